"""config.json of a VoiceChat checkpoint as dataclasses.

Defaults are the published model's values (the spec's config.json). Unknown keys are kept in
`extra` (and written back by `to_dict`), never fatal; values that cannot describe a working model
raise `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Silence appended to the input so that the model can finish its answer (`generate`, `vc-generate`).
EXTRA_DECODING_SECONDS = 3.0

MODEL_TYPE = "nemotron_voicechat"
SPEAKERS = ("Aria",)
SPEAKER_PROMPT_FRAMES = 37  # frames of the stored speaker latent (audio_prompt_latents.Aria [1, 37, hidden])

# Upper bounds of the sizes: far above the published model's, low enough that what is built from a
# size before the weights are read (a Python object per layer, a table per position) cannot
# exhaust memory. The weights are checked against the sizes before anything is built
# (checkpoint.check_sizes).
MOST_LAYERS = 512  # layers of a stack, heads, groups, steps
MOST_WIDTH = 1 << 18  # widths, vocabularies, windows
MOST_POSITIONS = 1 << 24  # the LLM's context (93 hours of 80 ms frames), the encoder's table
MIN_RATE, MAX_RATE = 1_000, 384_000  # sample rates, in Hz (as audio.py takes them)


class ConfigError(ValueError):
    """A config.json value that cannot describe a working model; the message names the field."""


def _check(ok: bool, field_path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.json: {field_path}: {message}")


@dataclass
class _Section:
    """Shared `from_dict` / `to_dict` for the nested sections (unknown keys go to `extra`)."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Fields whose JSON forms `_normalize` reads itself, not by their annotation.
    OWN_FORMS: typing.ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, path: str = ""):
        _check(data is None or isinstance(data, dict), path.rstrip(".") or "(top level)",
               f"expected an object, got {type(data).__name__}")
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "extra"}
        hints = typing.get_type_hints(cls)
        subs = cls.section_types()
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key in subs:
                _check(isinstance(value, dict), f"{path}{key}", f"expected an object, got {type(value).__name__}")
                kwargs[key] = subs[key].from_dict(value, f"{path}{key}.")
            elif key in names:
                kwargs[key] = value if key in cls.OWN_FORMS else _typed(value, hints[key], f"{path}{key}")
            else:
                extra[key] = value
        obj = cls(**kwargs)
        obj.extra = extra
        obj._normalize(path)
        return obj

    def _normalize(self, path: str) -> None:
        """Coerce JSON forms and validate; subclasses extend."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if not f.init or f.name == "extra":
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Section) else _jsonable(value)
        out.update(self.extra)
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _typed(value: Any, hint: Any, path: str) -> Any:
    """`value` from JSON as the annotation `hint` says (int, float, bool, str, a tuple or list of
    them, a dict, or one of these or None), or a ConfigError naming `path`. A float is finite,
    or "inf" / "-inf" as `to_dict` writes it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _typed(value, hint, path)
    if hint is Any:
        return value
    if hint is bool:
        _check(isinstance(value, bool), path, f"expected true or false, got {value!r}")
        return value
    if hint is int:
        whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
        _check((isinstance(value, int) and not isinstance(value, bool)) or whole, path,
               f"expected an integer, got {_kind(value)} {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, str) and value in ("inf", "-inf"):
            return float(value)
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), path,
               f"expected a number, got {_kind(value)} {value!r}")
        _check(math.isfinite(value), path, f"must be finite, got {value!r}")
        return float(value)
    if hint is str:
        _check(isinstance(value, str), path, f"expected a string, got {_kind(value)} {value!r}")
        return value
    if origin in (tuple, list):
        _check(isinstance(value, (list, tuple)), path, f"expected a list, got {_kind(value)} {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            _check(len(value) == len(args), path, f"expected {len(args)} items, got {len(value)}")
            items = [_typed(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            items = [_typed(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        _check(isinstance(value, dict), path, f"expected an object, got {_kind(value)} {value!r}")
        return value
    raise TypeError(f"config field {path}: unhandled annotation {hint!r}")  # a bug here, not in the file


def _positive(obj: _Section, path: str, *names: str, most: int = MOST_WIDTH) -> None:
    """Integers in [1, most]."""
    for name in names:
        value = getattr(obj, name)
        _check(isinstance(value, int) and not isinstance(value, bool) and 0 < value <= most,
               f"{path}{name}", f"must be an integer in [1, {most}], got {value!r}")


def _within(obj: _Section, path: str, name: str, low: float, high: float, low_open: bool = True) -> None:
    """A number in (low, high] (or [low, high] when not `low_open`)."""
    value = getattr(obj, name)
    ok = (low < value if low_open else low <= value) and value <= high
    _check(ok, f"{path}{name}", f"must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")


# --------------------------------------------------------------------------- LLM (Nemotron-H)

@dataclass
class TextConfig(_Section):
    model_type: str = "nemotron_h"
    hidden_size: int = 4480
    intermediate_size: int = 15680
    num_hidden_layers: int = 56
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 80
    ssm_state_size: int = 128
    conv_kernel: int = 4
    n_groups: int = 8
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mlp_bias: bool = False
    attention_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    vocab_size: int = 131072
    max_position_embeddings: int = 131072
    hybrid_override_pattern: str = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    def _normalize(self, path: str) -> None:
        _positive(self, path, "hidden_size", "intermediate_size", "head_dim", "mamba_head_dim", "ssm_state_size",
                  "conv_kernel", "vocab_size")
        _positive(self, path, "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "mamba_num_heads",
                  "n_groups", most=MOST_LAYERS)
        _positive(self, path, "max_position_embeddings", most=MOST_POSITIONS)
        _within(self, path, "layer_norm_epsilon", 0.0, 1.0)
        _check(self.model_type == "nemotron_h", f"{path}model_type",
               f"expected 'nemotron_h', got {self.model_type!r}")
        lo, hi = (float(v) for v in self.time_step_limit)
        _check(0.0 <= lo <= hi, f"{path}time_step_limit", f"expected [low, high] with 0 <= low <= high, got {[lo, hi]}")
        self.time_step_limit = (lo, hi)
        pattern = self.hybrid_override_pattern
        _check(isinstance(pattern, str) and set(pattern) <= set("M*-") and len(pattern) > 0,
               f"{path}hybrid_override_pattern", f"must use only 'M', '*' and '-', got {pattern!r}")
        _check(len(pattern) == self.num_hidden_layers, f"{path}hybrid_override_pattern",
               f"has {len(pattern)} layers but num_hidden_layers is {self.num_hidden_layers}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, f"{path}num_key_value_heads",
               f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}")
        _check(self.mamba_num_heads % self.n_groups == 0, f"{path}n_groups",
               f"{self.n_groups} does not divide mamba_num_heads {self.mamba_num_heads}")

    @property
    def block_types(self) -> list[str]:
        """Per layer: 'mamba', 'attention' or 'mlp', from `hybrid_override_pattern`."""
        kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
        return [kinds[c] for c in self.hybrid_override_pattern]

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.block_types) if k == "mamba"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.block_types) if k == "attention"]

    @property
    def mlp_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.block_types) if k == "mlp"]

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_inner_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_in_proj_size(self) -> int:
        return self.mamba_inner_size + self.mamba_conv_dim + self.mamba_num_heads


