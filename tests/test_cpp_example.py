"""The C++ example (examples/cpp) built with CMake against voicechat's CMake package, as a C++ user
builds it (find_package(voicechat) from `python -m voicechat --cmake-dir`, linking voicechat::kernels),
and run on the inputs and expected outputs its make_inputs.py writes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "cpp"


def _tool(name: str) -> str | None:
    """`name` beside this Python (a venv's cmake and ninja), else on the PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """(the built program, its inputs file)."""
    cmake = _tool("cmake")
    if cmake is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no cmake or no C++ compiler here")
    tmp = tmp_path_factory.mktemp("cpp_example")
    found = _run([sys.executable, "-m", "voicechat", "--cmake-dir"])
    assert found.returncode == 0, found.stderr
    cmake_dir = Path(found.stdout.strip())
    assert (cmake_dir / "voicechatConfig.cmake").is_file()
    inputs = tmp / "inputs.safetensors"
    made = _run([sys.executable, str(EXAMPLE / "make_inputs.py"), str(inputs)])
    assert made.returncode == 0, made.stderr
    configure = [cmake, "-S", str(EXAMPLE), "-B", str(tmp / "build"), f"-Dvoicechat_DIR={cmake_dir}",
                 f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    ninja = _tool("ninja")
    if ninja is not None:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    for step in (configure, [cmake, "--build", str(tmp / "build")]):
        proc = _run(step)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "build" / "voicechat_example", inputs


def test_the_example_matches_the_references(example):
    program, inputs = example
    proc = _run([str(program), str(inputs)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for what in ("rvq_search codes", "rvq_search residual", "rel_pos_attention", "mamba_scan y", "mamba_scan state"):
        assert any(line.startswith(what) and " ok " in line for line in lines), proc.stdout
    assert lines[-1] == "all match"


def test_the_example_fails_on_a_wrong_expected_output(example, tmp_path):
    """It checks: one wrong code in the expected outputs gives a non-zero exit."""
    program, inputs = example
    arrays, meta = mx.load(str(inputs), return_metadata=True)
    arrays["rvq.codes"] = arrays["rvq.codes"] + mx.array([[0, 0, 1, 0, 0]], mx.int32)
    wrong = tmp_path / "wrong.safetensors"
    mx.save_safetensors(str(wrong), arrays, metadata=meta)
    proc = _run([str(program), str(wrong)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rvq_search codes       MISMATCH" in proc.stdout
