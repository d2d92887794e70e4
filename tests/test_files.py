"""Output files: whole or not at all, with the permissions a plain open() would give."""

from __future__ import annotations

import os
import stat

import pytest

from voicechat.files import atomic_output


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_the_written_file_has_the_umask_s_permissions_not_the_temp_file_s(tmp_path, umask_027):
    target = tmp_path / "out.json"
    with atomic_output(target) as f:
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
        with atomic_output(target, "wb") as f:
            f.write(b"new, half")
            raise RuntimeError("midway")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.wav"]


def test_a_folder_that_takes_no_new_file_is_an_error_naming_the_target():
    """procfs creates no files (for root too): the error names the file asked for, not the temp
    file it would have been written through."""
    target = "/proc/voicechat-out.wav"
    with pytest.raises(OSError, match=f"cannot write {target}") as info:
        with atomic_output(target, "wb") as f:
            f.write(b"never")
    assert ".tmp" not in str(info.value)
    assert not os.path.exists(target)
