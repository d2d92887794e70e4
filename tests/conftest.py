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
def _caches_of_this_run(tmp_path_factory):
    """The TTS char tables that loads keep and precompile's markers go to folders of this run, not
    the user's cache (XDG_CACHE_HOME; the kernel caches were placed when voicechat was imported; a
    test that studies the char table cache sets VOICECHAT_CHAR_TABLE_DIR itself)."""
    saved = {k: os.environ.get(k) for k in ("VOICECHAT_CHAR_TABLE_DIR", "XDG_CACHE_HOME")}
    root = tmp_path_factory.mktemp("cache")
    os.environ.setdefault("VOICECHAT_CHAR_TABLE_DIR", str(root / "voicechat" / "char-table"))
    os.environ["XDG_CACHE_HOME"] = str(root)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
