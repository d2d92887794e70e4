"""The sandwich-norm seam feeding a dense matvec (vc_dense_add_norm), run under the CPU emulation
(tests/cuda_emulation.py), equals the seam's reference then `@ w.T`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture, float_bits, normal
from voicechat.kernels.add_rms_norm import add_rms_norm_reference


def dense_add_norm_case(n, k, m, w_dtype, rows, threads, bias_dtype=None, seam=0, sessions=1, session=None):
    """seam 0: h + rms_norm(y) * post; 1: h + y; 2: h alone (y and post not read: NaN placeholders).
    `sessions` groups of m rows in one launch; `session` i: that group launched alone."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(n + k), 4)
    h = mx.random.normal((sessions * m, k), key=k1)
    y = 3.0 * mx.random.normal((sessions * m, k), key=k2)
    if session is not None:
        h, y, sessions = h[session * m : (session + 1) * m], y[session * m : (session + 1) * m], 1
    m = sessions * m  # the launch's rows (M below is a session's)
    per = m // sessions
    post = 1.0 + 0.1 * mx.random.normal((k,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((k,), key=k4)
    w = (normal((n, k), mx.float32, seed=n) * k**-0.5).astype(w_dtype)
    bias = normal((n,), bias_dtype, seed=3) if bias_dtype else None
    args = dict(K=k, N=n, M=per, ROWS=rows, THREADS=threads, HAS_BIAS=bias is not None, SEAM=seam,
                EPS_BITS=float_bits(1e-6), TW=w_dtype, TB=bias_dtype or w_dtype, TO=mx.float32, SESSIONS=sessions)
    unread = mx.full(h.shape, float("nan"))
    case = Case("vc_dense_add_norm", args, [h, unread if seam == 2 else y, unread[0] if seam else post, pre, w,
                                            bias if bias is not None else w],
                [("float", (m, n)), ("float", (m, k))], sessions * -(-n // rows), threads)
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
# sessions' CFG pairs in one launch (a ragged last tile), and each session's pair alone
SESSION_SHAPES = {"sessions_seam": (dict(n=20, k=1152, m=2, w_dtype=mx.bfloat16, rows=8, threads=160), 3),
                  "sessions_plain_bias": (dict(n=13, k=200, m=1, w_dtype=mx.float32, rows=4, threads=32,
                                               bias_dtype=mx.float32, seam=1), 3)}
for _name, (_shape, _sessions) in SESSION_SHAPES.items():
    CASES[_name] = lambda shape=_shape, sessions=_sessions: dense_add_norm_case(**shape, sessions=sessions)
    for _i in range(_sessions):
        CASES[f"{_name}_alone{_i}"] = lambda shape=_shape, sessions=_sessions, i=_i: dense_add_norm_case(
            **shape, sessions=sessions, session=i)


emulated = emulation_fixture("dense_add_norm", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_add_norm_kernel_emulated(emulated, name):
    out, h2 = emulated.run(name)
    want_out, want_h2 = (np.array(a) for a in emulated.refs[name])
    np.testing.assert_allclose(h2, want_h2, rtol=2e-6, atol=2e-6 * np.abs(want_h2).max())
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5 * np.abs(want_out).max())


@pytest.mark.parametrize("name", list(SESSION_SHAPES))
def test_each_session_of_a_launch_has_the_bits_of_its_launch_alone(emulated, name):
    out, h2 = emulated.run(name)
    shape, sessions = SESSION_SHAPES[name]
    m = shape["m"]
    for i in range(sessions):
        out_i, h2_i = emulated.run(f"{name}_alone{i}")
        np.testing.assert_array_equal(out[i * m : (i + 1) * m].view(np.uint32), out_i.view(np.uint32))
        np.testing.assert_array_equal(h2[i * m : (i + 1) * m].view(np.uint32), h2_i.view(np.uint32))
