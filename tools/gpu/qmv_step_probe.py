"""The LLM step's four 4-bit GEMV instances as the step launches them (in_proj and up_proj with a
prenormed x, out_proj with the gated group norm's partials and an emitted next norm, down_proj with
an emitted next norm; float32 x), each at several launch shapes, and MLX's product at the same
shapes: the program `tools/gpu/qmv_ncu.sh` runs under Nsight Compute with PROBE=step.

    PYTHONPATH=python python tools/gpu/qmv_step_probe.py [tiny]   (a check of the script on the CPU)
"""

from __future__ import annotations

import sys

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_gemv import random_q4  # noqa: E402

from voicechat.kernels import ext  # noqa: E402

# name: (N, K, prenorm groups (0: plain x), emit, activation, launches (rows, threads; 0 = default))
CASES = {
    "in_proj": (22656, 4480, 1, False, "", ((0, 0), (4, 0), (8, 96), (8, 128))),
    "up_proj": (15680, 4480, 1, False, "relu_squared", ((0, 0), (4, 0), (8, 96))),
    "out_proj": (4480, 10240, 8, True, "", ((0, 0), (8, 320), (4, 320), (4, 160), (2, 320), (8, 96))),
    "down_proj": (4480, 15680, 0, True, "", ((0, 0), (8, 512), (4, 512), (4, 256), (2, 512), (8, 128))),
}
if len(sys.argv) > 1:
    CASES = {"tiny": (64, 1024, 8, True, "", ((0, 0), (4, 128)))}


def launch(n: int, k: int, groups: int, emit: bool, activation: str, rows: int, threads: int, tensors):
    w, s, b, x, partials, residual, next_w = tensors
    pre = dict(prenormed=partials, prenorm_groups=groups) if groups else {}
    if emit:
        return ext.quantized_matvec_emit_norm(x, w, s, b, residual, next_w, None, 64, 4, rows_per_block=rows,
                                              threads=threads, **pre)
    return ext.quantized_matvec(x, w, s, b, None, 64, 4, rows_per_block=rows, threads=threads, warps=0,
                                activation=activation, **pre)


def main() -> None:
    for name, (n, k, groups, emit, activation, launches) in CASES.items():
        w, s, b = random_q4(n, k, 0)
        x = mx.random.normal((1, k))
        partials = mx.abs(mx.random.normal((1, 8 * max(groups, 1) * 16))) * k / 128  # ~unit rms
        residual = mx.random.normal((1, n))
        next_w = mx.ones((n,), dtype=mx.bfloat16)
        tensors = (w, s, b, x, partials, residual, next_w)
        mx.eval(*tensors)
        for rows, threads in launches:
            for _ in range(2):
                mx.eval(launch(n, k, groups, emit, activation, rows, threads, tensors))
            print(f"launched {name} {n}x{k} rows {rows} threads {threads}", flush=True)
        for x_dtype in (mx.float32, mx.bfloat16):
            xm = x.astype(x_dtype)
            for _ in range(2):
                mx.eval(mx.quantized_matmul(xm, w, s, b, transpose=True, group_size=64, bits=4))
        print(f"launched mlx {n}x{k}", flush=True)


if __name__ == "__main__":
    main()
