"""Fuzzing of what a user hands voicechat: WAV files and config.json.

Every run: a few hundred fixed-seed cases of each, in-process through the readers and validators
(`load_audio`, `VoiceChatConfig.from_file`, `open_checkpoint`, the model's construction and strict
load), and a handful through the vc-generate command. Each must end as a working result or as
voicechat's own error (a ValueError or OSError naming the problem): never another exception, a
traceback, a crash, a partial output file, or memory far beyond the input's size.

The long run: `pytest tests/test_fuzz.py --fuzz-cases N [--fuzz-seed S] -s` takes N cases of each
kind and N / 50 through the command, and prints the counts.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import resource
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from voicechat.audio import AudioError, load_audio, open_audio_bytes
from voicechat.checkpoint import open_checkpoint
from voicechat.config import VoiceChatConfig
from voicechat.stt.conformer import subsampled_length

DEFAULT_CASES = 300  # of each kind, in-process
DEFAULT_CLI_CASES = 3  # of each kind, through the command
SEED = 57
CONTEXT = 4096  # the tiny checkpoint's max_position_embeddings
HOP = 160  # its preprocessor's hop (10 ms at 16 kHz)
# Far above what the readers need for the few seconds of audio here, far below what a lying header
# costs when it is believed (gigabytes).
MAX_GROWTH_MIB = 768
MAX_CHILD_MIB = 1536


def _cases(request, default: int) -> int:
    return request.config.getoption("--fuzz-cases") or default


def _seed(request) -> int:
    return SEED + (request.config.getoption("--fuzz-seed") - 1 if request.config.getoption("--fuzz-cases") else 0)


def _maxrss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _report(name: str, counts: Counter, peak_mib: int) -> None:
    print(f"\nfuzz {name}: {sum(counts.values())} cases, {dict(sorted(counts.items()))}, peak {peak_mib} MiB")


# --------------------------------------------------------------------------- WAV files

def _seed_files(spoken_wav: Path) -> list[bytes]:
    """The spoken question as espeak-ng + sox made it, and in other formats and encodings soundfile
    writes (the ones this libsndfile cannot write are left out)."""
    speech, rate = sf.read(str(spoken_wav), dtype="float32")
    short = speech[: rate // 2]
    files = [spoken_wav.read_bytes()]
    for fmt, subtype, channels in (("WAV", "FLOAT", 1), ("WAV", "PCM_U8", 2), ("WAV", "PCM_24", 1),
                                   ("WAV", "ULAW", 1), ("WAV", "IMA_ADPCM", 1), ("FLAC", "PCM_16", 2),
                                   ("AIFF", "PCM_16", 1), ("AU", "PCM_16", 1), ("W64", "PCM_16", 1),
                                   ("CAF", "ALAC_16", 1), ("OGG", "VORBIS", 1), ("RF64", "PCM_16", 1)):
        buffer = io.BytesIO()
        data = short if channels == 1 else np.stack([short, -short], axis=1)
        try:
            sf.write(buffer, data, rate, format=fmt, subtype=subtype)
        except Exception:  # (a format this build of libsndfile lacks)
            continue
        files.append(buffer.getvalue())
    return files


_ABSURD_U32 = (0, 1, 2, 7, 999, 1000, 384_001, 65_535, 2**31 - 1, 2**31, 2**32 - 1)
_ABSURD_U16 = (0, 1, 3, 7, 64, 65, 255, 4095, 65_535)


def _mutate_wav(data: bytes, rng: random.Random) -> bytes:
    """One corruption (or a few) of a file's bytes: header fields set to absurd values, truncation,
    flipped bytes, junk chunks, or random bytes."""
    b = bytearray(data)
    fmt = b.find(b"fmt ")
    ops = rng.randint(1, 3)
    for _ in range(ops):
        kind = rng.random()
        if kind < 0.35 and fmt >= 0 and len(b) >= fmt + 24:
            field = rng.choice([(10, "<H"), (12, "<I"), (16, "<I"), (20, "<H"), (22, "<H"), (8, "<H"), (4, "<I")])
            values = _ABSURD_U16 if field[1] == "<H" else _ABSURD_U32
            struct.pack_into(field[1], b, fmt + field[0], rng.choice(values))
        elif kind < 0.45 and (at := b.find(b"data")) >= 0 and len(b) >= at + 8:
            struct.pack_into("<I", b, at + 4, rng.choice(_ABSURD_U32))
        elif kind < 0.55 and len(b) >= 8:
            struct.pack_into("<I", b, 4, rng.choice(_ABSURD_U32))  # the RIFF size
        elif kind < 0.7 and b:
            del b[rng.randrange(len(b)):]  # truncated
        elif kind < 0.85 and b:
            for _ in range(rng.randint(1, 16)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind < 0.93:
            at = rng.randrange(len(b) + 1)
            junk = rng.choice([b"fmt ", b"data", b"LIST", b"JUNK"]) + struct.pack("<I", rng.choice(_ABSURD_U32))
            b[at:at] = junk + bytes(rng.randrange(64))
        else:
            b = bytearray(rng.randbytes(rng.choice([0, 1, 4, 12, 44, 1000])))
    return bytes(b)


class _TooLong(ValueError):
    pass


def _fits(samples: int) -> None:
    """The tiny model's length check (session.py's, without a model): frames within its context."""
    frames = subsampled_length(1 + samples // HOP)
    if frames > CONTEXT:
        raise _TooLong(f"{frames} frames")


def _read_case(data: bytes, path: Path, through_bytes: bool) -> str:
    """One fuzzed file through the reader as generate and the command read it: its outcome."""
    try:
        if through_bytes:  # as `--audio -` reads stdin
            source = open_audio_bytes(data, "stdin")
        else:
            path.write_bytes(data)
            source = path
        wave = load_audio(source, 16000, pad=48_000, min_samples=257, check=_fits)
    except _TooLong:
        return "too long"
    except AudioError:
        return "AudioError"
    assert wave.dtype == np.float32 and wave.ndim == 1 and np.all(np.isfinite(wave))
    assert 257 <= len(wave) and subsampled_length(1 + len(wave) // HOP) <= CONTEXT
    return "read"


def test_fuzzed_audio_files_are_read_or_refused(request, tmp_path, spoken_wav):
    cases, rng = _cases(request, DEFAULT_CASES), random.Random(_seed(request))
    seeds = _seed_files(spoken_wav)
    assert len(seeds) >= 8
    start = _maxrss_mib()
    counts: Counter = Counter()
    for i in range(cases):
        data = _mutate_wav(rng.choice(seeds), rng)
        try:
            counts[_read_case(data, tmp_path / "case.wav", through_bytes=i % 4 == 0)] += 1
        except Exception as e:  # anything but voicechat's own error is a failure: show the case
            (tmp_path / "failing.wav").write_bytes(data)
            pytest.fail(f"case {i}: {type(e).__name__}: {e} (the file is {tmp_path / 'failing.wav'})")
        assert _maxrss_mib() - start < MAX_GROWTH_MIB, f"case {i}: memory grew to {_maxrss_mib()} MiB"
    _report("wav", counts, _maxrss_mib())
    assert counts["read"] > 0 and counts["AudioError"] > 0  # (the corruptions reach both outcomes)


# --------------------------------------------------------------------------- config.json

_VALUES = (None, "x", "", True, False, 0, -1, 1, 3, 2**31, 2**63, 10**30, 1e308, -1e308, 0.5, 1.5, float("nan"),
           float("inf"), "inf", [], [1], [[70, 0]], {}, {"a": 1})


def _key_paths(node: dict, prefix: tuple = ()):
    for key, value in node.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _key_paths(value, prefix + (key,))


def _mutate_config(base: dict, rng: random.Random) -> bytes:
    """A config.json with fields retyped, nulled, multiplied, deleted or added, or its bytes broken."""
    data = copy.deepcopy(base)
    paths = list(_key_paths(data))
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        path = rng.choice(paths)
        node = data
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] not in node:
            continue
        key, kind = path[-1], rng.random()
        if kind < 0.12:
            del node[key]
        elif kind < 0.3 and isinstance(node[key], int) and not isinstance(node[key], bool):
            node[key] = node[key] * rng.choice((0, -1, 2, 3, 1000, 2**20, 2**31))
        elif kind < 0.35:
            node[f"unknown_{rng.randrange(100)}"] = rng.choice(_VALUES)
        else:
            node[key] = rng.choice(_VALUES)
    text = json.dumps(data).encode()  # (NaN and Infinity as JSON's extension writes them)
    kind = rng.random()
    if kind < 0.04:
        return text[: rng.randrange(len(text))]
    if kind < 0.08:
        at = rng.randrange(len(text))
        return text[:at] + rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80")) + text[at:]
    if kind < 0.09:
        return b"[" * 50_000 + b"]" * 50_000
    return text


def _config_dir(tmp_path: Path, checkpoint: Path) -> Path:
    """A checkpoint folder whose config.json the fuzz rewrites; its other files are the tiny checkpoint's."""
    d = tmp_path / "fuzzed-checkpoint"
    d.mkdir()
    for name in os.listdir(checkpoint):
        if name != "config.json":
            (d / name).symlink_to(checkpoint / name)
    return d


