"""On the lent H200: why bench_gemv's per-call time (one eval of many calls) is ~2x Nsight Compute's
duration of the same 4-bit GEMV. Times one shape's call alone (an eval and a sync each), back to
back on one weight, back to back cycling weights past the L2, and a plain reduction over the
same bytes as the bandwidth MLX reaches with a simple kernel. Prints one line per case.

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/gemv_isolation.py
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_gemv import copies_for, q4_bytes, random_q4  # noqa: E402

from voicechat.kernels.gemv import quantized_matvec  # noqa: E402

CALLS = 32
SHAPES = ((22656, 4480), (4480, 15680), (131072, 4480)) if len(sys.argv) < 2 else ((256, 512),)  # any argument: tiny (a CPU check)


def per_call_us(run, calls: int, repeats: int = 9) -> float:
    for _ in range(3):
        mx.eval(run())
    samples = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / calls)
    return 1e6 * statistics.median(samples)


def main() -> None:
    for n, k in SHAPES:
        nbytes = q4_bytes(n, k)
        copies = [random_q4(n, k, seed) for seed in range(copies_for(nbytes))]
        x = mx.random.normal((1, k)).astype(mx.bfloat16)
        mx.eval(x)
        impls = {
            "ours": lambda w, s, b: quantized_matvec(x, w, s, b),
            "mlx": lambda w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4),
        }
        for name, f in impls.items():
            one = copies[0]
            cases = {
                "alone": (lambda: [f(*one)], 1),
                "same weight x32": (lambda: [f(*one) for _ in range(CALLS)], CALLS),
                f"{len(copies)} weights cycled x32": (lambda: [f(*copies[i % len(copies)]) for i in range(CALLS)], CALLS),
            }
            for case, (run, calls) in cases.items():
                us = per_call_us(run, calls)
                print(f"{n}x{k} {name:>5} {case:>22}: {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s", flush=True)
        # The bytes of one weight read by a plain MLX reduction: what a simple streaming kernel gets.
        words = [w.view(mx.int32) for w, _, _ in copies]
        us = per_call_us(lambda: [mx.max(words[i % len(words)]) for i in range(CALLS)], CALLS)
        print(f"{n}x{k} max() over the packed weight, cycled x32: {us:8.1f} us  {n * k // 2 / us / 1e3:7.0f} GB/s",
              flush=True)


if __name__ == "__main__":
    main()
