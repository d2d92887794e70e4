"""The streamed integer-MMA 4-bit matvec (vc_qmv_imma_stream) and its emitting twin, run under the
CPU emulation (tests/cuda_emulation.py: the MMA's fragments as PTX lays them out), equal MLX's
product: 16-row slabs by bulk copies and their stages' reuse, each warp's groups of a slab from shared
memory (scale rows padded where K is a multiple of 1024), x's block floating point expansion at any
scale, the last warp's store, and the block's own copies where the weight is misaligned. 2 stages,
as csrc/ops/gemv.cpp launches it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cuda_emulation import assert_close_to, emulation_fixture, persistent_case


def imma_stream_case(n, k, m, warps, blocks, **kw):
    """A persistent grid of `blocks` blocks walking the N / 16 slabs, `warps` warps splitting each
    slab's 64-wide groups."""
    layout = dict(K=k, N=n, M=m, WARPS=warps, STAGES=2)
    return persistent_case("vc_qmv_imma_stream", layout, n, k, m, 16, blocks, 32 * warps, **kw)


CASES = {
    # stages wrapping round (5 slabs a block, uneven groups a warp); two rows of unaligned bfloat16 x
    # with a residual; a misaligned weight (the block's own copies) with a bias and squared ReLU, with
    # K = 1024's padded scale rows too; K = 320 (K / 8 words a row, 8 mod 16): rows not padded
    "imma_stream_q4": lambda: imma_stream_case(160, 640, 1, 3, 2),
    "imma_stream_m2_bf16": lambda: imma_stream_case(48, 1024, 2, 4, 2, x_dtype=mx.bfloat16, epi=1, x_offset=1),
    "imma_stream_own_copies": lambda: imma_stream_case(64, 512, 1, 2, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
    "imma_stream_own_copies_padded": lambda: imma_stream_case(48, 1024, 1, 2, 2, w_offset=1),
    # huge and tiny x (the expansion's exponents); a group-normalized input; emitting on 8 groups
    "imma_stream_huge_x": lambda: imma_stream_case(32, 320, 1, 2, 1, x_scale=1e30),
    "imma_stream_tiny_x": lambda: imma_stream_case(32, 320, 2, 2, 1, x_scale=1e-30),
    "imma_stream_prenormed_groups": lambda: imma_stream_case(64, 1024, 2, 2, 3, np_=8, ng=4),
    "imma_stream_emit_prenormed": lambda: imma_stream_case(64, 2048, 1, 4, 2, np_=16, ng=8, emit=True),
}


emulated = emulation_fixture("qmv_imma_stream", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_integer_mma_matvec_emulated(emulated, name):
    """vc_qmv_imma_stream equals MLX's product (and, emitting, the next norm's input and a partial sum
    of out^2 a slab)."""
    assert_close_to(emulated.run(name), emulated.refs[name])
