"""Shared fixtures: tiny synthetic checkpoints and real spoken WAVs (espeak-ng + sox)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from voicechat.synthetic import make_checkpoint

QUESTION = "What is the capital of France?"


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


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=0,
                     help="run the long fuzz (tests/test_fuzz.py) over this many cases of each kind")
    parser.addoption("--fuzz-seed", type=int, default=1, help="first seed of the long fuzz")


def run_measured(cmd: list[str], *, stdin: bytes | None = None, env: dict | None = None,
                 timeout: float = 600) -> tuple[int, str, str, int]:
    """Runs `cmd` to its end: (exit code, stdout, stderr, the child's peak resident memory in MiB,
    as the kernel counted it for that process: os.wait4's ru_maxrss)."""
    import tempfile
    import threading

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=out, stderr=err, env=env)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            if stdin is not None:
                try:
                    proc.stdin.write(stdin)
                    proc.stdin.close()
                except BrokenPipeError:  # (the command stopped reading: its exit says why)
                    pass
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        text = lambda f: f.read().decode("utf-8", "backslashreplace")  # noqa: E731
        return proc.returncode, text(out), text(err), usage.ru_maxrss // 1024


@pytest.fixture(scope="session")
def measured_run():
    """`run_measured`, for tests that check a command's exit, lines and peak memory."""
    return run_measured


@pytest.fixture
def memory_device(tmp_path):
    """`make(name, minor)`: a private character device node of the kernel's memory driver in
    tmp_path (minor 3 is null, 7 is full), so that the real /dev nodes are never at stake. Skips
    where nodes cannot be made or opened (not root, a nodev filesystem)."""
    import stat

    def make(name: str, minor: int) -> Path:
        path = tmp_path / name
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
            with open(path, "rb"):
                pass
        except OSError as e:
            pytest.skip(f"cannot make a device node here ({e})")
        return path

    return make
