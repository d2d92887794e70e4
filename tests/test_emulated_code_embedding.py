"""One frame's code embedding (vc_code_embedding), run under the CPU emulation
(tests/cuda_emulation.py), equals its reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import Case, emulation_fixture
from voicechat.kernels.code_embedding import code_embedding_reference


def code_embedding_case(q, k, d, h, rows, w_dtype, sessions=1, session=None):
    """`sessions` frames in one launch; `session` i: that frame launched alone."""
    keys = mx.random.split(mx.random.key(q + d + rows), 3)
    table = mx.concatenate([mx.random.normal((q, k, d), key=keys[0]), mx.zeros((q, 1, d))], axis=1)
    table = table.reshape(q * (k + 1), d)
    code = mx.concatenate([mx.random.randint(0, k, (sessions, q - 1), key=keys[1]),
                           mx.full((sessions, 1), k)], axis=1)
    code = code.astype(mx.int32)  # the last one the mask code (a zero row)
    if session is not None:
        code, sessions = code[session : session + 1], 1
    weight = (0.2 * mx.random.normal((h, d), key=keys[2])).astype(w_dtype)
    per_block = (256 // 32) * 4  # output rows a block: 8 warps of 4
    args = dict(D=d, H=h, Q=q, KP=k + 1, B=rows, ROWS=4, THREADS=256, TW=w_dtype, SESSIONS=sessions)
    case = Case("vc_code_embedding", args, [code, table, weight], [("float", (sessions * rows, 1, h))],
                sessions * -(-h // per_block), 256)
    with mx.stream(mx.cpu):
        ref = mx.concatenate([code_embedding_reference(code[i], table, weight, rows) for i in range(sessions)])
    return case, ref


# a tail block past H, D no multiple of 32; for the CFG pair with bfloat16 weights, and one row
CASES = {"code_embedding_b2_bf16": lambda: code_embedding_case(5, 8, 40, 70, 2, mx.bfloat16),
         "code_embedding_one_row": lambda: code_embedding_case(7, 6, 24, 33, 1, mx.float32),
         # three sessions' frames in one launch (each its CFG pair), and each launched alone
         "code_embedding_sessions": lambda: code_embedding_case(5, 8, 40, 70, 2, mx.bfloat16, sessions=3)}
for _i in range(3):
    CASES[f"code_embedding_sessions_alone{_i}"] = lambda i=_i: code_embedding_case(5, 8, 40, 70, 2, mx.bfloat16,
                                                                                  sessions=3, session=i)


emulated = emulation_fixture("code_embedding", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_code_embedding_kernel_emulated(emulated, name):
    (got,) = emulated.run(name)
    np.testing.assert_allclose(got, np.array(emulated.refs[name]), rtol=1e-5, atol=1e-5)


def test_each_session_of_a_launch_has_the_bits_of_its_launch_alone(emulated):
    (together,) = emulated.run("code_embedding_sessions")
    for i in range(3):
        (alone,) = emulated.run(f"code_embedding_sessions_alone{i}")
        np.testing.assert_array_equal(together[2 * i : 2 * i + 2].view(np.uint32), alone.view(np.uint32))
    assert not np.array_equal(together[0], together[2])  # (the sessions' frames differ)
