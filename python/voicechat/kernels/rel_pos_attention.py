"""Relative-position self-attention of the FastConformer, with the chunked-limited mask.

    scores = (q + u) k^T * s + rel_shift((q + v_bias) p^T)[..., :L] * s     (masked outside the context)
    out    = softmax(scores) v

`k, v` are `[B, H, L, D]`, `q` `[B, H, n, D]` the queries of the last `n <= L` frames (a stream's new
frames after its cached ones; the output is theirs, `[B, H, n, D]`), `p` the projected positional table `[H, 2L - 1, D]` for relative
positions `L - 1 .. -(L - 1)`, or only its rows `[pos_first, pos_first + P)` when those cover every
pair inside the context (`position_window`: 71 rows for [70, 0] instead of 2L - 1), `u, v_bias`
`[H, D]`. Frame `i` may attend to frame `j` when their
chunks (`chunk = right + 1` frames) satisfy `0 <= chunk(i) - chunk(j) <= left // chunk`; `left < 0`
means unlimited history. Output in `q`'s dtype; float32 inside.

`rel_shift` moves row `i` of `(q + v_bias) p^T` left by `L - 1 - i`, so that entry `(i, j)` holds
the score of relative position `i - j`, i.e. positional row `L - 1 - i + j`. The kernel reads that
row directly (index arithmetic); the reference pads and reshapes as NeMo does.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference


def position_window(length: int, left: int, right: int) -> tuple[int, int]:
    """`(first, count)`: the rows of the `2L - 1` relative-position table that the context reads.

    Frame pairs (i, j) inside the context have relative positions `i - j` in
    `[-(chunk - 1), (left // chunk + 1) * chunk - 1]` (clipped to the sequence); row = L - 1 - (i - j).
    """
    chunk = right + 1
    most_past = length - 1 if left < 0 else min(length - 1, (left // chunk + 1) * chunk - 1)
    most_future = min(length - 1, chunk - 1)
    return length - 1 - most_past, most_past + most_future + 1


def rel_shift(x: mx.array) -> mx.array:
    """NeMo's rel_shift on `[..., L, P]`: left-pad one column, view as `[..., P + 1, L]`, drop row 0."""
    *lead, rows, cols = x.shape
    x = mx.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])
    x = x.reshape(*lead, cols + 1, rows)
    return x[..., 1:, :].reshape(*lead, rows, cols)


def chunked_limited_mask(length: int, left: int, right: int, key_start: mx.array | None = None) -> mx.array:
    """`[L, L]` bool, True where frame i may attend to frame j (NeMo's chunked_limited style).
    With `key_start [B]`, `[B, 1, L, L]`: row b's frames begin at key `key_start[b]` (frames
    counted from there; nothing before it is attended or attends)."""
    chunk = right + 1
    frame = mx.arange(length)
    if key_start is not None:
        frame = frame[None, :] - key_start.astype(mx.int32)[:, None]  # [B, L]; negative: not a frame
    idx = frame // chunk  # floor division: keys before the frames fall in chunks below 0
    diff = idx[..., :, None] - idx[..., None, :]
    allowed = diff >= 0
    if left >= 0:
        allowed = allowed & (diff <= left // chunk)
    if key_start is not None:
        allowed = (allowed & (frame[:, :, None] >= 0) & (frame[:, None, :] >= 0))[:, None]
    return allowed


def rel_pos_attention_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    p: mx.array,
    pos_bias_u: mx.array,
    pos_bias_v: mx.array,
    scale: float,
    left: int,
    right: int,
    pos_first: int = 0,
    key_start: mx.array | None = None,
) -> mx.array:
    """Composed MLX ops: full score matrices, pad/reshape rel_shift, masked softmax (zero queries
    for the frames before the given ones, their rows dropped). `key_start`: as `rel_pos_attention`'s
    (a query before its row's frames gives zeros)."""
    dtype = q.dtype
    q, k, v, p, u, b = (a.astype(mx.float32) for a in (q, k, v, p, pos_bias_u, pos_bias_v))
    length, queries = k.shape[-2], q.shape[-2]
    q = mx.pad(q, [(0, 0), (0, 0), (length - queries, 0), (0, 0)])
    if p.ndim == 4:
        p = p[0]
    # Rows outside the window only meet masked scores: zeros stand in for them.
    p = mx.pad(p, [(0, 0), (pos_first, 2 * length - 1 - pos_first - p.shape[1]), (0, 0)])
    ac = (q + u[:, None, :]) @ k.swapaxes(-1, -2)
    bd = rel_shift((q + b[:, None, :]) @ p.swapaxes(-1, -2))[..., :length]
    scores = ac * scale + bd * scale
    mask = chunked_limited_mask(length, left, right, key_start)
    scores = mx.where(mask, scores, mx.array(-1e30, mx.float32))
    out = mx.softmax(scores, axis=-1) @ v
    if key_start is not None:
        out = mx.where(mask.any(axis=-1, keepdims=True), out, 0.0)
    return out[:, :, length - queries :].astype(dtype)


def rel_pos_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    p: mx.array,
    pos_bias_u: mx.array,
    pos_bias_v: mx.array,
    scale: float,
    left: int,
    right: int,
    pos_first: int = 0,
    key_start: mx.array | None = None,
    *,
    method: str = "auto",
) -> mx.array:
    """The C++ kernel: scores only inside each frame's context window, rel_shift as indexing.

    `key_start` (int32 `[B]`): batch row b's frames begin at key `key_start[b]`; the keys before
    are not frames (a stream's cache kept at one length while it fills). Its windows count from
    there, and its rows are those of `k[b, :, key_start[b]:]` alone, bit for bit on the kernel
    paths. `method`: "auto" or "fused" (the kernel: C++ loop on the CPU, CUDA on a CUDA GPU, the
    composed ops elsewhere) or "composed" (the C++ composed-ops path, as_strided rel_shift).
    """
    if use_reference():
        return rel_pos_attention_reference(q, k, v, p, pos_bias_u, pos_bias_v, scale, left, right, pos_first,
                                           key_start)
    return ext.rel_pos_attention(q, k, v, p, pos_bias_u, pos_bias_v, float(scale), int(left), int(right),
                                 int(pos_first), key_start, method)