# --------------------------------------------------------------------------- speech in

@dataclass
class PreprocessorConfig(_Section):
    sample_rate: int = 16000
    features: int = 128
    n_fft: int = 512
    window_size: float = 0.025
    window_stride: float = 0.01
    window: str = "hann"
    preemph: float = 0.97
    log: bool = True
    normalize: str = "NA"
    dither: float = 1e-5  # training only; never applied here
    log_zero_guard_value: float = 2.0**-24
    pad_to: int = 0

    def _normalize(self, path: str) -> None:
        _within(self, path, "sample_rate", MIN_RATE, MAX_RATE, low_open=False)
        # (the mel filterbank is computed from these two when the model is built)
        _positive(self, path, "features", most=1 << 10)
        _positive(self, path, "n_fft", most=1 << 14)
        _within(self, path, "window_size", 0.0, 1.0)
        _within(self, path, "window_stride", 0.0, 1.0)
        _within(self, path, "preemph", 0.0, 1.0, low_open=False)
        _within(self, path, "log_zero_guard_value", 0.0, 1.0)
        _check(self.window == "hann", f"{path}window", f"only 'hann' is supported, got {self.window!r}")
        _check(self.win_length <= self.n_fft, f"{path}window_size",
               f"window of {self.win_length} samples is longer than n_fft {self.n_fft}")
        _check(self.hop_length > 0, f"{path}window_stride", "must be positive")

    @property
    def win_length(self) -> int:
        return int(round(self.window_size * self.sample_rate))

    @property
    def hop_length(self) -> int:
        return int(round(self.window_stride * self.sample_rate))


