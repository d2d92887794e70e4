"""Audio in and out: read any format soundfile reads, mix to mono, resample (soxr), write PCM16 WAV."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .files import atomic_output


class AudioError(ValueError):
    """Audio that cannot be used; the message names the file and the problem."""


def _decode(source, name: str) -> tuple[np.ndarray, int]:
    """soundfile's read of a path or a seekable file object, its failure an AudioError naming `name`."""
    import soundfile as sf

    try:
        data, rate = sf.read(source, dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
        why = str(e).strip() or type(e).__name__
        if why.startswith("Error opening "):  # libsndfile's reason after its own name for the source
            why = why.rsplit(": ", 1)[-1]  # (a BytesIO's repr for stdin)
        raise AudioError(f"{name}: not a readable audio file ({why})") from None
    return data, int(rate)


def read_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Samples `[frames, channels]` float32 in [-1, 1] and the file's rate."""
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path}: no such file")
    if path.is_dir():
        raise AudioError(f"{path}: is a directory, not an audio file")
    return _decode(str(path), str(path))


def read_audio_bytes(data: bytes, name: str = "stdin") -> tuple[np.ndarray, int]:
    """`read_audio` for a whole file's bytes (a pipe's: soundfile needs to seek)."""
    import io

    if not data:
        raise AudioError(f"{name}: no bytes to read")
    return _decode(io.BytesIO(data), name)


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


def load_audio(source: str | os.PathLike | np.ndarray, rate: int, sample_rate: int | None = None) -> np.ndarray:
    """Mono float32 at `rate` from a file path or an array (`sample_rate` says the array's rate)."""
    if isinstance(source, (str, os.PathLike)):
        data, file_rate = read_audio(source)
        name = str(source)
        if sample_rate is not None and sample_rate != file_rate:
            raise AudioError(f"{name}: file is {file_rate} Hz but sample_rate={sample_rate} was given")
        sample_rate = file_rate
    else:
        data = np.asarray(source)
        name = "audio array"
        if sample_rate is None:
            raise AudioError("audio array: give its sample_rate")
        if data.ndim == 2 and data.shape[1] > data.shape[0]:  # torch's [channels, samples], say
            raise AudioError(f"audio array of shape {data.shape}: more channels than samples; give "
                             "[samples, channels] (transpose a [channels, samples] array) or mono [samples]")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float, np.integer, np.floating)) \
            or not np.isfinite(sample_rate) or sample_rate != int(sample_rate):
        raise AudioError(f"sample_rate must be a whole number of Hz, got {sample_rate!r}")
    sample_rate = int(sample_rate)
    data = check_samples(data, name)
    return resample(to_mono(data), sample_rate, rate)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """Mono PCM16 WAV as bytes (what write_wav writes), for a stream that cannot seek (a pipe)."""
    import io

    import soundfile as sf

    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(samples)):
        raise AudioError("refusing to write NaN or infinite samples")
    buffer = io.BytesIO()
    sf.write(buffer, np.clip(samples, -1.0, 1.0), rate, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


def write_wav(path: str | os.PathLike, samples: np.ndarray, rate: int) -> Path:
    """Write mono PCM16 WAV atomically: a temp file beside `path`, renamed once complete."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise AudioError(f"{path}: directory {parent} does not exist")
    try:
        data = wav_bytes(samples, rate)
    except AudioError as e:
        raise AudioError(f"{path}: {e}") from None
    with atomic_output(path, "wb") as f:
        f.write(data)
    return path
