"""vc-generate --stream (and --realtime): the same WAV and JSON as a run without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import voicechat
from voicechat.cli import main

SAME = ("user_transcript", "text", "function_text", "text_tokens", "function_tokens", "audio_codes", "frames",
        "prompt_frames", "sample_rate")


def vc_generate(*args) -> subprocess.CompletedProcess:
    """The real command in a process of its own, on this source tree."""
    env = {**os.environ, "PYTHONPATH": str(Path(voicechat.__file__).parents[1]), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "voicechat.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def same_wav(a: Path, b: Path) -> None:
    x, rate_x = sf.read(str(a), dtype="int16")
    y, rate_y = sf.read(str(b), dtype="int16")
    assert rate_x == rate_y == 22050 and x.shape == y.shape
    # the samples agree to float rounding (1e-5): at most one PCM16 step apart
    assert np.abs(x.astype(np.int32) - y.astype(np.int32)).max() <= 1


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, tiny_checkpoint, spoken_wav_22k):
    out = tmp_path_factory.mktemp("offline")
    proc = vc_generate("-m", tiny_checkpoint, "--audio", spoken_wav_22k, "--output-audio", out / "a.wav",
                       "--output-json", out / "a.json", "-p", "Be brief.", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    return out, json.loads((out / "a.json").read_text()), proc


def test_stream_writes_the_wav_and_json_of_the_run_without_it(tmp_path, tiny_checkpoint, spoken_wav_22k, offline_run):
    out, expected, offline = offline_run
    proc = vc_generate("-m", tiny_checkpoint, "--audio", spoken_wav_22k, "--output-audio", tmp_path / "b.wav",
                       "--output-json", tmp_path / "b.json", "-p", "Be brief.", "--seed", "3", "--stream")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert {k: data[k] for k in SAME} == {k: expected[k] for k in SAME}
    same_wav(out / "a.wav", tmp_path / "b.wav")
    # the text as it arrived: lines of one channel each, the user's marked [user]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("[user] ") for line in lines)
    user = "".join(line[len("[user] "):] for line in lines if line.startswith("[user] "))
    assert user.replace(" ", "") == data["user_transcript"].replace(" ", "")
    assert "frames" in proc.stderr and "real-time factor" in proc.stderr
    assert "latency" not in proc.stderr  # (only --realtime paces and measures)


def test_stream_json_to_stdout_is_the_json_alone(capsys, tmp_path, tiny_checkpoint, spoken_wav_22k, offline_run):
    _, expected, _ = offline_run
    code = main(["-m", str(tiny_checkpoint), "--audio", str(spoken_wav_22k), "--output-json", "-", "-p", "Be brief.",
                 "--seed", "3", "--stream", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert {k: data[k] for k in SAME} == {k: expected[k] for k in SAME}


def test_realtime_paces_the_input_and_ends_with_the_latency(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    js_offline, js_live = tmp_path / "offline.json", tmp_path / "live.json"
    common = ["-m", str(tiny_checkpoint), "--audio", str(spoken_wav), "--extra-decoding-seconds", "0.5"]
    assert main(common + ["--output-json", str(js_offline), "-q"]) == 0
    capsys.readouterr()
    assert main(common + ["--output-json", str(js_live), "--stream", "--realtime"]) == 0
    _, err = capsys.readouterr()
    expected, data = json.loads(js_offline.read_text()), json.loads(js_live.read_text())
    assert {k: data[k] for k in SAME} == {k: expected[k] for k in SAME}
    assert "latency over" in err and "p50" in err and "p95" in err and "p99" in err and "late" in err


def test_realtime_needs_stream(capsys, tiny_checkpoint, spoken_wav):
    assert main(["-m", str(tiny_checkpoint), "--audio", str(spoken_wav), "--realtime"]) == 2
    assert "--realtime paces a --stream run" in capsys.readouterr().err
