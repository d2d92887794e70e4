"""Live session: latency a frame at wall-clock speed, and what a long session holds.

    PYTHONPATH=python python benchmarks/bench_live.py --size tiny                 # CPU, paced 80 ms chunks
    PYTHONPATH=python python benchmarks/bench_live.py --size tiny --fast          # as fast as possible
    PYTHONPATH=python python benchmarks/bench_live.py --size tiny --minutes 1,10  # memory over a long session
    PYTHONPATH=python python benchmarks/bench_live.py --size tiny --minutes 1,10 --paced  # ... live, its latency
    PYTHONPATH=python python benchmarks/bench_live.py --size full                 # GPU, random weights in memory

Latency (default): the bundled spoken question, then `--silence` seconds to answer in, pushed in
80 ms chunks at wall-clock speed (`--fast`: as fast as the session takes them). A warm-up live
session on the same input, unpaced, runs before the measured one and is dropped (not with
`--cold`): it meets every shape the measured one does, so that a process has built or loaded their
kernels and traced its compiled graphs before. Reported:
per-frame latency from the arrival of the chunk that completed a frame to `push` returning it
(p50, p95, max), the frames returned more than one chunk (80 ms) after their chunk arrived, and the
time from the end of the user's speech to the first non-silent answer audio.

Memory (`--minutes`): a conversation of the question and 3 s pauses, looped, pushed as fast as
possible (the tiny checkpoint's context, 4096 positions or 5.5 minutes, is raised to hold the
longest mark; nothing else about it changes); at each mark, the wall time so far, MLX's active and peak memory, the process's peak
RSS, and the bytes the session holds by part (`LiveSession.held_bytes`). With `--paced` the same
conversation is pushed at wall-clock speed, after a warm-up session on its first 8 s (not with
`--cold`), and the latency of the whole session is reported at the end (p50, p95, p99, max, late
frames): a long live session. A benchmark measures; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np

import voicechat
from voicechat.audio import load_audio
from voicechat.pacing import LatencyLog, feed, speech_end
from voicechat.synthetic import make_checkpoint, random_checkpoint, tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from mlx_settings import mlx_env  # noqa: E402


def question() -> np.ndarray:
    return load_audio(str(resources.files("voicechat") / "data" / "question.wav"), 16000)


def load(size: str, workdir: Path, context: int | None = None):
    """The checkpoint; `context`: at least this many positions (tiny only; full has 131072)."""
    if size == "full":
        return voicechat.load(random_checkpoint(workdir / "full", "full", quantize=4))
    config = tiny_config()
    if context is not None:
        config.text_config.max_position_embeddings = max(context, config.text_config.max_position_embeddings)
    return voicechat.load(make_checkpoint(workdir / "tiny", "tiny", config=config))


def latency(chat, silence_s: float, realtime: bool, cold: bool) -> dict:
    speech = question()
    samples = np.concatenate([speech, np.zeros(int(silence_s * 16000), np.float32)])
    if not cold:  # the warm-up runs the same input, unpaced: every shape the measured session meets
        # has its kernels built and loaded, its compiled graphs traced, before it
        with chat.live() as live:
            feed(live, samples, realtime=False)
    with chat.live() as live:
        log = feed(live, samples, realtime=realtime)
        result = live.result()
    summary = log.summary(speech_end(speech))
    return {"mode": "realtime" if realtime else "fast", "input_s": len(samples) / 16000, **summary,
            "frames_total": result.frames}


def memory(chat, minutes: list[float], keep_audio: bool, paced: bool = False, cold: bool = False) -> list[dict]:
    turn = np.concatenate([question(), np.zeros(3 * 16000, np.float32)])
    chunk = 1280
    marks, rows = sorted(minutes), []
    if paced and not cold:  # the session's shapes, met before the measured one
        with chat.live() as live:
            feed(live, np.tile(turn, 2)[: 8 * 16000], realtime=False)
    log = LatencyLog(chunk / 16000, realtime=paced)
    start = log.start = time.perf_counter()
    mx.reset_peak_memory()
    with chat.live(keep_audio=keep_audio) as live:
        fed, pos = 0, 0
        for mark in marks:
            while fed < mark * 60 * 16000:
                piece = turn[pos : pos + chunk]
                fed += piece.size
                pos = (pos + chunk) % len(turn)
                if not paced:
                    live.push(piece)
                    continue
                time.sleep(max(0.0, start + fed / 16000 - time.perf_counter()))
                arrived = time.perf_counter()
                frames = live.push(piece)
                log.add(frames, arrived, time.perf_counter())
            held = live.held_bytes()
            rows.append({"minutes": mark, "frames": live.frames, "wall_s": time.perf_counter() - start,
                         "mlx_active_mb": mx.get_active_memory() / 1e6, "mlx_peak_mb": mx.get_peak_memory() / 1e6,
                         "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                         **{f"{k}_mb": v / 1e6 for k, v in held.items()}})
            print(json.dumps(rows[-1]), flush=True)
        live.finish(0.0)
    if paced:
        print(json.dumps({"mode": "realtime", "input_s": fed / 16000, **log.summary()}), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--fast", action="store_true", help="push as fast as the session takes the chunks")
    p.add_argument("--cold", action="store_true", help="measure the first live session (compilation included)")
    p.add_argument("--silence", type=float, default=4.0, help="seconds of silence after the question (default 4)")
    p.add_argument("--minutes", default=None, help="memory run: report at these minutes of input, e.g. 1,10,60")
    p.add_argument("--no-keep-audio", action="store_true", help="memory run without keeping the answer's audio")
    p.add_argument("--paced", action="store_true", help="memory run at wall-clock speed, its latency reported")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        start = time.perf_counter()
        marks = [float(m) for m in args.minutes.split(",")] if args.minutes else []
        context = int(max(marks) * 60 / 0.08) + 64 if marks else None
        chat = load(args.size, Path(tmp), context)
        info = {"size": args.size, "device": str(mx.default_device()),
                "context": chat.config.text_config.max_position_embeddings, "load_s": time.perf_counter() - start,
                "mlx_env": mlx_env()}
        print(json.dumps(info), flush=True)
        if args.minutes:
            memory(chat, marks, keep_audio=not args.no_keep_audio, paced=args.paced, cold=args.cold)
        else:
            print(json.dumps(latency(chat, args.silence, realtime=not args.fast, cold=args.cold)), flush=True)
        chat.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