def _config_case(data: bytes, d: Path, build: bool) -> str:
    """One fuzzed config.json through what `voicechat.load` does before and while building."""
    from voicechat.model import VoiceChatModel

    (d / "config.json").write_bytes(data)
    try:
        config = VoiceChatConfig.from_file(d / "config.json")
    except ValueError:
        return "refused (config)"
    try:
        checkpoint = open_checkpoint(d)
    except ValueError:
        return "refused (sizes)"
    if not build:
        return "opened"
    try:
        checkpoint.load_into(VoiceChatModel(config), "")
    except ValueError:
        return "refused (weights)"
    return "built"


def test_fuzzed_configs_are_loaded_or_refused(request, tmp_path, tiny_checkpoint):
    cases, rng = _cases(request, DEFAULT_CASES), random.Random(_seed(request) + 1)
    base = json.loads((tiny_checkpoint / "config.json").read_text())
    d = _config_dir(tmp_path, tiny_checkpoint)
    start = _maxrss_mib()
    counts: Counter = Counter()
    for i in range(cases):
        data = _mutate_config(base, rng)
        try:
            counts[_config_case(data, d, build=True)] += 1
        except Exception as e:
            pytest.fail(f"case {i}: {type(e).__name__}: {e}; config.json: {data[:2000]!r}")
        assert _maxrss_mib() - start < MAX_GROWTH_MIB, f"case {i}: memory grew to {_maxrss_mib()} MiB"
    _report("config", counts, _maxrss_mib())
    assert counts["refused (config)"] > 0 and counts["built"] > 0


