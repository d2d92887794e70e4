"""One query position against fixed-size K/V buffers (slots past the position not written yet):
the C++ / CUDA kernels and the pure-MLX reference.

    out[b, h] = softmax over slots s <= offset of (scale * q[b, h] . k[b, h // G, s]) @ v[b, h // G, s]

`q [B, H, 1, D]`, `k, v [B, HK, CAP, D]` float32, `offset` an int32 array (one position for every
row, or `[B]`: one a row, as sessions stepped together are): returns `[B, 1, H * D]`.
With `new = (k_new, v_new, slot)` (`[B, HK, 1, D]` each and an int32 array), slot `slot` is read
as holding `k_new` / `v_new` instead of what the buffers hold there: the step attends as if the
new position were already written, and the caller writes it later (the TTS backbone writes all
its layers' new keys in one update).

On a CUDA GPU one launch while CAP <= 1024, two beyond (MLX's fast attention takes no mask array on
CUDA, and its fallback is a matmul, the mask, a softmax and a matmul), or with `chunked` two at any
CAP: a row's result then does not depend on CAP, which sessions stepped together need (their
buffers have the longest one's capacity); elsewhere MLX ops: its
attention with the mask, or, with `new`, the scores over the buffer and the new key, one softmax
and two products (no copy of the buffers).

`decode_attention_qkv` is the TTS step's form: q and the new key / value come from the stacked
q/k/v projection, normed and rotated as `qkv_heads` does, in the same launch on a CUDA GPU (one
launch a layer fewer); it also returns that key and value for the cache, or on CUDA writes them
into the cache's buffers itself (`write_cache`).

On CUDA beyond 1024 slots the first launch takes 256 slots a block (one pass of its warps) and a
second one merges them.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import on_cuda_gpu
from .qkv_heads import qkv_heads


def _per_row(a, b: int):
    """A position (or slot) as it broadcasts against `[B, HK, G, CAP]` scores: as it is for one value,
    `[B, 1, 1, 1]` for one a row."""
    if isinstance(a, mx.array) and a.size > 1:
        return a.reshape(b, 1, 1, 1)
    return a


def decode_attention_reference(q, k, v, offset, scale: float, mask=None, new=None):
    """`mask`: the validity of the slots, if already made (`arange(CAP) <= offset`: `[CAP]`, or
    `[B, 1, 1, CAP]` for a position a row)."""
    cap, b = k.shape[2], q.shape[0]
    mask = mx.arange(cap) <= _per_row(offset, b) if mask is None else mask
    if new is None:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        b, h, _, d = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b, 1, h * d)
    k_new, v_new, slot = new
    b, h, _, d = q.shape
    hk = k.shape[1]
    qg = q.astype(mx.float32).reshape(b, hk, h // hk, d)  # the query heads of each K/V head
    scores = (qg @ k.swapaxes(-1, -2)) * scale  # [B, HK, G, CAP]
    scores = mx.where(mask & (mx.arange(cap) != _per_row(slot, b)), scores, -mx.inf)
    fresh = (qg @ k_new.swapaxes(-1, -2)) * scale  # [B, HK, G, 1]
    p = mx.softmax(mx.concatenate([scores, fresh], axis=-1), axis=-1)
    out = p[..., :cap] @ v + p[..., cap:] * v_new
    return out.reshape(b, 1, h * d)


def plain_kernel_takes(q, k, v, new=None) -> bool:
    """Whether `decode_attention` runs our kernel for these arrays (and so can write the cache in
    place): a CUDA GPU, no `VOICECHAT_REFERENCE`, one float32 query position and buffers."""
    takes = all(a.dtype == mx.float32 for a in (q, k, v)) and q.shape[2] == 1
    if new is not None:
        takes = takes and all(a.dtype == mx.float32 for a in new[:2])
    return takes and not use_reference() and on_cuda_gpu()


def decode_attention(q, k, v, offset, scale: float, mask=None, new=None, write_cache: bool = False,
                     chunked: bool = False):
    """See the module docstring. `write_cache` (with `new`, only where `plain_kernel_takes`): the
    launch also stores the new key and value in their slot of `k` and `v`, in place, on the terms
    of `decode_attention_qkv`'s. `chunked`: the kernel's two launches at any capacity."""
    if not plain_kernel_takes(q, k, v, new):
        if write_cache:
            raise ValueError("decode_attention: write_cache needs the CUDA kernel (see plain_kernel_takes)")
        return decode_attention_reference(q, k, v, offset, scale, mask, new)
    if new is None:
        if write_cache:
            raise ValueError("decode_attention: write_cache needs new=(k_new, v_new, slot)")
        return ext.decode_attention(q, k, v, offset, scale, chunked=chunked)
    k_new, v_new, slot = new
    return ext.decode_attention(q, k, v, offset, scale, k_new=k_new, v_new=v_new, slot=slot, write_cache=write_cache,
                                chunked=chunked)


def qkv_kernel_takes(qkv, k, v) -> bool:
    """Whether `decode_attention_qkv` runs our kernel for these arrays (and so can write the cache in
    place): a CUDA GPU, no `VOICECHAT_REFERENCE`, one position, float32 buffers."""
    return (not use_reference() and on_cuda_gpu() and qkv.ndim == 3 and qkv.shape[1] == 1
            and k.dtype == mx.float32 and v.dtype == mx.float32)


def decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, eps: float, k, v, offset, scale: float, slot, heads: int,
                         mask=None, write_cache: bool = False, chunked: bool = False):
    """`qkv [B, 1, (heads + 2 HK) * D]` -> `(out [B, 1, heads * D], k_new, v_new [B, HK, 1, D])`:
    `qkv_heads` at position `offset`, then the attention over the buffers `k, v [B, HK, CAP, D]`
    with the new key and value read in `slot`. One CUDA launch (two beyond 1024 slots); elsewhere
    those two functions.

    `write_cache` (only where `qkv_kernel_takes`; refused elsewhere): the launch also stores the new
    key and value in `slot` of `k` and `v` themselves, in place. They must be views of the cache's
    own buffers, no later reader may want the slot's old contents, and the caller must order the
    launch after every earlier reader of the buffers and every later reader after it (MLX sees no
    write: `tts.backbone.settle`; see csrc/ops/decode_attention.cpp). `offset` and `slot` may hold a
    value a row ([B]: sessions' rows at their own positions); `chunked`: the kernel's two launches at
    any capacity, so that a row's result does not depend on the buffers' capacity."""
    if not qkv_kernel_takes(qkv, k, v):
        if write_cache:
            raise ValueError("decode_attention_qkv: write_cache needs the CUDA kernel (see qkv_kernel_takes)")
        q, k_new, v_new = qkv_heads(qkv, q_scale, k_scale, inv_freq, offset, heads, k.shape[1], eps)
        return decode_attention(q, k, v, offset, scale, mask, new=(k_new, v_new, slot)), k_new, v_new
    offset = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
    slot = slot if isinstance(slot, mx.array) else mx.array(slot, mx.int32)
    return tuple(ext.decode_attention_qkv(qkv, q_scale, k_scale, inv_freq, eps, k, v, offset, scale, slot, heads,
                                          write_cache=write_cache, chunked=chunked))
