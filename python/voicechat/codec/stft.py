"""The codec's short-time Fourier transform: n_fft 16, hop 4, periodic Hann, center=False.

Analysis (`stft`): zero-pad the waveform by (n_fft - hop) / 2 = 6 samples on each side, cut
frames of 16 every 4 samples, window, real DFT -> 9 bins; the features are the real parts then
the imaginary parts, 18 channels. N samples give N // hop frames.

Synthesis (`istft`): inverse real DFT per frame (the imaginary parts of the DC and Nyquist bins
are ignored, as every irfft does), clip each frame sample to +-window, multiply by the window,
overlap-add, divide by max(sum of window^2, 1e-10), drop 6 samples at each end. F frames give
F * hop samples.

The fast paths cut frames with reshapes (hop divides n_fft) and transform with one matmul by a
DFT basis (window folded in): a few ops on every backend. The `_reference` functions follow the
formulas literally with mx.fft and an explicit overlap-add loop. `StreamingISTFT` is `istft` of
frames given a few at a time: an output sample is final once no later frame overlaps it.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np


def periodic_hann(n_fft: int) -> np.ndarray:
    """Hann window with denominator n_fft (torch.hann_window's default), float32."""
    n = np.arange(n_fft, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * math.pi * n / n_fft)).astype(np.float32)


def padding(n_fft: int, hop: int) -> tuple[int, int]:
    """Zeros added before and after the waveform (6, 6 for n_fft 16, hop 4)."""
    left = (n_fft - hop) // 2
    return left, n_fft - hop - left


def _check(n_fft: int, hop: int) -> None:
    if n_fft % hop or n_fft % 2:
        raise ValueError(f"n_fft {n_fft} must be even and a multiple of hop {hop}")


@lru_cache(maxsize=8)
def _bases(n_fft: int) -> tuple[mx.array, mx.array, mx.array]:
    """Window, windowed forward basis [n_fft, 2 * bins] and inverse basis [2 * bins, n_fft]."""
    bins = n_fft // 2 + 1
    window = periodic_hann(n_fft).astype(np.float64)
    angle = 2.0 * math.pi * np.outer(np.arange(n_fft), np.arange(bins)) / n_fft  # [n, b]
    forward = np.concatenate([np.cos(angle), -np.sin(angle)], axis=1) * window[:, None]
    # irfft: x[n] = (X_0 + (-1)^n X_{n/2} + 2 sum_b Re X_b cos - Im X_b sin) / n_fft.
    weight = np.full(bins, 2.0)
    weight[0] = weight[-1] = 1.0
    inverse = np.concatenate([np.cos(angle).T * weight[:, None], -np.sin(angle).T * weight[:, None]], axis=0) / n_fft
    inverse[bins] = inverse[2 * bins - 1] = 0.0  # imaginary parts of DC and Nyquist do not exist
    as_mx = lambda a: mx.array(a.astype(np.float32))
    return as_mx(window), as_mx(forward), as_mx(inverse)


@lru_cache(maxsize=16)
def _envelope(frames: int, n_fft: int, hop: int) -> mx.array:
    """max(sum of window^2 over the overlapping frames, 1e-10), trimmed like the waveform."""
    window = periodic_hann(n_fft)
    total = np.zeros((frames - 1) * hop + n_fft, dtype=np.float32)
    for f in range(frames):
        total[f * hop : f * hop + n_fft] += window * window
    left, right = padding(n_fft, hop)
    return mx.array(np.maximum(total[left : total.shape[0] - right], np.float32(1e-10)))


def num_frames(num_samples: int, hop: int = 4) -> int:
    """STFT frames of `num_samples` samples: (N + n_fft - hop - n_fft) // hop + 1 = N // hop."""
    return num_samples // hop


def stft(wave: mx.array, n_fft: int = 16, hop: int = 4) -> mx.array:
    """`wave` [B, N] -> features [B, N // hop, n_fft + 2] float32 (real parts, then imaginary)."""
    _check(n_fft, hop)
    batch, n = wave.shape
    frames = num_frames(n, hop)
    if frames < 1:
        raise ValueError(f"a waveform of {n} samples is shorter than one hop ({hop})")
    _, forward, _ = _bases(n_fft)
    left, _ = padding(n_fft, hop)
    per_frame = n_fft // hop
    # Exactly the samples the frames cover: (frames + per_frame - 1) hops of the padded signal.
    covered = (frames + per_frame - 1) * hop
    padded = mx.pad(wave.astype(mx.float32), ((0, 0), (left, covered - left - n)))[:, :covered]
    hops = padded.reshape(batch, frames + per_frame - 1, hop)
    framed = mx.concatenate([hops[:, j : j + frames] for j in range(per_frame)], axis=-1)
    return framed @ forward


