"""The log-mel frontend: preemphasis, 25 ms Hann STFT every 10 ms, Slaney mel, natural log.

Exactly the checkpoint's featurizer (no dither, no normalization):
  x'[0] = x[0], x'[n] = x[n] - 0.97 x[n-1]
  reflect-pad 256 on both sides (the edge sample is not repeated), frames of 512 every 160,
  window = symmetric hann(400) zero-padded 56 + 56 to 512, |rfft|^2 over 257 bins,
  mel = fb[128, 257] @ power, log(mel + 2^-24).
Output `[1, T, 128]` with `T = 1 + len // 160`.

`StreamingLogMel` computes the same frames from samples given a chunk at a time: frame j covers
the padded samples [160 j, 160 j + 512), i.e. input samples up to 160 j + 255, so it is made as
soon as those exist; the last frames (within 256 samples of the end) need the reflection of the
true end and come at `finish()`.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..config import PreprocessorConfig


def hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3.0, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp)


def mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3.0, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Slaney-normalized triangular filters on the Slaney mel scale, `[n_mels, n_fft // 2 + 1]` float32.

    Rounded as the checkpoint's `featurizer.fb` was (librosa through NeMo): the triangles are
    stored in float32 first, then scaled by the float64 Slaney norm and rounded again. Rounding
    once instead differs by one ulp in ~150 of the 32896 entries.
    """
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    hz = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(hz)
    ramps = hz[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    norm = 2.0 / (hz[2:] - hz[:-2])
    return (weights * norm[:, None]).astype(np.float32)


def hann_window(length: int) -> np.ndarray:
    """Symmetric Hann window (denominator length - 1), float32."""
    n = np.arange(length, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * math.pi * n / (length - 1))).astype(np.float32)


def num_frames(num_samples: int, cfg: PreprocessorConfig) -> int:
    return 1 + num_samples // cfg.hop_length


def preemphasis(x: mx.array, coeff: float, previous: mx.array | None = None) -> mx.array:
    """`[x0, x1 - c x0, x2 - c x1, ...]`: the first sample is kept as is. `previous` (`[1]`): the
    sample before `x` when `x` continues a signal (then every sample is `x_n - c x_{n-1}`)."""
    if previous is None:
        return mx.concatenate([x[:1], x[1:] - coeff * x[:-1]])
    return x - coeff * mx.concatenate([previous, x[:-1]])


def preemphasis_host(x: np.ndarray, coeff: float, previous: np.ndarray | None = None) -> np.ndarray:
    """`preemphasis` of float32 samples on the host: the same float32 multiply, then subtract, so
    the same bits, without a round trip to the device (a live session's every chunk)."""
    before = x[:-1] if previous is None else np.concatenate([previous, x[:-1]])
    rest = (x[1:] if previous is None else x) - np.float32(coeff) * before
    return rest if previous is not None else np.concatenate([x[:1], rest])


def log_mel(
    audio: mx.array,
    cfg: PreprocessorConfig,
    filterbank: mx.array | None = None,
    window: mx.array | None = None,
) -> mx.array:
    """`audio` `[N]` float at `cfg.sample_rate` -> log-mel `[1, T, features]` float32.

    `filterbank` `[features, n_fft//2+1]` (or the checkpoint's `[1, features, bins]`) and `window`
    `[win_length]` default to the formula's own; the checkpoint stores the same values.
    """
    x = audio.astype(mx.float32).reshape(-1)
    n = x.shape[0]
    pad = cfg.n_fft // 2
    if n <= pad:
        raise ValueError(f"audio of {n} samples is too short for the {cfg.n_fft}-point frontend (need > {pad})")
    x = preemphasis(x, cfg.preemph)
    # Reflect without repeating the edge sample: x[pad:0:-1] ... x[-2:-pad-2:-1].
    x = mx.concatenate([x[1 : pad + 1][::-1], x, x[-pad - 1 : -1][::-1]])
    return _log_mel_frames(x, num_frames(n, cfg), cfg, *_frame_operands(cfg, filterbank, window))[None]


