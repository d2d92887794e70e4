"""The sandwich-norm seam feeding a dense matvec (vc_dense_add_norm), run under the CPU emulation
(tests/cuda_emulation.py), equals the seam's reference then `@ w.T`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture, float_bits, normal
from voicechat.kernels.add_rms_norm import add_rms_norm_reference


def dense_add_norm_case(n, k, m, w_dtype, rows, threads, bias_dtype=None, seam=0):
    """seam 0: h + rms_norm(y) * post; 1: h + y; 2: h alone (y and post not read: NaN placeholders)."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(n + k), 4)
    h = mx.random.normal((m, k), key=k1)
    y = 3.0 * mx.random.normal((m, k), key=k2)
    post = 1.0 + 0.1 * mx.random.normal((k,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((k,), key=k4)
    w = (normal((n, k), mx.float32, seed=n) * k**-0.5).astype(w_dtype)
    bias = normal((n,), bias_dtype, seed=3) if bias_dtype else None
    args = dict(K=k, N=n, M=m, ROWS=rows, THREADS=threads, HAS_BIAS=bias is not None, SEAM=seam,
                EPS_BITS=float_bits(1e-6), TW=w_dtype, TB=bias_dtype or w_dtype, TO=mx.float32)
    unread = mx.full(h.shape, float("nan"))
    case = Case("vc_dense_add_norm", args, [h, unread if seam == 2 else y, unread[0] if seam else post, pre, w,
                                            bias if bias is not None else w],
                [("float", (m, n)), ("float", (m, k))], -(-n // rows), threads)
    with mx.stream(mx.cpu):
        if seam == 0:
            h2, z = add_rms_norm_reference(h, y, post, pre, 1e-6)
        else:
            h2 = h + y if seam == 1 else h
            z = mx.fast.rms_norm(h2, pre, 1e-6)
        out = z @ w.T.astype(mx.float32)
        out = out if bias is None else out + bias.astype(mx.float32)
    return case, (out, h2)


# the TTS's gate/up (2 rows, several steps), a bias and one row; the add without the norm; the norm alone
CASES = {"dense_add_norm_tts": lambda: dense_add_norm_case(20, 1152, 2, mx.bfloat16, 8, 160),
         "dense_add_norm_bias": lambda: dense_add_norm_case(24, 200, 1, mx.float32, 4, 32, mx.float32),
         "dense_add_plain": lambda: dense_add_norm_case(20, 1152, 2, mx.bfloat16, 8, 160, seam=1),
         "dense_norm_only": lambda: dense_add_norm_case(24, 200, 1, mx.float32, 4, 32, mx.float32, seam=2)}


emulated = emulation_fixture("dense_add_norm", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_add_norm_kernel_emulated(emulated, name):
    out, h2 = emulated.run(name)
    want_out, want_h2 = (np.array(a) for a in emulated.refs[name])
    np.testing.assert_allclose(h2, want_h2, rtol=2e-6, atol=2e-6 * np.abs(want_h2).max())
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5 * np.abs(want_out).max())
