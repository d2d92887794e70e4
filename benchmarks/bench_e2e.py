"""End to end: ms per 80 ms frame and real-time factor for 5 s, 30 s and 120 s inputs.

    PYTHONPATH=python python -m pytest benchmarks/bench_e2e.py --benchmark-enable         # tiny checkpoint
    VOICECHAT_BENCH_SIZE=full python -m pytest benchmarks/bench_e2e.py --benchmark-enable # real shapes (GPU)

Full size uses random weights in the published 4-bit layout, made in memory on the device
(`voicechat.synthetic.random_checkpoint`: no 9 GB file). The input is the bundled spoken question
followed by silence up to the length asked; `extra_decoding_seconds` is 0 so the timeline is
exactly the input. `extra_info` holds frames, ms per frame, real-time factor, host syncs, each
stage's share, the first (cold: kernel compilation included) run's time and peak memory.
"""

from __future__ import annotations

import os
import time
from importlib import resources

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from voicechat.audio import load_audio
from voicechat.session import default_tts_thread
from voicechat.synthetic import make_checkpoint, random_checkpoint

from mlx_settings import mlx_env

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    start = time.perf_counter()
    if SIZE == "full":
        chat = voicechat.load(random_checkpoint(tmp_path_factory.mktemp("full"), "full", quantize=4))
    else:
        chat = voicechat.load(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny"))
    chat.load_s = time.perf_counter() - start
    chat.weights_bytes = chat.checkpoint.nbytes
    return chat


def _input(seconds: float) -> np.ndarray:
    question = load_audio(str(resources.files("voicechat") / "data" / "question.wav"), 16000)
    n = int(seconds * 16000)
    out = np.zeros(n, np.float32)
    out[: min(n, len(question))] = question[:n]
    return out


# VOICECHAT_BENCH_SECONDS="5,30" picks lengths (a short GPU session)
SECONDS = [int(v) for v in os.environ.get("VOICECHAT_BENCH_SECONDS", "5,30,120").split(",")]


# The TTS steps built on the caller's thread or on a thread of their own (`VoiceChat.tts_thread`,
# on by default on a CUDA GPU); unset runs the default, "0,1" runs both.
TTS_THREAD = [bool(int(v)) for v in os.environ["VOICECHAT_BENCH_TTS_THREAD"].split(",")] \
    if os.environ.get("VOICECHAT_BENCH_TTS_THREAD") else [None]


@pytest.mark.parametrize("tts_thread", TTS_THREAD)
@pytest.mark.parametrize("seconds", SECONDS)
def test_generate(benchmark, chat, seconds, tts_thread):
    if tts_thread is None:
        tts_thread = default_tts_thread()
    chat.tts_thread = tts_thread
    audio = _input(seconds)
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = chat.generate(audio, sample_rate=16000, extra_decoding_seconds=0.0)
    cold_s = time.perf_counter() - start
    results, peaks = [], [mx.get_peak_memory()]

    def run():  # each run's own peak: a warm run can peak higher than the cold one
        mx.reset_peak_memory()
        results.append(chat.generate(audio, sample_rate=16000, extra_decoding_seconds=0.0))
        peaks.append(mx.get_peak_memory())

    benchmark.pedantic(run, rounds=1 if seconds >= 120 else 3, iterations=1, warmup_rounds=0)
    r = results[-1]
    # with --benchmark-disable (a smoke run) there are no stats: the last run's own time
    gen = benchmark.stats.stats.min if benchmark.stats else r.timings["generate_s"]
    frames = r.frames + r.prompt_frames
    stages = {k: v for k, v in r.timings.items() if k != "generate_s"}
    benchmark.extra_info.update({
        "size": SIZE, "seconds": seconds, "frames": frames, "tts_thread": tts_thread,
        "ms_per_frame": 1000 * gen / frames, "rtf": gen / (r.frames * 0.08),
        "timeline_ms_per_frame": 1000 * r.timings["timeline_s"] / frames,
        "host_syncs": r.host_syncs, "first_run_s": cold_s, "load_s": chat.load_s,
        # random weights rarely pick blank: the transcript emits up to max_symbols a frame
        "transcript_chars": len(r.user_transcript),
        "stage_share": {k: v / r.timings["generate_s"] for k, v in stages.items()},
        "stage_s": stages, "peak_memory_gb": max(peaks) / 1e9,
        "weights_gb": chat.weights_bytes / 1e9, "peak_over_weights": max(peaks) / chat.weights_bytes,
        "peak_gb_by_run": [p / 1e9 for p in peaks],
        # the first (cold) run's and the last run's peak after each stage: the stage that set it
        "peak_gb_after_stage": first.peak_memory_gb, "peak_gb_after_stage_last": r.peak_memory_gb,
        "mlx_env": mlx_env(),
    })
    assert first.text_tokens == r.text_tokens
