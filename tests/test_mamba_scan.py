"""The fused Mamba-2 scan (C++ kernel) equals its pure-MLX reference, and the reference is a scan."""

import math

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.causal_conv import causal_conv_silu_reference
from voicechat.kernels.gated_rms_norm import gated_rms_norm_reference
from voicechat.kernels.gemv import on_cuda_gpu
from voicechat.kernels.mamba_scan import (mamba_conv_scan_step, mamba_scan, mamba_scan_packed,
                                         mamba_scan_packed_reference, mamba_scan_reference)


def _case(b, L, H, P, G, N, dtype, seed, with_state=True):
    keys = iter(mx.random.split(mx.random.key(seed), 9))
    x = mx.random.normal((b, L, H, P), key=next(keys)).astype(dtype)
    dt = (mx.random.normal((b, L, H), key=next(keys)) * 2.0).astype(dtype)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,), key=next(keys)))
    B = mx.random.normal((b, L, G, N), key=next(keys)).astype(dtype)
    C = mx.random.normal((b, L, G, N), key=next(keys)).astype(dtype)
    D = (1.0 + 0.1 * mx.random.normal((H,), key=next(keys))).astype(dtype)
    dt_bias = mx.random.uniform(-6.0, -2.0, (H,), key=next(keys)).astype(dtype)
    state = mx.random.normal((b, H, P, N), key=next(keys)) if with_state else None
    return x, dt, A_log, B, C, D, dt_bias, state