def istft(features: mx.array, n_fft: int = 16, hop: int = 4) -> mx.array:
    """Features [B, F, n_fft + 2] (real parts, then imaginary) -> waveform [B, F * hop] float32."""
    _check(n_fft, hop)
    _, frames, channels = features.shape
    if channels != n_fft + 2:
        raise ValueError(f"expected {n_fft + 2} STFT channels, got {channels}")
    window, _, inverse = _bases(n_fft)
    return _synthesize(features.astype(mx.float32), window, inverse, _envelope(frames, n_fft, hop), hop)


def windowed_frames(features, window, inverse):
    """Inverse DFT of each frame [B, F, n_fft], clipped to +-window, times the window."""
    framed = features @ inverse
    return mx.clip(framed, -window, window) * window


_windowed_frames_compiled = mx.compile(windowed_frames)


def windowed_frames_in_order(features, window, inverse):
    """`windowed_frames` with the inverse DFT as one multiply-add a basis row, in order (k = 0, 1,
    ...): elementwise, so a frame's samples are the same arithmetic in a batch of any size (a
    GPU picks a matmul's kernel by its row count). The streamed decoder's, whose batches of
    sessions give each one its samples alone."""
    framed = features[..., 0:1] * inverse[0]
    for k in range(1, inverse.shape[0]):
        framed = framed + features[..., k : k + 1] * inverse[k]
    return mx.clip(framed, -window, window) * window


@mx.compile
def _synthesize(features, window, inverse, envelope, hop: int):
    batch, frames, _ = features.shape
    n_fft = window.shape[0]
    framed = windowed_frames(features, window, inverse)  # [B, F, n_fft]
    per_frame = n_fft // hop
    # Overlap-add: the j-th hop of frame f lands on output hop f + j.
    out = None
    for j in range(per_frame):
        part = mx.pad(framed[..., j * hop : (j + 1) * hop], ((0, 0), (j, per_frame - 1 - j), (0, 0)))
        out = part if out is None else out + part
    left = (n_fft - hop) // 2
    out = out.reshape(batch, (frames + per_frame - 1) * hop)[:, left : left + frames * hop]
    return out / envelope


