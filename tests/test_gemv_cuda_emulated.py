"""The GEMV CUDA kernel sources, run on the CPU under a small CUDA emulation (one std::thread per
CUDA thread, tests/data/cuda_emu/cuda_emu.h), equal MLX's ops.

Where there is no GPU this checks the kernels' own text: index math, packing, the block
reductions, the clamped last rows, the argmax keys and ties, the unaligned-activation path.
It does not check the host side (csrc/gemv.cpp's template args and launch), nor anything about
the hardware (alignment faults, speed): those need the CUDA run of tests/test_gemv.py.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from voicechat.kernels import ext
from voicechat.kernels.add_rms_norm import add_rms_norm_guided_reference, add_rms_norm_reference
from voicechat.kernels.code_embedding import code_embedding_reference
from voicechat.kernels.decode_attention import decode_attention_reference
from voicechat.kernels.gemv import gelu_gate
from voicechat.kernels.mog_sample import mog_sample_reference
from voicechat.kernels.rvq import codebook_norms, rvq_search_reference
from voicechat.kernels.causal_conv import causal_conv_silu_reference
from voicechat.kernels.mamba_scan import mamba_scan_packed_reference
from voicechat.kernels.gated_rms_norm import gated_rms_norm_reference
from voicechat.kernels.qkv_heads import qkv_heads_reference, rope_inv_freq

EMU = Path(__file__).parent / "data" / "cuda_emu"
SOURCES = {s["name"]: s for s in ext.cuda_sources()}
NP = {"float": np.float32, "__nv_bfloat16": np.uint16, "__half": np.float16, "uint32_t": np.uint32,
      "int64_t": np.int64, "int32_t": np.int32}
CUDA_TYPE = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.uint32: "uint32_t",
             mx.int64: "int64_t", mx.int32: "int32_t"}


class Case:
    """One kernel launch: the source, template args, inputs (mx arrays), output shapes / types."""

    def __init__(self, source, template_args, inputs, outputs, blocks, threads, offsets=None, written=()):
        self.source, self.template_args, self.inputs, self.outputs = SOURCES[source], template_args, inputs, outputs
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


def build(cases: dict[str, Case], tmp: Path, defines: tuple[str, ...] = ()) -> Path:
    headers = []
    for c in cases.values():
        if c.source["header"] not in headers:
            headers.append(c.source["header"])
    main = ["int main(int argc, char** argv) {", "  const std::string which = argv[1], dir = argv[2];",
            "  const int blocks = std::stoi(argv[3]), threads = std::stoi(argv[4]), n_out = std::stoi(argv[5]);",
            "  std::vector<size_t> counts; std::vector<int> offsets;",
            "  for (int i = 0; i < n_out; ++i) counts.push_back(std::stoull(argv[6 + i]));",
            "  for (int i = 6 + n_out; i < argc; ++i) offsets.push_back(std::stoi(argv[i]));"]
    main += [f'  if (which == "{name}") {name}::run(dir, blocks, threads, counts, offsets);' for name in cases]
    main += ["  return 0;", "}"]
    text = "\n".join(['#include "cuda_emu.h"', IO, *headers, *(c.cpp(n) for n, c in cases.items()), *main])
    return compile_emulated(text, tmp / "kernels", defines)


def compile_emulated(text: str, exe: Path, defines: tuple[str, ...] = (), opt: str = "-O1") -> Path:
    """C++ `text` (against tests/data/cuda_emu) built by g++ into `exe` (its source beside it)."""
    cpp = exe.with_suffix(".cpp")
    cpp.write_text(text)
    proc = subprocess.run([shutil.which("g++"), "-std=c++20", opt, "-pthread", *(f"-D{d}" for d in defines), "-I",
                           str(EMU), "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def run(exe: Path, name: str, case: Case, tmp: Path) -> list[np.ndarray]:
    d = tmp / name
    d.mkdir(exist_ok=True)  # a case may run twice (its inputs written again)
    for i, (a, off) in enumerate(zip(case.inputs, case.offsets)):
        data = _bits(a).reshape(-1)
        (d / f"in{i}.bin").write_bytes(np.concatenate([np.zeros(off, data.dtype), data]).tobytes())
    counts = [int(np.prod(shape)) for _, shape in case.outputs]
    subprocess.run([str(exe), name, str(d), str(case.blocks), str(case.threads), str(len(counts)),
                    *map(str, counts), *map(str, case.offsets)], check=True, timeout=300)
    outs = [np.fromfile(d / f"out{i}.bin", dtype=NP[t]).reshape(shape) for i, (t, shape) in enumerate(case.outputs)]
    for i in case.written:  # after the outputs: the inputs written in place, as they are after the launch
        a = case.inputs[i]
        data = np.fromfile(d / f"in{i}.after.bin", dtype=NP[CUDA_TYPE[a.dtype]])
        outs.append(data[case.offsets[i]:].reshape(a.shape))
    return outs


def as_float(a: np.ndarray, cuda_type: str) -> np.ndarray:
    if cuda_type == "__nv_bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


# --------------------------------------------------------------------------- the cases

def _promote(*dtypes):
    """The dtype MLX's binary ops give these dtypes (what the host code's promote_types gives)."""
    return sum((mx.zeros((1,), dtype=d) for d in dtypes[1:]), mx.zeros((1,), dtype=dtypes[0])).dtype


def _q(n, k, bits, group, dtype, seed):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32))
    s = mx.array(rng.standard_normal((n, k // group), np.float32) * 0.02).astype(dtype)
    b = mx.array(rng.standard_normal((n, k // group), np.float32) * 0.02).astype(dtype)
    return w, s, b


def _x(shape, dtype, seed=7):
    return mx.array(np.random.default_rng(seed).standard_normal(shape, np.float32)).astype(dtype)


def _float_bits(f: float) -> int:
    """A float as the int template argument the kernels read it from (csrc float_bits)."""
    return int(np.float32(f).view(np.int32))


EPS_BITS = _float_bits(1e-5)  # the norms' eps as the kernels take it


def _epilogue_ref(ref, epi, residual):
    if epi == 1:
        return ref + residual.astype(mx.float32)
    if epi == 2:
        return mx.square(mx.maximum(ref, 0.0))
    return ref


def qmv_case(n, k, m, bits, group, x_dtype, s_dtype, rows, threads, bias_dtype=None, offset=0, warps=0, epi=0,
             norm_dtype=None, row_groups=1):
    """`warps` > 0: the warp layout (vc_qmv_warp) with that many warps per block; else the block
    layout with `threads` threads and `row_groups` groups of `rows` rows a block. `epi` 1: + a
    residual, 2: squared ReLU. `norm_dtype`: an RMSNorm prologue (block layout) with a weight of that
    type."""
    w, s, b = _q(n, k, bits, group, s_dtype, seed=n + k)
    x = _x((m, k), x_dtype)
    bias = _x((n,), bias_dtype, seed=3) if bias_dtype else None
    out = _promote(x_dtype, s_dtype, bias_dtype or s_dtype)
    residual = _x((m, n), out, seed=5) if epi == 1 else s
    split = dict(WARPS=warps) if warps else dict(THREADS=threads)
    args = dict(BITS=bits, GROUP=group, K=k, N=n, M=m, ROWS=rows, **split, EPI=epi, HAS_BIAS=bias is not None,
                TX=x_dtype, TS=s_dtype, TB=bias_dtype or s_dtype, TR=residual.dtype, TO=out)
    inputs = [x, w, s, b, bias if bias is not None else s, residual]
    norm_w = (1.0 + 0.2 * _x((k,), mx.float32, seed=9)).astype(norm_dtype) if norm_dtype else None
    if not warps:
        inputs += [norm_w if norm_dtype else s]
        args.update(NORM=1 if norm_dtype else 0, NP=0, NG=1, EPS_BITS=EPS_BITS, TN=norm_dtype or s_dtype, RG=row_groups)
    case = Case("vc_qmv_warp" if warps else "vc_qmv", args, inputs,
                [(CUDA_TYPE[out], (m, n))], -(-(-(-n // (rows * max(warps, 1)))) // row_groups),
                32 * warps if warps else threads,
                [offset] + [0] * (len(inputs) - 1))
    with mx.stream(mx.cpu):
        xf = x.astype(mx.float32)
        xf = mx.fast.rms_norm(xf, norm_w.astype(mx.float32), 1e-5) if norm_dtype else xf
        ref = mx.quantized_matmul(xf, w, s, b, transpose=True, group_size=group, bits=bits)
        ref = _epilogue_ref(ref if bias is None else ref + bias, epi, residual).astype(out)
    return case, ref


def _prenormed_inputs(k, m, np_, ng, x_dtype, seed):
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


def prenormed_case(n, k, m, np_, ng, rows, threads, epi=0, row_groups=1):
    """vc_qmv on an input its producer normalized (NORM 2): NG = 1 an RMSNorm, > 1 a group norm;
    `row_groups` groups of `rows` rows a block."""
    w, s, b = _q(n, k, 4, 64, mx.bfloat16, seed=n + k)
    x, partials, normed = _prenormed_inputs(k, m, np_, ng, mx.float32, seed=k)
    residual = _x((m, n), mx.float32, seed=5) if epi == 1 else s
    args = dict(BITS=4, GROUP=64, K=k, N=n, M=m, ROWS=rows, THREADS=threads, EPI=epi, HAS_BIAS=False,
                TX=mx.float32, TS=mx.bfloat16, TB=mx.bfloat16, TR=residual.dtype, TO=mx.float32, NORM=2, NP=np_,
                NG=ng, EPS_BITS=EPS_BITS, TN=mx.float32, RG=row_groups)
    case = Case("vc_qmv", args, [x, w, s, b, s, residual, partials], [("float", (m, n))],
                -(-(-(-n // rows)) // row_groups), threads)
    with mx.stream(mx.cpu):
        ref = mx.quantized_matmul(normed, w, s, b, transpose=True, group_size=64, bits=4)
        ref = _epilogue_ref(ref, epi, residual)
    return case, ref


def emit_case(n, k, m, rows, threads, x_dtype=mx.float32, np_=0, ng=1, next_dtype=mx.float32):
    """vc_qmv_emit: + residual, and the next norm's input (out * next_w, partial sums of out^2 a
    block); its own input plain, or normalized by its producer (np_ partials in ng groups)."""
    w, s, b = _q(n, k, 4, 64, mx.bfloat16, seed=n + k)
    if np_:
        x, partials, normed = _prenormed_inputs(k, m, np_, ng, x_dtype, seed=k)
        norm_in = [partials]
    else:
        x = normed = _x((m, k), x_dtype)
        norm_in = [s]
    residual = _x((m, n), mx.float32, seed=5)
    next_w = (1.0 + 0.2 * _x((n,), mx.float32, seed=11)).astype(next_dtype)
    blocks = -(-n // rows)
    args = dict(BITS=4, GROUP=64, K=k, N=n, M=m, ROWS=rows, THREADS=threads, HAS_BIAS=False, NORM=2 if np_ else 0,
                NP=np_, NG=ng, EPS_BITS=EPS_BITS, TX=x_dtype, TS=mx.bfloat16, TB=mx.bfloat16, TR=mx.float32,
                TN=mx.float32 if np_ else mx.bfloat16, TE=next_dtype, TO=mx.float32)
    case = Case("vc_qmv_emit", args, [x, w, s, b, s, residual, *norm_in, next_w],
                [("float", (m, n)), ("float", (m, n)), ("float", (m, blocks))], blocks, threads)
    with mx.stream(mx.cpu):
        out = mx.quantized_matmul(normed.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
        out = out + residual
        ref = (out, out * next_w.astype(mx.float32), mx.square(out).reshape(m, blocks, -1).sum(-1) if n % rows == 0
               else mx.sum(mx.square(out), -1, keepdims=True))
    return case, ref


def _partial_rows(n, rows, blocks, split):
    """The rows each partial of an emitting persistent kernel sums, in order: a tile's `rows` for
    each tile of the grid's whole rounds, then rows / split for each part of the last round's tiles."""
    tiles = n // rows
    whole = tiles // blocks * blocks
    return [rows] * whole + [rows // split] * ((tiles - whole) * split)


def _persistent_case(source, layout, n, k, m, rows, blocks, threads, x_dtype, epi, bias_dtype, np_, ng, emit,
                     x_offset, w_offset, x_scale=1.0, split=1):
    """A persistent 4-bit kernel's launch (`source` or its _emit twin, `layout` its leading template
    args, tiles of `rows` rows, the last round's cut in `split` parts: one partial each when emitting)
    and MLX's product it must equal: the input plain or normalized by its producer (np_ partials in
    ng groups), w_offset > 0 a misaligned weight."""
    w, s, b = _q(n, k, 4, 64, mx.bfloat16, seed=n + k)
    if np_:
        x, partials, normed = _prenormed_inputs(k, m, np_, ng, x_dtype, seed=k)
    else:
        x = normed = (_x((m, k), mx.float32) * x_scale).astype(x_dtype)
        partials = s
    bias = _x((n,), bias_dtype, seed=3) if bias_dtype else None
    residual = _x((m, n), mx.float32, seed=5) if epi == 1 or emit else s
    next_w = (1.0 + 0.2 * _x((n,), mx.float32, seed=11)) if emit else None
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
        ref = _epilogue_ref(ref if bias is None else ref + bias, 1 if emit else epi, residual)
        if emit:
            ends = np.cumsum(sizes)
            sq = np.square(np.array(ref))
            ref = (ref, ref * next_w, mx.array(np.stack([sq[:, e - r:e].sum(-1) for r, e in zip(sizes, ends)], -1)))
    return case, ref


ACCURACY_LEVELS = (0, 3, 4)  # the pair form, x in 3 and 4 int8 terms

# Warp-group cases of vc_qmv_stream: (n, k, m, rows, stages, blocks), threads, the WG the kernel derives
# from them (K's warps: K / 1024 rounded up), stream_case's keywords. Two groups on 3 stages; on parts
# of a split last round (one row a group); emitting a group-normed input with x staged through two of
# 4 stages; 3 warps a group drifting with x staged; four groups of two rows; the block's own copies
# with a bias and squared ReLU; two rows of unaligned bfloat16 x with a residual.
WARP_GROUPS = {
    "stream_wg2": ((40, 1024, 1, 8, 3, 2), 64, 2, dict(levels=4)),
    "stream_wg2_split": ((72, 640, 1, 8, 2, 4), 64, 2, dict(split=4)),
    "stream_wg2_emit_staged": ((32, 2048, 1, 8, 4, 2), 128, 2, dict(np_=16, ng=8, emit=True, xs=1, levels=4)),
    "stream_wg2_warps_drift": ((96, 3072, 1, 8, 3, 2), 192, 2, dict(xs=1, levels=4)),
    "stream_wg4": ((32, 640, 1, 8, 2, 2), 128, 4, {}),
    "stream_wg2_own_copies": ((40, 1024, 1, 8, 2, 2), 64, 2, dict(epi=2, bias_dtype=mx.float32, w_offset=1)),
    "stream_wg2_m2_bf16": ((32, 1024, 2, 8, 2, 2), 64, 2, dict(x_dtype=mx.bfloat16, epi=1, x_offset=1)),
}


def stream_case(n, k, m, rows, threads, stages, blocks, x_dtype=mx.float32, epi=0, bias_dtype=None, np_=0, ng=1,
                emit=False, x_offset=0, w_offset=0, xs=0, split=1, levels=0, x_scale=1.0):
    """vc_qmv_stream (or _emit): a persistent grid of `blocks` blocks walking the N / rows tiles,
    `stages` of them in flight, each of the last round's tiles cut into `split` parts (one a block);
    w_offset > 0 misaligns the weight, so the block copies tiles itself instead of the copy engine's
    bulk copies; xs the way float32 x reaches each lane (XS); levels > 0 the integer dot products
    with x in that many int8 terms (LEVELS)."""
    layout = dict(GROUP=64, K=k, N=n, M=m, ROWS=rows, THREADS=threads, STAGES=stages, XS=xs, SPLIT=split,
                  LEVELS=levels)
    return _persistent_case("vc_qmv_stream", layout, n, k, m, rows, blocks, threads, x_dtype, epi, bias_dtype, np_,
                            ng, emit, x_offset, w_offset, x_scale, split=split)


def imma_case(n, k, m, warps, blocks, x_dtype=mx.float32, epi=0, bias_dtype=None, np_=0, ng=1, emit=False,
              x_offset=0, w_offset=0, x_scale=1.0, levels=4, inflight=4):
    """vc_qmv_imma (or _emit): a persistent grid of `blocks` blocks walking the N / 16 slabs, `warps`
    warps splitting each slab's groups in batches of at most `inflight`, x in `levels` int8 terms;
    w_offset > 0 misaligns the weight (its words then come in 4-byte loads)."""
    layout = dict(K=k, N=n, M=m, WARPS=warps, LEVELS=levels, INFLIGHT=inflight)
    return _persistent_case("vc_qmv_imma", layout, n, k, m, 16, blocks, 32 * warps, x_dtype, epi, bias_dtype, np_,
                            ng, emit, x_offset, w_offset, x_scale)


def imma_stream_case(n, k, m, warps, stages, blocks, x_dtype=mx.float32, epi=0, bias_dtype=None, np_=0, ng=1,
                     emit=False, x_offset=0, w_offset=0, x_scale=1.0, slab=16, levels=4):
    """vc_qmv_imma_stream (or _emit): a persistent grid of `blocks` blocks walking the N / slab slabs
    (16 rows, or 8 with the weights as the MMA's B operand), `stages` of them in flight by bulk
    copies, `warps` warps splitting each slab's groups, x in `levels` int8 terms; w_offset > 0
    misaligns the weight, so the block copies slabs itself."""
    layout = dict(K=k, N=n, M=m, WARPS=warps, LEVELS=levels, STAGES=stages, SLAB=slab)
    return _persistent_case("vc_qmv_imma_stream", layout, n, k, m, slab, blocks, 32 * warps, x_dtype, epi,
                            bias_dtype, np_, ng, emit, x_offset, w_offset, x_scale)


def dense_case(n, k, m, x_dtype, w_dtype, rows, threads, bias_dtype=None, offset=0, warps=0, epi=0, pro=0):
    w = (_x((n, k), mx.float32, seed=n) * k**-0.5).astype(w_dtype)
    x = _x((m, 2 * k if pro else k), x_dtype)
    bias = _x((n,), bias_dtype, seed=3) if bias_dtype else None
    out = _promote(x_dtype, w_dtype, bias_dtype or w_dtype)
    residual = _x((m, n), out, seed=5) if epi == 1 else w
    split = dict(WARPS=warps) if warps else dict(THREADS=threads)
    args = dict(K=k, N=n, M=m, ROWS=rows, **split, EPI=epi, PRO=pro, HAS_BIAS=bias is not None, TX=x_dtype,
                TW=w_dtype, TB=bias_dtype or w_dtype, TR=residual.dtype, TO=out)
    case = Case("vc_dense_mv_warp" if warps else "vc_dense_mv", args,
                [x, w, bias if bias is not None else w, residual], [(CUDA_TYPE[out], (m, n))],
                -(-n // (rows * max(warps, 1))), 32 * warps if warps else threads, [offset, 0, 0, 0])
    with mx.stream(mx.cpu):
        xf = x.astype(mx.float32)
        ref = (gelu_gate(xf) if pro else xf) @ w.T.astype(mx.float32)
        ref = _epilogue_ref(ref if bias is None else ref + bias, epi, residual).astype(out)
    return case, ref


GPB = 8

# The streamed two-head argmax (argmax_stream_case's args): two rows of bfloat16 x with the logits; one
# row of float32 x over 3 stages; head b's weight misaligned (the blocks' own copies).
ARGMAX_STREAM_CASES = {"argmax_stream_bf16_logits": (256, 512, 2, mx.bfloat16, True, 4, 2, 3),
                       "argmax_stream_f32": (256, 512, 1, mx.float32, False, 4, 3, 2),
                       "argmax_stream_own_copies": (128, 1024, 1, mx.float32, True, 8, 2, 3, 1)}


def _argmax_heads(n, k, m, x_dtype):
    """Two 4-bit heads [n, k] as (weight, scales, biases) each, flat, and x [m, k], with ties and NaNs
    (below), and the reference logits of each (rounded to the output dtype, as float32)."""
    heads = []
    for seed in (1, 2):
        w, s, b = _q(n, k, 4, 64, mx.bfloat16, seed=seed)
        heads.append([np.array(w), np.array(s.view(mx.uint16)), np.array(b.view(mx.uint16))])
    x = _x((m, k), x_dtype)

    def logits(h):
        w, s, b = mx.array(h[0]), mx.array(h[1]).view(mx.bfloat16), mx.array(h[2]).view(mx.bfloat16)
        with mx.stream(mx.cpu):
            out = mx.quantized_matmul(x.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
            return np.array(out.astype(_promote(x_dtype, mx.bfloat16)).astype(mx.float32))

    # Ties: head a's best row again one row earlier and in another block. Head b: NaN logits (NaN
    # scales) in the last block, a negative NaN first: NaN wins whatever its sign, the first one.
    top = int(np.argmax(logits(heads[0])[0]))
    for dst in (top - 1, top % 7):
        for part in heads[0]:
            part[dst] = part[top]
    heads[1][1][n - 3] = 0xFFC0
    heads[1][1][n - 1] = 0x7FC0
    arrays = [mx.array(a) if i == 0 else mx.array(a).view(mx.bfloat16) for h in heads for i, a in enumerate(h)]
    return x, arrays, [logits(heads[0]), logits(heads[1])]


def argmax_case(n, k, m, x_dtype, write_logits, rows=4, threads=32):
    x, arrays, ref = _argmax_heads(n, k, m, x_dtype)
    out = _promote(x_dtype, mx.bfloat16)
    nb = -(-(-(-n // rows)) // GPB)
    args = dict(BITS=4, GROUP=64, K=k, N=n, M=m, ROWS=rows, THREADS=threads, GPB=GPB, WRITE_LOGITS=write_logits,
                TX=x_dtype, TS=mx.bfloat16, TO=out)
    shape = (m, n) if write_logits else (1,)
    case = Case("vc_two_head_argmax", args, [x, *arrays], [("int64_t", (m, 2, nb)), (CUDA_TYPE[out], shape),
                                                          (CUDA_TYPE[out], shape)], 2 * nb, threads)
    return case, ref, nb


def argmax_stream_case(n, k, m, x_dtype, write_logits, warps, stages, blocks, w_offset=0):
    """vc_two_head_argmax_stream: both heads' 16-row slabs walked by a persistent grid of `blocks`
    blocks, `stages` in flight, x in 4 int8 terms; w_offset > 0 misaligns head b's weight, so the
    blocks copy every slab themselves (the heads' own pointers through HeadsWalk)."""
    x, arrays, ref = _argmax_heads(n, k, m, x_dtype)
    out = _promote(x_dtype, mx.bfloat16)
    args = dict(K=k, N=2 * n, M=m, WARPS=warps, LEVELS=4, STAGES=stages, WRITE_LOGITS=write_logits, TX=x_dtype,
                TS=mx.bfloat16, TO=out)
    case = Case("vc_two_head_argmax_stream", args, [x, *arrays],
                [("int64_t", (m, 2, blocks)), (CUDA_TYPE[out], (2, m, n) if write_logits else (1,))], blocks,
                32 * warps, [0, 0, 0, 0, w_offset, 0, 0])
    return case, ref, blocks


def gated_norm_case(rows, c, groups, width, offset, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(rows + c), 3)
    y = mx.random.normal((rows, c), key=k1).astype(dtype)
    gate_src = (2.0 * mx.random.normal((rows, width), key=k2)).astype(dtype)
    weight = (1.0 + 0.1 * mx.random.normal((c,), key=k3)).astype(dtype)
    args = dict(C=c, G=groups, W=width, GATE_OFFSET=offset, THREADS=256, EPS_BITS=EPS_BITS, TY=dtype, TG=dtype,
                TW=dtype, TO=dtype)
    case = Case("vc_gated_rms_norm", args, [y, gate_src, weight], [(CUDA_TYPE[dtype], (rows, c))],
                rows * groups, 256)
    with mx.stream(mx.cpu):  # float32 math from the same inputs, rounded once, as the kernel does
        f32 = [a.astype(mx.float32) for a in (y, gate_src, weight)]
        ref = gated_rms_norm_reference(f32[0], f32[1], offset, f32[2], groups, 1e-5).astype(dtype)
    return case, ref


def dense_add_norm_case(n, k, m, w_dtype, rows, threads, bias_dtype=None, seam=0):
    """seam 0: h + rms_norm(y) * post; 1: h + y; 2: h alone (y and post not read: NaN placeholders)."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(n + k), 4)
    h = mx.random.normal((m, k), key=k1)
    y = 3.0 * mx.random.normal((m, k), key=k2)
    post = 1.0 + 0.1 * mx.random.normal((k,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((k,), key=k4)
    w = (_x((n, k), mx.float32, seed=n) * k**-0.5).astype(w_dtype)
    bias = _x((n,), bias_dtype, seed=3) if bias_dtype else None
    args = dict(K=k, N=n, M=m, ROWS=rows, THREADS=threads, HAS_BIAS=bias is not None, SEAM=seam,
                EPS_BITS=_float_bits(1e-6), TW=w_dtype, TB=bias_dtype or w_dtype, TO=mx.float32)
    unread = mx.full(h.shape, float("nan"))
    case = Case("vc_dense_add_norm", args, [h, unread if seam == 2 else y, unread[0] if seam else post, pre, w,
                                            bias if bias is not None else w],
                [("float", (m, n)), ("float", (m, k))], -(-n // rows), threads)
    with mx.stream(mx.cpu):
        if seam == 0:
            h2, z = add_rms_norm_reference(h, y, post, pre, 1e-6)
        else:
            h2 = h + y if seam == 1 else h
            z = mx.fast.rms_norm(h2, pre, 1e-6)
        out = z @ w.T.astype(mx.float32)
        out = out if bias is None else out + bias.astype(mx.float32)
    return case, (out, h2)


def add_norm_case(rows, c, y_dtype=mx.float32):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(rows + c), 4)
    h = mx.random.normal((rows, c), key=k1)
    y = (3.0 * mx.random.normal((rows, c), key=k2)).astype(y_dtype)
    post = 1.0 + 0.1 * mx.random.normal((c,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((c,), key=k4)
    args = dict(C=c, THREADS=256, EPS_BITS=_float_bits(1e-6), TH=mx.float32, TY=y_dtype, TW=mx.float32, TO=mx.float32)
    case = Case("vc_add_rms_norm", args, [h, y, post, pre],
                [("float", (rows, c)), ("float", (rows, c))], rows, 256)
    with mx.stream(mx.cpu):
        ref = add_rms_norm_reference(h, y.astype(mx.float32), post, pre, 1e-6)
    return case, ref


def code_embedding_case(q, k, d, h, rows, w_dtype):
    keys = mx.random.split(mx.random.key(q + d + rows), 3)
    table = mx.concatenate([mx.random.normal((q, k, d), key=keys[0]), mx.zeros((q, 1, d))], axis=1)
    table = table.reshape(q * (k + 1), d)
    code = mx.concatenate([mx.random.randint(0, k, (1, q - 1), key=keys[1]), mx.array([[k]])], axis=1)
    code = code.astype(mx.int32)  # the last one the mask code (a zero row)
    weight = (0.2 * mx.random.normal((h, d), key=keys[2])).astype(w_dtype)
    per_block = (256 // 32) * 4  # output rows a block: 8 warps of 4
    args = dict(D=d, H=h, Q=q, KP=k + 1, B=rows, ROWS=4, THREADS=256, TW=w_dtype)
    case = Case("vc_code_embedding", args, [code, table, weight], [("float", (rows, 1, h))], -(-h // per_block), 256)
    with mx.stream(mx.cpu):
        ref = code_embedding_reference(code, table, weight, rows)
    return case, ref


def add_norm_guided_case(c, guidance):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(c + 1), 4)
    h = mx.random.normal((2, 1, c), key=k1)
    y = 3.0 * mx.random.normal((2, 1, c), key=k2)
    post = 1.0 + 0.1 * mx.random.normal((c,), key=k3)
    pre = 1.0 + 0.1 * mx.random.normal((c,), key=k4)
    args = dict(C=c, THREADS=256, EPS_BITS=_float_bits(1e-6), G_BITS=_float_bits(guidance), TH=mx.float32,
                TY=mx.float32, TW=mx.float32, TO=mx.float32)
    case = Case("vc_add_rms_norm_guided", args, [h, y, post, pre], [("float", (1, 1, c))], 1, 256)
    with mx.stream(mx.cpu):
        ref = add_rms_norm_guided_reference(h, y, post, pre, 1e-6, guidance)
    return case, ref


def qkv_heads_case(b, t, hq, hk, d, offset, base, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(hq + d + t), 3)
    qkv = (2.0 * mx.random.normal((b, t, (hq + 2 * hk) * d), key=k1)).astype(dtype)
    q_scale = 1.0 + 0.1 * mx.random.normal((d,), key=k2)
    k_scale = 1.0 + 0.1 * mx.random.normal((d,), key=k3)
    inv_freq = rope_inv_freq(d, base)
    args = dict(B=b, HQ=hq, HK=hk, D=d, T=t, WARPS=4, TX=dtype, EPS_BITS=_float_bits(1e-6))
    items = b * t * (hq + 2 * hk)
    case = Case("vc_qkv_heads", args, [qkv, q_scale, k_scale, inv_freq, mx.array([offset], mx.int32)],
                [("float", (b, hq, t, d)), ("float", (b, hk, t, d)), ("float", (b, hk, t, d))], -(-items // 4), 128)
    with mx.stream(mx.cpu):
        ref = qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, hq, hk, 1e-6)
    return case, ref


def mog_case(n, r, latent, hidden, w_dtype, seed, sharp=3.0, ties=False):
    k = mx.random.split(mx.random.key(seed), 6)
    y = mx.random.normal((n + 1 + latent,), key=k[0]) * mx.concatenate(
        [mx.full((n,), sharp), mx.ones((1 + latent,))])  # sharp: top-p keeps a few components
    if ties:  # logits on a coarse grid: many equal probabilities, the top-p edge among equals
        y = mx.concatenate([mx.round(y[:n]), y[n:]])
    h = mx.random.normal((hidden,), key=k[1])
    u = mx.random.uniform(shape=(n,), key=k[2])
    noise = mx.random.normal((latent,), key=k[3])
    mus = (mx.random.normal((n * r, hidden), key=k[4]) * hidden**-0.5).astype(w_dtype)
    low_mat = (mx.random.normal((n, latent, r), key=k[5]) * r**-0.5).astype(w_dtype)
    args = dict(N=n, R=r, L=latent, H=hidden, THREADS=512, TW=w_dtype, TOP_P_BITS=_float_bits(0.95),
                MIN_LOG_STD_BITS=_float_bits(4.0), MIN_LOG_STD_NEG=True, NOISE_BITS=_float_bits(0.001))
    case = Case("vc_mog_sample", args, [y, h, u, noise, mus, low_mat],
                [("float", (latent,)), ("int32_t", (1,))], 1, 512)
    with mx.stream(mx.cpu):
        ref = mog_sample_reference(y, h, u, noise, mus, low_mat, 0.95, -4.0, 0.001)
    return case, ref


# Slots per block of the decode attention's first launch (csrc/decode_attention.cpp): all of them up
# to ATTN_CHUNK (one launch), else ATTN_SPLIT_CHUNK a block and a merge launch.
ATTN_CHUNK, ATTN_SPLIT_CHUNK = 1024, 256


def attn_chunking(cap):
    """(slots per chunk, chunks) of the first launch over `cap` slots."""
    ch = ATTN_CHUNK if cap <= ATTN_CHUNK else ATTN_SPLIT_CHUNK
    return ch, -(-cap // ch)
# (B, H, HK, CAP, D) of the decode attention: the TTS's heads over two chunks of slots, grouped heads,
# one chunk, a head dim that is no multiple of 4 (the scalar key loads)
ATTN_CONFIGS = {"attn_tts": (2, 4, 4, 1300, 72), "attn_gqa": (1, 4, 2, 1500, 40), "attn_single": (2, 4, 4, 300, 72),
                "attn_odd_dim": (1, 2, 1, 1100, 42)}
# the plain kernel writing the new key and value in place: the LLM's grouped heads in one chunk, and
# over several chunks
ATTN_WRITE_CONFIGS = {"attn_write_llm": (1, 8, 2, 300, 64), "attn_write_chunks": (2, 4, 2, 1300, 40)}


def attention_cases(tag, b, h, hk, cap, d, write=False):
    ch, nc = attn_chunking(cap)
    q, kv = mx.zeros((b, h, 1, d)), mx.zeros((b, hk, cap, d))
    dims = mx.array([cap], mx.int32)
    single = nc == 1  # one chunk: the part kernel writes the result
    new = mx.zeros((b, hk, 1, d))
    part = Case("vc_decode_attn_part", dict(D=d, H=h, HK=hk, CH=ch, THREADS=256, SINGLE=single, WRITE=write,
                                            SCALE_BITS=_float_bits(d**-0.5)),
                [q, kv, kv, mx.zeros((1,), mx.int32), dims, new, new, mx.zeros((1,), mx.int32)],
                [("float", (b * h * nc, d if single else d + 2))], b * h * nc, 256, written=(1, 2) if write else ())
    combine = Case("vc_decode_attn_combine", dict(D=d, CH=ATTN_SPLIT_CHUNK, THREADS=128),
                   [mx.zeros((b * h * nc, d + 2)), dims], [("float", (b * h, d))], b * h, 128)
    return {f"{tag}_part": part, f"{tag}_combine": combine}


# (B, H, HK, CAP, D, qkv's dtype, WRITE) of the attention from the stacked projection: the TTS step
# over several chunks and over one, writing the cache in place over one and several chunks, grouped
# heads with a bfloat16 projection
ATTN_QKV_CONFIGS = {"attn_qkv_tts": (2, 4, 4, 1300, 72, mx.float32, False),
                    "attn_qkv_single": (2, 4, 4, 300, 72, mx.float32, False),
                    "attn_qkv_write": (2, 4, 4, 300, 72, mx.float32, True),
                    "attn_qkv_write_chunks": (2, 4, 2, 1300, 72, mx.float32, True),
                    "attn_qkv_gqa_bf16": (1, 4, 2, 1500, 40, mx.bfloat16, False),
                    "attn_qkv_tiny": (2, 4, 4, 32, 24, mx.float32, True)}


def attention_qkv_case(b, h, hk, cap, d, dtype, write):
    ch, nc = attn_chunking(cap)
    single = nc == 1
    kv = mx.zeros((b, hk, cap, d))
    inputs = [mx.zeros((b, 1, (h + 2 * hk) * d), dtype), mx.zeros((d,)), mx.zeros((d,)), mx.zeros((d // 2,)),
              kv, kv, mx.zeros((1,), mx.int32), mx.array([cap], mx.int32), mx.zeros((1,), mx.int32)]
    return Case("vc_decode_attn_qkv_part",
                dict(D=d, H=h, HK=hk, CH=ch, THREADS=256, SINGLE=single, TX=dtype, WRITE=write,
                     SCALE_BITS=_float_bits(256**-0.5), EPS_BITS=_float_bits(1e-6)),
                inputs, [("float", (b * h * nc, d if single else d + 2)), ("float", (b, hk, 1, d)),
                         ("float", (b, hk, 1, d))], b * h * nc, 256, written=(4, 5) if write else ())


RVQ_CONFIGS = {"rvq_f32": (mx.float32, 40, 52, 4), "rvq_bf16": (mx.bfloat16, 64, 128, 32)}  # T, D, K, NB


def rvq_cases(tag, dtype, d, k, nb, rows=3, width=8):
    """The step kernel (first, first into a code row, next) and the finish, compiled once; inputs
    are set per launch. The code rows are [rows, width]."""
    base = dict(T=dtype, D=d, K=k, NB=nb, THREADS=256)
    placeholder = [mx.zeros((rows, d)), mx.zeros((rows, nb), mx.int64), mx.zeros((1, k, d), dtype),
                   mx.zeros((1, k)), mx.zeros((3,), mx.int32), mx.zeros((rows, width), mx.int32)]
    step_out = [("float", (rows, d)), ("int64_t", (rows, nb)), ("int32_t", (rows, width))]
    first_in = [placeholder[0], *placeholder[:1], *placeholder[2:]]
    cases = {f"{tag}_first": Case("vc_rvq_step", dict(base, FIRST=True, INTO=False), first_in, step_out, rows * nb, 256),
             f"{tag}_first_into": Case("vc_rvq_step", dict(base, FIRST=True, INTO=True), first_in, step_out,
                                       rows * nb, 256),
             f"{tag}_next": Case("vc_rvq_step", dict(base, FIRST=False, INTO=False), placeholder, step_out,
                                 rows * nb, 256),
             f"{tag}_finish": Case("vc_rvq_finish", base, [placeholder[0], placeholder[1], placeholder[2],
                                                           placeholder[4], placeholder[5]],
                                   [("float", (rows, d)), ("int32_t", (rows, width))], rows, 256)}
    # the whole run in one launch: clusters of 8 blocks a row (K = 52: 7 codewords a block, 3 in the
    # last), 2 warps a block
    cb = SOURCES["vc_rvq_cluster"]["cluster"]
    for into in (False, True):
        cases[f"{tag}_cluster" + ("_into" if into else "")] = Case(
            "vc_rvq_cluster", dict(T=dtype, D=d, K=k, CB=cb, THREADS=64, INTO=into),
            [placeholder[0], placeholder[2], placeholder[3], mx.zeros((4,), mx.int32), placeholder[5]],
            [("float", (rows, d)), ("int32_t", (rows, width))], rows * cb, 64)
    return cases


def conv_case(b, length, c, k, width, offset, src_dtype=mx.float32):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(c + length), 4)
    state = mx.random.normal((b, k - 1, c), key=k1)
    src = mx.random.normal((b, length, width), key=k2).astype(src_dtype)
    weight = 0.5 * mx.random.normal((c, k), key=k3)
    bias = 0.1 * mx.random.normal((c,), key=k4)
    args = dict(B=b, C=c, K=k, L=length, W=width, OFFSET=offset, HAS_BIAS=True, TS=src_dtype, THREADS=256)
    threads = b * (length + k - 1) * c
    case = Case("vc_causal_conv_silu", args, [state, src, weight, bias], [("float", (b, length, c)),
                ("float", (b, k - 1, c))], -(-threads // 256), 256)
    with mx.stream(mx.cpu):
        ref = causal_conv_silu_reference(state, src, offset, weight[..., None], bias)
    return case, ref


def conv_scan_case(b, h, p, g, n, extra, src_dtype=mx.float32, with_state=True, gated=False):
    """The decode step's conv + scan: projected = [gate (h*p) | x B C | dt (h) | `extra` columns].
    `gated`: the gated group norm's input times its weight, and the blocks' partial sums of squares."""
    keys = mx.random.split(mx.random.key(h + p + n), 9)
    conv, k = h * p + 2 * g * n, 4
    width = h * p + conv + h + extra
    projected = mx.random.normal((b, 1, width), key=keys[0]).astype(src_dtype)
    conv_state = mx.random.normal((b, k - 1, conv), key=keys[1])
    weight = 0.5 * mx.random.normal((conv, k, 1), key=keys[2])
    bias = 0.1 * mx.random.normal((conv,), key=keys[3])
    A_log = mx.random.normal((h,), key=keys[4]) * 0.5
    D = mx.random.normal((h,), key=keys[5]).astype(mx.bfloat16)
    dt_bias = (mx.random.normal((h,), key=keys[6]) - 1.0).astype(mx.bfloat16)
    state = mx.random.normal((b, h, p, n), key=keys[7])
    rb = next(r for r in (16, 8, 4, 2, 1) if p % r == 0)  # as mamba_conv_scan_step picks it
    gate_w = 1.0 + 0.2 * mx.random.normal((h * p,), key=keys[8])
    blocks = h * (p // rb)
    args = dict(H=h, P=p, G=g, N=n, K=k, W=width, X_OFF=h * p, DT_OFF=h * p + conv, RB=rb, HAS_BIAS=True,
                HAS_STATE=with_state, GATED=gated, GATE_OFF=0, TS=src_dtype, LO_BITS=0, HI_BITS=2139095040, BATCH=b)
    case = Case("vc_mamba_conv_scan_step", args,
                [projected, conv_state, weight, bias, A_log, D, dt_bias, state if with_state else dt_bias, gate_w],
                [("float", (b, 1, h * p)), ("float", (b, h, p, n)), ("float", (b, k - 1, conv)),
                 ("float", (b, 1, blocks if gated else 1))],
                b * blocks, rb * 32)
    with mx.stream(mx.cpu):
        xbc, new_conv = causal_conv_silu_reference(conv_state, projected, h * p, weight, bias)
        y, new_state = mamba_scan_packed_reference(xbc, projected, h * p + conv, A_log, D, dt_bias,
                                                   state if with_state else None, h, p, g, n)
        y = y.reshape(b, 1, h * p)
        if gated:
            hv = y * nn.silu(projected[..., : h * p].astype(mx.float32))
            return case, (hv * gate_w, new_state, new_conv, mx.square(hv).reshape(b, 1, blocks, rb).sum(-1))
    return case, (y, new_state, new_conv)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    tmp = tmp_path_factory.mktemp("cuda_emu")
    cases, refs = {}, {}
    for name, (case, ref) in {
        "q4_f32_m2_tail": qmv_case(37, 640, 2, 4, 64, mx.float32, mx.bfloat16, 4, 32),
        "q4_bf16_4480": qmv_case(10, 4480, 1, 4, 64, mx.bfloat16, mx.bfloat16, 4, 160),
        "q4_two_steps": qmv_case(9, 4480, 2, 4, 64, mx.float32, mx.bfloat16, 2, 64),
        "q8_g32_f16_bias": qmv_case(9, 384, 2, 8, 32, mx.float16, mx.float16, 8, 32, bias_dtype=mx.float32),
        "q4_g128_unaligned": qmv_case(5, 1024, 1, 4, 128, mx.float32, mx.float32, 2, 64, offset=1),
        "q8_bf16_unaligned": qmv_case(6, 256, 2, 8, 64, mx.bfloat16, mx.bfloat16, 1, 32, offset=3),
        "dense_bf16w_bias": dense_case(7, 1152, 2, mx.float32, mx.bfloat16, 4, 160, bias_dtype=mx.bfloat16),
        "dense_f32w_unaligned": dense_case(3, 40, 1, mx.bfloat16, mx.float32, 1, 32, offset=1),
        "dense_f16_rows8": dense_case(20, 136, 2, mx.float16, mx.float16, 8, 64),
        "dense_two_steps": dense_case(5, 4608, 1, mx.float32, mx.bfloat16, 2, 192),
        # the warp layout: trailing warps past N, several steps per lane, a bias, unaligned x
        "warp_q4_f32_m2_tail": qmv_case(37, 640, 2, 4, 64, mx.float32, mx.bfloat16, 4, 0, warps=4),
        "warp_q4_bf16_4480": qmv_case(10, 4480, 1, 4, 64, mx.bfloat16, mx.bfloat16, 2, 0, warps=2),
        "warp_q8_g32_f16_bias": qmv_case(9, 384, 2, 8, 32, mx.float16, mx.float16, 8, 0, mx.float32, warps=1),
        "warp_q4_g128_unaligned": qmv_case(5, 1024, 1, 4, 128, mx.float32, mx.float32, 1, 0, offset=1, warps=4),
        "warp_dense_bf16w_bias": dense_case(7, 1152, 2, mx.float32, mx.bfloat16, 4, 0, mx.bfloat16, warps=2),
        "warp_dense_f32w_unaligned": dense_case(3, 40, 1, mx.bfloat16, mx.float32, 1, 0, offset=1, warps=1),
        "warp_dense_two_steps": dense_case(5, 4608, 2, mx.float32, mx.bfloat16, 2, 0, warps=4),
        # epilogues: + residual, squared ReLU (both layouts, with a bias first)
        "q4_residual_m2": qmv_case(37, 640, 2, 4, 64, mx.float32, mx.bfloat16, 4, 32, epi=1),
        "q4_relu2_bias": qmv_case(21, 4480, 1, 4, 64, mx.float32, mx.bfloat16, 4, 160, mx.float32, epi=2),
        "warp_q4_residual": qmv_case(9, 1024, 2, 4, 64, mx.float32, mx.bfloat16, 2, 0, warps=2, epi=1),
        "warp_q8_relu2": qmv_case(11, 384, 1, 8, 32, mx.float32, mx.float32, 4, 0, warps=4, epi=2),
        "dense_residual_bias": dense_case(7, 1152, 2, mx.float32, mx.bfloat16, 4, 160, mx.bfloat16, epi=1),
        "warp_dense_relu2": dense_case(13, 256, 2, mx.float32, mx.bfloat16, 2, 0, warps=2, epi=2),
        # the RMSNorm prologue: in_proj's shape (two steps a row, 2 rows), up_proj's with squared ReLU,
        # a bfloat16 norm weight with a bias and a residual, unaligned x
        "q4_norm_m2": qmv_case(19, 4480, 2, 4, 64, mx.float32, mx.bfloat16, 8, 96, norm_dtype=mx.float32),
        "q4_norm_relu2": qmv_case(21, 640, 1, 4, 64, mx.float32, mx.bfloat16, 8, 32, epi=2, norm_dtype=mx.float32),
        "q8_norm_bias_residual": qmv_case(9, 384, 2, 8, 32, mx.float32, mx.float32, 4, 32, mx.float32, offset=1,
                                          epi=1, norm_dtype=mx.bfloat16),
        # inputs normalized by their producer: an RMSNorm (in_proj's K, two rows, a block's worth of
        # partials and more), a group norm (chunks of 4 groups, two steps a row), squared ReLU / residual
        "q4_prenormed_rms_m2": prenormed_case(19, 4480, 2, 300, 1, 8, 160),
        "q4_prenormed_rms_relu2": prenormed_case(21, 640, 1, 7, 1, 4, 32, epi=2),
        "q4_prenormed_groups": prenormed_case(13, 1280, 2, 12, 4, 4, 32, epi=1),
        # several row groups a block (row_groups), the same launches as three above: the last block's
        # groups partly past N
        "q4_norm_relu2_rg2": qmv_case(21, 640, 1, 4, 64, mx.float32, mx.bfloat16, 8, 32, epi=2, norm_dtype=mx.float32,
                                      row_groups=2),
        "q4_prenormed_rms_m2_rg2": prenormed_case(19, 4480, 2, 300, 1, 8, 160, row_groups=2),
        "q4_prenormed_groups_rg3": prenormed_case(13, 1280, 2, 12, 4, 4, 32, epi=1, row_groups=3),
        # (a row of one step, as at K = 4480, and of two steps, at 4 and 8 rows)
        "q4_prenormed_rms_4rows": prenormed_case(19, 4480, 1, 300, 1, 4, 160),
        "q4_prenormed_rms_4rows_rg3": prenormed_case(19, 4480, 1, 300, 1, 4, 160, row_groups=3),
        "q4_prenormed_rms_two_steps": prenormed_case(19, 4480, 1, 300, 1, 8, 96),
        "q4_prenormed_rms_two_steps_rg2": prenormed_case(19, 4480, 1, 300, 1, 8, 96, row_groups=2),
        # gated-GELU input (the TTS MLP's down_proj on gate / up): several steps, both layouts
        "dense_gelu_gate": dense_case(9, 4608, 2, mx.float32, mx.bfloat16, 4, 192, pro=1),
        "dense_gelu_gate_bf16x_bias": dense_case(5, 200, 1, mx.bfloat16, mx.bfloat16, 2, 32, mx.float32, pro=1),
        "warp_dense_gelu_gate": dense_case(7, 1152, 2, mx.float32, mx.bfloat16, 2, 0, warps=2, pro=1),
        # the gated group RMSNorm: the published mixer's width, and groups narrower than a block
        "gated_norm_mixer": gated_norm_case(2, 10240, 8, 22656, 0),
        "gated_norm_small": gated_norm_case(3, 96, 2, 300, 4),
        "gated_norm_bf16": gated_norm_case(2, 10240, 8, 22656, 0, mx.bfloat16),
        # the seam feeding a dense matvec: the TTS's gate/up (2 rows, several steps), a bias and one row
        "dense_add_norm_tts": dense_add_norm_case(20, 1152, 2, mx.bfloat16, 8, 160),
        "dense_add_norm_bias": dense_add_norm_case(24, 200, 1, mx.float32, 4, 32, mx.float32),
        "dense_add_plain": dense_add_norm_case(20, 1152, 2, mx.bfloat16, 8, 160, seam=1),
        "dense_norm_only": dense_add_norm_case(24, 200, 1, mx.float32, 4, 32, mx.float32, seam=2),
        # the sandwich-norm seam: the TTS width (CFG batch), a bfloat16 branch, a width below a block
        "add_norm_tts": add_norm_case(2, 1152),
        "add_norm_bf16_y": add_norm_case(3, 1152, mx.bfloat16),
        "add_norm_small": add_norm_case(1, 100),
        # the MoG head's last seam over the CFG pair, guided: the published width, an odd one
        "add_norm_guided_tts": add_norm_guided_case(1152, 0.2),
        "add_norm_guided_odd": add_norm_guided_case(300, 1.5),
        # one frame's code embedding: a tail block past H, D no multiple of 32; for the CFG pair with
        # bfloat16 weights, and one row
        "code_embedding_b2_bf16": code_embedding_case(5, 8, 40, 70, 2, mx.bfloat16),
        "code_embedding_one_row": code_embedding_case(7, 6, 24, 33, 1, mx.float32),
        # the TTS heads: a CFG step late in a session, the warmup, grouped heads with D > 64 in bf16
        "qkv_step": qkv_heads_case(2, 1, 16, 16, 72, 300, 1e4),
        "qkv_warmup": qkv_heads_case(2, 37, 16, 16, 72, 0, 1e6),
        "qkv_grouped_bf16": qkv_heads_case(1, 3, 4, 2, 80, 5, 1e4, mx.bfloat16),
        # the MoG draw: more components than threads, bfloat16 weights; a flat mixture (top-p keeps many)
        "mog_bf16": mog_case(1500, 8, 40, 96, mx.bfloat16, seed=1),
        "mog_flat_f32": mog_case(300, 4, 24, 64, mx.float32, seed=2, sharp=0.3),
        "mog_ties": mog_case(200, 8, 16, 64, mx.bfloat16, seed=3, sharp=1.5, ties=True),
        "mog_ties_flat": mog_case(700, 4, 24, 48, mx.float32, seed=4, sharp=0.6, ties=True),
        # the causal conv + SiLU: a step and a prefix longer than the kernel, bfloat16 input
        "conv_step": conv_case(1, 1, 300, 4, 700, 256),
        "conv_prefix_b2": conv_case(2, 6, 40, 4, 50, 7, mx.bfloat16),
        # the decode step's conv + scan: 8-row blocks, a state size over 32 not a multiple of it, two
        # batch rows; bfloat16 activations without a state and 4-row blocks
        "conv_scan_b2": conv_scan_case(2, 8, 16, 2, 40, 5),
        "conv_scan_bf16_no_state": conv_scan_case(1, 4, 12, 2, 24, 0, mx.bfloat16, with_state=False),
        "conv_scan_two_blocks_a_head": conv_scan_case(1, 4, 32, 2, 40, 3),  # 16 rows a block
        # gated: the norm's input and its partial sums (two rows, two 16-row blocks a head; bfloat16)
        "conv_scan_gated_b2": conv_scan_case(2, 4, 32, 2, 40, 3, gated=True),
        "conv_scan_gated_bf16": conv_scan_case(1, 8, 16, 2, 24, 0, mx.bfloat16, gated=True),
        # the matvec that emits the next norm's input: two rows, a tail block past N; a group-norm
        # input (the mamba out_proj's), bfloat16 x and next-norm weight
        # the streamed layout: stages wrapping round (3 blocks over 8 tiles), two chunks a thread with
        # unaligned bfloat16 x and a residual, a misaligned weight (the block's own copies) with a bias
        # and squared ReLU, a group-normed input, and the emitting variants
        "stream_q4": stream_case(64, 640, 1, 8, 32, 2, 3),
        "stream_m2_two_chunks": stream_case(48, 2048, 2, 8, 32, 3, 2, mx.bfloat16, epi=1, x_offset=1),
        "stream_own_copies": stream_case(40, 1024, 1, 8, 32, 2, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
        "stream_prenormed_groups": stream_case(32, 1024, 2, 4, 32, 2, 3, np_=8, ng=4),
        "stream_emit_prenormed": stream_case(32, 2048, 1, 8, 64, 2, 2, np_=16, ng=8, emit=True),
        "stream_emit_m2": stream_case(24, 640, 2, 4, 32, 4, 5, emit=True),
        # tiles of fewer rows than the input norm has groups (the group totals apart from a tile's sums)
        "stream_emit_two_rows_eight_groups": stream_case(32, 2048, 1, 2, 64, 4, 3, np_=16, ng=8, emit=True),
        "stream_m2_two_rows_four_groups": stream_case(16, 1024, 2, 2, 32, 2, 3, np_=8, ng=4),
        # several warps a block, each going on to its next tile without a block barrier (the last
        # one done with a tile stores it and refills the stage): 3 warps, 3 stages wrapping twice;
        # two emitting warps with two rows of a group-normed input
        "stream_warps_drift": stream_case(96, 3072, 1, 8, 96, 3, 2),
        # two chunks a thread and two rows of x in a stage's bytes (x's staged slices fit it), the
        # second round's chunks ending inside a warp's slice
        "stream_m2_two_chunks_16_rows": stream_case(32, 3840, 2, 16, 64, 2, 2),
        "stream_emit_warps_m2": stream_case(64, 2048, 2, 4, 64, 2, 3, np_=16, ng=4, emit=True),
        # one row of x whose slices outgrow a 4-row stage: staged (XS 1) through the last two of 4
        # stages (the first two asked for at the start), 10 tiles over 3 blocks with the integer dot
        # products; through the last two of 3 (the first alone at the start); 3 warps drifting over 4
        # stages, 24 tiles over 2 blocks
        "stream_x_two_stages": stream_case(40, 1024, 1, 4, 32, 4, 3, levels=4),
        "stream_x_two_of_three_stages": stream_case(40, 1024, 1, 4, 32, 3, 3),
        "stream_x_two_stages_warps_drift": stream_case(96, 3072, 1, 4, 96, 4, 2),
        # a tile's rows in groups, a barrier each (VC_ROW_GROUPS, ROW_GROUPED below): 3 warps, the last
        # with half a warp's chunks, the integer dot products
        "stream_row_groups_idle_lanes": stream_case(48, 2560, 1, 8, 96, 2, 3, levels=4),
        # warp groups (WG: more warps than K takes, each group of them on its share of every tile's rows),
        # and each one's twin with a group's threads alone (the same bits, see WARP_GROUPS)
        **{f"{name}{twin}": stream_case(*shape[:4], threads // (wg if twin else 1), *shape[4:], **kw)
           for name, (shape, threads, wg, kw) in WARP_GROUPS.items() for twin in ("", "_one_group")},
        # the last round's tiles cut into parts (vc_stream::Walk, split as gemv.cpp's split_last_round
        # picks it for the grid): 9 tiles over 4 blocks (the ninth in 4 parts of 2 rows); emitting two
        # rows of x, 7 tiles over 3 blocks (the seventh in halves: 8 partials); the block's own copies
        # (a misaligned weight) with a bias and squared ReLU, 5 tiles over 4 blocks; 3 warps drifting
        # over 3 stages, 11 tiles over 5 blocks
        "stream_split_parts": stream_case(72, 640, 1, 8, 32, 2, 4, split=4),
        "stream_emit_split_m2": stream_case(28, 1024, 2, 4, 32, 2, 3, emit=True, split=2),
        "stream_split_own_copies": stream_case(40, 1024, 1, 8, 32, 2, 4, epi=2, bias_dtype=mx.float32, w_offset=1,
                                               split=4),
        "stream_split_warps_drift": stream_case(88, 3072, 1, 8, 96, 3, 5, np_=16, ng=4, split=4),
        # the integer dot products (LEVELS: x in int8 terms): 4 levels on stages wrapping round; two
        # chunks a thread with two rows of unaligned bfloat16 x and a residual; 3 levels emitting on a
        # group-normed input; 3 with the block's own copies, a bias, squared ReLU and parts;
        # huge and tiny x (the terms' exponents); 3 warps drifting with x staged through a stage
        "stream_dp4a_q4": stream_case(64, 640, 1, 8, 32, 2, 3, levels=4),
        "stream_dp4a_m2_two_chunks": stream_case(48, 2048, 2, 8, 32, 3, 2, mx.bfloat16, epi=1, x_offset=1, levels=4),
        "stream_dp4a_emit_prenormed": stream_case(32, 2048, 1, 8, 64, 2, 2, np_=16, ng=8, emit=True, levels=3),
        "stream_dp4a_own_copies_split": stream_case(40, 1024, 1, 8, 32, 2, 4, epi=2, bias_dtype=mx.float32,
                                                    w_offset=1, split=4, levels=3),
        "stream_dp4a_huge_x": stream_case(32, 640, 1, 8, 32, 2, 2, x_scale=1e30, levels=4),
        "stream_dp4a_tiny_x": stream_case(32, 640, 2, 4, 32, 2, 3, x_scale=1e-30, levels=4),
        "stream_dp4a_staged_warps_drift": stream_case(96, 3072, 1, 8, 96, 3, 2, xs=1, levels=4),
        # the MLP down_proj's K (490 chunks over 512 threads), 32 rows: the products' accuracy
        **{f"stream_accuracy_{lv}": stream_case(32, 15680, 1, 8, 512, 2, 2, levels=lv) for lv in ACCURACY_LEVELS},
        # the integer-MMA layout: slabs wrapping round a grid of 3 (uneven groups a warp), two rows of
        # unaligned bfloat16 x with a residual, a misaligned weight with a bias and squared ReLU, tiny
        # and huge x (the expansion's exponents), a group-normalized input, emitting; batches of
        # groups in flight with spare slots (7 groups a warp in 4 batches of 2, 8 in 3 of 3), one at a time
        "imma_q4": imma_case(64, 640, 1, 3, 3),
        "imma_batches": imma_case(32, 1280, 1, 3, 2, inflight=2),
        "imma_three_levels": imma_case(32, 640, 2, 4, 1, levels=3),
        "imma_m2_bf16": imma_case(32, 1024, 2, 2, 1, mx.bfloat16, epi=1, x_offset=1),
        "imma_own_words": imma_case(48, 512, 1, 4, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
        "imma_tiny_x": imma_case(16, 256, 2, 2, 1, x_scale=1e-30),
        "imma_huge_x": imma_case(16, 256, 1, 1, 1, x_scale=1e30, inflight=1),
        "imma_prenormed_groups": imma_case(32, 1024, 2, 2, 2, np_=8, ng=4),
        "imma_emit_prenormed": imma_case(48, 2048, 1, 4, 2, np_=16, ng=8, emit=True, inflight=3),
        # the integer-MMA product on bulk-copied slabs: stages wrapping round (5 slabs a block, uneven
        # groups a warp), two rows of unaligned bfloat16 x with a residual over 3 stages, a misaligned
        # weight (the block's own copies) with a bias and squared ReLU, huge x, a group-normalized
        # input, emitting with an 8-group norm input; K = 320 (K / 8 words a row, 8 mod 16) the one
        # whose slab rows are not padded in shared memory
        "imma_stream_q4": imma_stream_case(160, 640, 1, 3, 2, 2),
        "imma_stream_m2_bf16": imma_stream_case(48, 1024, 2, 4, 3, 2, mx.bfloat16, epi=1, x_offset=1),
        "imma_stream_own_copies": imma_stream_case(64, 512, 1, 2, 2, 2, epi=2, bias_dtype=mx.float32, w_offset=1),
        # K = 1024: 32-byte scale rows, padded in the stage (the block's own copies too)
        "imma_stream_own_copies_padded": imma_stream_case(48, 1024, 1, 2, 2, 2, w_offset=1),
        "imma_stream_huge_x": imma_stream_case(32, 320, 1, 2, 2, 1, x_scale=1e30),
        "imma_stream_prenormed_groups": imma_stream_case(64, 1024, 2, 2, 2, 3, np_=8, ng=4),
        "imma_stream_emit_prenormed": imma_stream_case(64, 2048, 1, 4, 2, 2, np_=16, ng=8, emit=True),
        # 8-row slabs (the weights as the MMA's B operand, one row of x): slabs wrapping round (10 over
        # 3 blocks, uneven groups a warp), unaligned bfloat16 x with a residual, a misaligned weight (the
        # block's own copies) with a bias and squared ReLU on padded rows (K = 1024), huge and tiny x,
        # three levels (a level lane without a term), a group-normed input, emitting with 8 groups
        "imma_stream8_q4": imma_stream_case(80, 640, 1, 3, 2, 3, slab=8),
        "imma_stream8_bf16": imma_stream_case(40, 1024, 1, 4, 3, 2, mx.bfloat16, epi=1, x_offset=1, slab=8),
        "imma_stream8_own_copies_padded": imma_stream_case(48, 1024, 1, 2, 2, 2, epi=2, bias_dtype=mx.float32,
                                                           w_offset=1, slab=8),
        "imma_stream8_huge_x": imma_stream_case(32, 320, 1, 2, 2, 1, x_scale=1e30, slab=8),
        "imma_stream8_tiny_x_three_levels": imma_stream_case(24, 256, 1, 2, 2, 2, x_scale=1e-30, slab=8, levels=3),
        "imma_stream8_prenormed_groups": imma_stream_case(64, 1024, 1, 2, 2, 3, np_=8, ng=4, slab=8),
        "imma_stream8_emit_prenormed": imma_stream_case(64, 2048, 1, 4, 2, 2, np_=16, ng=8, emit=True, slab=8),
        "emit_m2": emit_case(37, 640, 2, 4, 32),
        "emit_tail": emit_case(10, 4480, 1, 8, 160),
        "emit_prenormed_groups": emit_case(16, 1280, 1, 8, 32, np_=20, ng=4),
        # the Mamba out_proj as launched: 8 groups, one step a thread (320 threads over K = 10240)
        "emit_prenormed_groups_one_step": emit_case(16, 10240, 1, 8, 320, np_=640, ng=8),
        "emit_bf16": emit_case(12, 256, 2, 4, 32, mx.bfloat16, next_dtype=mx.bfloat16),
    }.items():
        cases[name], refs[name] = case, ref
    for tag, config in ATTN_CONFIGS.items():
        for name, case in attention_cases(tag, *config).items():
            cases[name], refs[name] = case, None
    for tag, config in ATTN_WRITE_CONFIGS.items():
        for name, case in attention_cases(tag, *config, write=True).items():
            cases[name], refs[name] = case, None
    for tag, config in ATTN_QKV_CONFIGS.items():
        cases[tag], refs[tag] = attention_qkv_case(*config), None
        b, h, hk, cap, d = config[:5]
        cases[f"{tag}_combine"] = Case("vc_decode_attn_combine", dict(D=d, CH=ATTN_SPLIT_CHUNK, THREADS=128),
                                       [mx.zeros((b * h * attn_chunking(cap)[1], d + 2)), mx.array([cap], mx.int32)],
                                       [("float", (b * h, d))], b * h, 128)
    for tag, config in RVQ_CONFIGS.items():
        for name, case in rvq_cases(tag, *config).items():
            cases[name], refs[name] = case, None
    argmax = {}
    argmax_configs = {"argmax_bf16_logits": (argmax_case, (1000, 256, 2, mx.bfloat16, True)),
                      "argmax_f32": (argmax_case, (1000, 256, 2, mx.float32, False)),
                      **{name: (argmax_stream_case, config) for name, config in ARGMAX_STREAM_CASES.items()}}
    for name, (make, config) in argmax_configs.items():
        case, ref, nb = make(*config)
        cases[name], refs[name] = case, ref
        m = config[2]  # the finish kernel: a block for each row of x and head
        argmax[name] = (Case("vc_argmax_finish", dict(NB=nb, THREADS=256), [mx.zeros((m * 2 * nb,), mx.int64)],
                             [("int32_t", (m, 2))], m * 2, 256), nb)
    for name, (finish, _) in argmax.items():
        cases[name + "_finish"] = finish
    exe = build(cases, tmp)
    return exe, cases, refs, argmax, tmp



@pytest.mark.parametrize("name", ["q4_f32_m2_tail", "q4_bf16_4480", "q4_two_steps", "q8_g32_f16_bias",
                                  "q4_g128_unaligned", "q8_bf16_unaligned", "dense_bf16w_bias", "dense_f32w_unaligned",
                                  "dense_f16_rows8", "dense_two_steps", "warp_q4_f32_m2_tail", "warp_q4_bf16_4480",
                                  "warp_q8_g32_f16_bias", "warp_q4_g128_unaligned", "warp_dense_bf16w_bias",
                                  "warp_dense_f32w_unaligned", "warp_dense_two_steps", "q4_residual_m2",
                                  "q4_relu2_bias", "warp_q4_residual", "warp_q8_relu2", "dense_residual_bias",
                                  "warp_dense_relu2", "q4_norm_m2", "q4_norm_relu2", "q8_norm_bias_residual",
                                  "q4_prenormed_rms_m2", "q4_prenormed_rms_relu2", "q4_prenormed_groups",
                                  "q4_norm_relu2_rg2", "q4_prenormed_rms_m2_rg2", "q4_prenormed_groups_rg3",
                                  "q4_prenormed_rms_4rows_rg3", "q4_prenormed_rms_two_steps_rg2",
                                  "dense_gelu_gate", "dense_gelu_gate_bf16x_bias",
                                  "warp_dense_gelu_gate", "gated_norm_mixer", "gated_norm_small",
                                  "gated_norm_bf16"])
def test_matvec_kernels_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    case, ref = cases[name], refs[name]
    (out,) = run(exe, name, case, tmp)
    got = as_float(out, case.outputs[0][0])
    want = np.array(ref.astype(mx.float32))
    ulp = {"float": 2e-6, "__half": 1e-3, "__nv_bfloat16": 8e-3}[case.outputs[0][0]]
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp * np.abs(want).max())


@pytest.mark.parametrize("grouped, single", [("q4_norm_relu2_rg2", "q4_norm_relu2"),
                                             ("q4_prenormed_rms_m2_rg2", "q4_prenormed_rms_m2"),
                                             ("q4_prenormed_groups_rg3", "q4_prenormed_groups"),
                                             ("q4_prenormed_rms_two_steps_rg2", "q4_prenormed_rms_two_steps"),
                                             ("q4_prenormed_rms_4rows_rg3", "q4_prenormed_rms_4rows")])
def test_row_groups_change_no_bit_emulated(emulated, grouped, single):
    """A block's row groups are computed as separate blocks would compute them: the same bits."""
    exe, cases, _, _, tmp = emulated
    (got,) = run(exe, grouped, cases[grouped], tmp)
    (want,) = run(exe, single, cases[single], tmp)
    assert cases[grouped].blocks < cases[single].blocks
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["conv_step", "conv_prefix_b2"])
def test_causal_conv_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    y, state = run(exe, name, cases[name], tmp)
    y_ref, state_ref = refs[name]
    np.testing.assert_allclose(y, np.array(y_ref), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(state, np.array(state_ref))


@pytest.mark.parametrize("name", ["conv_scan_b2", "conv_scan_bf16_no_state", "conv_scan_two_blocks_a_head",
                                  "conv_scan_gated_b2", "conv_scan_gated_bf16"])
def test_conv_scan_step_kernel_emulated(emulated, name):
    """One launch equals causal_conv_silu then the scan: y, the ssm state and the conv state; gated,
    y * silu(gate) * weight and each block's sum of (y * silu(gate))^2."""
    exe, cases, refs, _, tmp = emulated
    y, state, conv_state, partials = run(exe, name, cases[name], tmp)
    y_ref, state_ref, conv_ref, *partials_ref = refs[name]
    if partials_ref:
        np.testing.assert_allclose(partials, np.array(partials_ref[0]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(y, np.array(y_ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(state, np.array(state_ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(conv_state, np.array(conv_ref))


@pytest.mark.parametrize("name", ["emit_m2", "emit_tail", "emit_prenormed_groups", "emit_bf16"])
def test_emit_norm_kernel_emulated(emulated, name):
    """out = product + residual, normed = out * next_w, and the block partials sum to sum(out^2)."""
    exe, cases, refs, _, tmp = emulated
    out, normed, partials = run(exe, name, cases[name], tmp)
    out_ref, normed_ref, partials_ref = (np.array(r) for r in refs[name])
    np.testing.assert_allclose(out, out_ref, rtol=2e-5, atol=2e-5 * np.abs(out_ref).max())
    np.testing.assert_allclose(normed, normed_ref, rtol=2e-5, atol=2e-5 * np.abs(normed_ref).max())
    # each block's partial: its own rows when N divides evenly, else compare the row totals
    if partials_ref.shape == partials.shape:
        np.testing.assert_allclose(partials, partials_ref, rtol=2e-5)
    np.testing.assert_allclose(partials.sum(-1), partials_ref.sum(-1), rtol=2e-5)


def _check_persistent(emulated, name: str) -> None:
    """A persistent 4-bit kernel's outputs (plain: out; emitting: out, normed, partials) equal MLX's."""
    exe, cases, refs, _, tmp = emulated
    case, ref = cases[name], refs[name]
    got = run(exe, name, case, tmp)
    want = [np.array(r) for r in (ref if isinstance(ref, tuple) else (ref,))]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


@pytest.mark.parametrize("name", ["stream_q4", "stream_m2_two_chunks", "stream_own_copies", "stream_prenormed_groups",
                                  "stream_emit_prenormed", "stream_emit_m2", "stream_warps_drift",
                                  "stream_m2_two_chunks_16_rows",
                                  "stream_emit_warps_m2", "stream_emit_two_rows_eight_groups",
                                  "stream_m2_two_rows_four_groups", "stream_split_parts", "stream_emit_split_m2",
                                  "stream_split_own_copies", "stream_split_warps_drift", "stream_dp4a_q4",
                                  "stream_dp4a_m2_two_chunks", "stream_dp4a_emit_prenormed",
                                  "stream_dp4a_own_copies_split", "stream_dp4a_huge_x", "stream_dp4a_tiny_x",
                                  "stream_dp4a_staged_warps_drift", "stream_x_two_stages",
                                  "stream_x_two_of_three_stages", "stream_x_two_stages_warps_drift",
                                  "stream_row_groups_idle_lanes"])
def test_streamed_matvec_kernels_emulated(emulated, name):
    """vc_qmv_stream equals MLX's product (and, emitting, the next norm's input and a partial sum of
    out^2 a tile, and a part of a split last-round tile): the tiles a block walks, the stages it reuses
    (refilled by whichever warp is done last), the parts' copies and rows, the input norm folded
    into x; with LEVELS (stream_dp4a_*) the products as integer dot products of x's int8 terms."""
    _check_persistent(emulated, name)


def test_streamed_products_are_at_least_as_exact_as_mlx(emulated):
    """Against the float64 product of the same 4-bit weights and float32 x (the MLP down_proj's K), the
    streamed layout's pair form, its integer dot products with x in 3 and in 4 int8 terms (the default)
    each err no more than MLX's own float32 product, and the default no more than the pair form.
    (Measured while writing it, the largest error over the largest |y|: MLX's CPU product 1.7e-6, the
    pair form 2.2e-7, 3 terms 8.4e-7, 4 terms 1.0e-7; 2 terms 8.9e-5 fail it.)"""
    exe, cases, _, _, tmp = emulated
    x, w, s, b = cases["stream_accuracy_0"].inputs[:4]
    deq = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4)
    exact = np.array(x).astype(np.float64) @ np.array(deq).astype(np.float64).T
    with mx.stream(mx.cpu):
        mlx = np.array(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))

    def error(y):
        return np.abs(y.astype(np.float64) - exact).max() / np.abs(exact).max()

    errors = {lv: error(run(exe, f"stream_accuracy_{lv}", cases[f"stream_accuracy_{lv}"], tmp)[0])
              for lv in ACCURACY_LEVELS}
    assert all(e <= error(mlx) for e in errors.values()), (errors, error(mlx))
    assert errors[4] <= errors[0], errors


STREAM_CASES = ["stream_q4", "stream_own_copies", "stream_emit_prenormed", "stream_warps_drift",
                "stream_m2_two_chunks_16_rows", "stream_m2_two_chunks", "stream_emit_warps_m2", "stream_x_two_stages",
                "stream_x_two_of_three_stages", "stream_x_two_stages_warps_drift"]
# where the kernel stages x: float32 x, 16-byte aligned, and with XS 1 the block's 4 KB slices (a
# warp, chunk round and row) inside one stage, or for one row of x inside all stages but the first
X_STAGES_TWO = ["stream_x_two_stages", "stream_x_two_of_three_stages", "stream_x_two_stages_warps_drift"]
X_STAGED = {1: ["stream_own_copies", "stream_emit_prenormed", "stream_warps_drift", "stream_m2_two_chunks_16_rows",
                *X_STAGES_TWO],
            2: ["stream_q4", "stream_own_copies", "stream_emit_prenormed", "stream_warps_drift",
                "stream_m2_two_chunks_16_rows", "stream_emit_warps_m2", *X_STAGES_TWO]}


def _x_staged(case: Case, xs: int) -> bool:
    """Whether vc_qmv_stream stages x in this case with XS = xs: its float32 and alignment checks, and
    for XS 1 the slices' fit in a stage as the extension's own pick (ext.stream_launch) judges it."""
    a = case.template_args
    if a["TX"] != mx.float32 or case.offsets[0] != 0:
        return False
    return xs == 2 or ext.stream_launch(a["K"], a["N"], a["M"], True, 1, a["ROWS"], a["THREADS"], a["STAGES"], 1,
                                        1)["stage_x"] == 1


@pytest.fixture(scope="module")
def emulated_staged_x(emulated, tmp_path_factory):
    """The stream cases built again with XS 1 (x loaded coalesced and handed round through the last
    stages' buffers) and XS 2 (through a region past the stages)."""
    _, cases, _, _, _ = emulated
    tmp = tmp_path_factory.mktemp("cuda_emu_staged_x")
    picked = {}
    for name in STREAM_CASES:
        for xs in (1, 2):
            staged = copy.copy(cases[name])
            staged.template_args = {**cases[name].template_args, "XS": xs}
            picked[f"{name}_xs{xs}"] = staged
    return build(picked, tmp), picked, tmp


@pytest.mark.parametrize("xs", [1, 2])
@pytest.mark.parametrize("name", STREAM_CASES)
def test_streamed_matvec_with_x_staged_gives_the_same_bits(emulated, emulated_staged_x, name, xs):
    """Staging x changes how it reaches each lane, not its values: the outputs are bit-identical to
    the unstaged build's, where the kernel stages it (X_STAGED: one on the block's own copies, one
    with two chunks a thread and two rows, three through two stages) and where it does not (bfloat16 or
    misaligned x; with XS 1, slices past a stage for two rows of x, or past all stages but the first)."""
    exe, cases, _, _, tmp = emulated
    staged, picked, staged_tmp = emulated_staged_x
    assert _x_staged(cases[name], xs) == (name in X_STAGED[xs])
    want = run(exe, name, cases[name], tmp)
    got = run(staged, f"{name}_xs{xs}", picked[f"{name}_xs{xs}"], staged_tmp)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", list(WARP_GROUPS))
def test_streamed_warp_groups_emulated(emulated, name):
    """With warp groups the streamed kernel equals MLX's product and gives exactly the bits of its twin
    with one group's threads (a row's sums are one group's warps', folded and totalled in the same
    order), and the extension derives the same WG from the launch."""
    (n, k, m, rows, stages, _), threads, wg, kw = WARP_GROUPS[name]
    launch = ext.stream_launch(k, n, m, kw.get("x_dtype", mx.float32) == mx.float32, kw.get("ng", 1), rows, threads,
                               stages)
    assert launch["warp_groups"] == wg
    _check_persistent(emulated, name)
    exe, cases, _, _, tmp = emulated
    got = run(exe, name, cases[name], tmp)
    want = run(exe, f"{name}_one_group", cases[f"{name}_one_group"], tmp)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _staged_build(emulated, tmp_path_factory, names: list[str], define: str, suffix: str):
    """The cases `names` with x staged through the last stages where they take it (XS 1), built with
    the probe define `define`; each as `<name>_<suffix>`."""
    _, cases, _, _, _ = emulated
    tmp = tmp_path_factory.mktemp(f"cuda_emu_{suffix}")
    picked = {}
    for name in names:
        staged = copy.copy(cases[name])
        staged.template_args = {**cases[name].template_args, "XS": 1}
        picked[f"{name}_{suffix}"] = staged
    return build(picked, tmp, (define,)), picked, tmp


def _assert_same_bits_as_built(emulated, other, name: str, suffix: str) -> None:
    """Case `name` of the kernels' own build and its twin in `other` (a _staged_build) give the same bits."""
    exe, cases, _, _, tmp = emulated
    other_exe, picked, other_tmp = other
    want = run(exe, name, cases[name], tmp)
    got = run(other_exe, f"{name}_{suffix}", picked[f"{name}_{suffix}"], other_tmp)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def emulated_tile_first(emulated, tmp_path_factory):
    """The stream cases built with VC_TILE_FIRST=1 (warp 0 asks for the first tile before its loads of
    x)."""
    return _staged_build(emulated, tmp_path_factory, STREAM_CASES, "VC_TILE_FIRST=1", "first")


@pytest.mark.parametrize("name", STREAM_CASES)
def test_streamed_matvec_asking_for_its_first_tile_before_x_gives_the_same_bits(emulated, emulated_tile_first, name):
    """VC_TILE_FIRST (a timeline probe's define) moves the first tile's request ahead of x's loads,
    not any value: the outputs are bit-identical to the kernels' own build."""
    _assert_same_bits_as_built(emulated, emulated_tile_first, name, "first")


# cases whose start asks for two items where x is staged (XS 1): stages - the stages x's slices take
# (stream_warps_drift: 3 stages, x's 12 KB in one 13.5 KB stage; stream_x_two_stages and its drifting
# twin: 4 stages, x in two; stream_wg2_emit_staged: two warp groups, 4 stages, x in two)
START_TWO = ["stream_warps_drift", "stream_x_two_stages", "stream_x_two_stages_warps_drift", "stream_wg2_emit_staged"]


@pytest.fixture(scope="module")
def emulated_start_one(emulated, tmp_path_factory):
    """START_TWO built with VC_START_ITEMS=1 (one item asked for at the start, the next after x's
    spread)."""
    return _staged_build(emulated, tmp_path_factory, START_TWO, "VC_START_ITEMS=1", "start_one")


@pytest.mark.parametrize("name", START_TWO)
def test_streamed_matvec_asking_for_one_item_at_the_start_gives_the_same_bits(emulated, emulated_start_one, name):
    """VC_START_ITEMS=1 (a timeline probe's define: what fits the 4-stage warp-group launch with parts
    in 640 threads' registers) moves the second item's request after x's spread, not any value: the
    outputs are bit-identical to the kernels' own build."""
    assert _x_staged(emulated[1][name], 1)
    _assert_same_bits_as_built(emulated, emulated_start_one, name, "start_one")


def _picked_stream_launches() -> list[tuple[int, dict]]:
    """(K, launch) for every streamed launch ext.stream_launch picks over a sweep of the overrides
    (the refused ones left out)."""
    picked = []
    for k in (2048, 3072, 4480, 10240, 15680):
        for n in (4480, 22656):
            for threads in (0, 96, 160, 320, 480, 512, 640, 960, 1024):
                for rows in (0, 2, 4, 8, 16):
                    for stages in (2, 3):
                        try:
                            picked.append((k, ext.stream_launch(k, n, threads=threads, rows=rows, stages=stages)))
                        except ValueError:
                            pass
    return picked


def test_the_hosts_warp_groups_are_the_kernels(tmp_path):
    """gemv.cpp's stream_warp_groups and the kernel's vc_stream::WarpGroups derive a launch's warp
    groups apart (the host to pick the block and split the last round, the kernel to share out each
    tile's rows): over every launch stream_launch picks in a sweep of K, N, threads, rows and stages,
    the kernel's WG from the launch's threads, rows and split equals the host's warp_groups."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    picked = _picked_stream_launches()
    assert {launch["warp_groups"] for _, launch in picked} >= {1, 2, 4}  # the sweep reaches groups
    args = [(k // 32, launch["threads"], launch["rows"], launch["split"]) for k, launch in picked]
    prints = [f"  std::printf(\"%d\\n\", vc_stream::WarpGroups<{c}, {t}, {r}, {sp}>::value);" for c, t, r, sp in args]
    text = "\n".join(['#include "cuda_emu.h"', "#include <cstdio>", SOURCES["vc_qmv_stream"]["header"],
                      "int main() {", *prints, "  return 0;", "}"])
    exe = compile_emulated(text, tmp_path / "warp_groups", opt="-O0")
    kernels = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert kernels == [launch["warp_groups"] for _, launch in picked]


# whole tiles, one warp group: VC_ROW_GROUPS applies (the block's own copies, stream_own_copies, take
# no barriers either way); the kernels' two groups against the whole tile's one barrier (1) and a
# group a row (-1)
ROW_GROUPED = [*STREAM_CASES, "stream_row_groups_idle_lanes"]


@pytest.fixture(scope="module", params=["1", "-1"])
def emulated_row_groups(request, emulated, tmp_path_factory):
    """ROW_GROUPED built with VC_ROW_GROUPS (each tile's rows in groups, a bulk copy and an mbarrier
    each, the product waiting for each group as it gets to its rows; the kernels' 2 groups)."""
    return _staged_build(emulated, tmp_path_factory, ROW_GROUPED, f"VC_ROW_GROUPS={request.param}", "row_groups")


@pytest.mark.parametrize("name", ROW_GROUPED)
def test_streamed_matvec_with_row_groups_gives_the_same_bits(emulated, emulated_row_groups, name):
    """VC_ROW_GROUPS changes how a tile's bytes come in and when the product waits for them, not any
    value: the outputs are bit-identical to the kernels' own build."""
    _assert_same_bits_as_built(emulated, emulated_row_groups, name, "row_groups")


@pytest.mark.parametrize("name", ["imma_q4", "imma_batches", "imma_three_levels", "imma_m2_bf16", "imma_own_words", "imma_tiny_x", "imma_huge_x",
                                  "imma_prenormed_groups", "imma_emit_prenormed"])
def test_integer_mma_matvec_kernels_emulated(emulated, name):
    """vc_qmv_imma equals MLX's product (and, emitting, the next norm's input and a partial sum of
    out^2 a slab): the MMA's fragments as PTX lays them out, x's block floating point expansion at
    any scale, the slabs a block walks and the groups its warps split."""
    _check_persistent(emulated, name)


@pytest.mark.parametrize("name", ["imma_stream_q4", "imma_stream_m2_bf16", "imma_stream_own_copies",
                                  "imma_stream_own_copies_padded", "imma_stream_huge_x",
                                  "imma_stream_prenormed_groups", "imma_stream_emit_prenormed",
                                  "imma_stream8_q4", "imma_stream8_bf16", "imma_stream8_own_copies_padded",
                                  "imma_stream8_huge_x", "imma_stream8_tiny_x_three_levels",
                                  "imma_stream8_prenormed_groups", "imma_stream8_emit_prenormed"])
def test_streamed_integer_mma_matvec_kernels_emulated(emulated, name):
    """vc_qmv_imma_stream equals MLX's product (and, emitting, the next norm's input and a partial sum
    of out^2 a slab): the slabs by bulk copy and their stages' reuse, each warp's groups of a slab
    from shared memory (scale rows padded where K is a multiple of 1024), the last warp's store, and
    the block's own copies where the weight is misaligned; with 8-row slabs (imma_stream8_*) the
    weights as the MMA's B operand, x's levels as its A rows and the bias lanes."""
    _check_persistent(emulated, name)


@pytest.mark.parametrize("name", ["dense_add_norm_tts", "dense_add_norm_bias", "dense_add_plain", "dense_norm_only"])
def test_dense_add_norm_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    out, h2 = run(exe, name, cases[name], tmp)
    want_out, want_h2 = (np.array(a) for a in refs[name])
    np.testing.assert_allclose(h2, want_h2, rtol=2e-6, atol=2e-6 * np.abs(want_h2).max())
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5 * np.abs(want_out).max())


@pytest.mark.parametrize("name", ["add_norm_tts", "add_norm_bf16_y", "add_norm_small"])
def test_add_rms_norm_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    h, z = run(exe, name, cases[name], tmp)
    h_ref, z_ref = refs[name]
    for got, want in ((h, np.array(h_ref)), (z, np.array(z_ref))):  # sums that cancel: atol by scale
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", ["add_norm_guided_tts", "add_norm_guided_odd"])
def test_add_rms_norm_guided_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    (got,) = run(exe, name, cases[name], tmp)
    want = np.array(refs[name])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", ["code_embedding_b2_bf16", "code_embedding_one_row"])
def test_code_embedding_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    (got,) = run(exe, name, cases[name], tmp)
    np.testing.assert_allclose(got, np.array(refs[name]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qkv_step", "qkv_warmup", "qkv_grouped_bf16"])
def test_qkv_heads_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    for got, want in zip(run(exe, name, cases[name], tmp), refs[name]):
        want = np.array(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["mog_bf16", "mog_flat_f32", "mog_ties", "mog_ties_flat"])
def test_mog_sample_kernel_emulated(emulated, name):
    exe, cases, refs, _, tmp = emulated
    z, component = run(exe, name, cases[name], tmp)
    z_ref, c_ref = refs[name]
    assert component.tolist() == np.array(c_ref).tolist()
    np.testing.assert_allclose(z, np.array(z_ref), rtol=2e-5, atol=2e-5)


def _attention_inputs(b, h, hk, cap, d, seed):
    """Random q [B, H, 1, D], buffers k, v [B, HK, CAP, D] and a new key and value [B, HK, 1, D]."""
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(seed), 5)
    return (mx.random.normal((b, h, 1, d), key=k1), mx.random.normal((b, hk, cap, d), key=k2),
            mx.random.normal((b, hk, cap, d), key=k3), mx.random.normal((b, hk, 1, d), key=k4),
            mx.random.normal((b, hk, 1, d), key=k5))


def _run_plain_part(exe, cases, tag, q, k, v, offset, cap, k_new, v_new, slot, name, tmp):
    """The plain attention's launch(es) on these inputs: its outputs, the first merged (`_merged`)."""
    part = cases[f"{tag}_part"]
    part.inputs = [q, k, v, mx.array([offset], mx.int32), mx.array([cap], mx.int32), k_new, v_new,
                   mx.array([slot], mx.int32)]
    (tmp / name).mkdir()
    out, *rest = run(exe, f"{tag}_part", part, tmp / name)
    return [_merged(exe, cases, tag, out, cap, tmp / f"{name}_c"), *rest]


def _merged(exe, cases, tag, out, cap, tmp):
    """The attention's second launch (beyond ATTN_CHUNK slots): the chunks' partial softmaxes merged."""
    if cap <= ATTN_CHUNK:
        return out
    combine = cases[f"{tag}_combine"]
    combine.inputs = [mx.array(out), mx.array([cap], mx.int32)]
    tmp.mkdir()
    (merged,) = run(exe, f"{tag}_combine", combine, tmp)
    return merged


@pytest.mark.parametrize("tag", list(ATTN_CONFIGS))
@pytest.mark.parametrize("offset", [0, 10, 270, 1100, 5000])
@pytest.mark.parametrize("with_new", [False, True])
def test_decode_attention_kernels_emulated(emulated, tag, offset, with_new):
    """Slot 0 only, one pass of a warp only partly, passes of several warps (the second chunk
    empty), into the second chunk, all (a full ring);
    `attn_single`: one chunk, no merge launch. `with_new`: the new key and value read in the
    position's slot (as the TTS backbone's step does) instead of the buffers'."""
    exe, cases, _, _, tmp = emulated
    b, h, hk, cap, d = ATTN_CONFIGS[tag]
    q, k, v, k_new, v_new = _attention_inputs(b, h, hk, cap, d, seed=offset + d)
    slot = offset % cap if with_new else -1
    scale = d**-0.5
    (out,) = _run_plain_part(exe, cases, tag, q, k, v, offset, cap, k_new, v_new, slot,
                             f"{tag}_{offset}_{int(with_new)}", tmp)
    with mx.stream(mx.cpu):
        new = (k_new, v_new, mx.array(slot, mx.int32)) if with_new else None
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), scale, new=new)
    np.testing.assert_allclose(out.reshape(b, 1, h * d), np.array(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tag", list(ATTN_WRITE_CONFIGS))
@pytest.mark.parametrize("offset", [0, 37, 299])
def test_decode_attention_writes_the_new_key_in_place_emulated(emulated, tag, offset):
    """WRITE: the same attention as reading the new key and value in their slot, and the buffers
    hold them there afterwards, every other slot untouched."""
    exe, cases, _, _, tmp = emulated
    b, h, hk, cap, d = ATTN_WRITE_CONFIGS[tag]
    q, k, v, k_new, v_new = _attention_inputs(b, h, hk, cap, d, seed=offset + d + 1)
    scale = d**-0.5
    out, k_after, v_after = _run_plain_part(exe, cases, tag, q, k, v, offset, cap, k_new, v_new, offset,
                                            f"{tag}_{offset}_write", tmp)
    with mx.stream(mx.cpu):
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), scale,
                                          new=(k_new, v_new, mx.array(offset, mx.int32)))
    np.testing.assert_allclose(out.reshape(b, 1, h * d), np.array(want), rtol=2e-5, atol=2e-5)
    for after, before, new in ((k_after, k, k_new), (v_after, v, v_new)):
        want_buf = np.array(before).copy()
        want_buf[:, :, offset] = np.array(new)[:, :, 0]
        np.testing.assert_array_equal(after, want_buf)


@pytest.mark.parametrize("tag", list(ATTN_QKV_CONFIGS))
@pytest.mark.parametrize("offset", [0, 10, 270, 1100, 5000])
def test_decode_attention_from_qkv_kernel_emulated(emulated, tag, offset):
    """The head preparation inside the attention equals qkv_heads then the attention with the new
    key in the position's slot; the key and value it writes out equal qkv_heads' k and v."""
    exe, cases, _, _, tmp = emulated
    b, h, hk, cap, d, dtype, write = ATTN_QKV_CONFIGS[tag]
    keys = mx.random.split(mx.random.key(offset + d + 1), 5)
    qkv = (2.0 * mx.random.normal((b, 1, (h + 2 * hk) * d), key=keys[0])).astype(dtype)
    q_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[1])
    k_scale = 1.0 + 0.1 * mx.random.normal((d,), key=keys[2])
    inv_freq = rope_inv_freq(d, 1e4)
    k, v = mx.random.normal((b, hk, cap, d), key=keys[3]), mx.random.normal((b, hk, cap, d), key=keys[4])
    slot, scale = offset % cap, 256**-0.5
    case = cases[tag]
    case.inputs = [qkv, q_scale, k_scale, inv_freq, k, v, mx.array([offset], mx.int32), mx.array([cap], mx.int32),
                   mx.array([slot], mx.int32)]
    name = f"{tag}_{offset}"
    (tmp / name).mkdir()
    out, k_new, v_new, *written = run(exe, tag, case, tmp / name)
    out = _merged(exe, cases, tag, out, cap, tmp / f"{name}_c")
    if write:  # the new key and value stored in the slot, every other slot as it was
        for after, before, new in zip(written, (k, v), (k_new, v_new)):
            want_buffer = np.array(before)
            want_buffer[:, :, slot] = new[:, :, 0]
            np.testing.assert_array_equal(after, want_buffer)
    else:
        assert not written
    with mx.stream(mx.cpu):
        q, want_k, want_v = qkv_heads_reference(qkv, q_scale, k_scale, inv_freq, offset, h, hk, 1e-6)
        want = decode_attention_reference(q, k, v, mx.array(offset, mx.int32), scale,
                                          new=(want_k, want_v, mx.array(slot, mx.int32)))
    np.testing.assert_allclose(k_new, np.array(want_k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v_new, np.array(want_v), rtol=0, atol=0)
    np.testing.assert_allclose(out.reshape(b, 1, h * d), np.array(want), rtol=2e-5, atol=2e-5)


RVQ_RUNS = [(0, 1, False), (2, 5, False), (2, 5, True), (0, 8, True)]  # start, count, into


def _rvq_inputs(tag, count):
    """Random codebooks (8 of them), residual rows and code rows for a config."""
    dtype, d, k, _ = RVQ_CONFIGS[tag]
    rows, width = 3, 8  # the cases' code rows
    keys_ = mx.random.split(mx.random.key(count + d), 3)
    books = mx.random.normal((8, k, d), key=keys_[0]).astype(dtype)
    residual = 2.0 * mx.random.normal((rows, d), key=keys_[1])
    row = mx.random.randint(0, k, (rows, width), key=keys_[2]).astype(mx.int32)
    return books, residual, row, codebook_norms(books)


_RVQ_CHAINS = {}  # (tag, start, count, into) -> the chain's outputs: its test and the cluster's share a run


def _rvq_chain(emulated, tag, start, count, into):
    """The chain the host runs: a step launch per codebook, then the finish -> (residual, code rows)."""
    if (tag, start, count, into) not in _RVQ_CHAINS:
        _RVQ_CHAINS[tag, start, count, into] = _rvq_chain_run(emulated, tag, start, count, into)
    return _RVQ_CHAINS[tag, start, count, into]


def _rvq_chain_run(emulated, tag, start, count, into):
    exe, cases, _, _, tmp = emulated
    books, residual, row, norms = _rvq_inputs(tag, count)
    rows, width = row.shape
    col0, w = (start, width) if into else (0, count)
    r, keys, codes = residual, residual, row if into else mx.zeros((rows, width), mx.int32)
    for i in range(count):
        name = f"{tag}_first_into" if i == 0 and into else f"{tag}_first" if i == 0 else f"{tag}_next"
        case = cases[name]
        case.inputs = [r, keys, books, norms, mx.array([start + i, col0 + i, w], mx.int32), codes]
        (tmp / f"{tag}_{start}_{count}_{into}_{i}").mkdir(exist_ok=True)
        r, keys, codes = run(exe, name, case, tmp / f"{tag}_{start}_{count}_{into}_{i}")
        r, keys, codes = mx.array(r), mx.array(keys), mx.array(codes)
    case = cases[f"{tag}_finish"]
    case.inputs = [r, keys, books, mx.array([start + count - 1, col0 + count - 1, w], mx.int32), codes]
    (tmp / f"{tag}_{start}_{count}_{into}_finish").mkdir(exist_ok=True)
    r_out, codes = run(exe, f"{tag}_finish", case, tmp / f"{tag}_{start}_{count}_{into}_finish")
    return r_out, codes.reshape(-1)[: rows * w].reshape(rows, w)


def _assert_rvq_equals_reference(tag, start, count, into, r_out, codes):
    books, residual, row, norms = _rvq_inputs(tag, count)
    with mx.stream(mx.cpu):
        want_codes, want_r = rvq_search_reference(residual, books, start, count, norms, row if into else None)
    np.testing.assert_array_equal(codes, np.array(want_codes))
    np.testing.assert_allclose(r_out, np.array(want_r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tag", list(RVQ_CONFIGS))
@pytest.mark.parametrize("start,count,into", RVQ_RUNS)
def test_rvq_kernels_emulated(emulated, tag, start, count, into):
    """The chain the host runs: a step launch per codebook, then the finish; each launch carries the
    code row on (into: the row's earlier codes kept, the new ones in columns start..; else the
    codes alone, columns 0..count - 1)."""
    _assert_rvq_equals_reference(tag, start, count, into, *_rvq_chain(emulated, tag, start, count, into))


@pytest.mark.parametrize("tag", list(RVQ_CONFIGS))
@pytest.mark.parametrize("start,count,into", RVQ_RUNS)
def test_rvq_cluster_kernel_emulated(emulated, tag, start, count, into):
    """The whole run in one launch of 8-block clusters (each cluster's blocks run at once here, its
    barrier theirs, each block reading the others' best keys from their shared memory) gives the
    chain's codes and residual bit for bit, and the reference's codes."""
    exe, cases, _, _, tmp = emulated
    books, residual, row, norms = _rvq_inputs(tag, count)
    rows, width = row.shape
    col0, w = (start, width) if into else (0, count)
    name = f"{tag}_cluster" + ("_into" if into else "")
    case = copy.copy(cases[name])
    case.inputs = [residual, books, norms, mx.array([start, count, col0, w], mx.int32),
                   row if into else mx.zeros((rows, width), mx.int32)]
    case.outputs = [("float", (rows, books.shape[2])), ("int32_t", (rows, w))]
    (tmp / f"{name}_{start}_{count}").mkdir()
    r_out, codes = run(exe, name, case, tmp / f"{name}_{start}_{count}")
    chain_r, chain_codes = _rvq_chain(emulated, tag, start, count, into)
    np.testing.assert_array_equal(codes, chain_codes)
    np.testing.assert_array_equal(r_out.view(np.uint32), chain_r.view(np.uint32))
    _assert_rvq_equals_reference(tag, start, count, into, r_out, codes)


@pytest.mark.parametrize("name", ["argmax_bf16_logits", "argmax_f32", *ARGMAX_STREAM_CASES])
def test_two_head_argmax_kernels_emulated(emulated, name):
    exe, cases, refs, argmax, tmp = emulated
    case, (ref_a, ref_b) = cases[name], refs[name]
    keys, *logits = run(exe, name, case, tmp)
    if len(logits) == 1:  # the streamed kernel's one output: [2, M, N] (or unwritten)
        logits = list(logits[0]) if case.template_args["WRITE_LOGITS"] else [None, None]
    logits_a, logits_b = logits
    finish, nb = argmax[name]
    finish.inputs = [mx.array(keys.reshape(-1))]
    (ids,) = run(exe, name + "_finish", finish, tmp)
    want = np.stack([np.argmax(ref_a, -1), np.argmax(ref_b, -1)], -1)  # numpy: first max, first NaN
    assert np.isnan(ref_b).any() and int(want[0, 1]) == int(np.flatnonzero(np.isnan(ref_b[0]))[0])
    np.testing.assert_array_equal(ids, want)
    if case.template_args["WRITE_LOGITS"]:
        t = case.outputs[1][0]
        for got, ref in ((logits_a, ref_a), (logits_b, ref_b)):
            np.testing.assert_allclose(as_float(got, t), ref, rtol=8e-3, atol=8e-3 * np.nanmax(np.abs(ref)))
