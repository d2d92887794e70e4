"""EAR-TTS per-frame cost: backbone step (batch 2), the 8-iteration code generation, a whole step.

    PYTHONPATH=python python -m pytest benchmarks/bench_tts.py --benchmark-enable
    VOICECHAT_BENCH_SIZE=full ...   # real shapes, random bf16 weights, no checkpoint file (GPU)
"""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from voicechat.checkpoint import open_checkpoint
from voicechat.config import VoiceChatConfig
from voicechat.kernels.gemv import on_cuda_gpu, use_gemv
from voicechat.synthetic import build_tokenizer, make_checkpoint
from voicechat.tokenizer import TextTokenizer
from voicechat.tts.ear_tts import EarTTS

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")
PROMPT_FRAMES = 37


def _random_weights(tts: EarTTS, dtype) -> None:
    """Random floats at every float parameter (the int flag buffers stay as they are)."""
    params = tree_flatten(tts.parameters())
    keys = mx.random.split(mx.random.key(0), len(params))
    new = []
    for (name, value), key in zip(params, keys):
        if mx.issubdtype(value.dtype, mx.floating):
            std = 1.0 if name.endswith(("rvq_embs", "_emb", "emb.weight", "embed_tokens.weight")) else 0.02
            value = (mx.random.normal(value.shape, key=key) * std).astype(dtype)
        new.append((name, value))
    tts.update(tree_unflatten(new))
    mx.eval(tts.parameters())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(tts, aria latent, silence codes) at the chosen size, with all load-time work done."""
    if SIZE == "full":
        cfg = VoiceChatConfig()
        # The vocabulary only sizes the conditioning table (one row gather per step); encoding
        # all 131072 subwords is load-time work that would spend this benchmark's minutes.
        vocab = 2048
        tts = EarTTS(cfg.tts_config, vocab)
        _random_weights(tts, mx.bfloat16)
        path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
        build_tokenizer(vocab).save(str(path))
        tts.set_tokenizer(TextTokenizer(path))
        h, q = cfg.tts_config.hidden_size, cfg.tts_config.num_quantizers
        aria = mx.random.normal((1, PROMPT_FRAMES, h)).astype(mx.bfloat16)
        silence = mx.zeros((q,), mx.int32)
    else:
        directory = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")
        ckpt = open_checkpoint(directory)
        cfg = ckpt.config
        tts = EarTTS(cfg.tts_config, cfg.text_config.vocab_size)
        ckpt.load_into(tts, "tts_model.tts_model.")
        tts.set_tokenizer(TextTokenizer(directory / "tokenizer.json"))
        aria = ckpt.tensors["tts_model.audio_prompt_latents.Aria"]
        silence = ckpt.tensors["tts_model.codec_silence_tokens"]
    if on_cuda_gpu():  # as voicechat.load does
        use_gemv(tts)
    tts.prepare()
    return tts, aria, silence


def _warm_session(tts, aria):
    cfg = tts.cfg
    cache = tts.make_cache()
    prompt = mx.zeros((1, PROMPT_FRAMES, cfg.num_quantizers), mx.int32)
    previous = tts.warmup(aria, prompt, cache)
    mx.eval(previous, cache.buffers)
    return cache, previous


def test_tts_backbone_step(benchmark, model):
    """28 (tiny: 7) Gemma-3 blocks, one frame, batch 2 (CFG), K/V caches, compiled."""
    tts, aria, _ = model
    cache, _ = _warm_session(tts, aria)
    step_fn = mx.compile(tts.backbone.step_arrays)
    x = mx.random.normal((2, 1, tts.cfg.hidden_size))
    mx.eval(x)

    def run():
        h = tts.backbone.step(x, cache, step_fn)
        mx.eval(h, cache.buffers, cache.pending)

    benchmark.pedantic(run, warmup_rounds=3, rounds=50, iterations=1)


def test_tts_generate_codes(benchmark, model):
    """The 8-iteration unmasking (5 MoG calls + RVQ over 31 codebooks), compiled."""
    tts, _, _ = model
    hidden = mx.random.normal((2, 1, tts.cfg.hidden_size))
    generate = mx.compile(tts.generate_codes)
    state = {"key": mx.random.key(0)}

    def run():
        codes, state["key"] = generate(hidden, state["key"])
        mx.eval(codes, state["key"])

    benchmark.pedantic(run, warmup_rounds=3, rounds=50, iterations=1)


def test_tts_step(benchmark, model):
    """A whole frame: EOS check, char-table row, fusion, backbone, code generation."""
    tts, aria, silence = model
    cache, previous = _warm_session(tts, aria)
    state = {"previous": previous, "key": mx.random.key(0), "t": 0}
    text_ids = [100, 200, 12, 12, 2, 300, 11, 50]

    def run():
        text_id = text_ids[state["t"] % len(text_ids)]
        state["previous"], state["key"] = tts.step(state["previous"], text_id, cache, state["key"], silence)
        mx.eval(state["previous"], state["key"])
        state["t"] += 1

    benchmark.pedantic(run, warmup_rounds=3, rounds=50, iterations=1)