def _context_size(value: Any, path: str) -> tuple[int, int]:
    """`att_context_size` is written as `[70, 0]` or `[[70, 0]]` (one entry per chunk setting)."""
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = value[0]
    _check(isinstance(value, (list, tuple)) and len(value) == 2
           and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
           path, f"expected [left, right] or [[left, right]], got {value!r}")
    left, right = value
    _check(-1 <= left <= MOST_POSITIONS and 0 <= right <= MOST_POSITIONS, path,
           f"left must be in [-1, {MOST_POSITIONS}] and right in [0, {MOST_POSITIONS}], got {value!r}")
    return int(left), int(right)


@dataclass
class EncoderConfig(_Section):
    feat_in: int = 128
    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 8
    ff_expansion_factor: int = 4
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    conv_kernel_size: int = 9
    causal_downsampling: bool = True
    conv_context_size: str = "causal"
    conv_norm_type: str = "layer_norm"
    self_attention_model: str = "rel_pos"
    att_context_style: str = "chunked_limited"
    att_context_size: tuple[int, int] = (70, 0)
    pos_emb_max_len: int = 5000
    use_bias: bool = False
    xscaling: bool = False

    OWN_FORMS = frozenset({"att_context_size"})

    def _normalize(self, path: str) -> None:
        _positive(self, path, "feat_in", "d_model", "subsampling_conv_channels", "conv_kernel_size")
        _positive(self, path, "n_layers", "n_heads", "ff_expansion_factor", "subsampling_factor", most=MOST_LAYERS)
        _positive(self, path, "pos_emb_max_len", most=MOST_POSITIONS)
        self.att_context_size = _context_size(self.att_context_size, f"{path}att_context_size")
        _check(self.d_model % self.n_heads == 0, f"{path}n_heads",
               f"{self.n_heads} heads do not divide d_model {self.d_model}")
        _check(self.subsampling_factor == 8, f"{path}subsampling_factor",
               f"only 8 (three stride-2 stages) is supported, got {self.subsampling_factor}")
        _check(self.self_attention_model == "rel_pos", f"{path}self_attention_model",
               f"only 'rel_pos' is supported, got {self.self_attention_model!r}")
        _check(self.att_context_style == "chunked_limited", f"{path}att_context_style",
               f"only 'chunked_limited' is supported, got {self.att_context_style!r}")
        _check(self.conv_kernel_size % 2 == 1, f"{path}conv_kernel_size", "must be odd")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def subsampled_features(self) -> int:
        """Frequency bins after the three (2, 1)-padded stride-2 stages: n -> n // 2 + 1 each."""
        n = self.feat_in
        for _ in range(3):
            n = n // 2 + 1
        return n


@dataclass
class DecoderConfig(_Section):
    pred_hidden: int = 640
    pred_rnn_layers: int = 2
    vocab_size: int = 1024
    blank_as_pad: bool = True

    def _normalize(self, path: str) -> None:
        _positive(self, path, "pred_hidden", "vocab_size")
        _positive(self, path, "pred_rnn_layers", most=MOST_LAYERS)


@dataclass
class JointConfig(_Section):
    joint_hidden: int = 640
    activation: str = "relu"
    encoder_hidden: int = 1024
    pred_hidden: int = 640
    num_classes: int = 1024

    def _normalize(self, path: str) -> None:
        _positive(self, path, "joint_hidden", "encoder_hidden", "pred_hidden", "num_classes")
        _check(self.activation == "relu", f"{path}activation", f"only 'relu' is supported, got {self.activation!r}")


@dataclass
class AudioConfig(_Section):
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    output_dim: int = 4480
    max_symbols: int = 10

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"preprocessor": PreprocessorConfig, "encoder": EncoderConfig,
                "decoder": DecoderConfig, "joint": JointConfig}

    def _normalize(self, path: str) -> None:
        _positive(self, path, "output_dim")
        _positive(self, path, "max_symbols", most=MOST_LAYERS)
        enc, dec, joint, pre = self.encoder, self.decoder, self.joint, self.preprocessor
        _check(enc.feat_in == pre.features, f"{path}encoder.feat_in",
               f"{enc.feat_in} differs from preprocessor.features {pre.features}")
        _check(joint.encoder_hidden == enc.d_model, f"{path}joint.encoder_hidden",
               f"{joint.encoder_hidden} differs from encoder.d_model {enc.d_model}")
        _check(joint.pred_hidden == dec.pred_hidden, f"{path}joint.pred_hidden",
               f"{joint.pred_hidden} differs from decoder.pred_hidden {dec.pred_hidden}")
        _check(joint.num_classes == dec.vocab_size, f"{path}joint.num_classes",
               f"{joint.num_classes} differs from decoder.vocab_size {dec.vocab_size}")


