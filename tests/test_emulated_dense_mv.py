"""The dense matvec (vc_dense_mv), run under the CPU emulation (tests/cuda_emulation.py), equals
`x @ w.T` with its epilogues and its gated-GELU input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import CUDA_TYPE, Case, assert_rounded_once, emulation_fixture, epilogue_ref, normal, promote
from voicechat.kernels.gemv import gelu_gate


def dense_case(n, k, m, x_dtype, w_dtype, rows, threads, bias_dtype=None, offset=0, epi=0, pro=0, sessions=1,
               session=None):
    """`sessions` groups of m rows in one launch; `session` i: that group's rows alone (S = 1)."""
    w = (normal((n, k), mx.float32, seed=n) * k**-0.5).astype(w_dtype)
    x = normal((sessions * m, 2 * k if pro else k), x_dtype)
    bias = normal((n,), bias_dtype, seed=3) if bias_dtype else None
    out = promote(x_dtype, w_dtype, bias_dtype or w_dtype)
    residual = normal((sessions * m, n), out, seed=5) if epi == 1 else w
    if session is not None:
        x = x[session * m : (session + 1) * m]
        residual = residual[session * m : (session + 1) * m] if epi == 1 else w
        sessions = 1
    args = dict(K=k, N=n, M=m, ROWS=rows, THREADS=threads, EPI=epi, PRO=pro, HAS_BIAS=bias is not None,
                SESSIONS=sessions, TX=x_dtype, TW=w_dtype, TB=bias_dtype or w_dtype, TR=residual.dtype, TO=out)
    case = Case("vc_dense_mv", args, [x, w, bias if bias is not None else w, residual],
                [(CUDA_TYPE[out], (sessions * m, n))], sessions * -(-n // rows), threads, [offset, 0, 0, 0])
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
# Sessions in one launch (each its CFG pair), and each session's rows launched alone: a ragged last
# tile (N % ROWS), + residual, the gated-GELU input, one row a session.
SESSION_SHAPES = {
    "sessions_residual": (dict(n=7, k=1152, m=2, x_dtype=mx.float32, w_dtype=mx.bfloat16, rows=4, threads=160,
                               bias_dtype=mx.bfloat16, epi=1), 3),
    "sessions_gelu_gate": (dict(n=9, k=320, m=2, x_dtype=mx.float32, w_dtype=mx.bfloat16, rows=2, threads=64,
                                pro=1), 4),
    "sessions_one_row": (dict(n=5, k=136, m=1, x_dtype=mx.bfloat16, w_dtype=mx.float16, rows=8, threads=32), 3),
}
for _name, (_shape, _sessions) in SESSION_SHAPES.items():
    CASES[_name] = lambda shape=_shape, sessions=_sessions: dense_case(**shape, sessions=sessions)
    for _i in range(_sessions):
        CASES[f"{_name}_alone{_i}"] = lambda shape=_shape, sessions=_sessions, i=_i: dense_case(
            **shape, sessions=sessions, session=i)


emulated = emulation_fixture("dense_mv", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_matvec_emulated(emulated, name):
    assert_rounded_once(emulated, name)


@pytest.mark.parametrize("name", list(SESSION_SHAPES))
def test_each_session_of_a_launch_has_the_bits_of_its_launch_alone(emulated, name):
    (together,) = emulated.run(name)
    sessions = SESSION_SHAPES[name][1]
    m = SESSION_SHAPES[name][0]["m"]
    for i in range(sessions):
        (alone,) = emulated.run(f"{name}_alone{i}")
        np.testing.assert_array_equal(together[i * m : (i + 1) * m].view(np.uint8), alone.view(np.uint8))
