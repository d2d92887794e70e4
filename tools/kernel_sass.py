"""The SASS nvcc makes for sm_90 of one registered CUDA kernel instance (template args overridable),
as opcode counts: what a kernel change does to the instructions, and whether two versions compile
to the same code, answered without a GPU. NVRTC (what the extension launches through) may schedule a
little differently; instruction counts and the code's shape agree.

    PYTHONPATH=python python tools/kernel_sass.py vc_qmv_stream_emit K=10240 N=4480 [LEVELS=3 ...]
        [--sass FILE]

The first NAME=VALUE pairs that the source's instances carry pick the instance (K and N: the step's
at that shape); every pair then overrides that template arg. Needs nvcc and cuobjdump on PATH
(cuobjdump also comes in the `nvidia-cuda-cuobjdump` wheel: its nvidia/cu13/bin). --sass writes the
whole listing, one instruction a line without addresses, so that two listings diff cleanly.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_cuda_sources import SOURCES, STUB, wrap  # noqa: E402  (the compile check's own wrapper)

INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?P<text>[^;]*);")


def pick_instance(source: dict, args: dict) -> dict:
    """The first instance whose template args include every given one, with all of them set."""
    for inst in source["instances"]:
        have = dict(inst["template_args"])
        if all(have.get(k, "").split(":", 1)[-1] == v for k, v in args.items() if k in ("K", "N")):
            kinds = {k: have[k].split(":", 1)[0] for k in args if k in have}
            missing = sorted(set(args) - set(kinds))
            if missing:
                raise SystemExit(f"{source['name']} has no template arg {', '.join(missing)}")
            return dict(inst, template_args=[(k, f"{kinds[k]}:{args[k]}" if k in args else v)
                                             for k, v in inst["template_args"]])
    raise SystemExit(f"{source['name']}: no registered instance at {args}")


def sass_lines(source: dict, instance: dict) -> tuple[list[str], str]:
    """The instance's SASS instructions (addresses dropped) and ptxas's resource line."""
    nvcc, cuobjdump = shutil.which("nvcc"), shutil.which("cuobjdump")
    if not nvcc or not cuobjdump:
        raise SystemExit("nvcc and cuobjdump must be on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        cu.write_text(wrap(source, [instance]))
        built = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-I", str(STUB), "-cubin", "-Xptxas", "-v",
                                "-o", str(cubin), str(cu)], capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(built.stderr[-2000:])
        listing = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    used = re.search(r"Used \d+ registers[^\n]*", built.stderr)
    lines = [m.group("text").strip() for m in map(INSTRUCTION.match, listing.splitlines()) if m]
    return lines, used.group(0) if used else "?"


def opcode(line: str) -> str:
    """The opcode without its modifiers or predicate: "@!P0 IDP.4A.U8.S8 ..." -> "IDP"."""
    words = line.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("args", nargs="*", metavar="NAME=VALUE")
    parser.add_argument("--sass", type=Path)
    ns = parser.parse_args()
    source = next((s for s in SOURCES if s["name"] == ns.name), None)
    if source is None:
        raise SystemExit(f"no CUDA source named {ns.name}: {', '.join(s['name'] for s in SOURCES)}")
    args = dict(a.split("=", 1) for a in ns.args)
    lines, used = sass_lines(source, pick_instance(source, args))
    if ns.sass:
        ns.sass.write_text("\n".join(lines) + "\n")
    counts = collections.Counter(map(opcode, lines))
    print(f"{ns.name} {' '.join(ns.args)}: {len(lines)} instructions; {used}")
    print(" ".join(f"{op}:{n}" for op, n in counts.most_common()))


if __name__ == "__main__":
    main()
