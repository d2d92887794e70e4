"""The Mamba-2 mixer's causal depthwise convolution + SiLU from a conv state: the C++ / CUDA kernel
and its pure-MLX reference.

    window = [conv_state; x]          conv_state [b, K-1, C], x = src[..., offset:offset + C] [b, L, C]
    y[t]   = silu(bias + sum_k window[t + k] * weight[:, k])
    returns (y [b, L, C] float32, window[:, L:] — the next conv state)

On a CUDA GPU a decode step (L = 1) is one launch reading x in place from the in_proj output;
a prefix and everything elsewhere run the reference (one compiled chain after the
concatenation). `ext.causal_conv_silu` itself takes any L (an instance per L).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ._native import ext, use_reference
from .gemv import on_cuda_gpu


@mx.compile
def _conv_silu(conv_state: mx.array, x: mx.array, weight: mx.array, bias: mx.array):
    window = mx.concatenate([conv_state, x.astype(conv_state.dtype)], axis=1)
    K, L = weight.shape[1], x.shape[1]
    out = bias.astype(mx.float32)
    for k in range(K):
        out = out + window[:, k : k + L] * weight[:, k, 0]
    return nn.silu(out), window[:, L:]


def causal_conv_silu_reference(conv_state: mx.array, src: mx.array, offset: int, weight: mx.array,
                               bias: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """weight [C, K, 1] (nn.Conv1d's depthwise layout), bias [C] or None."""
    c = conv_state.shape[-1]
    return _conv_silu(conv_state, src[..., offset : offset + c], weight,
                      bias if bias is not None else mx.zeros((1,), mx.float32))


def causal_conv_silu(conv_state: mx.array, src: mx.array, offset: int, weight: mx.array,
                     bias: mx.array | None = None) -> tuple[mx.array, mx.array]:
    # The kernel is for the decode step: its length is a template arg, and a prefix (once a
    # session, any length) would compile an instance per length.
    if use_reference() or not on_cuda_gpu() or src.shape[1] != 1:
        return causal_conv_silu_reference(conv_state, src, offset, weight, bias)
    y, state = ext.causal_conv_silu(conv_state, src, offset, weight, bias)
    return y, state
