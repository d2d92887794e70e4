"""On the lent H200: a waited LLM decode step's device span, read from the GPU's own clock.

Two one-block kernels bracket the compiled step in its graph: the first passes the audio frame
through (so every kernel of the step waits for it) and stores %globaltimer; the second reads the
step's ids and stores it again. Per round (each from an idle device, as profile_llm_step's
sync_step): the host's waited time, the device span between the stamps, and the rest, which is host
time before the first kernel ran or after the last one ended. %globaltimer counts the host's
wall clock in ns to a constant offset (0-3 ms on the H200s seen), which a lone stamp between the
host's times around its eval measures to ~+-50 us; with it taken off, the stamps go on the host's
timeline: when the first kernel ran after the step's graph was built and queued, and how long the
host's wait went on after the last one. Without Nsight Systems (not on the GPU image) this says
whether the waited step is device time, a late start or a late return.

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/step_stamps.py [tiny]
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_llm import CONTEXT, _audio, _primed  # noqa: E402
from profile_llm_step import _lm  # noqa: E402

_READ_CLOCK = 'unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));'
_PASS = mx.fast.cuda_kernel(
    name="vc_stamp_pass", input_names=["inp"], output_names=["out", "stamp"],
    source=_READ_CLOCK + """
    for (int i = threadIdx.x; i < N; i += blockDim.x) out[i] = inp[i];
    if (threadIdx.x == 0) stamp[0] = t;""") if mx.cuda.is_available() else None
_AFTER = mx.fast.cuda_kernel(
    name="vc_stamp_after", input_names=["a", "b"], output_names=["stamp"],
    source=_READ_CLOCK + "if (threadIdx.x == 0) stamp[0] = t + 0 * (a[0] + b[0]);") if mx.cuda.is_available() else None


def stamp_pass(x: mx.array) -> tuple[mx.array, mx.array]:
    return _PASS(inputs=[x], template=[("N", x.size)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[x.shape, (1,)], output_dtypes=[x.dtype, mx.uint64])


def stamp_after(a: mx.array, b: mx.array) -> mx.array:
    return _AFTER(inputs=[a, b], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                  output_dtypes=[mx.uint64])[0]


def main() -> None:
    lm = _lm("tiny" if len(sys.argv) > 1 else "full")
    cache, text, function, _ = _primed(lm)
    frames = _audio(lm, CONTEXT + 24)[:, CONTEXT:]
    offset = 0  # %globaltimer - the host's time_ns, ns
    if _PASS is not None:  # the clocks: a lone stamp lies between the host's times around its eval
        mids, halves = [], []
        for _ in range(20):
            mx.synchronize()
            h0 = time.time_ns()
            _, s = stamp_pass(frames[:, 0])
            mx.eval(s)
            h1 = time.time_ns()
            mids.append(s.item() - (h0 + h1) // 2)
            halves.append((h1 - h0) // 2)
        offset = int(statistics.median(mids))
        print(f"clock offset {offset / 1e3:.0f} us, +- {statistics.median(halves) / 1e3:.0f} us (a lone stamp's "
              "round trip, halved): the device times below have it taken off", flush=True)
    marks = {k: [] for k in ("built", "queued", "device start", "device end", "returned")}
    for i in range(24):
        mx.synchronize()
        time.sleep(0.003)
        t0 = time.time_ns()
        frame = frames[:, i : i + 1]
        if _PASS is not None:
            frame, s0 = stamp_pass(frame)
        text, function = lm.decode(text, frame, function, cache)
        text, function = text[:, None], function[:, None]
        s1 = stamp_after(text, function) if _AFTER is not None else None
        outs = [text, function, *cache.state, *([s0, s1] if s1 is not None else [])]
        t1 = time.time_ns()
        mx.async_eval(*outs)
        t2 = time.time_ns()
        mx.eval(*outs)
        t3 = time.time_ns()
        if i >= 4:  # compiled and warm
            g0, g1 = (s0.item() - offset, s1.item() - offset) if s1 is not None else (t0, t0)
            for k, v in zip(marks, (t1, t2, g0, g1, t3)):
                marks[k].append(1e-6 * (v - t0))
    print("ms from the step's start (min / median):", flush=True)
    for k, v in marks.items():
        print(f"{k:>13}: {min(v):6.2f} / {statistics.median(v):6.2f}", flush=True)
    span = [b - a for a, b in zip(marks["device start"], marks["device end"])]
    print(f"  device span: {min(span):6.2f} / {statistics.median(span):6.2f}", flush=True)


if __name__ == "__main__":
    main()
