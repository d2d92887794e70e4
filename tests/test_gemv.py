"""The matrix-vector kernels equal MLX's own ops (`mx.quantized_matmul`, `@`, `mx.argmax`).

Here (CPU) the fast functions take MLX's ops, so these tests hold the dispatch, shapes and
dtypes; the kernels' arithmetic and index math are checked by a numpy emulation. Run on a CUDA
GPU (the default device there), the same tests run the CUDA kernels, at the model's full-size
shapes too, against references computed on the CPU stream (float32 matmuls on the GPU may round
through TF32).
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.gemv import (
    GemvLinear,
    GemvQuantizedLinear,
    Prenormed,
    dense_matvec,
    dense_matvec_reference,
    on_cuda_gpu,
    quantized_matvec,
    quantized_matvec_emit_norm,
    gelu_gate,
    linear,
    stack_linears,
    quantized_matvec_reference,
    two_head_argmax,
    two_head_argmax_reference,
    use_gemv,
)
from voicechat.synthetic import full_config, inventory, tiny_config

ON_CUDA = on_cuda_gpu()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="full-size shapes: run where the CUDA kernels run")
EMBEDDINGS = ("embed_tokens", "special_emb", "cont_emb")


def _linear_shapes(config, quantized: bool) -> list[tuple[int, int]]:
    """Distinct (N, K) of the LLM's quantized projections + heads, or the TTS model's dense linears."""
    specs, _ = inventory(config, quantize=4)
    shapes = set()
    for s in specs:
        if not s.name.endswith(".weight") or len(s.shape) != 2 or any(e in s.name for e in EMBEDDINGS):
            continue
        if quantized and s.quantize:
            shapes.add((s.shape[0], s.shape[1] * 8))
        elif not quantized and s.name.startswith("tts_model.") and not s.quantize:
            shapes.add(s.shape)
    return sorted(shapes)


LLM_TINY = _linear_shapes(tiny_config(), quantized=True)
LLM_FULL = _linear_shapes(full_config(), quantized=True)
TTS_TINY = _linear_shapes(tiny_config(), quantized=False)
TTS_FULL = _linear_shapes(full_config(), quantized=False)
# (N, K): K not a multiple of 512, N = 1, N not a multiple of the rows a block takes
ODD_QUANTIZED = [(1, 64), (7, 320), (33, 4480)]
ODD_DENSE = [(1, 8), (5, 40), (37, 1160)]

TOL = {mx.float32: 5e-5, mx.bfloat16: 8e-3, mx.float16: 2e-3}  # of the largest |output|


def _on_cpu(fn, *args, **kwargs):
    with mx.stream(mx.cpu):
        out = fn(*args, **kwargs)
        mx.eval(out)
    return out


def reference(fn, x, *args, **kwargs):
    """`fn(x, ...)` as the kernels compute it: on the CPU stream from float32 activations, then cast
    to the dtype `fn` gives (MLX's CPU kernels accumulate bfloat16 activations in bfloat16, ~10%
    off at K = 4480). Off CUDA the fast paths are MLX's ops themselves, taken as they are."""
    if not ON_CUDA:
        return _on_cpu(fn, x, *args, **kwargs)
    dtype = fn(x, *args, **kwargs).dtype  # lazy: only the dtype
    return _on_cpu(lambda: fn(x.astype(mx.float32), *args, **kwargs).astype(dtype))


def assert_close(got: mx.array, ref: mx.array) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.shape, ref.dtype)
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    r = np.array(ref.astype(mx.float32), dtype=np.float64)
    assert np.isfinite(g).all()
    err, scale = np.abs(g - r).max(), np.abs(r).max() + 1e-6
    assert err <= TOL[ref.dtype] * scale, f"max error {err:.3g} vs largest output {scale:.3g}"


