"""Sequential residual quantization in composed MLX ops.

Stand-in with the signature of `voicechat.kernels.rvq.rvq_search` until that kernel is on main.
"""

from __future__ import annotations

import mlx.core as mx


def rvq_search(residual: mx.array, codebooks: mx.array, start: int, count: int, norms: mx.array | None = None):
    """For q in start..start+count: `code = argmin_k ||r - E_q[k]||^2; r -= E_q[code]`.

    residual [B, D], codebooks [Q, K, D], norms [Q, K] (`||E_q[k]||^2`, computed when None).
    Returns (codes [B, count] int32, residual [B, D])."""
    r = residual.astype(mx.float32)
    codes = []
    for q in range(start, start + count):
        book = codebooks[q]
        norm = norms[q] if norms is not None else mx.sum(mx.square(book.astype(mx.float32)), axis=-1)
        # ||r||^2 is the same for every k, so it does not move the argmin.
        index = mx.argmin(norm - 2.0 * (r @ book.T), axis=-1).astype(mx.int32)
        r = r - book[index].astype(mx.float32)
        codes.append(index)
    return mx.stack(codes, axis=-1), r
