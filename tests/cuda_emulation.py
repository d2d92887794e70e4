"""Run registered CUDA kernel sources on the CPU (tests/data/cuda_emu/cuda_emu.h: a std::thread per
CUDA thread) and compare them with the kernels' references.

A test module lists its launches as `Case`s (a registered source, its template args, inputs and
output shapes), builds them into one executable with `emulate`, and runs each by name. Where there is
no GPU this checks a kernel's own text: its index math, packing, reductions, barriers and the order
of its shared-memory traffic. It does not check the host side (the launches csrc/ picks), nor the
hardware's speed.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from voicechat.kernels import ext

EMU = Path(__file__).parent / "data" / "cuda_emu"
SOURCES = {s["name"]: s for s in ext.cuda_sources()}
NP = {"float": np.float32, "__nv_bfloat16": np.uint16, "__half": np.float16, "uint32_t": np.uint32,
      "int64_t": np.int64, "int32_t": np.int32}
CUDA_TYPE = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.uint32: "uint32_t",
             mx.int64: "int64_t", mx.int32: "int32_t"}


class Case:
    """One kernel launch: the source, template args, inputs (mx arrays), output shapes / types."""

    def __init__(self, source, template_args, inputs, outputs, blocks, threads, offsets=None, written=()):
        self.source = SOURCES[source] if isinstance(source, str) else source
        self.template_args, self.inputs, self.outputs = template_args, inputs, outputs
        self.blocks, self.threads = blocks, threads
        self.offsets = offsets or [0] * len(inputs)  # elements to shift an input pointer by (unaligned)
        self.written = tuple(written)  # inputs the kernel writes in place: read back after the launch

    def input_types(self):
        return [CUDA_TYPE[a.dtype] for a in self.inputs]

    def cpp(self, name: str) -> str:
        params = [f"const {t}* {n}" for t, n in zip(self.input_types(), self.source["input_names"])]
        params += [f"{t}* {n}" for (t, _), n in zip(self.outputs, self.source["output_names"])]
        consts = []
        for key, value in self.template_args.items():
            if isinstance(value, bool):
                consts.append(f"constexpr bool {key} = {'true' if value else 'false'};")
            elif isinstance(value, int):
                consts.append(f"constexpr int {key} = {value};")
            else:
                consts.append(f"using {key} = {CUDA_TYPE[value]};")
        reads = [f"auto in{i} = cuda_emu_io::read<{t}>(dir + \"/in{i}.bin\");" for i, t in enumerate(self.input_types())]
        outs = [f"std::vector<{t}> out{i}(counts[{i}]); std::memset(out{i}.data(), 0xFF, counts[{i}] * sizeof({t}));"
                for i, (t, _) in enumerate(self.outputs)]
        args = [f"in{i}.data() + offsets[{i}]" for i in range(len(self.inputs))]
        args += [f"out{i}.data()" for i in range(len(self.outputs))]
        writes = [f"cuda_emu_io::write(dir + \"/out{i}.bin\", out{i});" for i in range(len(self.outputs))]
        writes += [f"cuda_emu_io::write(dir + \"/in{i}.after.bin\", in{i});" for i in self.written]
        return f"""
