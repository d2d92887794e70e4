"""Output files written whole or not at all: a temp file beside the target, renamed once complete."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _default_mode() -> int:
    """What `open(path, "w")` would give a new file: 0o666 less the umask (read without a race
    only through the umask call itself, so it is set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "w"):
    """Yields a file object to write `path`'s content into. On success the file replaces `path`
    with the permissions a plain `open` would have given it (a temp file's are 0o600); on any
    error it is removed and `path` is left as it was."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    except OSError as e:  # named after the file asked for, not the temp file
        raise OSError(e.errno, f"cannot write {target}: {e.strerror}") from None
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            if hasattr(os, "fchmod"):  # POSIX (Windows has no 0o600 temp files to undo)
                os.fchmod(f.fileno(), _default_mode())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
