"""The RVQ search's whole run in one launch of 8-block thread-block clusters (vc_rvq_cluster), run
under the CPU emulation (tests/cuda_emulation.py: a cluster's blocks at once, its barrier theirs, each
block reading the others' best keys from their shared memory), equals its reference."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import SOURCES, Case, emulate
from voicechat.kernels.rvq import codebook_norms, rvq_search_reference

RVQ_CONFIGS = {"rvq_f32": (mx.float32, 40, 52), "rvq_bf16": (mx.bfloat16, 64, 128)}  # T, D, K
RVQ_RUNS = [(0, 1, False), (2, 5, False), (2, 5, True), (0, 8, True)]  # start, count, into
ROWS, WIDTH = 3, 8  # residual rows; codebooks (the code rows' width)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The cluster kernel for each config, with and without a code row coming in (inputs set per
    test): clusters of 8 blocks a row (K = 52: 7 codewords a block, 3 in the last), 2 warps a block."""
    cb = SOURCES["vc_rvq_cluster"]["cluster"]
    cases = {}
    for tag, (dtype, d, k) in RVQ_CONFIGS.items():
        for into in (False, True):
            cases[f"{tag}_cluster" + ("_into" if into else "")] = (Case(
                "vc_rvq_cluster", dict(T=dtype, D=d, K=k, CB=cb, THREADS=64, INTO=into),
                [mx.zeros((ROWS, d)), mx.zeros((1, k, d), dtype), mx.zeros((1, k)), mx.zeros((4,), mx.int32),
                 mx.zeros((ROWS, WIDTH), mx.int32)],
                [("float", (ROWS, d)), ("int32_t", (ROWS, WIDTH))], ROWS * cb, 64), None)
    return emulate(tmp_path_factory, "rvq", cases)


def _rvq_inputs(tag, count):
    """Random codebooks (WIDTH of them), residual rows and code rows for a config."""
    dtype, d, k = RVQ_CONFIGS[tag]
    keys_ = mx.random.split(mx.random.key(count + d), 3)
    books = mx.random.normal((WIDTH, k, d), key=keys_[0]).astype(dtype)
    residual = 2.0 * mx.random.normal((ROWS, d), key=keys_[1])
    row = mx.random.randint(0, k, (ROWS, WIDTH), key=keys_[2]).astype(mx.int32)
    return books, residual, row, codebook_norms(books)


@pytest.mark.parametrize("tag", list(RVQ_CONFIGS))
@pytest.mark.parametrize("start,count,into", RVQ_RUNS)
def test_rvq_cluster_kernel_emulated(emulated, tag, start, count, into):
    """The codes (into a code row: its earlier codes kept, the new ones in columns start..; else the
    codes alone, columns 0..count - 1) and the residual of the reference's codebook by codebook search."""
    books, residual, row, norms = _rvq_inputs(tag, count)
    col0, w = (start, WIDTH) if into else (0, count)
    name = f"{tag}_cluster" + ("_into" if into else "")
    case = copy.copy(emulated.cases[name])
    case.inputs = [residual, books, norms, mx.array([start, count, col0, w], mx.int32),
                   row if into else mx.zeros((ROWS, WIDTH), mx.int32)]
    case.outputs = [("float", (ROWS, books.shape[2])), ("int32_t", (ROWS, w))]
    r_out, codes = emulated.run(name, case, f"{name}_{start}_{count}")
    with mx.stream(mx.cpu):
        want_codes, want_r = rvq_search_reference(residual, books, start, count, norms, row if into else None)
    np.testing.assert_array_equal(codes, np.array(want_codes))
    np.testing.assert_allclose(r_out, np.array(want_r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tag", list(RVQ_CONFIGS))
def test_each_row_of_a_launch_has_the_bits_of_its_launch_alone(emulated, tag):
    """A cluster a row: sessions' rows searched in one launch each get, bit for bit, the codes and
    residual of their row launched alone (what lets sessions stepped together share the launch)."""
    books, residual, row, norms = _rvq_inputs(tag, 5)
    name = f"{tag}_cluster_into"
    cb = SOURCES["vc_rvq_cluster"]["cluster"]
    runs = mx.array([2, 5, 2, WIDTH], mx.int32)

    def launch(rows, folder):
        case = copy.copy(emulated.cases[name])
        case.inputs = [residual[rows], books, norms, runs, row[rows]]
        n = rows.stop - rows.start
        case.outputs = [("float", (n, books.shape[2])), ("int32_t", (n, WIDTH))]
        case.blocks = n * cb
        return emulated.run(name, case, folder)

    r_all, codes_all = launch(slice(0, ROWS), f"{tag}_rows_all")
    for i in range(ROWS):
        r_i, codes_i = launch(slice(i, i + 1), f"{tag}_rows_{i}")
        np.testing.assert_array_equal(codes_all[i : i + 1], codes_i)
        np.testing.assert_array_equal(r_all[i : i + 1].view(np.uint32), r_i.view(np.uint32))