namespace {name} {{
void kernel({", ".join(params)}) {{
  {" ".join(consts)}
{self.source["source"]}
}}
void run(const std::string& dir, int blocks, int threads, const std::vector<size_t>& counts,
         const std::vector<int>& offsets) {{
  {" ".join(reads)}
  {" ".join(outs)}
  cuda_emu::launch(blocks, threads, [&] {{ kernel({", ".join(args)}); }}, {self.source["cluster"]});
  {" ".join(writes)}
}}
}}  // namespace {name}
"""


IO = """
#include <fstream>
#include <string>
namespace cuda_emu_io {
template <typename T>
std::vector<T> read(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::vector<T> v(static_cast<size_t>(f.tellg()) / sizeof(T));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), v.size() * sizeof(T));
  return v;
}
template <typename T>
void write(const std::string& path, const std::vector<T>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
}  // namespace cuda_emu_io
"""


def build(cases: dict[str, Case], tmp: Path, opt: str = "-O1") -> Path:
    """One executable running any of `cases` by name: `exe NAME DIR BLOCKS THREADS ...` (see `run`)."""
    headers = []
    for c in cases.values():
        if c.source["header"] not in headers:
            headers.append(c.source["header"])
    main = ["int main(int argc, char** argv) {", "  const std::string which = argv[1], dir = argv[2];",
            "  const int blocks = std::stoi(argv[3]), threads = std::stoi(argv[4]), n_out = std::stoi(argv[5]);",
            "  std::vector<size_t> counts; std::vector<int> offsets;",
            "  for (int i = 0; i < n_out; ++i) counts.push_back(std::stoull(argv[6 + i]));",
            "  for (int i = 6 + n_out; i < argc; ++i) offsets.push_back(std::stoi(argv[i]));"]
    main += [f'  if (which == "{name}") cuda_emu_kernels::{name}::run(dir, blocks, threads, counts, offsets);'
             for name in cases]
    main += ["  return 0;", "}"]
    # the kernels in namespace cuda_emu_kernels: shared.ld finds their __shared__ statics by it
    text = "\n".join(['#include "cuda_emu.h"', IO, "namespace cuda_emu_kernels {", *headers,
                      *(c.cpp(n) for n, c in cases.items()), "}  // namespace cuda_emu_kernels", *main])
    return compile_emulated(text, tmp / "kernels", opt)


def compile_emulated(text: str, exe: Path, opt: str = "-O1") -> Path:
    """C++ `text` (against tests/data/cuda_emu) built by g++ into `exe` (its source beside it)."""
    cpp = exe.with_suffix(".cpp")
    cpp.write_text(text)
    proc = subprocess.run([shutil.which("g++"), "-std=c++20", opt, "-pthread", "-fdata-sections", "-I", str(EMU),
                           f"-Wl,-T,{EMU / 'shared.ld'}", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _launch(exe: Path, name: str, case: Case, d: Path, **kwargs) -> subprocess.CompletedProcess:
    d.mkdir(parents=True, exist_ok=True)  # a case may run twice (its inputs written again)
    for i, (a, off) in enumerate(zip(case.inputs, case.offsets)):
        data = _bits(a).reshape(-1)
        (d / f"in{i}.bin").write_bytes(np.concatenate([np.zeros(off, data.dtype), data]).tobytes())
    counts = [int(np.prod(shape)) for _, shape in case.outputs]
    return subprocess.run([str(exe), name, str(d), str(case.blocks), str(case.threads), str(len(counts)),
                           *map(str, counts), *map(str, case.offsets)], timeout=300, **kwargs)


def run(exe: Path, name: str, case: Case, tmp: Path) -> list[np.ndarray]:
    """The launch `name` of `exe` on `case`'s inputs: its outputs, then the inputs it writes in place."""
    d = tmp / name
    _launch(exe, name, case, d, check=True)
    outs = [np.fromfile(d / f"out{i}.bin", dtype=NP[t]).reshape(shape) for i, (t, shape) in enumerate(case.outputs)]
    for i in case.written:  # after the outputs: the inputs written in place, as they are after the launch
        a = case.inputs[i]
        data = np.fromfile(d / f"in{i}.after.bin", dtype=NP[CUDA_TYPE[a.dtype]])
        outs.append(data[case.offsets[i]:].reshape(a.shape))
    return outs


def mutated(case: Case, pattern: str, count: int, replacement: str = "") -> Case:
    """`case` with regex `pattern` (found `count` times in its kernel's header and body) replaced: a
    hazard injected, for a test that the emulation catches it."""
    source = dict(case.source)
    found = 0
    for part in ("header", "source"):
        source[part], n = re.subn(pattern, replacement, source[part])
        found += n
    assert found == count, f"{pattern!r} found {found} times, not {count}"
    out = copy.copy(case)
    out.source = source
    return out


