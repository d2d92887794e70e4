"""The audio codec (`tts_model.audio_codec.*`): 22.05 kHz waveform <-> 31 codes per 80 ms frame.

    encode: wave [B, N] -> STFT [B, N/4, 18] -> encoder -> latent [B, N/1764, 512] -> PRVQ -> codes
    decode: codes [B, 31, T] -> sum of means [B, T, 512] -> decoder -> [B, 441 T, 18]
            -> magnitude / phase -> iSTFT -> wave [B, 1764 T]

Lengths. The STFT pads 6 zeros on each side, so N samples give (N + 12 - 16) / 4 + 1 = N / 4
frames; the encoder's strided convolutions (kernel = stride = 7, 7, 9, no padding) divide that
by 441, so N = 1764 T samples give exactly T code frames (N must be a multiple of 1764). The
decoder's transposed convolutions (kernel = stride = 9, 7, 7) give 441 T STFT frames; the
overlap-add is (441 T - 1) * 4 + 16 = 1764 T + 12 samples long and loses 6 at each end: 1764 T.

Causality. Every ConvNeXt depthwise convolution is left-padded (k - 1 = 6 frames, no look-ahead)
and the (transposed) strided convolutions never mix code frames, so decoder STFT frame f depends
only on code frames <= f // 441. The iSTFT frame f covers output samples 4 f - 6 .. 4 f + 9, and
the periodic Hann window is 0 at its first tap, so code frame t + 1 first touches output sample
1764 (t + 1) - 5: the last 5 samples of each frame wait for the next one. An incremental decoder
keeps the 6-frame left context of every block (and the iSTFT overlap) between calls.

Memory. Decoding the whole answer at once holds ~18 MB of activations per code frame at full size
(the last stage runs 441 STFT frames a code frame through 4 x 384 channels): 6.6 GB for 30 s.
`decode` therefore runs fixed windows of `DECODE_CHUNK_FRAMES` code frames plus the history and
look-ahead above (`decode_context`: 3 frames back, 1 ahead for the published codec) and keeps each
window's own samples. Every window has the same length, so one set of compiled kernels serves
every input length.

Streaming. `DecoderStream` decodes code frames as they come, with per-layer caches instead of a
window of history: each ConvNeXt block keeps its last k - 1 input frames, the iSTFT the windowed
frames still overlapping future samples. A frame's samples are final when it is decoded except
the last 6 (the iSTFT's overlap with the next frame; the first frame has 6 fewer), which come with
the next frame or at `finish()`: the stream lags the whole decode by 6 samples (0.27 ms).

Weights are loaded strictly below `tts_model.audio_codec.`; the loader converts the published
torch layouts (Conv1d [out, in, k], ConvTranspose1d [in, out, k]) by module type. They stay in the
checkpoint's dtype (bf16 published): the codec computes in float32 and casts each weight as it
uses it (exact), so `generate` holds no float32 copy of its ~165M parameters (0.33 GB at full
size); the casts cost a pass over the weights per decode window. A live session decodes every
80 ms, where that pass would cost more than the frame: the first one makes the decoder's and the
quantizer's weights float32 for good (`VoiceChat._stream_in_float32`).
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from ..config import CodecConfig
from ..held import evaluate_held, held, hold
from ..stacked_rows import StackedRows, padded
from ..kernels import use_reference
from ..kernels.rvq import codebook_norms, rvq_search, rvq_search_reference
from .stft import StreamingISTFT, istft, istft_reference, stft, stft_reference, windowed_frames_in_order
from .stft import padding as stft_padding

MAX_MAGNITUDE = 100.0
LAYER_NORM_EPS = 1e-6
# Code frames of output per decode window: with the 4 of context, ~0.35 GB of activations at full size.
DECODE_CHUNK_FRAMES = 16


# --------------------------------------------------------------------------- layers

def _convnext_padded(padded, operands):
    """Causal ConvNeXt block on [B, k - 1 + T, C] (the k - 1 frames before the T it outputs first);
    the depthwise conv as k shifted multiply-adds. `operands`: `ConvNeXtBlock.operands()`."""
    taps, dw_b, ln_w, ln_b, w1_t, b1, w2_t, b2 = operands
    k = len(taps)
    t = padded.shape[1] - (k - 1)
    x = padded[:, k - 1 :]
    h = dw_b + padded[:, 0:t] * taps[0]
    for j in range(1, k):
        h = h + padded[:, j : j + t] * taps[j]
    h = mx.fast.layer_norm(h, ln_w, ln_b, LAYER_NORM_EPS)
    b, _, c = h.shape
    h = nn.gelu(each_row_matmul(h, w1_t) + b1)
    return x + (each_row_matmul(h.reshape(b, t, -1), w2_t) + b2).reshape(b, t, c)


def each_row_matmul(x: mx.array, matrix: mx.array) -> mx.array:
    """`x [B, T, C]` times `matrix [C, N]` as `[B * T, N]` (the frames as matmul rows: a [B, T, C]
    operand costs a Flatten and an Unflatten a matmul), one matmul for each of the B rows. A GPU
    picks a matmul's kernel by its row count, so B streams as one matmul would round otherwise
    than each stream alone; a row's own matmul is its alone arithmetic (a batch of sessions'
    codec frames gives each one its own samples bit for bit)."""
    b, t, c = x.shape
    if b == 1:
        return x.reshape(t, c) @ matrix
    return mx.concatenate([x[i] @ matrix for i in range(b)])


@mx.compile
def _convnext(x, operands):
    """`_convnext_padded` from the start of a signal: zeros before it."""
    return _convnext_padded(mx.pad(x, ((0, 0), (len(operands[0]) - 1, 0), (0, 0))), operands)


_convnext_continued = mx.compile(_convnext_padded)


class ConvNeXtBlock(nn.Module):
    """dwconv (depthwise k7, bias, causal) -> LayerNorm(1e-6) -> pwconv1 (C -> 4C) -> GELU(erf)
    -> pwconv2 (4C -> C) -> + input."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.dwconv = nn.Conv1d(channels, channels, kernel_size, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=LAYER_NORM_EPS)
        self.pwconv1 = nn.Conv1d(channels, 4 * channels, 1)
        self.pwconv2 = nn.Conv1d(4 * channels, channels, 1)

    def _sources(self) -> tuple[mx.array, ...]:
        return (self.dwconv.weight, self.dwconv.bias, self.norm.weight, self.norm.bias, self.pwconv1.weight,
                self.pwconv1.bias, self.pwconv2.weight, self.pwconv2.bias)

    @staticmethod
    def _derive(sources: tuple[mx.array, ...]) -> tuple:
        dw_w, dw_b, ln_w, ln_b, w1, b1, w2, b2 = (_f32(a) for a in sources)
        return ([dw_w[:, j, 0] for j in range(dw_w.shape[1])], dw_b, ln_w, ln_b, conv_matrix(w1), b1,
                conv_matrix(w2), b2)

    def operands(self) -> tuple:
        """The block's weights as `_convnext_padded` reads them, in float32: the depthwise conv's k
        taps `[C]` and its bias, the norm's weight and bias, each pointwise conv's transposed
        weight `[in, out]` and bias. The held views where `hold_operands` made them from the current
        weights; else made here, in the caller's graph (slices, transposes and casts)."""
        sources = self._sources()
        kept = held(self, "_operands", sources)
        return self._derive(sources) if kept is None else kept

    def hold_operands(self) -> None:
        """Keep `operands()` as views, where the weights are float32 (of a bfloat16 weight they would
        be float32 copies): a compiled graph then reads them as inputs instead of deriving them (a
        Slice and Squeeze a tap, a Reshape and Transpose a matrix) at every call."""
        sources = self._sources()
        if all(a.dtype == mx.float32 for a in sources):
            hold(self, "_operands", sources, self._derive(sources))

    def __call__(self, x: mx.array) -> mx.array:
        return _convnext(x, self.operands())

    def stream(self, x: mx.array, context: mx.array, operands: tuple) -> tuple[mx.array, mx.array]:
        """The block on frames `x` that continue a signal whose last k - 1 frames are `context`
        (zeros at its start): `(output, the context of the next call)`. `operands`: `operands()`."""
        padded = mx.concatenate([context, x], axis=1)
        return _convnext_continued(padded, operands), padded[:, padded.shape[1] - context.shape[1] :]

    def reference(self, x: mx.array) -> mx.array:
        k, channels = self.dwconv.weight.shape[1], self.dwconv.weight.shape[0]
        h = _conv(mx.pad(x, ((0, 0), (k - 1, 0), (0, 0))), self.dwconv, groups=channels)
        mean = h.mean(axis=-1, keepdims=True)
        var = mx.square(h - mean).mean(axis=-1, keepdims=True)
        h = (h - mean) * mx.rsqrt(var + LAYER_NORM_EPS) * _f32(self.norm.weight) + _f32(self.norm.bias)
        h = _conv(h, self.pwconv1)
        h = 0.5 * h * (1.0 + mx.erf(h / math.sqrt(2.0)))
        return x + _conv(h, self.pwconv2)


