"""The block-layout quantized matvec (vc_qmv) and its emitting twin (vc_qmv_emit), run under the CPU
emulation (tests/cuda_emulation.py), equal MLX's `quantized_matmul` and the composed epilogues."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import (CUDA_TYPE, EPS_BITS, Case, assert_rounded_once, emulation_fixture, epilogue_ref, normal,
                            prenormed_inputs, promote, quantized)


def qmv_case(n, k, m, bits, group, x_dtype, s_dtype, rows, threads, bias_dtype=None, offset=0, epi=0):
    """vc_qmv with `threads` threads and `rows` rows a block. `epi` 1: + a residual, 2: squared ReLU."""
    w, s, b = quantized(n, k, bits, group, s_dtype, seed=n + k)
    x = normal((m, k), x_dtype)
    bias = normal((n,), bias_dtype, seed=3) if bias_dtype else None
    out = promote(x_dtype, s_dtype, bias_dtype or s_dtype)
    residual = normal((m, n), out, seed=5) if epi == 1 else s
    args = dict(BITS=bits, GROUP=group, K=k, N=n, M=m, ROWS=rows, THREADS=threads, EPI=epi,
                HAS_BIAS=bias is not None, TX=x_dtype, TS=s_dtype, TB=bias_dtype or s_dtype, TR=residual.dtype,
                TO=out, NORM=0, NP=0, NG=1, EPS_BITS=EPS_BITS, TN=s_dtype)
    inputs = [x, w, s, b, bias if bias is not None else s, residual, s]
    case = Case("vc_qmv", args, inputs, [(CUDA_TYPE[out], (m, n))], -(-n // rows), threads,
                [offset] + [0] * (len(inputs) - 1))
    with mx.stream(mx.cpu):
        ref = mx.quantized_matmul(x.astype(mx.float32), w, s, b, transpose=True, group_size=group, bits=bits)
        ref = epilogue_ref(ref if bias is None else ref + bias, epi, residual).astype(out)
    return case, ref


def prenormed_case(n, k, m, np_, ng, rows, threads, epi=0):
    """vc_qmv on an input its producer normalized (NORM 2): NG = 1 an RMSNorm, > 1 a group norm."""
    w, s, b = quantized(n, k, 4, 64, mx.bfloat16, seed=n + k)
    x, partials, normed = prenormed_inputs(k, m, np_, ng, mx.float32, seed=k)
    residual = normal((m, n), mx.float32, seed=5) if epi == 1 else s
    args = dict(BITS=4, GROUP=64, K=k, N=n, M=m, ROWS=rows, THREADS=threads, EPI=epi, HAS_BIAS=False,
                TX=mx.float32, TS=mx.bfloat16, TB=mx.bfloat16, TR=residual.dtype, TO=mx.float32, NORM=2, NP=np_,
                NG=ng, EPS_BITS=EPS_BITS, TN=mx.float32)
    case = Case("vc_qmv", args, [x, w, s, b, s, residual, partials], [("float", (m, n))], -(-n // rows), threads)
    with mx.stream(mx.cpu):
        ref = mx.quantized_matmul(normed, w, s, b, transpose=True, group_size=64, bits=4)
        ref = epilogue_ref(ref, epi, residual)
    return case, ref


def emit_case(n, k, m, rows, threads, x_dtype=mx.float32, np_=0, ng=1, next_dtype=mx.float32):
    """vc_qmv_emit: + residual, and the next norm's input (out * next_w, partial sums of out^2 a
    block); its own input plain, or normalized by its producer (np_ partials in ng groups)."""
    w, s, b = quantized(n, k, 4, 64, mx.bfloat16, seed=n + k)
    if np_:
        x, partials, normed = prenormed_inputs(k, m, np_, ng, x_dtype, seed=k)
        norm_in = [partials]
    else:
        x = normed = normal((m, k), x_dtype)
        norm_in = [s]
    residual = normal((m, n), mx.float32, seed=5)
    next_w = (1.0 + 0.2 * normal((n,), mx.float32, seed=11)).astype(next_dtype)
    blocks = -(-n // rows)
    args = dict(BITS=4, GROUP=64, K=k, N=n, M=m, ROWS=rows, THREADS=threads, HAS_BIAS=False, NORM=2 if np_ else 0,
                NP=np_, NG=ng, EPS_BITS=EPS_BITS, TX=x_dtype, TS=mx.bfloat16, TB=mx.bfloat16, TR=mx.float32,
                TN=mx.float32 if np_ else mx.bfloat16, TE=next_dtype, TO=mx.float32)
    case = Case("vc_qmv_emit", args, [x, w, s, b, s, residual, *norm_in, next_w],
                [("float", (m, n)), ("float", (m, n)), ("float", (m, blocks))], blocks, threads)
    with mx.stream(mx.cpu):
        out = mx.quantized_matmul(normed.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
        out = out + residual
        ref = (out, out * next_w.astype(mx.float32), mx.square(out).reshape(m, blocks, -1).sum(-1) if n % rows == 0
               else mx.sum(mx.square(out), -1, keepdims=True))
    return case, ref


CASES = {
    # tail rows past N, one step of K a thread at the LLM's K, two steps, 8-bit with a bias, unaligned x
    "q4_f32_m2_tail": lambda: qmv_case(37, 640, 2, 4, 64, mx.float32, mx.bfloat16, 4, 32),
    "q4_bf16_4480": lambda: qmv_case(10, 4480, 1, 4, 64, mx.bfloat16, mx.bfloat16, 4, 160),
    "q4_two_steps": lambda: qmv_case(9, 4480, 2, 4, 64, mx.float32, mx.bfloat16, 2, 64),
    "q8_g32_f16_bias": lambda: qmv_case(9, 384, 2, 8, 32, mx.float16, mx.float16, 8, 32, bias_dtype=mx.float32),
    "q4_g128_unaligned": lambda: qmv_case(5, 1024, 1, 4, 128, mx.float32, mx.float32, 2, 64, offset=1),
    "q8_bf16_unaligned": lambda: qmv_case(6, 256, 2, 8, 64, mx.bfloat16, mx.bfloat16, 1, 32, offset=3),
    # epilogues: + residual, squared ReLU after a bias
    "q4_residual_m2": lambda: qmv_case(37, 640, 2, 4, 64, mx.float32, mx.bfloat16, 4, 32, epi=1),
    "q4_relu2_bias": lambda: qmv_case(21, 4480, 1, 4, 64, mx.float32, mx.bfloat16, 4, 160, mx.float32, epi=2),
    # inputs normalized by their producer: an RMSNorm (in_proj's K, two rows, a block's worth of
    # partials and more; 4 rows of one step, 8 of two), a group norm (chunks of 4 groups, two steps)
    "q4_prenormed_rms_m2": lambda: prenormed_case(19, 4480, 2, 300, 1, 8, 160),
    "q4_prenormed_rms_relu2": lambda: prenormed_case(21, 640, 1, 7, 1, 4, 32, epi=2),
    "q4_prenormed_groups": lambda: prenormed_case(13, 1280, 2, 12, 4, 4, 32, epi=1),
    "q4_prenormed_rms_4rows": lambda: prenormed_case(19, 4480, 1, 300, 1, 4, 160),
    "q4_prenormed_rms_two_steps": lambda: prenormed_case(19, 4480, 1, 300, 1, 8, 96),
}
# the matvec that emits the next norm's input: two rows, a tail block past N; a group-norm input, as
# the mamba out_proj launches it (8 groups, one step a thread: 320 threads over K = 10240); bfloat16 x
# and next-norm weight
EMIT_CASES = {
    "emit_m2": lambda: emit_case(37, 640, 2, 4, 32),
    "emit_tail": lambda: emit_case(10, 4480, 1, 8, 160),
    "emit_prenormed_groups": lambda: emit_case(16, 1280, 1, 8, 32, np_=20, ng=4),
    "emit_prenormed_groups_one_step": lambda: emit_case(16, 10240, 1, 8, 320, np_=640, ng=8),
    "emit_bf16": lambda: emit_case(12, 256, 2, 4, 32, mx.bfloat16, next_dtype=mx.bfloat16),
}


emulated = emulation_fixture("qmv", {**CASES, **EMIT_CASES})


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_matvec_emulated(emulated, name):
    assert_rounded_once(emulated, name)


@pytest.mark.parametrize("name", list(EMIT_CASES))
def test_emit_norm_kernel_emulated(emulated, name):
    """out = product + residual, normed = out * next_w, and the block partials sum to sum(out^2)."""
    out, normed, partials = emulated.run(name)
    out_ref, normed_ref, partials_ref = (np.array(r) for r in emulated.refs[name])
    np.testing.assert_allclose(out, out_ref, rtol=2e-5, atol=2e-5 * np.abs(out_ref).max())
    np.testing.assert_allclose(normed, normed_ref, rtol=2e-5, atol=2e-5 * np.abs(normed_ref).max())
    # each block's partial: its own rows when N divides evenly, else compare the row totals
    if partials_ref.shape == partials.shape:
        np.testing.assert_allclose(partials, partials_ref, rtol=2e-5)
    np.testing.assert_allclose(partials.sum(-1), partials_ref.sum(-1), rtol=2e-5)