# --------------------------------------------------------------------------- speech out

@dataclass
class CharacterEncoderConfig(_Section):
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float = 50.0
    rope_base: float = 1e4
    char_vocab_size: int = 257

    def _normalize(self, path: str) -> None:
        _positive(self, path, "hidden_size", "intermediate_size", "head_dim", "char_vocab_size")
        _positive(self, path, "num_hidden_layers", "num_attention_heads", "num_key_value_heads", most=MOST_LAYERS)
        _within(self, path, "rms_norm_eps", 0.0, 1.0)
        _within(self, path, "query_pre_attn_scalar", 0.0, 1e6)
        _within(self, path, "attn_logit_softcapping", 0.0, 1e6)
        _within(self, path, "rope_base", 0.0, 1e12)
        _check(self.num_attention_heads * self.head_dim == self.hidden_size, f"{path}head_dim",
               f"num_attention_heads {self.num_attention_heads} x head_dim {self.head_dim} "
               f"!= hidden_size {self.hidden_size}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, f"{path}num_key_value_heads",
               f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}")


@dataclass
class MogHeadConfig(_Section):
    intermediate_size: int = 4608
    low_rank: int = 64
    min_log_std: float = -4.0
    num_layers: int = 3
    num_predictions: int = 1024
    eps: float = 1e-6

    def _normalize(self, path: str) -> None:
        _positive(self, path, "intermediate_size", "low_rank", "num_predictions")
        _positive(self, path, "num_layers", most=MOST_LAYERS)
        _within(self, path, "eps", 0.0, 1.0)


