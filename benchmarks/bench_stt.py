"""Speech in: log-mel, the FastConformer perception, the RNNT transcript, and each C++ kernel
against its pure-MLX reference.

    PYTHONPATH=python pytest benchmarks/bench_stt.py --benchmark-enable            # tiny checkpoint
    VOICECHAT_BENCH_SIZE=full pytest benchmarks/bench_stt.py --benchmark-enable    # published shapes (GPU)

Full size builds Perception, RNNTDecoder and RNNTJoint from the default config with random bf16
weights (the stored frontend buffers stay float32), no checkpoint file. Random RNNT weights emit at
every query; the joint's blank bias is raised so that about one frame in three emits, closer to
speech (`extra_info["tokens"]`).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from voicechat.checkpoint import open_checkpoint
from voicechat.config import VoiceChatConfig
from voicechat.kernels.rel_pos_attention import position_window, rel_pos_attention, rel_pos_attention_reference
from voicechat.kernels.rnnt_greedy import rnnt_greedy, rnnt_greedy_reference
from voicechat.listening.conformer import Perception
from voicechat.listening.mel import log_mel
from voicechat.listening.rnnt import RNNTDecoder, RNNTJoint, greedy_decode, loop_weights
from voicechat.synthetic import make_checkpoint

SIZE = os.environ.get("VOICECHAT_BENCH_SIZE", "tiny")
SECONDS = [10, 60]


class STT:
    def __init__(self, config, perception, decoder, joint):
        self.config, self.perception, self.decoder, self.joint = config, perception, decoder, joint


def _full_size() -> STT:
    cfg = VoiceChatConfig()
    a = cfg.audio_config
    perception, decoder, joint = Perception(a), RNNTDecoder(a.decoder), RNNTJoint(a.joint)
    for m in (perception, decoder, joint):
        m.set_dtype(mx.bfloat16)
    f = perception.preprocessor.featurizer
    f.fb, f.window = f.fb.astype(mx.float32), f.window.astype(mx.float32)
    for m in (perception, decoder, joint):
        mx.eval(m.parameters())
    return STT(cfg, perception, decoder, joint)


@pytest.fixture(scope="module")
def stt(tmp_path_factory) -> STT:
    if SIZE == "full":
        model = _full_size()
    else:
        ckpt = open_checkpoint(make_checkpoint(tmp_path_factory.mktemp("bench-stt") / "tiny", "tiny"))
        a = ckpt.config.audio_config
        model = STT(ckpt.config, Perception(a), RNNTDecoder(a.decoder), RNNTJoint(a.joint))
        ckpt.load_into(model.perception, "stt_model.perception.")
        ckpt.load_into(model.decoder, "stt_model.rnnt_decoder.")
        ckpt.load_into(model.joint, "stt_model.rnnt_joint.")
    out = model.joint.joint_net[2]
    blank = model.config.rnnt_blank_id
    raise_blank = np.zeros(out.bias.shape, dtype=np.float32)
    raise_blank[blank] = 1.0 if SIZE == "tiny" else 2.5
    out.bias = out.bias + mx.array(raise_blank).astype(out.bias.dtype)
    return model


def _audio(seconds: int) -> mx.array:
    a = mx.array(np.random.default_rng(seconds).standard_normal(16000 * seconds).astype(np.float32) * 0.1)
    mx.eval(a)
    return a


def test_log_mel(benchmark, stt):
    audio = _audio(10)
    f = stt.perception.preprocessor.featurizer
    benchmark(lambda: mx.eval(log_mel(audio, stt.config.audio_config.preprocessor, f.fb, f.window)))
    benchmark.extra_info.update(size=SIZE, seconds=10)


@pytest.mark.parametrize("seconds", SECONDS)
def test_encoder(benchmark, stt, seconds):
    mel = stt.perception.log_mel(_audio(seconds))
    mx.eval(mel)

    def run():
        out = stt.perception(mel)
        mx.eval(out)
        return out

    projected, lengths, encoded = benchmark(run)
    benchmark.extra_info.update(size=SIZE, seconds=seconds, frames=int(lengths[0]))


@pytest.fixture(scope="module")
def encoded(stt):
    out = stt.perception(stt.perception.log_mel(_audio(10)))[2]
    mx.eval(out)
    return out


def test_rnnt_decode(benchmark, stt, encoded):
    c = stt.config
    ids = benchmark(greedy_decode, encoded, stt.decoder, stt.joint, c.rnnt_blank_id, c.audio_config.max_symbols)
    benchmark.extra_info.update(size=SIZE, seconds=10, frames=encoded.shape[1], tokens=len(ids))


# --------------------------------------------------------------------------- kernels vs references

def _attention_inputs(stt, seconds):
    e = stt.config.audio_config.encoder
    frames = 1 + 16000 * seconds // 160
    for _ in range(3):
        frames = frames // 2 + 1
    keys = mx.random.split(mx.random.key(seconds), 4)
    shape = (1, e.n_heads, frames, e.head_dim)
    q, k, v = (mx.random.normal(shape, key=keys[i]) for i in range(3))
    first, count = position_window(frames, *e.att_context_size)
    p = mx.random.normal((e.n_heads, count, e.head_dim), key=keys[3])
    u, b = mx.zeros((e.n_heads, e.head_dim)), mx.zeros((e.n_heads, e.head_dim))
    mx.eval(q, k, v, p)
    return (q, k, v, p, u, b, e.head_dim**-0.5, *e.att_context_size, first), frames


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("seconds", SECONDS)
def test_rel_pos_attention(benchmark, stt, seconds, path):
    args, frames = _attention_inputs(stt, seconds)
    fn = rel_pos_attention if path == "kernel" else rel_pos_attention_reference
    benchmark(lambda: mx.eval(fn(*args)))
    benchmark.extra_info.update(size=SIZE, seconds=seconds, frames=frames, path=path)


# kernel-host: the loop's weights as the session passes them on a GPU (float32 copies in host memory)
@pytest.mark.parametrize("path", ["kernel", "kernel-host", "reference"])
def test_rnnt_greedy(benchmark, stt, encoded, path):
    c, joint = stt.config, stt.joint
    enc_proj = joint.enc(encoded[0])
    mx.eval(enc_proj)
    fn = rnnt_greedy_reference if path == "reference" else rnnt_greedy
    w = loop_weights(stt.decoder, joint, host_copies=path == "kernel-host")
    args = (enc_proj, *w, c.rnnt_blank_id, c.audio_config.max_symbols)
    table = benchmark(lambda: _eval(fn(*args)))
    benchmark.extra_info.update(size=SIZE, frames=encoded.shape[1], tokens=int((np.array(table) >= 0).sum()),
                                path=path)


def _eval(a):
    mx.eval(a)
    return a


@pytest.mark.parametrize("threads", [1, 0])
def test_rnnt_greedy_every_frame_emitting(benchmark, stt, encoded, threads):
    """The worst case of random weights: blank pushed down, so every frame emits max_symbols tokens
    (an LSTM step each). threads 0: the count chosen for the model's size; 1: one thread. Weights
    as the session passes them on a GPU."""
    c, joint = stt.config, stt.joint
    enc_proj = joint.enc(encoded[0])
    w = loop_weights(stt.decoder, joint, host_copies=True)
    out_b = w.out_b - 100.0 * (mx.arange(w.out_b.shape[0]) == c.rnnt_blank_id)
    mx.eval(enc_proj, out_b)
    args = (enc_proj, *w[:-1], out_b, c.rnnt_blank_id, c.audio_config.max_symbols)
    table = benchmark(lambda: _eval(rnnt_greedy(*args, threads=threads)))
    tokens = int((np.array(table) >= 0).sum())
    benchmark.extra_info.update(size=SIZE, frames=encoded.shape[1], tokens=tokens, threads=threads)
    if benchmark.stats:  # none with --benchmark-disable
        benchmark.extra_info["ms_per_token"] = 1e3 * benchmark.stats.stats.min / max(tokens, 1)
