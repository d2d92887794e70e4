import os
import subprocess

import numpy as np
import pytest
import soundfile as sf

from voicechat.audio import AudioError, load_audio, open_audio, read_audio, resample, to_mono, write_wav


def test_reads_espeak_wav_and_resamples(spoken_wav_22k, spoken_wav):
    data, rate = read_audio(spoken_wav_22k)
    assert rate == 22050 and data.shape[1] == 1
    ours = load_audio(spoken_wav_22k, 16000)
    assert ours.dtype == np.float32 and ours.ndim == 1
    assert abs(len(ours) - round(len(data) * 16000 / 22050)) <= 1
    sox, _ = read_audio(spoken_wav)
    n = min(len(ours), len(sox))
    # soxr and sox agree on the same resampling (different filters: close, not equal)
    corr = np.corrcoef(ours[:n], sox[:n, 0])[0, 1]
    assert corr > 0.99


def test_other_formats_and_stereo(tmp_path, spoken_wav):
    data, rate = read_audio(spoken_wav)
    flac = tmp_path / "q.flac"
    subprocess.run(["sox", str(spoken_wav), "-c", "2", "-r", "44100", str(flac)], check=True)
    stereo, r = read_audio(flac)
    assert r == 44100 and stereo.shape[1] == 2
    mono = load_audio(flac, 16000)
    assert abs(len(mono) - len(data)) <= 2
    assert to_mono(np.array([[1.0, 0.0], [0.5, 0.5]], dtype=np.float32)).tolist() == [0.5, 0.5]


def test_array_input_needs_its_rate():
    with pytest.raises(AudioError, match="sample_rate"):
        load_audio(np.zeros(100, np.float32), 16000)
    out = load_audio(np.zeros(8000, np.float32), 16000, sample_rate=8000)
    assert len(out) == 16000
    assert len(load_audio(np.zeros(8000, np.float32), 16000, sample_rate=np.int64(8000))) == 16000
    assert len(load_audio(np.zeros(8000, np.float32), 16000, sample_rate=8000.0)) == 16000
    for rate in ("8000", 8000.5, float("nan"), True):
        with pytest.raises(AudioError, match="sample_rate must be a whole number of Hz"):
            load_audio(np.zeros(8000, np.float32), 16000, sample_rate=rate)


def test_a_channels_first_array_is_refused_not_read_as_thousands_of_channels():
    """[channels, samples] (torch's layout) would average each sample's 'channels' into one: refused
    with the layout to give; [samples, channels] is read."""
    wave = np.sin(np.arange(8000, dtype=np.float32) / 7)
    for bad in (wave[None], np.stack([wave, wave])):
        with pytest.raises(AudioError, match="more channels than samples"):
            load_audio(bad, 16000, sample_rate=16000)
    np.testing.assert_array_equal(load_audio(np.stack([wave, wave], 1), 16000, sample_rate=16000), wave)


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_bytes(b"RIFF....WAVEfmt junk"), "not a readable audio file"),
    (lambda p: p.write_text("hello, not audio"), "not a readable audio file"),
    (lambda p: sf.write(str(p), np.zeros((0,), np.float32), 16000), "contains no samples"),
    (lambda p: sf.write(str(p), np.full(100, np.nan, np.float32), 16000, subtype="FLOAT"), "NaN"),
])
def test_bad_audio(tmp_path, make, needle):
    p = tmp_path / "bad.wav"
    make(p)
    with pytest.raises(AudioError, match=needle):
        load_audio(p, 16000)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(AudioError, match="no such file"):
        load_audio(tmp_path / "nope.wav", 16000)
    with pytest.raises(AudioError, match="is a directory"):
        load_audio(tmp_path, 16000)


