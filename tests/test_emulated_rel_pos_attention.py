"""The FastConformer's rel-pos attention CUDA kernel (rel_pos_attention), run under the CPU emulation
(tests/cuda_emulation.py), equals its reference: the context window by chunks, rel_shift as index
arithmetic into a window of the positional table, the warps' online softmaxes merged."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cuda_emulation import Case, assert_close_to, emulation_fixture
from voicechat.kernels.rel_pos_attention import position_window, rel_pos_attention_reference


def rel_pos_case(b, h, length, d, left, right, dtype=mx.float32, window=True, queries=None, starts=None):
    """One block a query row; p the rows of the table the context reads (position_window), or all
    2L - 1; `queries`: only the last frames' queries (a stream's new frames), else all L; `starts`:
    each batch row's key start (the keys before it large garbage, never to be read)."""
    queries = length if queries is None else queries
    keys = mx.random.split(mx.random.key(length + d + h), 6)
    k, v = (mx.random.normal((b, h, length, d), key=keys[i]).astype(dtype) for i in (1, 2))
    key_start = None if starts is None else mx.array(starts, mx.int32)
    if key_start is not None:
        garbage = mx.arange(length)[None, None, :, None] < key_start[:, None, None, None]
        k, v = (mx.where(garbage, (1e4 * a).astype(dtype), a) for a in (k, v))
    q = mx.random.normal((b, h, queries, d), key=keys[0]).astype(dtype)
    first, count = position_window(length, left, right) if window else (0, 2 * length - 1)
    p = mx.random.normal((h, count, d), key=keys[3]).astype(dtype)
    u, vb = (0.1 * mx.random.normal((h, d), key=keys[i]) for i in (4, 5))
    scale = d**-0.5
    dims = mx.array([length, h, left, right, first, count, length - queries], mx.int32)
    case = Case("rel_pos_attention", dict(T=dtype, D=d, THREADS=128, STARTS=key_start is not None),
                [q, k, v, p, u, vb, dims, mx.array([scale], mx.float32), dims if key_start is None else key_start],
                [("float", (b, h, queries, d))], b * h * queries, 128)
    with mx.stream(mx.cpu):  # float32 from the same inputs, as the kernel computes
        f32 = [a.astype(mx.float32) for a in (q, k, v, p)]
        ref = rel_pos_attention_reference(*f32, u, vb, scale, left, right, first, key_start)
    return case, ref


# chunks of 4 frames with 8 frames of history and a window of the table (D = 40: a lane 2 values of a
# row, the second partly); unlimited history over the whole table, two batch rows; one frame a
# chunk, more warps than context; bfloat16 inputs at the encoder's D = 20 (less than a warp); a
# stream's new frames after its cached ones (the last 3 and the last 1 of the frames' queries); key
# starts (a stream's cache kept at one length while it fills), with one frame a chunk and with
# chunks of 2 frames and queries before the frames (zeros)
CASES = {"rel_pos_chunked": lambda: rel_pos_case(1, 2, 20, 40, 8, 3),
         "rel_pos_unlimited": lambda: rel_pos_case(2, 1, 12, 32, -1, 0, window=False),
         "rel_pos_short_context": lambda: rel_pos_case(1, 2, 9, 16, 2, 0),
         "rel_pos_bf16": lambda: rel_pos_case(1, 2, 14, 20, 6, 1, mx.bfloat16),
         "rel_pos_last_queries": lambda: rel_pos_case(2, 2, 15, 24, 9, 0, queries=3),
         "rel_pos_last_query_bf16": lambda: rel_pos_case(1, 2, 12, 20, 10, 0, mx.bfloat16, queries=1),
         "rel_pos_key_starts": lambda: rel_pos_case(3, 2, 16, 24, 9, 0, queries=2, starts=[0, 6, 13]),
         "rel_pos_key_starts_chunked": lambda: rel_pos_case(2, 1, 18, 20, 4, 1, mx.bfloat16, starts=[3, 0])}

emulated = emulation_fixture("rel_pos_attention", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_rel_pos_attention_kernel_emulated(emulated, name):
    assert_close_to(emulated.run(name), emulated.refs[name], rtol=2e-5)
