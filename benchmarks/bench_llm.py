"""Nemotron-H duplex LM: one decode step (fused input, all layers, both heads' argmax, cache update),
eager and compiled (`DuplexLM.decode`), and a 64-position prefix.

    PYTHONPATH=python pytest benchmarks/bench_llm.py --benchmark-enable            # tiny, 4-bit checkpoint
    VOICECHAT_BENCH_SIZE=full pytest benchmarks/bench_llm.py --benchmark-enable    # published shapes, 4-bit (GPU)

Full size builds DuplexLM from the default config with random weights and `nn.quantize`s it
(group 64, 4 bits: embed_tokens, both 131072-wide heads and every mixer projection), no checkpoint
file. `extra_info` records the primitives per step (`ops_total`, `ops_kernels`; see
voicechat.llm.opcount).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import pytest

from voicechat.checkpoint import open_checkpoint
from voicechat.config import VoiceChatConfig
from voicechat.llm.nemotron_h import DuplexLM, count_step_ops
from voicechat.llm.opcount import count_ops, kernel_count
from voicechat.synthetic import make_checkpoint

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")
CONTEXT = 64  # positions already in the cache when a step is timed
PAD = 12


def _full_size_lm() -> DuplexLM:
    cfg = VoiceChatConfig()
    lm = DuplexLM(cfg.text_config, cfg.function_channel_weight)
    lm.set_dtype(mx.bfloat16)  # dense parts bf16 and scales bf16, as in the published files
    for layer in lm.llm.layers:
        if layer.kind == "mamba":
            layer.mixer.A_log = layer.mixer.A_log.astype(mx.float32)  # stored float32, as published
    nn.quantize(lm, group_size=64, bits=4)
    # Materialize one module at a time so the float weights never all exist at once.
    mx.eval(lm.embed_tokens.parameters())
    for layer in lm.llm.layers:
        mx.eval(layer.parameters())
    return lm.prepare()


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> DuplexLM:
    if SIZE == "full":
        return _full_size_lm()
    path = make_checkpoint(tmp_path_factory.mktemp("bench-llm") / "tiny-q4", "tiny", quantize=4, dtype="bfloat16")
    ckpt = open_checkpoint(path)
    model = DuplexLM(ckpt.config.text_config, ckpt.config.function_channel_weight)
    ckpt.load_into(model, "stt_model.", ignore=("perception.", "rnnt_decoder.", "rnnt_joint."))
    return model.prepare()


def _audio(lm: DuplexLM, length: int) -> mx.array:
    a = mx.random.normal((1, length, lm.llm.config.hidden_size), key=mx.random.key(0))
    mx.eval(a)
    return a


def _primed(lm: DuplexLM):
    """A cache holding CONTEXT positions, the ids they ended with ([1, 1] int32 each) and the next
    audio frame: every timed round steps from there."""
    audio = _audio(lm, CONTEXT + 1)
    pad = mx.full((1, CONTEXT), PAD, dtype=mx.int32)
    primed = lm.make_cache()
    out = lm.step(lm.fused_input(pad, audio[:, :CONTEXT], pad), primed)
    mx.eval(out, primed.state)
    text, function = out.text_ids[:, None].astype(mx.int32), out.function_ids[:, None].astype(mx.int32)
    return primed, text, function, audio[:, CONTEXT:]


def _fresh_cache(primed):
    """A copy of the primed cache, evaluated: every round steps from the same CONTEXT positions, and
    the copy's own launches (the K/V buffers') stay out of the timed step."""
    cache = primed.copy()
    mx.eval(cache.state)
    return (cache,), {}


ROUNDS = 30  # timed rounds of a waited step, after 3 warm-up rounds (as bench_reference_mlx_lm's)


def test_llm_step(benchmark, lm):
    primed, text, function, frame = _primed(lm)

    def step(cache):
        res = lm.step(lm.fused_input(text, frame, function), cache)
        mx.eval(res.text_ids, res.function_ids, cache.state)
        return res

    res = benchmark.pedantic(step, setup=lambda: _fresh_cache(primed), rounds=ROUNDS, warmup_rounds=3)
    assert res.text_ids.shape == (1,)
    counts = count_step_ops(lm, 1, _fresh_cache(primed)[0][0])
    benchmark.extra_info.update(size=SIZE, context=CONTEXT, ops_total=sum(counts.values()),
                                ops_kernels=kernel_count(counts), ops=dict(counts))


def test_llm_decode_step(benchmark, lm):
    """The same step as one compiled graph (`DuplexLM.decode`, what the session runs)."""
    primed, text, function, frame = _primed(lm)

    def step(cache):
        ids = lm.decode(text, frame, function, cache)
        mx.eval(ids, cache.state)
        return ids

    ids = benchmark.pedantic(step, setup=lambda: _fresh_cache(primed), rounds=ROUNDS, warmup_rounds=3)
    assert ids[0].shape == (1,)
    (cache,), _ = _fresh_cache(primed)
    counts = count_ops(*lm.decode(text, frame, function, cache, queue=False), cache.state)
    benchmark.extra_info.update(size=SIZE, context=CONTEXT, ops_total=sum(counts.values()),
                                ops_kernels=kernel_count(counts), ops=dict(counts))


CHAIN = 40  # steps per pipelined chain


def test_llm_decode_pipelined(benchmark, lm):
    """CHAIN compiled steps as the session runs them: each fed the previous step's ids and queued
    with `mx.async_eval`, one wait at the end. The benchmark's time is the chain's; ms a step is
    in `extra_info` (bench_reference_mlx_lm's pipelined test is its like)."""
    primed, text, function, frame = _primed(lm)
    audio = _audio(lm, CONTEXT + CHAIN)[:, CONTEXT:]

    def chain(cache):
        t, f = text, function
        for i in range(CHAIN):
            t, f = lm.decode(t, audio[:, i : i + 1], f, cache)
            t, f = t[:, None], f[:, None]
            mx.async_eval(t, f, *cache.state)
        mx.eval(t, f)
        return t

    mx.eval(audio)
    assert benchmark.pedantic(chain, setup=lambda: _fresh_cache(primed), rounds=5, warmup_rounds=1).shape == (1, 1)
    if benchmark.stats:  # none with --benchmark-disable
        benchmark.extra_info.update(size=SIZE, context=CONTEXT, chain=CHAIN,
                                    ms_per_step=1e3 * benchmark.stats.stats.min / CHAIN)


def test_llm_prefix64(benchmark, lm):
    audio = _audio(lm, 64)
    pad = mx.full((1, 64), PAD, dtype=mx.int32)

    def prefix():
        cache = lm.make_cache()
        res = lm.step(lm.fused_input(pad, audio, pad), cache)
        mx.eval(res.text_ids, res.function_ids, cache.state)
        return res

    res = benchmark(prefix)
    assert res.hidden.shape[:2] == (1, 64)
    benchmark.extra_info.update(size=SIZE, positions=64)
