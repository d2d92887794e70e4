"""One query over fixed-size K/V buffers (slots past the position unwritten): the CUDA kernels
equal MLX's attention with the mask (there, and under the CPU emulation in
test_gemv_cuda_emulated.py); the reference is what the TTS backbone and the LLM's compiled decode
ran before."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.decode_attention import decode_attention, decode_attention_reference
from voicechat.kernels.gemv import on_cuda_gpu

ON_CUDA = on_cuda_gpu()


def _inputs(b, h, hk, cap, d, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((b, h, 1, d), key=k1), mx.random.normal((b, hk, cap, d), key=k2),
            mx.random.normal((b, hk, cap, d), key=k3))


def test_reference_is_the_formula():
    q, k, v = _inputs(1, 4, 2, 20, 8, seed=3)
    offset = 11
    qn, kn, vn = np.array(q), np.array(k), np.array(v)
    want = np.zeros((1, 4, 8))
    for h in range(4):
        scores = kn[0, h // 2, : offset + 1] @ qn[0, h, 0] * 8**-0.5
        p = np.exp(scores - scores.max())
        want[0, h] = (p / p.sum()) @ vn[0, h // 2, : offset + 1]
    got = decode_attention(q, k, v, mx.array(offset, mx.int32), 8**-0.5)
    np.testing.assert_allclose(np.array(got).reshape(1, 4, 8), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU")
@pytest.mark.parametrize("b,h,hk,cap,d", [(2, 16, 16, 256, 72), (2, 16, 16, 7500, 72), (1, 40, 8, 512, 128)])
@pytest.mark.parametrize("offset", [0, 200, 300, 9000])
def test_kernels_equal_the_reference(b, h, hk, cap, d, offset):
    q, k, v = _inputs(b, h, hk, cap, d, seed=offset)
    got = decode_attention(q, k, v, mx.array([offset], mx.int32), d**-0.5)
    with mx.stream(mx.cpu):
        want = np.array(decode_attention_reference(q, k, v, mx.array(offset, mx.int32), d**-0.5))
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)


def test_bad_arguments_are_refused():
    q, k, v = _inputs(1, 4, 3, 20, 8)
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        ext.decode_attention(q, k, v, mx.array([0], mx.int32), 1.0)
    q, k, v = _inputs(1, 4, 2, 20, 8)
    with pytest.raises(ValueError, match=r"\[B, H, 1, D\]"):
        ext.decode_attention(mx.concatenate([q, q], axis=2), k, v, mx.array([0], mx.int32), 1.0)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA stream"):
            ext.decode_attention(q, k, v, mx.array([0], mx.int32), 1.0)
