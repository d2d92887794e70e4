"""The dense matvec (vc_dense_mv), run under the CPU emulation (tests/cuda_emulation.py), equals
`x @ w.T` with its epilogues and its gated-GELU input."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cuda_emulation import CUDA_TYPE, Case, assert_rounded_once, emulation_fixture, epilogue_ref, normal, promote
from voicechat.kernels.gemv import gelu_gate


def dense_case(n, k, m, x_dtype, w_dtype, rows, threads, bias_dtype=None, offset=0, epi=0, pro=0):
    w = (normal((n, k), mx.float32, seed=n) * k**-0.5).astype(w_dtype)
    x = normal((m, 2 * k if pro else k), x_dtype)
    bias = normal((n,), bias_dtype, seed=3) if bias_dtype else None
    out = promote(x_dtype, w_dtype, bias_dtype or w_dtype)
    residual = normal((m, n), out, seed=5) if epi == 1 else w
    args = dict(K=k, N=n, M=m, ROWS=rows, THREADS=threads, EPI=epi, PRO=pro, HAS_BIAS=bias is not None, TX=x_dtype,
                TW=w_dtype, TB=bias_dtype or w_dtype, TR=residual.dtype, TO=out)
    case = Case("vc_dense_mv", args, [x, w, bias if bias is not None else w, residual], [(CUDA_TYPE[out], (m, n))],
                -(-n // rows), threads, [offset, 0, 0, 0])
    with mx.stream(mx.cpu):
        xf = x.astype(mx.float32)
        ref = (gelu_gate(xf) if pro else xf) @ w.T.astype(mx.float32)
        ref = epilogue_ref(ref if bias is None else ref + bias, epi, residual).astype(out)
    return case, ref


CASES = {
    # a bias, float32 weights with unaligned bfloat16 x, 8 rows a block, several steps of K a thread
    "dense_bf16w_bias": lambda: dense_case(7, 1152, 2, mx.float32, mx.bfloat16, 4, 160, bias_dtype=mx.bfloat16),
    "dense_f32w_unaligned": lambda: dense_case(3, 40, 1, mx.bfloat16, mx.float32, 1, 32, offset=1),
    "dense_f16_rows8": lambda: dense_case(20, 136, 2, mx.float16, mx.float16, 8, 64),
    "dense_two_steps": lambda: dense_case(5, 4608, 1, mx.float32, mx.bfloat16, 2, 192),
    # + residual after a bias; the gated-GELU input (the TTS MLP's down_proj on gate / up)
    "dense_residual_bias": lambda: dense_case(7, 1152, 2, mx.float32, mx.bfloat16, 4, 160, mx.bfloat16, epi=1),
    "dense_relu2": lambda: dense_case(13, 256, 2, mx.float32, mx.bfloat16, 2, 32, epi=2),
    "dense_gelu_gate": lambda: dense_case(9, 4608, 2, mx.float32, mx.bfloat16, 4, 192, pro=1),
    "dense_gelu_gate_bf16x_bias": lambda: dense_case(5, 200, 1, mx.bfloat16, mx.bfloat16, 2, 32, mx.float32, pro=1),
}


emulated = emulation_fixture("dense_mv", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_matvec_emulated(emulated, name):
    assert_rounded_once(emulated, name)
