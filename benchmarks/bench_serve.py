"""K concurrent WebSocket clients against one `vc-serve`, each streaming a WAV at wall-clock pace.

    python benchmarks/bench_serve.py --size tiny        # serves a tiny checkpoint from this process
    python benchmarks/bench_serve.py --size full        # full size, random weights in memory (GPU)
    python benchmarks/bench_serve.py --url ws://127.0.0.1:8000/v1/realtime --clients 1 2 4

For K = 1, 2, 4, 8, 16 (`--clients`) it reports per-frame latency p50 / p95 / max (from the moment
the 80 ms chunk that completes a frame is sent to the moment that frame's audio arrives), the late
frames (latency over 80 ms: the answer falls behind real time), the time from the first chunk
to the first audio, and the p95 over each client's frames after its first 2 s (its session's
start and the others' frames that waited for it left out; `--seconds 20` streams the WAV looped to
20 s a client, so that there are such frames). A measurement: it asserts nothing.

The server it starts runs in a process of its own, so that the clients' threads do not share its
interpreter lock. Before each K is measured, K clients stream `--warm-seconds` of the input: the
server then has traced and compiled what K sessions at once take (perception batched across their
full encoder caches among it) before the measured run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np
import soundfile as sf

CHUNK = 1280  # 80 ms at 16 kHz
FRAME_SECONDS = 0.08
STARTING_FRAMES = 25  # a client's first 2 s: its session's start and the others' catching up on it


def stream_client(url: str, pcm: np.ndarray, seed: int, out: dict) -> None:
    """One client at wall-clock pace; fills `out` with send times and audio arrival times."""
    import base64

    from websockets.sync.client import connect

    sends, arrivals = [], []
    with connect(url, max_size=16 << 20, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {
            "seed": seed, "extra_decoding_seconds": 0.0,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                      "output": {"format": {"type": "audio/pcm", "rate": 22050}}}}}))

        def receive() -> None:
            for message in ws:
                event = json.loads(message)
                if event["type"] == "response.output_audio.delta":
                    arrivals.append(time.perf_counter())
                elif event["type"] == "error":
                    out["error"] = event["error"]["message"]
                    return
                elif event["type"] == "response.done":
                    return

        reader = threading.Thread(target=receive)
        reader.start()
        start = time.perf_counter()
        for i in range(0, len(pcm), CHUNK):
            time.sleep(max(0.0, start + (i + CHUNK) / 16000 - time.perf_counter()))  # the chunk has been spoken
            sends.append(time.perf_counter())
            piece = pcm[i : i + CHUNK].astype("<i2").tobytes()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        reader.join()
    out["sends"], out["arrivals"] = sends, arrivals


def run(url: str, pcm: np.ndarray, clients: int) -> dict:
    outs = [{} for _ in range(clients)]
    threads = [threading.Thread(target=stream_client, args=(url, pcm, i, outs[i])) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies, steady, first = [], [], []
    errors = [o["error"] for o in outs if "error" in o]
    for o in outs:
        if "sends" not in o:
            continue
        sends, arrivals = o["sends"], o["arrivals"]
        n = min(len(sends), len(arrivals))
        latencies += [arrivals[k] - sends[k] for k in range(n)]
        steady += [arrivals[k] - sends[k] for k in range(STARTING_FRAMES, n)]
        if arrivals:
            first.append(arrivals[0] - (sends[0] - FRAME_SECONDS))
    ms = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {"clients": clients, "frames": len(latencies), "p50_ms": float(np.percentile(ms, 50)),
            "p95_ms": float(np.percentile(ms, 95)), "max_ms": float(ms.max()),
            "late_frames": int((ms > FRAME_SECONDS * 1000).sum()),
            "steady_p95_ms": float(np.percentile(np.array(steady) * 1000, 95)) if steady else None,
            "first_audio_ms": float(np.median(first) * 1000) if first else None, "errors": errors}


def serve_in_process(size: str, workdir: str, max_sessions: int) -> str:
    """A real uvicorn server on a thread of this process, on a model made here (at full size, random
    weights in memory: no checkpoint file); returns its /v1/realtime URL."""
    import socket

    import uvicorn

    import voicechat
    from voicechat.serve.app import ServerSettings, create_app
    from voicechat.synthetic import make_checkpoint, random_checkpoint

    if size == "full":
        chat = voicechat.load(random_checkpoint(Path(workdir) / "full", "full", quantize=4))
    else:
        chat = voicechat.load(make_checkpoint(Path(workdir) / "tiny", "tiny"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(chat, ServerSettings(max_sessions=max_sessions)), host="127.0.0.1", port=port,
                            log_level="warning", ws_max_size=16 << 20)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"ws://127.0.0.1:{port}/v1/realtime"


def _serve_forever(size: str, workdir: str, max_sessions: int, urls) -> None:
    """The server process: `serve_in_process`, its URL sent back, then serving until terminated."""
    urls.put(serve_in_process(size, workdir, max_sessions))
    threading.Event().wait()


def serve_in_subprocess(size: str, workdir: str, max_sessions: int):
    """`serve_in_process` in a process of its own: `(url, process)`."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    urls = context.Queue()
    process = context.Process(target=_serve_forever, args=(size, workdir, max_sessions, urls), daemon=True)
    process.start()
    return urls.get(timeout=1800), process


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="an running server's /v1/realtime URL (default: start one)")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--audio", help="a 16 kHz mono WAV (default: the bundled question)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--warm-seconds", type=float, default=8.0,
                   help="input each of K warm-up clients streams before K is measured (default 8)")
    p.add_argument("--seconds", type=float, default=None,
                   help="input each measured client streams: the WAV looped to this length (default: the WAV once)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    audio = args.audio or str(resources.files("voicechat") / "data" / "question.wav")
    pcm, rate = sf.read(audio, dtype="int16")
    if rate != 16000 or pcm.ndim != 1:
        print("error: --audio must be a 16 kHz mono WAV", file=sys.stderr)
        return 2
    if args.seconds is not None and not 0 < args.seconds <= 3600:
        print("error: --seconds must be in (0, 3600]", file=sys.stderr)
        return 2
    warm = np.resize(pcm, int(args.warm_seconds * 16000) // CHUNK * CHUNK)
    if args.seconds is not None:
        pcm = np.resize(pcm, max(CHUNK, int(args.seconds * 16000) // CHUNK * CHUNK))
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        url, server = (args.url, None) if args.url else serve_in_subprocess(args.size, tmp, max(args.clients))
        try:
            rows = []
            for k in args.clients:
                run(url, warm, k)  # compiled graphs and kernels for k sessions at once
                rows.append(run(url, pcm, k))
        finally:
            if server is not None:
                server.terminate()
                server.join()
    print(f"{'clients':>7} {'frames':>7} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'late':>6} {'first audio ms':>15} "
          f"{'p95 after 2 s':>14}")
    for r in rows:
        print(f"{r['clients']:>7} {r['frames']:>7} {r['p50_ms']:>8.1f} {r['p95_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{r['late_frames']:>6} {r['first_audio_ms'] or float('nan'):>15.1f} "
              f"{r['steady_p95_ms'] or float('nan'):>14.1f}" +
              (f"  errors: {r['errors'][:1]}" if r["errors"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
