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


class TextTokenizer:
    """Byte-level BPE over the model's 131072 ids; decode keeps special tokens unless told."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable tokenizer.json ({e})") from None
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
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip: Iterable[int] = ()) -> str:
        """Text of `ids` with the ids in `skip` removed first; other specials are kept."""
        drop = set(skip)
        return self._tok.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def single_character_tokens(self) -> list[tuple[int, str]]:
        """(id, token) of every one-character token, sorted by id: the TTS char vocabulary."""
        return sorted((i, t) for t, i in self.vocab().items() if len(t) == 1)


def load_rnnt_pieces(directory: str | Path, config_vocabulary: list[str] | None, size: int) -> list[str]:
    """RNNT pieces from config.json's `rnnt_vocabulary`, else `rnnt_tokenizer/vocab.json`."""
    if config_vocabulary is not None:
        pieces = list(config_vocabulary)
        source = "config.json rnnt_vocabulary"
    else:
        path = Path(directory) / "rnnt_tokenizer" / "vocab.json"
        source = str(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{directory}: no RNNT vocabulary (config.json rnnt_vocabulary or "
                                  "rnnt_tokenizer/vocab.json)") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            by_id = {int(i): p for p, i in data.items()}
            if sorted(by_id) != list(range(len(by_id))):
                raise CheckpointError(f"{path}: ids are not 0..{len(by_id) - 1}")
            pieces = [by_id[i] for i in range(len(by_id))]
        elif isinstance(data, list):
            pieces = [str(p) for p in data]
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
