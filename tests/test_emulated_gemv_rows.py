"""The 4-bit matvec kernels at 2 and 4 rows of x, run under the CPU emulation (tests/cuda_emulation.py):
each row's outputs have the bits the same kernel gives that row alone (M = 1, the same launch), and
equal MLX's product. This is what lets sessions step together: a session's ids and codes in a batch
are those it gets alone. Every layout that quantized_matvec and two_head_argmax launch: the streamed
(vc_qmv_stream: 4 rows x 8-row tiles fill a warp's 32 sums), the integer MMA (vc_qmv_imma_stream: one
MMA a pair of rows; at 4 rows a slab's 64 sums end in two turns of 32 lanes), the block layout
(vc_qmv), their emitting twins (the next norm's input and the partial sums of out^2), a producer's
norm, the block's own copies of a misaligned weight, and the two-head argmax."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import assert_close_to, emulate, persistent_case
from test_emulated_qmv import emit_case, prenormed_case, qmv_case
from test_emulated_two_head_argmax import argmax_stream_case


def stream_case(n, k, m, threads, blocks, xs=0, split=1, **kw):
    layout = dict(GROUP=64, K=k, N=n, M=m, ROWS=8, THREADS=threads, STAGES=2, XS=xs, SPLIT=split)
    return persistent_case("vc_qmv_stream", layout, n, k, m, 8, blocks, threads, split=split, **kw)


def imma_case(n, k, m, warps, blocks, **kw):
    layout = dict(K=k, N=n, M=m, WARPS=warps, STAGES=2)
    return persistent_case("vc_qmv_imma_stream", layout, n, k, m, 16, blocks, 32 * warps, **kw)


MAKERS = {
    # the streamed layout: stages wrapping round; emitting on a group-normed input; the last round's
    # tiles cut in parts; bfloat16 x with a residual; the block's own copies (a misaligned weight)
    "stream": lambda m: stream_case(64, 640, m, 32, 3),
    "stream_emit_prenormed": lambda m: stream_case(32, 2048, m, 64, 2, np_=16, ng=8, emit=True),
    "stream_split": lambda m: stream_case(72, 640, m, 32, 4, split=4),
    "stream_residual_bf16": lambda m: stream_case(48, 2048, m, 32, 2, x_dtype=mx.bfloat16, epi=1),
    "stream_own_copies": lambda m: stream_case(40, 1024, m, 32, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
    # the integer MMA: the same, and a group-normed input
    "imma": lambda m: imma_case(160, 640, m, 3, 2),
    "imma_emit_prenormed": lambda m: imma_case(64, 2048, m, 4, 2, np_=16, ng=8, emit=True),
    "imma_prenormed_groups": lambda m: imma_case(64, 1024, m, 2, 3, np_=8, ng=4),
    "imma_residual_bf16": lambda m: imma_case(48, 1024, m, 4, 2, x_dtype=mx.bfloat16, epi=1),
    "imma_own_copies": lambda m: imma_case(64, 512, m, 2, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
    "imma_emit_own_copies": lambda m: imma_case(48, 1024, m, 2, 2, emit=True, w_offset=1),
    # the block layout: rows past N, a producer's norm, emitting
    "block": lambda m: qmv_case(37, 640, m, 4, 64, mx.float32, mx.bfloat16, 8, 32),
    "block_prenormed": lambda m: prenormed_case(24, 1024, m, 8, 4, 8, 64, epi=1),
    "block_emit": lambda m: emit_case(32, 640, m, 8, 32),
    # the two-head argmax: each block's best key a head and row of x, and the logits
    "argmax": lambda m: argmax_stream_case(64, 640, m, mx.float32, True, 2, 3),
}
ROWS = (2, 4)


def _argmax(case) -> bool:
    return case.source["name"].startswith("vc_two_head_argmax")


def row_alone(case, i: int):
    """`case` for row i of x alone (M = 1, the same launch): the inputs with a row per row of x
    sliced, and the outputs' shapes."""
    m = case.template_args["M"]
    alone = copy.copy(case)
    alone.template_args = {**case.template_args, "M": 1}
    alone.inputs = [a[i:i + 1] if (j == 0 or (a.ndim == 2 and a.shape[0] == m)) else a
                    for j, a in enumerate(case.inputs)]
    if _argmax(case):  # keys [m, 2, blocks], logits [2, m, n]
        (kt, ks), (lt, ls) = case.outputs
        alone.outputs = [(kt, (1, *ks[1:])), (lt, (2, 1, ls[2]))]
    else:
        alone.outputs = [(t, (1, *shape[1:])) for t, shape in case.outputs]
    return alone


