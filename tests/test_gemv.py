"""The matrix-vector products equal MLX's own ops (`mx.quantized_matmul`, `@`, `mx.argmax`).

On a CUDA GPU (the default device there) these run our CUDA kernels, at the model's tiny and
full-size shapes, against references computed on the CPU stream (float32 matmuls on the GPU may round
through TF32). On the CPU the products are MLX's ops, so only the tests of what the C++ path composes
there (epilogues, a producer's norm, the emitted norm input, the gated-GELU input, input shapes and
biases, argument checks, the layers, stacking, the host's launch picks) run; the kernels' own text is
checked on the CPU by tests/test_emulated_*.py (the two-head argmax's ties and NaNs among them).
"""

from __future__ import annotations

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
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on a CUDA GPU (elsewhere MLX's ops)")
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


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", LLM_TINY + ODD_QUANTIZED)
def test_quantized_equals_mlx(n, k, dtype, rows):
    _check_quantized(n, k, dtype, rows)


@pytest.mark.parametrize("bits,group,scale_dtype,dtype", [
    (8, 64, mx.bfloat16, mx.float32), (8, 32, mx.float32, mx.bfloat16), (4, 32, mx.float16, mx.float16),
    (4, 128, mx.float32, mx.float32), (8, 128, mx.bfloat16, mx.bfloat16)])
@needs_cuda
@pytest.mark.parametrize("n,k", [(40, 384), (9, 640)])
def test_quantized_other_packings_equal_mlx(n, k, bits, group, scale_dtype, dtype):
    _check_quantized(n, k, dtype, 2, bits, group, scale_dtype)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", LLM_FULL)
def test_quantized_full_size_equals_mlx(n, k, dtype, rows):
    _check_quantized(n, k, dtype, rows)


def _exact(a: mx.array) -> np.ndarray:
    """`a` as numpy, every value kept (bfloat16 and float16 widen to float32 exactly)."""
    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def _each_row_alone(fn, x):
    """`fn(x)` and `fn` of each row of x alone, evaluated (fn returns an array or a tuple)."""
    as_list = lambda out: list(out) if isinstance(out, (tuple, list)) else [out]  # noqa: E731
    together = as_list(fn(x))
    alone = [as_list(fn(x[i:i + 1])) for i in range(x.shape[0])]
    mx.eval(together, alone)
    return together, alone


ROW_SHAPES = LLM_FULL if ON_CUDA else LLM_TINY


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", ROW_SHAPES)
def test_quantized_rows_have_the_bits_they_have_alone(n, k, dtype, rows):
    """Each row of a 2- or 4-row quantized matvec equals, bit for bit, the matvec of that row alone
    (at every LLM shape: on a CUDA GPU the streamed, integer-MMA and block layouts), plain, with a
    residual and with squared ReLU: a session's step in a batch is its step alone."""
    w, s, b = _quantized(n, k, seed=n + k)
    x = _x((rows, k), dtype, seed=rows) * 3.0
    residual = _x((rows, n), mx.float32, seed=9)
    for kw in ({}, {"squared_relu": True}):
        together, alone = _each_row_alone(lambda v: quantized_matvec(v, w, s, b, **kw), x)
        for i, (row,) in enumerate(alone):
            np.testing.assert_array_equal(_exact(together[0][i:i + 1]), _exact(row), err_msg=f"{kw} row {i}")
    together = quantized_matvec(x, w, s, b, residual=residual)
    for i in range(rows):
        alone = quantized_matvec(x[i:i + 1], w, s, b, residual=residual[i:i + 1])
        np.testing.assert_array_equal(_exact(together[i:i + 1]), _exact(alone), err_msg=f"residual row {i}")


SEAMS = [(192, 320, 256, 4), (192, 320, 256, 1)] + ([(4480, 10240, 22656, 8), (4480, 15680, 22656, 1)] if ON_CUDA
                                                    else [])


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("n,k,n2,groups", SEAMS)
def test_emitted_norm_rows_have_the_bits_they_have_alone(n, k, n2, groups, rows):
    """The LLM's block seams at 2 and 4 rows: a group-prenormed input into a + residual matvec that
    emits the next norm (the mamba out_proj, the MLP down_proj), then the matvec that finishes it
    (the next in_proj): every output and partial of row i equals row i's alone, bit for bit."""
    w1, s1, b1 = _q4(n, k, seed=n)
    w2, s2, b2 = _q4(n2, n, seed=n2)
    norm = 1.0 + 0.2 * mx.random.normal((n,), key=mx.random.key(3))
    x = mx.random.normal((rows, k), key=mx.random.key(1))
    partials = mx.abs(mx.random.normal((rows, 8 * groups), key=mx.random.key(4))) * k
    residual = 3.0 * mx.random.normal((rows, n), key=mx.random.key(2))

    def seam(i, j):
        pre_in = Prenormed(x[i:j], partials[i:j], groups, 1e-5)
        out, pre = quantized_matvec_emit_norm(pre_in, w1, s1, b1, residual[i:j], norm, eps=1e-5)
        return [out, pre.weighted, pre.partials, quantized_matvec(pre, w2, s2, b2, squared_relu=True)]

    together = seam(0, rows)
    mx.eval(together)
    for i in range(rows):
        alone = seam(i, i + 1)
        mx.eval(alone)
        for a, b in zip(together, alone):
            np.testing.assert_array_equal(_exact(a[i:i + 1]), _exact(b), err_msg=f"row {i}")


def test_stream_launch_at_the_step_shapes():
    """The float streamed layout's launch for one row of x, as quantized_matvec picks it on sm_90: the
    MLP down_proj (16 warps' x slices staged through a
    70 KB stage, one block an SM, the last round's 32 tiles cut in 4 parts: 528 + 128 partials), the
    mamba out_proj on its gated group norm (a chunk of K a thread, two blocks an SM, whole tiles);
    bfloat16 x not staged; the mamba in_proj and MLP up_proj (the integer MMA) and the narrower
    shapes (the block layout) not streamed."""
    down = ext.stream_launch(15680, 4480)
    assert down == dict(threads=512, blocks=132, smem=2 * 70560, stage_x=1, split=4, partials=656)
    assert ext.stream_launch(15680, 4480, x_float32=False)["stage_x"] == 0
    out = ext.stream_launch(10240, 4480, prenorm_groups=8)
    assert out == dict(threads=320, blocks=264, smem=2 * 46080, stage_x=1, split=1, partials=560)
    for k, n in ((4480, 22656), (4480, 15680), (4480, 4480), (5120, 4480), (4480, 1024)):
        assert ext.stream_launch(k, n) is None, (k, n)


@pytest.mark.parametrize("rows", [2, 4])
def test_stream_launch_of_rows_adds_up_as_one_row(rows):
    """2 and 4 rows of x at the step's streamed shapes: the threads and the last-round split of one
    row (each output's sum in the same order), its blocks where the split cuts tiles (the down_proj),
    one block an SM where whole tiles let the grid change (the out_proj: a tile's sums and partial do
    not depend on its block), the same partials; the integer-MMA shapes not streamed."""
    for k, n, groups in ((15680, 4480, 1), (10240, 4480, 8)):
        one, more = ext.stream_launch(k, n, prenorm_groups=groups), ext.stream_launch(k, n, prenorm_groups=groups,
                                                                                   rows=rows)
        assert (more["threads"], more["split"], more["partials"]) == (one["threads"], one["split"], one["partials"])
        assert more["blocks"] == (one["blocks"] if one["split"] > 1 else min(one["blocks"], 132)), (k, n)
    assert ext.stream_launch(10240, 4480, prenorm_groups=8, rows=rows)["blocks"] == 132
    for k, n in ((4480, 22656), (4480, 15680)):
        assert ext.stream_launch(k, n, rows=rows) is None, (k, n)


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


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", TTS_TINY + ODD_DENSE)
def test_dense_equals_matmul(n, k, dtype, rows):
    _check_dense(n, k, dtype, rows)


@pytest.mark.parametrize("w_dtype,dtype", [(mx.float32, mx.float32), (mx.float16, mx.float16),
                                           (mx.bfloat16, mx.float16), (mx.float32, mx.bfloat16)])
@pytest.mark.parametrize("with_bias", [False, True])
@needs_cuda
def test_dense_other_dtypes_and_bias(w_dtype, dtype, with_bias):
    _check_dense(48, 136, dtype, 2, w_dtype, with_bias)


@needs_cuda
@pytest.mark.parametrize("n,k,rows", [(24, 100, 1), (24, 96, 3)])  # K % 8 != 0, 3 rows: MLX's op
def test_dense_outside_the_kernel_still_right(n, k, rows):
    _check_dense(n, k, mx.float32, rows)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n,k", TTS_FULL)
def test_dense_full_size_equals_matmul(n, k, dtype, rows):
    _check_dense(n, k, dtype, rows)


@pytest.mark.parametrize("n,k", [(48, 136)] + (TTS_FULL if ON_CUDA else []))
@pytest.mark.parametrize("rows", [1, 2])
def test_dense_sessions_in_one_launch_have_the_bits_they_have_alone(n, k, rows):
    """Sessions' CFG pairs as one launch (`sessions`): each session's rows are its product alone, bit
    for bit, with + residual and the gated-GELU input too; on a CPU MLX's matmul gives the same."""
    sessions = 5
    w = (_x((n, k), mx.float32, seed=n) * k**-0.5).astype(mx.bfloat16)
    x = _x((sessions * rows, k), mx.float32, seed=2)
    gated = _x((sessions * rows, 2 * k), mx.float32, seed=3)
    residual = _x((sessions * rows, n), mx.float32, seed=4)
    together = [dense_matvec(x, w, sessions=sessions), dense_matvec(x, w, residual=residual, sessions=sessions),
                dense_matvec(gated, w, gated_input=True, sessions=sessions)]
    for i in range(sessions):
        part = slice(i * rows, (i + 1) * rows)
        alone = [dense_matvec(x[part], w), dense_matvec(x[part], w, residual=residual[part]),
                 dense_matvec(gated[part], w, gated_input=True)]
        for t, a in zip(together, alone):
            assert mx.array_equal(t[part], a).item()
    assert_close(together[0], reference(dense_matvec_reference, x, w))


def test_dense_sessions_must_split_the_rows_evenly():
    w = mx.zeros((8, 16))
    with pytest.raises(ValueError, match="not 2 equal groups"):
        dense_matvec(mx.zeros((3, 16)), w, sessions=2)
    with pytest.raises(ValueError, match="at least 1"):
        dense_matvec(mx.zeros((2, 16)), w, sessions=0)


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


def _check_two_heads(n, k, dtype, rows, plant_ties):
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
    ids = two_head_argmax(x, head_a, head_b)
    assert ids.dtype == mx.int32 and ids.shape == (rows, 2)
    np.testing.assert_array_equal(np.array(ids), np.array(ref_ids))
    ids2, la, lb = two_head_argmax(x, head_a, head_b, return_logits=True)
    np.testing.assert_array_equal(np.array(ids2), np.array(ref_ids))
    assert_close(la, ref_a)
    assert_close(lb, ref_b)


@needs_cuda
@pytest.mark.parametrize("plant_ties", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_two_head_argmax_equals_argmax(dtype, rows, plant_ties):
    vocab, k = (tiny_config().text_config.vocab_size, tiny_config().text_config.hidden_size)
    _check_two_heads(vocab, k, dtype, rows, plant_ties)


@needs_cuda
@pytest.mark.parametrize("plant_ties", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_two_head_argmax_full_size(dtype, plant_ties):
    cfg = full_config().text_config
    _check_two_heads(cfg.vocab_size, cfg.hidden_size, dtype, 1, plant_ties)


@pytest.mark.parametrize("rows", [2, 4])
def test_two_head_argmax_rows_have_the_bits_they_have_alone(rows):
    """The two-head argmax of 2 and 4 rows (at full size on a CUDA GPU): each row's ids and logits are
    those of that row alone, bit for bit."""
    cfg = (full_config() if ON_CUDA else tiny_config()).text_config
    head_a, head_b = _head(cfg.vocab_size, cfg.hidden_size, seed=1), _head(cfg.vocab_size, cfg.hidden_size, seed=2)
    x = _x((rows, cfg.hidden_size), mx.float32, seed=5)
    together, alone = _each_row_alone(lambda v: two_head_argmax(v, head_a, head_b, return_logits=True), x)
    for i, row in enumerate(alone):
        for a, b in zip(together, row):
            np.testing.assert_array_equal(_exact(a[i:i + 1]), _exact(b), err_msg=f"row {i}")


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_two_head_argmax_takes_heads_not_of_whole_slabs(dtype):
    # 200 rows: the streamed walk cannot take them, so MLX's ops do
    _check_two_heads(200, 128, dtype, 1, plant_ties=True)


@needs_cuda
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
def test_the_kernels_run_on_cuda():
    """Each product is one launch of our kernels there: no MLX matmul in its graph."""
    from voicechat.llm.opcount import count_ops, custom_kernels

    w, s, b = _quantized(64, 128)
    wd = _x((32, 128), mx.bfloat16)
    for out in (quantized_matvec(mx.zeros((1, 128)), w, s, b), dense_matvec(mx.zeros((2, 128)), wd)):
        counts = count_ops(out)
        assert custom_kernels(counts) == 1 and "QuantizedMatmul" not in counts and "Matmul" not in counts, counts


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


# --------------------------------------------------------------------------- norms carried between launches


def _q4(n, k, seed):
    dense = mx.random.normal((n, k), key=mx.random.key(seed)) * k**-0.5
    w, s, b = mx.quantize(dense, group_size=64, bits=4)
    return w, s.astype(mx.bfloat16), b.astype(mx.bfloat16)


# (On a CUDA GPU the mamba out_proj into in_proj shapes take the streamed layout into the integer MMA,
# the others the block layout.)
@pytest.mark.parametrize("n,k,n2,rows", [(4480, 10240, 22656, 1), (192, 320, 256, 2), (128, 192, 40, 1)])
def test_emitted_norm_finished_by_the_next_matvec_equals_rms_norm_between(n, k, n2, rows):
    """A + residual matvec leaving the next RMSNorm half done, finished by the next matvec (the LLM
    block seam, shapes of the mamba out_proj into in_proj among them): the same as the plain matvec,
    MLX's rms_norm, then the next matvec (squared ReLU on it, as the MLP's up_proj)."""
    w1, s1, b1 = _q4(n, k, seed=n)
    w2, s2, b2 = _q4(n2, n, seed=n2)
    x = mx.random.normal((rows, k), key=mx.random.key(1))
    residual = 3.0 * mx.random.normal((rows, n), key=mx.random.key(2))
    norm = nn.RMSNorm(n, eps=1e-5)
    norm.weight = 1.0 + 0.2 * mx.random.normal((n,), key=mx.random.key(3))
    out, pre = quantized_matvec_emit_norm(x, w1, s1, b1, residual, norm.weight, eps=norm.eps)
    got = quantized_matvec(pre, w2, s2, b2, squared_relu=True)
    with mx.stream(mx.cpu):
        want_out = quantized_matvec_reference(x, w1, s1, b1, residual=residual)
        want = quantized_matvec_reference(norm(want_out), w2, s2, b2, squared_relu=True)
        want_normed = np.array(norm(want_out))
    assert isinstance(pre, Prenormed) and pre.groups == 1 and pre.partials.shape[:-1] == (rows,)
    np.testing.assert_allclose(np.array(out), np.array(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(pre.resolve()), want_normed, rtol=1e-5, atol=1e-5)
    want = np.array(want)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("k,groups,per_group,rows", [(10240, 8, 80, 1), (256, 4, 3, 2), (192, 4, 1, 1)])
def test_group_prenormed_input_equals_group_norm_then_matvec(k, groups, per_group, rows):
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
    got = quantized_matvec(pre, w, s, b)
    out, nxt = quantized_matvec_emit_norm(pre, w, s, b, residual, next_norm)
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
    with pytest.raises(ValueError, match="next_norm"):
        ext.quantized_matvec_emit_norm(x, w, s, b, residual, mx.ones((63,)))
    with pytest.raises(ValueError, match="residual"):
        ext.quantized_matvec_emit_norm(x, w, s, b, mx.zeros((1, 7)), mx.ones((64,)))
