"""Host time one launch costs under MLX-CUDA, by kind: a custom kernel (`mx.fast.cuda_kernel`) with
a short and a long header (our kernels carry headers of tens of KB), with 1 and 8 inputs, against a
native op that compile does not fuse (`mx.cumsum`), each as a chain of LAUNCHES launches, eager and
compiled (`mx.compile`, as the frame loop runs), and the 64 KB case with its header and body
`#include`d from files (what voicechat's kernels do: MLX-CUDA hashes a kernel's whole text at every
launch, an include line is all it sees). Prints, a case, build (graph made) / eval (queued and
waited) in us a launch, min over rounds; needs a CUDA GPU, MLX only (no voicechat build).

    python3 tools/gpu/launch_cost.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import mlx.core as mx

LAUNCHES = 200
ROUNDS = 15
N = 256


def custom(header_kb: int, inputs: int, included: bool = False):
    header = "".join(f"// padding line {i:06d} {'.' * 40}\n" for i in range(header_kb * 1024 // 64))
    names = [f"x{i}" for i in range(inputs)]
    source = "const int i = threadIdx.x + blockIdx.x * blockDim.x;\n" \
             f"if (i < {N}) out[i] = " + " + ".join(f"{n}[i]" for n in names) + " + 1.0f;\n"
    name = f"launch_cost_{header_kb}_{inputs}"
    if included:  # the texts in files, by absolute path: the body's include sits inside the kernel
        folder = tempfile.mkdtemp(prefix="launch_cost_")
        for part, text in (("header", header), ("body", source)):
            with open(os.path.join(folder, f"{part}.cuh"), "w") as f:
                f.write(text)
        header = f'#include "{folder}/header.cuh"\n'
        source = f'#include "{folder}/body.cuh"\n'
        name += "_included_" + os.path.basename(folder)[-8:]
    kernel = mx.fast.cuda_kernel(name=name, input_names=names, output_names=["out"], source=source, header=header)

    def launch(y, extra):
        return kernel(inputs=[y, *extra[: inputs - 1]], grid=(N, 1, 1), threadgroup=(N, 1, 1),
                      output_shapes=[(N,)], output_dtypes=[mx.float32])[0]

    return launch


def native(y, extra):
    return mx.cumsum(y)  # grows to inf over the chain: only the time counts


def chain(step, extra):
    def run(y):
        for _ in range(LAUNCHES):
            y = step(y, extra)
        return y

    return run


def timed(fn, x) -> tuple[float, float]:
    builds, evals = [], []
    for _ in range(ROUNDS):
        mx.synchronize()
        t0 = time.perf_counter()
        y = fn(x)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        evals.append(t2 - t1)
    return min(builds) * 1e6 / LAUNCHES, min(evals) * 1e6 / LAUNCHES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    x = mx.zeros((N,))
    extra = [mx.zeros((N,)) for _ in range(7)]
    mx.eval(x, *extra)
    cases = {"native cumsum": native}
    for kb in (1, 16, 64):
        for inputs in (1, 8):
            cases[f"custom {kb} KB header, {inputs} inputs"] = custom(kb, inputs)
    cases["custom 64 KB header included, 8 inputs"] = custom(64, 8, included=True)
    results = {}
    for name, step in cases.items():
        for mode in ("eager", "compiled"):
            fn = chain(step, extra)
            fn = mx.compile(fn) if mode == "compiled" else fn
            first = fn(x)
            mx.eval(first)  # the trace and the kernel compile
            if name.startswith("custom"):  # each launch adds the inputs' sum and 1: the kernel really ran
                assert mx.all(first == LAUNCHES).item(), name
            build, run = timed(fn, x)
            results[f"{name}, {mode}"] = {"build_us": build, "eval_us": run}
            print(f"{name:>32} {mode:>8}: build {build:6.2f} us  eval {run:6.2f} us a launch", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