def _frame_operands(cfg: PreprocessorConfig, filterbank: mx.array | None,
                    window: mx.array | None) -> tuple[mx.array, mx.array]:
    """The filterbank `[features, bins]` and the window zero-padded to `n_fft`, float32, as
    `_log_mel_frames` reads them (defaults: the formula's own)."""
    if window is None:
        window = mx.array(hann_window(cfg.win_length))
    left = (cfg.n_fft - window.shape[0]) // 2
    window = mx.pad(window.astype(mx.float32), (left, cfg.n_fft - window.shape[0] - left))
    if filterbank is None:
        filterbank = mx.array(mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.features))
    return filterbank.astype(mx.float32).reshape(-1, cfg.n_fft // 2 + 1), window


def _log_mel_frames(padded: mx.array, frames: int, cfg: PreprocessorConfig, fb: mx.array,
                    window: mx.array) -> mx.array:
    """Log-mel `[frames, features]` of the frames starting every hop from `padded[0]` (the
    preemphasized, reflect-padded signal from some frame's first sample on); `fb` and `window`:
    `_frame_operands`."""
    strided = mx.as_strided(padded, shape=(frames, cfg.n_fft), strides=(cfg.hop_length, 1))
    return _log_mel_of(strided, cfg, fb, window)


def _log_mel_of(framed: mx.array, cfg: PreprocessorConfig, fb: mx.array, window: mx.array) -> mx.array:
    """Log-mel `[N, features]` of the frames `framed [N, n_fft]`, each row its own arithmetic."""
    spec = mx.fft.rfft(framed * window, axis=-1)
    power = mx.square(mx.real(spec)) + mx.square(mx.imag(spec))
    mel = power @ fb.T
    return mx.log(mel + cfg.log_zero_guard_value)


class StreamingLogMel:
    """`log_mel` of a signal given a chunk at a time: `push(samples)` returns the frames those
    samples completed, `finish()` the last ones (with the reflection of the true end). Stacked,
    they are `log_mel` of the whole signal, bit for bit (every frame is the same arithmetic on the
    same samples). Holds less than one frame's span of samples between calls (plus the chunk)."""

    def __init__(self, cfg: PreprocessorConfig, filterbank: mx.array | None = None, window: mx.array | None = None):
        self.cfg = cfg
        # Made once, not in every chunk's graph (a pad and a cast a chunk otherwise).
        self._operands = _frame_operands(cfg, filterbank, window)
        mx.eval(self._operands)
        self.pad = cfg.n_fft // 2
        self.samples = 0  # input samples so far
        self.frames = 0  # frames returned so far
        self._previous: np.ndarray | None = None  # the last input sample (preemphasis of the next chunk)
        self._head = np.zeros(0, np.float32)  # preemphasized samples while the left reflection is not known
        self._padded: np.ndarray | None = None  # the padded signal from frame `frames`' first sample on
        self._tail = np.zeros(0, np.float32)  # the last pad + 1 preemphasized samples (the right reflection)

    def push(self, samples: np.ndarray) -> mx.array:
        """Mono float32 samples -> the log-mel frames `[1, k, features]` they completed (k >= 0)."""
        return self.frames_of_span(self.take(samples))

    def take(self, samples: np.ndarray) -> np.ndarray | None:
        """`push` on the host: the samples held, and the padded span of the frames they completed
        (`[(k - 1) * hop + n_fft]`, None for none) for `frames_of`. Several streams' spans of one
        length make their frames in one batch."""
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if samples.size == 0:
            return None
        emphasized = preemphasis_host(samples, self.cfg.preemph, self._previous)
        self._previous = samples[-1:].copy()
        self.samples += samples.size
        self._tail = np.concatenate([self._tail, emphasized])[-(self.pad + 1):]
        if self._padded is None:
            self._head = np.concatenate([self._head, emphasized])
            if self._head.size <= self.pad:
                return None
            self._padded = np.concatenate([self._head[1 : self.pad + 1][::-1], self._head])
            self._head = np.zeros(0, np.float32)
        else:
            self._padded = np.concatenate([self._padded, emphasized])
        return self._span(self._available(self._padded.size))

    def frames_of(self, spans: np.ndarray) -> mx.array:
        """The log-mel frames `[B, k, features]` of `take`'s spans `[B, (k - 1) * hop + n_fft]`
        (of streams with this one's config and filterbank), each row its own arithmetic."""
        # The frames cut on the host: one matrix of every row's frames, the matmul's rows.
        framed = np.lib.stride_tricks.sliding_window_view(spans, self.cfg.n_fft, axis=1)[:, :: self.cfg.hop_length]
        rows, count = framed.shape[:2]
        mel = _log_mel_of(mx.array(framed.reshape(rows * count, -1)), self.cfg, *self._operands)
        return mel[None] if rows == 1 else mel.reshape(rows, count, -1)

    def finish(self) -> mx.array:
        """The frames that need the end of the signal: `1 + samples // hop` in all."""
        if self.samples <= self.pad:
            raise ValueError(f"audio of {self.samples} samples is too short for the {self.cfg.n_fft}-point "
                             f"frontend (need > {self.pad})")
        self._padded = np.concatenate([self._padded, self._tail[:-1][::-1]])
        span = self._span(num_frames(self.samples, self.cfg) - self.frames)
        self._padded = np.zeros(0, np.float32)
        return self.frames_of_span(span)

    def _available(self, length: int) -> int:
        """Whole frames in `length` padded samples from the next frame's first sample."""
        return max(0, (length - self.cfg.n_fft) // self.cfg.hop_length + 1)

    def _span(self, count: int) -> np.ndarray | None:
        """The padded samples of the next `count` frames (taken: the held samples move on)."""
        if count <= 0:
            return None
        hop = self.cfg.hop_length
        span = self._padded[: (count - 1) * hop + self.cfg.n_fft]
        self._padded = self._padded[count * hop :]
        self.frames += count
        return span

    def frames_of_span(self, span: np.ndarray | None) -> mx.array:
        """`frames_of` one stream's span `[1, k, features]` (none for None: `take` completed none)."""
        return self._empty() if span is None else self.frames_of(span[None])

    def _empty(self) -> mx.array:
        return mx.zeros((1, 0, self.cfg.features), mx.float32)
