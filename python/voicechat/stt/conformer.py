"""The speech encoder: log-mel frontend buffers, causal FastConformer, projection to the LLM width.

Attribute names mirror the checkpoint below `stt_model.perception.`:
  preprocessor.featurizer.{fb, window}   the stored filterbank [1, 128, 257] and window [400]
  encoder.pre_encode.{conv.N, out}       causal depthwise-striding x8 subsampling
  encoder.layers.N.*                     Conformer blocks (rel-pos attention, conv module)
  proj                                   Linear(d_model -> output_dim)

Everything is causal: encoder frame i depends on mel frames <= 8 i only (subsampling pads 2 left,
1 right; attention sees i - left .. i; the depthwise conv pads k - 1 on the left). Activations are
float32 whatever the weights' dtype.

`PerceptionStream` runs the same network on a signal given a chunk at a time, with caches: each
subsampling stage keeps the input frames its next output reads (its right zero pad is only read
by a stage's last output, when the input length is even, so that output waits for `finish`), each
layer the keys and values of its last `left` frames and the last `k - 1` inputs of its depthwise
conv. New mel frames give new encoder frames, the same values as the whole-signal pass. The
attention caches hold `left` frames' keys from the start (zeros before the first frames, which the
attention skips: its key start), so every chunk of n frames has one shape from the first: its
layers run as one compiled graph (`ConformerEncoder.stream`), and streams at any point batch.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..config import AudioConfig, ConfigError, EncoderConfig, PreprocessorConfig
from ..held import evaluate_held, held, hold
from ..kernels.gemv import stack_linears
from ..kernels.rel_pos_attention import position_window, rel_pos_attention
from ..stacked_rows import StackedRows, padded
from .mel import StreamingLogMel, hann_window, log_mel, mel_filterbank

LAYER_NORM_EPS = 1e-5
# The streamed layers' projected position tables are held under this key + the length, for the
# last few lengths (each 71 rows a layer: ~7 MB at full size).
POSITIONS_KEY = "_stream_positions_"
KEPT_POSITION_LENGTHS = 4


def subsampled_length(lengths: mx.array | int):
    """Frames after the three (2, 1)-padded, stride-2, kernel-3 stages: n -> n // 2 + 1 each."""
    for _ in range(3):
        lengths = lengths // 2 + 1
    return lengths


def relative_positions(length: int, d_model: int, first: int = 0, count: int | None = None) -> mx.array:
    """Rows `[first, first + count)` of the `[2L - 1, d_model]` float32 table of relative positions
    L-1 .. -(L-1) (all of them by default).

    Interleaved: sin on even dims, cos on odd, `div_i = exp(-2i ln(1e4) / d_model)` (NeMo's table,
    computed in float32 like its own).
    """
    count = 2 * length - 1 - first if count is None else count
    top = length - 1 - first
    pos = mx.arange(top, top - count, -1, dtype=mx.float32)
    div = mx.exp(mx.arange(0, d_model, 2, dtype=mx.float32) * -(math.log(10000.0) / d_model))
    angles = pos[:, None] * div[None, :]
    return mx.stack([mx.sin(angles), mx.cos(angles)], axis=-1).reshape(count, d_model)


class Featurizer(nn.Module):
    """The checkpoint's frontend buffers (the formula's own values until loaded)."""

    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        self.fb = mx.array(mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.features))[None]
        self.window = mx.array(hann_window(cfg.win_length))


class Preprocessor(nn.Module):
    def __init__(self, cfg: PreprocessorConfig):
        super().__init__()
        self.featurizer = Featurizer(cfg)


