"""The Mamba-2 mixer's gated group RMSNorm: the C++ / CUDA kernel and its pure-MLX reference.

    h   = y * silu(gate)
    out = h / sqrt(mean(h^2 over the channel's group) + eps) * weight

over `groups` equal groups of the C channels. The gate is read in place at columns
[gate_offset, gate_offset + C) of `gate_src` (the mixer's in_proj output), so no slice is copied.
On a CUDA GPU this is one launch (float32 inputs); elsewhere the reference runs (a compiled chain
around MLX's rms_norm).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ._native import ext, use_reference
from .gemv import on_cuda_gpu


@mx.compile
def _gated_group_norm(y: mx.array, gate: mx.array, weight: mx.array, groups: int, eps: float) -> mx.array:
    h = y * nn.silu(gate)
    shape = h.shape
    h = mx.fast.rms_norm(h.reshape(*shape[:-1], groups, shape[-1] // groups), None, eps)
    return h.reshape(shape) * weight


def gated_rms_norm_reference(y: mx.array, gate_src: mx.array, gate_offset: int, weight: mx.array, groups: int,
                             eps: float) -> mx.array:
    c = y.shape[-1]
    return _gated_group_norm(y, gate_src[..., gate_offset : gate_offset + c], weight, groups, eps)


def gated_rms_norm(y: mx.array, gate_src: mx.array, gate_offset: int, weight: mx.array, groups: int,
                   eps: float) -> mx.array:
    """y [..., C], gate_src [..., W] (gate at columns [gate_offset, gate_offset + C)), weight [C]."""
    if use_reference() or not on_cuda_gpu():
        return gated_rms_norm_reference(y, gate_src, gate_offset, weight, groups, eps)
    return ext.gated_rms_norm(y, gate_src, gate_offset, weight, groups, eps)
