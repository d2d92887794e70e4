"""Our own kernel launch (the default where built, VOICECHAT_OWN_LAUNCH=0 for MLX's; csrc/cuda/own_launch.h): the text NVRTC
compiles for each registered instance, the cubin cache on disk, NVRTC itself where a library is
there, and on a CUDA GPU the launch against MLX's own path."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_cuda_sources import kernel
from voicechat.kernels import ext
from voicechat.kernels.gemv import on_cuda_gpu

SOURCES = ext.cuda_sources()
ON_CUDA = on_cuda_gpu()


def _instance_kernel(src: dict, inst: dict) -> str:
    """The kernel part of an instance's text as test_cuda_sources' nvcc check writes it (MLX's
    layout), as our unmangled vc_kernel with the launch bounds our launch states."""
    return 'extern "C" ' + kernel(src, inst, "vc_kernel", launch_bounds=True)


def test_every_instance_text_is_the_header_and_the_kernel_as_mlx_writes_it():
    for src in SOURCES:
        for k, inst in enumerate(src["instances"]):
            text = ext.own_kernel_text(src["name"], k, "sm_90")
            assert text.startswith("// sm_90\n"), src["name"]
            assert src["header"] in text and _instance_kernel(src, inst) in text, (src["name"], k)
            assert text.index(src["header"]) < text.index("vc_kernel("), src["name"]


def test_instance_texts_and_file_names_tell_instances_and_targets_apart():
    src = next(s for s in SOURCES if len(s["instances"]) >= 2)
    a, b = (ext.own_kernel_text(src["name"], k) for k in (0, 1))
    assert a != b and ext.own_kernel_file_name(a) != ext.own_kernel_file_name(b)
    assert ext.own_kernel_file_name(a) == ext.own_kernel_file_name(ext.own_kernel_text(src["name"], 0))
    assert ext.own_kernel_text(src["name"], 0, "sm_100") != a
    name = ext.own_kernel_file_name(a)
    assert name.startswith("vc_") and len(name) == 35 and all(c in "0123456789abcdef" for c in name[3:])
    with pytest.raises(ValueError, match="no instance"):
        ext.own_kernel_text(src["name"], len(src["instances"]))


@pytest.mark.parametrize("name", ["vc_qmv_imma_stream", "vc_decode_attn_part", "vc_rvq_cluster"])
def test_an_instance_text_compiles_with_nvcc(name, tmp_path):
    """The whole translation unit, prelude included, as NVRTC gets it (nvcc here, for sm_90)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    cu = tmp_path / "vc_kernel.cu"
    cu.write_text(ext.own_kernel_text(name, 0, "sm_90"))
    proc = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(tmp_path / "k.cubin"), str(cu)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert b"vc_kernel" in (tmp_path / "k.cubin").read_bytes()


def _cuda_include() -> str | None:
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    return next((f"{h}/include" for h in homes if h and os.path.exists(f"{h}/include/cuda.h")), None)


def test_the_launch_compiles_against_mlx_cuda_headers():
    """The launch itself (VC_OWN_LAUNCH) builds only against mlx-cuda, so a CPU build never compiles
    it: checked here against this mlx's headers (the same in its CUDA wheel) and CUDA's."""
    cuda = _cuda_include()
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if cuda is None or compiler is None:
        pytest.skip("no CUDA headers or no C++ compiler here")
    import mlx.core as mx

    csrc = Path(__file__).parents[1] / "csrc"
    mlx_include = Path(mx.__file__).parent / "include"
    cmd = [compiler, "-std=c++20", "-fsyntax-only", "-DVC_OWN_LAUNCH=1", '-DVC_BACKEND="cuda"', f"-I{mlx_include}",
           f"-I{csrc}", f"-I{csrc / 'compat'}", f"-I{cuda}", str(csrc / "cuda" / "own_launch.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cached_cubin_reads_back_only_for_its_own_text(tmp_path):
    path = str(tmp_path / "cubin" / "k.cubin")  # the folder is made on the first write
    text, cubin = "// sm_90\nkernel text\n", b"\x7fELF\x00\x01binary\xff"
    assert ext.read_cached_cubin(path, text) is None
    ext.write_cached_cubin(path, text, cubin)
    assert ext.read_cached_cubin(path, text) == cubin
    assert ext.read_cached_cubin(path, text + " ") is None  # another text under the same name
    assert ext.read_cached_cubin(path, "// sm_90\nkernel text") is None
    assert sorted(p.name for p in (tmp_path / "cubin").iterdir()) == ["k.cubin"]  # no temporary left
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - len(cubin)])  # the cubin cut off
    assert ext.read_cached_cubin(path, text) is None
    ext.write_cached_cubin(path, text, cubin + b"2")  # rewritten whole
    assert ext.read_cached_cubin(path, text) == cubin + b"2"


