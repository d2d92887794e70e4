"""When each warp of the streamed 4-bit GEMV kernels gets to each point of its walk, on the H200: its
prologue done (x and the norm's scales, or x's integer-MMA expansion, ready), each of its block's
tiles in (the tile's mbarrier passed), its share of that tile summed, and the tile stored (by the
block's last warp). Answers what a kernel's total time cannot: whether a block's first tile lands
early or with the whole wave of first requests, how long a tile's product takes, and how much of the
kernel is the last round of tiles.

How: the kernels' walk has `VC_STAMP(event, round)` hooks, empty in the extension. This tool hands
MLX the extension's own kernel text (cuda_sources(): the step's instance, with the launch's template
args) behind a header that defines the hook as a store of the SM's cycle counter, plus the global
timer at each warp's start and end, and an extra `stamps` output. Each launch's output is first
checked bit-equal to the extension's own launch at the same settings (its default launch where it
refuses those: the same bits). The L2 is swept (256 MB read) before each launch, so the weights come
from DRAM as in the decode step.

  PYTHONPATH=python python tools/gpu/qmv_timeline.py [--nvcc]

QMV_TIMELINE="out_proj:tma:8:320:2,out_proj:immatma:0:512:2:VC_RAMP=0" picks the variants
(shape:kind:rows:threads:stages[:NAME=VALUE+...]; kind tma = vc_qmv_stream, immatma =
vc_qmv_imma_stream, whose slabs have 8 rows where the field says 8 and 16 otherwise, probe = the
streamed walk's bulk copies alone, no prologue and no product, as qmv_variants.py's tmaprobe; the
optional sixth field defines macros ahead of the kernel's text, VC_RAMP=0 asking for every
first-round tile at the start, VC_START_ITEMS=1 for one alone (csrc/gemv_cuda.h); XS=0|1|2 among
them is vc_qmv_stream's stage_x instead: how float32 x reaches each lane, see ext.stream_launch,
whose pick it is otherwise).
QMV_TIMELINE_LAUNCHES (3) the launches a variant (the one with the shortest span is reported);
QMV_TIMELINE_L2=1 writes x, the norm's partials and the residual anew after the sweep, as the decode
step leaves them in the L2. --nvcc compiles each variant's text for sm_90 with nvcc here (no GPU).
tools/gpu/timeline.sh runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_gemv import random_q4  # noqa: E402

from voicechat.kernels import ext  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the streamed walk's loads alone (a block's tiles asked for as vc_stream::walk_tiles does, each
# touched once in, its stage refilled), with its stamps; XLOAD 0: no prologue
from qmv_variants import ROUND_SHAPES, SHAPES as VARIANT_SHAPES, TMA_PROBE as PROBE, tma_probe_launch  # noqa: E402

ROUNDS, EVENTS = 4, 4  # tiles a block recorded; events: prologue, in, summed, stored
SLOTS = 4 + EVENTS * ROUNDS  # global timer and cycle count at start and end, then the events
MAX_WARPS = 32

# name: (N, K, prenorm groups (0: none), emit), from tools/gpu/qmv_variants.py's (with its round shapes)
SHAPES = {name: (n, k, groups, emit)
          for name, (n, k, (groups, emit, _)) in {**VARIANT_SHAPES, **ROUND_SHAPES}.items()}
DEFAULT_VARIANTS = ("out_proj:tma:8:320:2,out_proj:immatma:0:256:2,out_proj:immatma:0:512:2,"
                    "down_proj:tma:8:512:2,in_proj:immatma:0:256:2")


def _prefix(blocks: int, defines: tuple = ()) -> str:
    return "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines) + f"""
