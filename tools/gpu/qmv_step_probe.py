"""The LLM step's four 4-bit GEMV instances as the step launches them (in_proj and up_proj with a
prenormed x, out_proj with the gated group norm's partials and an emitted next norm, down_proj with
an emitted next norm; float32 x), each at several launch shapes (the block layout's and the streamed
layout's), and MLX's product at the same
shapes: the program `tools/gpu/qmv_ncu.sh` runs under Nsight Compute with PROBE=step.

    PYTHONPATH=python python tools/gpu/qmv_step_probe.py [tiny]   (a check of the script on the CPU)
    QMV_CASES=out_proj,down_proj ...                             (some of the four)
    QMV_LAUNCHES="8,0,2,0;4,0,2,3" ...                           (these launches for every case)
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_gemv import random_q4  # noqa: E402

from voicechat.kernels import ext  # noqa: E402

# Launches: (rows, threads, stages, blocks_per_sm[, imma]); 0 = the default, stages -1 = the block
# layout, > 0 the streamed layout (vc_qmv_stream) with that many tiles in flight a block; imma 1: the
# integer tensor-core layout (vc_qmv_imma: threads and blocks_per_sm steer it).
BLOCK = ((0, 0, -1, 0), (4, 0, -1, 0))
# name: (N, K, prenorm groups (0: plain x), emit, activation, launches)
CASES = {
    "in_proj": (22656, 4480, 1, False, "", BLOCK + ((8, 0, 2, 0), (8, 0, 4, 0), (8, 0, 8, 0), (8, 0, 4, 1),
                                                    (4, 0, 4, 0))),
    "up_proj": (15680, 4480, 1, False, "relu_squared", BLOCK + ((8, 0, 2, 0), (8, 0, 4, 0), (8, 0, 8, 0))),
    "out_proj": (4480, 10240, 8, True, "", BLOCK + ((8, 0, 2, 0), (8, 0, 3, 0), (8, 0, 4, 0), (4, 0, 4, 0),
                                                     (4, 0, 8, 0), (8, 160, 2, 0))),
    "down_proj": (4480, 15680, 0, True, "", BLOCK + ((8, 0, 2, 0), (8, 512, 2, 0), (8, 512, 3, 0),
                                                      (8, 0, 3, 0))),
}
if os.environ.get("QMV_CASES"):  # a comma-separated subset, to keep a short call short
    CASES = {name: CASES[name] for name in os.environ["QMV_CASES"].split(",")}
if os.environ.get("QMV_LAUNCHES"):  # "rows,threads,stages,blocks_per_sm;..." for every case
    chosen = tuple(tuple(int(v) for v in item.split(",")) for item in os.environ["QMV_LAUNCHES"].split(";"))
    CASES = {name: case[:5] + (chosen,) for name, case in CASES.items()}
if len(sys.argv) > 1:
    CASES = {"tiny": (64, 1024, 8, True, "", ((0, 0, -1, 0), (4, 128, -1, 0)))}


def launch(n: int, k: int, groups: int, emit: bool, activation: str, launch_shape, tensors):
    rows, threads, stages, per_sm, imma = (*launch_shape, 0)[:5]
    w, s, b, x, partials, residual, next_w = tensors
    pre = dict(prenormed=partials, prenorm_groups=groups) if groups else {}
    shape = dict(rows_per_block=rows, threads=threads, stages=stages, blocks_per_sm=per_sm, imma=imma)
    if emit:
        return ext.quantized_matvec_emit_norm(x, w, s, b, residual, next_w, None, 64, 4, **shape, **pre)
    return ext.quantized_matvec(x, w, s, b, None, 64, 4, warps=0, activation=activation, **shape, **pre)


def main() -> None:
    for name, (n, k, groups, emit, activation, launches) in CASES.items():
        w, s, b = random_q4(n, k, 0)
        x = mx.random.normal((1, k))
        partials = mx.abs(mx.random.normal((1, 8 * max(groups, 1) * 16))) * k / 128  # ~unit rms
        residual = mx.random.normal((1, n))
        next_w = mx.ones((n,), dtype=mx.bfloat16)
        tensors = (w, s, b, x, partials, residual, next_w)
        mx.eval(*tensors)
        for shape in launches:
            for _ in range(2):
                mx.eval(launch(n, k, groups, emit, activation, shape, tensors))
            # stderr: ncu's CSV goes to stdout, and this line has commas
            print(f"launched {name} {n}x{k} (rows, threads, stages, blocks an SM) {shape}", file=sys.stderr)
        for x_dtype in (mx.float32, mx.bfloat16):
            xm = x.astype(x_dtype)
            for _ in range(2):
                mx.eval(mx.quantized_matmul(xm, w, s, b, transpose=True, group_size=64, bits=4))
        print(f"launched mlx {n}x{k}", file=sys.stderr)


if __name__ == "__main__":
    main()