def row_of(case, outputs: list[np.ndarray], i: int) -> list[np.ndarray]:
    if _argmax(case):
        keys, logits = outputs
        return [keys[i:i + 1], logits[:, i:i + 1]]
    return [o[i:i + 1] for o in outputs]


CASES = [f"{name}_m{m}" for name in MAKERS for m in ROWS]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """Every case (`NAME_m{M}`) and each of its rows alone (`NAME_m{M}_row{i}`), one executable."""
    cases = {}
    for name in MAKERS:
        for m in ROWS:
            case, ref = MAKERS[name](m)
            cases[f"{name}_m{m}"] = (case, ref)
            for i in range(m):
                cases[f"{name}_m{m}_row{i}"] = (row_alone(case, i), None)
    # whole tiles (no split) walked by another grid at 4 rows than alone: gemv.cpp gives 2-4 rows
    # one block an SM where one row has two
    case, ref = stream_case(56, 1024, 4, 32, 2, emit=True)
    cases["stream_other_grid_m4"] = (case, ref)
    for i in range(4):
        alone = row_alone(case, i)
        alone.blocks = 5
        cases[f"stream_other_grid_m4_row{i}"] = (alone, None)
    return emulate(tmp_path_factory, "gemv_rows", cases)


@pytest.mark.parametrize("name", CASES)
def test_each_row_has_the_bits_it_has_alone(emulated, name):
    """Row i of a launch with M rows of x equals, bit for bit, the launch of row i alone."""
    case = emulated.cases[name]
    together = emulated.run(name)
    for i in range(case.template_args["M"]):
        alone = emulated.run(f"{name}_row{i}")
        for got, want in zip(row_of(case, together, i), alone):
            np.testing.assert_array_equal(got, want, err_msg=f"row {i}")


def test_whole_tiles_have_the_bits_they_have_on_another_grid(emulated):
    """The streamed layout without a split: a tile's sums (and emitted partial) do not depend on
    which block walks it, so 4 rows on 2 blocks give each row what it gets alone on 5."""
    test_each_row_has_the_bits_it_has_alone(emulated, "stream_other_grid_m4")
    assert_close_to(emulated.run("stream_other_grid_m4"), emulated.refs["stream_other_grid_m4"])


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("argmax")])
def test_rows_equal_mlx(emulated, name):
    """Every row equals MLX's product (and, emitting, the next norm's input and the partial sums)."""
    assert_close_to(emulated.run(name), emulated.refs[name])


@pytest.mark.parametrize("m", ROWS)
def test_two_head_argmax_rows_find_each_rows_best(emulated, m):
    """The argmax at M rows: each row's best key of each head over the blocks is numpy's argmax of
    that row's reference logits (ties to the first index, the first NaN)."""
    case = emulated.cases[f"argmax_m{m}"]
    keys, _ = emulated.run(f"argmax_m{m}")
    refs = emulated.refs[f"argmax_m{m}"]
    for i in range(m):
        for head in range(2):
            best = int(keys[i, head].max())
            index = (~best) & 0xFFFFFFFF
            ref = refs[head][i]
            want = int(np.argmax(np.where(np.isnan(ref), np.inf, ref))) if np.isnan(ref).any() else int(np.argmax(ref))
            assert index == want, (i, head, index, want)
    assert case.template_args["M"] == m