def envelope_at(positions: np.ndarray, frames: int | None, n_fft: int, hop: int) -> np.ndarray:
    """`_envelope`'s values at positions of the untrimmed overlap-add (`frames` frames in all; None:
    more than reach these positions): the window's squares of the frames covering each position,
    summed in frame order in float32 (as `_envelope` sums them), at least 1e-10."""
    w2 = periodic_hann(n_fft) * periodic_hann(n_fft)
    total = np.zeros(positions.shape, np.float32)
    for k in range(n_fft // hop - 1, -1, -1):  # the oldest frame first
        frame = positions // hop - k
        valid = (frame >= 0) if frames is None else (frame >= 0) & (frame < frames)
        total = np.where(valid, total + w2[positions % hop + k * hop], total)
    return np.maximum(total, np.float32(1e-10))


class StreamingISTFT:
    """`istft` of frames given a few at a time (batch rows kept apart): `push(features)` returns the
    samples no later frame overlaps, `finish()` the last `n_fft - hop - left` (6) that waited for a
    next frame. Concatenated, they are `istft` of every frame at once (float32 sums in the same
    order; the inverse DFT is the same matmul). Keeps the last `n_fft / hop - 1` windowed frames."""

    def __init__(self, n_fft: int = 16, hop: int = 4):
        _check(n_fft, hop)
        self.n_fft, self.hop, self.per_frame = n_fft, hop, n_fft // hop
        self.left, _ = padding(n_fft, hop)
        self._previous: np.ndarray | None = None  # [B, per_frame - 1, n_fft]: the last frames (zeros at the start)
        self.frames = 0

    def push(self, features: mx.array) -> np.ndarray:
        """Features [B, F, n_fft + 2] -> the samples `[B, F * hop]` that became final (F * hop - 6
        at the first call)."""
        return self.add(self.windowed(features))

    def windowed(self, features: mx.array) -> np.ndarray:
        """Features [B, F, n_fft + 2] -> their windowed inverse frames `[B, F, n_fft]` (row by row:
        one call may serve several streams' rows, each then `add`ed to its own stream)."""
        if features.shape[-1] != self.n_fft + 2:
            raise ValueError(f"expected {self.n_fft + 2} STFT channels, got {features.shape[-1]}")
        window, _, inverse = _bases(self.n_fft)
        return np.array(_windowed_frames_compiled(features.astype(mx.float32), window, inverse))

    def bases(self) -> tuple[mx.array, mx.array]:
        """`(window, inverse DFT)`: what `windowed_frames` takes besides the features."""
        window, _, inverse = _bases(self.n_fft)
        return window, inverse

    def add(self, framed: np.ndarray) -> np.ndarray:
        """`push` from frames `windowed` already made: the samples that became final."""
        return self._overlap_add(framed, end=False)

    def finish(self) -> np.ndarray:
        """The last samples, up to the end of the last frame (none if nothing was pushed)."""
        if self._previous is None:
            return np.zeros((0, 0), np.float32)
        return self._overlap_add(np.zeros((self._previous.shape[0], 0, self.n_fft), np.float32), end=True)

    def _overlap_add(self, framed: np.ndarray, end: bool) -> np.ndarray:
        batch, count, _ = framed.shape
        tail = self.per_frame - 1
        if self._previous is None:
            self._previous = np.zeros((batch, tail, self.n_fft), np.float32)
        parts = [self._previous, framed]
        if end:  # frames past the last add nothing
            parts.append(np.zeros((batch, tail, self.n_fft), np.float32))
        stack = np.concatenate(parts, axis=1)
        hops = count + (tail if end else 0)  # output hops now final: frame f's first hop is hop f
        out = stack[:, tail : tail + hops, : self.hop]
        for j in range(1, self.per_frame):  # hop h: frame h's hop 0, then frame h - 1's hop 1, ...
            out = out + stack[:, tail - j : tail - j + hops, j * self.hop : (j + 1) * self.hop]
        first = self.frames * self.hop
        positions = first + np.arange(hops * self.hop)
        total = self.frames + count if end else None
        samples = out.reshape(batch, -1) / envelope_at(positions, total, self.n_fft, self.hop)
        keep = positions >= self.left
        if end:
            keep &= positions < self.left + total * self.hop
        self._previous = np.concatenate([self._previous, framed], axis=1)[:, -tail:]
        self.frames += count
        return samples[:, keep]


# --------------------------------------------------------------------------- references

def stft_reference(wave: mx.array, n_fft: int = 16, hop: int = 4) -> mx.array:
    """`stft` by the formula: pad, strided frames, window, mx.fft.rfft, concat(real, imag)."""
    batch, n = wave.shape
    left, right = padding(n_fft, hop)
    padded = mx.pad(wave.astype(mx.float32), ((0, 0), (left, right)))
    frames = (padded.shape[1] - n_fft) // hop + 1
    framed = mx.as_strided(padded, (batch, frames, n_fft), (padded.shape[1], hop, 1))
    spec = mx.fft.rfft(framed * mx.array(periodic_hann(n_fft)), axis=-1)
    return mx.concatenate([mx.real(spec), mx.imag(spec)], axis=-1)


def istft_reference(features: mx.array, n_fft: int = 16, hop: int = 4) -> mx.array:
    """`istft` by the formula: irfft per frame, clip, window, overlap-add loop, normalize, trim."""
    batch, frames, _ = features.shape
    bins = n_fft // 2 + 1
    x = features.astype(mx.float32)
    framed = mx.fft.irfft(x[..., :bins] + 1j * x[..., bins:], n=n_fft, axis=-1)
    window = mx.array(periodic_hann(n_fft))
    framed = mx.clip(framed, -window, window) * window
    length = (frames - 1) * hop + n_fft
    out = mx.zeros((batch, length))
    envelope = mx.zeros((length,))
    for f in range(frames):
        out[:, f * hop : f * hop + n_fft] += framed[:, f]
        envelope[f * hop : f * hop + n_fft] += window * window
    left, right = padding(n_fft, hop)
    return (out / mx.maximum(envelope, 1e-10))[:, left : length - right]
