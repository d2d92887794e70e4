"""Launch shapes of the 4-bit GEMV at the LLM's shapes (out_proj 4480x10240, down_proj 4480x15680,
in_proj 22656x4480, up_proj 15680x4480), float32 x, one input row: the program
`tools/gpu/qmv_variants.sh` runs under Nsight Compute.

  stream   the weight rows, scales and biases read and folded, no math: what a kernel of this grid
           can stream (the roofline of the launch shape); built here from the extension's device
           code (vc_gemv's header, fetched through ext.cuda_sources()). With a suffix, the product's
           other parts added one by one (STREAM_FLAGS): x (its float32 chunk loads as the product
           makes them), xc (the same bytes coalesced, as from a chunk-major x), xs (x staged by
           each warp in shared memory), r (the block sum and store), o (the product's occupancy:
           5 blocks an SM): streamx, streamxr, streamo, streamxo, streamxro, streamxc, streamxs,
           streamxsr. H200, in_proj, f32 x (2026-12-02): 15.3 / 26.6 / 20.2 / 18.5 (warp-staged;
           20.1 staged by the block behind one barrier) us for stream / x / xc / xs, 28.5 xr,
           20.4 xsr, 29.5 xo, 32.4 xro; the product 28.9
  ext      the step's own instance through the extension (prologue and emitted norm included) at
           (rows, threads); threads 0: the default; its fourth field is row_groups (1: one group of rows
           a block; > 1 the block layout with that many, see quantized_matvec)
  imma     the same through the integer-MMA layout; its fourth field is quantized_matvec's imma
           (1: the default groups in flight a warp, 2-16 that many); rows and threads are ignored
  tma      the same through the streamed layout (bulk copies into shared memory) at (rows, threads;
           0: its defaults); its fourth field is quantized_matvec's stages (tiles in flight a block)
  immatma  the integer-MMA product on the streamed layout's bulk-copied slabs (imma=1 with stages);
           its fourth field is the stages; rows 8: 8-row slabs (the weights as the MMA's B operand),
           else 16; threads 0: 8 warps
  dp4a     the float streamed layout with its products as integer dot products (quantized_matvec's
           dp4a): its fourth field is the levels (x's int8 terms), at 2 stages
  tmaprobe the streamed layout's loads and nothing else (vc_stream's bulk copies, STAGES tiles of
           rows in flight a block, each tile's bytes touched once in, then the stage refilled): what
           its walk can stream; its fourth field is the stages. tmaprobex: every block first loads
           x's K floats and waits for them, as the streamed kernels' prologue does.
  An optional fifth field (imma, tma, immatma, dp4a, tmaprobe*) is the blocks an SM (0: as the extension
  picks).

Tried with it and removed (2026-12-01, commit 65a9609 has the code): a cp.async ring into shared
memory (lost at every shape: 10 warps an SM), the product without the register prefetch, split-K.

    PYTHONPATH=python python tools/gpu/qmv_variants.py [--list] [--nvcc]

QMV_VARIANTS="in_proj:ext:8:96:1,out_proj:tmaprobe:8:320:2:1" adds variants
(shape:kind:rows:threads:fourth[:blocks an SM]),
QMV_SHAPES="in_proj,up_proj" keeps only those shapes (and adds any of ROUND_SHAPES it names: out_proj's
K at whole rounds of its launch, e.g. out_proj_n4224, each with the default launch),
QMV_LAUNCHES=1 launches each variant once (twice by default). QMV_INPUTS_IN_L2=1 (for Nsight
Compute's --cache-control none: qmv_variants.sh with NCU_CACHE=none) reads 256 MB before each launch
and writes x, the norm's partials and the residual anew: the weights come from DRAM and the
activations from the L2, as in the decode step, where the kernel before wrote them (with the caches
flushed, x's loads go to DRAM too).

--list prints the variants; --nvcc compiles each stream variant for sm_90 with nvcc here (no GPU)
and prints its registers a thread.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_gemv import random_q4  # noqa: E402

from voicechat.kernels import ext  # noqa: E402

STREAM = """
  constexpr int CHUNKS = K / 32;
  constexpr int GROUPS = K / 64;
  constexpr int PART = CHUNKS / KSPLIT;
  const uint4* w4 = reinterpret_cast<const uint4*>(weight);
  const int first = (blockIdx.x % KSPLIT) * PART;
  const int row0 = (blockIdx.x / KSPLIT) * ROWS;
  unsigned int fold = 0u;
  float xs = 0.0f;
  __shared__ float4 sx[(FLAGS & 16) != 0 ? K / 4 : 1];
  if constexpr ((FLAGS & 16) != 0) {  // x into shared memory first (STAGE)
    if (static_cast<int>(threadIdx.x) < PART) {  // the first weights in flight meanwhile
      const size_t row = static_cast<size_t>(min(row0, N - 1));
      fold = __ldcs(w4 + row * CHUNKS + first + threadIdx.x).x;
    }
    vc_probe::stage_x<K, THREADS>(x, sx);
  }
  for (int c = first + threadIdx.x; c < first + PART; c += THREADS) {
    uint4 v[ROWS];
    unsigned int sb[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const size_t row = static_cast<size_t>(min(row0 + r, N - 1));
      v[r] = __ldcs(w4 + row * CHUNKS + c);
      sb[r] = static_cast<unsigned int>(__bfloat16_as_ushort(scales[row * GROUPS + c / 2])) ^
              (static_cast<unsigned int>(__bfloat16_as_ushort(biases[row * GROUPS + c / 2])) << 16);
    }
    if constexpr ((FLAGS & 1) != 0) {  // the chunk's 32 float32 x values, as the product loads them
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float4 t;
        if constexpr ((FLAGS & 16) != 0) {  // from the staged copy (STAGE's layout)
          t = sx[vc_probe::staged_slot(c, j)];
        } else if constexpr ((FLAGS & 8) != 0) {  // the same bytes, coalesced (a chunk-major x)
          t = reinterpret_cast<const float4*>(x)[j * CHUNKS + c];
        } else {
          t = reinterpret_cast<const float4*>(x)[c * 8 + j];
        }
        xs += (t.x + t.y) + (t.z + t.w);
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) fold ^= v[r].x ^ v[r].y ^ v[r].z ^ v[r].w ^ sb[r];
  }
  if constexpr ((FLAGS & 4) != 0) {  // 42 KB of shared memory a block: 5 blocks an SM, as the product's 80 registers
    __shared__ float pad[42 * 256 - ((FLAGS & 2) != 0 ? ROWS * THREADS + ROWS : 0)];
    if (fold == 0x9E3779B9u) {
      pad[threadIdx.x] = xs;
      out[blockIdx.x * ROWS] = pad[(threadIdx.x + 1) % THREADS];
    }
  }
  if constexpr ((FLAGS & 2) != 0) {  // the block's row sums and their store, as the product's epilogue
    __shared__ float part[ROWS * THREADS];
    __shared__ float total[ROWS];
    float vals[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) vals[r] = static_cast<float>((fold >> r) & 255u) + xs;
    vc_gemv::block_sum<ROWS, THREADS>(vals, part, total);
    if (threadIdx.x < ROWS) out[blockIdx.x * ROWS + threadIdx.x] = total[threadIdx.x];
  } else if (fold == 0x9E3779B9u && xs != 1.5f) {
    out[blockIdx.x * ROWS] = static_cast<float>(fold);  // keeps the loads
  }
