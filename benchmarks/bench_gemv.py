"""The GEMV kernels against MLX's own ops at the model's decode shapes (a few rows).

    PYTHONPATH=python pytest benchmarks/bench_gemv.py --benchmark-enable              # tiny shapes
    VOICECHAT_BENCH_SIZE=full pytest benchmarks/bench_gemv.py --benchmark-enable      # published shapes (GPU)
    PYTHONPATH=python python benchmarks/bench_gemv.py --size full --json OUT.json     # table + JSON
    PYTHONPATH=python python benchmarks/bench_gemv.py --size full --rows 1,2,4        # sessions stepped together

Cases, each ours vs MLX's op, float32 and bfloat16 activations:
- q4:     4-bit GEMV (`--rows`, default 1) at every distinct Nemotron-H projection shape and the
          131072 x 4480 head, vs `mx.quantized_matmul`;
- dense:  bf16-weight GEMV (2 rows: the TTS backbone's two CFG rows) at the TTS model's linear
          shapes, vs `x @ w.T`;
- argmax: both heads' argmax in one pass vs two `mx.quantized_matmul` + `mx.argmax` (`--rows`);
- floor:  every Nemotron-H projection (one distinct weight each) + both heads (`--rows`): the LLM
          step's matmul floor.
Each timed round evaluates many calls (mx.eval, time.perf_counter, after warm-up); weights are
cycled over copies totalling >= 256 MB so that a call reads them from memory, not from the
GPU's L2 (50-60 MB on sm_90 parts). GB/s counts the packed weights, scales and biases once per call. On a CPU the
"ours" path is MLX's op itself (the kernels are CUDA only), so only tiny shapes make sense there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import pytest

try:  # an installed voicechat first; else the source tree (with tools/dev-build.sh's extension)
    import voicechat.kernels  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from voicechat.kernels import build_info  # noqa: E402
from voicechat.kernels.gemv import (  # noqa: E402
    dense_matvec,
    quantized_matvec,
    two_head_argmax,
    two_head_argmax_reference,
)
from voicechat.synthetic import full_config, inventory, tiny_config  # noqa: E402

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")
CYCLE_BYTES = 256 << 20
MIN_CALLS = 8  # calls per timed round, at least
DTYPES = {"bf16": mx.bfloat16, "f32": mx.float32}
EMBEDDINGS = ("embed_tokens", "special_emb", "cont_emb")


# --------------------------------------------------------------------------- shapes

def llm_projections(size: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of every 4-bit Nemotron-H projection and both heads, as the inventory lists them."""
    specs, _ = inventory(full_config() if size == "full" else tiny_config(), quantize=4)
    return [(s.name[: -len(".weight")], s.shape[0], s.shape[1] * 8) for s in specs
            if s.quantize and s.name.endswith(".weight") and "embed_tokens" not in s.name]


def tts_linear_shapes(size: str) -> list[tuple[int, int]]:
    specs, _ = inventory(full_config() if size == "full" else tiny_config(), quantize=4)
    return sorted({s.shape for s in specs if s.name.startswith("tts_model.") and s.name.endswith(".weight")
                   and len(s.shape) == 2 and not any(e in s.name for e in EMBEDDINGS)})


def distinct(shapes):
    return sorted(set(shapes), key=lambda nk: (-nk[0] * nk[1], nk))


# --------------------------------------------------------------------------- arrays

