"""One query position against fixed-size K/V buffers (slots past the position not written yet):
the C++ / CUDA kernels and the pure-MLX reference.

    out[b, h] = softmax over slots s <= offset of (scale * q[b, h] . k[b, h // G, s]) @ v[b, h // G, s]

`q [B, H, 1, D]`, `k, v [B, HK, CAP, D]` float32, `offset` an int32 array: returns `[B, 1, H * D]`.
On a CUDA GPU one launch while CAP <= 256, two beyond (MLX's fast attention takes no mask array on CUDA, and
its fallback is a matmul, the mask, a softmax and a matmul); elsewhere MLX's attention with the
mask.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import on_cuda_gpu


def decode_attention_reference(q, k, v, offset, scale: float, mask=None):
    """`mask`: the `[CAP]` validity of the slots, if already made (`arange(CAP) <= offset`)."""
    mask = mx.arange(k.shape[2]) <= offset if mask is None else mask
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    b, h, _, d = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, 1, h * d)


def decode_attention(q, k, v, offset, scale: float, mask=None):
    kernel_takes = all(a.dtype == mx.float32 for a in (q, k, v)) and q.shape[2] == 1
    if use_reference() or not on_cuda_gpu() or not kernel_takes:
        return decode_attention_reference(q, k, v, offset, scale, mask)
    return ext.decode_attention(q, k, v, offset, scale)
