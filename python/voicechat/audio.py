"""Audio in and out: read any format soundfile reads, mix to mono, resample (soxr), write PCM16 WAV.

An input is opened first (`open_audio`: the header's rate, length and channels, nothing decoded)
and read only once its length is known to fit: what it will cost is checked before it is spent."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .files import fspath, output_file

# Sample rates taken in: telephone-band recordings to studio rates. Outside, a rate is a broken
# header or a mistake (a 1 Hz header makes 16000 samples of each one in resampling).
MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 384_000
MAX_CHANNELS = 64  # a mixdown of more is a broken header, not a recording


class AudioError(ValueError):
    """Audio that cannot be used; the message names the file and the problem."""


def check_rate(rate, name: str = "audio", what: str = "sample rate") -> int:
    """`rate` as an int, a whole number of Hz within [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE]."""
    number = isinstance(rate, (int, float, np.integer, np.floating)) and not isinstance(rate, (bool, np.bool_))
    if not number or not np.isfinite(rate) or rate != int(rate):
        raise AudioError(f"{name}: {what} must be a whole number of Hz, got {rate!r}")
    rate = int(rate)
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioError(f"{name}: {what} {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
    return rate


def _soundfile_error(e: Exception, name: str) -> AudioError:
    why = str(e).strip() or type(e).__name__
    if why.startswith("Error opening "):  # libsndfile's reason after its own name for the source
        why = why.rsplit(": ", 1)[-1]  # (a BytesIO's repr for stdin)
    return AudioError(f"{name}: not a readable audio file ({why})")


@dataclass
class AudioInput:
    """An input opened but not read: its rate, length and channels, as its header says (or its
    array's shape). `read()` decodes it, no more frames than `frames`."""

    name: str
    rate: int
    frames: int
    channels: int
    _source: object = field(repr=False)  # the path as bytes, a BytesIO, or the array itself

    def samples_at(self, rate: int) -> int:
        """Samples once resampled to `rate` (soxr's count: the length times the ratio, rounded)."""
        return (self.frames * rate + self.rate // 2) // self.rate

    def read(self) -> np.ndarray:
        """Samples `[frames, channels]` float32 in [-1, 1], checked (`check_samples`)."""
        if isinstance(self._source, np.ndarray):
            return check_samples(self._source, self.name)
        import soundfile as sf

        if isinstance(self._source, io.BytesIO):
            self._source.seek(0)
        try:
            data, _ = sf.read(self._source, frames=self.frames, dtype="float32", always_2d=True)
        except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
            raise _soundfile_error(e, self.name) from None
        return check_samples(data, self.name)


def _open_sound(source, name: str) -> AudioInput:
    import soundfile as sf

    try:
        with sf.SoundFile(source) as f:  # the header only
            rate, frames, channels = f.samplerate, f.frames, f.channels
    except Exception as e:
        raise _soundfile_error(e, name) from None
    rate = check_rate(rate, name)
    if frames <= 0:
        raise AudioError(f"{name}: contains no samples")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{name}: {channels} channels (at most {MAX_CHANNELS} are mixed down)")
    return AudioInput(name, rate, int(frames), int(channels), source)


def open_audio_bytes(data: bytes, name: str = "stdin") -> AudioInput:
    """`open_audio` for a whole file's bytes (a pipe's: soundfile needs to seek)."""
    if not data:
        raise AudioError(f"{name}: no bytes to read")
    return _open_sound(io.BytesIO(bytes(data)), name)


def open_audio(source: str | bytes | os.PathLike | np.ndarray | AudioInput,
               sample_rate: int | None = None, name: str | None = None) -> AudioInput:
    """Open a file (a str, bytes or path-like path, as `open` takes) or an array (`sample_rate`
    says its rate; float samples, or int16 / int32 / uint8 PCM; `[samples]` or
    `[samples, channels]`) without decoding anything. An `AudioInput` is returned as it is."""
    if isinstance(source, AudioInput):
        if sample_rate is not None and check_rate(sample_rate, source.name, "sample_rate") != source.rate:
            raise AudioError(f"{source.name}: is {source.rate} Hz but sample_rate={sample_rate} was given")
        return source
    if isinstance(source, (str, bytes, os.PathLike)):
        path = fspath(source)
        name = name or path
        if not os.path.exists(path):
            raise AudioError(f"{name}: no such file")
        if os.path.isdir(path):
            raise AudioError(f"{name}: is a directory, not an audio file")
        # soundfile encodes a str path strictly: bytes keep a non-UTF-8 name's own bytes
        opened = _open_sound(os.fsencode(path), name)
        if sample_rate is not None and check_rate(sample_rate, name, "sample_rate") != opened.rate:
            raise AudioError(f"{name}: file is {opened.rate} Hz but sample_rate={sample_rate} was given")
        return opened
    name = name or "audio array"
    if not isinstance(source, np.ndarray):
        raise AudioError(f"{name}: expected a file path or a numpy array, got "
                         f"{type(source).__name__}")
    if sample_rate is None:
        raise AudioError(f"{name}: give its sample_rate")
    rate = check_rate(sample_rate, name, "sample_rate")
    if source.ndim not in (1, 2):
        raise AudioError(f"{name}: must be [samples] or [samples, channels], got shape {source.shape}")
    if source.ndim == 2 and source.shape[1] > source.shape[0]:  # torch's [channels, samples], say
        raise AudioError(f"{name} of shape {source.shape}: more channels than samples; give "
                         "[samples, channels] (transpose a [channels, samples] array) or mono [samples]")
    channels = source.shape[1] if source.ndim == 2 else 1
    if source.size == 0:
        raise AudioError(f"{name}: contains no samples")
    if channels > MAX_CHANNELS:
        raise AudioError(f"{name}: {channels} channels (at most {MAX_CHANNELS} are mixed down)")
    return AudioInput(name, rate, int(source.shape[0]), int(channels), source)


def read_audio(path: str | bytes | os.PathLike) -> tuple[np.ndarray, int]:
    """Samples `[frames, channels]` float32 in [-1, 1] and the file's rate."""
    opened = open_audio(path)
    return opened.read(), opened.rate


def read_audio_bytes(data: bytes, name: str = "stdin") -> tuple[np.ndarray, int]:
    """`read_audio` for a whole file's bytes (a pipe's: soundfile needs to seek)."""
    opened = open_audio_bytes(data, name)
    return opened.read(), opened.rate


def to_mono(samples: np.ndarray) -> np.ndarray:
    """Average the channels of `[frames, channels]` (a 1-D input is already mono)."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        return samples
    if samples.ndim != 2:
        raise AudioError(f"audio must be [frames] or [frames, channels], got shape {samples.shape}")
    return samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Mono float32 at `rate_out` (soxr, high quality); unchanged when the rates agree."""
    if rate_in <= 0:
        raise AudioError(f"sample rate must be positive, got {rate_in}")
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if rate_in == rate_out:
        return samples
    import soxr

    return soxr.resample(samples, rate_in, rate_out, quality="HQ").astype(np.float32, copy=False)


# Integer PCM as soundfile reads it into floats: full scale is 1.0 (uint8 is offset by 128).
_PCM_SCALE = {np.dtype(np.int16): 2.0**15, np.dtype(np.int32): 2.0**31, np.dtype(np.uint8): 2.0**7}


def check_samples(samples: np.ndarray, name: str = "audio") -> np.ndarray:
    """Float samples, finite and not empty; integer PCM (int16, int32, uint8: what
    `scipy.io.wavfile` and sound cards give) scaled to [-1, 1) as soundfile scales it."""
    samples = np.asarray(samples)
    if samples.size == 0:
        raise AudioError(f"{name}: contains no samples")
    if samples.dtype in _PCM_SCALE:
        offset = 128.0 if samples.dtype == np.uint8 else 0.0
        return ((samples.astype(np.float64) - offset) / _PCM_SCALE[samples.dtype]).astype(np.float32)
    if not np.issubdtype(samples.dtype, np.floating):
        raise AudioError(f"{name}: expected float samples in [-1, 1] or int16 / int32 / uint8 PCM, "
                         f"got {samples.dtype}")
    if not np.all(np.isfinite(samples)):
        raise AudioError(f"{name}: contains NaN or infinite samples")
    return samples


def load_audio(source: str | bytes | os.PathLike | np.ndarray | AudioInput, rate: int,
               sample_rate: int | None = None, *, pad: int = 0, min_samples: int = 1,
               check: Callable[[int], None] | None = None) -> np.ndarray:
    """Mono float32 at `rate`, then `pad` samples of silence, from a file path, an array
    (`sample_rate` says its rate) or an opened `AudioInput`.

    Before anything is decoded, resampled or padded, the length it will have is computed from the
    header and the rates: under `min_samples` it is an AudioError naming the input, and `check`
    (given that length) may refuse it too (a context that it would not fit)."""
    opened = open_audio(source, sample_rate)
    total = opened.samples_at(rate) + pad
    if total < min_samples:
        raise AudioError(f"{opened.name}: audio is too short ({total} samples at {rate} Hz, "
                         f"{min_samples} at least)")
    if check is not None:
        check(total)
    wave = resample(to_mono(opened.read()), opened.rate, rate)
    if pad:
        wave = np.concatenate([wave, np.zeros(pad, dtype=np.float32)])
    return wave


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """Mono PCM16 WAV as bytes (what write_wav writes), for a stream that cannot seek (a pipe)."""
    import soundfile as sf

    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(samples)):
        raise AudioError("refusing to write NaN or infinite samples")
    buffer = io.BytesIO()
    sf.write(buffer, np.clip(samples, -1.0, 1.0), rate, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


def write_wav(path: str | bytes | os.PathLike, samples: np.ndarray, rate: int) -> Path:
    """Write mono PCM16 WAV: whole or not at all to a regular file, directly to a device or FIFO
    (`files.output_file`)."""
    name = fspath(path)
    parent = Path(os.path.realpath(name)).parent
    if not parent.is_dir():
        raise AudioError(f"{name}: directory {parent} does not exist")
    try:
        data = wav_bytes(samples, rate)
    except AudioError as e:
        raise AudioError(f"{name}: {e}") from None
    with output_file(name, "wb") as f:
        f.write(data)
    return Path(name)
