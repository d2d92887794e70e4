"""What a launch pays for reading a one-element array (an eps, a scale, a position), by where that
array came from: made on the host for each call, made on the host once and kept, computed on the
device, or not read at all (the value a template argument). Back to back, 64 launches an eval,
eagerly and inside mx.compile. Run on the lent H200 (see docs/developing.md).

    python3 tools/gpu/scalar_read_cost.py
"""

from __future__ import annotations

import time

import mlx.core as mx

SOURCE = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = x[i];
  if (READ) v += s[0];
  out[i] = v;
"""
kernel = mx.fast.cuda_kernel(name="vc_scalar_probe", input_names=["x", "s"], output_names=["out"], source=SOURCE)
x = mx.random.normal((2832 * 160,))
kept = mx.array([1e-5])
mx.eval(x, kept)
on_device = mx.zeros((1,)) + 1e-5
mx.eval(on_device)


def launch(a, s, read=True):
    return kernel(inputs=[a, s], template=[("READ", read)], grid=(a.size, 1, 1), threadgroup=(160, 1, 1),
                  output_shapes=[a.shape], output_dtypes=[mx.float32])[0]


CASES = {
    "no read (template arg)": lambda a: launch(a, kept, read=False),
    "host array made each call": lambda a: launch(a, mx.array([1e-5])),
    "host array made once, kept": lambda a: launch(a, kept),
    "array computed on the device": lambda a: launch(a, on_device),
}


def per_launch_us(fn, calls=64, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        a = x
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            a = fn(a)
        mx.eval(a)
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


for name, fn in CASES.items():
    compiled = mx.compile(lambda a, fn=fn: fn(fn(fn(fn(a)))))  # 4 launches a call
    per_launch_us(fn, 8, 1)
    per_launch_us(compiled, 2, 1)
    print(f"{name:32s} eager {per_launch_us(fn):7.1f} us   compiled {per_launch_us(compiled, 16) / 4:7.1f} us a launch",
          flush=True)
