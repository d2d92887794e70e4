"""Where an LLM decode step's time goes: building the graph in Python, queueing its kernels
(the host's share), waiting for the device, and the steady state of a pipelined chain of steps
(each fed the previous step's ids, `mx.async_eval`).

    PYTHONPATH=python python benchmarks/profile_llm_step.py [--size full] [--json out.json]

A measurement, not a test: prints one line per variant (min / median ms over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_settings import mlx_env

CONTEXT = 64
PAD = 12


def _lm(size: str):
    if size == "full":
        from bench_llm import _full_size_lm

        return _full_size_lm()
    import tempfile

    from voicechat.checkpoint import open_checkpoint
    from voicechat.llm.nemotron_h import DuplexLM
    from voicechat.synthetic import make_checkpoint

    path = make_checkpoint(tempfile.mkdtemp() + "/tiny-q4", "tiny", quantize=4, dtype="bfloat16")
    ckpt = open_checkpoint(path)
    lm = DuplexLM(ckpt.config.text_config, ckpt.config.function_channel_weight)
    ckpt.load_into(lm, "stt_model.", ignore=("perception.", "rnnt_decoder.", "rnnt_joint."))
    return lm.prepare()


def _stats(samples: list[float]) -> dict:
    return {"min_ms": 1e3 * min(samples), "median_ms": 1e3 * statistics.median(samples), "rounds": len(samples)}


def prime(lm, context: int, frames: int):
    """(audio [1, context + frames, hidden], the cache after a `context`-position prefix of pad ids,
    the prefix's text and function ids [1, 1] int32), all evaluated."""
    h = lm.llm.config.hidden_size
    audio = mx.random.normal((1, context + frames, h), key=mx.random.key(0))
    pad = mx.full((1, context), PAD, dtype=mx.int32)
    primed = lm.make_cache()
    first = lm.step(lm.fused_input(pad, audio[:, :context], pad), primed)
    mx.eval(audio, first.text_ids, first.function_ids, primed.state)
    return audio, primed, first.text_ids[:, None].astype(mx.int32), first.function_ids[:, None].astype(mx.int32)


def profile(lm, rounds: int = 20, chain: int = 40, compiled: bool = False, context: int = CONTEXT) -> dict:
    context = max(context, 1)  # the prefix call takes at least one position
    audio, primed, text, function = prime(lm, context, chain + 1)
    frame = audio[:, context : context + 1]

    def step(t, f, audio_frame, cache):
        if compiled:
            return lm.decode(t, audio_frame, f, cache)
        out = lm.step(lm.fused_input(t, audio_frame, f), cache)
        return out.text_ids.astype(mx.int32), out.function_ids.astype(mx.int32)

    # One step from an idle device: build the graph (Python), queue it (`async_eval` returns once
    # every kernel is encoded and launched: the host's share), then wait for the rest. The compiled
    # step queues its parts but the last while it builds them (`DuplexLM.decode`): its build time
    # includes their queueing, and the device is already running them.
    build, queue, wait, whole = [], [], [], []
    for _ in range(rounds + 2):
        cache = primed.copy()
        mx.eval(cache.state)  # the copy's launches (the K/V buffers') are not the step's
        mx.synchronize()
        t0 = time.perf_counter()
        ids = step(text, function, frame, cache)
        t1 = time.perf_counter()
        mx.async_eval(ids, cache.state)
        t2 = time.perf_counter()
        mx.eval(ids, cache.state)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        queue.append(t2 - t1)
        wait.append(t3 - t2)
        whole.append(t3 - t0)

    per_step, host = [], []
    for _ in range(3):
        cache = primed.copy()
        mx.eval(cache.state)
        t, f = text, function
        mx.eval(t, f)
        t0 = time.perf_counter()
        busy = 0.0
        for i in range(chain):
            h0 = time.perf_counter()
            t, f = step(t, f, audio[:, context + i : context + i + 1], cache)
            t, f = t[:, None], f[:, None]
            mx.async_eval(t, f, *cache.state)
            busy += time.perf_counter() - h0
        mx.eval(t, f)
        per_step.append((time.perf_counter() - t0) / chain)
        host.append(busy / chain)

    # pipelined_host: the host's time per step in the chain, building the graph and queueing it
    # (with any wait MLX makes when too much is queued): near pipelined_step, the host binds
    # unless that wait is large; `queue` from an idle device says which.
    return {"build": _stats(build[2:]), "queue": _stats(queue[2:]), "wait": _stats(wait[2:]),
            "sync_step": _stats(whole[2:]),
            "pipelined_step": _stats(per_step), "pipelined_host": _stats(host)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--json")
    parser.add_argument("--compiled-only", action="store_true", help="skip the eager step")
    parser.add_argument("--context", default=str(CONTEXT),
                        help="positions in the cache before the step; several, comma-separated, profile each")
    args = parser.parse_args()
    contexts = [int(v) for v in args.context.split(",")]
    lm = _lm(args.size)
    results = {"size": args.size, "context": contexts[0], "device": str(mx.default_device()), "mlx_env": mlx_env()}
    if not args.compiled_only:
        results["eager"] = profile(lm, context=contexts[0])
    results["compiled"] = profile(lm, compiled=True, context=contexts[0])
    for context in contexts[1:]:  # the compiled step only
        results[f"compiled@{context}"] = profile(lm, compiled=True, context=context)
    print("mlx env:", results["mlx_env"] or "defaults")
    for variant, parts in results.items():
        if variant.startswith(("eager", "compiled")):
            for part, s in parts.items():
                print(f"{variant:>9} {part:>15}: min {s['min_ms']:7.2f} ms  median {s['median_ms']:7.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