#define VC_TL_SLOTS {SLOTS}
#define VC_TL_ROUNDS {ROUNDS}
__device__ long long vc_tl[{blocks} * {MAX_WARPS} * VC_TL_SLOTS];
// "memory": no load or store of the kernel moves across a stamp
__device__ __forceinline__ long long vc_tl_clock() {{
  long long c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  return c;
}}
__device__ __forceinline__ long long vc_tl_global() {{
  long long c;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c)::"memory");
  return c;
}}
#define VC_STAMP(event, round)                                                                  \\
  do {{                                                                                          \\
    if ((threadIdx.x & 31) == 0 && (round) < VC_TL_ROUNDS)                                      \\
      vc_tl[(blockIdx.x * {MAX_WARPS} + (threadIdx.x >> 5)) * VC_TL_SLOTS + 4 + (event) * VC_TL_ROUNDS + (round)] = \\
          vc_tl_clock();                                                                        \\
  }} while (0)
"""


BODY_BEFORE = f"""
  long long* vc_tl_mine = vc_tl + (blockIdx.x * {MAX_WARPS} + (threadIdx.x >> 5)) * VC_TL_SLOTS;
  if ((threadIdx.x & 31) == 0) {{
    for (int i = 4; i < VC_TL_SLOTS; ++i) vc_tl_mine[i] = 0;
  }}
  const long long vc_tl_g0 = vc_tl_global(), vc_tl_c0 = vc_tl_clock();
"""
BODY_AFTER = f"""
  const long long vc_tl_g1 = vc_tl_global(), vc_tl_c1 = vc_tl_clock();
  if ((threadIdx.x & 31) == 0) {{
    auto* o = stamps + (blockIdx.x * {MAX_WARPS} + (threadIdx.x >> 5)) * VC_TL_SLOTS;
    o[0] = vc_tl_g0;
    o[1] = vc_tl_c0;
    o[2] = vc_tl_g1;
    o[3] = vc_tl_c1;
    for (int i = 4; i < VC_TL_SLOTS; ++i) o[i] = vc_tl_mine[i];
  }}
"""

DTYPES = {"float": mx.float32, "__nv_bfloat16": mx.bfloat16, "__half": mx.float16}


def _source(kind: str, emit: bool) -> dict:
    if kind == "probe":
        src = _source("tma", False)
        return dict(src, name="vc_probe_walk", input_names=["x", "weight", "scales", "biases"],
                    output_names=["out"], source=PROBE, instances=[])
    name = {"tma": "vc_qmv_stream", "immatma": "vc_qmv_imma_stream"}[kind] + ("_emit" if emit else "")
    for src in ext.cuda_sources():
        if src["name"] == name:
            return src
    raise SystemExit(f"the extension has no {name} source")


def _instance(src: dict, k: int, n: int) -> dict:
    """The registered instance at (K, N): the step's; at an N the step has none at (a round shape of
    qmv_variants.py), its instance at K with N made n."""
    at_k = [inst for inst in src["instances"] if dict(inst["template_args"]).get("K") == f"int:{k}"]
    for inst in at_k:
        if dict(inst["template_args"]).get("N") == f"int:{n}":
            return inst
    if at_k:
        return dict(at_k[0], template_args=[(name, f"int:{n}" if name == "N" else value)
                                            for name, value in at_k[0]["template_args"]])
    raise SystemExit(f"{src['name']} has no registered instance at K={k}")


def _template(src: dict, k: int, n: int, overrides: dict) -> list:
    """The step's instance with the launch's fields overridden, as MLX takes it."""
    inst = _instance(src, k, n)
    out = []
    for name, value in inst["template_args"]:
        kind, _, text = value.partition(":")
        value = {"int": int, "bool": lambda t: t == "true", "type": DTYPES.__getitem__}[kind](text)
        out.append((name, overrides.get(name, value)))
    return out


def _launch(shape: str, kind: str, rows: int, threads: int, stages: int, stage_x: int = -1) -> dict:
    """Grid, block and shared memory as the extension picks them (ext.stream_launch /
    ext.imma_stream_launch); stage_x -1 the extension's own."""
    n, k, groups, _ = SHAPES[shape]
    ng = max(groups, 1)
    if kind == "probe":
        blocks, smem = tma_probe_launch(n, k, rows, stages)
        return dict(blocks=blocks, threads=threads, smem=smem, rows=rows,
                    template=[("K", k), ("N", n), ("ROWS", rows), ("THREADS", threads), ("STAGES", stages),
                              ("XLOAD", 0)])
    if kind == "tma":
        l = ext.stream_launch(k, n, 1, True, ng, rows, threads, stages, 0, stage_x)
        return dict(blocks=l["blocks"], threads=l["threads"], smem=l["smem"], rows=l["rows"], partials=l["partials"],
                    overrides={"ROWS": l["rows"], "THREADS": l["threads"], "STAGES": stages, "XS": l["stage_x"],
                               "SPLIT": l["split"], "LEVELS": l["levels"]})
    l = ext.imma_stream_launch(k, n, 1, ng, threads, stages, 0, 8 if rows == 8 else 0)
    return dict(blocks=l["blocks"], threads=32 * l["warps"], smem=l["smem"], rows=l["rows"], partials=n // l["rows"],
                overrides={"WARPS": l["warps"], "STAGES": stages, "SLAB": l["rows"]})


