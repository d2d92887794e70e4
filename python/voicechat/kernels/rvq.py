"""RVQ argmin search: sequential residual quantization over codebooks [start, start + count).

    for q in start .. start + count - 1:
        code[q] = argmin_k ||E[q, k]||^2 - 2 r . E[q, k]     (first index on ties)
        r = r - E[q, code[q]]

Returns `(codes [B, count] int32, residual [B, D] float32)`; given `into` (the codes so far,
`[B, Q]`), the codes come back as those rows with columns [start, start + count) replaced (on
CUDA the kernels write them there: no concatenation launches). Distances use the precomputed
codeword norms (`codebook_norms`), so pass them in when calling repeatedly.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference


def codebook_norms(codebooks: mx.array) -> mx.array:
    """`||E[q, k]||^2` as float32 `[Q, K]`."""
    e = codebooks.astype(mx.float32)
    return (e * e).sum(axis=-1)


def rvq_search_reference(
    residual: mx.array, codebooks: mx.array, start: int, count: int, norms: mx.array | None = None,
    into: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Composed MLX ops, one codebook at a time."""
    norms = codebook_norms(codebooks) if norms is None else norms.astype(mx.float32)
    r = residual.astype(mx.float32)
    codes = []
    for q in range(start, start + count):
        book = codebooks[q].astype(mx.float32)
        dist = norms[q] - 2.0 * (r @ book.T)
        code = mx.argmin(dist, axis=-1).astype(mx.int32)
        r = r - book[code]
        codes.append(code)
    codes = mx.stack(codes, axis=1)
    if into is not None:
        row = into.astype(mx.int32)
        codes = mx.concatenate([row[:, :start], codes, row[:, start + count:]], axis=1)
    return codes, r


def rvq_search(
    residual: mx.array,
    codebooks: mx.array,
    start: int,
    count: int,
    norms: mx.array | None = None,
    *,
    into: mx.array | None = None,
    method: str = "auto",
    stream=None,
) -> tuple[mx.array, mx.array]:
    """The C++ kernel: on a CUDA GPU the whole run in one launch of thread-block clusters (through our
    own launch), on the CPU a fused loop; MLX ops (a GEMM a codebook) for many rows and elsewhere.

    `method`: "auto" (the kernel for up to 8 rows where it runs, else the ops), "fused" (the kernel;
    an error on a CUDA GPU where our own launch is off) or "composed" (the ops).
    """
    if use_reference():
        return rvq_search_reference(residual, codebooks, start, count, norms, into)
    norms = codebook_norms(codebooks) if norms is None else norms
    codes, r = ext.rvq_search(residual, codebooks, norms, start, count, method, into=into, stream=stream)
    return codes, r