class CausalSubsampling(nn.Module):
    """Causal depthwise-striding subsampling: [B, T, feat] -> [B, T', d_model], T' = subsampled_length(T).

    `conv` keeps NeMo's indices: 0 conv, 1 ReLU, 2 depthwise, 3 pointwise, 4 ReLU, 5 depthwise,
    6 pointwise, 7 ReLU. Each stride-2 conv is preceded by padding (2, 1) on time and frequency.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        c = cfg.subsampling_conv_channels
        self.conv = [
            nn.Conv2d(1, c, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=2, groups=c),
            nn.Conv2d(c, c, 1),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=2, groups=c),
            nn.Conv2d(c, c, 1),
            nn.ReLU(),
        ]
        self.out = nn.Linear(c * cfg.subsampled_features, cfg.d_model)

    STAGES = 3
    LEFT, RIGHT = 2, 1  # zero padding before each stride-2 conv, on time and frequency

    @classmethod
    def _pad(cls, x: mx.array, time: tuple[int, int] = (LEFT, RIGHT)) -> mx.array:
        return mx.pad(x, [(0, 0), time, (cls.LEFT, cls.RIGHT), (0, 0)])

    def stage(self, i: int, padded: mx.array) -> mx.array:
        """Stage i (stride-2 conv, then the pointwise conv of stages 1 and 2, ReLU) on its padded input."""
        conv = self.conv
        if i == 0:
            return nn.relu(conv[0](padded))
        return nn.relu(conv[3 * i](conv[3 * i - 1](padded)))

    def project(self, x: mx.array) -> mx.array:
        """The last stage's `[B, T, F, C]` -> `[B, T, d_model]`."""
        b, t, f, c = x.shape
        # Channel-major flatten, as NeMo's [B, C, T, F] -> [B, T, C * F].
        return self.out(x.transpose(0, 1, 3, 2).reshape(b, t, c * f))

    def __call__(self, x: mx.array) -> mx.array:
        x = x[..., None]
        for i in range(self.STAGES):
            x = self.stage(i, self._pad(x))
        return self.project(x)

    def stream(self, x: mx.array, state: "SubsamplingState", end: bool = False) -> mx.array:
        """The output frames that the new input frames `x [B, n, feat]` complete (all of them when
        `end`: the right zero pad then stands for the input's end). Stage output o reads its input
        frames 2o - 2 .. 2o; `state` keeps, per stage, those from the next output's first on (B
        rows: streams at the same point of their stage inputs, each row its own arithmetic)."""
        rows = x.shape[0]
        x = x[..., None]
        for i in range(self.STAGES):
            pending = mx.concatenate([state.pending[i], self._pad(x, (0, 0))], axis=1)
            if end:  # the right pad
                pending = mx.pad(pending, [(0, 0), (0, self.RIGHT), (0, 0), (0, 0)])
            count = max(0, (pending.shape[1] - 1) // 2)  # outputs whose three taps are all here
            state.pending[i] = pending[:, 2 * count :]
            if count == 0:  # (a conv of no output frames is not an op MLX takes; later stages may still end)
                x = mx.zeros((rows, 0, (pending.shape[2] - 3) // 2 + 1, self.conv[0].weight.shape[0]), mx.float32)
            else:
                x = self.stage(i, pending[:, : 2 * count + 1])
        if x.shape[1] == 0:  # no projection of zero rows: MLX-CUDA's addmm divides by the row count
            return mx.zeros((rows, 0, self.out.weight.shape[0]), mx.float32)
        return self.project(x)


def _weight_t(layer: nn.Module) -> mx.array:
    """A bias-free projection's weight as the right operand of `x @ w`: `[in, out]`, a transposed
    view (a Linear's `[out, in]`, a kernel-1 Conv1d's `[out, 1, in]`)."""
    w = layer["weight"]
    return w.reshape(w.shape[0], w.shape[-1]).T if w.ndim == 3 else w.T


def hold_weight_t(layer: nn.Module) -> None:
    """Keep `_weight_t(layer)` (`ConformerEncoder.prepare`)."""
    hold(layer, "_weight_t", (layer["weight"],), _weight_t(layer))


def project(layer: nn.Module, x: mx.array) -> mx.array:
    """`x @ w.T` for a bias-free Linear or kernel-1 Conv1d (the matmul it is). Where the transposed
    view is held, a compiled graph reads it as a leaf instead of replaying its Transpose (and
    Reshape) at every call; the product's operands, strides included, are the same."""
    kept = held(layer, "_weight_t", (layer["weight"],))
    return x @ (_weight_t(layer) if kept is None else kept)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, expansion: int):
        super().__init__()
        self.linear1 = nn.Linear(d_model, expansion * d_model, bias=False)
        self.linear2 = nn.Linear(expansion * d_model, d_model, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return project(self.linear2, nn.silu(project(self.linear1, x)))


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (pos_bias_u / pos_bias_v)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        self.n_heads = h
        self.context = cfg.att_context_size
        self.linear_q = nn.Linear(d, d, bias=False)
        self.linear_k = nn.Linear(d, d, bias=False)
        self.linear_v = nn.Linear(d, d, bias=False)
        self.linear_out = nn.Linear(d, d, bias=False)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = mx.zeros((h, d // h))
        self.pos_bias_v = mx.zeros((h, d // h))
        self._qkv = None  # q, k and v as one layer (`stack()`); not in the key tree

    def stack(self) -> None:
        """Run q, k and v as one projection (one matmul instead of three; each output row is
        computed as before)."""
        self._qkv = stack_linears([self.linear_q, self.linear_k, self.linear_v])

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self._qkv is None:
            return project(self.linear_q, x), project(self.linear_k, x), project(self.linear_v, x)
        d = x.shape[-1]
        return tuple(mx.split(project(self._qkv, x), [d, 2 * d], axis=-1))

    def project_positions(self, pos_emb: mx.array) -> mx.array:
        """Table rows `[P, d]` -> this layer's position keys `[heads, P, d / heads]`."""
        d = pos_emb.shape[-1]
        return self.linear_pos(pos_emb).reshape(pos_emb.shape[0], self.n_heads, d // self.n_heads).transpose(1, 0, 2)

    def __call__(self, x: mx.array, batch: int, pos_emb: mx.array | None, pos_first: int = 0,
                 cache: "EncoderLayerCache | None" = None, positions: mx.array | None = None,
                 key_start: mx.array | None = None) -> mx.array:
        """`x [batch * T, d]`: the frames as rows, each sequence's T in turn (`ConformerBlock.rows`).
        `pos_emb`: rows `[pos_first, pos_first + P)` of the relative-position table (all 2L - 1 or
        the context's window): only those rows go through `linear_pos`, unless `positions` gives
        them projected (`project_positions`). With `cache`, `x` continues a stream: its frames
        attend to the cached keys and values of the frames before them too (the table is then that
        of the cached + new length), and the cache keeps the last `left`; `key_start [batch]`: where
        each sequence's frames begin among the cached + new keys (`rel_pos_attention`)."""
        rows, d = x.shape
        b, length, h = batch, rows // batch, self.n_heads
        heads = lambda y: y.reshape(b, length, h, d // h).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = (heads(y) for y in self.project(x))
        p = self.project_positions(pos_emb) if positions is None else positions
        left, right = self.context
        if cache is not None:
            # The new frames' queries attend to the cached keys and values too; the kernel computes
            # each query row on its own, so they get the whole-signal values.
            k = mx.concatenate([cache.keys, k], axis=2)
            v = mx.concatenate([cache.values, v], axis=2)
            keep = max(0, k.shape[2] - left)
            cache.keys, cache.values = k[:, :, keep:], v[:, :, keep:]
        out = rel_pos_attention(q, k, v, p, self.pos_bias_u, self.pos_bias_v, (d // h) ** -0.5, left, right,
                                pos_first, key_start)
        return project(self.linear_out, out.transpose(0, 2, 1, 3).reshape(rows, d))


def depthwise_taps(weight: mx.array) -> list[mx.array]:
    """A depthwise Conv1d's weight `[C, k, 1]` as its k taps `[C]`."""
    return [weight[:, j, 0] for j in range(weight.shape[1])]


def _causal_depthwise(padded: mx.array, taps: list[mx.array]) -> mx.array:
    """Depthwise conv of `padded [B, k - 1 + T, C]` with `taps` (`depthwise_taps`; no bias): the T
    frames after the first k - 1, as k shifted multiply-adds (one fused launch under `mx.compile`)."""
    k = len(taps)
    t = padded.shape[1] - (k - 1)
    y = padded[:, 0:t] * taps[0]
    for j in range(1, k):
        y = y + padded[:, j : j + t] * taps[j]
    return y


_causal_depthwise_compiled = mx.compile(_causal_depthwise)


class ConvModule(nn.Module):
    """Pointwise -> GLU -> causal depthwise (left pad k - 1) -> LayerNorm ("batch_norm") -> SiLU -> pointwise.

    The convolutions run as what they are, matmuls and shifted multiply-adds: on a GPU a chunk of
    one frame then costs two matmuls and one fused kernel instead of three convolution calls."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, k = cfg.d_model, cfg.conv_kernel_size
        self.kernel_size = k
        self.pointwise_conv1 = nn.Conv1d(d, 2 * d, 1, bias=False)
        self.depthwise_conv = nn.Conv1d(d, d, k, groups=d, bias=False)
        self.batch_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.pointwise_conv2 = nn.Conv1d(d, d, 1, bias=False)

    def __call__(self, x: mx.array, batch: int, cache: "EncoderLayerCache | None" = None) -> mx.array:
        """`x [batch * T, d]`: the frames as rows (`ConformerBlock.rows`). With `cache`, the
        depthwise conv's left context is the cached last `k - 1` inputs (zeros at a stream's start,
        as the whole-signal pass pads) instead of zeros, and is updated."""
        rows, d = x.shape
        x = nn.glu(project(self.pointwise_conv1, x), axis=-1).reshape(batch, rows // batch, d)
        if cache is None:
            x = mx.pad(x, [(0, 0), (self.kernel_size - 1, 0), (0, 0)])
        else:
            x = mx.concatenate([cache.conv, x], axis=1)
            cache.conv = x[:, x.shape[1] - (self.kernel_size - 1) :]
        x = _causal_depthwise_compiled(x, self.taps()).reshape(rows, d)
        return project(self.pointwise_conv2, nn.silu(self.batch_norm(x)))

    def hold_taps(self) -> None:
        """Keep the depthwise taps as evaluated views (`ConformerEncoder.prepare`)."""
        w = self.depthwise_conv["weight"]
        hold(self, "_taps", (w,), depthwise_taps(w))

    def taps(self) -> list[mx.array]:
        """The depthwise taps: held views where kept (a compiled graph reads k leaves instead of
        replaying a Slice and a Squeeze for each tap at every call), else sliced here."""
        w = self.depthwise_conv["weight"]
        kept = held(self, "_taps", (w,))
        return depthwise_taps(w) if kept is None else kept


class ConformerBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.norm_feed_forward1 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.feed_forward1 = FeedForward(d, cfg.ff_expansion_factor)
        self.norm_self_att = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.self_attn = RelPositionAttention(cfg)
        self.norm_conv = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.conv = ConvModule(cfg)
        self.norm_feed_forward2 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.feed_forward2 = FeedForward(d, cfg.ff_expansion_factor)
        self.norm_out = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def __call__(self, x: mx.array, pos_emb: mx.array | None, pos_first: int = 0,
                 cache: "EncoderLayerCache | None" = None, positions: mx.array | None = None) -> mx.array:
        """`x [B, T, d]` -> `[B, T, d]` (`rows` on its frames)."""
        b, t, d = x.shape
        return self.rows(x.reshape(b * t, d), b, pos_emb, pos_first, cache, positions).reshape(b, t, d)

    def rows(self, x: mx.array, batch: int, pos_emb: mx.array | None, pos_first: int = 0,
             cache: "EncoderLayerCache | None" = None, positions: mx.array | None = None,
             key_start: mx.array | None = None) -> mx.array:
        """The block on `batch` sequences' frames as rows `[batch * T, d]`: each projection a matmul
        of x as it is (a `[B, T, d]` x adds a Flatten and an Unflatten around each one)."""
        # The residual adds stay elementwise ops, which a compiled graph fuses: mx.addmm (the add in
        # the matmul's epilogue) takes ~3 us more a call on a CUDA GPU at one row than matmul + add.
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), batch, pos_emb, pos_first, cache, positions, key_start)
        x = x + self.conv(self.norm_conv(x), batch, cache)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class ConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.context = cfg.att_context_size
        self.pre_encode = CausalSubsampling(cfg)
        self.layers = [ConformerBlock(cfg) for _ in range(cfg.n_layers)]
        self._stream_compiled = mx.compile(self._stream_layers)

    def __call__(self, mel: mx.array, stepwise: bool = False) -> mx.array:
        """`[B, T, feat]` -> `[B, T', d_model]` (xscaling off: the input is not scaled).

        `stepwise`: evaluate after the subsampling and after each layer. Queued as one graph, a
        long input's every intermediate stays alive on CUDA until its launch completes (MLX keeps
        a launch's inputs until then), and the host queues the whole encoder long before the GPU
        has run it; one layer at a time bounds that at the cost of a wait per layer."""
        x = self.pre_encode(mel)
        b, t, d = x.shape
        first, pos_emb = self.position_rows(t)
        x = x.reshape(b * t, d)
        if stepwise:
            mx.eval(x, pos_emb)
        for layer in self.layers:
            x = layer.rows(x, b, pos_emb, first)
            if stepwise:
                mx.eval(x)
        return x.reshape(b, t, d)

    def prepare(self) -> None:
        """The arrays the layers derive from their weights, made once and kept (again after the
        weights change dtype): every attention's q, k and v as one projection
        (`RelPositionAttention.stack`), each projection's transposed weight and each depthwise
        conv's taps as evaluated views. The stream's compiled layers are made again: a trace holds
        the weights it read as constants."""
        self._stream_compiled = mx.compile(self._stream_layers)
        for layer in self.layers:
            attention = layer.self_attn
            attention.stack()
            for projection in (layer.feed_forward1.linear1, layer.feed_forward1.linear2, attention._qkv,
                               attention.linear_out, layer.conv.pointwise_conv1, layer.conv.pointwise_conv2,
                               layer.feed_forward2.linear1, layer.feed_forward2.linear2):
                hold_weight_t(projection)
            layer.conv.hold_taps()
        evaluate_held(*self.layers)

    def position_rows(self, length: int) -> tuple[int, mx.array]:
        """`(first, rows)`: only the table rows the attention context reads (71 for [70, 0]),
        whatever the length."""
        first, count = position_window(length, *self.context)
        return first, relative_positions(length, self.d_model, first, count)

    def stream_positions(self, length: int) -> tuple[int, list[mx.array]]:
        """`position_rows(length)` through every layer's `linear_pos`: `(first, [positions [heads,
        P, d / heads] per layer])`, what `stream` takes. They depend on the length and the weights
        only: made once a length, evaluated, and held for every stream until the weights change
        (a session's first chunk then projects no table); the last `KEPT_POSITION_LENGTHS` lengths
        are kept (chunks of one size repeat one length)."""
        sources = tuple(layer.self_attn.linear_pos.weight for layer in self.layers)
        name = f"{POSITIONS_KEY}{length}"
        kept = held(self, name, sources)
        if kept is None:
            first, pos_emb = self.position_rows(length)
            kept = (first, [mx.contiguous(layer.self_attn.project_positions(pos_emb)) for layer in self.layers])
            mx.eval(kept[1])
            lengths = [key for key in self if key.startswith(POSITIONS_KEY) and key != name]
            for key in lengths[: max(0, len(lengths) - KEPT_POSITION_LENGTHS + 1)]:  # (oldest first)
                del self[key]
            hold(self, name, sources, kept)
        return kept

    def stream(self, x: mx.array, caches: list["EncoderLayerCache"], key_start: mx.array) -> mx.array:
        """The layers on new subsampled frames `x [B, n, d_model]` of B streams, with `caches`
        (one per layer, `left` frames each, updated) and `key_start [B]` (int32: where each
        stream's frames begin among the cached + new keys; the keys before are the zeros a cache
        starts with); the position tables of `stream_positions(left + n)`.

        Every chunk of n frames has the same shapes, so the layers run as one compiled graph
        (`mx.compile`, traced once per B, n and thread), replayed instead of built op by op, its
        elementwise chains fused (on a CPU the fused code rounds as the separate ops do: tested)."""
        cached = caches[0].keys.shape[2]
        first, projected = self.stream_positions(cached + x.shape[1])
        x, state = self._stream_compiled(x, projected, first, key_start, [c.state for c in caches])
        for cache, (keys, values, conv) in zip(caches, state):
            cache.keys, cache.values, cache.conv = keys, values, conv
        return x

    def _stream_layers(self, x: mx.array, positions: list[mx.array], first: int, key_start: mx.array,
                       state: list[list[mx.array]]) -> tuple[mx.array, list[list[mx.array]]]:
        """`stream` as a function of arrays (what `mx.compile` traces): each layer's cache arrays
        in, the updated ones out. The layers update caches made here, not the caller's."""
        caches = [EncoderLayerCache(*arrays) for arrays in state]
        b, n, d = x.shape
        x = x.reshape(b * n, d)
        for layer, cache, projected in zip(self.layers, caches, positions):
            x = layer.rows(x, b, None, first, cache, projected, key_start)
        return x.reshape(b, n, d), [cache.state for cache in caches]


class Perception(nn.Module):
    """log-mel -> FastConformer -> projection; returns the LLM's audio channel and the RNNT input."""

    def __init__(self, audio_cfg: AudioConfig):
        super().__init__()
        self.config = audio_cfg
        self.preprocessor = Preprocessor(audio_cfg.preprocessor)
        self.encoder = ConformerEncoder(audio_cfg.encoder)
        self.proj = nn.Linear(audio_cfg.encoder.d_model, audio_cfg.output_dim)

    def log_mel(self, audio_16k: mx.array) -> mx.array:
        """Waveform `[N]` at 16 kHz -> `[1, T, features]` with the stored filterbank and window."""
        f = self.preprocessor.featurizer
        return log_mel(audio_16k, self.config.preprocessor, f.fb, f.window)

    def __call__(self, mel: mx.array, lengths: mx.array | None = None, stepwise: bool = False):
        """`mel [1, T, features]` -> `(projected [1, F, output_dim], lengths [1] int32, encoded [1, F, d_model])`.

        `lengths` (mel frames per batch row, default T) only sets the returned lengths: the encoder
        is causal, so frames past a row's length never change the frames before it. `stepwise`: see
        `ConformerEncoder`.
        """
        if mel.ndim != 3 or mel.shape[-1] != self.config.encoder.feat_in:
            raise ValueError(f"mel must be [B, T, {self.config.encoder.feat_in}], got {tuple(mel.shape)}")
        if lengths is None:
            lengths = mx.full((mel.shape[0],), mel.shape[1], dtype=mx.int32)
        projected, encoded = self.project(self.encoder(mel.astype(mx.float32), stepwise))
        return projected, subsampled_length(lengths.astype(mx.int32)), encoded

    def project(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Encoder frames -> `(projected [.., output_dim], encoded [.., d_model])`, both float32."""
        encoded = x.astype(mx.float32)
        return self.proj(encoded).astype(mx.float32), encoded


@dataclass
class SubsamplingState:
    """Per subsampling stage, its input frames (padded in frequency) from its next output's first
    tap on: two zero frames (the left pad) at a stream's start."""

    pending: list[mx.array]


@dataclass
class EncoderLayerCache:
    """A Conformer layer's state between chunks: the keys and values `[1, heads, <= left, head_dim]`
    of its last `left` frames and the last `k - 1` inputs `[1, k - 1, d_model]` of its depthwise conv."""

    keys: mx.array
    values: mx.array
    conv: mx.array

    @property
    def state(self) -> list[mx.array]:
        return [self.keys, self.values, self.conv]


class _BatchCaches(StackedRows):
    """The layer caches of the streams one `push_streams` batch ran, as that batch's rows, kept
    stacked between chunks (`StackedRows`)."""

    def __init__(self, members: list["PerceptionStream"], caches: list[EncoderLayerCache]):
        super().__init__(members)
        self.caches = caches

    def arrays(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.state]


class PerceptionStream:
    """`Perception` (log-mel, encoder, projection) of a 16 kHz signal given a chunk at a time:
    `push(samples)` returns what those samples completed, `finish()` the rest (the frames that
    need the signal's end). Concatenated, the outputs equal `perception(perception.log_mel(x))`
    (the same arithmetic on the same values, row by row). What it holds is bounded: under one
    mel frame's span of samples, three stage inputs of two frames each, and per layer `left`
    frames of keys and values (zeros before the first frames: the attention's key start skips
    them) and `k - 1` conv inputs.

    The attention must see no frame to its right (`att_context_size [left, 0]`) and a bounded past
    (`left >= 0`): the published model's [70, 0]."""

    def __init__(self, perception: Perception):
        cfg = perception.config
        left, right = cfg.encoder.att_context_size
        if right != 0 or left < 0:
            raise ConfigError(f"a live session needs att_context_size [left >= 0, 0]; this model has [{left}, {right}]")
        self.perception = perception
        f = perception.preprocessor.featurizer
        self.mel = StreamingLogMel(cfg.preprocessor, f.fb, f.window)
        enc = perception.encoder
        channels, heads = cfg.encoder.subsampling_conv_channels, cfg.encoder.n_heads
        width = cfg.encoder.feat_in + CausalSubsampling.LEFT + CausalSubsampling.RIGHT
        self.subsampling = SubsamplingState([])
        for i in range(CausalSubsampling.STAGES):
            self.subsampling.pending.append(mx.zeros((1, CausalSubsampling.LEFT, width, 1 if i == 0 else channels)))
            width = (width - 3) // 2 + 1 + CausalSubsampling.LEFT + CausalSubsampling.RIGHT
        d, k = cfg.encoder.d_model, cfg.encoder.conv_kernel_size
        self.left = left
        self._caches = [EncoderLayerCache(mx.zeros((1, heads, left, d // heads)), mx.zeros((1, heads, left, d // heads)),
                                          mx.zeros((1, k - 1, d))) for _ in enc.layers]
        self._batch: _BatchCaches | None = None  # where the caches are while they are a batch's rows
        self.frames = 0  # encoder frames returned so far

    @property
    def caches(self) -> list[EncoderLayerCache]:
        """Each layer's cache, this stream's own (taken out of the batch that holds them, if one does)."""
        if self._batch is not None:
            row = self._batch.row_of(self)
            self._caches = [EncoderLayerCache(*(a[row : row + 1] for a in c.state)) for c in self._batch.caches]
            self._batch = None
        return self._caches

    @property
    def state(self) -> list[mx.array]:
        """Every array carried between chunks (to evaluate after a chunk; a batch's rows whole)."""
        caches = self._batch.arrays() if self._batch is not None else [a for c in self._caches for a in c.state]
        return self.subsampling.pending + caches

    @property
    def state_nbytes(self) -> int:
        """The bytes this stream holds between chunks (its share of a batch's rows)."""
        pending = sum(int(a.nbytes) for a in self.subsampling.pending)
        if self._batch is not None:
            return pending + sum(int(a.nbytes) for a in self._batch.arrays()) // len(self._batch.members)
        return pending + sum(int(a.nbytes) for c in self._caches for a in c.state)

    def push(self, samples: np.ndarray) -> tuple[mx.array, mx.array]:
        """16 kHz mono float32 samples -> `(projected [1, k, output_dim], encoded [1, k, d_model])`
        of the k >= 0 encoder frames they completed (lazy)."""
        return self._encode(self.mel.push(samples), end=False)

    def finish(self) -> tuple[mx.array, mx.array]:
        """The last encoder frames (the input has ended): `subsampled_length(1 + samples // 160)` in all."""
        return self._encode(self.mel.finish(), end=True)

    @property
    def key_start(self) -> int:
        """Where this stream's frames begin among its cached keys and a chunk's new ones: the
        cache's zeros before the first frames, until `left` frames have come."""
        return max(0, self.left - self.frames)

    def _subsampled(self, mel: mx.array, end: bool) -> mx.array:
        return self.perception.encoder.pre_encode.stream(mel.astype(mx.float32), self.subsampling, end)

    def _encode(self, mel: mx.array, end: bool) -> tuple[mx.array, mx.array]:
        return self._layers(self._subsampled(mel, end))

    def _layers(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Subsampled frames `x [1, n, d_model]` through the layers (caches updated) and the projection."""
        if x.shape[1] == 0:  # (as in `CausalSubsampling.stream`: no matmul of zero rows)
            return mx.zeros((1, 0, self.perception.proj.weight.shape[0]), mx.float32), x
        x = self.perception.encoder.stream(x, self.caches, mx.array([self.key_start], mx.int32))
        self.frames += x.shape[1]
        return self.perception.project(x)


def push_streams(streams: list[PerceptionStream], chunks: list[np.ndarray],
                 rows: Callable[[int], int] | None = None) -> tuple[list[tuple[mx.array, mx.array]], int]:
    """`streams[i].push(chunks[i])` for every stream (all of one `Perception`), with the layers and
    the projection of the streams whose chunks complete the same number of frames run as one
    batch, wherever each stream is (its key start in the batch's): their caches stacked (or, for
    the same streams in the same rows as the last batch, that batch's caches as they are), one
    compiled graph for all of them (the launches of one stream's chunk), each stream's output rows
    taken back and its caches left as the batch's rows (`PerceptionStream.caches` takes them out
    when it runs otherwise). Row by row it is each stream's own arithmetic (on a CPU, bit for bit:
    tested). `rows(m)`: the rows a batch of m streams runs as (>= m; the first stream's rows
    again fill the rest, their results unused), so that the compiled graph is traced for a few
    batch sizes, not every count. Returns the outputs and how many streams ran in a batch of two
    or more."""
    xs = _frontend_rows(streams, chunks)
    out: list[tuple[mx.array, mx.array] | None] = [None] * len(streams)
    groups: dict[int, list[int]] = {}
    for i, (stream, x) in enumerate(zip(streams, xs)):
        if x.shape[1]:
            groups.setdefault(x.shape[1], []).append(i)
        else:
            out[i] = stream._layers(x)
    together = 0
    for count, members in groups.items():
        if len(members) == 1:
            out[members[0]] = streams[members[0]]._layers(xs[members[0]])
            continue
        together += len(members)
        first = streams[members[0]]
        batch = padded(members, rows)
        order = [streams[i] for i in batch]
        held = first._batch
        if held is not None and held.holds(order):
            caches = held.caches  # the last batch's rows, as they are
        else:
            caches = [EncoderLayerCache(*(mx.concatenate([s.caches[layer].state[j] for s in order]) for j in range(3)))
                      for layer in range(len(first.perception.encoder.layers))]
        starts = mx.array([s.key_start for s in order], mx.int32)
        x = first.perception.encoder.stream(mx.concatenate([xs[i] for i in batch]), caches, starts)
        projected, encoded = first.perception.project(x)
        held = _BatchCaches(order, caches)
        for row, i in enumerate(members):
            stream = streams[i]
            stream._batch = held
            stream.frames += count
            out[i] = (projected[row : row + 1], encoded[row : row + 1])
    return out, together


def _frontend_rows(streams: list[PerceptionStream], chunks: list[np.ndarray]) -> list[mx.array]:
    """Each stream's chunk through the log-mel and the subsampling (`_subsampled(mel.push(chunk))`),
    the streams at the same point (spans of one length, stage inputs of one shape: a server's
    sessions fed 80 ms at a time) as one batch, each row its own arithmetic. Returns each
    stream's subsampled frames `[1, n, d_model]` (lazy); their subsampling states move on."""
    spans = [stream.mel.take(chunk) for stream, chunk in zip(streams, chunks)]
    groups: dict[tuple, list[int]] = {}
    for i, (stream, span) in enumerate(zip(streams, spans)):
        key = (0 if span is None else span.size, *(p.shape for p in stream.subsampling.pending))
        groups.setdefault(key, []).append(i)
    xs: list[mx.array | None] = [None] * len(streams)
    for (length, *_), members in groups.items():
        first = streams[members[0]]
        if length == 0 or len(members) == 1:
            for i in members:
                xs[i] = streams[i]._subsampled(streams[i].mel.frames_of_span(spans[i]), False)
            continue
        mel = first.mel.frames_of(np.stack([spans[i] for i in members]))
        state = SubsamplingState([mx.concatenate([streams[i].subsampling.pending[k] for i in members])
                                  for k in range(CausalSubsampling.STAGES)])
        x = first.perception.encoder.pre_encode.stream(mel, state)
        for row, i in enumerate(members):
            streams[i].subsampling.pending = [p[row : row + 1] for p in state.pending]
            xs[i] = x[row : row + 1]
    return xs