def _variants() -> list:
    """(shape, kind, rows, threads, stages, macros, stage_x) a variant; XS=n among the sixth field's
    names is the launch's stage_x (-1 where not: the extension's own), the rest macros."""
    out = []
    for item in filter(None, os.environ.get("QMV_TIMELINE", DEFAULT_VARIANTS).split(",")):
        f = item.split(":")
        if len(f) not in (5, 6) or f[0] not in SHAPES or f[1] not in ("tma", "immatma", "probe"):
            raise SystemExit(f"QMV_TIMELINE: {item!r} is not shape:tma|immatma|probe:rows:threads:stages[:defines]")
        names = tuple(filter(None, f[5].split("+"))) if len(f) == 6 else ()
        stage_x = [int(d[3:]) for d in names if d.startswith("XS=")]
        out.append((f[0], f[1], *map(int, f[2:5]), tuple(d for d in names if not d.startswith("XS=")),
                    stage_x[-1] if stage_x else -1))
    return out


def _kernel_parts(shape: str, kind: str, launch: dict, defines: tuple, np_: int):
    n, k, _, emit = SHAPES[shape]
    src = _source(kind, emit)
    header = _prefix(launch["blocks"], defines) + src["header"]
    body = BODY_BEFORE + src["source"] + BODY_AFTER
    if kind == "probe":
        return src, header, body, launch["template"]
    # NP: the partials this tool makes (the registered instance's may come from another producer)
    return src, header, body, _template(src, k, n, {**launch["overrides"], "NP": np_} if np_ else launch["overrides"])


def _tensors(shape: str):
    n, k, groups, _ = SHAPES[shape]
    w, s, b = random_q4(n, k, 0)
    x = mx.random.normal((1, k))
    partials = mx.abs(mx.random.normal((1, 640 if groups > 1 else 560))) * k / 640
    residual = mx.random.normal((1, n))
    next_w = mx.ones((n,), dtype=mx.float32)
    mx.eval(x, w, s, b, partials, residual, next_w)
    return x, w, s, b, partials, residual, next_w


def _ext_outputs(shape: str, kind: str, rows: int, threads: int, stages: int, t) -> list:
    n, k, groups, emit = SHAPES[shape]
    x, w, s, b, partials, residual, next_w = t
    pre = dict(prenormed=partials, prenorm_groups=groups) if groups else {}
    launch = dict(imma=1, stages=stages, threads=threads, rows_per_block=8 if rows == 8 else 0) if kind == "immatma" \
        else dict(rows_per_block=rows, threads=threads, stages=stages)
    if emit:
        return list(ext.quantized_matvec_emit_norm(x, w, s, b, residual, next_w, None, 64, 4, **pre, **launch))
    return [ext.quantized_matvec(x, w, s, b, None, 64, 4, **pre, **launch)]


