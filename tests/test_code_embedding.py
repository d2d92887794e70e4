"""One frame's code embedding (depth sum of the chosen codewords, then `embed_code`): the C++ op (a
CUDA launch on a CUDA GPU, MLX ops elsewhere) equals its pure-MLX reference."""

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.code_embedding import code_embedding, code_embedding_reference


def _case(q, k, d, h, dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 3)
    books = mx.random.normal((q, k, d), key=keys[0])
    table = mx.concatenate([books, mx.zeros((q, 1, d))], axis=1).reshape(q * (k + 1), d)
    # every value from 0 to K (the mask code, a zero row) among the codes
    code = mx.random.randint(0, k + 1, (1, q), key=keys[1]).astype(mx.int32)
    code = mx.concatenate([code[:, :-2], mx.array([[0, k]], mx.int32)], axis=1)
    weight = (0.1 * mx.random.normal((h, d), key=keys[2])).astype(dtype)
    return code, table, weight


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("q,k,d,h", [(31, 1024, 512, 1152), (5, 8, 24, 70)])
def test_op_equals_reference(dtype, rows, q, k, d, h):
    code, table, weight = _case(q, k, d, h, dtype, seed=q + rows)
    got = ext.code_embedding(code, table, weight, rows)
    with mx.stream(mx.cpu):  # float32 exactly (a GPU matmul may round through TF32)
        want = code_embedding_reference(code, table, weight, rows)
        mx.eval(want)
    assert got.shape == (rows, 1, h) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(code_embedding(code, table, weight, rows)), np.array(want),
                               rtol=1e-5, atol=1e-4)


def test_reference_is_the_depth_sum_times_the_weight():
    # The formula itself, in numpy: the mask code K adds nothing.
    code, table, weight = _case(5, 8, 24, 70, mx.float32, seed=3)
    t, c = np.array(table), np.array(code)[0]
    depth = sum(t[i * 9 + c[i]] for i in range(5))
    want = np.broadcast_to(np.array(weight) @ depth, (2, 1, 70))
    np.testing.assert_allclose(np.array(code_embedding_reference(code, table, weight, 2)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q,k,d,h", [(31, 1024, 512, 1152), (5, 8, 24, 70)])
def test_sessions_in_one_call_have_the_bits_of_each_alone(q, k, d, h):
    """Three sessions' frames (`sessions=3`, each its CFG pair): each session's rows, bit for bit, its
    own call's, in the C++ op (the kernel on a GPU, composed ops elsewhere) and the Python face."""
    frames = [_case(q, k, d, h, mx.bfloat16, seed=s) for s in (7, 8, 9)]
    table, weight = frames[0][1], frames[0][2]
    codes = mx.concatenate([f[0] for f in frames])
    for op in (lambda c, **kw: ext.code_embedding(c, table, weight, 2, **kw),
               lambda c, **kw: code_embedding(c, table, weight, 2, **kw)):
        together = op(codes, sessions=3)
        assert together.shape == (6, 1, h)
        for i, f in enumerate(frames):
            np.testing.assert_array_equal(np.array(together[2 * i : 2 * i + 2]), np.array(op(f[0])))


def test_bad_arguments_are_errors():
    code, table, weight = _case(5, 8, 24, 70, mx.float32, seed=4)
    with pytest.raises(ValueError, match="integer"):
        ext.code_embedding(code.astype(mx.float32), table, weight)
    with pytest.raises(ValueError, match="table"):
        ext.code_embedding(code, table[:-1], weight)
    with pytest.raises(ValueError, match="weight"):
        ext.code_embedding(code, table, weight[:, :-1])
    with pytest.raises(ValueError, match="rows"):
        ext.code_embedding(code, table, weight, 0)
    with pytest.raises(ValueError, match="a session"):
        ext.code_embedding(code, table, weight, 2, sessions=2)
