"""The streamed 4-bit matvec (vc_qmv_stream) and its emitting twin, run under the CPU emulation
(tests/cuda_emulation.py), equal MLX's product: the tiles a block walks, the stages it reuses
(refilled by whichever warp is done last), each tile's two row groups, the last round's parts, the
block's own copies of a misaligned weight, the input norm folded into x's int8 terms, and x staged
through shared memory (XS). One row of x, 8-row tiles and 2 stages, as csrc/ops/gemv.cpp launches it."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from cuda_emulation import assert_close_to, build, emulation_fixture, mutated, persistent_case, run, run_mutant


def stream_case(n, k, threads, blocks, xs=0, split=1, **kw):
    """A persistent grid of `blocks` blocks walking the N / 8 tiles, each of the last round's tiles cut
    into `split` parts (one a block); xs: how float32 x reaches each lane (XS)."""
    layout = dict(GROUP=64, K=k, N=n, M=1, ROWS=8, THREADS=threads, STAGES=2, XS=xs, SPLIT=split)
    return persistent_case("vc_qmv_stream", layout, n, k, 1, 8, blocks, threads, split=split, **kw)


CASES = {
    # stages wrapping round (8 tiles over 3 blocks); two chunks of K a thread with unaligned bfloat16 x
    # and a residual; a misaligned weight (the block's own copies) with a bias and squared ReLU
    "stream_q4": lambda: stream_case(64, 640, 32, 3),
    "stream_two_chunks_bf16": lambda: stream_case(48, 2048, 32, 2, x_dtype=mx.bfloat16, epi=1, x_offset=1),
    "stream_own_copies": lambda: stream_case(40, 1024, 32, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
    # a group-normed input; emitting on one (8 groups), on 16 groups (more than a tile's rows), plain
    "stream_prenormed_groups": lambda: stream_case(32, 1024, 32, 3, np_=8, ng=4),
    "stream_emit_prenormed": lambda: stream_case(32, 2048, 64, 2, np_=16, ng=8, emit=True),
    "stream_emit_sixteen_groups": lambda: stream_case(32, 2048, 64, 3, np_=32, ng=16, emit=True),
    "stream_emit": lambda: stream_case(48, 640, 32, 5, emit=True),
    # 3 warps a block, each going on to its next tile without a block barrier (12 tiles over 2
    # blocks); 3 warps, the last with half a warp's chunks
    "stream_warps_drift": lambda: stream_case(96, 3072, 96, 2),
    "stream_idle_lanes": lambda: stream_case(48, 2560, 96, 3),
    # the last round's tiles cut into parts (vc_stream::Walk): 9 tiles over 4 blocks (the ninth in 4
    # parts of 2 rows); emitting, 7 tiles over 3 blocks (the seventh in halves); the block's own copies
    # with parts; 3 warps drifting over 11 tiles on 5 blocks with a group-normed input
    "stream_split_parts": lambda: stream_case(72, 640, 32, 4, split=4),
    "stream_emit_split": lambda: stream_case(56, 1024, 32, 3, split=2, emit=True),
    "stream_split_own_copies": lambda: stream_case(40, 1024, 32, 4, split=4, epi=2, bias_dtype=mx.float32,
                                                   w_offset=1),
    "stream_split_warps_drift": lambda: stream_case(88, 3072, 96, 5, split=4, np_=16, ng=4),
    # huge and tiny x (the int8 terms' exponents); x staged through the last stage with 3 warps drifting
    "stream_huge_x": lambda: stream_case(32, 640, 32, 2, x_scale=1e30),
    "stream_tiny_x": lambda: stream_case(32, 640, 32, 3, x_scale=1e-30),
    "stream_staged_warps_drift": lambda: stream_case(96, 3072, 96, 2, xs=1),
    # the MLP down_proj's K (490 chunks over 512 threads): the products' accuracy
    "stream_accuracy": lambda: stream_case(32, 15680, 512, 2),
}


emulated = emulation_fixture("qmv_stream", CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_matvec_emulated(emulated, name):
    """vc_qmv_stream equals MLX's product (and, emitting, the next norm's input and a partial sum of
    out^2 a tile, and a part of a split last-round tile)."""
    assert_close_to(emulated.run(name), emulated.refs[name])


def test_streamed_products_are_at_least_as_exact_as_mlx(emulated):
    """Against the float64 product of the same 4-bit weights and float32 x (the MLP down_proj's K), the
    integer dot products with x in 4 int8 terms err no more than MLX's own float32 product (2 terms
    would not)."""
    x, w, s, b = emulated.cases["stream_accuracy"].inputs[:4]
    deq = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4)
    exact = np.array(x).astype(np.float64) @ np.array(deq).astype(np.float64).T
    with mx.stream(mx.cpu):
        mlx = np.array(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))

    def error(y):
        return np.abs(y.astype(np.float64) - exact).max() / np.abs(exact).max()

    (ours,) = emulated.run("stream_accuracy")
    assert error(ours) <= error(mlx), (error(ours), error(mlx))


STAGED = ["stream_q4", "stream_own_copies", "stream_emit_prenormed", "stream_warps_drift", "stream_two_chunks_bf16",
          "stream_split_parts"]


def _stages_x(case, xs: int) -> bool:
    """Whether vc_qmv_stream stages x with XS = xs (its STAGE_X): float32, 16-byte aligned x, and with
    XS 1 the block's 4 KB slices (a warp and chunk round) inside one of its 2 stages."""
    a = case.template_args
    if a["TX"] != mx.float32 or case.offsets[0] != 0:
        return False
    cpt = -(-(a["K"] // 32) // a["THREADS"])
    x_bytes = a["THREADS"] // 32 * cpt * 4096
    stage = a["ROWS"] * a["K"] // 2 + 2 * a["ROWS"] * (a["K"] // 64) * 2
    return xs == 2 or x_bytes <= stage


@pytest.fixture(scope="module")
def emulated_staged_x(emulated, tmp_path_factory):
    """STAGED built again with XS 1 (x loaded coalesced and handed round through the last stage's
    buffer) and XS 2 (through a region past the stages)."""
    tmp = tmp_path_factory.mktemp("cuda_emu_qmv_stream_staged_x")
    picked = {}
    for name in STAGED:
        for xs in (1, 2):
            staged = copy.copy(emulated.cases[name])
            staged.template_args = {**staged.template_args, "XS": xs}
            picked[f"{name}_xs{xs}"] = staged
    return build(picked, tmp), picked, tmp


@pytest.mark.parametrize("xs", [1, 2])
@pytest.mark.parametrize("name", STAGED)
def test_streamed_matvec_with_x_staged_gives_the_same_bits(emulated, emulated_staged_x, name, xs):
    """Staging x changes how it reaches each lane, not its values: the outputs are bit-identical to
    the unstaged launch's, where the kernel stages x and where it does not (bfloat16 or misaligned x,
    or with XS 1 slices past a stage)."""
    exe, picked, tmp = emulated_staged_x
    staged = picked[f"{name}_xs{xs}"]
    assert _stages_x(staged, xs) == (name in {1: ["stream_own_copies", "stream_emit_prenormed", "stream_warps_drift"],
                                              2: ["stream_q4", "stream_own_copies", "stream_emit_prenormed",
                                                  "stream_warps_drift", "stream_split_parts"]}[xs])
    want = emulated.run(name)
    got = run(exe, f"{name}_xs{xs}", staged, tmp)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# every mbarrier wait of the streamed walk (an item's first row group, and the second as the product
# gets to it), as the registered (compacted) text has them
WAITS = r"bar_wait\(&bars\[[^;]*\);"


@pytest.mark.parametrize("name", ["stream_emit_prenormed", "stream_q4"])
def test_the_walk_without_its_mbarrier_waits_fails(emulated, tmp_path, name):
    """A hazard the emulation must catch: the streamed kernel with both bar_wait calls deleted reads
    its stages before the bulk copies land (garbage): wrong outputs where each block walks no more
    items than it has stages (stream_emit_prenormed), and where it refills a stage an mbarrier phase
    still owes bytes to, an abort (stream_q4)."""
    outputs, _ = run_mutant(mutated(emulated.cases[name], WAITS, 2), tmp_path)
    if outputs is not None:
        want = emulated.refs[name]
        want = [np.array(r) for r in (want if isinstance(want, tuple) else (want,))]
        assert not all(np.allclose(g, w, rtol=1e-3, atol=1e-3) for g, w in zip(outputs, want))


@pytest.mark.parametrize("name, pattern", [
    # the last warp done with a stage, before it asks for the stage's next tile
    ("stream_q4", r"reads_before_copies\(\);(?=\nwalk\.fetch\(i \+ STAGES)"),
    # the block, once x's staged slices are read out of the stage its next tiles go to
    ("stream_staged_warps_drift", r"reads_before_copies\(\);(?=\n__syncthreads\(\);)"),
])
def test_a_copy_into_a_used_stage_without_the_proxy_fence_fails(emulated, tmp_path, name, pattern):
    """A hazard the emulation must catch: a bulk copy into shared memory the threads have read (a tile
    that landed there) or written (x's slices) with no fence.proxy.async after that use."""
    outputs, stderr = run_mutant(mutated(emulated.cases[name], pattern, 1), tmp_path)
    assert outputs is None and "no fence.proxy.async" in stderr, stderr[-2000:]