def _quantized(n, k, *, bits=4, group=64, dtype=mx.bfloat16, seed=0):
    kw, kv, ks, kb = mx.random.split(mx.random.key(seed), 4)
    shape = (n, k * bits // 32)  # random packed words: two random 16-bit halves
    w = (mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=kw) << 16) | mx.random.randint(
        0, 1 << 16, shape, dtype=mx.uint32, key=kv)
    scales = (mx.random.normal((n, k // group), key=ks) * 0.02).astype(dtype)
    biases = (mx.random.normal((n, k // group), key=kb) * 0.02).astype(dtype)
    return w, scales, biases


def _x(shape, dtype, seed=1):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# --------------------------------------------------------------------------- quantized

def _check_quantized(n, k, dtype, rows, bits=4, group=64, scale_dtype=mx.bfloat16):
    w, s, b = _quantized(n, k, bits=bits, group=group, dtype=scale_dtype, seed=n + k)
    x = _x((rows, k), dtype, seed=rows)
    got = quantized_matvec(x, w, s, b, group, bits)
    assert_close(got, reference(quantized_matvec_reference, x, w, s, b, group, bits))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", LLM_TINY + ODD_QUANTIZED)
def test_quantized_equals_mlx(n, k, dtype, rows):
    _check_quantized(n, k, dtype, rows)


@pytest.mark.parametrize("bits,group,scale_dtype,dtype", [
    (8, 64, mx.bfloat16, mx.float32), (8, 32, mx.float32, mx.bfloat16), (4, 32, mx.float16, mx.float16),
    (4, 128, mx.float32, mx.float32), (8, 128, mx.bfloat16, mx.bfloat16)])
@pytest.mark.parametrize("n,k", [(40, 384), (9, 640)])
def test_quantized_other_packings_equal_mlx(n, k, bits, group, scale_dtype, dtype):
    _check_quantized(n, k, dtype, 2, bits, group, scale_dtype)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", LLM_FULL)
def test_quantized_full_size_equals_mlx(n, k, dtype, rows):
    _check_quantized(n, k, dtype, rows)


def _stream_stages(n: int, k: int, rows: int, most: int = 4) -> int:
    """The most tiles (4-bit, group 64, bfloat16 scales) a streamed block keeps in flight inside 227 KB
    of shared memory, up to `most`, as the extension judges it."""
    for stages in range(most, 2, -1):
        try:
            ext.stream_launch(k, n, rows, stages=stages)
            return stages
        except ValueError:
            pass
    return 2


PERSISTENT = {"streamed": {}, "streamed_pair_form": {"dp4a": -1}, "streamed_dp4a_3_terms": {"dp4a": 3},
              "integer_mma": {"imma": 1}, "integer_mma_streamed": {"imma": 1, "stages": 2},
              "integer_mma_streamed_8_rows": {"imma": 1, "stages": 2, "rows_per_block": 8}}


@needs_cuda
@pytest.mark.parametrize("layout", list(PERSISTENT))
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", LLM_FULL)
def test_persistent_layouts_full_size_equal_mlx(n, k, dtype, rows, layout):
    """The persistent 4-bit layouts at every LLM shape: streamed (bulk copies into shared memory),
    integer MMA (x as int8 block floating point terms on the tensor cores), and the two together (16-row
    slabs, or 8-row ones with the weights as the MMA's other operand, for one row of x); the streamed
    one's products as integer dot products (x in 4 int8 terms: its default for one row; 3 terms) and
    in the float pair form (its default for two rows)."""
    w, s, b = _quantized(n, k, dtype=mx.bfloat16, seed=n + k)
    x = _x((rows, k), dtype, seed=rows)
    launch = PERSISTENT[layout]
    if "imma" not in launch:
        launch = {"stages": _stream_stages(n, k, rows), **launch}
    if layout == "integer_mma_streamed_8_rows" and rows == 2:
        with pytest.raises(ValueError, match="or of 8 for one row of x"):
            quantized_matvec(x, w, s, b, **launch)
        return
    if layout == "integer_mma_streamed" and not _imma_stream_fits(n, k, rows):
        with pytest.raises(ValueError, match="inside 227 KB of shared memory"):
            quantized_matvec(x, w, s, b, **launch)
        return
    got = quantized_matvec(x, w, s, b, **launch)
    assert_close(got, reference(quantized_matvec_reference, x, w, s, b))


def _imma_stream_fits(n: int, k: int, rows: int, stages: int = 2) -> bool:
    """Whether the streamed integer-MMA layout's shared memory takes K (x's expansion and `stages`
    16-row slabs in 227 KB; the MLP down_proj's K = 15680 does not), as the extension judges it."""
    try:
        ext.imma_stream_launch(k, n, rows, 1, 0, stages)
    except ValueError:
        return False
    return True


def test_stream_launch_stages_x_where_its_slices_fit():
    """The float streamed layout's pick of how float32 x reaches each lane (stage_x): through its
    last stages where a block's x slices (4 KB a warp) fit in one, or for one row of x in all but
    the first, else in a region of their own where that leaves the SM its blocks, else each lane
    loads its own chunk; bfloat16 x never."""
    down = ext.stream_launch(15680, 4480)  # the MLP down_proj: 16 warps' slices in a 70 KB stage
    assert (down["rows"], down["stage_x"], down["smem"], down["blocks"]) == (8, 1, 2 * 70560, 132)
    assert ext.stream_launch(15680, 4480, x_float32=False)["stage_x"] == 0
    own = ext.stream_launch(15680, 4480, stage_x=2)  # 64 KB more, still one block an SM
    assert (own["stage_x"], own["smem"], own["blocks"]) == (2, 2 * 70560 + 16 * 4096, 132)
    out = ext.stream_launch(10240, 4480, prenorm_groups=8)  # the mamba out_proj: two blocks an SM
    assert (out["rows"], out["stage_x"], out["smem"], out["blocks"]) == (8, 1, 2 * 46080, 264)
    assert ext.stream_launch(10240, 4480, prenorm_groups=8, stage_x=2)["blocks"] == 132  # asked for: one an SM
    # K = 4480: 5 warps' 20 KB outgrow an 8-row stage (19.7 KB); beside 2 stages their own region
    # would cost the SM blocks (5 -> 3); with 4 stages they pass through the last two
    assert ext.stream_launch(4480, 22656, stages=2)["stage_x"] == 0
    four = ext.stream_launch(4480, 22656, stages=4)
    assert (four["stage_x"], four["smem"], four["blocks"]) == (1, 4 * 20160, 264)
    assert ext.stream_launch(4480, 22656, stages=4, stage_x=2)["smem"] == 4 * 20160 + 5 * 4096
    # 4-row tiles at out_proj: 40 KB of slices through the last two of 4 stages of 22.5 KB, not for
    # two rows of x (80 KB: neither there nor beside the stages at two blocks an SM)
    out4 = ext.stream_launch(10240, 4480, rows=4, stages=4, prenorm_groups=8)
    assert (out4["stage_x"], out4["smem"], out4["blocks"]) == (1, 4 * 23040, 264)
    assert ext.stream_launch(10240, 4480, 2, rows=4, stages=4, prenorm_groups=8)["stage_x"] == 0
    # two rows of x at down_proj: 128 KB of slices fit neither a stage nor beside 2-3 of them
    assert ext.stream_launch(15680, 4480, 2, stages=3)["stage_x"] == 0
    assert ext.stream_launch(15680, 4480, 2, stages=2, stage_x=2)["stage_x"] == 0
    # whatever the shape, rows, stages and mode: a block's shared memory inside the SM's 227 KB
    for n, k in LLM_FULL:
        for m in (1, 2):
            for stages in (2, 3, 4):
                for mode in (-1, 0, 1, 2):
                    try:
                        launch = ext.stream_launch(k, n, m, True, 1, 0, 0, stages, 0, mode)
                    except ValueError:
                        continue
                    assert launch["smem"] + 4096 <= 232448, (n, k, m, stages, mode, launch)
    assert ext.stream_launch(4480, 4480) is None  # the block layout's shape
    with pytest.raises(ValueError, match="streamed layout takes"):
        ext.stream_launch(4480, 22656, stages=20)


def test_stream_launch_takes_warp_groups_where_the_threads_are_a_multiple_of_ks_warps():
    """Warp groups (the streamed kernel's WG): at out_proj's K (10 warps at a chunk a thread) 640 threads
    make two groups of 4 rows each, one block an SM, the last round split in parts of whole rows for
    each group; at K = 4480 four groups; the default's 320 threads one group; threads that are no
    whole multiple stay at 512 at most, and groups at 1024."""
    wg = ext.stream_launch(10240, 4480, prenorm_groups=8, threads=640, stages=3)
    assert (wg["warp_groups"], wg["blocks"], wg["stage_x"], wg["split"]) == (2, 132, 1, 4)
    assert ext.stream_launch(4480, 22656, threads=640, stages=2)["warp_groups"] == 4  # K = 4480: 5 warps
    assert ext.stream_launch(10240, 4480, prenorm_groups=8)["warp_groups"] == 1
    assert ext.stream_launch(10240, 4480, threads=480, stages=2)["warp_groups"] == 1  # 15 warps
    with pytest.raises(ValueError, match="up to 512"):
        ext.stream_launch(10240, 4480, threads=608, stages=2)  # 19 warps: no whole multiple of 10
    with pytest.raises(ValueError, match="1024 in warp groups"):
        ext.stream_launch(10240, 4480, threads=1280, stages=2)  # four groups of two rows: too many threads


def test_imma_stream_launch_takes_8_row_slabs_for_one_row():
    """The streamed integer-MMA layout's 8-row slabs (one row of x) fit the MLP down_proj's K = 15680,
    whose 16-row ones do not: x's expansion (245 groups x 276 bytes) and two slabs of 8 rows."""
    with pytest.raises(ValueError, match="inside 227 KB"):
        ext.imma_stream_launch(15680, 4480)
    down = ext.imma_stream_launch(15680, 4480, rows=8)
    assert (down["rows"], down["smem"], down["blocks"]) == (8, 67712 + 2 * (8 * 7840 + 2 * 8 * 490), 132)
    assert ext.imma_stream_launch(4480, 22656)["rows"] == 16
    for bad, why in [(dict(m=2, rows=8), "or of 8 for one row of x"), (dict(rows=12), "slabs of 16 rows")]:
        with pytest.raises(ValueError, match=why):
            ext.imma_stream_launch(4480, 22656, **bad)


def _printed_under(variable: str, value: str, printed: str) -> subprocess.CompletedProcess:
    """A fresh process with the environment variable set (the extension reads it once) printing
    `printed` (an expression over the down_proj launch `l` and `ext`)."""
    code = f"from voicechat.kernels import ext\nl = ext.stream_launch(15680, 4480)\nprint({printed})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), variable: value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_stage_x_setting_from_the_environment():
    """VOICECHAT_QMV_STAGE_X forces a mode where it applies (the default's pick otherwise); a bad value
    is one clear error."""
    printed = "l['stage_x'], ext.stream_launch(15680, 4480, stage_x=1)['stage_x']"
    for value, want in [("0", "0 1"), ("2", "2 1"), ("auto", "1 1")]:
        done = _printed_under("VOICECHAT_QMV_STAGE_X", value, printed)
        assert done.stdout.split() == want.split(), done.stderr
    bad = _printed_under("VOICECHAT_QMV_STAGE_X", "3", printed)
    assert bad.returncode != 0 and "VOICECHAT_QMV_STAGE_X must be auto, 0, 1 or 2" in bad.stderr


def test_stream_launch_splits_the_last_rounds_tiles():
    """With one block an SM, the last round's tiles are cut into parts (a power of two, whole rows) so
    that each part has a block of its own: the emitting kernel then writes a partial a tile of the
    whole rounds and one a part. Two blocks an SM, a grid the tiles fill evenly, or a last round too
    full to split keep whole tiles."""
    down = ext.stream_launch(15680, 4480)  # 560 tiles over 132 blocks: 528 + 32 tiles in 4 parts
    assert (down["blocks"], down["split"], down["partials"]) == (132, 4, 528 + 32 * 4)
    # the mamba out_proj's 264 blocks (two an SM) keep whole tiles; asked for one an SM, 4 parts (8
    # would want 256 blocks)
    out = ext.stream_launch(10240, 4480, prenorm_groups=8)
    assert (out["blocks"], out["split"], out["partials"]) == (264, 1, 560)
    one = ext.stream_launch(10240, 4480, prenorm_groups=8, blocks_per_sm=1)
    assert (one["blocks"], one["split"], one["partials"]) == (132, 4, 528 + 32 * 4)
    big = ext.stream_launch(10240, 4480, prenorm_groups=8, rows=16)  # 280 tiles over 132: 16 left, 8 parts
    assert (big["blocks"], big["split"], big["partials"]) == (132, 8, 264 + 16 * 8)
    even = ext.stream_launch(15680, 1056)  # 132 tiles: one round, nothing left
    assert (even["blocks"], even["split"], even["partials"]) == (132, 1, 132)
    wide = ext.stream_launch(4480, 22656, stages=4)  # 264 blocks (two an SM)
    assert (wide["blocks"], wide["split"], wide["partials"]) == (264, 1, 2832)


def test_dp4a_is_a_streamed_launch_of_its_levels_and_bad_ones_are_errors():
    """dp4a (the float streamed layout's integer dot products) is a template arg of the streamed
    launch, the same tiles and grid: by default 4 int8 terms of x for one row, the pair form (0) for
    two or with dp4a -1; a level count other than 3 or 4, or a layout other than the float streamed
    one, is one clear error, on every backend."""
    plain, dp = ext.stream_launch(15680, 4480, dp4a=-1), ext.stream_launch(15680, 4480)
    assert (plain["levels"], dp["levels"], ext.stream_launch(15680, 4480, dp4a=3)["levels"]) == (0, 4, 3)
    assert ext.stream_launch(5120, 4480, 2, stages=3)["levels"] == 0
    assert {k: v for k, v in dp.items() if k != "levels"} == {k: v for k, v in plain.items() if k != "levels"}
    w, s, b = _quantized(16, 128)
    x = mx.zeros((1, 128))
    for bad in [dict(dp4a=5), dict(dp4a=2), dict(dp4a=4, warps=2), dict(dp4a=4, imma=1), dict(dp4a=3, stages=-1)]:
        with pytest.raises(ValueError, match="dp4a"):
            ext.quantized_matvec(x, w, s, b, **bad)
    for levels in (1, 2, 5):  # the launch helper refuses what quantized_matvec refuses
        with pytest.raises(ValueError, match="dp4a must be -1, 0, 3 or 4"):
            ext.stream_launch(15680, 4480, dp4a=levels)


def test_split_setting_from_the_environment():
    """VOICECHAT_QMV_SPLIT=1 keeps the last round's tiles whole, auto splits them where the grid is one
    block an SM (down_proj, not out_proj's two), any at any blocks an SM; a bad value is one clear
    error."""
    out_proj = "ext.stream_launch(10240, 4480, prenorm_groups=8)"
    printed = f"l['split'], l['partials'], {out_proj}['split'], {out_proj}['partials']"
    for value, want in [("1", "1 560 1 560"), ("auto", "4 656 1 560"), ("any", "4 656 8 784")]:
        done = _printed_under("VOICECHAT_QMV_SPLIT", value, printed)
        assert done.stdout.split() == want.split(), done.stderr
    bad = _printed_under("VOICECHAT_QMV_SPLIT", "2", "l['split']")
    assert bad.returncode != 0 and "VOICECHAT_QMV_SPLIT must be auto, 1 or any" in bad.stderr


IMMA_STREAMED, STREAMED, BLOCK = {"imma": 1, "stages": 2}, {"stages": 2}, {"stages": -1}
PAIR_FORM = {"stages": 2, "dp4a": -1}  # the float streamed layout's products without the integer dot products


@needs_cuda
@pytest.mark.parametrize("n,k,layout", [(22656, 4480, IMMA_STREAMED), (15680, 4480, IMMA_STREAMED),
                                        (4480, 10240, STREAMED), (4480, 15680, STREAMED), (4480, 4480, BLOCK)])
def test_default_layout_at_the_step_shapes(n, k, layout):
    """One row: the default takes the streamed integer-MMA layout at the wide outputs of K = 4480
    (the mamba in_proj, the MLP up_proj), the float streamed layout at K >= 8192 (the mamba
    out_proj, the MLP down_proj; its integer dot products) and the block layout below: the same bits
    as that layout asked for, and not those of the others (they round differently; the float
    streamed layout's pair form among them)."""
    w, s, b = _quantized(n, k, dtype=mx.bfloat16, seed=n)
    x = _x((1, k), mx.float32, seed=3)
    default = np.array(quantized_matvec(x, w, s, b))
    np.testing.assert_array_equal(default, np.array(quantized_matvec(x, w, s, b, **layout)))
    for other in (IMMA_STREAMED, STREAMED, BLOCK, PAIR_FORM):
        if other is not layout and (other is not IMMA_STREAMED or _imma_stream_fits(n, k, 1)):
            assert not np.array_equal(default, np.array(quantized_matvec(x, w, s, b, **other))), other
    # two rows keep the block layout at every shape
    x2 = _x((2, k), mx.float32, seed=4)
    np.testing.assert_array_equal(np.array(quantized_matvec(x2, w, s, b)),
                                  np.array(quantized_matvec(x2, w, s, b, **BLOCK)))


@needs_cuda
def test_streamed_layout_refuses_what_it_cannot_take():
    w, s, b = _quantized(36, 640, dtype=mx.bfloat16, seed=1)  # 36 rows: no whole tiles of 8
    x = _x((1, 640), mx.float32)
    with pytest.raises(ValueError, match="streamed layout takes N a multiple"):
        quantized_matvec(x, w, s, b, stages=2)
    w, s, b = _quantized(64, 15680, dtype=mx.bfloat16, seed=1)
    with pytest.raises(ValueError, match="227 KB"):
        quantized_matvec(_x((1, 15680), mx.float32), w, s, b, stages=4)
    assert_close(quantized_matvec(_x((1, 15680), mx.float32), w, s, b, stages=2),
                 reference(quantized_matvec_reference, _x((1, 15680), mx.float32), w, s, b))


@needs_cuda
def test_a_block_its_kernel_registers_cannot_take_is_refused_not_launched():
    """Two rows of x and two chunks of it a thread (K = 32768 at 512 threads) need more registers
    than a 512-thread block has: such a block does not run, its output stays unwritten and nothing
    reports it (2026-12-04: a 2-row down_proj launch). Our launch refuses it with the numbers."""
    if not all(ext.own_launch()):
        pytest.skip("our own launch is off or not built")
    w, s, b = _quantized(8, 32768, dtype=mx.bfloat16, seed=3)
    with pytest.raises(ValueError, match=r"registers a thread, so at most \d+ threads a block, and the launch asks "
                                         r"for 512"):
        ext.quantized_matvec(_x((2, 32768), mx.float32), w, s, b, None, 64, 4, stages=2, rows_per_block=4,
                             threads=512)


@needs_cuda
@pytest.mark.parametrize("rows", [2, 4, 8])
def test_streamed_tiles_of_fewer_rows_than_the_norm_has_groups(rows):
    """The input norm's group totals have shared memory of their own: tiles of 2 or 4 rows take 8
    groups (they once did not compile, then were refused)."""
    w, s, b = _quantized(64, 10240, dtype=mx.bfloat16, seed=2)
    raw = _x((1, 10240), mx.float32)
    pre = Prenormed(raw, mx.square(raw).reshape(1, 8, -1).sum(-1), 8, 1e-5)
    with mx.stream(mx.cpu):
        want = quantized_matvec_reference(mx.fast.rms_norm(raw.reshape(1, 8, -1), None, 1e-5).reshape(1, -1), w, s, b)
    assert_close(quantized_matvec(pre, w, s, b, stages=2, rows_per_block=rows), want)
    assert_close(quantized_matvec(pre, w, s, b, rows_per_block=rows), want)


@needs_cuda
@pytest.mark.parametrize("inflight", [2, 5, 16])
def test_integer_mma_groups_in_flight_change_no_bit(inflight):
    """imma > 1: that many 64-wide groups in flight a warp (loaded before their MMAs) instead of the
    default's. Each warp still adds its groups in the same order, so the bits are the default's."""
    w, s, b = _quantized(4480, 10240, dtype=mx.bfloat16, seed=7)
    x = _x((1, 10240), mx.float32, seed=2)
    np.testing.assert_array_equal(np.array(quantized_matvec(x, w, s, b, imma=inflight)),
                                  np.array(quantized_matvec(x, w, s, b, imma=1)))


@needs_cuda
@pytest.mark.parametrize("row_groups, rows_per_block", [(2, 0), (3, 0), (4, 0), (4, 4), (11, 4)])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k,squared_relu", [(22656, 4480, False), (15680, 4480, True), (1000, 640, False)])
def test_row_groups_change_no_bit(n, k, squared_relu, rows, row_groups, rows_per_block):
    """row_groups > 1: each block computes several groups of rows as that many blocks would (at 1000
    rows the last block's groups run past N): the bits of one group a block, through the RMSNorm
    prologue and through a producer's partials, with the default 8 rows a group and with 4."""
    w, s, b = _quantized(n, k, dtype=mx.bfloat16, seed=5)
    x = _x((rows, k), mx.float32, seed=3)
    weight = 1.0 + 0.1 * _x((k,), mx.float32, seed=4)
    partials = mx.abs(_x((rows, 560), mx.float32, seed=6)) * k / 560
    for x_in, extra in ((x, dict(norm=(weight, 1e-5))),
                        (Prenormed(x * weight, partials, 1, 1e-5), {})):
        launch = dict(squared_relu=squared_relu, stages=-1, rows_per_block=rows_per_block, **extra)
        want = quantized_matvec(x_in, w, s, b, **launch)
        got = quantized_matvec(x_in, w, s, b, row_groups=row_groups, **launch)
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_row_groups_are_checked():
    w, s, b = _quantized(40, 640, dtype=mx.bfloat16, seed=1)
    x = _x((1, 640), mx.float32)
    for kwargs, message in ((dict(row_groups=65), r"row_groups must be in \[0, 64\]"),
                            (dict(row_groups=-1), r"row_groups must be in"),
                            (dict(row_groups=2, stages=2), "row_groups > 1 takes the block layout"),
                            (dict(row_groups=2, imma=1), "row_groups > 1 takes the block layout")):
        with pytest.raises(ValueError, match=message):
            quantized_matvec(x, w, s, b, **kwargs)
    with pytest.raises(ValueError, match="row_groups > 1 takes the block layout"):
        ext.quantized_matvec(x, w, s, b, warps=2, row_groups=2)


_ROW_GROUPS_CHILD = """
import sys
import numpy as np
import mlx.core as mx
from voicechat.kernels.gemv import quantized_matvec
w, s, b, x = (mx.array(np.load(sys.argv[1])[k]) for k in ("w", "s", "b", "x"))
np.save(sys.argv[2], np.array(quantized_matvec(x, w, s.astype(mx.bfloat16), b.astype(mx.bfloat16))))
"""


def test_the_default_row_groups_come_from_the_environment(tmp_path):
    """VOICECHAT_QMV_ROW_GROUPS sets the block layout's row groups where a call leaves them to the
    default (an A/B without a rebuild): the same bits (on a CUDA GPU, RG 4 against this process's
    1), and a bad value is one clear error."""
    w, s, b = _quantized(1000, 640, dtype=mx.bfloat16, seed=2)
    x = _x((1, 640), mx.float32, seed=8)
    np.savez(tmp_path / "in.npz", w=np.array(w), s=np.array(s.astype(mx.float32)),
             b=np.array(b.astype(mx.float32)), x=np.array(x))
    want = np.array(quantized_matvec(x, w, s, b))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for value, ok in (("4", True), ("0", False), ("four", False)):
        proc = subprocess.run([sys.executable, "-c", _ROW_GROUPS_CHILD, str(tmp_path / "in.npz"),
                               str(tmp_path / "out.npy")], env={**env, "VOICECHAT_QMV_ROW_GROUPS": value},
                              capture_output=True, text=True, timeout=300)
        if ok:
            assert proc.returncode == 0, proc.stderr[-2000:]
            np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), want)
        else:
            assert proc.returncode != 0
            assert "VOICECHAT_QMV_ROW_GROUPS must be an integer in [1, 64]" in proc.stderr


@needs_cuda
def test_integer_mma_layout_refuses_what_it_cannot_take():
    w, s, b = _quantized(40, 640, dtype=mx.bfloat16, seed=1)  # 40 rows: no whole slabs of 16
    with pytest.raises(ValueError, match="integer-MMA layout takes K a multiple of 64, N of 16"):
        quantized_matvec(_x((1, 640), mx.float32), w, s, b, imma=1)
    w, s, b = _quantized(48, 640, bits=4, group=32, dtype=mx.bfloat16, seed=1)
    with pytest.raises(ValueError, match="groups of 64"):
        quantized_matvec(_x((1, 640), mx.float32), w, s, b, 32, 4, imma=1)
    w, s, b = _quantized(48, 640, dtype=mx.bfloat16, seed=1)
    with pytest.raises(ValueError, match="at most 16 groups in flight"):
        quantized_matvec(_x((1, 640), mx.float32), w, s, b, imma=17)
    # with stages: the integer MMA on bulk-copied slabs
    with pytest.raises(ValueError, match="streamed integer-MMA layout takes 2 stages at least, inside 227 KB"):
        quantized_matvec(_x((1, 640), mx.float32), w, s, b, imma=1, stages=64)
    w, s, b = _quantized(40, 640, dtype=mx.bfloat16, seed=1)
    with pytest.raises(ValueError, match="streamed integer-MMA layout takes K a multiple of 64, N of 16"):
        quantized_matvec(_x((1, 640), mx.float32), w, s, b, imma=1, stages=2)


@pytest.mark.parametrize("shape", [(192,), (1, 1, 192), (2, 1, 192), (3, 192), (4, 2, 192)])
def test_quantized_input_shapes_and_bias(shape):
    w, s, b = _quantized(72, 192)
    bias = _x((72,), mx.float32, seed=5)
    x = _x(shape, mx.float32)
    got = quantized_matvec(x, w, s, b, bias=bias)
    assert got.shape == shape[:-1] + (72,)
    assert_close(got, reference(quantized_matvec_reference, x, w, s, b, bias=bias))


# --------------------------------------------------------------------------- dense

def _check_dense(n, k, dtype, rows, w_dtype=mx.bfloat16, with_bias=False):
    w = (_x((n, k), mx.float32, seed=n + k) * k**-0.5).astype(w_dtype)
    bias = _x((n,), w_dtype, seed=9) if with_bias else None
    x = _x((rows, k), dtype, seed=rows)
    got = dense_matvec(x, w, bias=bias)
    assert_close(got, reference(dense_matvec_reference, x, w, bias=bias))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", TTS_TINY + ODD_DENSE)
def test_dense_equals_matmul(n, k, dtype, rows):
    _check_dense(n, k, dtype, rows)


@pytest.mark.parametrize("w_dtype,dtype", [(mx.float32, mx.float32), (mx.float16, mx.float16),
                                           (mx.bfloat16, mx.float16), (mx.float32, mx.bfloat16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_other_dtypes_and_bias(w_dtype, dtype, with_bias):
    _check_dense(48, 136, dtype, 2, w_dtype, with_bias)


@pytest.mark.parametrize("n,k,rows", [(24, 100, 1), (24, 96, 3)])  # K % 8 != 0, 3 rows: MLX's op
def test_dense_outside_the_kernel_still_right(n, k, rows):
    _check_dense(n, k, mx.float32, rows)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", TTS_FULL)
def test_dense_full_size_equals_matmul(n, k, dtype, rows):
    _check_dense(n, k, dtype, rows)


# --------------------------------------------------------------------------- epilogues

# The LLM's fused epilogues: out_proj / down_proj / o_proj + residual, up_proj squared ReLU; odd ones.
EPILOGUE_QUANTIZED = [(7, 320), (33, 4480)] + ([(4480, 10240), (4480, 15680), (15680, 4480)] if ON_CUDA else [])
EPILOGUE_DENSE = [(5, 40), (37, 1160)] + ([(1152, 1152), (4608, 1152)] if ON_CUDA else [])


def _epilogue_kwargs(epilogue, rows, n, dtype):
    if epilogue == "residual":
        return {"residual": _x((rows, n), dtype, seed=9)}
    return {"squared_relu": True}


@pytest.mark.parametrize("epilogue", ["residual", "squared_relu"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", EPILOGUE_QUANTIZED)
def test_quantized_epilogues_equal_the_composed_ops(n, k, dtype, epilogue):
    w, s, b = _quantized(n, k, seed=n)
    for rows in (1, 2):
        x = _x((rows, k), dtype, seed=rows)
        kw = _epilogue_kwargs(epilogue, rows, n, dtype)
        assert_close(quantized_matvec(x, w, s, b, **kw), reference(quantized_matvec_reference, x, w, s, b, **kw))


@pytest.mark.parametrize("epilogue", ["residual", "squared_relu"])
@pytest.mark.parametrize("n,k", EPILOGUE_DENSE)
def test_dense_epilogues_equal_the_composed_ops(n, k, epilogue):
    w = (_x((n, k), mx.float32, seed=n) * k**-0.5).astype(mx.bfloat16)
    for rows in (1, 2):
        x = _x((rows, k), mx.float32, seed=rows)
        kw = _epilogue_kwargs(epilogue, rows, n, mx.float32)
        assert_close(dense_matvec(x, w, **kw), reference(dense_matvec_reference, x, w, **kw))


def test_epilogue_residual_add_is_exactly_the_separate_add():
    """In float32 the fused add rounds once, as `y + r` does: bit-identical, not just close."""
    w, s, b = _quantized(64, 640, seed=3)
    x, r = _x((2, 640), mx.float32), _x((2, 64), mx.float32, seed=4)
    fused = quantized_matvec(x, w, s, b, residual=r)
    separate = quantized_matvec(x, w, s, b) + r
    assert np.array_equal(np.array(fused), np.array(separate))
    squared = quantized_matvec(x, w, s, b, squared_relu=True)
    assert np.array_equal(np.array(squared), np.array(mx.square(mx.maximum(quantized_matvec(x, w, s, b), 0))))


def test_epilogue_arguments_are_checked():
    w, s, b = _quantized(16, 128)
    x = mx.zeros((1, 128))
    with pytest.raises(ValueError, match="cannot be fused together"):
        quantized_matvec(x, w, s, b, residual=mx.zeros((1, 16)), squared_relu=True)
    with pytest.raises(ValueError, match="residual must be"):
        ext.quantized_matvec(x, w, s, b, residual=mx.zeros((1, 15)))
    with pytest.raises(ValueError, match="activation must be"):
        ext.dense_matvec(x, mx.zeros((16, 128)), activation="gelu")


# --------------------------------------------------------------------------- two heads

def _head(n, k, seed, dtype=mx.bfloat16):
    head = nn.QuantizedLinear(64, 1, bias=False, group_size=64, bits=4)  # then given [n, k] arrays
    head.weight, head.scales, head.biases = _quantized(n, k, dtype=dtype, seed=seed)
    return head


def _copy_row(head, src, dst):
    """Make row dst of the head equal to row src (a tie between their logits)."""
    for name in ("weight", "scales", "biases"):
        a = np.array(head[name].view(mx.uint16) if head[name].dtype == mx.bfloat16 else head[name])
        a[dst] = a[src]
        b = mx.array(a)
        setattr(head, name, b.view(mx.bfloat16) if head[name].dtype == mx.bfloat16 else b)


def _check_two_heads(n, k, dtype, rows, plant_ties, streamed=0):
    head_a, head_b = _head(n, k, seed=1), _head(n, k, seed=2)
    x = _x((rows, k), dtype, seed=3)
    if plant_ties:
        # The max of head a again one row earlier (same block), of head b at row 0 (another block).
        top_a, top_b = (int(_on_cpu(mx.argmax, reference(h, x[:1]), -1)[0]) for h in (head_a, head_b))
        _copy_row(head_a, top_a, max(top_a - 1, 0))
        _copy_row(head_b, top_b, 0)
    ref_a, ref_b = reference(head_a, x), reference(head_b, x)
    ref_ids = _on_cpu(lambda: mx.stack([mx.argmax(ref_a, -1), mx.argmax(ref_b, -1)], -1).astype(mx.int32))
    if plant_ties:
        assert int(ref_ids[0, 0]) == max(top_a - 1, 0) and int(ref_ids[0, 1]) == 0
    ids = two_head_argmax(x, head_a, head_b, streamed=streamed)
    assert ids.dtype == mx.int32 and ids.shape == (rows, 2)
    np.testing.assert_array_equal(np.array(ids), np.array(ref_ids))
    ids2, la, lb = two_head_argmax(x, head_a, head_b, return_logits=True, streamed=streamed)
    np.testing.assert_array_equal(np.array(ids2), np.array(ref_ids))
    assert_close(la, ref_a)
    assert_close(lb, ref_b)


# streamed 1: both heads on the streamed integer-MMA walk, 0 the block layout, -1 the default's pick (on
# CUDA; elsewhere MLX's ops either way)
@pytest.mark.parametrize("streamed", [-1, 0, 1])
@pytest.mark.parametrize("plant_ties", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_two_head_argmax_equals_argmax(dtype, rows, plant_ties, streamed):
    vocab, k = (tiny_config().text_config.vocab_size, tiny_config().text_config.hidden_size)
    _check_two_heads(vocab, k, dtype, rows, plant_ties, streamed)


@needs_cuda
@pytest.mark.parametrize("streamed", [-1, 0, 1])
@pytest.mark.parametrize("plant_ties", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_two_head_argmax_full_size(dtype, plant_ties, streamed):
    cfg = full_config().text_config
    _check_two_heads(cfg.vocab_size, cfg.hidden_size, dtype, 1, plant_ties, streamed)


def _arrays(head):
    return [head.weight, head.scales, head.biases]


def test_two_head_argmax_refuses_a_streamed_it_does_not_know():
    head_a, head_b = _head(192, 128, seed=6), _head(192, 128, seed=7)
    with pytest.raises(ValueError, match="streamed is -1"):
        ext.two_head_argmax(_x((1, 128), mx.float32), _arrays(head_a), _arrays(head_b), streamed=2)


@needs_cuda
def test_two_head_argmax_streamed_refuses_heads_not_of_whole_slabs():
    head_a, head_b = _head(200, 128, seed=6), _head(200, 128, seed=7)  # 200 rows: not whole 16-row slabs
    with pytest.raises(ValueError, match="whole 16-row slabs"):
        ext.two_head_argmax(_x((1, 128), mx.float32), _arrays(head_a), _arrays(head_b), streamed=1)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_two_head_argmax_default_takes_heads_not_of_whole_slabs(dtype):
    # 200 rows: the streamed walk cannot take them, so the default falls back to the block layout
    _check_two_heads(200, 128, dtype, 1, plant_ties=True, streamed=-1)


def test_two_head_argmax_nan_is_the_largest_first_one_wins():
    head_a, head_b = _head(300, 128, seed=4), _head(300, 128, seed=5)
    s = np.array(head_a.scales.astype(mx.float32))
    s[[250, 17, 90]] = np.nan
    head_a.scales = mx.array(s).astype(mx.bfloat16)
    x = _x((1, 128), mx.float32)
    ids = two_head_argmax(x, head_a, head_b)
    assert int(ids[0, 0]) == 17
    np.testing.assert_array_equal(np.array(ids), np.array(_on_cpu(two_head_argmax_reference, x, head_a, head_b)))


def test_two_head_argmax_falls_back_for_heads_it_does_not_take():
    head_a, head_b = _head(200, 128, seed=6), nn.Linear(128, 200)
    x = _x((1, 128), mx.float32)
    np.testing.assert_array_equal(np.array(two_head_argmax(x, head_a, head_b)),
                                  np.array(_on_cpu(two_head_argmax_reference, x, head_a, head_b)))


# --------------------------------------------------------------------------- layers

class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.QuantizedLinear(192, 320, bias=False)
        self.mlp = [nn.Linear(320, 136), nn.Linear(136, 96, bias=False)]
        self.norm = nn.RMSNorm(96)

    def __call__(self, x):
        return self.norm(self.mlp[1](nn.silu(self.mlp[0](self.proj(x)))))


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_use_gemv_swaps_layers_and_keeps_outputs(rows):
    model = _Block()
    model.mlp[0].weight = model.mlp[0].weight.astype(mx.bfloat16)
    x = _x((rows, 192), mx.float32)
    before = {name: id(p) for name, p in _flat(model.parameters())}
    expected = _on_cpu(model, x)
    assert use_gemv(model) is model
    assert type(model.proj) is GemvQuantizedLinear and type(model.mlp[0]) is GemvLinear
    assert type(model.mlp[1]) is GemvLinear and type(model.norm) is nn.RMSNorm
    assert {name: id(p) for name, p in _flat(model.parameters())} == before  # the same arrays
    assert_close(model(x), expected)
    layer = use_gemv(nn.Linear(8, 4))
    assert type(layer) is GemvLinear


def _flat(tree, prefix=""):
    from mlx.utils import tree_flatten
    return tree_flatten(tree, prefix)


# --------------------------------------------------------------------------- kernel arithmetic

def _field(v: np.ndarray, shift: int, width: int) -> np.ndarray:
    """vc_gemv::field: the bits under the exponent of 2^23, then one exact scale and offset."""
    mask = np.uint32(((1 << width) - 1) << shift)
    magic = ((v & mask) | np.uint32(0x4B000000)).view(np.float32)
    unit = np.float32(2.0**-shift)
    return magic * unit + np.float32(-(2.0**23) * unit)


def _unpack8(v: np.ndarray) -> np.ndarray:
    """vc_gemv::unpack8: [..., 4] values of each 8-bit word."""
    hi = v >> np.uint32(16)
    return np.stack([_field(v, 0, 8), _field(v, 8, 8), _field(hi, 0, 8), _field(hi, 8, 8)], axis=-1)


PAIR_C = np.float32(0x4180 * 2.0**-19)
PAIR_LO = np.float32(2.0**-16)


def _pair_dots(w: np.ndarray, xc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vc_gemv::pair_word / pair_fma at 4 bits: (sum(q x), sum(x)) per row, input row and chunk, from
    w [N, chunks, 4] words and xc [M, chunks, 32]: nibbles s and s + 4 of a word OR-ed under
    0x41804180 give the floats 16 + PAIR_C + q_hi + q_lo 2^-16 and 16 + q_lo, the offsets removed per
    chunk."""
    x = xc.reshape(xc.shape[0], xc.shape[1], 4, 8)  # [M, chunks, word, value]
    dot = np.zeros((w.shape[0], x.shape[0], w.shape[1]), np.float32)
    hsum = np.zeros(x.shape[:2], np.float32)
    lsum = np.zeros(x.shape[:2], np.float32)
    for s in range(4):
        u = w << np.uint32(3) if s == 0 else w >> np.uint32(4 * s - 3)
        t = (u & np.uint32(0x00780078)) | np.uint32(0x41804180)
        hi, lo = t.view(np.float32), (t << np.uint32(16)).view(np.float32)  # [N, chunks, word]
        xh = x[..., s + 4]
        xl = (x[..., s].astype(np.float64) - float(PAIR_LO) * xh).astype(np.float32)  # one rounding, as fmaf
        dot += np.einsum("ncw,mcw->nmc", hi, xh, dtype=np.float32) + np.einsum("ncw,mcw->nmc", lo, xl,
                                                                               dtype=np.float32)
        hsum += xh.sum(-1, dtype=np.float32)
        lsum += xl.sum(-1, dtype=np.float32)
    offset = (np.float32(16) + PAIR_C) * hsum + np.float32(16) * lsum
    return dot - offset[None], (np.float32(1) + PAIR_LO) * hsum + lsum


def _emulate_qmv(x, w, scales, biases, group, bits, threads):
    """qmv_accumulate + block_sum in numpy: chunk c (4 words) of a row goes to thread c % threads
    in step c // threads; per chunk scale[c * CHUNK / GROUP] * sum(q x) + bias * sum(x)."""
    n, words = w.shape
    vpw = 32 // bits
    chunk = 4 * vpw
    k = words * vpw
    chunks = k // chunk
    iters = -(-chunks // threads)
    xc = x.reshape(x.shape[0], chunks, chunk)
    if bits == 4:
        dot, xsum = _pair_dots(w.reshape(n, chunks, 4), xc)
    else:
        q = _unpack8(w.reshape(n, chunks, 4)).reshape(n, chunks, chunk)  # [N, chunks, CHUNK]
        dot = np.einsum("ncv,mcv->nmc", q, xc, dtype=np.float32)
        xsum = xc.sum(-1, dtype=np.float32)
    g = np.arange(chunks) * chunk // group
    per_chunk = scales[:, None, g] * dot + biases[:, None, g] * xsum[None]  # [N, M, chunks]
    partial = np.zeros((n, x.shape[0], threads), np.float32)
    seen = np.zeros(chunks, int)
    for t in range(threads):
        for it in range(iters):
            c = it * threads + t
            if c < chunks:
                partial[..., t] += per_chunk[..., c]
                seen[c] += 1
    assert (seen == 1).all()  # every chunk exactly once
    return partial.sum(-1).T  # [M, N]


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (4, 128), (8, 64), (8, 32)])
@pytest.mark.parametrize("k", [4480, 640, 128])
def test_kernel_arithmetic_emulated_in_numpy(bits, group, k):
    w, s, b = _quantized(6, k, bits=bits, group=group, dtype=mx.float32, seed=k)
    x = _x((2, k), mx.float32)
    _, threads, warps = ext.gemv_launch_config("quantized", k, 6, bits)
    threads = 32 if warps else threads  # the warp layout: 32 lanes split K
    got = _emulate_qmv(np.array(x), np.array(w), np.array(s), np.array(b), group, bits, threads)
    want = np.array(_on_cpu(quantized_matvec_reference, x, w, s, b, group, bits))
    # float32 rounding apart only (the GPU tests' TOL would let an offset slip by)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def _argmax_key(v: np.ndarray) -> np.ndarray:
    """vc_gemv::argmax_key for float32 values at indices 0..n-1."""
    b = v.astype(np.float32).view(np.uint32).copy()
    b[np.isnan(v)] = 0x7FFFFFFF
    b[v == 0] = 0
    ordered = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint64)
    return (ordered << np.uint64(32)) | (~np.arange(v.size, dtype=np.uint32)).astype(np.uint64)


@pytest.mark.parametrize("values", [
    [1.0, 3.0, 3.0, -1.0], [-0.0, 0.0], [0.0, -0.0, -1e-30], [-np.inf, -np.inf], [-5.0, -2.0, -2.0, -7.0],
    [1.0, np.nan, 3.0, np.nan], [np.inf, np.nan], [-np.nan, 2.0], [np.inf, 1e38, np.inf], [-3e38, -np.inf]])
def test_argmax_keys_order_like_mx_argmax(values):
    v = np.array(values, np.float32)
    assert int(~np.uint32(_argmax_key(v).max() & np.uint64(0xFFFFFFFF))) == int(mx.argmax(mx.array(v)))


def test_bad_arguments_are_errors():
    w, s, b = _quantized(8, 128)
    with pytest.raises(ValueError, match="K"):
        quantized_matvec(mx.zeros((1, 64)), w, s, b)
    with pytest.raises(ValueError, match="bits"):
        quantized_matvec(mx.zeros((1, 128)), w, s, b, bits=3)
    with pytest.raises(ValueError, match="K"):
        dense_matvec(mx.zeros((1, 5)), mx.zeros((3, 4)))


# --------------------------------------------------------------------------- CUDA only

@needs_cuda
@pytest.mark.parametrize("rows_per_block,threads,warps", [
    (1, 32, 0), (2, 64, 0), (8, 96, 0), (4, 512, 0), (8, 256, 0),  # block layout
    (1, 0, 1), (2, 0, 4), (8, 0, 2), (4, 0, 16), (8, 0, 8)])       # warp layout
def test_launch_overrides_give_the_same_results(rows_per_block, threads, warps):
    w, s, b = _quantized(1000, 4480)
    x = _x((2, 4480), mx.float32)
    ref = reference(quantized_matvec_reference, x, w, s, b)
    launch = dict(rows_per_block=rows_per_block, threads=threads, warps=warps)
    assert_close(ext.quantized_matvec(x, w, s, b, **launch), ref)
    wd = (_x((1000, 1152), mx.float32) * 0.03).astype(mx.bfloat16)
    assert_close(ext.dense_matvec(x[:, :1152], wd, **launch), reference(dense_matvec_reference, x[:, :1152], wd))


@needs_cuda
@pytest.mark.parametrize("x_dtype", [mx.float32, mx.bfloat16])
def test_warp_groups_at_full_size_give_one_groups_bits(x_dtype):
    """Two warp groups at the mamba out_proj (640 threads, one block an SM, 3 stages, the last round in
    parts): the product equals MLX's, and is bit for bit the launch of one group's 320 threads."""
    n, k = 4480, 10240
    w, s, b = _quantized(n, k, seed=n + k)
    x = _x((1, k), x_dtype)
    residual = _x((1, n), mx.float32, seed=5)
    launch = dict(rows_per_block=8, stages=3, residual=residual)
    assert ext.stream_launch(k, n, 1, x_dtype == mx.float32, 1, 8, 640, 3)["warp_groups"] == 2
    got = ext.quantized_matvec(x, w, s, b, threads=640, **launch)
    one = ext.quantized_matvec(x, w, s, b, threads=320, **launch)
    np.testing.assert_array_equal(np.array(got), np.array(one))
    assert_close(got, reference(quantized_matvec_reference, x, w, s, b, residual=residual))


@needs_cuda
def test_the_kernels_run_on_cuda():
    # Launch overrides are only checked on the kernel path: an invalid one proves it is taken.
    w, s, b = _quantized(64, 128)
    with pytest.raises(ValueError, match="rows_per_block"):
        ext.quantized_matvec(mx.zeros((1, 128)), w, s, b, rows_per_block=3)
    with pytest.raises(ValueError, match="rows_per_block"):
        ext.dense_matvec(mx.zeros((2, 128)), mx.zeros((4, 128)), rows_per_block=3)


# --------------------------------------------------------------------------- stacked layers


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_stacked_linears_give_each_layers_output(dtype, bias, rows):
    layers = [nn.Linear(96, n, bias=bias) for n in (64, 16, 40)]
    for layer in layers:
        layer.set_dtype(dtype)
    x = mx.random.normal((rows, 96), key=mx.random.key(rows))
    expected = [layer(x) for layer in layers]
    mx.eval(expected)
    stacked = stack_linears(layers)
    assert type(stacked) is nn.Linear and stacked.weight.shape == (120, 96)
    parts = mx.split(stacked(x), [64, 80], axis=-1)
    for part, layer, want in zip(parts, layers, expected):
        np.testing.assert_allclose(np.array(part.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.array(layer(x).astype(mx.float32)), np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 64), (4, 32)])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_stacked_quantized_linears_give_each_layers_output_exactly(bits, group_size, rows):
    """Quantization is per row, so a stack of quantized layers is the same numbers; LLM q/k/v."""
    layers = [nn.QuantizedLinear(128, n, bias=False, group_size=group_size, bits=bits) for n in (96, 32, 32)]
    x = mx.random.normal((rows, 128), key=mx.random.key(rows))
    expected = [layer(x) for layer in layers]
    mx.eval(expected)
    stacked = stack_linears(layers)
    assert type(stacked) is nn.QuantizedLinear and stacked.weight.shape[0] == 160
    assert (stacked.bits, stacked.group_size) == (bits, group_size)
    parts = mx.split(stacked(x), [96, 128], axis=-1)
    for part, layer, want in zip(parts, layers, expected):
        np.testing.assert_allclose(np.array(part), np.array(want), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.array(layer(x)), np.array(want))
    with pytest.raises(ValueError, match="bits and group size"):
        stack_linears([nn.QuantizedLinear(64, 8, bits=4), nn.QuantizedLinear(64, 8, bits=8)])


def test_stacked_linears_keep_their_class_and_cost_no_memory():
    mx.clear_cache()
    layers = [use_gemv(nn.Linear(512, 512, bias=False)) for _ in range(3)]
    mx.eval([layer.parameters() for layer in layers])
    # on a GPU stream the replaced buffers are released once the stream's work is done: wait for it
    mx.synchronize()
    before = mx.get_active_memory()
    stacked = stack_linears(layers)
    assert type(stacked) is GemvLinear
    mx.synchronize()
    grown = mx.get_active_memory() - before
    assert grown < 512 * 512 * 4  # one stack replaces three weights (it would be 3x that with copies)
    with pytest.raises(TypeError):
        stack_linears([nn.Linear(8, 8), nn.Linear(8, 8, bias=False)])
    with pytest.raises(TypeError):
        stack_linears([nn.Linear(8, 8), use_gemv(nn.Linear(8, 8))])
    with pytest.raises(ValueError, match="input width"):
        stack_linears([nn.Linear(8, 8), nn.Linear(16, 8)])


# --------------------------------------------------------------------------- gated-GELU input


@pytest.mark.parametrize("x_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k,rows", [(1152, 4608, 2), (24, 64, 1), (7, 40, 2)])
def test_gated_input_equals_gelu_gate_then_matvec(n, k, rows, x_dtype):
    w = (mx.random.normal((n, k), key=mx.random.key(n)) * k**-0.5).astype(mx.bfloat16)
    x = mx.random.normal((rows, 2 * k), key=mx.random.key(k)).astype(x_dtype)
    got = dense_matvec(x, w, gated_input=True)
    with mx.stream(mx.cpu):
        want = np.array(dense_matvec_reference(x.astype(mx.float32), w.astype(mx.float32), gated_input=True))
    assert got.shape == (rows, n)
    # float32: the kernel (CUDA) or MLX's composed ops hold float32 sums; bfloat16 x: the output rounds to it
    tol = 2e-5 if x_dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol * np.abs(want).max())


def test_gated_input_through_the_layer_and_bad_inputs():
    layer = use_gemv(nn.Linear(64, 24, bias=True))
    x = mx.random.normal((2, 128), key=mx.random.key(7))
    want = layer(gelu_gate(x))
    np.testing.assert_allclose(np.array(layer(x, gated_input=True)), np.array(want), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2K\]"):
        ext.dense_matvec(x[:, :64], layer.weight, input="gelu_gate")
    with pytest.raises(ValueError, match="input must be"):
        ext.dense_matvec(x[:, :64], layer.weight, input="gelu")


# --------------------------------------------------------------------------- RMSNorm prologue


@pytest.mark.parametrize("x_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k,rows,squared_relu", [(22656, 4480, 1, False), (300, 640, 2, True), (40, 128, 1, False)])
def test_norm_prologue_equals_rms_norm_then_matvec(n, k, rows, squared_relu, x_dtype):
    dense = mx.random.normal((n, k), key=mx.random.key(n)) * k**-0.5
    w, s, b = mx.quantize(dense, group_size=64, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    x = (3.0 * mx.random.normal((rows, k), key=mx.random.key(k))).astype(x_dtype)
    weight = 1.0 + 0.2 * mx.random.normal((k,), key=mx.random.key(1))
    got = quantized_matvec(x, w, s, b, squared_relu=squared_relu, norm=(weight, 1e-5))
    with mx.stream(mx.cpu):
        want = quantized_matvec_reference(x.astype(mx.float32), w, s, b, squared_relu=squared_relu,
                                          norm=(weight, 1e-5))
        want = np.array(want)
    tol = 1e-4 if x_dtype == mx.float32 else 2e-2  # bfloat16 x: the composed path rounds the norm's output
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol * np.abs(want).max())


def test_norm_prologue_rejects_bad_weights():
    layer = nn.QuantizedLinear(128, 24, bias=False, group_size=64, bits=4)
    x = mx.random.normal((1, 128), key=mx.random.key(3))
    with pytest.raises(ValueError, match="norm_weight"):
        ext.quantized_matvec(x, layer.weight, layer.scales, layer.biases, norm_weight=mx.ones((64,)))


# --------------------------------------------------------------------------- norms carried between launches


def _q4(n, k, seed):
    dense = mx.random.normal((n, k), key=mx.random.key(seed)) * k**-0.5
    w, s, b = mx.quantize(dense, group_size=64, bits=4)
    return w, s.astype(mx.bfloat16), b.astype(mx.bfloat16)


# the block layout, and (on a CUDA GPU) the streamed one with 3 tiles in flight a block (its integer
# dot products for one row of x, and its pair form) and the integer tensor-core one
LAYOUTS = [{}, {"stages": 3}, {"stages": 3, "dp4a": -1}, {"imma": 1}, {"imma": 1, "stages": 2}] if ON_CUDA else [{}]


def _fits(layout: dict, k: int, n: int) -> dict:
    """The layout for a K x N product: the integer-MMA one takes K a multiple of 64 and N of 16 only
    (elsewhere the default's)."""
    return {} if "imma" in layout and (k % 64 or n % 16) else layout


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("n,k,n2,rows", [(4480, 10240, 22656, 1), (192, 320, 256, 2), (128, 192, 40, 1)])
def test_emitted_norm_finished_by_the_next_matvec_equals_rms_norm_between(n, k, n2, rows, layout):
    """A + residual matvec leaving the next RMSNorm half done, finished by the next matvec (the LLM
    block seam, shapes of the mamba out_proj into in_proj among them): the same as the plain matvec,
    MLX's rms_norm, then the next matvec (squared ReLU on it, as the MLP's up_proj)."""
    w1, s1, b1 = _q4(n, k, seed=n)
    w2, s2, b2 = _q4(n2, n, seed=n2)
    x = mx.random.normal((rows, k), key=mx.random.key(1))
    residual = 3.0 * mx.random.normal((rows, n), key=mx.random.key(2))
    norm = nn.RMSNorm(n, eps=1e-5)
    norm.weight = 1.0 + 0.2 * mx.random.normal((n,), key=mx.random.key(3))
    out, pre = quantized_matvec_emit_norm(x, w1, s1, b1, residual, norm.weight, eps=norm.eps, **_fits(layout, k, n))
    got = quantized_matvec(pre, w2, s2, b2, squared_relu=True, **_fits(layout, n, n2))
    with mx.stream(mx.cpu):
        want_out = quantized_matvec_reference(x, w1, s1, b1, residual=residual)
        want = quantized_matvec_reference(norm(want_out), w2, s2, b2, squared_relu=True)
        want_normed = np.array(norm(want_out))
    assert isinstance(pre, Prenormed) and pre.groups == 1 and pre.partials.shape[:-1] == (rows,)
    np.testing.assert_allclose(np.array(out), np.array(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(pre.resolve()), want_normed, rtol=1e-5, atol=1e-5)
    want = np.array(want)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("k,groups,per_group,rows", [(10240, 8, 80, 1), (256, 4, 3, 2), (192, 4, 1, 1)])
def test_group_prenormed_input_equals_group_norm_then_matvec(k, groups, per_group, rows, layout):
    """An input its producer normalized by groups (the gated norm the conv + scan kernel leaves for
    the mamba out_proj; 192 / 4 = 48 channels a group is not whole 16-byte chunks: the composed
    path), into a plain and an emitting matvec."""
    n = 4480 if k == 10240 else 72
    w, s, b = _q4(n, k, seed=k)
    raw = 2.0 * mx.random.normal((rows, k), key=mx.random.key(4))
    weight = 1.0 + 0.2 * mx.random.normal((k,), key=mx.random.key(5))
    # each group's sum of squares split unevenly over its partials
    sq = mx.square(raw).reshape(rows, groups, k // groups).sum(-1, keepdims=True)
    split = mx.softmax(mx.random.normal((rows, groups, per_group), key=mx.random.key(6)), axis=-1)
    pre = Prenormed(raw * weight, (sq * split).reshape(rows, groups * per_group), groups, 1e-5)
    residual = mx.random.normal((rows, n), key=mx.random.key(7))
    next_norm = 1.0 + 0.1 * mx.random.normal((n,), key=mx.random.key(8))
    layout = _fits(layout, k, n)
    got = quantized_matvec(pre, w, s, b, **layout)
    out, nxt = quantized_matvec_emit_norm(pre, w, s, b, residual, next_norm, **layout)
    with mx.stream(mx.cpu):
        normed = mx.fast.rms_norm(raw.reshape(rows, groups, -1), None, 1e-5).reshape(rows, k) * weight
        np.testing.assert_allclose(np.array(pre.resolve()), np.array(normed), rtol=1e-5, atol=1e-5)
        want = quantized_matvec_reference(normed, w, s, b)
        want_out = want + residual
        want_next = np.array(mx.fast.rms_norm(want_out, next_norm, 1e-5))
    want = np.array(want)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(np.array(out), np.array(want_out), rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(np.array(nxt.resolve()), want_next, rtol=1e-4, atol=1e-4)


def test_linear_emits_the_next_norm_only_from_our_quantized_layer():
    """`linear(..., emit_norm=...)`: `(out, Prenormed)` where our kernel can leave the norm half done,
    `(out, None)` elsewhere; a Prenormed input works with any layer."""
    base = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4)
    ours = GemvQuantizedLinear.from_quantized_linear(base)
    dense = nn.Linear(128, 64, bias=False)
    norm = nn.RMSNorm(64)
    x = mx.random.normal((1, 128), key=mx.random.key(9))
    residual = mx.random.normal((1, 64), key=mx.random.key(10))
    out, pre = linear(ours, x, residual=residual, emit_norm=norm)
    assert (pre is not None) == on_cuda_gpu()
    plain, none = linear(base, x, residual=residual, emit_norm=norm)
    assert none is None
    np.testing.assert_allclose(np.array(out), np.array(plain), rtol=1e-4, atol=1e-4)
    prenormed = Prenormed(x * 2.0, mx.sum(mx.square(x), -1, keepdims=True), 1, 1e-5)
    for layer in (base, ours, dense):
        want = layer(mx.fast.rms_norm(x, mx.full((128,), 2.0), 1e-5))
        np.testing.assert_allclose(np.array(linear(layer, prenormed)), np.array(want), rtol=1e-4, atol=1e-4)


def test_prenormed_and_emit_reject_bad_inputs():
    w, s, b = _q4(64, 128, seed=1)
    x = mx.random.normal((1, 128), key=mx.random.key(2))
    residual = mx.zeros((1, 64))
    with pytest.raises(ValueError, match="partials"):
        ext.quantized_matvec(x, w, s, b, prenormed=mx.ones((1, 3)), prenorm_groups=2)
    with pytest.raises(ValueError, match="groups must divide"):
        ext.quantized_matvec(x, w, s, b, prenormed=mx.ones((1, 3)), prenorm_groups=3)
    with pytest.raises(ValueError, match="cannot be combined"):
        ext.quantized_matvec(x, w, s, b, prenormed=mx.ones((1, 2)), norm_weight=mx.ones((128,)))
    with pytest.raises(ValueError, match="next_norm"):
        ext.quantized_matvec_emit_norm(x, w, s, b, residual, mx.ones((63,)))
    with pytest.raises(ValueError, match="residual"):
        ext.quantized_matvec_emit_norm(x, w, s, b, mx.zeros((1, 7)), mx.ones((64,)))
    with pytest.raises(ValueError, match="no norm"):
        quantized_matvec(Prenormed(x, mx.ones((1, 1)), 1, 1e-5), w, s, b, norm=(mx.ones((128,)), 1e-5))
