"""One frame's code embedding, the EAR-TTS code generation's input: the C++ / CUDA kernel and its
pure-MLX reference.

    out = plus + W @ sum_q table[q * (K + 1) + code[q]]

`table [Q * (K + 1), D]` float32 holds the codebooks with one zero row after each (the mask code K
adds nothing), `W [H, D]` is `embed_code`'s weight, `plus [B, 1, H]` (optional) is added to the
result. Returns `[B, 1, H]`, or `[1, 1, H]` without `plus`. On a CUDA GPU one launch; elsewhere
the reference.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import on_cuda_gpu


def code_embedding_reference(code: mx.array, table: mx.array, weight: mx.array,
                             plus: mx.array | None = None) -> mx.array:
    q = code.size
    rows = code.reshape(q).astype(mx.int32) + mx.arange(q, dtype=mx.int32) * (table.shape[0] // q)
    out = (table[rows].sum(axis=0) @ weight.astype(mx.float32).T).reshape(1, 1, -1)
    return out if plus is None else plus + out


def code_embedding(code: mx.array, table: mx.array, weight: mx.array, plus: mx.array | None = None) -> mx.array:
    if use_reference() or not on_cuda_gpu():
        return code_embedding_reference(code, table, weight, plus)
    return ext.code_embedding(code, table, weight, plus)