def run_mutant(case: Case, tmp: Path) -> tuple[list[np.ndarray] | None, str]:
    """`case` built alone and run: its outputs (None where the emulation aborted) and its stderr."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    exe = build({"mutant": case}, tmp, "-O0")
    proc = _launch(exe, "mutant", case, tmp / "mutant", capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc.stderr
    d = tmp / "mutant"
    return [np.fromfile(d / f"out{i}.bin", dtype=NP[t]).reshape(shape)
            for i, (t, shape) in enumerate(case.outputs)], proc.stderr


class Emulated:
    """The cases of one test module built into one executable, with their references."""

    def __init__(self, exe: Path, cases: dict[str, Case], refs: dict, tmp: Path):
        self.exe, self.cases, self.refs, self.tmp = exe, cases, refs, tmp

    def run(self, name: str, case: Case | None = None, folder: str | None = None) -> list[np.ndarray]:
        """Case `name` (or `case`, compiled as `name`: other inputs) run in its own folder."""
        return run(self.exe, name, case or self.cases[name], self.tmp / (folder or name))


def emulate(tmp_path_factory, tag: str, cases: dict[str, tuple[Case, object]]) -> Emulated:
    """`cases` ({name: (Case, reference)}) built into one executable (skips without g++)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    tmp = tmp_path_factory.mktemp(f"cuda_emu_{tag}")
    built = {name: case for name, (case, _) in cases.items()}
    return Emulated(build(built, tmp), built, {name: ref for name, (_, ref) in cases.items()}, tmp)


def emulation_fixture(tag: str, makers: dict):
    """A module-scoped fixture `emulated`: the cases of `makers` ({name: () -> (Case, reference)})
    built into one executable (a test module assigns it: `emulated = emulation_fixture(...)`)."""

    @pytest.fixture(scope="module")
    def emulated(tmp_path_factory):
        return emulate(tmp_path_factory, tag, {name: make() for name, make in makers.items()})

    return emulated


def as_float(a: np.ndarray, cuda_type: str) -> np.ndarray:
    if cuda_type == "__nv_bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


ULP = {"float": 2e-6, "__half": 1e-3, "__nv_bfloat16": 8e-3}  # a rounding or two of each output type


def assert_rounded_once(emulated: "Emulated", name: str) -> None:
    """Case `name`'s one output equals its reference (float32 math, rounded once to the output type)
    to a rounding or two, relative to the reference's largest value."""
    cuda_type = emulated.cases[name].outputs[0][0]
    (out,) = emulated.run(name)
    want = np.array(emulated.refs[name].astype(mx.float32))
    np.testing.assert_allclose(as_float(out, cuda_type), want, rtol=ULP[cuda_type],
                               atol=ULP[cuda_type] * np.abs(want).max())


# --------------------------------------------------------------------------- inputs

def promote(*dtypes):
    """The dtype MLX's binary ops give these dtypes (what the host code's promote_types gives)."""
    return sum((mx.zeros((1,), dtype=d) for d in dtypes[1:]), mx.zeros((1,), dtype=dtypes[0])).dtype


def normal(shape, dtype, seed=7):
    return mx.array(np.random.default_rng(seed).standard_normal(shape, np.float32)).astype(dtype)


def float_bits(f: float) -> int:
    """A float as the int template argument the kernels read it from (csrc float_bits)."""
    return int(np.float32(f).view(np.int32))


EPS_BITS = float_bits(1e-5)  # the matvecs' norm eps as the kernels take it


def quantized(n, k, bits, group, dtype, seed):
    """Random packed words [n, k * bits / 32] and scales / biases [n, k / group] of `dtype`."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32))
    s = mx.array(rng.standard_normal((n, k // group), np.float32) * 0.02).astype(dtype)
    b = mx.array(rng.standard_normal((n, k // group), np.float32) * 0.02).astype(dtype)
    return w, s, b


def epilogue_ref(ref, epi, residual):
    """vc_gemv::finish's epilogue in MLX ops: 0 as it is, 1 + residual, 2 squared ReLU."""
    if epi == 1:
        return ref + residual.astype(mx.float32)
    if epi == 2:
        return mx.square(mx.maximum(ref, 0.0))
    return ref


