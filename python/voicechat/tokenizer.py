"""The LLM's tokenizer (tokenizer.json via `tokenizers`) and the RNNT transcript pieces."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from .checkpoint import CheckpointError

# RNNT pieces that never reach the transcript: SentencePiece specials and language tags.
_SPECIAL_PIECES = {"<unk>", "<pad>", "<s>", "</s>"}
_LANGUAGE_TAG = re.compile(r"^<[a-z]{2,3}-[A-Za-z]{2,4}>$")


class TextError(ValueError):
    """Text that cannot be tokenized (not a str, or not encodable as UTF-8)."""


def check_text(text, what: str = "text") -> str:
    """`text` if it is a str that UTF-8 can encode; a lone surrogate (a non-UTF-8 byte that
    reached Python as a surrogate escape) is a TextError naming its position."""
    if not isinstance(text, str):
        raise TextError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TextError(f"{what} is not valid Unicode text: {text[e.start]!r} at character {e.start} "
                        "(a lone surrogate; bytes that were not UTF-8?)") from None
    return text


class TextTokenizer:
    """Byte-level BPE over the model's 131072 ids; decode keeps special tokens unless told."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        try:  # (read here, not by its path: a path that is not UTF-8 does not reach Rust)
            self._tok = Tokenizer.from_str(path.read_bytes().decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception; UTF-8 and OSErrors too
            raise CheckpointError(f"{path}: not a readable tokenizer.json ({type(e).__name__}: {e})") from None
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token string -> id, every id (specials included)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with no BOS/EOS added (the caller frames prompts itself)."""
        return self._tok.encode(check_text(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip: Iterable[int] = ()) -> str:
        """Text of `ids` with the ids in `skip` removed first; other specials are kept."""
        drop = set(skip)
        return self._tok.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def single_character_tokens(self, vocab: dict[str, int] | None = None) -> list[tuple[int, str]]:
        """(id, token) of every one-character token, sorted by id: the TTS char vocabulary.
        `vocab`: `vocab()` where the caller has already read it (131072 entries)."""
        return sorted((i, t) for t, i in (self.vocab() if vocab is None else vocab).items() if len(t) == 1)


def load_rnnt_pieces(directory: str | Path, config_vocabulary: list[str] | None, size: int) -> list[str]:
    """RNNT pieces from config.json's `rnnt_vocabulary`, else `rnnt_tokenizer/vocab.json`."""
    if config_vocabulary is not None:
        pieces = list(config_vocabulary)
        source = "config.json rnnt_vocabulary"
    else:
        path = Path(directory) / "rnnt_tokenizer" / "vocab.json"
        source = str(path)
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{directory}: no RNNT vocabulary (config.json rnnt_vocabulary or "
                                  "rnnt_tokenizer/vocab.json)") from None
        except (ValueError, RecursionError, OSError) as e:  # JSON, UTF-8 (UnicodeDecodeError), reading
            raise CheckpointError(f"{path}: not a readable JSON vocabulary ({type(e).__name__}: {e})") from None
        if isinstance(data, dict):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in data.values()):
                raise CheckpointError(f"{path}: expected piece -> integer id")
            by_id = {i: p for p, i in data.items()}
            if sorted(by_id) != list(range(len(data))):
                raise CheckpointError(f"{path}: ids are not 0..{len(data) - 1}, each once")
            pieces = [by_id[i] for i in range(len(by_id))]
        elif isinstance(data, list):
            if not all(isinstance(p, str) for p in data):
                raise CheckpointError(f"{path}: expected a list of piece strings")
            pieces = list(data)
        else:
            raise CheckpointError(f"{path}: expected an object (piece -> id) or a list of pieces")
    if len(pieces) != size:
        raise CheckpointError(f"{source}: {len(pieces)} pieces, but the RNNT has {size} classes")
    return pieces


def is_special_piece(piece: str) -> bool:
    return piece in _SPECIAL_PIECES or bool(_LANGUAGE_TAG.match(piece))


def decode_pieces(ids: Iterable[int], pieces: Sequence[str]) -> str:
    """Join the pieces of `ids` (specials and language tags dropped), '▁' -> space, stripped."""
    out = []
    for i in ids:
        piece = pieces[int(i)]
        if not is_special_piece(piece):
            out.append(piece)
    return "".join(out).replace("▁", " ").strip()
