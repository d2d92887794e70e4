"""Gemma's sandwich-norm seam: the C++ / CUDA kernel and its pure-MLX reference.

    h' = h + rms_norm(y) * post
    z  = rms_norm(h') * pre

`y` is a sublayer's output, `post` its post-norm scale, `pre` the next sublayer's input-norm scale
(offset norms pass their `1 + weight`). Returns `(h', z)`. On a CUDA GPU one launch (float32 `h`,
`post`, `pre`); elsewhere the reference runs (a compiled chain around MLX's rms_norm: the same
ops as the separate norms and the add).
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import GemvLinear, gemv_applies, linear, on_cuda_gpu


@mx.compile
def _add_norm(h: mx.array, y: mx.array, post: mx.array, pre: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    h = h + mx.fast.rms_norm(y, post, eps)
    return h, mx.fast.rms_norm(h, pre, eps)


def add_rms_norm_reference(h: mx.array, y: mx.array, post: mx.array, pre: mx.array,
                           eps: float) -> tuple[mx.array, mx.array]:
    return _add_norm(h, y, post, pre, eps)


def add_rms_norm(h: mx.array, y: mx.array, post: mx.array, pre: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """h, y [..., C]; post, pre [C]. `(h + rms_norm(y) * post, rms_norm(h + ...) * pre)`."""
    if use_reference() or not on_cuda_gpu():
        return add_rms_norm_reference(h, y, post, pre, eps)
    return tuple(ext.add_rms_norm(h, y, post, pre, eps))


def add_rms_norm_linear(h: mx.array, y: mx.array | None, post: mx.array | None, pre: mx.array, eps: float,
                        layer, sessions: int = 1) -> tuple[mx.array, mx.array]:
    """`(h', layer(rms_norm(h') * pre))` with `h' = h + rms_norm(y) * post` (the seam of
    `add_rms_norm`), `h + y` without `post`, or `h` without `y` either (an input norm before the
    layer): with a dense `GemvLinear` on a CUDA GPU (1-2 float32 rows a session) one launch
    (`ext.dense_add_norm_matvec`); otherwise MLX ops, then the layer. `sessions`: the rows are that
    many equal groups (sessions' CFG pairs), each group's bits those it has alone."""
    given = [a for a in (h, y, post, pre) if a is not None]
    if (isinstance(layer, GemvLinear) and gemv_applies(h, sessions=sessions) and all(a.dtype == mx.float32 for a in given)
            and (y is None or y.shape == h.shape)):
        out, h2 = ext.dense_add_norm_matvec(h, y, post, pre, eps, layer["weight"], layer.get("bias"),
                                            sessions=sessions)
        return h2, out
    if post is not None:
        h2, z = add_rms_norm(h, y, post, pre, eps)
        return h2, linear(layer, z, sessions=sessions)
    h2 = h if y is None else h + y
    return h2, linear(layer, mx.fast.rms_norm(h2, pre, eps), sessions=sessions)


def add_rms_norm_guided_reference(h: mx.array, y: mx.array, post: mx.array, pre: mx.array, eps: float,
                                  guidance: float) -> mx.array:
    _, z = _add_norm(h, y, post, pre, eps)
    cond, uncond = z[0::2], z[1::2]  # each session's pair: rows 2s (conditioned) and 2s + 1
    return cond + guidance * (cond - uncond)


def add_rms_norm_guided(h: mx.array, y: mx.array, post: mx.array, pre: mx.array, eps: float,
                        guidance: float) -> mx.array:
    """The seam over a classifier-free-guidance pair `h, y [2, 1, C]` (row 0 conditioned, row 1 not),
    then `cond + guidance * (cond - uncond)` of its normed output: `[1, 1, C]`; sessions' pairs
    `[2 S, 1, C]` -> `[S, 1, C]`, each its pair's alone. One launch on a CUDA GPU (float32, guidance
    >= 0); elsewhere the reference (the seam, then the guidance)."""
    if (use_reference() or not on_cuda_gpu() or guidance < 0 or h.shape != y.shape or h.ndim != 3
            or h.shape[0] % 2 or h.shape[1] != 1 or any(a.dtype != mx.float32 for a in (h, y, post, pre))):
        return add_rms_norm_guided_reference(h, y, post, pre, eps, guidance)
    return ext.add_rms_norm_guided(h, y, post, pre, eps, guidance)
