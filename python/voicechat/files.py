"""Output files. A regular file, or a path where nothing is yet, is written whole or not at all: a
temp file beside it, renamed over it once complete. Anything else (a device such as /dev/null, a
FIFO, a terminal or pipe reached through /dev/stdout) is written directly, as `>` in a shell
would: never replaced, never created, never truncated. A symlink is followed to its target."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

# A chain of symlinks longer than this is a loop (Linux's own limit is 40).
_MAX_LINKS = 40
# Temp files of atomic writes under way, for `remove_pending_outputs`.
_PENDING: set[str] = set()


class OutputError(OSError):
    """An output that cannot be written; the message names the path given."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]"
        return str(self.strerror)


def fspath(path: str | bytes | os.PathLike) -> str:
    """`path` as a str; a bytes path that is not UTF-8 keeps its bytes as surrogate escapes (what
    Python does with such a name in sys.argv), so every os function still finds the file."""
    return os.fsdecode(os.fspath(path))


def _default_mode() -> int:
    """What `open(path, "w")` would give a new file: 0o666 less the umask (read without a race
    only through the umask call itself, so it is set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _through_proc(path: str) -> bool:
    """Whether `path`'s chain of symlinks passes through /proc (/dev/stdout -> /proc/self/fd/1):
    such a path is a file this process already has open (the shell's redirection, a pipe)."""
    p = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        if p == "/proc" or p.startswith("/proc/"):
            return True
        try:
            link = os.readlink(p)
        except OSError:  # not a link, or nothing there
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), link))
    return False


def _cannot(path: str, e: OSError) -> OutputError:
    return OutputError(e.errno, f"cannot write {path}: {e.strerror or e}")


def output_kind(path: str | bytes | os.PathLike) -> str:
    """How `path` is written: "atomic" (a regular file, or nothing there yet) or "direct"
    (a device, FIFO, socket, or a file reached through /proc). A directory, a symlink loop or a
    path through a non-directory is an OutputError."""
    name = fspath(path)
    if not name:
        raise OutputError(errno.ENOENT, "cannot write '': the path is empty")
    try:
        st = os.stat(name)  # (follows symlinks)
    except FileNotFoundError:  # (a dangling symlink: its target is made)
        return "atomic"
    except OSError as e:
        raise _cannot(name, e) from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(errno.EISDIR, f"cannot write {name}: is a directory")
    if not stat.S_ISREG(st.st_mode) or _through_proc(name):
        return "direct"
    return "atomic"


def check_output(path: str | bytes | os.PathLike) -> None:
    """What can be known before the work that makes an output: the path is not a directory, and
    for an atomic write its directory exists and takes a new file (a file made and dropped there:
    os.access says yes to root); a direct write's target opens for writing (a FIFO is not opened:
    that waits for its reader)."""
    name = fspath(path)
    if output_kind(name) == "direct":
        if not stat.S_ISFIFO(os.stat(name).st_mode) and not os.access(name, os.W_OK):
            raise OutputError(errno.EACCES, f"cannot write {name}: permission denied")
        return
    parent = Path(os.path.realpath(name)).parent
    if not parent.is_dir():
        raise OutputError(errno.ENOENT, f"cannot write {name}: directory {parent} does not exist")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError:
        raise OutputError(errno.EACCES, f"cannot write {name}: directory {parent} is not writable") from None


def same_file(a: str | bytes | os.PathLike, b: str | bytes | os.PathLike) -> bool:
    """Whether two paths name one file: the same path once symlinks are resolved, or the same
    device and inode (hard links, /dev/stdout and the file it is redirected to)."""
    a, b = fspath(a), fspath(b)
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


@contextlib.contextmanager
def output_file(path: str | bytes | os.PathLike, mode: str = "w"):
    """Yields a file object to write `path`'s content into (`mode` "w" or "wb").

    Atomic (see `output_kind`): on success the temp file replaces the symlinks' target with the
    permissions a plain `open` would have given it (a temp file's are 0o600); on any error it is
    removed and the target is left as it was. Direct: opened for appending, without creating or
    truncating. Either way an OSError while writing (ENOSPC, EPIPE, ...) is an OutputError naming
    `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    name = fspath(path)
    if output_kind(name) == "direct":
        try:
            fd = os.open(name, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise _cannot(name, e) from None
        try:
            with os.fdopen(fd, mode) as f:
                yield f
        except OSError as e:
            if isinstance(e, OutputError) or e.errno is None:
                raise
            raise _cannot(name, e) from None
        return
    target = Path(os.path.realpath(name))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:  # named after the file asked for, not the temp file
        raise _cannot(name, e) from None
    _PENDING.add(tmp)
    try:
        try:
            with os.fdopen(fd, mode) as f:
                yield f
                f.flush()
                if hasattr(os, "fchmod"):  # POSIX (Windows has no 0o600 temp files to undo)
                    os.fchmod(f.fileno(), _default_mode())
                os.fsync(f.fileno())  # whole on disk before the name points at it
            os.replace(tmp, target)
        except OSError as e:
            if isinstance(e, OutputError) or e.errno is None:
                raise
            raise _cannot(name, e) from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _PENDING.discard(tmp)


def remove_pending_outputs() -> None:
    """Remove the temp files of atomic writes under way (a process about to exit from a signal
    handler leaves none behind)."""
    for tmp in list(_PENDING):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _PENDING.discard(tmp)