"""

# the tmaprobe kinds: the streamed walk's bulk copies alone (XLOAD 1: x's K floats loaded and waited
# for first, as the streamed kernels' prologue). Its VC_STAMPs are empty here; qmv_timeline.py's
# probe kind defines them.
TMA_PROBE = """
  constexpr int GROUPS = K / 64;
  using S = vc_stream::Stage<ROWS, K / 2, K / 2, ROWS * GROUPS * 2>;
  constexpr int TILES = N / ROWS;
  VC_DYNAMIC_SMEM(vc_stages);
  __shared__ unsigned long long bars[STAGES];
  __shared__ unsigned int arrived[STAGES];
  const vc_stream::Walk<S, TILES, 1> walk;  // whole tiles: blockIdx.x, + gridDim.x, ...
  const unsigned char* wb = reinterpret_cast<const unsigned char*>(weight);
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(scales);
  const unsigned char* bb = reinterpret_cast<const unsigned char*>(biases);
  float xs = 0.0f;
  if constexpr (XLOAD != 0) {
    for (int i = threadIdx.x; i < K / 4; i += THREADS) {
      const float4 t = reinterpret_cast<const float4*>(x)[i];
      xs += (t.x + t.y) + (t.z + t.w);
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    vc_stream::start_tiles<STAGES, S>(walk, bars, arrived, vc_stages, wb, sb, bb, static_cast<int>(threadIdx.x));
  }
  unsigned int fold = xs == 1.5f ? 1u : 0u;  // x in before the walk, as the product's pair form needs it
  __syncthreads();
  VC_STAMP(0, 0);
  for (int i = 0; i < walk.count; ++i) {
    const int st = i % STAGES;
    vc_stream::bar_wait(&bars[st], (i / STAGES) & 1);
    VC_STAMP(1, i);
    vc_stream::ramp_tiles<STAGES, S>(i, walk, bars, vc_stages, wb, sb, bb, static_cast<int>(threadIdx.x & 31));
    fold ^= reinterpret_cast<const unsigned int*>(vc_stages + st * S::BYTES)[threadIdx.x];
    __syncthreads();
    VC_STAMP(2, i);
    if (threadIdx.x < 32 && i + STAGES < walk.count) {
      vc_stream::reads_before_copies();
      walk.fetch(i + STAGES, vc_stages + st * S::BYTES, wb, sb, bb, &bars[st], static_cast<int>(threadIdx.x));
    }
  }
  if (fold == 0x9E3779B9u) {
    out[blockIdx.x] = static_cast<float>(fold);  // keeps the reads
  }
"""
TMA_PROBE_KINDS = {"tmaprobe": 0, "tmaprobex": 1}
SM_COUNT = 132  # the H200's
# the kinds with a persistent grid, which the blocks-an-SM field sets
PER_SM_KINDS = ("imma", "tma", "immatma", "dp4a", *TMA_PROBE_KINDS)

# streamxs's staging of x (tried in the block layout's product on the H200, 2026-12-02, and taken out:
# see docs/developing.md): each warp copies the x chunks its lanes read, coalesced, into float4
# slots, chunk c's eight at c * 8 + (j ^ (c % 8)) (the 8 lanes of a 16-byte shared load: 8 bank quads)
STAGE = """
namespace vc_probe {
__device__ __forceinline__ int staged_slot(int c, int j) { return c * 8 + (j ^ (c & 7)); }

template <int K, int THREADS>
__device__ __forceinline__ void stage_x(const float* x, float4* sx) {
  constexpr int CHUNKS = K / 32;
  constexpr int ITERS = (CHUNKS + THREADS - 1) / THREADS;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp_chunk = static_cast<int>(threadIdx.x) - lane;  // the warp's first chunk at step 0
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = (it * THREADS + warp_chunk) * 8 + i * 32 + lane;
      if (q < K / 4) sx[staged_slot(q / 8, q % 8)] = reinterpret_cast<const float4*>(x)[q];
    }
  }
  __syncwarp();
}
}  // namespace vc_probe
"""

# the stream kinds' parts besides the weight loads (the FLAGS template argument): x's chunk loads (1),
# the block sum and store (2), 42 KB of shared memory (4: 5 blocks an SM, the product's occupancy at
# 80 registers); x's loads coalesced as from a chunk-major x (8), or from x staged in shared memory (16)
STREAM_FLAGS = {"stream": 0, "streamx": 1, "streamxr": 3, "streamo": 4, "streamxo": 5, "streamxro": 7,
                "streamxc": 9, "streamxs": 17, "streamxsr": 19}

# name: (N, K, ext case: prenorm groups (0: none), emit, activation)
SHAPES = {
    "out_proj": (4480, 10240, (8, True, "")),
    "down_proj": (4480, 15680, (0, True, "")),
    "in_proj": (22656, 4480, (1, False, "")),
    "up_proj": (15680, 4480, (1, False, "relu_squared")),
}

# out_proj's K at N = 2112 r, r = 1-4 whole rounds of its launch (264 blocks of 8-row tiles, r tiles a
# block), and at its own 4480 (2.12 rounds: a third round of 32 tiles), each with the default launch
# alone: named in QMV_SHAPES only (tools/gpu/out_proj_rounds.sh). What a round costs, what the launch
# costs beyond its rounds, and what out_proj's late third round costs.
ROUND_SHAPES = {f"out_proj_n{n}": (n, 10240, (8, True, "")) for n in (2112, 4224, 4480, 6336, 8448)}

# the kinds launched through the extension (the others are the probes': STREAM_FLAGS, TMA_PROBE_KINDS)
EXT_KINDS = ("ext", "imma", "tma", "immatma", "dp4a")
# (kind, rows, threads, ksplit) per shape; ext's fourth field: row_groups
DEFAULT = ("ext", 0, 0, 1)
VARIANTS = {
    "out_proj": [("stream", 8, 320, 1), ("stream", 8, 160, 2), DEFAULT, ("ext", 8, 160, 1), ("ext", 4, 320, 1)],
    "down_proj": [("stream", 8, 256, 1), ("stream", 8, 512, 1), DEFAULT, ("ext", 8, 512, 1), ("ext", 4, 256, 1)],
    "in_proj": [("stream", 8, 160, 1), DEFAULT, ("ext", 4, 160, 1)],
    "up_proj": [DEFAULT, ("ext", 4, 160, 1)],
}


def _from_environment() -> None:
    """QMV_VARIANTS adds launches, QMV_SHAPES keeps shapes (see the module's docstring)."""
    kinds = (*EXT_KINDS, *STREAM_FLAGS, *TMA_PROBE_KINDS)
    keep = [s for s in os.environ.get("QMV_SHAPES", "").split(",") if s]
    for name in keep:
        if name in ROUND_SHAPES:
            SHAPES[name], VARIANTS[name] = ROUND_SHAPES[name], [DEFAULT]
    for item in filter(None, os.environ.get("QMV_VARIANTS", "").split(",")):
        fields = item.split(":")
        if (len(fields) not in (5, 6) or fields[0] not in SHAPES or fields[1] not in kinds
                or (len(fields) == 6 and fields[1] not in PER_SM_KINDS)):
            raise SystemExit(f"QMV_VARIANTS: {item!r} is not shape:{'|'.join(kinds)}:rows:threads:fourth"
                             f"[:per_sm, for {'|'.join(PER_SM_KINDS)}]")
        VARIANTS[fields[0]].append((fields[1], *map(int, fields[2:])))
    for shape in list(SHAPES):
        if keep and shape not in keep:
            del SHAPES[shape]


def _header(name: str = "vc_qmv") -> str:
    for src in ext.cuda_sources():
        if src["name"] == name:
            return src["header"]
    raise SystemExit(f"the extension has no {name} source")


def _stream_kernel():
    return mx.fast.cuda_kernel(name="vc_probe_stream", input_names=["x", "weight", "scales", "biases"],
                               output_names=["out"], source=STREAM, header=_header() + STAGE)


def _tma_probe_kernel(smem: int):
    return mx.fast.cuda_kernel(name="vc_probe_tma", input_names=["x", "weight", "scales", "biases"],
                               output_names=["out"], source=TMA_PROBE, header=_header("vc_qmv_stream"),
                               shared_memory=smem)


def _tma_template(n: int, k: int, v) -> list:
    kind, rows, threads, stages, *_ = v
    return [("K", k), ("N", n), ("ROWS", rows), ("THREADS", threads), ("STAGES", stages),
            ("XLOAD", TMA_PROBE_KINDS[kind])]


def tma_probe_launch(n: int, k: int, rows: int, stages: int, per_sm: int = 0) -> tuple[int, int]:
    """(blocks, dynamic shared memory) of the tmaprobe kernel: STAGES tiles of `rows` rows a block,
    as many blocks an SM as fit (or per_sm)."""
    smem = stages * (rows * k // 2 + 2 * rows * (k // 64) * 2)
    return min(n // rows, SM_COUNT * (per_sm if per_sm > 0 else max(1, 232448 // (smem + 1024)))), smem


def _tma_probe(n: int, k: int, v, tensors):
    _, rows, threads, stages, *per_sm = v
    blocks, smem = tma_probe_launch(n, k, rows, stages, per_sm[0] if per_sm else 0)
    x, w, s, b = tensors[:4]
    return _tma_probe_kernel(smem)(
        inputs=[x, w, s, b], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
        template=_tma_template(n, k, v), output_shapes=[(blocks,)], output_dtypes=[mx.float32])


def _tag(shape: str, v) -> str:
    kind, rows, threads, fourth, *per_sm = v
    fourth_name = {"ext": "row_groups", "imma": "imma", "dp4a": "levels"}.get(
        kind, "stages" if "tma" in kind else "ksplit")
    return f"{shape} {kind} rows {rows} threads {threads} {fourth_name} {fourth}" + (
        f" per_sm {per_sm[0]}" if per_sm else "")


def _args(n: int, k: int, v) -> dict:
    kind, rows, threads, ksplit = v
    blocks = (n + rows - 1) // rows * ksplit
    return dict(grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                template=[("K", k), ("N", n), ("ROWS", rows), ("THREADS", threads), ("KSPLIT", ksplit),
                          ("FLAGS", STREAM_FLAGS[kind])],
                output_shapes=[(blocks * rows,)], output_dtypes=[mx.float32])


def _ext_call(shape: str, v, tensors):
    """The step's instance of `shape` through the extension at v's rows and threads (kind ext), or
    through its integer-MMA layout (kind imma), its streamed one (kind tma), both (kind immatma) or the
    streamed one's integer dot products (kind dp4a)."""
    kind, rows, threads, row_groups, *per_sm = v
    _, _, (groups, emit, activation) = SHAPES[shape]
    x, w, s, b, partials, residual, next_w = tensors
    pre = dict(prenormed=partials, prenorm_groups=groups) if groups else {}
    launch = dict(imma=row_groups) if kind == "imma" else dict(rows_per_block=rows, threads=threads)
    if kind == "tma":
        launch.update(stages=row_groups)
    if kind == "immatma":
        launch = dict(imma=1, stages=row_groups, threads=threads, rows_per_block=8 if rows == 8 else 0)
    if kind == "dp4a":
        launch.update(dp4a=row_groups)
    if per_sm:
        launch.update(blocks_per_sm=per_sm[0])
    if emit:
        if kind == "ext" and row_groups > 1:
            raise SystemExit(f"{shape}: the emitting matvec takes no row_groups")
        return ext.quantized_matvec_emit_norm(x, w, s, b, residual, next_w, None, 64, 4, **pre, **launch)
    if kind in ("imma", "tma", "immatma", "dp4a"):
        return [ext.quantized_matvec(x, w, s, b, None, 64, 4, activation=activation, **pre, **launch)]
    if row_groups > 1:
        launch.update(row_groups=row_groups)
    return [ext.quantized_matvec(x, w, s, b, None, 64, 4, warps=0, activation=activation, **pre, **launch)]


def _step_like(tensors):
    """tensors with the L2 as the decode step leaves it (QMV_INPUTS_IN_L2): 256 MB read (the
    weights' lines gone, no dirty lines left to write back), then x, the partials and the residual
    written anew (theirs in)."""
    mx.eval(mx.sum(sweep))
    x, w, s, b, partials, residual, next_w = tensors
    fresh = (x * 1.0, partials * 1.0, residual * 1.0)
    mx.eval(*fresh)
    return (fresh[0], w, s, b, fresh[1], fresh[2], next_w)


sweep = mx.zeros((64 << 20,), dtype=mx.float32) if os.environ.get("QMV_INPUTS_IN_L2") == "1" else None
if sweep is not None:
    mx.eval(sweep)  # made once: each launch's sweep then only reads it


def run() -> None:
    stream = _stream_kernel()
    for shape, (n, k, (groups, _, _)) in SHAPES.items():
        w, s, b = random_q4(n, k, 0)
        x = mx.random.normal((1, k))
        # partials as the producer leaves them: 640 in 8 groups (the gated conv + scan), 560 (an
        # emitting matvec's blocks)
        partials = mx.abs(mx.random.normal((1, 640 if groups > 1 else 560))) * k / 640
        tensors = (x, w, s, b, partials, mx.random.normal((1, n)), mx.ones((n,), dtype=mx.bfloat16))
        mx.eval(*tensors)
        for v in VARIANTS[shape]:
            try:
                for _ in range(int(os.environ.get("QMV_LAUNCHES", "2"))):  # 1: one profiled launch a variant
                    launch = _step_like(tensors) if sweep is not None else tensors
                    if v[0] in EXT_KINDS:
                        mx.eval(*_ext_call(shape, v, launch))
                    elif v[0] in TMA_PROBE_KINDS:
                        mx.eval(_tma_probe(n, k, v, launch)[0])
                    else:
                        mx.eval(stream(inputs=list(launch[:4]), **_args(n, k, v))[0])
            except ValueError as e:  # a launch the extension refuses: say so, measure the rest
                print("refused", _tag(shape, v), "-", e, flush=True)
                continue
            print("launched", _tag(shape, v), flush=True)


def nvcc_registers() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_cuda_sources import STUB, wrap

    nvcc = shutil.which("nvcc") or sys.exit("nvcc is not installed")
    for shape, (n, k, _) in SHAPES.items():
        for v in (v for v in VARIANTS[shape] if v[0] in STREAM_FLAGS or v[0] in TMA_PROBE_KINDS):
            if v[0] in TMA_PROBE_KINDS:
                template, source, header = _tma_template(n, k, v), TMA_PROBE, _header("vc_qmv_stream")
            else:
                template, source, header = _args(n, k, v)["template"], STREAM, _header() + STAGE
            src = {"name": "probe", "input_names": ["x", "weight", "scales", "biases"], "output_names": ["out"],
                   "source": source, "header": header}
            targs = [(name, f"int:{val}") for name, val in template]
            inst = {"input_types": ["float", "uint32_t", "__nv_bfloat16", "__nv_bfloat16"],
                    "output_types": ["float"], "template_args": targs}
            with tempfile.TemporaryDirectory() as tmp:
                cu = Path(tmp) / "probe.cu"
                cu.write_text(wrap(src, [inst]))
                proc = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-I", str(STUB), "-cubin", "-Xptxas", "-v",
                                       "-o", str(Path(tmp) / "p.cubin"), str(cu)], capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", proc.stderr)
            print(f"{_tag(shape, v)}: {regs.group(1) if regs else proc.stderr[-400:]} registers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--nvcc", action="store_true")
    args = parser.parse_args()
    _from_environment()
    if args.list:
        for shape in SHAPES:
            for v in VARIANTS[shape]:
                print(_tag(shape, v))
    elif args.nvcc:
        nvcc_registers()
    else:
        run()


if __name__ == "__main__":
    main()
