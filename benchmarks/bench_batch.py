"""Many live sessions on one model: the batched frame's cost for B sessions stepped together.

    PYTHONPATH=python python benchmarks/bench_batch.py --size tiny --batches 1,2,4,8,16   # CPU
    PYTHONPATH=python python benchmarks/bench_batch.py --size full --json batch.json      # GPU, B up to 64

For each B, an `Engine` holds B sessions, each fed the bundled spoken question (then silence),
looped, from its own starting point. A round feeds every session one 80 ms piece
(`Engine.feed_many`: their perception as one batch, then their transcripts as one loop) and runs one
engine tick (the LLM steps of all B sessions as one batch, in groups of 4, then their TTS steps as
one batch, their codec frames as one batch, then each session's text). `--warmup` rounds trace
the compiled steps for the bucket; `--rounds` rounds are measured. Reported per B:

- `round_ms` p50 / p95: one round, feeds and tick: the wall time of one 80 ms frame for all B
  sessions (real time needs it under 80 ms);
- `tick_ms` p50 and `model_ms` p50: the tick, and its batched model step alone (read back);
- `latency_ms` p50 / p95: per session and round, from the moment its piece was fed to its frame
  being made;
- `memory_per_session_mb`: MLX's active memory with B sessions open and stepped, less the memory
  before any was opened, over B; `peak_per_session_mb` the same from the peak;
- `realtime`: `round_ms` p95 plus `--headroom-ms` (default 20) under 80 ms.

The largest real-time B is printed last (`--json PATH` writes everything). A benchmark measures;
it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np

import voicechat
from voicechat.audio import load_audio
from voicechat.engine import Engine
from voicechat.synthetic import make_checkpoint, random_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from mlx_settings import mlx_env  # noqa: E402

FRAME_MS = 80.0
PIECE = 1280  # 80 ms at 16 kHz


def conversation() -> np.ndarray:
    """The bundled question and 3 s to answer in, as one loop of input."""
    speech = load_audio(str(resources.files("voicechat") / "data" / "question.wav"), 16000)
    return np.concatenate([speech, np.zeros(3 * 16000, np.float32)])


def load(size: str, workdir: Path):
    if size == "full":
        return voicechat.load(random_checkpoint(workdir / "full", "full", quantize=4))
    return voicechat.load(make_checkpoint(workdir / "tiny", "tiny"))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def measure(chat, batch: int, rounds: int, warmup: int, headroom_ms: float) -> dict:
    loop = conversation()
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    round_ms, tick_ms, model_ms, latency_ms = [], [], [], []
    with Engine(chat, max_sessions=batch) as engine:
        sessions = [engine.live(seed=i) for i in range(batch)]
        offsets = [(i * 7 * PIECE) % len(loop) for i in range(batch)]  # sessions at different points
        for r in range(warmup + rounds):
            start = time.perf_counter()
            pieces = [(s, loop[(offset + r * PIECE) % (len(loop) - PIECE):][:PIECE], 16000)
                      for s, offset in zip(sessions, offsets)]
            fed = dict.fromkeys(sessions, time.perf_counter())
            engine.feed_many(pieces)
            engine.step()
            end = time.perf_counter()
            for s in sessions:
                s.collect()
            if r < warmup:
                continue
            tick = engine.last_tick
            round_ms.append(1e3 * (end - start))
            tick_ms.append(1e3 * (end - tick.started))
            model_ms.append(1e3 * (tick.stepped - tick.started))
            latency_ms += [1e3 * (done - fed[s]) for s, done in tick.delivered.items()]
        active = mx.get_active_memory()
        peak = mx.get_peak_memory()
        slots = engine.slots
    p95 = percentile(round_ms, 95)
    return {
        "batch": batch, "slots": slots, "rounds": rounds,
        "round_ms_p50": percentile(round_ms, 50), "round_ms_p95": p95,
        "tick_ms_p50": percentile(tick_ms, 50), "model_ms_p50": percentile(model_ms, 50),
        "latency_ms_p50": percentile(latency_ms, 50), "latency_ms_p95": percentile(latency_ms, 95),
        "memory_per_session_mb": (active - before) / batch / 2**20,
        "peak_per_session_mb": (peak - before) / batch / 2**20,
        "realtime": bool(p95 + headroom_ms < FRAME_MS),
    }


def table(rows: list[dict]) -> str:
    head = ("B", "round p50", "round p95", "tick p50", "model p50", "latency p50", "latency p95",
            "MB/session", "peak MB/session", "real time")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["batch"]), *(f"{r[k]:.1f}" for k in ("round_ms_p50", "round_ms_p95", "tick_ms_p50", "model_ms_p50",
                                                       "latency_ms_p50", "latency_ms_p95")),
            f"{r['memory_per_session_mb']:.2f}", f"{r['peak_per_session_mb']:.2f}", "yes" if r["realtime"] else "no",
        ]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--batches", default=None, help="session counts, e.g. 1,2,4,8 (default: 1..64 in powers of two "
                                                   "at full size, 1..16 tiny)")
    p.add_argument("--rounds", type=int, default=40, help="measured rounds per B (default 40)")
    p.add_argument("--warmup", type=int, default=16, help="rounds first, not measured (default 16)")
    p.add_argument("--headroom-ms", type=float, default=20.0, help="real time: round p95 + this < 80 ms (default 20)")
    p.add_argument("--json", default=None, help="write the settings and rows here")
    args = p.parse_args(argv)
    default = "1,2,4,8,16,32,64" if args.size == "full" else "1,2,4,8,16"
    batches = [int(b) for b in (args.batches or default).split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        start = time.perf_counter()
        chat = load(args.size, Path(tmp))
        info = {"size": args.size, "device": str(mx.default_device()), "load_s": time.perf_counter() - start,
                "rounds": args.rounds, "warmup": args.warmup, "headroom_ms": args.headroom_ms, "mlx_env": mlx_env()}
        print(json.dumps(info), flush=True)
        rows = []
        for batch in batches:
            rows.append(measure(chat, batch, args.rounds, args.warmup, args.headroom_ms))
            print(json.dumps(rows[-1]), flush=True)
        chat.close()
    print(table(rows))
    fits = [r["batch"] for r in rows if r["realtime"]]
    print(f"largest real-time B: {max(fits) if fits else 'none'} (round p95 + {args.headroom_ms:g} ms < 80 ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
