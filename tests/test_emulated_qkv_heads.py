"""The TTS head norms + RoPE + layout (vc_qkv_heads), run under the CPU emulation
(tests/cuda_emulation.py), equal its reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture, float_bits
from voicechat.kernels.qkv_heads import qkv_heads_reference, rope_inv_freq


def qkv_heads_case(b, t, hq, hk, d, offset, base, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(hq + d + t), 3)
    qkv = (2.0 * mx.random.normal((b, t, (hq + 2 * hk) * d), key=k1)).astype(dtype)
    q_scale = 1.0 + 0.1 * mx.random.normal((d,), key=k2)
    k_scale = 1.0 + 0.1 * mx.random.normal((d,), key=k3)
    inv_freq = rope_inv_freq(d, base)
    args = dict(B=b, HQ=hq, HK=hk, D=d, T=t, WARPS=4, TX=dtype, EPS_BITS=float_bits(1e-6))
    items = b * t * (hq + 2 * hk)
    case = Case("vc_qkv_heads", args, [qkv, q_scale, k_scale, inv_freq, mx.array([offset], mx.int32)],
                [("float", (b, hq, t, d)), ("float", (b, hk, t, d)), ("float", (b, hk, t, d))], -(-items // 4), 128)
    with mx.stream(mx.cpu):
        ref = qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, hq, hk, 1e-6)
    return case, ref


# a CFG step late in a conversation, the warmup, grouped heads with D > 64 in bfloat16
CASES = {"qkv_step": lambda: qkv_heads_case(2, 1, 16, 16, 72, 300, 1e4),
         "qkv_warmup": lambda: qkv_heads_case(2, 37, 16, 16, 72, 0, 1e6),
         "qkv_grouped_bf16": lambda: qkv_heads_case(1, 3, 4, 2, 80, 5, 1e4, mx.bfloat16)}


emulated = emulation_fixture("qkv_heads", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_qkv_heads_kernel_emulated(emulated, name):
    for got, want in zip(emulated.run(name), emulated.refs[name]):
        want = np.array(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
