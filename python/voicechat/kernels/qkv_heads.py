"""The TTS attention's head preparation: the C++ / CUDA kernel and its pure-MLX reference.

From the stacked q/k/v projection `qkv [B, T, (H + 2 HK) * D]`: q and k RMS-normed per head
(times the offset norms' `1 + weight`), then rotated (rotate-half RoPE at positions offset + t,
angle = position * inv_freq[i] in float32, as Hugging Face computes it), and v as is; each
`[B, heads, T, D]` float32. On a CUDA GPU one launch; elsewhere the reference (MLX ops).
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import on_cuda_gpu


def rope_inv_freq(head_dim: int, base: float) -> mx.array:
    """`base^(-2i / D)` for i < D / 2, float32."""
    return (base ** (-mx.arange(0, head_dim // 2, dtype=mx.float32) * (2.0 / head_dim))).astype(mx.float32)


def _rotate(x: mx.array, inv_freq: mx.array, offset) -> mx.array:
    """x [B, heads, T, D] rotated from position `offset`: an int, one value, or one a batch row [B]."""
    t, half = x.shape[-2], x.shape[-1] // 2
    if isinstance(offset, mx.array) and offset.size > 1:  # a position a batch row
        positions = (mx.arange(t, dtype=mx.int32)[None, :] + offset.reshape(-1, 1)).astype(mx.float32)
        angles = (positions[:, :, None] * inv_freq[None, None, :])[:, None]  # [B, 1, T, D / 2]
    else:
        positions = (mx.arange(t, dtype=mx.int32) + offset).astype(mx.float32)
        angles = positions[:, None] * inv_freq[None, :]
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, heads: int, kv_heads: int, eps: float):
    b, t, _ = qkv.shape
    d = q_scale.shape[0]
    x = qkv.astype(mx.float32).reshape(b, t, heads + 2 * kv_heads, d).transpose(0, 2, 1, 3)
    q, k, v = x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]
    q = _rotate(mx.fast.rms_norm(q, q_scale, eps), inv_freq, offset)
    k = _rotate(mx.fast.rms_norm(k, k_scale, eps), inv_freq, offset)
    return q, k, v


def qkv_heads(qkv, q_scale, k_scale, inv_freq, offset, heads: int, kv_heads: int, eps: float):
    """qkv [B, T, (heads + 2 kv_heads) * D] -> (q, k, v) [B, heads / kv_heads, T, D] float32.
    `offset`: the first position (int or int32 array), or one a batch row (`[B]`: MLX's ops)."""
    if use_reference() or not on_cuda_gpu() or (isinstance(offset, mx.array) and offset.size > 1):
        return qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, heads, kv_heads, eps)
    offset = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
    return tuple(ext.qkv_heads(qkv, q_scale, k_scale, inv_freq, offset, heads, kv_heads, qkv.shape[0], eps))
