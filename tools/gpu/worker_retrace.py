"""What a fresh TTS worker thread costs: the compiled TTS step traced again on a new thread.

MLX 0.32's compile cache is thread-local, so a new worker thread per `generate` (as the
twenty-first session's code had) traces the compiled TTS step again at every threaded call. This
times the first steps of a warmed-up TTS on the main thread (twice: cold, then warm) and on two
fresh threads, each step waited for. The difference between a fresh thread's first steps and the
warm ones is what the worker a `VoiceChat` keeps for its life (`voicechat.tts_thread.WorkerThread`)
saves per call. (CPU, tiny checkpoint, twenty-first session: 39 / 41 ms against 7-9 ms warm; H200,
full size, twenty-second: 14.6 / 13.9 and 13.6 / 16.8 ms against 3.6-4.4 ms.)

    PYTHONPATH=/tmp/site2:/tmp/site python3 tools/gpu/worker_retrace.py [--size tiny|full] [--steps 4]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

import voicechat
from voicechat.testing import make_checkpoint, random_checkpoint


def _load(size: str, folder: Path):
    if size == "full":
        return voicechat.load(random_checkpoint(folder / "full", "full", quantize=4))
    return voicechat.load(make_checkpoint(folder / "tiny", "tiny"))


def _step_times(chat, steps: int) -> list[float]:
    """ms of each of the first `steps` TTS steps of a freshly warmed-up TTS, on this thread."""
    tts, c = chat.tts.tts_model, chat.config
    cache = tts.make_cache()
    previous = tts.warmup(chat.tts.audio_prompt_latents[c.speaker], chat.warmup_codes(), cache)
    key = mx.random.key(0)
    mx.eval(previous, key, cache.state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        previous, key = tts.step(previous, mx.array([5], dtype=mx.int32), cache, key,
                                 chat.tts.codec_silence_tokens)
        mx.eval(previous, key)
        times.append(round((time.perf_counter() - start) * 1e3, 2))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        chat = _load(args.size, Path(folder))
        print("main thread, first:", _step_times(chat, args.steps), "ms")
        print("main thread, again:", _step_times(chat, args.steps), "ms")
        for i in range(2):
            result = {}

            def on_a_fresh_thread():
                try:
                    result["times"] = _step_times(chat, args.steps)
                finally:
                    mx.clear_streams()  # MLX 0.32.4 can abort at exit over a finished thread's streams

            worker = threading.Thread(target=on_a_fresh_thread)
            worker.start()
            worker.join()
            print(f"fresh thread {i + 1}:", result.get("times"), "ms")


if __name__ == "__main__":
    main()
