"""Shared fixtures: tiny synthetic checkpoints and real spoken WAVs (espeak-ng + sox)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from voicechat.synthetic import make_checkpoint

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="session", autouse=True)
def _char_tables_of_this_run(tmp_path_factory):
    """The TTS char tables that loads keep on disk go to a folder of this run, not the user's cache
    (a test that studies the cache sets VOICECHAT_CHAR_TABLE_DIR itself)."""
    before = os.environ.get("VOICECHAT_CHAR_TABLE_DIR")
    if before is None:
        os.environ["VOICECHAT_CHAR_TABLE_DIR"] = str(tmp_path_factory.mktemp("char-table"))
    yield
    if before is None:
        os.environ.pop("VOICECHAT_CHAR_TABLE_DIR", None)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """float32, published (torch) layout, dense."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint_q4(tmp_path_factory) -> Path:
    """bfloat16 with the published 4-bit per-module quantization."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-q4", "tiny", quantize=4, dtype="bfloat16")


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed (the README's set-up installs espeak-ng and sox)")
    return path


# Machines without espeak-ng (the lent GPU box) may point this at WAVs made elsewhere by the same
# two commands (question-22k.wav, question-16k.wav).
PREMADE = os.environ.get("VOICECHAT_TEST_WAVS")


@pytest.fixture(scope="session")
def spoken_wav_22k(tmp_path_factory) -> Path:
    """A spoken question as espeak-ng writes it (22050 Hz mono PCM16)."""
    if PREMADE:
        return Path(PREMADE) / "question-22k.wav"
    out = tmp_path_factory.mktemp("wav") / "question-22k.wav"
    subprocess.run([_need("espeak-ng"), "-w", str(out), QUESTION], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def spoken_wav(spoken_wav_22k, tmp_path_factory) -> Path:
    """The same question at 16 kHz mono PCM16 (sox), the model's input rate."""
    if PREMADE:
        return Path(PREMADE) / "question-16k.wav"
    out = tmp_path_factory.mktemp("wav") / "question-16k.wav"
    subprocess.run([_need("sox"), "-R", str(spoken_wav_22k), "-r", "16000", "-c", "1", "-b", "16", str(out)],
                   check=True, capture_output=True)
    return out