def prenormed_inputs(k, m, np_, ng, x_dtype, seed):
    """A norm's input times its weight and partial sums of its squares (np_ a row, ng groups), and
    the normalized input they stand for: each group scaled by rsqrt(its sum / (k / ng) + eps)."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((m, k)).astype(np.float32) * 3.0
    weight = (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    sq = (raw.reshape(m, ng, k // ng) ** 2).sum(-1)  # [m, ng]
    split = rng.dirichlet(np.ones(np_ // ng), size=(m, ng)).astype(np.float32)  # uneven shares of each group's sum
    partials = (sq[..., None] * split).reshape(m, np_)
    scale = 1.0 / np.sqrt(partials.reshape(m, ng, -1).sum(-1) / (k // ng) + 1e-5)
    normed = (raw.reshape(m, ng, -1) * scale[..., None]).reshape(m, k) * weight
    return mx.array(raw * weight).astype(x_dtype), mx.array(partials), mx.array(normed)


def assert_close_to(got: list[np.ndarray], ref, rtol=2e-5) -> None:
    """Each output within rtol of its reference, relative to the reference's largest value."""
    want = [np.array(r) for r in (ref if isinstance(ref, tuple) else (ref,))]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


def _partial_rows(n, rows, blocks, split):
    """The rows each partial of an emitting persistent kernel sums, in order: a tile's `rows` for
    each tile of the grid's whole rounds, then rows / split for each part of the last round's tiles."""
    tiles = n // rows
    whole = tiles // blocks * blocks
    return [rows] * whole + [rows // split] * ((tiles - whole) * split)


def persistent_case(source, layout, n, k, m, rows, blocks, threads, x_dtype=mx.float32, epi=0, bias_dtype=None,
                    np_=0, ng=1, emit=False, x_offset=0, w_offset=0, x_scale=1.0, split=1):
    """A persistent 4-bit kernel's launch (`source` or its _emit twin, `layout` its leading template
    args, tiles of `rows` rows, the last round's cut in `split` parts: one partial each when emitting)
    and MLX's product it must equal: the input plain or normalized by its producer (np_ partials in
    ng groups), w_offset > 0 a misaligned weight (the block's own copies instead of bulk copies)."""
    w, s, b = quantized(n, k, 4, 64, mx.bfloat16, seed=n + k)
    if np_:
        x, partials, normed = prenormed_inputs(k, m, np_, ng, x_dtype, seed=k)
    else:
        x = normed = (normal((m, k), mx.float32) * x_scale).astype(x_dtype)
        partials = s
    bias = normal((n,), bias_dtype, seed=3) if bias_dtype else None
    residual = normal((m, n), mx.float32, seed=5) if epi == 1 or emit else s
    next_w = (1.0 + 0.2 * normal((n,), mx.float32, seed=11)) if emit else None
    args = dict(layout)
    if not emit:
        args["EPI"] = epi
    args.update(HAS_BIAS=bias is not None, NORM=2 if np_ else 0, NP=np_, NG=ng, EPS_BITS=EPS_BITS, TX=x_dtype,
                TS=mx.bfloat16, TB=bias_dtype or mx.bfloat16, TR=residual.dtype, TN=partials.dtype, TO=mx.float32)
    inputs = [x, w, s, b, bias if bias is not None else s, residual, partials]
    outputs = [("float", (m, n))]
    sizes = _partial_rows(n, rows, blocks, split)
    if emit:
        args["TE"] = mx.float32
        inputs.append(next_w)
        outputs += [("float", (m, n)), ("float", (m, len(sizes)))]
    case = Case(source + "_emit" if emit else source, args, inputs, outputs, blocks, threads,
                [x_offset, w_offset] + [0] * (len(inputs) - 2))
    with mx.stream(mx.cpu):
        ref = mx.quantized_matmul(normed.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
        ref = epilogue_ref(ref if bias is None else ref + bias, 1 if emit else epi, residual)
        if emit:
            ends = np.cumsum(sizes)
            sq = np.square(np.array(ref))
            ref = (ref, ref * next_w, mx.array(np.stack([sq[:, e - r:e].sum(-1) for r, e in zip(sizes, ends)], -1)))
    return case, ref