def test_cached_cubin_in_an_unwritable_place_raises_and_leaves_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(Exception):
        ext.write_cached_cubin(str(blocker / "k.cubin"), "t", b"c")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def _nvrtc_or_skip() -> None:
    try:
        ext.nvrtc_cubin("extern \"C\" __global__ void vc_kernel() {}\n", "sm_90", [])
    except RuntimeError as e:
        if "cannot be loaded" in str(e):
            pytest.skip("no NVRTC here (VOICECHAT_NVRTC names one)")
        raise


def test_nvrtc_compiles_an_instance_text_to_a_cubin_and_reports_errors():
    _nvrtc_or_skip()
    cubin = ext.nvrtc_cubin(ext.own_kernel_text("vc_decode_attn_part", 0, "sm_90"), "sm_90", ext.cuda_include_dirs())
    assert cubin[:4] == b"\x7fELF" and b"vc_kernel" in cubin
    with pytest.raises(RuntimeError, match="did not compile"):
        ext.nvrtc_cubin('extern "C" __global__ void vc_kernel() { undeclared_name(); }\n', "sm_90", [])


def test_cuda_headers_are_searched_where_mlx_cuda_searches_them(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    toolkit = tmp_path / "cuda"
    for folder in (site / "mlx" / "include" / "cccl", site / "nvidia" / "cu13" / "include", toolkit / "include"):
        folder.mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    mlx_root = str(site / "mlx")
    # the wheel's CCCL, then pip's CUDA runtime headers (the toolkit not searched)
    assert ext.cuda_include_dirs(mlx_root) == [str(site / "mlx" / "include" / "cccl"),
                                               str(site / "nvidia" / "cu13" / "include")]
    shutil.rmtree(site / "nvidia")
    (toolkit / "include" / "cccl").mkdir()
    assert ext.cuda_include_dirs(mlx_root) == [str(site / "mlx" / "include" / "cccl"), str(toolkit / "include"),
                                               str(toolkit / "include" / "cccl")]
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    assert ext.cuda_include_dirs(str(tmp_path / "nowhere"))[0] == str(toolkit / "include")


def test_nvrtc_compiles_the_strided_copy():
    _nvrtc_or_skip()
    text = ext.strided_copy_text("sm_90")
    assert text.startswith("// sm_90\n") and ext.strided_copy_text("sm_100") != text
    cubin = ext.nvrtc_cubin(text, "sm_90", ext.cuda_include_dirs())
    assert cubin[:4] == b"\x7fELF" and b"vc_kernel" in cubin


def test_the_launch_is_built_only_against_mlx_cuda():
    assert ext.own_launch_fallback() is None  # nothing here has failed
    built, wanted = ext.own_launch()
    assert wanted == (os.environ.get("VOICECHAT_OWN_LAUNCH") != "0")
    assert built == ext.build_info()["own_launch"]
    if ext.build_info()["backend"] != "cuda":
        assert not built


# On a CUDA GPU: a fresh process (a kernel's launch path is chosen when it is first made) runs the
# same products through MLX's custom kernels and through ours, then ours again from the cache.
PROBE = r"""
import json, sys
import mlx.core as mx
import numpy as np
from voicechat.kernels import ext
from voicechat.kernels.gemv import quantized_matvec, quantized_matvec_emit_norm, dense_matvec

def q4(n, k, seed):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * k ** -0.5
    w, s, b = mx.quantize(w, group_size=64, bits=4)
    return w, s.astype(mx.bfloat16), b.astype(mx.bfloat16)

out = {}
x = mx.random.normal((1, 4480), key=mx.random.key(1))
w, s, b = q4(22656, 4480, 2)
out["imma_stream"] = quantized_matvec(x, w, s, b)  # one row at in_proj's shape: the integer MMA
out["block"] = quantized_matvec(mx.concatenate([x, x * 2]), w, s, b)  # two rows: the block layout
w2, s2, b2 = q4(4480, 10240, 3)
x2 = mx.random.normal((1, 10240), key=mx.random.key(4))
r = mx.random.normal((1, 4480), key=mx.random.key(5))
y, pre = quantized_matvec_emit_norm(x2, w2, s2, b2, r, mx.ones((4480,)))  # the streamed layout
out["stream_emit"], out["prenormed"] = y, pre.resolve()
d = (mx.random.normal((1152, 4608), key=mx.random.key(6)) * 0.02).astype(mx.bfloat16)
out["dense"] = dense_matvec(mx.random.normal((2, 4608), key=mx.random.key(7)), d)
# views that are not row-contiguous (a column of a wider array, reversed columns, a broadcast row):
# our launch copies them first, as MLX's does
wide = mx.random.normal((4480, 3), key=mx.random.key(8))
mx.eval(wide)
out["column_view"] = quantized_matvec(wide[:, 1:2].T, w, s, b)
rows = mx.random.normal((2, 4608), key=mx.random.key(9))
mx.eval(rows)
out["reversed_view"] = dense_matvec(rows[:, ::-1], d)
out["broadcast_view"] = dense_matvec(mx.broadcast_to(rows[:1], (2, 4608)), d)
mx.eval(out)
np.savez(sys.argv[1], **{k: np.array(v.astype(mx.float32)) for k, v in out.items()})
print(json.dumps({"own_launch": list(ext.own_launch()), "fallback": ext.own_launch_fallback()}))
"""


def _probe(tmp_path: Path, tag: str, own: bool, **env) -> tuple[dict, dict]:
    env = {**os.environ, "VOICECHAT_OWN_LAUNCH": "1" if own else "0", "VOICECHAT_CUBIN_DIR": str(tmp_path / "cubin"),
           **env}
    npz = tmp_path / f"{tag}.npz"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(npz)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    info["stderr"] = proc.stderr
    return info, dict(np.load(npz))


@pytest.mark.skipif(not ON_CUDA, reason="our own launch runs on a CUDA GPU")
def test_own_launch_equals_mlx_custom_kernels_and_reads_its_cache_back(tmp_path):
    info, theirs = _probe(tmp_path, "mlx", own=False)
    if not ext.own_launch()[0]:
        pytest.skip("this CUDA build has no own launch (no CUDA toolkit headers at build time)")
    assert info["own_launch"] == [True, False]
    info, ours = _probe(tmp_path, "own", own=True)
    assert info["own_launch"] == [True, True] and info["fallback"] is None
    cached = sorted(p.name for p in (tmp_path / "cubin").iterdir())
    assert cached and all(name.startswith("vc_") and name.endswith(".cubin") for name in cached)
    _, again = _probe(tmp_path, "again", own=True)
    assert sorted(p.name for p in (tmp_path / "cubin").iterdir()) == cached  # read back, not compiled anew
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)
        np.testing.assert_array_equal(again[name], ours[name], err_msg=name)