@pytest.mark.parametrize("subtype,dtype", [("PCM_16", np.int16), ("PCM_32", np.int32), ("PCM_U8", np.uint8)])
def test_integer_pcm_arrays_are_the_floats_soundfile_reads(tmp_path, subtype, dtype):
    """An int16 / int32 / uint8 array (scipy.io.wavfile's, a sound card's) is scaled as soundfile
    scales the same file's samples into floats; other integer arrays are refused by name."""
    p = tmp_path / "pcm.wav"
    sf.write(str(p), (np.sin(np.arange(1600) / 5) * 0.7).astype(np.float32), 16000, subtype=subtype)
    ints, _ = sf.read(str(p), dtype="int16" if dtype == np.uint8 else dtype.__name__)
    if dtype == np.uint8:  # soundfile gives no uint8: the file's bytes are the PCM
        ints = (ints.astype(np.int32) // 256 + 128).astype(np.uint8)
    floats, _ = sf.read(str(p), dtype="float32")
    np.testing.assert_array_equal(load_audio(ints, 16000, sample_rate=16000), floats)
    with pytest.raises(AudioError, match="int64"):
        load_audio(np.zeros(100, np.int64), 16000, sample_rate=16000)


def test_8bit_wav_is_read(tmp_path):
    p = tmp_path / "u8.wav"
    sf.write(str(p), (np.sin(np.arange(1600) / 5) * 0.5).astype(np.float32), 8000, subtype="PCM_U8")
    out = load_audio(p, 16000)
    assert len(out) == 3200 and np.abs(out).max() > 0.4


def test_write_is_pcm16_mono_and_atomic(tmp_path):
    x = (np.sin(np.arange(22050) / 10) * 0.8).astype(np.float32)
    p = write_wav(tmp_path / "out.wav", x, 22050)
    info = sf.info(str(p))
    assert (info.samplerate, info.channels, info.subtype, info.frames) == (22050, 1, "PCM_16", 22050)
    assert os.listdir(tmp_path) == ["out.wav"]
    with pytest.raises(AudioError, match="does not exist"):
        write_wav(tmp_path / "missing" / "out.wav", x, 22050)
    with pytest.raises(AudioError, match="NaN"):
        write_wav(tmp_path / "nan.wav", np.array([np.nan], np.float32), 22050)
    assert os.listdir(tmp_path) == ["out.wav"]  # no partial file left behind


def test_resample_identity_and_bad_rate():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert resample(x, 16000, 16000) is not None and np.array_equal(resample(x, 16000, 16000), x)
    with pytest.raises(AudioError, match="positive"):
        resample(x, 0, 16000)


def _with_rate(src, dst, rate: int):
    """A copy of the WAV `src` whose header claims `rate` Hz (the fmt chunk's rate and byte rate)."""
    import struct

    data = bytearray(src.read_bytes())
    fmt = data.find(b"fmt ")
    channels, = struct.unpack_from("<H", data, fmt + 10)
    bits, = struct.unpack_from("<H", data, fmt + 22)
    struct.pack_into("<II", data, fmt + 12, rate, (rate * channels * bits // 8) & 0xFFFFFFFF)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("rate", [1, 999, 384_001, 4_000_000_000])
def test_a_header_rate_outside_the_bounds_is_refused_before_reading(tmp_path, spoken_wav, rate):
    """A 1 Hz header would be resampled 16000-fold (12 s and gigabytes before failing); it is
    refused from the header, naming the file."""
    bad = _with_rate(spoken_wav, tmp_path / "rate.wav", rate)
    with pytest.raises(AudioError, match=f"{bad}: .*(outside 1000..384000 Hz|not a readable audio file)"):
        load_audio(bad, 16000)
    with pytest.raises(AudioError, match="outside 1000..384000 Hz"):
        open_audio(np.zeros(100, np.float32), sample_rate=rate)


def test_the_length_is_known_and_checked_before_anything_is_read_or_padded(spoken_wav):
    """`check` sees the length the input will have (resampled and padded) before any of it is
    decoded or allocated: a pad of 10^13 samples (40 TB) is refused by it, not allocated."""
    info = sf.info(str(spoken_wav))
    seen = []

    class TooLong(ValueError):
        pass

    def check(total):
        seen.append(total)
        raise TooLong(total)

    with pytest.raises(TooLong):
        load_audio(spoken_wav, 22050, pad=10**13, check=check)
    expected = round(info.frames * 22050 / info.samplerate) + 10**13
    assert seen == [expected]
    seen.clear()
    wave = load_audio(spoken_wav, 22050, pad=123, check=seen.append)
    assert seen == [len(wave)]  # the count announced is the count made


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 44100, 48000, 96000, 16001])
def test_samples_at_is_soxr_s_count(rate):
    for n in (1, 999, 12345, 77777):
        opened = open_audio(np.zeros(n, np.float32), sample_rate=rate)
        assert opened.samples_at(16000) == len(load_audio(opened, 16000, min_samples=0)), (rate, n)


def test_too_short_names_the_file(tmp_path):
    p = tmp_path / "click.wav"
    sf.write(str(p), np.zeros(100, np.float32), 16000)
    with pytest.raises(AudioError, match=f"{p}: audio is too short \\(100 samples at 16000 Hz, 257 at least\\)"):
        load_audio(p, 16000, min_samples=257)


def test_a_file_name_that_is_not_utf8_is_read(tmp_path, spoken_wav):
    name = os.fsencode(tmp_path) + b"/question-\xff.wav"
    with open(name, "wb") as f:
        f.write(spoken_wav.read_bytes())
    expected = load_audio(spoken_wav, 16000)
    np.testing.assert_array_equal(load_audio(name, 16000), expected)  # a bytes path
    np.testing.assert_array_equal(load_audio(os.fsdecode(name), 16000), expected)  # as sys.argv has it


def test_channels_are_bounded():
    with pytest.raises(AudioError, match="65 channels"):
        open_audio(np.zeros((1000, 65), np.float32), sample_rate=16000)
