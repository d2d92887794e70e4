"""One frame's code embedding, the EAR-TTS code generation's input: the C++ / CUDA kernel and its
pure-MLX reference.

    out = W @ sum_q table[q * (K + 1) + code[q]]

`table [Q * (K + 1), D]` float32 holds the codebooks with one zero row after each (the mask code K
adds nothing), `W [H, D]` is `embed_code`'s weight. Returns `[rows, 1, H]` (the same row `rows`
times: the CFG pair's). On a CUDA GPU one launch; elsewhere the reference.
"""

from __future__ import annotations

import mlx.core as mx

from ._native import ext, use_reference
from .gemv import on_cuda_gpu


def code_embedding_reference(code: mx.array, table: mx.array, weight: mx.array, rows: int = 1) -> mx.array:
    q = code.size
    index = code.reshape(q).astype(mx.int32) + mx.arange(q, dtype=mx.int32) * (table.shape[0] // q)
    out = (table[index].sum(axis=0) @ weight.astype(mx.float32).T).reshape(1, 1, -1)
    return mx.broadcast_to(out, (rows, 1, out.shape[-1]))


def code_embedding(code: mx.array, table: mx.array, weight: mx.array, rows: int = 1, sessions: int = 1) -> mx.array:
    """`[rows, 1, H]`: the frame's embedding `rows` times; `sessions` S: code `[S, Q]`, a frame a
    session, `[S * rows, 1, H]` (each session's rows its frame's alone, in one launch on a GPU)."""
    if use_reference() or not on_cuda_gpu():
        if sessions == 1:
            return code_embedding_reference(code, table, weight, rows)
        frames = code.reshape(sessions, -1)
        return mx.concatenate([code_embedding_reference(frames[i], table, weight, rows) for i in range(sessions)])
    return ext.code_embedding(code, table, weight, rows, sessions=sessions)