@pytest.mark.skipif(not ON_CUDA, reason="our own launch runs on a CUDA GPU")
def test_a_process_whose_own_launch_fails_goes_on_with_mlxs(tmp_path):
    """No NVRTC to be had (VOICECHAT_NVRTC names none): one line on stderr, then MLX's launch, with
    MLX's results."""
    if not ext.own_launch()[0]:
        pytest.skip("this CUDA build has no own launch (no CUDA toolkit headers at build time)")
    _, theirs = _probe(tmp_path, "mlx", own=False)
    info, fallen = _probe(tmp_path, "fallen", own=True, VOICECHAT_NVRTC=str(tmp_path / "no-libnvrtc.so"))
    assert info["own_launch"] == [True, True] and "cannot be loaded" in info["fallback"]
    lines = [line for line in info["stderr"].splitlines() if "our own kernel launch failed" in line]
    assert len(lines) == 1 and "MLX's launch is used" in lines[0]
    assert not (tmp_path / "cubin").exists() or not any((tmp_path / "cubin").iterdir())
    for name, want in theirs.items():
        np.testing.assert_array_equal(fallen[name], want, err_msg=name)


@pytest.mark.skipif(not ON_CUDA, reason="our own launch runs on a CUDA GPU")
def test_an_unwritable_cubin_folder_is_said_once_and_costs_only_compiles(tmp_path):
    if not ext.own_launch()[0]:
        pytest.skip("this CUDA build has no own launch (no CUDA toolkit headers at build time)")
    _, theirs = _probe(tmp_path, "mlx", own=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    info, ours = _probe(tmp_path, "own", own=True, VOICECHAT_CUBIN_DIR=str(blocker / "cubin"))
    assert info["fallback"] is None
    assert info["stderr"].count("cannot keep compiled kernels in") == 1, info["stderr"][-2000:]
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)


def _block_threads(inst: dict) -> int:
    """The block an instance's launch takes, where a template arg fixes it (THREADS, or WARPS x 32)."""
    args = {name: value.split(":", 1)[-1] for name, value in inst["template_args"]}
    return max(int(args.get("THREADS", 0)), 32 * int(args.get("WARPS", 0)))


@pytest.mark.skipif(not ON_CUDA, reason="a cubin loads on a CUDA GPU")
def test_every_registered_instance_takes_its_own_block():
    """A block of more threads than a kernel's registers allow does not run, and nothing reports it: the
    registered instances (the step's) of more than 256 threads (below that any kernel fits) compile to
    kernels that take their THREADS."""
    if not ext.own_launch()[0]:
        pytest.skip("this CUDA build has no own launch (no CUDA toolkit headers at build time)")
    big = [(src["name"], i, _block_threads(inst)) for src in SOURCES for i, inst in enumerate(src["instances"])
           if _block_threads(inst) > 256]
    assert big  # the 4-bit matvecs at out_proj / down_proj, the MoG sampler
    for name, i, threads in big:
        registers, most = ext.cubin_limits(ext.nvrtc_cubin(ext.own_kernel_text(name, i, "sm_90"), "sm_90"))
        assert most >= threads, (name, i, registers, most, threads)
