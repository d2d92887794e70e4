"""Shared fixtures: tiny synthetic checkpoints and real spoken WAVs (espeak-ng + sox)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


@pytest.fixture(scope="session")
def ray_cluster():
    """A small local Ray cluster (CPU only) for the tests that use Ray; yields its address, which
    a child process joins with `--ray-address`. Skips where ray is not installed."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, object_store_memory=150 << 20, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=0,
                     help="run the long fuzz (tests/test_fuzz.py) over this many cases of each kind")
    parser.addoption("--fuzz-seed", type=int, default=1, help="first seed of the long fuzz")


# Forks the command from a small process and writes its exit code and peak RSS (KiB) to argv[1]. A
# child forked straight from pytest would count pytest's own RSS as its peak: Linux keeps the high
# water mark of the image a process had before exec.
_MEASURING_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


def run_measured(cmd: list[str], *, stdin: bytes | None = None, env: dict | None = None,
                 timeout: float = 600) -> tuple[int, str, str, int]:
    """Runs `cmd` (its first item an absolute path) to its end: (exit code, stdout, stderr, the
    command's own peak resident memory in MiB: os.wait4's ru_maxrss, the command forked from a
    small launcher)."""
    import signal
    import tempfile
    import threading

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as result:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _MEASURING_LAUNCHER, result.name, *cmd],
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=out, stderr=err, env=env, start_new_session=True)
        killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        killer.start()
        try:
            if stdin is not None:
                try:
                    proc.stdin.write(stdin)
                    proc.stdin.close()
                except BrokenPipeError:  # (the command stopped reading: its exit says why)
                    pass
            proc.wait()
        finally:
            killer.cancel()
        measured = result.read().split()
        if not measured:  # the launcher was killed with it
            raise AssertionError(f"{cmd} ran past {timeout} s")
        code, maxrss_kib = (int(v) for v in measured)
        out.seek(0)
        err.seek(0)
        text = lambda f: f.read().decode("utf-8", "backslashreplace")  # noqa: E731
        return code, text(out), text(err), maxrss_kib // 1024


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
