"""Codec benchmarks: decode of one code frame and of 10 s (in one pass and in the windows `decode`
uses by default, with each one's peak memory), encode of the 38-frame TTS warmup.

    PYTHONPATH=python python -m pytest benchmarks/bench_codec.py --benchmark-enable
    VOICECHAT_BENCH_SIZE=full ...   # random weights at the real shapes (no checkpoint file)

Tiny (default) loads a synthetic tiny checkpoint; full builds the codec from
VoiceChatConfig().codec_config with random float32 weights and random codebooks.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from voicechat.checkpoint import open_checkpoint
from voicechat.codec import AudioCodec
from voicechat.codec.codec import DECODE_CHUNK_FRAMES
from voicechat.config import VoiceChatConfig
from voicechat.synthetic import make_checkpoint

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")
FRAMES_10S = 125  # 10 s at 80 ms per code frame
WARMUP_FRAMES = 38  # (37 Aria frames + 1) * 1764 zero samples


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> AudioCodec:
    if SIZE == "full":
        cfg = VoiceChatConfig().codec_config
        model = AudioCodec(cfg)
        books = mx.random.normal((cfg.num_quantizers, cfg.codebook_size, cfg.latent_dim), key=mx.random.key(0))
        model.update({"prvq": {"mus_list": [books[q] for q in range(cfg.num_quantizers)]}})
    else:
        ckpt = open_checkpoint(make_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", "tiny"))
        model = AudioCodec(ckpt.config.codec_config)
        ckpt.load_into(model, "tts_model.audio_codec.")
    mx.eval(model.parameters())
    model.prvq.codebooks()
    return model


def _codes(codec: AudioCodec, frames: int) -> mx.array:
    cfg = codec.config
    rng = np.random.default_rng(frames)
    codes = mx.array(rng.integers(0, cfg.codebook_size, (1, cfg.num_quantizers, frames)).astype(np.int32))
    mx.eval(codes)
    return codes


def _run(benchmark, fn, *args):
    mx.eval(fn(*args))  # compile and warm up outside the timing
    benchmark(lambda: mx.eval(fn(*args)))


def test_decode_one_frame(benchmark, codec):
    _run(benchmark, codec.decode, _codes(codec, 1))


@pytest.mark.parametrize("chunk", [None, DECODE_CHUNK_FRAMES], ids=["whole", "windows"])
def test_decode_10s(benchmark, codec, chunk):
    codes = _codes(codec, FRAMES_10S)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    _run(benchmark, lambda c: codec.decode(c, chunk_frames=chunk), codes)
    benchmark.extra_info["peak_activation_gb"] = (mx.get_peak_memory() - base) / 1e9


def test_encode_warmup_38_frames(benchmark, codec):
    wave = mx.zeros((1, WARMUP_FRAMES * codec.samples_per_frame))
    _run(benchmark, codec.encode, wave)
