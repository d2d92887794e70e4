"""The sandwich-norm seam `(h + rms_norm(y) * post, rms_norm(...) * pre)`: the extension (CUDA
kernel, or MLX ops elsewhere) equals the pure-MLX reference; the kernel's own text also runs
under the CPU emulation (test_gemv_cuda_emulated.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.add_rms_norm import (add_rms_norm, add_rms_norm_guided, add_rms_norm_guided_reference,
                                             add_rms_norm_reference)
from voicechat.kernels.gemv import on_cuda_gpu

ON_CUDA = on_cuda_gpu()


def _inputs(lead, c, seed=0):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    h = mx.random.normal((*lead, c), key=k1)
    y = 3.0 * mx.random.normal((*lead, c), key=k2)
    post = 1.0 + 0.1 * mx.random.normal((c,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((c,), key=k4)
    return h, y, post, pre


@pytest.mark.parametrize("y_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("lead,c", [((2, 1), 1152), ((1, 40), 1152), ((3,), 100), ((1, 1), 8)])
def test_extension_equals_reference(lead, c, y_dtype):
    h, y, post, pre = _inputs(lead, c)
    y = y.astype(y_dtype)
    got_h, got_z = ext.add_rms_norm(h, y, post, pre, 1e-6)
    with mx.stream(mx.cpu):
        want_h, want_z = add_rms_norm_reference(h, y.astype(mx.float32), post, pre, 1e-6)
    assert got_h.shape == h.shape and got_z.dtype == mx.float32
    for got, want in ((got_h, want_h), (got_z, want_z)):  # sums that cancel: atol by scale
        want = np.array(want)
        np.testing.assert_allclose(np.array(got), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_reference_is_the_formula():
    """Independent numpy in float64."""
    h, y, post, pre = _inputs((2, 3), 16, seed=5)
    hn, yn, pn, qn = (np.array(a, np.float64) for a in (h, y, post, pre))
    norm = lambda x: x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)  # noqa: E731
    want_h = hn + norm(yn) * pn
    got_h, got_z = add_rms_norm(h, y, post, pre, 1e-6)
    np.testing.assert_allclose(np.array(got_h), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(got_z), norm(want_h) * qn, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c,guidance", [(1152, 0.2), (100, 1.5), (8, 0.0)])
def test_guided_seam_equals_reference(c, guidance):
    """The MoG head's last seam over the CFG pair, then `cond + g * (cond - uncond)`: one launch on
    CUDA, MLX ops elsewhere; against the seam then the guidance, and the formula in numpy."""
    h, y, post, pre = _inputs((2, 1), c, seed=c)
    got = ext.add_rms_norm_guided(h, y, post, pre, 1e-6, guidance)
    if ON_CUDA:  # counted before anything evaluates it
        from voicechat.llm.opcount import count_ops, custom_kernels

        assert custom_kernels(count_ops(got)) == 1
    with mx.stream(mx.cpu):
        want = add_rms_norm_guided_reference(h, y, post, pre, 1e-6, guidance)
        mx.eval(want)
    assert got.shape == (1, 1, c) and got.dtype == mx.float32
    want = np.array(want)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    np.testing.assert_allclose(np.array(add_rms_norm_guided(h, y, post, pre, 1e-6, guidance)), want,
                               rtol=2e-6, atol=2e-6 * np.abs(want).max())
    hn, yn, pn, qn = (np.array(a, np.float64) for a in (h, y, post, pre))
    norm = lambda x: x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)  # noqa: E731
    z = norm(hn + norm(yn) * pn) * qn
    np.testing.assert_allclose(want, z[:1] + guidance * (z[:1] - z[1:]), rtol=1e-5, atol=1e-5)


def test_sessions_guided_pairs_have_the_bits_of_each_pair_alone():
    """Three sessions' CFG pairs `[6, 1, C]` in one call (one launch on CUDA) -> `[3, 1, C]`: each
    session's guided row, bit for bit, its own pair's (the C++ op and the Python face)."""
    h, y, post, pre = _inputs((6, 1), 1152, seed=31)
    for op in (ext.add_rms_norm_guided, add_rms_norm_guided):
        together = op(h, y, post, pre, 1e-6, 0.2)
        assert together.shape == (3, 1, 1152)
        for i in range(3):
            alone = op(h[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2], post, pre, 1e-6, 0.2)
            np.testing.assert_array_equal(np.array(together[i : i + 1]), np.array(alone))


def test_guided_seam_needs_the_cfg_pair():
    h, y, post, pre = _inputs((3, 1), 12)
    with pytest.raises(ValueError, match="CFG pair"):
        ext.add_rms_norm_guided(h, y, post, pre, 1e-6, 0.2)


def test_bad_arguments_are_refused():
    h, y, post, pre = _inputs((2,), 12)
    with pytest.raises(ValueError, match="one shape"):
        ext.add_rms_norm(h, y[:, :6], post, pre, 1e-6)
    with pytest.raises(ValueError, match="post and pre"):
        ext.add_rms_norm(h, y, post[:6], pre, 1e-6)


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernel runs on a CUDA GPU")
def test_the_kernel_runs_on_cuda_as_one_launch():
    from voicechat.llm.opcount import count_ops, custom_kernels

    h, y, post, pre = _inputs((2, 1), 1152)
    mx.eval(h, y, post, pre)
    counts = count_ops(*add_rms_norm(h, y, post, pre, 1e-6))
    assert custom_kernels(counts) == 1 and "RMSNorm" not in counts


@pytest.mark.parametrize("rows,bias", [(2, False), (1, True), (5, False)])
def test_seam_with_the_next_projection_equals_the_seam_then_the_layer(rows, bias):
    """`add_rms_norm_linear`: one launch with our dense GEMV on CUDA (1-2 rows), the seam then the
    layer otherwise; the same numbers either way."""
    import mlx.nn as nn

    from voicechat.kernels.add_rms_norm import add_rms_norm_linear
    from voicechat.kernels.gemv import use_gemv

    h, y, post, pre = _inputs((rows, 1), 1152, seed=rows)
    layer = use_gemv(nn.Linear(1152, 96, bias=bias))
    layer.set_dtype(mx.bfloat16)
    got_h, got = add_rms_norm_linear(h, y, post, pre, 1e-6, layer)
    with mx.stream(mx.cpu):
        want_h, z = add_rms_norm_reference(h, y, post, pre, 1e-6)
        w = layer.weight.astype(mx.float32)
        want = z @ w.T + (layer.bias.astype(mx.float32) if bias else 0.0)
        want_h, want = np.array(want_h), np.array(want)
    assert got.shape == (rows, 1, 96) and got_h.shape == h.shape
    np.testing.assert_allclose(np.array(got_h), want_h, rtol=2e-6, atol=2e-6 * np.abs(want_h).max())
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows,bias,with_add", [(2, False, True), (2, False, False), (1, True, True), (5, False, True)])
def test_input_norm_with_the_projection_equals_the_norm_then_the_layer(rows, bias, with_add):
    """`add_rms_norm_linear` without post: `h' = h + add` (or `h`), then the input norm and the layer;
    one launch with our dense GEMV on CUDA (1-2 rows), MLX ops otherwise; the same numbers either way."""
    import mlx.nn as nn

    from voicechat.kernels.add_rms_norm import add_rms_norm_linear
    from voicechat.kernels.gemv import use_gemv

    h, add, _, pre = _inputs((rows, 1), 1152, seed=rows + 7)
    layer = use_gemv(nn.Linear(1152, 96, bias=bias))
    layer.set_dtype(mx.bfloat16)
    got_h, got = add_rms_norm_linear(h, add if with_add else None, None, pre, 1e-6, layer)
    if ON_CUDA and rows <= 2:  # counted before anything evaluates it
        from voicechat.llm.opcount import count_ops, custom_kernels

        counts = count_ops(got)
        assert custom_kernels(counts) == 1 and "RMSNorm" not in counts
    with mx.stream(mx.cpu):
        want_h = h + add if with_add else h
        w = layer.weight.astype(mx.float32)
        want = mx.fast.rms_norm(want_h, pre, 1e-6) @ w.T + (layer.bias.astype(mx.float32) if bias else 0.0)
        want_h, want = np.array(want_h), np.array(want)
    assert got.shape == (rows, 1, 96) and got_h.shape == h.shape
    np.testing.assert_allclose(np.array(got_h), want_h, rtol=2e-6, atol=2e-6 * np.abs(want_h).max())
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("with_y,post", [(True, True), (True, False), (False, False)])
def test_sessions_of_the_seam_and_projection_have_the_bits_of_each_alone(with_y, post):
    """`add_rms_norm_linear(..., sessions=3)`: three sessions' CFG pairs in one call (one launch on
    CUDA); each session's h' and output, bit for bit, its own call's."""
    import mlx.nn as nn

    from voicechat.kernels.add_rms_norm import add_rms_norm_linear
    from voicechat.kernels.gemv import use_gemv

    h, y, p, pre = _inputs((6, 1), 1152, seed=21)
    layer = use_gemv(nn.Linear(1152, 96, bias=False))
    layer.set_dtype(mx.bfloat16)
    y, p = (y if with_y else None), (p if post else None)
    got_h, got = add_rms_norm_linear(h, y, p, pre, 1e-6, layer, sessions=3)
    for i in range(3):
        part = slice(2 * i, 2 * i + 2)
        want_h, want = add_rms_norm_linear(h[part], None if y is None else y[part], p, pre, 1e-6, layer)
        np.testing.assert_array_equal(np.array(got_h[part]), np.array(want_h))
        np.testing.assert_array_equal(np.array(got[part]), np.array(want))


def test_seam_matvec_refuses_bad_shapes():
    h, y, post, pre = _inputs((2,), 64)
    with pytest.raises(ValueError, match="alike"):
        ext.dense_add_norm_matvec(h, y[:, :32], post, pre, 1e-6, mx.zeros((8, 64)))
    with pytest.raises(ValueError, match="post and pre"):
        ext.dense_add_norm_matvec(h, y, post[:8], pre, 1e-6, mx.zeros((8, 64)))
    with pytest.raises(ValueError, match="bias"):
        ext.dense_add_norm_matvec(h, y, post, pre, 1e-6, mx.zeros((8, 64)), mx.zeros((3,)))
    with pytest.raises(ValueError, match="not 3 equal groups"):
        ext.dense_add_norm_matvec(h, y, post, pre, 1e-6, mx.zeros((8, 64)), sessions=3)
    with pytest.raises(ValueError, match="post needs y"):
        ext.dense_add_norm_matvec(h, None, post, pre, 1e-6, mx.zeros((8, 64)))
