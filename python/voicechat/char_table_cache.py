"""The TTS char table kept on disk: computed once per checkpoint, read back by every later load.

EAR-TTS conditions each frame on a row of a `[vocab + 1, hidden]` table that the char encoder
computes over every subword of the vocabulary at load time (`CharAwareSubwordEncoder.table`): a
few seconds on a warm GPU, and most of a first load while its kernels compile. The table depends
only on what the key below hashes, so it is kept as a safetensors file named by that key:

- the char encoder's own tensors (`embed_subword.*`: names, dtypes, shapes, bytes; not the other
  9 GB of the checkpoint), its config section and the vocabulary size;
- the tokenizer's subword -> characters map (what `set_tokenizer` derives from tokenizer.json);
- the code that computes it: the voicechat package's Python sources, its extension's file and the
  kernel library's,
  MLX's version, the device (kind and name: another GPU may pick other matmul algorithms), and the
  environment that changes its arithmetic (MLX_ENABLE_TF32, VOICECHAT_REFERENCE) and whether
  our kernels run (`decode_kernels`).

Rules:
- A file is written whole or not at all (a temp name in the same folder, renamed over), readable
  as a plain `open` would make it (a container built as root serves other users).
- A file is trusted only if its metadata names the same key, its table has the expected shape and
  dtype, and its checksum matches: three sums of the table's 32-bit words modulo 2**32 (all
  words, words weighted by row, words weighted by column), computed on the device, exact in any
  order. Anything else (unreadable, cut short, flipped bytes, another key) is recomputed and the
  file written again.
- The folder: $VOICECHAT_CHAR_TABLE_DIR, else `voicechat/char-table` in the user's cache folder
  ($XDG_CACHE_HOME or ~/.cache). An empty VOICECHAT_CHAR_TABLE_DIR turns the cache off. A folder
  that cannot be written costs only the computation: said once a process on stderr.
- Files are ~600 MB at full size (float32); one per checkpoint, tokenizer, device and voicechat
  build. Nothing prunes them: removing the folder is always safe.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .files import output_file

FORMAT = "voicechat-char-table 1"
_ENVIRONMENT = ("MLX_ENABLE_TF32", "VOICECHAT_REFERENCE")

_said_unwritable = False
_code_digest: str | None = None
_lock = threading.Lock()


def cache_folder() -> Path | None:
    """Where tables are kept, or None when the cache is off (VOICECHAT_CHAR_TABLE_DIR empty)."""
    value = os.environ.get("VOICECHAT_CHAR_TABLE_DIR")
    if value is not None:
        return Path(value).expanduser() if value else None
    from . import cache_root

    return Path(cache_root()) / "voicechat" / "char-table"


def code_files() -> list[Path]:
    """The files whose bytes make `code_digest`: the package's .py files, its extension and the
    kernel library beside it."""
    package = Path(__file__).parent
    compiled = [*package.glob("_ext*"), *package.glob("libvoicechat_kernels*")]
    return sorted(package.rglob("*.py")) + sorted(compiled)


def code_digest() -> str:
    """A hash of the code that computes the table (`code_files`; made once a process)."""
    global _code_digest
    with _lock:
        if _code_digest is None:
            h = hashlib.sha256()
            package = Path(__file__).parent
            for path in code_files():
                h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
            _code_digest = h.hexdigest()
        return _code_digest


def device_text() -> str:
    """The default device, and on a GPU its name and architecture."""
    device = mx.default_device()
    text = str(device)
    if device.type == mx.gpu:
        try:
            info = mx.device_info()
            text += f" {info.get('device_name', '')} {info.get('architecture', '')}"
        except Exception:  # (an MLX without device_info: the kind alone)
            pass
    return text


def _array_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def table_key(encoder, config_section: dict, vocabulary_digest: str, decode_kernels: bool) -> str:
    """The hex key of a char encoder's table: everything the table depends on (see the module).
    `vocabulary_digest`: the encoder's `vocabulary_digest` (its subword -> characters map)."""
    h = hashlib.sha256()

    def feed(*parts) -> None:
        for p in parts:
            h.update(p if isinstance(p, bytes) else str(p).encode())
            h.update(b"\0")

    feed(FORMAT, code_digest(), mx.__version__, device_text(), decode_kernels)
    for name in _ENVIRONMENT:
        feed(name, os.environ.get(name, "<unset>"))
    feed(sorted(config_section.items()), encoder.vocab_size, encoder.hidden_size)
    feed(vocabulary_digest)
    for name, a in sorted(tree_flatten(encoder.parameters()), key=lambda kv: kv[0]):
        feed(name, a.dtype, tuple(a.shape), _array_bytes(a))
    return h.hexdigest()


def checksum(table: mx.array) -> str:
    """Three sums of the table's 32-bit words modulo 2**32: all words, each row's sum times its row
    number + 1, each column's sum times its column number + 1 ("s1 s2 s3" in hex)."""
    words = table.view(mx.uint32)
    rows = words.sum(axis=1)
    cols = words.sum(axis=0)
    row_weights = mx.arange(1, rows.shape[0] + 1, dtype=mx.uint32)
    col_weights = mx.arange(1, cols.shape[0] + 1, dtype=mx.uint32)
    sums = mx.stack([rows.sum(), (rows * row_weights).sum(), (cols * col_weights).sum()])
    return " ".join(f"{int(v):08x}" for v in np.array(sums))


def read_table(path: Path, key: str, shape: tuple[int, ...]) -> mx.array | None:
    """The table kept at `path` if it is whole and for `key`, else None."""
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        table = arrays.get("table")
        if meta.get("format") != FORMAT or meta.get("key") != key or table is None \
                or tuple(table.shape) != shape or table.dtype != mx.float32:
            return None
        mx.eval(table)
        if checksum(table) != meta.get("checksum"):
            return None
        return table
    except Exception:  # unreadable or cut short: a miss
        return None


def write_table(path: Path, key: str, table: mx.array) -> None:
    """Keep `table` at `path`, whole or not at all (`files.output_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with output_file(path, "wb") as f:
        mx.save_safetensors(f, {"table": table}, metadata={"format": FORMAT, "key": key, "checksum": checksum(table)})


def _say_unwritable(folder: Path, error: Exception) -> None:
    global _said_unwritable
    with _lock:
        if _said_unwritable:
            return
        _said_unwritable = True
    reason = getattr(error, "strerror", None) or str(error)
    print(f"voicechat: cannot keep the char table in {folder} ({reason}); every load computes it again "
          "(VOICECHAT_CHAR_TABLE_DIR picks the folder, empty turns the cache off)", file=sys.stderr)


def cached_table(key: Callable[[], str], shape: tuple[int, ...], compute: Callable[[], mx.array]) \
        -> tuple[mx.array, str]:
    """The table for `key()` from the cache folder, else `compute()` (and kept there). Returns the
    table and where it came from: "cache", "computed" (and kept), or "computed, not kept"."""
    folder = cache_folder()
    if folder is None:
        return compute(), "computed, not kept"
    path = folder / f"{key()}.safetensors"
    table = read_table(path, path.stem, shape)
    if table is not None:
        return table, "cache"
    table = compute()
    try:
        write_table(path, path.stem, table)
    except (OSError, RuntimeError, ValueError) as e:  # (MLX's writer raises RuntimeError)
        _say_unwritable(folder, e)
        return table, "computed, not kept"
    return table, "computed"