def _probe_outputs(shape: str, kind: str, launch: dict, defines: tuple, t) -> tuple[list, np.ndarray]:
    n, k, groups, emit = SHAPES[shape]
    x, w, s, b, partials, residual, next_w = t
    src, header, body, template = _kernel_parts(shape, kind, launch, defines, partials.shape[-1] if groups else 0)
    kernel = mx.fast.cuda_kernel(name=src["name"] + "_timeline", input_names=src["input_names"],
                                 output_names=[*src["output_names"], "stamps"], source=body, header=header,
                                 shared_memory=launch["smem"])
    inputs = [x, w, s, b, s, residual if emit else s, partials if groups else s]
    shapes, dtypes = [(1, n)], [mx.float32]
    if kind == "probe":
        inputs, shapes, emit = inputs[:4], [(launch["blocks"],)], False
    elif emit:
        inputs.append(next_w)
        shapes += [(1, n), (1, launch["partials"])]
        dtypes += [mx.float32, mx.float32]
    blocks, threads = launch["blocks"], launch["threads"]
    outs = kernel(inputs=inputs, grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1), template=template,
                  output_shapes=[*shapes, (blocks * MAX_WARPS * SLOTS,)], output_dtypes=[*dtypes, mx.int64])
    mx.eval(*outs)
    stamps = np.array(outs[-1]).reshape(blocks, MAX_WARPS, SLOTS)[:, : threads // 32]
    return list(outs[:-1]), stamps


def _pcts(v: np.ndarray, which=(10, 50, 90)) -> str:
    v = v[np.isfinite(v)]
    if v.size == 0:
        return "-"
    return "/".join(f"{p:.2f}" for p in (*np.percentile(v, which), v.max()))


def _span(stamps: np.ndarray) -> float:
    return float(stamps[..., 2].max() - stamps[..., 0].min())


# A warp that ends this long after the first start (ns) is counted apart: some launches held a few
# warps (or every block at its first loads) ~200-400 us, far past any kernel's own time, and with x
# staged at out_proj (XS 1) a third of the warps 100-650 us in ~100 us quanta in every launch
# (2026-12-04), while ncu timed the same kernels without stamps at 13-14.5 us: something of this
# probe's, not of the kernels; why is open.
STALLED_NS = 100_000


def report(tag: str, stamps: np.ndarray) -> None:
    """Times in us from the first warp's start: each warp's global start plus its cycles at the median
    clock rate of all warps (the global timer's steps are coarse; the cycle counts are per SM).
    Percentiles over warps (p10/p50/p90/max; stored: over blocks, p50/max)."""
    g0, c0, g1, c1 = (stamps[..., i].astype(np.float64) for i in range(4))
    rate = np.median((c1 - c0) / np.maximum(g1 - g0, 1.0))  # cycles a ns
    start = (g0 - g0.min()) / 1e3

    def at(event: int, r: int) -> np.ndarray:
        c = stamps[..., 4 + event * ROUNDS + r].astype(np.float64)
        return np.where(c > 0, start + (c - c0) / rate / 1e3, np.nan)

    end = start + (c1 - c0) / rate / 1e3
    stalled = int((end * 1e3 > STALLED_NS).sum())
    print(f"== {tag}: {stamps.shape[0]} blocks x {stamps.shape[1]} warps, span {_span(stamps) / 1e3:.2f} us, "
          f"{rate:.2f} GHz" + (f", {stalled} warps past {STALLED_NS // 1000} us" if stalled else "")
          + f"\n  start {_pcts(start)}  prologue done {_pcts(at(0, 0))}  warp ends {_pcts(end)}")
    prev = at(0, 0)
    for r in range(ROUNDS):
        tin, summed, stored = at(1, r), at(2, r), at(3, r)
        have = ~np.isnan(tin)
        if not have.any():
            break
        # a warp's product: from when it could start (tile in, its previous tile summed) to summed
        product = summed - np.fmax(tin, prev)
        stored_blocks = np.max(np.where(np.isnan(stored), -np.inf, stored), axis=1)  # the block's storing warp
        print(f"  round {r} ({int(have.any(axis=1).sum())} blocks): in {_pcts(tin[have])}  summed "
              f"{_pcts(summed[have])}  product {_pcts(product[have])}  stored {_pcts(stored_blocks, (50,))}")
        prev = summed
    sys.stdout.flush()


def _fresh(t):
    """x, the partials and the residual written anew (QMV_TIMELINE_L2): in the L2 as the step leaves them."""
    x, w, s, b, partials, residual, next_w = t
    fresh = (x * 1.0, partials * 1.0, residual * 1.0)
    mx.eval(*fresh)
    return (fresh[0], w, s, b, fresh[1], fresh[2], next_w)


def run() -> None:
    sweep = mx.zeros((64 << 20,), dtype=mx.float32)
    mx.eval(sweep)
    launches = int(os.environ.get("QMV_TIMELINE_LAUNCHES", "3"))
    in_l2 = os.environ.get("QMV_TIMELINE_L2") == "1"
    tensors = {}
    for shape, kind, rows, threads, stages, defines, stage_x in _variants():
        t = tensors.setdefault(shape, _tensors(shape))
        launch = _launch(shape, kind, rows, threads, stages, stage_x)
        xs = f" XS={launch['overrides']['XS']}" if kind == "tma" else ""
        tag = (f"{shape} {kind} rows {launch['rows']} threads {threads} stages {stages}{xs}"
               + "".join(f" {d}" for d in defines) + (" (inputs in L2)" if in_l2 else ""))
        against = "the extension's"
        try:
            want = None if kind == "probe" else _ext_outputs(shape, kind, rows, threads, stages, t)
        except ValueError as e:
            # a launch the extension refuses (a kernel its registers cannot run at this block, e.g.
            # 8:640:4 in parts: only VC_START_ITEMS=1 fits it): its default launch gives the same
            # bits (rows, threads, stages and parts change no row's sum)
            print(f"{tag}: the extension refuses this launch ({str(e)[:160]})", flush=True)
            want, against = _ext_outputs(shape, kind, 0, 0, 0, t), "the extension's default launch's"
        if want is not None:
            mx.eval(*want)
        best = None
        try:
            for _ in range(launches):
                mx.eval(mx.sum(sweep))
                got, stamps = _probe_outputs(shape, kind, launch, defines, _fresh(t) if in_l2 else t)
                if best is None or _span(stamps) < _span(best):
                    best = stamps
        except (ValueError, RuntimeError) as e:  # a launch MLX refuses: say so, measure the rest
            print(f"{tag}: refused - {e}", flush=True)
            continue
        if want is not None:
            same = all(bool(mx.array_equal(a, b)) for a, b in zip(got, want))
            print(f"{tag}: outputs {'bit-equal to' if same else 'DIFFER from'} {against}", flush=True)
        report(tag, best)


def nvcc() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_cuda_sources import STUB, wrap

    compiler = shutil.which("nvcc") or sys.exit("nvcc is not installed")
    names = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}
    for shape, kind, rows, threads, stages, defines, stage_x in _variants():
        launch = _launch(shape, kind, rows, threads, stages, stage_x)
        src, header, body, template = _kernel_parts(shape, kind, launch, defines,
                                                    640 if SHAPES[shape][2] > 1 else 560 if SHAPES[shape][2] else 0)
        targs = [(name, f"bool:{str(v).lower()}" if isinstance(v, bool) else f"int:{v}" if isinstance(v, int)
                  else f"type:{names[v]}") for name, v in template]
        probe = dict(src, source=body, header=header, output_names=[*src["output_names"], "stamps"])
        if kind == "probe":
            step = dict(input_types=["float", "uint32_t", "__nv_bfloat16", "__nv_bfloat16"], output_types=["float"])
        else:
            step = _instance(src, SHAPES[shape][1], SHAPES[shape][0])
        inst = dict(step, template_args=targs, output_types=[*step["output_types"], "int64_t"])
        with tempfile.TemporaryDirectory() as tmp:
            cu = Path(tmp) / "probe.cu"
            cu.write_text(wrap(probe, [inst]))
            proc = subprocess.run([compiler, "-arch=sm_90", "-std=c++17", "-I", str(STUB), "-cubin", "-o",
                                   str(Path(tmp) / "p.cubin"), str(cu)], capture_output=True, text=True)
        print(f"{shape} {kind} {rows}:{threads}:{stages} {'+'.join(defines)}: {'compiled' if proc.returncode == 0 else proc.stderr[-1500:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvcc", action="store_true")
    args = parser.parse_args()
    nvcc() if args.nvcc else run()


if __name__ == "__main__":
    main()
