"""Synthetic VoiceChat checkpoints: the published files, key names, shapes and dtypes, random weights.

`make_checkpoint(dir, size="tiny")` writes a checkpoint small enough for tests on a CPU that still
has every structural feature of the real one (all three Nemotron-H block kinds, sliding and global
TTS layers, a 2-layer LSTM, the rel-pos conformer with x8 causal subsampling, codec strides 7/7/9,
hop 4, n_fft 16, 1764 samples per frame, 16 kHz in / 22.05 kHz out). `size="full"` has the real
shapes (for GPU benchmarks); `inventory(...)` lists its tensors without making any.

    vc-make-checkpoint OUT_DIR [--size tiny|full] [--quantize 4|8] [--dtype bfloat16] [--layout torch|mlx]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from .config import SPEAKER_PROMPT_FRAMES, VoiceChatConfig

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
NUM_SPECIAL_TOKENS = 16  # ids 0..15 are special, as in the published tokenizer (1 bos, 2 eos, 11 silence, 12 pad)


# --------------------------------------------------------------------------- configs

def tiny_config() -> VoiceChatConfig:
    """Small widths, all different from each other, so that a wrong transpose fails on shapes."""
    data = {
        "rnnt_blank_id": 40,
        "text_config": {
            "hidden_size": 192, "intermediate_size": 320, "num_hidden_layers": 5,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 24, "n_groups": 2,
            "conv_kernel": 4, "vocab_size": 384, "max_position_embeddings": 4096,
            "hybrid_override_pattern": "M*-M-",
        },
        "audio_config": {
            "encoder": {"n_layers": 2, "d_model": 80, "n_heads": 4, "subsampling_conv_channels": 24},
            "decoder": {"pred_hidden": 48, "vocab_size": 40},
            "joint": {"joint_hidden": 56, "encoder_hidden": 80, "pred_hidden": 48, "num_classes": 40},
            "output_dim": 192,
        },
        "tts_config": {
            "hidden_size": 96, "intermediate_size": 136, "num_hidden_layers": 7,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 24,
            "sliding_window": 32, "latent_size": 40, "codebook_size": 52,
            "character_encoder": {"hidden_size": 96, "intermediate_size": 112, "num_attention_heads": 4,
                                  "num_key_value_heads": 4, "head_dim": 24},
            "mog_head": {"intermediate_size": 104, "low_rank": 8, "num_predictions": 20},
        },
        "codec_config": {"base_channels": 12, "latent_dim": 40, "codebook_size": 52},
    }
    return VoiceChatConfig.from_dict(data)


def full_config() -> VoiceChatConfig:
    return VoiceChatConfig()


# --------------------------------------------------------------------------- the inventory

@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: its name, shape, dtype and how to fill it."""

    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype
    init: Callable[[np.random.Generator], np.ndarray]
    quantize: int | None = None  # bits: a dense tensor of `dense_dtype` is quantized into weight/scales/biases
    dense_dtype: mx.Dtype | None = None
    # Draw from the generators of these names instead of `name` (an MLX-layout tensor made from
    # its torch-layout sources gets their values: both layouts of one seed hold the same weights).
    seed_names: tuple[str, ...] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size


@dataclass(frozen=True)
class _Gaussian:
    """`center + std * N(0, 1)` of a shape: drawn with numpy (files) or on the MLX device (in memory)."""

    shape: tuple
    std: float
    center: float = 0.0
    perm: tuple | None = None  # stored transposed (MLX layout of a torch-shaped draw)

    def __call__(self, rng: np.random.Generator) -> np.ndarray:
        x = np.float32(self.center) + rng.standard_normal(self.shape, dtype=np.float32) * np.float32(self.std)
        return x.transpose(self.perm) if self.perm else x

    def mlx(self, key: mx.array, shape: tuple) -> mx.array:
        return self.center + self.std * mx.random.normal(shape, key=key)


def _normal(shape, std):
    return _Gaussian(tuple(shape), float(std))


def _around(shape, center, std):
    return _Gaussian(tuple(shape), float(std), float(center))


def _const(shape, value, dtype=np.float32):
    return lambda rng: np.full(shape, value, dtype=dtype)


