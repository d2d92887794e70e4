import mlx.core as mx

from voicechat.kernels import build_info, ext


def test_build_info_names_mlx_and_backend():
    info = build_info()
    assert info["mlx_version"] == mx.__version__
    assert info["backend"] in ("cpu", "cuda", "metal")


def test_array_round_trip_is_zero_copy():
    a = mx.random.normal((257, 33))
    mx.eval(a)
    b = ext.identity(a)
    assert ext.data_ptr(a) == ext.data_ptr(b)
    assert mx.array_equal(a, b)


def test_list_round_trip_is_zero_copy_and_keeps_dtypes():
    xs = [mx.arange(5, dtype=mx.int32), mx.ones((3, 4), dtype=mx.bfloat16), mx.zeros((0,))]
    mx.eval(xs)
    ys = ext.identity_list(xs)
    assert [y.dtype for y in ys] == [x.dtype for x in xs]
    for x, y in zip(xs[:2], ys[:2]):
        assert ext.data_ptr(x) == ext.data_ptr(y)


def test_lazy_arrays_pass_through_unevaluated():
    a = mx.ones((4,)) * 3
    b = ext.identity(a)
    assert mx.array_equal(b, mx.full((4,), 3.0))


def test_non_array_is_rejected():
    import pytest

    with pytest.raises(TypeError):
        ext.identity([1, 2, 3])


def test_no_second_libmlx_is_loaded():
    # The extension's allocations show in mlx.core's allocator: one libmlx in the process.
    mx.eval(mx.zeros((1,)))
    before = mx.get_active_memory()
    a = ext.identity(mx.zeros((1 << 20,), dtype=mx.float32))
    mx.eval(a)
    # 4 MB, less what small buffers freed meanwhile (on the H200: 16 bytes short of 4 MB exactly)
    assert mx.get_active_memory() - before >= (4 << 20) - 4096
