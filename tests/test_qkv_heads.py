"""The TTS attention's head preparation (per-head RMSNorm of q and k, rotate-half RoPE, the
[B, heads, T, D] layout) from the stacked q/k/v projection: the CUDA kernel equals the pure-MLX
reference (there), the reference equals the backbone's composed path (MLX's rms_norm and
fast.rope) everywhere; the kernel's own text also runs under the CPU emulation
(test_gemv_cuda_emulated.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.gemv import on_cuda_gpu
from voicechat.kernels.qkv_heads import qkv_heads, qkv_heads_reference, rope_inv_freq

ON_CUDA = on_cuda_gpu()


def _inputs(b, t, hq, hk, d, seed=0, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    qkv = (2.0 * mx.random.normal((b, t, (hq + 2 * hk) * d), key=k1)).astype(dtype)
    return qkv, 1.0 + 0.1 * mx.random.normal((d,), key=k2), 1.0 + 0.1 * mx.random.normal((d,), key=k3)


def _composed(qkv, q_scale, k_scale, base, offset, hq, hk, eps):
    """What the backbone runs without the kernel: split, per-head norms, mx.fast.rope."""
    b, t, _ = qkv.shape
    d = q_scale.shape[0]
    q, k, v = mx.split(qkv.astype(mx.float32), [hq * d, (hq + hk) * d], axis=-1)
    q = mx.fast.rms_norm(q.reshape(b, t, hq, d), q_scale, eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(k.reshape(b, t, hk, d), k_scale, eps).transpose(0, 2, 1, 3)
    rope = dict(traditional=False, base=base, scale=1.0, offset=offset)
    return mx.fast.rope(q, d, **rope), mx.fast.rope(k, d, **rope), v.reshape(b, t, hk, d).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("b,t,hq,hk,d,offset,base", [(2, 1, 16, 16, 72, 0, 1e4), (2, 1, 16, 16, 72, 200, 1e6),
                                                     (2, 37, 16, 16, 72, 0, 1e4), (1, 3, 4, 2, 80, 9, 1e4)])
def test_reference_equals_the_composed_path(b, t, hq, hk, d, offset, base):
    qkv, qs, ks = _inputs(b, t, hq, hk, d)
    got = qkv_heads_reference(qkv, qs, ks, rope_inv_freq(d, base), offset, hq, hk, 1e-6)
    want = _composed(qkv, qs, ks, base, offset, hq, hk, 1e-6)
    # The angles round differently (position * inv_freq here, MLX's own in fast.rope): float32
    # angles near 200 carry ~1e-5 of rounding.
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == mx.float32
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("b,t,hq,hk,d,offset", [(2, 1, 16, 16, 72, 0), (2, 1, 16, 16, 72, 4000),
                                                (2, 37, 16, 16, 72, 0), (1, 3, 4, 2, 80, 9)])
def test_kernel_equals_reference(b, t, hq, hk, d, offset, dtype):
    qkv, qs, ks = _inputs(b, t, hq, hk, d, dtype=dtype)
    inv_freq = rope_inv_freq(d, 1e4)
    got = qkv_heads(qkv, qs, ks, inv_freq, mx.array(offset, mx.int32), hq, hk, 1e-6)
    with mx.stream(mx.cpu):
        want = qkv_heads_reference(qkv, qs, ks, inv_freq, offset, hq, hk, 1e-6)
        want = [np.array(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
def test_the_kernel_is_one_launch():
    from voicechat.llm.opcount import count_ops, custom_kernels

    qkv, qs, ks = _inputs(2, 1, 16, 16, 72)
    inv_freq = rope_inv_freq(72, 1e4)
    mx.eval(qkv, qs, ks, inv_freq)
    counts = count_ops(*qkv_heads(qkv, qs, ks, inv_freq, mx.array(5, mx.int32), 16, 16, 1e-6))
    assert custom_kernels(counts) == 1 and "RMSNorm" not in counts and "RoPE" not in counts


def test_bad_arguments_are_refused():
    qkv, qs, ks = _inputs(2, 1, 4, 2, 8)
    inv_freq, offset = rope_inv_freq(8, 1e4), mx.array(0, mx.int32)
    with pytest.raises(ValueError, match="does not match heads"):
        ext.qkv_heads(qkv, qs, ks, inv_freq, offset, 4, 3, 2, 1e-6)
    with pytest.raises(ValueError, match="inv_freq"):
        ext.qkv_heads(qkv, qs, ks, inv_freq[:3], offset, 4, 2, 2, 1e-6)
    with pytest.raises(ValueError, match="multiple of batch"):
        ext.qkv_heads(qkv, qs, ks, inv_freq, offset, 4, 2, 3, 1e-6)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="CUDA stream"):
            ext.qkv_heads(qkv, qs, ks, inv_freq, offset, 4, 2, 2, 1e-6)