def _f32(a: mx.array) -> mx.array:
    """A weight as the float32 the codec computes in (exact; no copy when it already is)."""
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _conv(x: mx.array, layer: nn.Conv1d, stride: int = 1, groups: int = 1) -> mx.array:
    """`layer(x)` (unpadded) with its weights in float32: the references' convolution."""
    y = mx.conv1d(x, _f32(layer.weight), stride=stride, groups=groups)
    return y + _f32(layer.bias) if "bias" in layer else y


def conv_matrix(weight: mx.array) -> mx.array:
    """A kernel = stride conv's weight `[out, k, c]` as one matmul's right operand `[k * c, out]`
    (a transposed view; `_downsample`, and a pointwise conv, k = 1)."""
    return weight.reshape(weight.shape[0], -1).T


def transposed_conv_matrix(weight: mx.array) -> mx.array:
    """A kernel = stride transposed conv's weight `[out, k, c]` as one matmul's right operand
    `[c, out * k]`, column o * k + j (a transposed view; `_upsample`)."""
    out, k, c = weight.shape
    return weight.reshape(out * k, c).T


def _matrix(layer: nn.Module, weight: mx.array) -> mx.array:
    """A strided conv's or transposed conv's `weight` as its matmul's right operand."""
    return (transposed_conv_matrix if isinstance(layer, nn.ConvTranspose1d) else conv_matrix)(weight)


