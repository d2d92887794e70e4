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
    # 4 MB, less what small buffers freed meanwhile (a GPU allocator can give 16 bytes short of 4 MB)
    assert mx.get_active_memory() - before >= (4 << 20) - 4096


ABORT_IN_C = "import ctypes, voicechat.kernels; ctypes.CDLL(None).abort()"


def _abort(native_trace: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, VOICECHAT_NATIVE_TRACE=native_trace)
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", ABORT_IN_C], capture_output=True, text=True,
                          env=env, timeout=120)


def test_native_trace_prints_the_crashing_threads_frames_then_the_handler_before_it():
    import signal

    proc = _abort("1")
    assert proc.returncode == -signal.SIGABRT
    assert "voicechat: native stack at SIGABRT:" in proc.stderr
    frames = proc.stderr.split("voicechat: native stack at SIGABRT:")[1].splitlines()
    assert any("libc" in line or "abort" in line for line in frames[1:12]), proc.stderr[-2000:]
    assert "Fatal Python error: Aborted" in proc.stderr  # faulthandler's, after ours


def test_no_native_trace_unless_asked():
    import signal

    proc = _abort("0")
    assert proc.returncode == -signal.SIGABRT and "native stack" not in proc.stderr