def random_q4(n: int, k: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    kw, kv, ks, kb = mx.random.split(mx.random.key(seed), 4)
    shape = (n, k // 8)
    w = (mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=kw) << 16) | mx.random.randint(
        0, 1 << 16, shape, dtype=mx.uint32, key=kv)
    scales = (mx.random.normal((n, k // 64), key=ks) * 0.02).astype(mx.bfloat16)
    biases = (mx.random.normal((n, k // 64), key=kb) * 0.02).astype(mx.bfloat16)
    mx.eval(w, scales, biases)
    return w, scales, biases


def q4_bytes(n: int, k: int) -> int:
    return n * k // 2 + 2 * n * (k // 64) * 2


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(CYCLE_BYTES / nbytes)))


def random_head(n: int, k: int, seed: int) -> nn.QuantizedLinear:
    """A 4-bit head [n, k] without the float matrix: a small layer given random packed arrays."""
    head = nn.QuantizedLinear(64, 1, bias=False, group_size=64, bits=4)
    head.weight, head.scales, head.biases = random_q4(n, k, seed)
    return head


# --------------------------------------------------------------------------- timing

def seconds_per_round(run: Callable[[], list], *, warmup: int = 3, repeats: int = 7, min_seconds: float = 0.05):
    """Median wall time of mx.eval(run()) (after warm-up), each sample spanning >= min_seconds."""
    for _ in range(warmup):
        mx.eval(run())
    t0 = time.perf_counter()
    mx.eval(run())
    loops = max(1, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-7)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            mx.eval(run())
        samples.append((time.perf_counter() - t0) / loops)
    return statistics.median(samples)


@dataclass
class Result:
    group: str
    name: str
    impl: str
    x: str
    rows: int
    calls: int  # per round
    bytes_per_call: int
    us_per_call: float
    gbps: float
    extra: dict = field(default_factory=dict)


ECHO = False  # script mode: print every result as it is measured (a cut-off run still tells something)


def emit(r: Result) -> Result:
    if ECHO:
        print(f"  {r.group:<11} {r.name:<14} {r.x:<5} {r.rows:>2} {r.impl:<5} {r.us_per_call:9.1f} us "
              f"{r.gbps:8.1f} GB/s", flush=True)
    return r


def measure(group, name, impl, x_name, rows, calls, bytes_per_call, run, extra=None) -> Result:
    s = seconds_per_round(run) / calls
    return emit(Result(group, name, impl, x_name, rows, calls, bytes_per_call, s * 1e6, bytes_per_call / s / 1e9,
                       extra or {}))


# --------------------------------------------------------------------------- cases

def q4_copies(n, k):
    """Enough random 4-bit matrices [n, k] that cycling through them defeats the L2 cache."""
    return [random_q4(n, k, seed) for seed in range(copies_for(q4_bytes(n, k)))]


def dense_copies(n, k):
    copies = [(mx.random.normal((n, k), key=mx.random.key(i)) * 0.03).astype(mx.bfloat16)
              for i in range(copies_for(n * k * 2))]
    mx.eval(copies)
    return copies


def q4_runs(n, k, x_dtype, rows=1):
    """{impl: (calls, run)} for one 4-bit shape."""
    copies = q4_copies(n, k)
    x = mx.random.normal((rows, k)).astype(x_dtype)
    calls = max(MIN_CALLS, len(copies))
    order = [copies[i % len(copies)] for i in range(calls)]

    def ours():
        return [quantized_matvec(x, w, s, b) for w, s, b in order]

    def mlx():
        return [mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4) for w, s, b in order]

    return calls, {"ours": ours, "mlx": mlx}


def dense_runs(n, k, x_dtype, rows=2):
    copies = dense_copies(n, k)
    x = mx.random.normal((rows, k)).astype(x_dtype)
    calls = max(MIN_CALLS, len(copies))
    order = [copies[i % len(copies)] for i in range(calls)]

    def ours():
        return [dense_matvec(x, w) for w in order]

    def mlx():
        return [x @ w.T for w in order]

    return calls, {"ours": ours, "mlx": mlx}


def argmax_runs(n, k, x_dtype, rows=1):
    head_a, head_b = random_head(n, k, 1), random_head(n, k, 2)
    h = mx.random.normal((rows, k)).astype(x_dtype)
    calls = MIN_CALLS
    return calls, {"ours": lambda: [two_head_argmax(h, head_a, head_b) for _ in range(calls)],
                   "mlx": lambda: [two_head_argmax_reference(h, head_a, head_b) for _ in range(calls)]}


def floor_runs(size, x_dtype, rows=1):
    projections = llm_projections(size)
    weights = [random_q4(n, k, i) for i, (_, n, k) in enumerate(projections)]
    xs = {k: mx.random.normal((rows, k)).astype(x_dtype) for _, _, k in projections}
    mx.eval(list(xs.values()))
    pairs = [(xs[k], w) for (_, _, k), w in zip(projections, weights)]
    total = sum(q4_bytes(n, k) for _, n, k in projections)
    return len(projections), total, {
        "ours": lambda: [quantized_matvec(x, w, s, b) for x, (w, s, b) in pairs],
        "mlx": lambda: [mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4) for x, (w, s, b) in pairs],
    }


def release():
    mx.synchronize()
    mx.clear_cache()


# --------------------------------------------------------------------------- script mode

GROUPS = ("q4", "dense", "argmax", "floor")


def run_all(size: str, groups=GROUPS, rows_list=(1,)) -> list[Result]:
    results = []
    cfg = full_config().text_config if size == "full" else tiny_config().text_config
    for n, k in distinct((n, k) for _, n, k in llm_projections(size)) if "q4" in groups else []:
        for x_name, x_dtype in DTYPES.items():
            for rows in rows_list:
                calls, runs = q4_runs(n, k, x_dtype, rows)
                for impl, run in runs.items():
                    results.append(measure("q4", f"{n}x{k}", impl, x_name, rows, calls, q4_bytes(n, k), run))
                del runs
                release()
    for n, k in tts_linear_shapes(size) if "dense" in groups else []:
        for x_name, x_dtype in DTYPES.items():
            calls, runs = dense_runs(n, k, x_dtype)
            for impl, run in runs.items():
                results.append(measure("dense", f"{n}x{k}", impl, x_name, 2, calls, n * k * 2, run))
            del runs
            release()
    for x_name, x_dtype in DTYPES.items() if "argmax" in groups else []:
        for rows in rows_list:
            calls, runs = argmax_runs(cfg.vocab_size, cfg.hidden_size, x_dtype, rows)
            for impl, run in runs.items():
                results.append(measure("argmax", f"2x{cfg.vocab_size}x{cfg.hidden_size}", impl, x_name, rows, calls,
                                       2 * q4_bytes(cfg.vocab_size, cfg.hidden_size), run))
            del runs
            release()
    for x_name, x_dtype in DTYPES.items() if "floor" in groups else []:
        for rows in rows_list:
            count, total, runs = floor_runs(size, x_dtype, rows)
            for impl, run in runs.items():
                r = measure("floor", f"{count} matrices", impl, x_name, rows, 1, total, run, {"matrices": count})
                results.append(r)
            del runs
            release()
    return results


def table(results: list[Result]) -> str:
    base = {(r.group, r.name, r.x, r.rows): r for r in results if r.impl == "mlx"}
    lines = [f"{'case':<8} {'shape':<22} {'x':<5} {'rows':>4} {'impl':<5} {'us/call':>10} {'GB/s':>9} {'vs mlx':>7}"]
    for r in results:
        ref = base.get((r.group, r.name, r.x, r.rows))
        speedup = f"{ref.us_per_call / r.us_per_call:6.2f}x" if ref and r.impl != "mlx" else ""
        lines.append(f"{r.group:<8} {r.name:<22} {r.x:<5} {r.rows:>4} {r.impl:<5} {r.us_per_call:10.1f} {r.gbps:9.1f} "
                     f"{speedup:>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("tiny", "full"), default=SIZE)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    p.add_argument("--rows", default="1", help="comma-separated rows of x for q4, argmax and floor (1, 2, 4)")
    args = p.parse_args(argv)
    try:
        rows_list = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        p.error(f"--rows: whole numbers separated by commas, not {args.rows!r}")
    if any(r < 1 for r in rows_list):
        p.error("--rows: each at least 1")
    info = {"size": args.size, "device": str(mx.default_device()), "build": build_info(), "mlx": mx.__version__,
            "tf32": os.environ.get("MLX_ENABLE_TF32", "")}
    print(json.dumps(info))
    groups = tuple(g for g in args.only.split(",") if g)
    unknown = set(groups) - set(GROUPS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}")
    global ECHO
    ECHO = True
    results = run_all(args.size, groups, rows_list)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"info": info, "results": [asdict(r) for r in results]}, indent=1))
    return 0


# --------------------------------------------------------------------------- pytest-benchmark

def _shape_ids(shapes):
    return [f"{n}x{k}" for n, k in shapes]


Q4_SHAPES = distinct((n, k) for _, n, k in llm_projections(SIZE))
DENSE_SHAPES = tts_linear_shapes(SIZE)


def _bench(benchmark, run, calls, bytes_per_call, **info):
    out = benchmark(lambda: mx.eval(run()))
    median = getattr(getattr(getattr(benchmark, "stats", None), "stats", None), "median", None)
    if median:  # None with --benchmark-disable
        info["gbps"] = bytes_per_call * calls / median / 1e9
    benchmark.extra_info.update(size=SIZE, calls_per_round=calls, bytes_per_call=bytes_per_call, **info)
    return out


@pytest.mark.parametrize("impl", ["ours", "mlx"])
@pytest.mark.parametrize("x", list(DTYPES))
@pytest.mark.parametrize("n,k", Q4_SHAPES, ids=_shape_ids(Q4_SHAPES))
def test_q4_matvec(benchmark, n, k, x, impl):
    calls, runs = q4_runs(n, k, DTYPES[x])
    _bench(benchmark, runs[impl], calls, q4_bytes(n, k), shape=[n, k], x=x, impl=impl)
    del runs
    release()


@pytest.mark.parametrize("impl", ["ours", "mlx"])
@pytest.mark.parametrize("x", list(DTYPES))
@pytest.mark.parametrize("n,k", DENSE_SHAPES, ids=_shape_ids(DENSE_SHAPES))
def test_dense_matvec(benchmark, n, k, x, impl):
    calls, runs = dense_runs(n, k, DTYPES[x])
    _bench(benchmark, runs[impl], calls, n * k * 2, shape=[n, k], x=x, impl=impl, rows=2)
    del runs
    release()


@pytest.mark.parametrize("impl", ["ours", "mlx"])
@pytest.mark.parametrize("x", list(DTYPES))
def test_two_head_argmax(benchmark, x, impl):
    cfg = full_config().text_config if SIZE == "full" else tiny_config().text_config
    calls, runs = argmax_runs(cfg.vocab_size, cfg.hidden_size, DTYPES[x])
    _bench(benchmark, runs[impl], calls, 2 * q4_bytes(cfg.vocab_size, cfg.hidden_size), x=x, impl=impl)
    del runs
    release()


@pytest.mark.parametrize("impl", ["ours", "mlx"])
@pytest.mark.parametrize("x", list(DTYPES))
def test_llm_matmul_floor(benchmark, x, impl):
    count, total, runs = floor_runs(SIZE, DTYPES[x])
    _bench(benchmark, runs[impl], 1, total, matrices=count, x=x, impl=impl)
    del runs
    release()


if __name__ == "__main__":
    raise SystemExit(main())