# --------------------------------------------------------------------------- through the command

def _cli_env() -> dict:
    import voicechat

    root = str(Path(voicechat.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _check_command(run_measured, cmd: list[str], out_dir: Path, counts: Counter, what: str) -> int:
    """Runs vc-generate: a result, or exactly one `error:` line and nothing written; no traceback;
    bounded memory. Returns the child's peak MiB."""
    before = sorted(os.listdir(out_dir))
    code, out, err, peak = run_measured(cmd, env=_cli_env(), timeout=300)
    assert "Traceback" not in err and "terminate called" not in err, f"{what}: {err}"
    assert peak < MAX_CHILD_MIB, f"{what}: {peak} MiB"
    if code == 0:
        counts["ran"] += 1
        assert out.startswith("[user] "), f"{what}: {out!r}"
    else:
        counts["error line"] += 1
        assert code in (1, 2), f"{what}: rc {code}: {err}"
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: {err}"
        assert sorted(os.listdir(out_dir)) == before, f"{what}: left {os.listdir(out_dir)}"  # nothing partial
    return peak


def _pick(rng: random.Random, make, outcome, want: set[str], count: int, tries: int = 400) -> list[bytes]:
    """`count` fuzzed inputs whose in-process outcome is in `want` (the command's errors for
    them come before the model loads, so each costs about a second)."""
    found = []
    for _ in range(tries):
        data = make()
        if outcome(data) in want:
            found.append(data)
            if len(found) == count:
                break
    return found


def test_fuzzed_inputs_through_the_command(request, tmp_path, tiny_checkpoint, spoken_wav, measured_run):
    n = max(DEFAULT_CLI_CASES, _cases(request, 0) // 50)
    rng = random.Random(_seed(request) + 2)
    seeds = _seed_files(spoken_wav)
    base = json.loads((tiny_checkpoint / "config.json").read_text())
    d = _config_dir(tmp_path, tiny_checkpoint)
    outs = tmp_path / "out"
    outs.mkdir()
    probe = tmp_path / "probe.wav"
    wavs = _pick(rng, lambda: _mutate_wav(rng.choice(seeds), rng), lambda b: _read_case(b, probe, False),
                 {"AudioError"}, n)
    wavs += _pick(rng, lambda: _mutate_wav(rng.choice(seeds), rng), lambda b: _read_case(b, probe, False),
                  {"read"}, 1)
    configs = _pick(rng, lambda: _mutate_config(base, rng), lambda b: _config_case(b, d, build=False),
                    {"refused (config)", "refused (sizes)"}, n)
    counts: Counter = Counter()
    peak = 0
    wav_out, json_out = outs / "answer.wav", outs / "answer.json"
    for i, data in enumerate(wavs):
        audio = tmp_path / f"fuzzed-{i}.wav"
        audio.write_bytes(data)
        peak = max(peak, _check_command(
            measured_run, [sys.executable, "-m", "voicechat", "-m", str(tiny_checkpoint), "--audio", str(audio), "-q",
             "--output-audio", str(wav_out), "--output-json", str(json_out), "--extra-decoding-seconds", "0.5"],
            outs, counts, f"wav case {i} ({audio})"))
        for f in (wav_out, json_out):
            f.unlink(missing_ok=True)
    for i, data in enumerate(configs):
        (d / "config.json").write_bytes(data)
        peak = max(peak, _check_command(
            measured_run, [sys.executable, "-m", "voicechat", "-m", str(d), "--audio", str(spoken_wav), "-q",
             "--output-audio", str(wav_out)], outs, counts, f"config case {i}: {data[:300]!r}"))
    _report("command", counts, peak)
    assert counts["error line"] >= 2 * n and counts["ran"] >= 1