def _downsample(x: mx.array, matrix: mx.array, k: int) -> mx.array:
    """Conv1d with kernel = stride = k, no padding, no bias, as one matmul (`matrix`: `conv_matrix`
    of its float32 weight): [B, T, C] -> [B, T/k, out]."""
    b, t, c = x.shape
    return each_row_matmul(x.reshape(b, t // k, k * c), matrix).reshape(b, t // k, matrix.shape[1])


def _upsample(x: mx.array, matrix: mx.array, k: int) -> mx.array:
    """ConvTranspose1d with kernel = stride = k, no bias (`matrix`: `transposed_conv_matrix` of its
    float32 weight): each input frame becomes k output frames."""
    b, t, c = x.shape
    out = matrix.shape[1] // k
    y = each_row_matmul(x, matrix)  # [B * T, out * k], index o * k + j
    return y.reshape(b, t, out, k).transpose(0, 1, 3, 2).reshape(b, t * k, out)


def _stages(cfg: CodecConfig):
    chans = cfg.stage_channels
    outs = chans[1:] + [cfg.latent_dim]
    return list(zip(chans, cfg.downsample_rates, outs))


class AudioEncoder(nn.Module):
    """layers: 0 Conv1d(18 -> C0, k1); per stage 3 ConvNeXt blocks + Conv1d(C -> next, k = s = rate)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv1d(cfg.stft_channels, cfg.stage_channels[0], 1, bias=False)]
        for ch, rate, nxt in _stages(cfg):
            layers += [ConvNeXtBlock(ch, cfg.block_kernel_size) for _ in range(cfg.blocks_per_stage)]
            layers.append(nn.Conv1d(ch, nxt, rate, stride=rate, bias=False))
        self.layers = layers

    def __call__(self, x: mx.array) -> mx.array:
        """STFT features [B, F, 18] -> latent [B, F / prod(rates), latent_dim]."""
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                x = layer(x)
            else:
                x = _downsample(x, conv_matrix(_f32(layer.weight)), layer.weight.shape[1])
        return x

    def reference(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer.reference(x) if isinstance(layer, ConvNeXtBlock) else _conv(x, layer, stride=layer.weight.shape[1])
        return x


class AudioDecoder(nn.Module):
    """layers: per stage, deepest first, ConvTranspose1d(src -> C, k = s = rate) + 3 ConvNeXt
    blocks; last Conv1d(C0 -> 18, k1)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers: list[nn.Module] = []
        src = cfg.latent_dim
        for ch, rate, _ in reversed(_stages(cfg)):
            layers.append(nn.ConvTranspose1d(src, ch, rate, stride=rate, bias=False))
            layers += [ConvNeXtBlock(ch, cfg.block_kernel_size) for _ in range(cfg.blocks_per_stage)]
            src = ch
        layers.append(nn.Conv1d(src, cfg.stft_channels, 1, bias=False))
        self.layers = layers

    def __call__(self, x: mx.array, contexts: list[mx.array] | None = None, operands: list | None = None) -> mx.array:
        """Latent [B, T, latent_dim] -> decoder features [B, T * prod(rates), 18]. `contexts` (one
        per ConvNeXt block, see `ConvNeXtBlock.stream`): `x` continues a signal; updated in place.
        `operands`: `operands()`, where the caller has them."""
        operands = self.operands() if operands is None else operands
        blocks = 0
        for layer, operand in zip(self.layers, operands):
            if isinstance(layer, ConvNeXtBlock):
                if contexts is None:
                    x = _convnext(x, operand)
                else:
                    x, contexts[blocks] = layer.stream(x, contexts[blocks], operand)
                blocks += 1
            elif isinstance(layer, nn.ConvTranspose1d):
                x = _upsample(x, operand, layer.weight.shape[1])
            else:
                x = _downsample(x, operand, layer.weight.shape[1])
        return x

    def operands(self) -> list:
        """Each layer's weights as the decoder reads them, in float32: a block's `operands()`, an
        upsampling's `transposed_conv_matrix`, the last conv's `conv_matrix`. Held views where
        `hold_operands` made them from the current weights; else made in the caller's graph."""
        out = []
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                out.append(layer.operands())
                continue
            kept = held(layer, "_matrix", (layer.weight,))
            out.append(_matrix(layer, _f32(layer.weight)) if kept is None else kept)
        return out

    def hold_operands(self) -> None:
        """Keep every layer's operands as evaluated views where its weights are float32 (a live
        session's decoder, `VoiceChat._stream_in_float32`); a dtype change or reload leaves them
        unused until this runs again."""
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                layer.hold_operands()
            elif layer.weight.dtype == mx.float32:
                hold(layer, "_matrix", (layer.weight,), _matrix(layer, layer.weight))
        evaluate_held(self)

    def reference(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                x = layer.reference(x)
            elif isinstance(layer, nn.ConvTranspose1d):
                x = mx.conv_transpose1d(x, _f32(layer.weight), stride=layer.weight.shape[1])
            else:
                x = _conv(x, layer)
        return x


# --------------------------------------------------------------------------- quantizer

class _Variance(nn.Module):
    def __init__(self):
        super().__init__()
        self.variance = mx.array(1.0)


def check_codes(codes: mx.array, book: mx.array) -> None:
    """codes must be [B, Q', T] with Q' no more than `book`'s codebooks (ValueError)."""
    if codes.ndim != 3 or codes.shape[1] > book.shape[0]:
        raise ValueError(f"codes must be [batch, <= {book.shape[0]} codebooks, frames], got {codes.shape}")


def codewords_sum(book: mx.array, codes: mx.array) -> mx.array:
    """The sum of the codewords `codes [B, Q', T]` pick from the first Q' codebooks of `book [Q, K,
    D]`: latent [B, T, D]. Added in codebook order (q = 0, 1, ...) as elementwise adds, so every
    row's sum is the same arithmetic in a batch of any size (a reduction's kernel may split the
    sum otherwise by shape)."""
    q = mx.arange(codes.shape[1])[None, :, None]
    picked = book[q, codes.astype(mx.int32)]  # [B, Q', T, D]
    latent = picked[:, 0]
    for i in range(1, picked.shape[1]):
        latent = latent + picked[:, i]
    return latent


class PRVQ(nn.Module):
    """Residual quantizer over `num_quantizers` codebooks of means `mus_list.{q}` [K, latent_dim].

    encode: code[q] = nearest mean to the residual, residual -= that mean, q = 0 .. Q-1.
    decode: the sum of the selected means. `variance_list.{q}.variance` is loaded, never used.
    """

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.mus_list = [mx.zeros((cfg.codebook_size, cfg.latent_dim)) for _ in range(cfg.num_quantizers)]
        self.variance_list = [_Variance() for _ in range(cfg.num_quantizers)]

    def codebooks(self) -> tuple[mx.array, mx.array]:
        """The means stacked as float32 [Q, K, D] and their squared norms [Q, K].

        Built once per set of loaded means (`held.hold`, with the means as its sources): `mus_list`
        then holds views of the stack, so the means are stored once. Holding the arrays keeps their
        ids from being reused.
        """
        kept = held(self, "_codebooks", tuple(self.mus_list))
        if kept is None:
            book = mx.stack([m.astype(mx.float32) for m in self.mus_list])
            # range slices: views (an integer index is a gather, which evaluates to a copy)
            self.mus_list = [book[q : q + 1].reshape(book.shape[1:]) for q in range(book.shape[0])]
            kept = (book, codebook_norms(book))
            hold(self, "_codebooks", tuple(self.mus_list), kept)
        return kept

    def encode(self, latent: mx.array) -> mx.array:
        """latent [B, T, D] -> codes [B, Q, T] int32."""
        b, t, d = latent.shape
        book, norms = self.codebooks()
        codes, _ = rvq_search(latent.astype(mx.float32).reshape(b * t, d), book, 0, book.shape[0], norms)
        return codes.reshape(b, t, -1).transpose(0, 2, 1)

    def decode(self, codes: mx.array) -> mx.array:
        """codes [B, Q', T] (Q' <= Q: the first Q' codebooks) -> latent [B, T, D] float32."""
        book, _ = self.codebooks()
        check_codes(codes, book)
        return codewords_sum(book, codes)

    def decode_reference(self, codes: mx.array) -> mx.array:
        latent = mx.zeros((codes.shape[0], codes.shape[2], self.mus_list[0].shape[-1]))
        for q in range(codes.shape[1]):
            latent = latent + self.mus_list[q].astype(mx.float32)[codes[:, q]]
        return latent


# --------------------------------------------------------------------------- the codec

def decode_context(cfg: CodecConfig) -> tuple[int, int]:
    """(history, look-ahead) in code frames that decoding a run of frames exactly needs.

    Zero padding at a window's start reaches `blocks x (k - 1)` frames into every decoder stage,
    widened by each later upsampling; the iSTFT then needs 2 more STFT frames before a frame's
    first sample. At its end, a frame's last samples overlap the next code frame's first STFT
    frames (the 5-sample horizon above). For the published codec: (1026 + 2) / 441 -> 3 frames
    back, 1 ahead.
    """
    per_code = math.prod(cfg.downsample_rates)
    reach, rate = 0, 1  # reach in STFT frames; rate: a stage's frames per code frame
    for factor in reversed(cfg.downsample_rates):
        rate *= factor
        reach += cfg.blocks_per_stage * (cfg.block_kernel_size - 1) * (per_code // rate)
    left, _ = stft_padding(cfg.n_fft, cfg.hop_length)
    reach += (cfg.n_fft - 1 - left) // cfg.hop_length
    ahead = (left - 1) // cfg.hop_length + 1 if left else 0
    return -(-reach // per_code), -(-ahead // per_code)


def decode_windows(frames: int, chunk: int, history: int, ahead: int) -> list[tuple[int, int, int, int]]:
    """(window start, window end, keep start, keep end) in code frames, covering [0, frames).

    Every window has the same length `history + chunk + ahead` (or is the whole input when that is
    shorter). A window's start is clamped into the input: at 0 the zero padding is the true start;
    near the end a window reaches further back than it needs, which changes nothing.
    """
    size = history + chunk + ahead
    if frames <= size:
        return [(0, frames, 0, frames)]
    windows = []
    for start in range(0, frames, chunk):
        end = min(start + chunk, frames)
        lo = min(max(start - history, 0), frames - size)
        windows.append((lo, lo + size, start, end))
    return windows


@mx.compile
def _spectrum(features: mx.array) -> mx.array:
    """Decoder output [B, F, 2 * bins] (magnitude logits, phases) -> (real, imaginary) parts.

    magnitude = 100 exp(-softplus(ln 100 - m)) = 100 sigmoid(m - ln 100). The imaginary parts of
    the DC and Nyquist bins are dropped by `istft`'s inverse basis (they are forced to zero).
    """
    bins = features.shape[-1] // 2
    x = features.astype(mx.float32)
    magnitude = MAX_MAGNITUDE * mx.sigmoid(x[..., :bins] - math.log(MAX_MAGNITUDE))
    phase = x[..., bins:]
    return mx.concatenate([magnitude * mx.cos(phase), magnitude * mx.sin(phase)], axis=-1)


def _spectrum_reference(features: mx.array) -> mx.array:
    bins = features.shape[-1] // 2
    x = features.astype(mx.float32)
    magnitude = MAX_MAGNITUDE * mx.exp(-nn.softplus(-x[..., :bins] + math.log(MAX_MAGNITUDE)))
    phase = x[..., bins:]
    imag = magnitude * mx.sin(phase)
    keep = mx.array([0.0] + [1.0] * (bins - 2) + [0.0])
    return mx.concatenate([magnitude * mx.cos(phase), imag * keep], axis=-1)


class AudioCodec(nn.Module):
    """The codec network: `encoder`, `decoder`, `prvq` under `tts_model.audio_codec.`.

    Computes in float32 throughout (the checkpoint stores bf16; each weight is cast where it is
    used, unless a live session made the decoder's float32: `VoiceChat._stream_in_float32`). A
    bf16 network is not offered: its decoder phases (tens of radians) lose ~0.25 rad, a 14 % RMS
    waveform error on random weights.
    """

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.config = cfg
        self.encoder = AudioEncoder(cfg)
        self.decoder = AudioDecoder(cfg)
        self.prvq = PRVQ(cfg)

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    # ----------------------------------------------------------------------- encode

    def _check_wave(self, wave: mx.array) -> None:
        spf = self.samples_per_frame
        if wave.ndim != 2 or wave.shape[1] == 0 or wave.shape[1] % spf:
            raise ValueError(f"codec input must be [batch, samples] with samples a positive multiple "
                             f"of {spf} (one code frame), got shape {tuple(wave.shape)}")

    def encode_latent(self, wave: mx.array) -> mx.array:
        """wave [B, N] -> latent [B, N / 1764, latent_dim] float32."""
        self._check_wave(wave)
        if use_reference():
            return self.encode_latent_reference(wave)
        features = stft(wave, self.config.n_fft, self.config.hop_length)
        return self.encoder(features)

    def encode(self, wave: mx.array) -> mx.array:
        """wave [B, N] float (N a multiple of 1764) -> codes [B, num_quantizers, N / 1764] int32."""
        return self.prvq.encode(self.encode_latent(wave))

    # ----------------------------------------------------------------------- decode

    def decode_latent(self, latent: mx.array) -> mx.array:
        """latent [B, T, latent_dim] -> wave [B, T * 1764] float32."""
        if use_reference():
            return self.decode_latent_reference(latent)
        features = self.decoder(latent.astype(mx.float32))
        return istft(_spectrum(features), self.config.n_fft, self.config.hop_length)

    def decode(self, codes: mx.array, chunk_frames: int | None = DECODE_CHUNK_FRAMES) -> mx.array:
        """codes [B, Q, T] -> wave [B, T * 1764] float32.

        Decoded in windows of `chunk_frames` output frames plus their context (see the module
        docstring); `None` decodes everything in one pass. Both give the same samples, to float
        rounding. Each window's graph is built while the one before it runs, then that one is
        waited for and this one dispatched (`mx.async_eval`): one window's activations at a time
        (~0.36 GB at full size), the host's graph building still beside the device. (Without the wait
        the host queues every window at once, and on CUDA their buffers live until their kernels
        complete: several GB for a 30 s answer.)

        Every code must lie in [0, codebook_size): control codes are replaced by the caller
        (with the per-codebook silence codes) before decoding; nothing here syncs to check.
        """
        if use_reference():
            return self.decode_latent_reference(self.prvq.decode_reference(codes))
        latent = self.prvq.decode(codes)
        if chunk_frames is None:
            return self.decode_latent(latent)
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be a positive number of code frames, got {chunk_frames}")
        spf = self.samples_per_frame
        pieces = []
        for lo, hi, start, end in decode_windows(latent.shape[1], chunk_frames, *decode_context(self.config)):
            wave = self.decode_latent(latent[:, lo:hi])
            if pieces:
                mx.eval(pieces[-1])
            pieces.append(wave[:, (start - lo) * spf : (end - lo) * spf])
            mx.async_eval(pieces[-1])
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)

    # ----------------------------------------------------------------------- references

    def encode_latent_reference(self, wave: mx.array) -> mx.array:
        self._check_wave(wave)
        features = stft_reference(wave, self.config.n_fft, self.config.hop_length)
        return self.encoder.reference(features)

    def encode_reference(self, wave: mx.array) -> mx.array:
        latent = self.encode_latent_reference(wave)
        b, t, d = latent.shape
        book, norms = self.prvq.codebooks()
        codes, _ = rvq_search_reference(latent.reshape(b * t, d), book, 0, book.shape[0], norms)
        return codes.reshape(b, t, -1).transpose(0, 2, 1)

    def decode_latent_reference(self, latent: mx.array) -> mx.array:
        features = self.decoder.reference(latent.astype(mx.float32))
        return istft_reference(_spectrum_reference(features), self.config.n_fft, self.config.hop_length)

    def decode_reference(self, codes: mx.array) -> mx.array:
        return self.decode_latent_reference(self.prvq.decode_reference(codes))


class DecoderStream:
    """`AudioCodec.decode` of code frames given a few at a time, with per-layer caches (no window
    of history): `push(codes)` returns the samples that became final, `finish()` the last 6.
    Concatenated, they equal `decode` of every frame at once to float rounding (the same
    arithmetic on the same values; tested to 1e-5). Holds k - 1 frames per ConvNeXt block and
    3 iSTFT frames between calls."""

    def __init__(self, codec: AudioCodec, batch: int = 1):
        self.codec = codec
        cfg = codec.config
        self._contexts = [mx.zeros((batch, cfg.block_kernel_size - 1, layer.dwconv.weight.shape[0]), mx.float32)
                          for layer in codec.decoder.layers if isinstance(layer, ConvNeXtBlock)]
        self._batch: _BatchContexts | None = None  # where the contexts are while they are a batch's rows
        self.istft = StreamingISTFT(cfg.n_fft, cfg.hop_length)
        self.frames = 0

    @property
    def contexts(self) -> list[mx.array]:
        """Each ConvNeXt block's last k - 1 input frames, this stream's own (taken out of the batch
        that holds them, if one does)."""
        if self._batch is not None:
            row = self._batch.row_of(self)
            self._contexts = [c[row : row + 1] for c in self._batch.contexts]
            self._batch = None
        return self._contexts

    @contexts.setter
    def contexts(self, value: list[mx.array]) -> None:
        self._contexts, self._batch = value, None

    def push(self, codes: mx.array) -> np.ndarray:
        """codes [B, Q, T] (no control codes) -> the final samples `[B, n]` float32 (n = 1764 T,
        6 fewer for the first frame)."""
        framed = self.queue(codes)
        mx.eval(framed, self.contexts)
        return self.take(framed)

    def queue(self, codes: mx.array) -> mx.array:
        """`push` on the device only: the windowed inverse-STFT frames of `codes` (lazy; the block
        contexts move on lazily too), for `take` once evaluated. Several streams' frames queued
        before any is read back run back to back on the device."""
        framed, self.contexts = _stream_frames(self.codec, codes, self.contexts, self.istft)
        self.frames += codes.shape[2]
        return framed

    def take(self, framed: mx.array) -> np.ndarray:
        """The samples that `queue`'s frames made final (read back: `[B, n]`)."""
        return self.istft.add(np.array(framed))

    def finish(self) -> np.ndarray:
        """The samples that waited for a next frame: `[B, 6]` (none before the first frame)."""
        return self.istft.finish()


def _stream_graph(codec: AudioCodec, codes: mx.array, book: mx.array, contexts: list[mx.array], window: mx.array,
                  inverse: mx.array, operands: list) -> tuple[mx.array, list[mx.array]]:
    """Code frames continuing a stream -> their windowed inverse-STFT frames and the blocks' next
    contexts (what `_stream_frames` compiles)."""
    contexts = list(contexts)
    features = codec.decoder(codewords_sum(book, codes), contexts, operands)
    return windowed_frames_in_order(_spectrum(features), window, inverse), contexts


def _stream_frames(codec: AudioCodec, codes: mx.array, contexts: list[mx.array],
                   istft: StreamingISTFT) -> tuple[mx.array, list[mx.array]]:
    """A streamed decode step as one compiled graph (traced once per batch and frame count; the
    decoder's operands are inputs, taken anew at each call, so a cast or reload is seen): replayed,
    not built op by op, each frame. Returns the windowed frames and the new contexts, lazy."""
    book, _ = codec.prvq.codebooks()
    check_codes(codes, book)
    step = getattr(codec, "_stream_step", None)
    if step is None:
        step = mx.compile(lambda *args: _stream_graph(codec, *args))
        codec._stream_step = step
    window, inverse = istft.bases()
    framed, contexts = step(codes, book, contexts, window, inverse, codec.decoder.operands())
    return framed, contexts


class _BatchContexts(StackedRows):
    """The block contexts of the streams one `queue_streams` batch ran, as that batch's rows, kept
    stacked between frames (`StackedRows`)."""

    def __init__(self, members: list[DecoderStream], contexts: list[mx.array]):
        super().__init__(members)
        self.contexts = contexts


def push_streams(streams: list[DecoderStream], codes: mx.array,
                 rows: Callable[[int], int] | None = None) -> list[np.ndarray]:
    """`streams[i].push(codes[i : i + 1])` for every stream (batch 1 each, of one codec), run as one
    batch (`queue_streams`, then `take_streams`). Returns each stream's samples `[n]`."""
    framed, contexts = queue_streams(streams, codes, rows)
    mx.eval(framed, contexts)
    return take_streams(streams, framed)


def queue_streams(streams: list[DecoderStream], codes: mx.array,
                  rows: Callable[[int], int] | None = None) -> tuple[mx.array, list[mx.array]]:
    """The decoder on every stream's code frames `codes [len(streams), Q, T]` as one batch, lazy:
    their contexts stacked (or, for the same streams in the same rows as the last batch, that
    batch's contexts as they are) and left as the batch's rows (`DecoderStream.contexts` takes a
    stream's out when it runs otherwise). Row by row it is each stream's own arithmetic, bit for
    bit (`each_row_matmul`, `codewords_sum`, `windowed_frames_in_order`). `rows(m)`: the rows a
    batch of m streams runs as (>= m; the first stream's rows again fill the rest, their results
    unused), so that the compiled step is traced for a few batch sizes, not every count. Returns
    the windowed frames, for `take_streams` once evaluated, and the contexts (lazy: evaluate them
    with the frames)."""
    codec = streams[0].codec
    count = len(streams)
    order = padded(streams, rows)
    batch = streams[0]._batch
    if batch is not None and batch.holds(order):
        contexts = batch.contexts  # the last batch's rows, as they are
    else:
        contexts = [mx.concatenate([s.contexts[j] for s in order]) for j in range(len(streams[0].contexts))]
        batch = _BatchContexts(order, contexts)
    if len(order) > count:
        codes = mx.concatenate([codes, mx.broadcast_to(codes[:1], (len(order) - count, *codes.shape[1:]))])
    framed, batch.contexts = _stream_frames(codec, codes, contexts, streams[0].istft)
    for stream in streams:
        stream._batch = batch
        stream.frames += codes.shape[2]
    return framed, batch.contexts


def take_streams(streams: list[DecoderStream], framed: mx.array) -> list[np.ndarray]:
    """`queue_streams`' frames read back: each stream's final samples `[n]` (its overlap-add)."""
    framed = np.array(framed)
    return [stream.istft.add(framed[i : i + 1])[0] for i, stream in enumerate(streams)]
