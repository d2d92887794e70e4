"""Fused Mamba-2 selective scan: the C++ kernel and its pure-MLX reference.

For every position t, head h (group g = h // (heads / groups)), head channel p and state index n:

    dt   = clip(softplus(dt_raw[t, h] + dt_bias[h]), *time_step_limit)
    s    = exp(dt * A[h]) * s + dt * x[t, h, p] * B[t, g, n]       with A = -exp(A_log)
    y[t, h, p] = sum_n s[h, p, n] * C[t, g, n] + D[h] * x[t, h, p]

starting from `state` (zeros when None). One call covers any number of positions: the
single-token decode step and a multi-token prefix alike; it returns y and the final state.
The state is always float32; y has x's dtype; all arithmetic is float32.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ._native import ext, use_reference
from .causal_conv import causal_conv_silu
from .gemv import Prenormed, on_cuda_gpu

__all__ = ["mamba_scan", "mamba_scan_reference", "mamba_scan_packed", "mamba_scan_packed_reference",
           "mamba_conv_scan_step"]

_NO_LIMIT = (0.0, math.inf)


def _softplus(v: mx.array) -> mx.array:
    # torch's softplus (threshold 20): identical to log1p(exp(v)) in float32 above the threshold.
    return mx.where(v > 20.0, v, mx.log1p(mx.exp(mx.minimum(v, 20.0))))


def mamba_scan_reference(
    x: mx.array,
    dt: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
) -> tuple[mx.array, mx.array]:
    """Sequential scan in composed MLX ops.

    x [b, L, H, P], dt [b, L, H], A_log / D / dt_bias [H], B / C [b, L, G, N],
    state [b, H, P, N] or None -> (y [b, L, H, P] in x.dtype, state [b, H, P, N] float32).
    """
    _check(x, dt, A_log, B, C, D, dt_bias, state)
    f32 = mx.float32
    b, L, H, P = x.shape
    G, N = B.shape[-2:]
    lo, hi = time_step_limit
    step = mx.clip(_softplus(dt.astype(f32) + dt_bias.astype(f32)), lo, hi)  # [b, L, H]
    A = -mx.exp(A_log.astype(f32))
    Bh = mx.repeat(B.astype(f32), H // G, axis=2)  # [b, L, H, N]
    Ch = mx.repeat(C.astype(f32), H // G, axis=2)
    xf = x.astype(f32)
    Df = D.astype(f32)
    s = mx.zeros((b, H, P, N), f32) if state is None else state.astype(f32)
    ys = []
    for t in range(L):
        decay = mx.exp(step[:, t] * A)[..., None, None]  # [b, H, 1, 1]
        update = (step[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]  # [b, H, P, N]
        s = decay * s + update
        y = (s @ Ch[:, t, :, :, None])[..., 0] + Df[:, None] * xf[:, t]  # [b, H, P]
        ys.append(y)
    y = mx.stack(ys, axis=1) if ys else mx.zeros((b, 0, H, P), f32)
    return y.astype(x.dtype), s


def _check(x, dt, A_log, B, C, D, dt_bias, state) -> None:
    if x.ndim != 4 or dt.ndim != 3 or B.ndim != 4 or C.ndim != 4:
        raise ValueError("mamba_scan: expected x [b, L, H, P], dt [b, L, H], B and C [b, L, G, N]")
    b, L, H, P = x.shape
    G, N = B.shape[-2:]
    if tuple(dt.shape) != (b, L, H) or tuple(B.shape) != (b, L, G, N) or tuple(C.shape) != (b, L, G, N):
        raise ValueError(f"mamba_scan: shapes disagree: x {x.shape}, dt {dt.shape}, B {B.shape}, C {C.shape}")
    if H % G:
        raise ValueError(f"mamba_scan: {G} groups do not divide {H} heads")
    for name, v in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        if tuple(v.shape) != (H,):
            raise ValueError(f"mamba_scan: {name} has shape {v.shape}, expected ({H},)")
    if state is not None and tuple(state.shape) != (b, H, P, N):
        raise ValueError(f"mamba_scan: state has shape {state.shape}, expected {(b, H, P, N)}")


def mamba_scan(
    x: mx.array,
    dt: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
    *,
    method: str = "auto",
) -> tuple[mx.array, mx.array]:
    """The fused scan: one C++ / CUDA kernel launch per call, any L (shapes as the reference).

    `method`: "auto" or "fused" (the kernel), "composed" (the C++ composed-ops fallback).
    """
    if use_reference():
        return mamba_scan_reference(x, dt, A_log, B, C, D, dt_bias, state, time_step_limit)
    y, s = ext.mamba_scan(x, dt, A_log, B, C, D, dt_bias, state, time_step_limit[0], time_step_limit[1], method)
    return y, s


def _unpack(xbc, dt_src, dt_offset, heads, head_dim, groups, state_size):
    b, L, _ = xbc.shape
    hp, gn = heads * head_dim, groups * state_size
    x = xbc[..., :hp].reshape(b, L, heads, head_dim)
    B = xbc[..., hp : hp + gn].reshape(b, L, groups, state_size)
    C = xbc[..., hp + gn : hp + 2 * gn].reshape(b, L, groups, state_size)
    return x, dt_src[..., dt_offset : dt_offset + heads], B, C


def mamba_scan_packed_reference(
    xbc: mx.array, dt_src: mx.array, dt_offset: int, A_log: mx.array, D: mx.array, dt_bias: mx.array,
    state: mx.array | None, heads: int, head_dim: int, groups: int, state_size: int,
    time_step_limit: tuple[float, float] = _NO_LIMIT,
) -> tuple[mx.array, mx.array]:
    """`mamba_scan_reference` on the mixer's packed buffers (see `mamba_scan_packed`)."""
    if xbc.shape[-1] != heads * head_dim + 2 * groups * state_size:
        raise ValueError("mamba_scan_packed: xbc's width is not heads * head_dim + 2 * groups * state_size")
    if not 0 <= dt_offset <= dt_src.shape[-1] - heads:
        raise ValueError("mamba_scan_packed: dt columns [dt_offset, dt_offset + heads) out of range")
    x, dt, B, C = _unpack(xbc, dt_src, dt_offset, heads, head_dim, groups, state_size)
    return mamba_scan_reference(x, dt, A_log, B, C, D, dt_bias, state, time_step_limit)


