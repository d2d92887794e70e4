"""Output files: a regular file whole or not at all, with the permissions a plain open() would
give; a device, FIFO or symlink written to or through, never replaced; errors name the path."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import threading

import pytest

from voicechat.files import (OutputError, check_output, output_file, output_kind, remove_pending_outputs,
                             same_file)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_the_written_file_has_the_umask_s_permissions_not_the_temp_file_s(tmp_path, umask_027):
    target = tmp_path / "out.json"
    with output_file(target) as f:
        f.write("{}\n")
    assert target.read_text() == "{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # 0o666 less the umask; a temp file is 0o600
    with open(tmp_path / "plain.json", "w") as f:
        f.write("{}\n")
    assert stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == stat.S_IMODE(target.stat().st_mode)


def test_an_error_leaves_the_old_file_and_no_temp_file(tmp_path):
    target = tmp_path / "out.wav"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with output_file(target, "wb") as f:
            f.write(b"new, half")
            raise RuntimeError("midway")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.wav"]


def test_a_folder_that_takes_no_new_file_is_an_error_naming_the_target():
    """procfs creates no files (for root too): the error names the file asked for, not the temp
    file it would have been written through."""
    target = "/proc/voicechat-out.wav"
    with pytest.raises(OSError, match=f"cannot write {target}") as info:
        with output_file(target, "wb") as f:
            f.write(b"never")
    assert ".tmp" not in str(info.value)
    assert not os.path.exists(target)


def test_a_device_is_written_to_not_replaced(tmp_path, memory_device):
    null = memory_device("null", 3)
    assert output_kind(null) == "direct"
    with output_file(null, "wb") as f:
        f.write(b"RIFF" + bytes(1000))
    assert stat.S_ISCHR(os.stat(null).st_mode)  # still the device, not a regular file
    assert sorted(os.listdir(tmp_path)) == ["null"]  # and no temp file beside it


def test_a_full_device_is_an_error_naming_it(memory_device):
    full = memory_device("full", 7)
    with pytest.raises(OutputError, match=f"cannot write {full}: No space left on device") as info:
        with output_file(full, "wb") as f:
            f.write(b"x" * 100_000)
    assert info.value.errno == errno.ENOSPC
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_the_real_dev_full_is_written_to_not_replaced():
    """(Only once the device is known to be written directly: a rename would replace it.)"""
    if not stat.S_ISCHR(os.stat("/dev/full").st_mode) or output_kind("/dev/full") != "direct":
        pytest.fail("/dev/full would be replaced")
    with pytest.raises(OutputError, match="cannot write /dev/full: No space left on device"):
        with output_file("/dev/full", "wb") as f:
            f.write(b"x" * 100_000)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def _reader(fifo, keep: int | None = None):
    """Reads the FIFO whole (or `keep` bytes, then closes it) on a thread; returns what it read."""
    got = bytearray()

    def read():
        with open(fifo, "rb") as f:
            got.extend(f.read() if keep is None else f.read(keep))

    t = threading.Thread(target=read, daemon=True)  # (left waiting, if the FIFO were replaced)
    t.start()
    return t, got


def test_a_fifo_is_written_to_not_replaced(tmp_path):
    fifo = tmp_path / "answer.wav"
    os.mkfifo(fifo)
    t, got = _reader(fifo)
    with output_file(fifo, "wb") as f:
        f.write(b"RIFF-the-answer")
    t.join(timeout=30)
    assert bytes(got) == b"RIFF-the-answer"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["answer.wav"]


def test_a_fifo_whose_reader_left_is_a_broken_pipe_naming_it(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    t, got = _reader(fifo, keep=1)
    with pytest.raises(OutputError, match=f"cannot write {fifo}: Broken pipe"):
        with output_file(fifo, "wb") as f:
            for _ in range(64):  # past the pipe's buffer, after the reader has gone
                f.write(b"x" * 65536)
                f.flush()
    t.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "answer.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert output_kind(link) == "atomic"
    with output_file(link) as f:
        f.write("new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"
    assert sorted(os.listdir(tmp_path / "real")) == ["answer.json"]  # the temp file was beside the target
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "real" / "new.json")
    with output_file(dangling) as f:
        f.write("made")
    assert dangling.is_symlink() and (tmp_path / "real" / "new.json").read_text() == "made"


def test_a_symlink_loop_and_a_directory_are_errors(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OutputError, match=f"cannot write {loop}: Too many levels of symbolic links"):
        with output_file(loop) as f:
            f.write("x")
    assert loop.is_symlink()
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path)
    with pytest.raises(OutputError, match="the path is empty"):
        check_output("")


def test_a_non_utf8_name_is_written(tmp_path):
    name = os.fsencode(tmp_path) + b"/answer-\xff.json"
    with output_file(name) as f:
        f.write("{}")
    with open(name, "rb") as f:
        assert f.read() == b"{}"
    with output_file(os.fsdecode(name)) as f:  # as sys.argv carries it (surrogate escapes)
        f.write("[]")
    with open(name, "rb") as f:
        assert f.read() == b"[]"


@contextlib.contextmanager
def _small_tmpfs(path):
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_is_an_error_naming_the_file_and_leaves_nothing(tmp_path):
    with _small_tmpfs(tmp_path / "small") as small:
        target = small / "answer.wav"
        with pytest.raises(OutputError, match=f"cannot write {target}: No space left on device") as info:
            with output_file(target, "wb") as f:
                f.write(b"x" * 1_000_000)
        assert ".tmp" not in str(info.value)
        assert os.listdir(small) == []


def test_same_file(tmp_path):
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    assert same_file(a, a) and same_file(a, tmp_path / "." / "a.wav")  # neither exists yet
    assert not same_file(a, b)
    a.write_bytes(b"")
    (tmp_path / "link.wav").symlink_to(a)
    os.link(a, tmp_path / "hard.wav")
    assert same_file(a, tmp_path / "link.wav") and same_file(a, tmp_path / "hard.wav")
    assert not same_file(a, b)


def test_the_temp_file_of_a_write_under_way_can_be_removed(tmp_path):
    """What a signal handler calls before it exits: the half-written temp file goes, the target
    is never made."""
    target = tmp_path / "answer.wav"
    with pytest.raises(OutputError, match=f"cannot write {target}: No such file"):
        with output_file(target, "wb") as f:
            f.write(b"half")
            f.flush()
            assert len(os.listdir(tmp_path)) == 1  # the temp file
            remove_pending_outputs()
            assert os.listdir(tmp_path) == []
    assert os.listdir(tmp_path) == []
