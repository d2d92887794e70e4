"""On the lent H200: why bench_gemv's per-call time (one eval of many calls) is ~2x Nsight Compute's
duration of the same 4-bit GEMV. Times one shape's call alone (an eval, which waits, each), back to
back on one weight, back to back cycling weights past the L2, and a plain reduction over the
same bytes as the bandwidth MLX reaches with a simple kernel. Prints one line per case.

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/gemv_isolation.py
"""

from __future__ import annotations

import sys

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_gemv import copies_for, q4_bytes, random_q4, seconds_per_round  # noqa: E402

from voicechat.kernels.gemv import quantized_matvec  # noqa: E402

CALLS = 32
# any argument: one tiny shape instead (a check of the script on a CPU)
SHAPES = ((22656, 4480), (4480, 15680), (131072, 4480)) if len(sys.argv) < 2 else ((256, 512),)


def per_call_us(run, calls: int) -> float:
    return 1e6 * seconds_per_round(run) / calls


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
