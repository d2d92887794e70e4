"""On the lent H200: the 4-bit GEMV at the LLM's shapes back to back (one input row, weights cycled
past the L2, 32 calls an eval), float32 x at 4 and 8 rows a block, bfloat16 x at the default, and
MLX's product. Runs on any build, so two builds on one machine give an A/B (one line per case).
Back to back includes MLX's host work per call, near the kernel's own time at these sizes: for the
kernel alone use tools/gpu/qmv_ncu.sh.

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/qmv_backtoback.py [tiny]
"""

from __future__ import annotations

import sys

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_gemv import copies_for, q4_bytes, random_q4, seconds_per_round  # noqa: E402

from voicechat.kernels import ext  # noqa: E402

CALLS = 32
SHAPES = ((22656, 4480), (15680, 4480), (4480, 10240), (4480, 15680), (131072, 4480))
ROWS = (4, 8)
if len(sys.argv) > 1:  # a check of the script where there is no GPU
    SHAPES, ROWS = ((64, 512),), (4,)


def main() -> None:
    for n, k in SHAPES:
        nbytes = q4_bytes(n, k)
        copies = [random_q4(n, k, seed) for seed in range(copies_for(nbytes))]
        for x_dtype, rows_list in ((mx.float32, ROWS + ("mlx",)), (mx.bfloat16, (0, "mlx"))):
            x = mx.random.normal((1, k)).astype(x_dtype)
            mx.eval(x)
            for rows in rows_list:
                if rows == "mlx":
                    def f(w, s, b):
                        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
                else:
                    def f(w, s, b, rows=rows):
                        return ext.quantized_matvec(x, w, s, b, rows_per_block=rows, warps=0)
                run = lambda: [f(*copies[i % len(copies)]) for i in range(CALLS)]  # noqa: E731
                us = 1e6 * seconds_per_round(run, warmup=2, repeats=3, min_seconds=0.02) / CALLS
                x_name = "f32" if x_dtype == mx.float32 else "bf16"
                print(f"{n}x{k} {x_name:>4} rows {rows!s:>3}: {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s", flush=True)
        del copies


if __name__ == "__main__":
    main()
