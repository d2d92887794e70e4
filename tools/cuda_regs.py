"""Registers, spills and static shared memory of every registered CUDA kernel instance, from
ptxas (`nvcc -Xptxas -v` for sm_90, as tests/test_cuda_sources.py compiles them): occupancy
questions answered without a GPU (65536 registers and 228 KB of shared memory an SM on Hopper).

    PYTHONPATH=python python tools/cuda_regs.py [name-substring ...]
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_cuda_sources import SOURCES, STUB, wrap  # noqa: E402  (the compile check's own wrapper)

SHOWN = ("BITS", "K", "N", "M", "ROWS", "THREADS", "WARPS", "D", "H", "SINGLE", "TX", "T")


def report(source: dict, index: int, instance: dict, nvcc: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "kernel.cu"
        cu.write_text(wrap(source, [instance]))
        proc = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-I", str(STUB), "-cubin", "-Xptxas", "-v",
                               "-o", str(Path(tmp) / "kernel.cubin"), str(cu)], capture_output=True, text=True)
    if proc.returncode:
        return f"{source['name']} {index}: does not compile"
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spill = re.search(r"(\d+) bytes spill stores", proc.stderr)
    stack = re.search(r"(\d+) bytes stack frame", proc.stderr)
    smem = re.search(r"(\d+) bytes smem", proc.stderr)
    args = {name: value.split(":", 1)[1] for name, value in instance["template_args"] if name in SHOWN}
    return (f"{source['name']} {index} {args}: {regs.group(1) if regs else '?'} registers, "
            f"{spill.group(1) if spill else 0} bytes spilled, {stack.group(1) if stack else 0} bytes stack, "
            f"{smem.group(1) if smem else 0} bytes smem")


def main() -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("cuda_regs: nvcc is not on PATH")
    wanted = sys.argv[1:]
    for source in SOURCES:
        if wanted and not any(w in source["name"] for w in wanted):
            continue
        for index, instance in enumerate(source["instances"]):
            print(report(source, index, instance, nvcc), flush=True)


if __name__ == "__main__":
    main()
