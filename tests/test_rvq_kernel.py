"""The C++ RVQ argmin search equals its pure-MLX reference: on the CPU the fused loop and the composed
ops; on a CUDA GPU the cluster kernel (through our own launch) and the composed ops."""

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels.rvq import codebook_norms, rvq_search, rvq_search_reference


def _case(batch, dim, size, books, dtype, seed):
    key_r, key_e = mx.random.split(mx.random.key(seed))
    residual = mx.random.normal((batch, dim), key=key_r).astype(dtype)
    codebooks = mx.random.normal((books, size, dim), key=key_e).astype(dtype)
    return residual, codebooks


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("batch", [1, 500])
@pytest.mark.parametrize("start,count", [(0, 1), (2, 5), (0, 31)])
@pytest.mark.parametrize("method", ["fused", "auto", "composed"])
def test_kernel_equals_reference(dtype, batch, start, count, method):
    # the methods one after another in one process: on a GPU the cluster kernel's launches and MLX
    # ops' take each other's cached graphs (a kernel of clusters enters MLX's graph as a child graph,
    # so that MLX's in-place updates of a cached node never mix cluster shapes)
    _skip_fused_without_the_cluster_kernel(method)
    if method == "fused" and batch * count > 2000:
        count = min(count, 5)  # the plain C++ loop at 500 x 31 is slow on this CPU, not wrong
    residual, codebooks = _case(batch, 40, 48, 31, dtype, seed=batch + count)
    norms = codebook_norms(codebooks)
    codes, r = rvq_search(residual, codebooks, start, count, norms, method=method)
    with mx.stream(mx.cpu):  # float32 exactly (a GPU matmul may round through TF32)
        ref_codes, ref_r = rvq_search_reference(residual, codebooks, start, count, norms)
        mx.eval(ref_codes, ref_r)
    assert codes.shape == (batch, count) and codes.dtype == mx.int32
    assert r.shape == (batch, 40) and r.dtype == mx.float32
    np.testing.assert_array_equal(np.array(codes), np.array(ref_codes))
    np.testing.assert_allclose(np.array(r), np.array(ref_r), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("start,count", [(0, 1), (4, 6), (25, 6), (0, 31)])
@pytest.mark.parametrize("method", ["fused", "auto", "composed"])
def test_codes_into_a_row_keep_its_other_columns(dtype, start, count, method):
    _skip_fused_without_the_cluster_kernel(method)
    # The TTS step's use: the codes so far in, that row with the run's columns replaced out.
    residual, codebooks = _case(2, 40, 48, 31, dtype, seed=start + count)
    norms = codebook_norms(codebooks)
    row = mx.random.randint(0, 48, (2, 31), key=mx.random.key(7)).astype(mx.int32)
    codes, r = rvq_search(residual, codebooks, start, count, norms, into=row, method=method)
    alone, r_alone = rvq_search(residual, codebooks, start, count, norms, method=method)
    with mx.stream(mx.cpu):
        ref_codes, ref_r = rvq_search_reference(residual, codebooks, start, count, norms, into=row)
        mx.eval(ref_codes, ref_r)
    assert codes.shape == (2, 31) and codes.dtype == mx.int32
    want = np.array(row)
    want[:, start : start + count] = np.array(alone)
    np.testing.assert_array_equal(np.array(codes), want)
    np.testing.assert_array_equal(np.array(codes), np.array(ref_codes))
    np.testing.assert_array_equal(np.array(r), np.array(r_alone))
    np.testing.assert_allclose(np.array(r), np.array(ref_r), rtol=1e-5, atol=1e-4)


def test_codes_into_must_be_one_integer_row_per_residual():
    residual, codebooks = _case(2, 8, 4, 3, mx.float32, seed=1)
    for bad in (mx.zeros((2, 2), mx.int32), mx.zeros((1, 3), mx.int32), mx.zeros((2, 3), mx.float32)):
        with pytest.raises(ValueError, match="into"):
            rvq_search(residual, codebooks, 0, 1, into=bad)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_full_size_shapes_one_row(dtype):
    _skip_fused_without_the_cluster_kernel("fused")
    residual, codebooks = _case(1, 512, 1024, 31, dtype, seed=3)
    codes, r = rvq_search(residual, codebooks, 9, 22, method="fused")
    with mx.stream(mx.cpu):
        ref_codes, ref_r = rvq_search_reference(residual, codebooks, 9, 22)
        mx.eval(ref_codes, ref_r)
    np.testing.assert_array_equal(np.array(codes), np.array(ref_codes))
    np.testing.assert_allclose(np.array(r), np.array(ref_r), rtol=1e-4, atol=1e-3)


def test_strided_inputs_equal_contiguous_ones_without_copy_nodes_on_cuda():
    # Transposed views (not row-contiguous) give the same codes and residual. On CUDA the kernel
    # makes its inputs row-contiguous itself (only when needed): no Contiguous node per call.
    from voicechat.kernels.gemv import on_cuda_gpu
    from voicechat.llm.opcount import count_ops

    _skip_fused_without_the_cluster_kernel("fused")
    key_r, key_e = mx.random.split(mx.random.key(11))
    residual = mx.random.normal((40, 3), key=key_r).T                            # [3, 40], strided
    codebooks = mx.random.normal((6, 40, 48), key=key_e).transpose(0, 2, 1)   # [6, 48, 40], strided
    norms = codebook_norms(codebooks)
    codes, r = rvq_search(residual, codebooks, 1, 4, norms, method="fused")
    want_codes, want_r = rvq_search(mx.contiguous(residual), mx.contiguous(codebooks), 1, 4, norms, method="fused")
    np.testing.assert_array_equal(np.array(codes), np.array(want_codes))
    np.testing.assert_array_equal(np.array(r), np.array(want_r))
    if on_cuda_gpu():
        assert "Contiguous" not in count_ops(*rvq_search(residual, codebooks, 1, 4, norms, method="fused"))


def test_exact_codewords_are_found_and_residual_vanishes():
    # A residual that is an exact sum of one codeword per codebook decodes to those codewords.
    rng = np.random.default_rng(0)
    books = rng.standard_normal((6, 32, 16)).astype(np.float32) * np.float32(4.0) ** -np.arange(6)[:, None, None]
    chosen = rng.integers(0, 32, 6)
    target = sum(books[q, chosen[q]] for q in range(6))[None]
    for method in ("fused", "composed") if _fused_runs() else ("composed",):
        codes, r = rvq_search(mx.array(target), mx.array(books), 0, 6, method=method)
        np.testing.assert_array_equal(np.array(codes)[0], chosen)
        assert float(mx.abs(r).max()) < 1e-5


def test_ties_pick_the_first_index():
    books = mx.zeros((1, 8, 4))  # every codeword equal: argmin must be 0
    for method in ("fused", "composed") if _fused_runs() else ("composed",):
        codes, _ = rvq_search(mx.ones((2, 4)), books, 0, 1, method=method)
        assert np.array(codes).tolist() == [[0], [0]]


def test_bad_arguments_are_errors():
    residual, codebooks = _case(2, 8, 4, 3, mx.float32, seed=1)
    with pytest.raises(ValueError, match="method must be"):
        rvq_search(residual, codebooks, 0, 1, method="fast")
    with pytest.raises(ValueError, match="out of range"):
        rvq_search(residual, codebooks, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        rvq_search(residual[:, :4], codebooks, 0, 1)


def _fused_runs() -> bool:
    """Whether method "fused" runs here: the CPU's loop, or on a CUDA GPU the cluster kernel (our own
    launch)."""
    from voicechat.kernels._native import kernel_launch
    from voicechat.kernels.gemv import on_cuda_gpu

    return not on_cuda_gpu() or kernel_launch()["launch"] == "own"


def _skip_fused_without_the_cluster_kernel(method: str) -> None:
    if method == "fused" and not _fused_runs():
        pytest.skip("on a CUDA GPU the fused kernel is the cluster kernel, which runs through our own launch")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("size,start,count,into", [(1024, 9, 22, True), (1024, 0, 1, False), (52, 2, 5, True),
                                                   (52, 0, 8, False)])
def test_the_cluster_kernel_is_one_launch_for_the_run(dtype, size, start, count, into):
    """On a CUDA GPU through our own launch, method "auto" for a few rows is one launch of 8-block
    clusters for the whole run, with the reference's codes: the full-size TTS shape, one codebook, and
    K = 52 (blocks of 7 codewords, 3 in the last), each row of a two-row batch its own cluster."""
    from voicechat.kernels._native import kernel_launch
    from voicechat.llm.opcount import count_ops, custom_kernels

    if kernel_launch()["launch"] != "own":
        pytest.skip("the cluster kernel runs on a CUDA GPU through our own launch")
    residual, codebooks = _case(2, 512 if size == 1024 else 40, size, 31, dtype, seed=size + count)
    norms = codebook_norms(codebooks)
    row = mx.random.randint(0, size, (2, 31), key=mx.random.key(5)).astype(mx.int32) if into else None
    codes, r = rvq_search(residual, codebooks, start, count, norms, into=row)
    assert custom_kernels(count_ops(codes, r)) == 1
    with mx.stream(mx.cpu):
        want_codes, want_r = rvq_search_reference(residual, codebooks, start, count, norms, into=row)
        mx.eval(want_codes, want_r)
    np.testing.assert_array_equal(np.array(codes), np.array(want_codes))
    np.testing.assert_allclose(np.array(r), np.array(want_r), rtol=1e-5, atol=1e-3)


def test_fused_on_cuda_without_our_launch_is_an_error():
    """On a CUDA GPU where our own launch is off, method "fused" (the cluster kernel) is refused in one
    line, not run some other way; "auto" takes the composed ops there."""
    from voicechat.kernels.gemv import on_cuda_gpu

    if not on_cuda_gpu() or _fused_runs():
        pytest.skip("the fused kernel runs here")
    residual, codebooks = _case(1, 8, 16, 3, mx.float32, seed=2)
    with pytest.raises(ValueError, match="fused.*own kernel launch"):
        rvq_search(residual, codebooks, 0, 2, method="fused")