class _Writer:
    """Collects TensorSpecs in the published layout (or MLX's, for `layout="mlx"`)."""

    def __init__(self, dtype: mx.Dtype, layout: str, quantize: int | None, qmap: dict):
        self.dtype, self.layout, self.quantize, self.qmap = dtype, layout, quantize, qmap
        self.specs: list[TensorSpec] = []

    def add(self, name, shape, init, dtype=None, seed_names=None):
        self.specs.append(TensorSpec(name, tuple(int(s) for s in shape), dtype or self.dtype, init,
                                     seed_names=seed_names))

    def linear(self, name, out_dim, in_dim, bias=False, quantizable=False, std=None):
        std = 1.0 / math.sqrt(in_dim) if std is None else std
        if quantizable and self.quantize:
            group = 64
            if in_dim % group:
                raise ValueError(f"{name}: input width {in_dim} is not a multiple of the group size {group}")
            self.qmap[name] = {"group_size": group, "bits": self.quantize}
            per_word = 32 // self.quantize
            self.specs.append(TensorSpec(f"{name}.weight", (out_dim, in_dim // per_word), mx.uint32,
                                         _normal((out_dim, in_dim), std), self.quantize, self.dtype))
            self.specs.append(TensorSpec(f"{name}.scales", (out_dim, in_dim // group), self.dtype, None))
            self.specs.append(TensorSpec(f"{name}.biases", (out_dim, in_dim // group), self.dtype, None))
        else:
            self.add(f"{name}.weight", (out_dim, in_dim), _normal((out_dim, in_dim), std))
        if bias:
            self.add(f"{name}.bias", (out_dim,), _normal((out_dim,), 0.02))

    def embedding(self, name, rows, dim, quantizable=False, std=1.0):
        self.linear(name, rows, dim, quantizable=quantizable, std=std)

    def conv1d(self, name, out_ch, in_per_group, k, bias=False):
        std = 1.0 / math.sqrt(in_per_group * k)
        torch_shape = (out_ch, in_per_group, k)
        if self.layout == "torch":
            self.add(f"{name}.weight", torch_shape, _normal(torch_shape, std))
        else:
            self.add(f"{name}.weight", (out_ch, k, in_per_group), _Gaussian(torch_shape, std, perm=(0, 2, 1)))
        if bias:
            self.add(f"{name}.bias", (out_ch,), _normal((out_ch,), 0.02))

    def conv_transpose1d(self, name, in_ch, out_ch, k):
        std = 1.0 / math.sqrt(in_ch)
        torch_shape = (in_ch, out_ch, k)
        if self.layout == "torch":
            self.add(f"{name}.weight", torch_shape, _normal(torch_shape, std))
        else:
            self.add(f"{name}.weight", (out_ch, k, in_ch), _Gaussian(torch_shape, std, perm=(1, 2, 0)))

    def conv2d(self, name, out_ch, in_per_group, k, bias=True):
        std = 1.0 / math.sqrt(in_per_group * k * k)
        torch_shape = (out_ch, in_per_group, k, k)
        if self.layout == "torch":
            self.add(f"{name}.weight", torch_shape, _normal(torch_shape, std))
        else:
            self.add(f"{name}.weight", (out_ch, k, k, in_per_group), _Gaussian(torch_shape, std, perm=(0, 2, 3, 1)))
        if bias:
            self.add(f"{name}.bias", (out_ch,), _normal((out_ch,), 0.02))

    def norm(self, name, dim, offset=False, bias=False):
        """RMSNorm / LayerNorm weights; `offset` norms apply `w + 1`, so they sit around 0."""
        self.add(f"{name}.weight", (dim,), _around((dim,), 0.0 if offset else 1.0, 0.1))
        if bias:
            self.add(f"{name}.bias", (dim,), _normal((dim,), 0.02))

    def lstm(self, name, layers, in_dim, hidden):
        std = 1.0 / math.sqrt(hidden)
        for n in range(layers):
            width = in_dim if n == 0 else hidden
            if self.layout == "torch":
                self.add(f"{name}.weight_ih_l{n}", (4 * hidden, width), _normal((4 * hidden, width), std))
                self.add(f"{name}.weight_hh_l{n}", (4 * hidden, hidden), _normal((4 * hidden, hidden), std))
                self.add(f"{name}.bias_ih_l{n}", (4 * hidden,), _normal((4 * hidden,), std))
                self.add(f"{name}.bias_hh_l{n}", (4 * hidden,), _normal((4 * hidden,), std))
            else:  # one bias = bias_ih + bias_hh, summed in float32 as the loader does
                self.add(f"{name}.{n}.Wx", (4 * hidden, width), _normal((4 * hidden, width), std),
                         seed_names=(f"{name}.weight_ih_l{n}",))
                self.add(f"{name}.{n}.Wh", (4 * hidden, hidden), _normal((4 * hidden, hidden), std),
                         seed_names=(f"{name}.weight_hh_l{n}",))
                bias = _normal((4 * hidden,), std)
                self.add(f"{name}.{n}.bias", (4 * hidden,),
                         lambda r_ih, r_hh, b=bias, d=self.dtype: _rounded(b(r_ih), d) + _rounded(b(r_hh), d),
                         dtype=mx.float32, seed_names=(f"{name}.bias_ih_l{n}", f"{name}.bias_hh_l{n}"))


def _stt(w: _Writer, cfg: VoiceChatConfig) -> None:
    t, a = cfg.text_config, cfg.audio_config
    h = t.hidden_size
    w.embedding("stt_model.embed_tokens", t.vocab_size, h, quantizable=True)
    w.linear("stt_model.function_head", t.vocab_size, h, quantizable=True)
    for i, kind in enumerate(t.block_types):
        p = f"stt_model.llm.layers.{i}"
        if kind == "mamba":
            nh = t.mamba_num_heads
            w.add(f"{p}.mixer.A_log", (nh,), lambda rng, n=nh: np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32),
                  dtype=mx.float32)
            w.add(f"{p}.mixer.D", (nh,), _around((nh,), 1.0, 0.1))
            w.conv1d(f"{p}.mixer.conv1d", t.mamba_conv_dim, 1, t.conv_kernel, bias=True)
            # dt_bias = softplus^-1 of a step in [1e-3, 1e-1], as Mamba-2 initializes it.
            w.add(f"{p}.mixer.dt_bias", (nh,), lambda rng, n=nh: _inv_softplus(
                np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))).astype(np.float32))
            w.linear(f"{p}.mixer.in_proj", t.mamba_in_proj_size, h, quantizable=True)
            w.norm(f"{p}.mixer.norm", t.mamba_inner_size)
            w.linear(f"{p}.mixer.out_proj", h, t.mamba_inner_size, quantizable=True)
        elif kind == "attention":
            w.linear(f"{p}.mixer.k_proj", t.num_key_value_heads * t.head_dim, h, quantizable=True)
            w.linear(f"{p}.mixer.o_proj", h, t.num_attention_heads * t.head_dim, quantizable=True)
            w.linear(f"{p}.mixer.q_proj", t.num_attention_heads * t.head_dim, h, quantizable=True)
            w.linear(f"{p}.mixer.v_proj", t.num_key_value_heads * t.head_dim, h, quantizable=True)
        else:
            w.linear(f"{p}.mixer.down_proj", h, t.intermediate_size, quantizable=True)
            w.linear(f"{p}.mixer.up_proj", t.intermediate_size, h, quantizable=True)
        w.norm(f"{p}.norm", h)
    w.norm("stt_model.llm.norm_f", h)
    w.linear("stt_model.lm_head", t.vocab_size, h, quantizable=True)

    e, pre = a.encoder, a.preprocessor
    p = "stt_model.perception.encoder"
    d, c = e.d_model, e.subsampling_conv_channels
    for i in range(e.n_layers):
        q = f"{p}.layers.{i}"
        w.norm(f"{q}.conv.batch_norm", d, bias=True)
        w.conv1d(f"{q}.conv.depthwise_conv", d, 1, e.conv_kernel_size)
        w.conv1d(f"{q}.conv.pointwise_conv1", 2 * d, d, 1)
        w.conv1d(f"{q}.conv.pointwise_conv2", d, d, 1)
        for ff in ("feed_forward1", "feed_forward2"):
            w.linear(f"{q}.{ff}.linear1", e.ff_expansion_factor * d, d)
            w.linear(f"{q}.{ff}.linear2", d, e.ff_expansion_factor * d)
        for nname in ("norm_conv", "norm_feed_forward1", "norm_feed_forward2", "norm_out", "norm_self_att"):
            w.norm(f"{q}.{nname}", d, bias=True)
        for lin in ("linear_k", "linear_out", "linear_pos", "linear_q", "linear_v"):
            w.linear(f"{q}.self_attn.{lin}", d, d)
        w.add(f"{q}.self_attn.pos_bias_u", (e.n_heads, e.head_dim), _normal((e.n_heads, e.head_dim), 0.02))
        w.add(f"{q}.self_attn.pos_bias_v", (e.n_heads, e.head_dim), _normal((e.n_heads, e.head_dim), 0.02))
    w.conv2d(f"{p}.pre_encode.conv.0", c, 1, 3)
    w.conv2d(f"{p}.pre_encode.conv.2", c, 1, 3)
    w.conv2d(f"{p}.pre_encode.conv.3", c, c, 1)
    w.conv2d(f"{p}.pre_encode.conv.5", c, 1, 3)
    w.conv2d(f"{p}.pre_encode.conv.6", c, c, 1)
    w.linear(f"{p}.pre_encode.out", d, c * e.subsampled_features, bias=True)

    from .stt.mel import hann_window, mel_filterbank

    bins = pre.n_fft // 2 + 1
    fb = mel_filterbank(pre.sample_rate, pre.n_fft, pre.features)
    w.add("stt_model.perception.preprocessor.featurizer.fb", (1, pre.features, bins),
          lambda rng: fb[None], dtype=mx.float32)
    window = hann_window(pre.win_length)
    w.add("stt_model.perception.preprocessor.featurizer.window", (pre.win_length,), lambda rng: window,
          dtype=mx.float32)
    w.linear("stt_model.perception.proj", a.output_dim, d, bias=True)

    dec, joint = a.decoder, a.joint
    w.lstm("stt_model.rnnt_decoder.prediction.dec_rnn.lstm", dec.pred_rnn_layers, dec.pred_hidden, dec.pred_hidden)
    w.embedding("stt_model.rnnt_decoder.prediction.embed", dec.vocab_size + 1, dec.pred_hidden)
    w.linear("stt_model.rnnt_joint.enc", joint.joint_hidden, joint.encoder_hidden, bias=True)
    w.linear("stt_model.rnnt_joint.joint_net.2", joint.num_classes + 1, joint.joint_hidden, bias=True)
    w.linear("stt_model.rnnt_joint.pred", joint.joint_hidden, joint.pred_hidden, bias=True)


def _codec(w: _Writer, cfg: VoiceChatConfig, codebooks: dict) -> None:
    c = cfg.codec_config
    p = "tts_model.audio_codec"
    chans = c.stage_channels
    k = c.block_kernel_size

    def blocks(prefix, start, ch):
        for j in range(c.blocks_per_stage):
            b = f"{prefix}.layers.{start + j}"
            w.conv1d(f"{b}.dwconv", ch, 1, k, bias=True)
            w.norm(f"{b}.norm", ch, bias=True)
            w.conv1d(f"{b}.pwconv1", 4 * ch, ch, 1, bias=True)
            w.conv1d(f"{b}.pwconv2", ch, 4 * ch, 1, bias=True)

    # Decoder: per stage (deepest first) ConvTranspose1d then blocks; then Conv1d to the STFT channels.
    idx = 0
    src = c.latent_dim
    for ch, rate in zip(reversed(chans), reversed(c.downsample_rates)):
        w.conv_transpose1d(f"{p}.decoder.layers.{idx}", src, ch, rate)
        blocks(f"{p}.decoder", idx + 1, ch)
        idx += 1 + c.blocks_per_stage
        src = ch
    w.conv1d(f"{p}.decoder.layers.{idx}", c.stft_channels, chans[0], 1)

    # Encoder: Conv1d from the STFT channels, then per stage blocks and a strided Conv1d.
    w.conv1d(f"{p}.encoder.layers.0", chans[0], c.stft_channels, 1)
    idx = 1
    for s, (ch, rate) in enumerate(zip(chans, c.downsample_rates)):
        blocks(f"{p}.encoder", idx, ch)
        nxt = chans[s + 1] if s + 1 < len(chans) else c.latent_dim
        w.conv1d(f"{p}.encoder.layers.{idx + c.blocks_per_stage}", nxt, ch, rate)
        idx += 1 + c.blocks_per_stage

    var = "_variance_list" if w.layout == "torch" else "variance_list"
    for q in range(c.num_quantizers):
        w.add(f"{p}.prvq.{var}.{q}.variance", (), _const((), 1.0))
    for q in range(c.num_quantizers):
        w.add(f"{p}.prvq.mus_list.{q}", (c.codebook_size, c.latent_dim), lambda rng, q=q: codebooks["all"][q])


def _tts(w: _Writer, cfg: VoiceChatConfig, codebooks: dict) -> None:
    t, ce, mog = cfg.tts_config, cfg.tts_config.character_encoder, cfg.tts_config.mog_head
    h, vocab = t.hidden_size, cfg.text_config.vocab_size
    ctrl = "tts_model._control_codes" if w.layout == "torch" else "tts_model.control_codes"
    k = t.codebook_size
    w.add(ctrl, (3,), lambda rng: np.array([k - 3, k - 2, k - 1], dtype=np.int32), dtype=mx.int32)
    _codec(w, cfg, codebooks)
    w.add("tts_model.audio_prompt_latents.Aria", (1, SPEAKER_PROMPT_FRAMES, h), _normal((1, SPEAKER_PROMPT_FRAMES, h), 1.0))
    w.add("tts_model.codec_silence_tokens", (t.num_quantizers,),
          lambda rng: rng.integers(0, k - 3, t.num_quantizers).astype(np.int32), dtype=mx.int32)

    p = "tts_model.tts_model"
    w.add(f"{p}.audio_prompt_projection_W", (h, h), _normal((h, h), 1.0 / math.sqrt(h)))

    def attention(prefix, heads, kv_heads, head_dim):
        w.linear(f"{prefix}.k_proj", kv_heads * head_dim, h)
        w.linear(f"{prefix}.o_proj", h, heads * head_dim)
        w.linear(f"{prefix}.q_proj", heads * head_dim, h)
        w.linear(f"{prefix}.v_proj", kv_heads * head_dim, h)

    def mlp(prefix, inter):
        w.linear(f"{prefix}.down_proj", h, inter)
        w.linear(f"{prefix}.gate_proj", inter, h)
        w.linear(f"{prefix}.up_proj", inter, h)

    for i in range(t.num_hidden_layers):
        q = f"{p}.backbone.layers.{i}"
        w.norm(f"{q}.input_layernorm", h, offset=True)
        mlp(f"{q}.mlp", t.intermediate_size)
        w.norm(f"{q}.post_attention_layernorm", h, offset=True)
        w.norm(f"{q}.post_feedforward_layernorm", h, offset=True)
        w.norm(f"{q}.pre_feedforward_layernorm", h, offset=True)
        w.norm(f"{q}.self_attn.k_norm", t.head_dim, offset=True)
        attention(f"{q}.self_attn", t.num_attention_heads, t.num_key_value_heads, t.head_dim)
        w.norm(f"{q}.self_attn.q_norm", t.head_dim, offset=True)
    w.norm(f"{p}.backbone.norm", h, offset=True)
    w.add(f"{p}.bos_emb", (h,), _normal((h,), 1.0))
    w.linear(f"{p}.embed_code", h, t.latent_size)

    s = f"{p}.embed_subword"
    for i in range(ce.num_hidden_layers):
        q = f"{s}.backbone.encoder.layers.{i}"
        mlp(f"{q}.mlp", ce.intermediate_size)
        w.norm(f"{q}.post_feedforward_layernorm", h, offset=True)
        w.norm(f"{q}.post_self_attn_layernorm", h, offset=True)
        w.norm(f"{q}.pre_feedforward_layernorm", h, offset=True)
        w.norm(f"{q}.pre_self_attn_layernorm", h, offset=True)
        attention(f"{q}.self_attn", ce.num_attention_heads, ce.num_key_value_heads, ce.head_dim)
    w.norm(f"{s}.backbone.encoder.norm", h, offset=True)
    w.add(f"{s}.bos_eos_emb.pad_tensor", (), _const((), 0, np.int32), dtype=mx.int32)
    w.add(f"{s}.bos_eos_emb.special_emb.weight", (3, h), _normal((3, h), 1.0))
    w.add(f"{s}.bos_eos_emb.special_flags", (vocab,), lambda rng: codebooks["special_flags"], dtype=mx.int32)
    w.add(f"{s}.embed_tokens.weight", (ce.char_vocab_size, h), _normal((ce.char_vocab_size, h), 1.0))
    w.linear(f"{s}.proj_embedding", h, h)
    w.add(f"{s}.subword_flag_emb.cont_emb.weight", (2, h), _normal((2, h), 1.0))
    w.add(f"{s}.subword_flag_emb.is_continuation", (vocab + 1,), lambda rng: codebooks["is_continuation"],
          dtype=mx.int32)
    w.add(f"{s}.subword_flag_emb.pad_tensor", (), _const((), 0, np.int32), dtype=mx.int32)

    g = f"{p}.gated_fusion_audio_text"
    w.linear(f"{g}.audio_proj", h, h, bias=True)
    w.norm(f"{g}.final_norm", h, offset=True)
    w.add(f"{g}.gate", (h,), _normal((h,), 1.0))
    w.add(f"{g}.residual_scale", (), _normal((), 1.0))
    w.linear(f"{g}.text_proj", h, h, bias=True)

    m = f"{p}.mog_head"
    n, r, lat = mog.num_predictions, mog.low_rank, t.latent_size
    w.add(f"{m}.low_mat", (n, lat, r), _normal((n, lat, r), 1.0 / math.sqrt(r)))
    for i in range(mog.num_layers):
        mlp(f"{m}.mlp_stack.{i}.mlp", mog.intermediate_size)
        w.norm(f"{m}.mlp_stack.{i}.post_norm", h, offset=True)
        w.norm(f"{m}.mlp_stack.{i}.pre_norm", h, offset=True)
    w.norm(f"{m}.mlp_stack.{mog.num_layers}", h, offset=True)
    w.linear(f"{m}.proj_else", lat, h)
    w.linear(f"{m}.proj_logits", n, h)
    w.linear(f"{m}.proj_logs", 1, h)
    w.linear(f"{m}.proj_mus", n * r, h)
    w.add(f"{p}.null_emb", (h,), _normal((h,), 1.0))
    w.add(f"{p}.rvq_embs", (t.num_quantizers, k, lat), lambda rng: codebooks["all"])


def _inv_softplus(y: np.ndarray) -> np.ndarray:
    return y + np.log(-np.expm1(-y))


def inventory(
    config: VoiceChatConfig,
    quantize: int | None = None,
    dtype: str | mx.Dtype = mx.bfloat16,
    layout: str = "torch",
    extras: dict | None = None,
) -> tuple[list[TensorSpec], dict]:
    """Every tensor of the checkpoint (name-sorted) and the quantization map, without making any."""
    if quantize not in (None, 4, 8):
        raise ValueError(f"quantize must be None, 4 or 8, got {quantize!r}")
    if layout not in ("torch", "mlx"):
        raise ValueError(f"layout must be 'torch' or 'mlx', got {layout!r}")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    qmap: dict = {}
    w = _Writer(dtype, layout, quantize, qmap)
    extras = extras if extras is not None else {}
    _stt(w, config)
    _tts(w, config, extras)
    return sorted(w.specs, key=lambda s: s.name), qmap


# --------------------------------------------------------------------------- the tokenizer

_CORPUS = """What is the capital of France? The capital of France is Paris.
Hello, how are you today? I am fine, thank you. Can you tell me the time?
The quick brown fox jumps over the lazy dog. Please answer in one sentence.
What's the weather like? It is sunny and warm. Let me check that for you.
"""


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly 256 single-character tokens and `vocab_size` ids.

    Ids 0..15 are special (`<unk>`, `<s>` = 1, `</s>` = 2, ..., 11 `<silence>`, 12 `<pad>`), then the
    256 byte symbols, then merges: first those learned from a short English text, then synthetic
    pair merges until the vocabulary is full (as large as the published 131072 if asked).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [f"<SPECIAL_{i}>" for i in range(NUM_SPECIAL_TOKENS)]
    specials[0], specials[1], specials[2], specials[11], specials[12] = "<unk>", "<s>", "</s>", "<silence>", "<pad>"
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    learned = min(vocab_size, NUM_SPECIAL_TOKENS + 256 + 160)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=learned, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges = data["model"]["merges"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in merges]
    # Synthetic pair merges fill the rest deterministically: two-symbol tokens, then three.
    symbols = sorted(alphabet)
    seen = set(vocab)
    def pairs() -> Iterator[tuple[str, str]]:
        for a in symbols:
            for b in symbols:
                yield a, b
        for a in symbols:
            for b in symbols:
                for c in symbols:
                    yield a + b, c
    it = pairs()
    while len(vocab) < vocab_size:
        a, b = next(it)
        if a + b in seen or a not in seen:
            continue
        vocab[a + b] = len(vocab)
        seen.add(a + b)
        merges.append([a, b])
    data["model"]["vocab"] = vocab
    data["model"]["merges"] = merges
    tok = Tokenizer.from_str(json.dumps(data))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def rnnt_vocabulary(size: int) -> list[str]:
    """SentencePiece-style pieces: specials, a language tag, whole words, then single letters."""
    head = ["<unk>", "<en-US>"]
    words = ["▁the", "▁capital", "▁of", "▁is", "▁what", "▁a", "▁hello", "▁you", "▁how", "▁are"]
    letters = [c for c in "etaoinshrdlucmfwypvbgkjqxz"]
    pieces = head + words + ["▁"] + letters + [f"▁{c}" for c in "etaoinshrdlucmfwypvbgkjqxz"]
    pieces = pieces + [f"<piece{i}>" for i in range(max(0, size - len(pieces)))]
    return pieces[:size]


def token_flags(tokenizer, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`is_continuation[vocab + 1]` (1 where a token does not start a word) and `special_flags[vocab]`."""
    cont = np.zeros(vocab_size + 1, dtype=np.int32)
    special = np.zeros(vocab_size, dtype=np.int32)
    for token, i in tokenizer.get_vocab().items():
        if i < NUM_SPECIAL_TOKENS:
            continue
        cont[i] = 0 if token.startswith("Ġ") else 1
    special[1], special[2] = 1, 2
    return cont, special


# --------------------------------------------------------------------------- writing

def _rounded(x: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """`x` as stored in `dtype`, back in float32."""
    return np.array(mx.array(x).astype(dtype).astype(mx.float32))


def _materialize(spec: TensorSpec, seed: int) -> dict[str, mx.array]:
    if spec.seed_names:
        rngs = [np.random.default_rng([seed, zlib.crc32(n.encode())]) for n in spec.seed_names]
        return {spec.name: mx.array(np.asarray(spec.init(*rngs))).astype(spec.dtype)}
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.quantize:
        # Quantized from weights of the stored float dtype, so scales and biases come out in it.
        dense = mx.array(spec.init(rng)).astype(spec.dense_dtype)
        base = spec.name[: -len(".weight")]
        weight, scales, biases = mx.quantize(dense, group_size=64, bits=spec.quantize)
        return {spec.name: weight, f"{base}.scales": scales, f"{base}.biases": biases}
    return {spec.name: mx.array(np.asarray(spec.init(rng))).astype(spec.dtype)}


def _materialize_on_device(spec: TensorSpec, seed: int) -> dict[str, mx.array]:
    """Like `_materialize`, but large Gaussian tensors are drawn by MLX on the default device."""
    if not isinstance(spec.init, _Gaussian):
        return _materialize(spec, seed)
    key = mx.random.key((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**31)
    if spec.quantize:
        dense = spec.init.mlx(key, spec.init.shape).astype(spec.dense_dtype)
        base = spec.name[: -len(".weight")]
        weight, scales, biases = mx.quantize(dense, group_size=64, bits=spec.quantize)
        return {spec.name: weight, f"{base}.scales": scales, f"{base}.biases": biases}
    return {spec.name: spec.init.mlx(key, spec.shape).astype(spec.dtype)}


def published_config_json(config: VoiceChatConfig) -> dict:
    """`config` as the published config.json writes it: its text config holds `use_bias: false`
    (a Nemotron-H field that other MLX loaders require) and leaves out `time_step_limit` when it
    is the unbounded default (JSON has no infinity; an absent limit means no limit)."""
    data = config.to_dict()
    text = data["text_config"]
    text.setdefault("use_bias", False)
    if tuple(config.text_config.time_step_limit) == (0.0, math.inf):
        del text["time_step_limit"]
    return data


def _write_config(config: VoiceChatConfig, path: Path) -> None:
    path.write_text(json.dumps(published_config_json(config), indent=2) + "\n")


def random_checkpoint(
    directory: str | Path,
    size: str = "full",
    quantize: int | None = 4,
    dtype: str | mx.Dtype | None = None,
    seed: int = 0,
    config: VoiceChatConfig | None = None,
):
    """A `Checkpoint` whose tensors are made in memory on the default device (no safetensors file):
    for GPU benchmarks at full size. `directory` receives config.json and the tokenizer files."""
    from .checkpoint import Checkpoint

    config = config or (tiny_config() if size == "tiny" else full_config())
    dtype = dtype or ("bfloat16" if size == "full" else "float32")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = config.text_config.vocab_size
    tokenizer = build_tokenizer(vocab)
    cont, special = token_flags(tokenizer, vocab)
    extras = {"is_continuation": cont, "special_flags": special}
    specs, qmap = inventory(config, quantize, dtype, "mlx", extras)
    t = config.tts_config
    rng = np.random.default_rng([seed, 7])
    extras["all"] = rng.standard_normal((t.num_quantizers, t.codebook_size, t.latent_size), dtype=np.float32)
    config = VoiceChatConfig.from_dict(config.to_dict())
    if qmap:
        config.quantization = config.quantization_config = {"group_size": 64, "bits": quantize, **qmap}
    config.rnnt_vocabulary = rnnt_vocabulary(config.audio_config.decoder.vocab_size)
    _write_config(config, directory / "config.json")
    tokenizer.save(str(directory / "tokenizer.json"))
    tensors: dict[str, mx.array] = {}
    for spec in specs:
        if spec.init is None:
            continue
        made = _materialize_on_device(spec, seed)
        mx.eval(made)
        tensors.update(made)
    return Checkpoint(directory, config, tensors)


def make_checkpoint(
    directory: str | Path,
    size: str = "tiny",
    quantize: int | None = None,
    dtype: str | mx.Dtype | None = None,
    layout: str = "torch",
    seed: int = 0,
    shards: int | None = None,
    config: VoiceChatConfig | None = None,
) -> Path:
    """Write a complete synthetic checkpoint into `directory` (created; must be empty or absent).

    `dtype` is the floating dtype of stored weights (default: bfloat16 for full, float32 for tiny).
    `shards` splits the weights into that many files + index (default: 1 file for tiny, ~5 GB
    shards for full). Weights are made, written and freed one shard at a time.
    """
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    config = config or (tiny_config() if size == "tiny" else full_config())
    dtype = dtype or ("bfloat16" if size == "full" else "float32")
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory}: exists and is not empty")
    directory.mkdir(parents=True, exist_ok=True)

    vocab = config.text_config.vocab_size
    tokenizer = build_tokenizer(vocab)
    cont, special = token_flags(tokenizer, vocab)
    extras = {"is_continuation": cont, "special_flags": special}
    specs, qmap = inventory(config, quantize, dtype, layout, extras)
    rng = np.random.default_rng([seed, 7])
    t = config.tts_config
    extras["all"] = rng.standard_normal((t.num_quantizers, t.codebook_size, t.latent_size), dtype=np.float32)

    config = VoiceChatConfig.from_dict(config.to_dict())
    if qmap:
        q = {"group_size": 64, "bits": quantize, **qmap}
        config.quantization = q
        config.quantization_config = q
    config.rnnt_vocabulary = rnnt_vocabulary(config.audio_config.decoder.vocab_size)
    _write_config(config, directory / "config.json")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (directory / "rnnt_tokenizer").mkdir(exist_ok=True)
    (directory / "rnnt_tokenizer" / "vocab.json").write_text(
        json.dumps({p: i for i, p in enumerate(config.rnnt_vocabulary)}, ensure_ascii=False, indent=0) + "\n")

    groups = _shard_specs(specs, shards if shards else (1 if size == "tiny" else None))
    weight_map: dict[str, str] = {}
    for n, group in enumerate(groups):
        name = "model.safetensors" if len(groups) == 1 else f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        arrays: dict[str, mx.array] = {}
        for spec in group:
            if spec.init is None:
                continue  # scales / biases come with their quantized weight
            for key, value in _materialize(spec, seed).items():
                arrays[key] = value
                weight_map[key] = name
        mx.eval(arrays)
        mx.save_safetensors(str(directory / name), arrays, metadata={"format": "mlx"})
        del arrays
    if len(groups) > 1:
        total = sum(s.nbytes for s in specs)
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return directory


def _shard_specs(specs: list[TensorSpec], count: int | None, max_bytes: int = 5 * 2**30) -> list[list[TensorSpec]]:
    """Split name-sorted specs into shards, keeping a quantized weight with its scales and biases."""
    units: list[list[TensorSpec]] = []
    by_name = {s.name: s for s in specs}
    for s in specs:
        if s.init is None:
            continue
        unit = [s]
        if s.quantize:
            base = s.name[: -len(".weight")]
            unit += [by_name[f"{base}.scales"], by_name[f"{base}.biases"]]
        units.append(unit)
    if count is None:
        total = sum(sum(x.nbytes for x in u) for u in units)
        count = max(1, math.ceil(total / max_bytes))
    target = sum(sum(x.nbytes for x in u) for u in units) / count
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for unit in units:
        b = sum(x.nbytes for x in unit)
        if size + b > target and groups[-1] and len(groups) < count:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += b
    return groups


# --------------------------------------------------------------------------- command

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vc-make-checkpoint", description="Write a synthetic VoiceChat checkpoint.")
    parser.add_argument("output", help="directory to create (must be empty or absent)")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--quantize", type=int, choices=[4, 8], default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--layout", choices=["torch", "mlx"], default="torch")
    parser.add_argument("--seed", type=_count(0), default=0)
    parser.add_argument("--shards", type=_count(1), default=None, help="weight files (default: 1 tiny, ~5 GB each full)")
    args = parser.parse_args(argv)
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out}: exists and is not an empty directory", file=sys.stderr)
        return 2
    tmp, done = None, False
    made = [p for p in reversed(out.absolute().parents) if not p.exists()]  # folders to make, outermost first
    try:
        # written beside its place (missing folders made) and moved there whole: no half checkpoint
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".vc-ckpt-", dir=out.parent))
        except OSError as e:  # named after the checkpoint asked for, not the scratch folder
            raise OSError(e.errno, f"cannot write {out}: {e.strerror}") from None
        make_checkpoint(tmp / "c", args.size, args.quantize, args.dtype, args.layout, args.seed, args.shards)
        if out.exists():
            out.rmdir()
        shutil.move(str(tmp / "c"), str(out))
        done = True
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            for folder in reversed(made):  # the folders this call made, innermost first
                with contextlib.suppress(OSError):
                    folder.rmdir()
    print(out)
    return 0


def _count(least: int):
    """An argparse type: an int >= least."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    return parse


if __name__ == "__main__":
    sys.exit(main())
