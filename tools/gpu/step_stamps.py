"""On the lent H200: a waited decode step's device span, read from the GPU's own clock: the LLM's
(default) or the TTS frame's (`--step tts`: backbone and code generation).

Two one-block kernels bracket the compiled step in its graph: the first passes the step's input
through (the LLM's audio frame, which every kernel of its step waits for; the TTS's previous
codes, which all but its text path wait for) and stores %globaltimer; the second reads the
step's outputs and stores it again. Per round (each from an idle device, as profile_llm_step's
sync_step): the host's waited time, the device span between the stamps, and the rest, which is host
time before the first kernel ran or after the last one ended. %globaltimer counts the host's
wall clock in ns to a constant offset (0-3 ms on the H200s seen), which a lone stamp between the
host's times around its eval measures to ~+-50 us; with it taken off, the stamps go on the host's
timeline: when the first kernel ran after the step's graph was built and queued, and how long the
host's wait went on after the last one. Without Nsight Systems (not on the GPU image) this says
whether the waited step is device time, a late start or a late return.

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/step_stamps.py [--step tts] [--size tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_llm import CONTEXT, _audio, _primed  # noqa: E402
from profile_llm_step import _lm  # noqa: E402
from profile_tts_step import _tts  # noqa: E402

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


def llm_rounds(size: str):
    """(the step's input for round i, the step on its stamped input -> (its outputs, two to stamp after))."""
    lm = _lm(size)
    cache, text, function, _ = _primed(lm)
    frames = _audio(lm, CONTEXT + ROUNDS)[:, CONTEXT:]
    ids = [text, function]

    def step(frame):
        t, f = lm.decode(ids[0], frame, ids[1], cache)
        ids[:] = t[:, None], f[:, None]
        return [*ids, *cache.state], (t, f)

    return lambda i: frames[:, i : i + 1], step


def tts_rounds(size: str):
    tts, cache, previous = _tts(size, gemv=True)
    text, silence = mx.array([100], mx.int32), mx.zeros((tts.cfg.num_quantizers,), mx.int32)
    carried = [previous, mx.random.key(0)]

    def step(stamped_previous):
        carried[:] = tts.step(stamped_previous, text, cache, carried[1], silence)
        return [*carried, *cache.buffers], tuple(carried)

    return lambda i: carried[0], step


ROUNDS = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=("llm", "tts"), default="llm")
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    args = parser.parse_args()
    step_input, step = (llm_rounds if args.step == "llm" else tts_rounds)(args.size)
    offset = 0  # %globaltimer - the host's time_ns, ns
    if _PASS is not None:  # the clocks: a lone stamp lies between the host's times around its eval
        mids, halves = [], []
        for _ in range(20):
            mx.synchronize()
            h0 = time.time_ns()
            _, s = stamp_pass(step_input(0))
            mx.eval(s)
            h1 = time.time_ns()
            mids.append(s.item() - (h0 + h1) // 2)
            halves.append((h1 - h0) // 2)
        offset = int(statistics.median(mids))
        print(f"clock offset {offset / 1e3:.0f} us, +- {statistics.median(halves) / 1e3:.0f} us (a lone stamp's "
              "round trip, halved): the device times below have it taken off", flush=True)
    marks = {k: [] for k in ("built", "queued", "device start", "device end", "returned")}
    for i in range(ROUNDS):
        mx.synchronize()
        time.sleep(0.003)
        t0 = time.time_ns()
        x = step_input(i)
        if _PASS is not None:
            x, s0 = stamp_pass(x)
        outs, last = step(x)
        s1 = stamp_after(*last) if _AFTER is not None else None
        outs += [s0, s1] if s1 is not None else []
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