def mamba_scan_packed(
    xbc: mx.array, dt_src: mx.array, dt_offset: int, A_log: mx.array, D: mx.array, dt_bias: mx.array,
    state: mx.array | None, heads: int, head_dim: int, groups: int, state_size: int,
    time_step_limit: tuple[float, float] = _NO_LIMIT, *, method: str = "auto",
) -> tuple[mx.array, mx.array]:
    """The scan on the Mamba mixer's own buffers, so that the GPU kernel copies no slice.

    xbc [b, L, H*P + 2*G*N] holds x | B | C per position (the conv output); dt_src [b, L, W]
    holds the H step inputs at columns [dt_offset, dt_offset + H) (in_proj's output).
    """
    if use_reference():
        return mamba_scan_packed_reference(xbc, dt_src, dt_offset, A_log, D, dt_bias, state, heads, head_dim,
                                           groups, state_size, time_step_limit)
    y, s = ext.mamba_scan_packed(xbc, dt_src, dt_offset, A_log, D, dt_bias, state, heads, head_dim, groups,
                                 state_size, time_step_limit[0], time_step_limit[1], method)
    return y, s


def mamba_conv_scan_step(
    projected: mx.array, conv_state: mx.array, x_offset: int, conv_weight: mx.array, conv_bias: mx.array | None,
    dt_offset: int, A_log: mx.array, D: mx.array, dt_bias: mx.array, state: mx.array | None, heads: int,
    head_dim: int, groups: int, state_size: int, time_step_limit: tuple[float, float] = _NO_LIMIT, *,
    gated_norm: tuple[int, mx.array, float] | None = None,
) -> tuple:
    """The decode step's `causal_conv_silu` then `mamba_scan_packed` on in_proj's output
    `projected [b, 1, W]` (x | B | C at columns x_offset.., dt at dt_offset): `(y [b, 1, H*P],
    ssm state [b, H, P, N], conv state [b, K-1, C])`. One launch on a CUDA GPU (the conv of the
    group's B and C is redone by each block there), those two calls elsewhere.

    `gated_norm = (gate_offset, weight [H*P], eps)`: the mixer's gated group RMSNorm of y (gate at
    columns [gate_offset, gate_offset + H*P) of `projected`, `groups` groups) is returned in y's
    place as `Prenormed` (see `voicechat.kernels.gemv`): the out_proj matvec applies its scales, so
    the norm costs no launch of its own."""
    b = projected.shape[0]
    kernel_takes = (projected.shape[1] == 1 and conv_state.dtype == mx.float32 and conv_weight.dtype == mx.float32
                    and (conv_bias is None or conv_bias.dtype == mx.float32))
    if use_reference() or not on_cuda_gpu() or not kernel_takes:
        xbc, new_conv = causal_conv_silu(conv_state, projected, x_offset, conv_weight, conv_bias)
        y, ssm = mamba_scan_packed(xbc, projected, dt_offset, A_log, D, dt_bias, state, heads, head_dim, groups,
                                   state_size, time_step_limit)
        y = y.reshape(b, projected.shape[1], heads * head_dim)
        if gated_norm is None:
            return y, ssm, new_conv
        offset, weight, eps = gated_norm
        h = y * nn.silu(projected[..., offset : offset + heads * head_dim].astype(mx.float32))
        partials = mx.square(h).reshape(*h.shape[:-1], groups, -1).sum(-1)
        return Prenormed(h * weight, partials, groups, eps), ssm, new_conv
    gate = dict(gate_weight=gated_norm[1], gate_offset=gated_norm[0]) if gated_norm is not None else {}
    out = ext.mamba_conv_scan_step(projected, conv_state, x_offset, conv_weight, conv_bias, dt_offset, A_log, D,
                                   dt_bias, state, heads, head_dim, groups, state_size, time_step_limit[0],
                                   time_step_limit[1], **gate)
    if gated_norm is None:
        return tuple(out)
    y, ssm, new_conv, partials = out
    return Prenormed(y, partials, groups, gated_norm[2]), ssm, new_conv
