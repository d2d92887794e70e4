"""Where a live frame's time goes: perception, the transcript, the model step and the codec.

    PYTHONPATH=python python benchmarks/profile_live.py [--size full] [--frames 60] [--json out.json]

A live session is fed the bundled question, then silence, in 80 ms chunks as fast as it takes
them. Each chunk's work is split into its stages, each waited for before the next starts (so the
stages do not overlap as they do in a session: their sum is a little more than a frame's time):

- `perceive`: log-mel, the streamed FastConformer and the projection of the chunk's frames;
- `transcript`: the RNNT loop over the chunk's encoder frames, read back;
- `step`: the LLM and TTS steps of the frame, evaluated (`FrameLoop`);
- `codec`: the streamed codec decode of the frame's codes, evaluated;
- `frame`: the whole `push`, unsplit, timed in a session of its own on the same input.

Printed per stage: p50, p95 and max in ms over `--frames` frames after `--warmup` (traces and
kernel compiles); `host`, the p50 of the time until its graph is built and queued
(`mx.async_eval` returns once the host has launched every kernel: what is left is the device's);
and the primitives the first measured frame's graph holds (`opcount`: each costs
a launch on a GPU). Perception runs its compiled chunk from the first frame (its attention
cache holds the left context's keys from the start).
Full size: random 4-bit weights in memory (a CUDA GPU). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np

import voicechat
from voicechat.audio import load_audio
from voicechat.llm.opcount import kernel_count, op_labels
from voicechat.synthetic import make_checkpoint, random_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from mlx_settings import mlx_env  # noqa: E402

CHUNK = 1280  # 80 ms at 16 kHz


def _input(frames: int) -> np.ndarray:
    speech = load_audio(str(resources.files("voicechat") / "data" / "question.wav"), 16000)
    total = (frames + 8) * CHUNK
    return np.concatenate([speech, np.zeros(max(0, total - speech.size), np.float32)])[:total]


def _timed(name: str, times: dict, ops: dict, fn, readback, warmup: int, queued=None):
    """`fn` wrapped: its lazy outputs evaluated (`readback`) and timed under `name`; the graph of
    the first measured call (after `warmup` calls) is counted. With `queued` (the lazy arrays of
    `fn`'s result), they are first queued with `mx.async_eval`, and the time until that returns
    (building the graph and launching its kernels, on the host) is kept as `name` + " host"."""

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if name not in ops and len(times[name]) >= warmup:
            counting = time.perf_counter()
            ops[name] = kernel_count(op_labels(out)) if readback is mx.eval else None
            start += time.perf_counter() - counting  # (counting is not the stage's time)
        if queued is not None:
            mx.async_eval(queued(out))
            times[name + " host"].append((time.perf_counter() - start) * 1e3)
        readback(out)
        times[name].append((time.perf_counter() - start) * 1e3)
        return out

    return wrapped


def split(chat, samples: np.ndarray, warmup: int) -> tuple[dict, dict]:
    times: dict = defaultdict(list)
    ops: dict = {}
    lazy = lambda out: [a for a in out if isinstance(a, mx.array)]  # noqa: E731
    with chat.live() as live:
        live.perception.push = _timed("perceive", times, ops, live.perception.push, mx.eval, warmup, queued=list)
        live.transcript.push = _timed("transcript", times, ops, live.transcript.push, np.array, warmup)
        live.loop.step = _timed("step", times, ops, live.loop.step, lambda out: mx.eval(lazy(out)), warmup,
                                queued=lazy)
        decoder = live.decoder
        decoder.queue = _timed("codec", times, ops, decoder.queue, mx.eval, warmup, queued=lambda framed: [framed])
        for pos in range(0, samples.size, CHUNK):
            live.push(samples[pos : pos + CHUNK])
        live.finish(0.0)
    return {k: v[warmup:] for k, v in times.items()}, ops


def whole(chat, samples: np.ndarray, warmup: int) -> list[float]:
    times = []
    with chat.live() as live:
        for pos in range(0, samples.size, CHUNK):
            start = time.perf_counter()
            frames = live.push(samples[pos : pos + CHUNK])
            if frames:
                times.append((time.perf_counter() - start) * 1e3)
        live.finish(0.0)
    return times[warmup:]


def _summary(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_ms": statistics.median(values),
            "p95_ms": values[min(len(values) - 1, int(0.95 * len(values)))], "max_ms": values[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--frames", type=int, default=60, help="frames measured (default 60)")
    p.add_argument("--warmup", type=int, default=20, help="frames first, not measured (default 20)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.size == "full":
            chat = voicechat.load(random_checkpoint(workdir / "full", "full", quantize=4))
        else:
            chat = voicechat.load(make_checkpoint(workdir / "tiny", "tiny"))
        samples = _input(args.frames + args.warmup)
        times, ops = split(chat, samples, args.warmup)
        rows = {name: {**_summary(times[name]), "host_p50_ms": _summary(times.get(name + " host", [])).get("p50_ms"),
                       "ops": ops.get(name)} for name in ("perceive", "transcript", "step", "codec")}
        rows["frame"] = {**_summary(whole(chat, samples, args.warmup)), "ops": None}
        chat.close()
    info = {"size": args.size, "device": str(mx.default_device()), "mlx_env": mlx_env(), "rows": rows}
    print(f"{'stage':<11} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'host ms':>8} {'ops':>6}")
    for name, row in rows.items():
        if row["n"]:
            host = row.get("host_p50_ms")
            print(f"{name:<11} {row['p50_ms']:8.2f} {row['p95_ms']:8.2f} {row['max_ms']:8.2f} "
                  f"{'' if host is None else f'{host:8.2f}':>8} {row['ops'] if row['ops'] is not None else '':>6}")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