@dataclass
class TTSConfig(_Section):
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    rope_global_base_freq: float = 1e6
    rope_local_base_freq: float = 1e4
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    num_delay_speech_tokens: int = 2
    num_iterations: int = 8
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    exponent: float = 3.0
    use_gated_fusion_for_text_audio: bool = True
    use_subword_flag_emb: bool = True
    use_bos_eos_emb: bool = True
    use_audio_prompt_frozen_projection: bool = True
    audio_prompt_duration: float = 3.0
    character_encoder: CharacterEncoderConfig = field(default_factory=CharacterEncoderConfig)
    mog_head: MogHeadConfig = field(default_factory=MogHeadConfig)

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"character_encoder": CharacterEncoderConfig, "mog_head": MogHeadConfig}

    def _normalize(self, path: str) -> None:
        _positive(self, path, "hidden_size", "intermediate_size", "head_dim", "latent_size", "codebook_size")
        _positive(self, path, "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "sliding_window_pattern", "num_quantizers", "num_iterations", most=MOST_LAYERS)
        _positive(self, path, "sliding_window", most=MOST_POSITIONS)
        _check(0 <= self.num_delay_speech_tokens <= MOST_LAYERS, f"{path}num_delay_speech_tokens",
               f"must be in [0, {MOST_LAYERS}], got {self.num_delay_speech_tokens}")
        _within(self, path, "rms_norm_eps", 0.0, 1.0)
        _within(self, path, "exponent", 0.0, 100.0)
        _within(self, path, "query_pre_attn_scalar", 0.0, 1e6)
        _within(self, path, "rope_global_base_freq", 0.0, 1e12)
        _within(self, path, "rope_local_base_freq", 0.0, 1e12)
        _within(self, path, "noise_scale", 0.0, 100.0, low_open=False)
        _within(self, path, "guidance_scale", -100.0, 100.0, low_open=False)
        _within(self, path, "audio_prompt_duration", 0.0, 3600.0)
        _check(self.num_attention_heads * self.head_dim == self.hidden_size, f"{path}head_dim",
               f"num_attention_heads {self.num_attention_heads} x head_dim {self.head_dim} "
               f"!= hidden_size {self.hidden_size}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, f"{path}num_key_value_heads",
               f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}")
        _check(self.character_encoder.hidden_size == self.hidden_size, f"{path}character_encoder.hidden_size",
               f"{self.character_encoder.hidden_size} differs from hidden_size {self.hidden_size}")
        _check(0.0 < self.top_p <= 1.0, f"{path}top_p", f"must be in (0, 1], got {self.top_p}")
        _check(sum(self.mask_schedule) == self.num_quantizers, f"{path}exponent",
               f"mask schedule {self.mask_schedule} does not cover {self.num_quantizers} quantizers")

    @property
    def global_layers(self) -> list[int]:
        """Layers with global attention (full KV cache, RoPE `rope_global_base_freq`)."""
        p = self.sliding_window_pattern
        return [i for i in range(self.num_hidden_layers) if (i + 1) % p == 0]

    def is_global_layer(self, i: int) -> bool:
        return (i + 1) % self.sliding_window_pattern == 0

    @property
    def mask_schedule(self) -> list[int]:
        """Codebooks decided at each of `num_iterations` steps (exponent 3, 31 -> [0,0,0,1,1,3,4,22])."""
        n, q, e = self.num_iterations, self.num_quantizers, self.exponent
        masked = [math.ceil((1.0 - (i / n) ** e) ** (1.0 / e) * q) for i in range(n)] + [0]
        return [masked[i] - masked[i + 1] for i in range(n)]


@dataclass
class CodecConfig(_Section):
    sample_rate: int = 22050
    base_channels: int = 384
    channel_multipliers: tuple[int, ...] = (1, 2, 4)
    downsample_rates: tuple[int, ...] = (7, 7, 9)
    blocks_per_stage: int = 3
    block_kernel_size: int = 7
    latent_dim: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024

    def _normalize(self, path: str) -> None:
        _within(self, path, "sample_rate", MIN_RATE, MAX_RATE, low_open=False)
        _positive(self, path, "base_channels", "latent_dim", "codebook_size")
        _positive(self, path, "blocks_per_stage", "block_kernel_size", "n_fft", "hop_length", "num_quantizers",
                  most=MOST_LAYERS)
        self.channel_multipliers = tuple(self.channel_multipliers)
        self.downsample_rates = tuple(self.downsample_rates)
        for name in ("channel_multipliers", "downsample_rates"):
            values = getattr(self, name)
            _check(1 <= len(values) <= 8 and all(1 <= v <= 64 for v in values), f"{path}{name}",
                   f"must be 1 to 8 integers in [1, 64], got {list(values)}")
        _check(len(self.channel_multipliers) == len(self.downsample_rates), f"{path}downsample_rates",
               f"{len(self.downsample_rates)} rates for {len(self.channel_multipliers)} stages")
        _check(self.n_fft % 2 == 0, f"{path}n_fft", "must be even")

    @property
    def stage_channels(self) -> list[int]:
        return [self.base_channels * m for m in self.channel_multipliers]

    @property
    def samples_per_frame(self) -> int:
        """waveform_to_token_ratio: hop x product of the downsample rates (4 x 7 x 7 x 9 = 1764)."""
        return self.hop_length * math.prod(self.downsample_rates)

    waveform_to_token_ratio = samples_per_frame

    @property
    def stft_channels(self) -> int:
        """Real and imaginary parts of n_fft / 2 + 1 bins (18)."""
        return 2 * (self.n_fft // 2 + 1)


# --------------------------------------------------------------------------- top level

@dataclass
class VoiceChatConfig(_Section):
    model_type: str = MODEL_TYPE
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 12
    silence_token_id: int = 11
    rnnt_blank_id: int = 1024
    input_sample_rate: int = 16000
    output_sample_rate: int = 22050
    frame_duration: float = 0.08
    function_channel_weight: float = 2.0
    speaker: str = "Aria"
    rnnt_vocabulary: list[str] | None = None
    quantization: dict[str, Any] | None = None
    quantization_config: dict[str, Any] | None = None
    text_config: TextConfig = field(default_factory=TextConfig)
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TTSConfig = field(default_factory=TTSConfig)
    codec_config: CodecConfig = field(default_factory=CodecConfig)

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"text_config": TextConfig, "audio_config": AudioConfig,
                "tts_config": TTSConfig, "codec_config": CodecConfig}

    def _normalize(self, path: str) -> None:
        for name in ("input_sample_rate", "output_sample_rate"):
            _within(self, path, name, MIN_RATE, MAX_RATE, low_open=False)
        _within(self, path, "frame_duration", 0.0, 10.0)
        _within(self, path, "function_channel_weight", -1e6, 1e6, low_open=False)
        _check(self.model_type == MODEL_TYPE, "model_type",
               f"expected {MODEL_TYPE!r}, got {self.model_type!r} (not a VoiceChat checkpoint)")
        _check(self.speaker in SPEAKERS, "speaker",
               f"unknown speaker {self.speaker!r}; this model ships only {', '.join(SPEAKERS)}")
        text, audio, tts, codec = self.text_config, self.audio_config, self.tts_config, self.codec_config
        _check(audio.output_dim == text.hidden_size, "audio_config.output_dim",
               f"{audio.output_dim} differs from text_config.hidden_size {text.hidden_size}")
        _check(self.rnnt_blank_id == audio.decoder.vocab_size, "rnnt_blank_id",
               f"{self.rnnt_blank_id} differs from audio_config.decoder.vocab_size {audio.decoder.vocab_size}")
        _check(tts.latent_size == codec.latent_dim, "tts_config.latent_size",
               f"{tts.latent_size} differs from codec_config.latent_dim {codec.latent_dim}")
        _check(tts.num_quantizers == codec.num_quantizers, "tts_config.num_quantizers",
               f"{tts.num_quantizers} differs from codec_config.num_quantizers {codec.num_quantizers}")
        _check(tts.codebook_size == codec.codebook_size, "tts_config.codebook_size",
               f"{tts.codebook_size} differs from codec_config.codebook_size {codec.codebook_size}")
        _check(codec.sample_rate == self.output_sample_rate, "codec_config.sample_rate",
               f"{codec.sample_rate} differs from output_sample_rate {self.output_sample_rate}")
        _check(audio.preprocessor.sample_rate == self.input_sample_rate, "audio_config.preprocessor.sample_rate",
               f"{audio.preprocessor.sample_rate} differs from input_sample_rate {self.input_sample_rate}")
        frame = codec.samples_per_frame / codec.sample_rate
        _check(abs(frame - self.frame_duration) < 1e-3, "frame_duration",
               f"{self.frame_duration} s but the codec makes {codec.samples_per_frame} samples "
               f"per frame at {codec.sample_rate} Hz ({frame:.4f} s)")
        hop_in = audio.preprocessor.hop_length * audio.encoder.subsampling_factor
        _check(abs(hop_in / self.input_sample_rate - self.frame_duration) < 1e-6, "frame_duration",
               f"{self.frame_duration} s but the encoder makes one frame per {hop_in} input samples")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id"):
            value = getattr(self, name)
            _check(0 <= value < text.vocab_size, name, f"{value} is outside the vocabulary ({text.vocab_size})")
        if self.rnnt_vocabulary is not None:
            _check(len(self.rnnt_vocabulary) == audio.decoder.vocab_size, "rnnt_vocabulary",
                   f"{len(self.rnnt_vocabulary)} pieces but audio_config.decoder.vocab_size is "
                   f"{audio.decoder.vocab_size}")
        if self.quantization is None and self.quantization_config is not None:
            self.quantization = self.quantization_config

    # -- derived

    @property
    def samples_per_frame(self) -> int:
        return self.codec_config.samples_per_frame

    @property
    def input_samples_per_frame(self) -> int:
        return int(round(self.frame_duration * self.input_sample_rate))

    # -- files

    @classmethod
    def from_file(cls, path: str | Path) -> "VoiceChatConfig":
        """The config of a checkpoint's config.json; every problem is a ConfigError naming the file."""
        path = Path(path)
        try:
            text = path.read_bytes().decode("utf-8")
            data = json.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a config") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {_kind(data)}")
        if "model_type" not in data:  # a file that does not say what it is, is not taken as one
            raise ConfigError(f"{path}: model_type: missing (a VoiceChat checkpoint says {MODEL_TYPE!r})")
        try:
            return cls.from_dict(data)
        except ConfigError as e:  # "config.json: field: ..." -> "<path>: field: ..."
            message = str(e).removeprefix("config.json: ")
            raise ConfigError(f"{path}: {message}") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a config") from None

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("rnnt_vocabulary", "quantization", "quantization_config"):
            if out.get(key) is None:
                out.pop(key, None)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
