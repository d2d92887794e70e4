"""On the lent H200: can the frame loop's two halves be built on two host threads?

The timeline is host-bound: MLX spends ~15 us of host time a launch, so a frame's LLM step costs ~3
ms of host time and its TTS step ~4.4 ms against ~3.2 + ~2.5 ms of device time. MLX >= 0.31.2 gives
each thread its own default stream and command encoder, so the LLM decode chain could be built on
the main thread while a worker builds the TTS frames, fed each frame's text id (a device array)
through a queue. This times, per frame:

  one thread   both chains built on the main thread, as the session's loop does
  two threads  the LLM chain on the main thread, the TTS chain on a worker

in alternating rounds, and checks that the threaded rounds give the LLM the same ids and the TTS
codes in range. With MLX 0.32.4 a lazy array made on one thread's default stream cannot be evaluated
from another ("There is no Stream(cpu, 0) in current thread"), nor, on the CPU here, a compiled step
traced on another thread: so the TTS's carried arrays are evaluated where a round changes threads,
each thread compiles its own TTS step, and the LLM chain runs on a stream made with
`mx.new_thread_unsafe_stream`. Where the compiled TTS still fails in the worker, the probe says so and
times both arms with the TTS step uncompiled. A probe for the next step of issue 7;
nothing in the package changes. (Found after it: the compiled step failed in the worker because it
closed over lazy arrays made on the main thread, not because a compiled trace keeps its stream;
`voicechat.tts_thread` now does this in the package with one compiled step. Keep this probe as the
measurement of the twelfth session.)

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/thread_probe.py [--size tiny] [--frames 60]
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
import traceback

import mlx.core as mx

sys.path.insert(0, "benchmarks")
from bench_llm import CONTEXT, _audio, _fresh_cache, _primed  # noqa: E402
from profile_llm_step import _lm  # noqa: E402
from profile_tts_step import _tts  # noqa: E402


def _leaves(tree):
    for v in tree:
        if isinstance(v, (list, tuple)):
            yield from _leaves(v)
        elif isinstance(v, mx.array):
            yield v


def _module_arrays(obj, seen=None):
    """Every mx.array an object holds, through attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _module_arrays(v, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _module_arrays(v, seen)
    elif hasattr(obj, "__dict__") and not callable(obj) or hasattr(obj, "children"):
        for v in vars(obj).values():
            yield from _module_arrays(v, seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiled-only", action="store_true", help="no uncompiled rounds after a failure")
    args = parser.parse_args()
    n = args.frames
    lm = _lm(args.size)
    primed, text0, function0, _ = _primed(lm)
    frames = _audio(lm, CONTEXT + n)[:, CONTEXT:]
    state = {}
    # The LLM chain on a stream any thread may wait on: the worker's graphs take its in-flight text ids
    # (a thread's own default stream cannot be waited on from another thread).
    llm_stream = mx.new_thread_unsafe_stream(mx.default_device())

    def fresh_tts(compiled: bool):
        """A TTS at the start of its timeline (a failed threaded step leaves its cache unusable)."""
        tts, cache, previous = _tts(args.size, gemv=True)
        tts.compile, tts._step_fn = compiled, None
        mx.eval(tts.char_table(), list(_module_arrays(tts)))  # lazy ones would be this thread's
        silence = mx.zeros((tts.cfg.num_quantizers,), mx.int32)
        state.update(tts=tts, cache=cache, previous=previous, key=mx.random.key(0), silence=silence)
        mx.eval(silence, state["key"])

    def tts_frame(text_id):
        state["previous"], state["key"] = state["tts"].step(state["previous"], text_id, state["cache"], state["key"],
                                                            state["silence"])
        mx.async_eval(state["previous"], state["key"])
        return state["previous"]

    def llm_chain(on_id=None):
        (cache,), _ = _fresh_cache(primed)
        mx.eval(cache.state)  # made on this thread's stream: settled before the worker sees its graph
        t, f, ids = text0, function0, []
        for i in range(n):
            with mx.stream(llm_stream):
                ti, fi = lm.decode(t, frames[:, i : i + 1], f, cache)
            mx.async_eval(ti, fi)
            if on_id:
                on_id(ti)
            t, f = ti[:, None], fi[:, None]
            ids.append(ti)
        return ids

    def one_thread():
        use_step_fn("main")
        codes = []
        ids = llm_chain(lambda ti: codes.append(tts_frame(ti)))
        mx.eval(ids, codes)
        settle_tts()
        return ids, codes

    def settle_tts():
        """Every array the TTS carries from frame to frame, evaluated: a lazy array made on one
        thread's stream cannot be evaluated from another thread."""
        carried = [v for v in vars(state["cache"]).values() if isinstance(v, (mx.array, list, tuple))]
        mx.eval(state["previous"], state["key"], [a for a in _leaves(carried) if a is not None])

    # One worker for every threaded round, with the TTS step compiled on its own (a compiled step
    # keeps the thread-local stream it was traced on: the main thread's failed in the worker).
    jobs: queue.Queue = queue.Queue()
    step_fns = {}

    def use_step_fn(who: str):
        tts = state["tts"]
        if step_fns.get(who, (None, None))[0] is not tts:
            step_fns[who] = (tts, None)
        if step_fns[who][1] is None and tts.compile:
            # a function object of this thread's own: MLX keeps a compiled trace per function, and the
            # trace holds the streams of the thread that made it
            step_fns[who] = (tts, mx.compile(lambda *a: tts._step_graph(*a)))
        tts._step_fn = step_fns[who][1]
        tts.prepare()  # (uncompiled: the plain graph)

    def worker_loop():
        while (job := jobs.get()) is not None:
            handoff, codes, errors, done = job
            try:
                use_step_fn("worker")
                while (text_id := handoff.get()) is not None:
                    codes.append(tts_frame(text_id))
                settle_tts()
            except Exception as e:
                errors.append(f"{e!r}\n{traceback.format_exc(limit=-3)}")
                while handoff.get() is not None:  # drain, so the main thread finishes
                    pass
            done.set()

    worker = threading.Thread(target=worker_loop, daemon=True)
    worker.start()

    def two_threads():
        settle_tts()
        handoff: queue.Queue = queue.Queue()
        codes, errors, done = [], [], threading.Event()
        jobs.put((handoff, codes, errors, done))
        ids = llm_chain(handoff.put)
        handoff.put(None)
        mx.eval(ids)
        done.wait()
        use_step_fn("main")
        if errors:
            raise RuntimeError(errors[0])
        return ids, codes

    def timed(fn):
        mx.synchronize()
        start = time.perf_counter()
        out = fn()
        mx.synchronize()
        return (time.perf_counter() - start) * 1e3 / n, out

    def rounds(label: str, compiled: bool) -> bool:
        fresh_tts(compiled)
        one_thread()  # compiled and warm
        want = [int(i.item()) for i in one_thread()[0]]
        for r in range(args.rounds):
            ms, _ = timed(one_thread)
            print(f"{label} round {r}  one thread : {ms:6.2f} ms a frame", flush=True)
            try:
                ms, (ids, codes) = timed(two_threads)
            except Exception as e:
                print(f"{label} round {r}  two threads: failed: {e}", flush=True)
                return False
            same = [int(i.item()) for i in ids] == want
            in_range = all(int(c.min().item()) >= 0 for c in codes)
            print(f"{label} round {r}  two threads: {ms:6.2f} ms a frame (LLM ids as one thread: {same}, "
                  f"{len(codes)} code frames, codes >= 0: {in_range})", flush=True)
        ms, _ = timed(lambda: mx.eval(llm_chain()))
        print(f"{label} the LLM chain alone: {ms:6.2f} ms a frame", flush=True)
        ms, _ = timed(lambda: mx.eval([tts_frame(i) for i in want]))
        print(f"{label} the TTS chain alone: {ms:6.2f} ms a frame", flush=True)
        return True

    print(f"{args.size}: {n} frames a round", flush=True)
    if not rounds("compiled TTS", True) and not args.compiled_only:
        rounds("uncompiled TTS", False)
    jobs.put(None)


if __name__ == "__main__":
    main()