def _close(a, b, dtype):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == mx.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(a, b, **tol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("H,P,G,N", [(8, 16, 1, 24), (8, 16, 8, 24), (16, 80, 8, 128), (8, 64, 2, 40)])
@pytest.mark.parametrize("L,with_state", [(1, True), (1, False), (7, True), (7, False)])
@pytest.mark.parametrize("method", ["fused", "composed"])
def test_kernel_equals_reference(dtype, H, P, G, N, L, with_state, method):
    args = _case(2 if L == 1 else 1, L, H, P, G, N, dtype, seed=H + P + G + N + L, with_state=with_state)
    y, s = mamba_scan(*args, method=method)
    y_ref, s_ref = mamba_scan_reference(*args)
    assert y.shape == args[0].shape and y.dtype == dtype
    assert s.shape == (args[0].shape[0], H, P, N) and s.dtype == mx.float32
    _close(y, y_ref, dtype)
    _close(s, s_ref, dtype)


def _packed(x, dt, B, C, gate_width=5):
    """The mixer's layout: xbc = x | B | C per position, dt at the end of a wider projection."""
    b, L = x.shape[:2]
    xbc = mx.concatenate([x.reshape(b, L, -1), B.reshape(b, L, -1), C.reshape(b, L, -1)], axis=-1)
    dt_src = mx.concatenate([mx.zeros((b, L, gate_width), dt.dtype), xbc, dt], axis=-1)
    return xbc, dt_src, gate_width + xbc.shape[-1]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("H,P,G,N", [(8, 16, 1, 24), (8, 16, 8, 24), (16, 80, 8, 128)])
@pytest.mark.parametrize("L,with_state", [(1, True), (6, False), (6, True)])
@pytest.mark.parametrize("method", ["fused", "composed"])
def test_packed_kernel_equals_reference(dtype, H, P, G, N, L, with_state, method):
    x, dt, A_log, B, C, D, dt_bias, state = _case(1, L, H, P, G, N, dtype, seed=L + N, with_state=with_state)
    xbc, dt_src, offset = _packed(x, dt, B, C)
    y, s = mamba_scan_packed(xbc, dt_src, offset, A_log, D, dt_bias, state, H, P, G, N, method=method)
    y_ref, s_ref = mamba_scan_reference(x, dt, A_log, B, C, D, dt_bias, state)
    assert y.shape == x.shape and y.dtype == dtype and s.dtype == mx.float32
    _close(y, y_ref, dtype)
    _close(s, s_ref, dtype)
    y_pr, s_pr = mamba_scan_packed_reference(xbc, dt_src, offset, A_log, D, dt_bias, state, H, P, G, N)
    _close(y_pr, y_ref, dtype)


def test_packed_bad_layout_is_an_error():
    x, dt, A_log, B, C, D, dt_bias, state = _case(1, 2, 8, 16, 2, 24, mx.float32, seed=6)
    xbc, dt_src, offset = _packed(x, dt, B, C)
    with pytest.raises(ValueError, match="width"):
        mamba_scan_packed(xbc[..., 1:], dt_src, offset, A_log, D, dt_bias, state, 8, 16, 2, 24)
    with pytest.raises(ValueError, match="out of range"):
        mamba_scan_packed(xbc, dt_src, offset + 1, A_log, D, dt_bias, state, 8, 16, 2, 24)


def test_strided_inputs_like_in_proj_slices():
    # The mixer hands the kernel slices of one projection: non-contiguous views.
    b, L, H, P, G, N = 1, 3, 8, 16, 2, 24
    x, dt, A_log, B, C, D, dt_bias, state = _case(b, L, H, P, G, N, mx.float32, seed=5)
    packed = mx.concatenate([x.reshape(b, L, -1), B.reshape(b, L, -1), C.reshape(b, L, -1), dt], axis=-1)
    o1, o2, o3 = H * P, H * P + G * N, H * P + 2 * G * N
    views = (packed[..., :o1].reshape(b, L, H, P), packed[..., o3:], packed[..., o1:o2].reshape(b, L, G, N),
             packed[..., o2:o3].reshape(b, L, G, N))
    y, s = mamba_scan(views[0], views[1], A_log, views[2], views[3], D, dt_bias, state.transpose(0, 1, 2, 3))
    y_ref, s_ref = mamba_scan_reference(x, dt, A_log, B, C, D, dt_bias, state)
    _close(y, y_ref, mx.float32)
    _close(s, s_ref, mx.float32)


@pytest.mark.parametrize("method", ["fused", "composed"])
def test_multi_token_equals_chained_single_steps(method):
    args = list(_case(1, 6, 8, 16, 2, 24, mx.float32, seed=11))
    y_all, s_all = mamba_scan(*args, method=method)
    x, dt, A_log, B, C, D, dt_bias, state = args
    ys = []
    for t in range(6):
        y, state = mamba_scan(x[:, t : t + 1], dt[:, t : t + 1], A_log, B[:, t : t + 1], C[:, t : t + 1], D, dt_bias,
                              state, method=method)
        ys.append(y)
    _close(y_all, mx.concatenate(ys, axis=1), mx.float32)
    _close(s_all, state, mx.float32)


def test_reference_matches_a_plain_numpy_scan():
    # Independent transcription of the recurrence, element by element, with the clip limits.
    b, L, H, P, G, N = 1, 4, 4, 3, 2, 5
    args = _case(b, L, H, P, G, N, mx.float32, seed=2)
    lo, hi = 0.001, 0.05
    y_ref, s_ref = mamba_scan_reference(*args, time_step_limit=(lo, hi))
    y_k, s_k = mamba_scan(*args, time_step_limit=(lo, hi))
    x, dt, A_log, B, C, D, dt_bias, state = (np.array(a, dtype=np.float64) for a in args)
    s = state.copy()
    y = np.zeros((b, L, H, P))
    for t in range(L):
        for h in range(H):
            g = h // (H // G)
            step = min(max(math.log1p(math.exp(dt[0, t, h] + dt_bias[h])), lo), hi)
            s[0, h] = math.exp(-math.exp(A_log[h]) * step) * s[0, h] + step * np.outer(x[0, t, h], B[0, t, g])
            y[0, t, h] = s[0, h] @ C[0, t, g] + D[h] * x[0, t, h]
    np.testing.assert_allclose(np.array(y_ref), y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(s_ref), s, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(y_k), y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(s_k), s, rtol=1e-4, atol=1e-5)


def test_large_dt_takes_the_softplus_threshold_branch():
    x, dt, A_log, B, C, D, dt_bias, state = _case(1, 2, 8, 16, 2, 24, mx.float32, seed=3)
    dt = dt + 30.0  # softplus(v) = v above 20; the decay underflows to 0
    y, s = mamba_scan(x, dt, A_log, B, C, D, dt_bias, state)
    y_ref, s_ref = mamba_scan_reference(x, dt, A_log, B, C, D, dt_bias, state)
    assert bool(mx.all(mx.isfinite(y)))
    _close(y, y_ref, mx.float32)
    _close(s, s_ref, mx.float32)


def test_bad_shapes_are_errors():
    x, dt, A_log, B, C, D, dt_bias, state = _case(1, 2, 8, 16, 2, 24, mx.float32, seed=4)
    with pytest.raises(ValueError, match="shape"):
        mamba_scan(x, dt[:, :1], A_log, B, C, D, dt_bias, state)
    with pytest.raises(ValueError, match="group"):
        mamba_scan(x, dt, A_log, mx.repeat(B[:, :, :1], 3, axis=2), mx.repeat(C[:, :, :1], 3, axis=2), D, dt_bias, None)
    with pytest.raises(ValueError, match="state"):
        mamba_scan(x, dt, A_log, B, C, D, dt_bias, state[:, :4])


def _step_case(b, H, P, G, N, dtype, seed):
    """The decode step's inputs: in_proj's output [gate | x B C | dt], the conv state and weights."""
    keys = iter(mx.random.split(mx.random.key(seed), 9))
    conv = H * P + 2 * G * N
    projected = mx.random.normal((b, 1, H * P + conv + H), key=next(keys)).astype(dtype)
    conv_state = mx.random.normal((b, 3, conv), key=next(keys))
    weight = 0.5 * mx.random.normal((conv, 4, 1), key=next(keys))
    bias = 0.1 * mx.random.normal((conv,), key=next(keys))
    _, _, A_log, _, _, D, dt_bias, state = _case(b, 1, H, P, G, N, mx.float32, seed)
    return projected, conv_state, weight, bias, A_log, D, dt_bias, state


def _conv_then_scan(projected, conv_state, weight, bias, A_log, D, dt_bias, state, H, P, G, N):
    with mx.stream(mx.cpu):
        xbc, conv_next = causal_conv_silu_reference(conv_state, projected, H * P, weight, bias)
        y, s = mamba_scan_packed_reference(xbc, projected, H * P + xbc.shape[-1], A_log, D, dt_bias, state, H, P, G,
                                           N)
        return y.reshape(projected.shape[0], 1, H * P), s, conv_next


@pytest.mark.parametrize("b,H,P,G,N,dtype", [(1, 128, 80, 8, 128, mx.float32), (2, 8, 12, 2, 40, mx.bfloat16)])
def test_conv_scan_step_equals_conv_then_scan(b, H, P, G, N, dtype):
    """The decode step's one launch on CUDA (the published mixer's shape; bfloat16 activations, 4-row
    blocks, two batch rows); the two calls it stands for elsewhere."""
    case = _step_case(b, H, P, G, N, dtype, seed=H + N)
    projected, conv_state, weight, bias, A_log, D, dt_bias, state = case
    conv = H * P + 2 * G * N
    y, s, conv_next = mamba_conv_scan_step(projected, conv_state, H * P, weight, bias, H * P + conv, A_log, D,
                                           dt_bias, state, H, P, G, N)
    want_y, want_s, want_conv = _conv_then_scan(*case, H, P, G, N)
    assert y.shape == (b, 1, H * P) and s.shape == (b, H, P, N) and conv_next.shape == (b, 3, conv)
    np.testing.assert_allclose(np.array(y), np.array(want_y.astype(mx.float32)), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.array(s), np.array(want_s), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.array(conv_next), np.array(want_conv))


@pytest.mark.parametrize("b,H,P,G,N,dtype", [(1, 128, 80, 8, 128, mx.float32), (2, 8, 12, 2, 40, mx.bfloat16)])
def test_conv_scan_step_leaves_the_gated_norm_for_out_proj(b, H, P, G, N, dtype):
    """With `gated_norm`, the step returns the mixer's gated group RMSNorm of y half done
    (Prenormed: y * silu(gate) * weight and partial sums of squares per group), which resolves to
    gated_rms_norm of the plain step's y."""
    case = _step_case(b, H, P, G, N, dtype, seed=H + N + 1)
    projected, conv_state, weight, bias, A_log, D, dt_bias, state = case
    conv = H * P + 2 * G * N
    norm_w = 1.0 + 0.2 * mx.random.normal((H * P,), key=mx.random.key(3))
    args = (projected, conv_state, H * P, weight, bias, H * P + conv, A_log, D, dt_bias, state, H, P, G, N)
    pre, s, conv_next = mamba_conv_scan_step(*args, gated_norm=(0, norm_w, 1e-5))
    want_y, want_s, want_conv = _conv_then_scan(*case, H, P, G, N)
    assert pre.groups == G and pre.weighted.shape == (b, 1, H * P) and pre.partials.shape[:-1] == (b, 1)
    assert pre.partials.shape[-1] % G == 0
    with mx.stream(mx.cpu):
        want = gated_rms_norm_reference(want_y, projected.astype(mx.float32), 0, norm_w, G, 1e-5)
        np.testing.assert_allclose(np.array(pre.resolve()), np.array(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(s), np.array(want_s), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.array(conv_next), np.array(want_conv))
    if on_cuda_gpu():  # bad gate arguments reach the kernel's checks
        with pytest.raises(ValueError, match="gate_weight"):
            ext.mamba_conv_scan_step(*args, gate_weight=norm_w[1:])


def test_conv_scan_step_refuses_bad_arguments():
    H, P, G, N = 4, 8, 2, 16
    projected, conv_state, weight, bias, A_log, D, dt_bias, state = _step_case(1, H, P, G, N, mx.float32, seed=1)
    conv = H * P + 2 * G * N
    args = lambda **kw: dict(dict(projected=projected, conv_state=conv_state, x_offset=H * P, conv_weight=weight,
                                  conv_bias=bias, dt_offset=H * P + conv, A_log=A_log, D=D, dt_bias=dt_bias,
                                  state=state, heads=H, head_dim=P, groups=G, state_size=N), **kw)
    with pytest.raises(ValueError, match="one position"):
        ext.mamba_conv_scan_step(**args(projected=mx.concatenate([projected, projected], axis=1)))
    with pytest.raises(ValueError, match="conv_state"):
        ext.mamba_conv_scan_step(**args(conv_state=conv_state[..., 1:]))
    with pytest.raises(ValueError, match="outside projected"):
        ext.mamba_conv_scan_step(**args(dt_offset=H * P + conv + 1))
    with pytest.raises(ValueError, match="groups must divide"):
        ext.mamba_conv_scan_step(**args(groups=3))
    if not on_cuda_gpu():
        with pytest.raises(ValueError, match="CUDA stream"):
            ext.mamba_conv_scan_step(**args())
