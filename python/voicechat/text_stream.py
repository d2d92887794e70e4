"""Text deltas of a growing id sequence: joined, they are the text the whole sequence decodes to.

`Result.text` is `tokenizer.decode(ids, skip).strip()` and `Result.user_transcript` is
`decode_pieces(ids, pieces)` (also stripped). A live session hands out each frame's new text as it
comes; joined, a channel's deltas equal those strings exactly:
- `TokenDeltas`: byte-level BPE ids. A token can end inside a multi-byte character, which then
  decodes to U+FFFD until its last byte arrives: the text is held back while it ends in U+FFFD.
  Each decode covers only the ids since the last complete character (a few), not the history.
- `PieceDeltas`: RNNT pieces ('▁' -> space, special pieces dropped); each piece is text on its own.
- `StrippedDeltas` (used by both): leading whitespace is never handed out and trailing whitespace
  only once more text follows it; `finish()` drops what is still held back.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from .tokenizer import is_special_piece

INCOMPLETE = "\ufffd"  # what a character cut short decodes to


class StrippedDeltas:
    """Deltas of a text whose joined whole is the text's `.strip()`."""

    def __init__(self):
        self._started = False  # some non-whitespace text has been handed out
        self._held = ""  # trailing whitespace, handed out only before more text

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body

    def finish(self) -> str:
        """The end of the text: what is held back is trailing whitespace, which strip() drops."""
        self._held = ""
        return ""


class TokenDeltas:
    """Text deltas of ids decoded by `decode(ids) -> str` (a byte-level decoder: the text of a
    sequence is the UTF-8 decoding of its tokens' bytes, U+FFFD for bytes that form no character).
    Ids in `skip` are dropped, as `TextTokenizer.decode(ids, skip)` drops them."""

    def __init__(self, decode: Callable[[Sequence[int]], str], skip: Iterable[int] = ()):
        self._decode = decode
        self._skip = frozenset(int(i) for i in skip)
        self._window: list[int] = []  # the ids since the last complete character was handed out
        self._done = 0  # ids of the window whose text was handed out (a whole number of characters)
        self._done_text = ""  # their text
        self._strip = StrippedDeltas()

    def add(self, token_id: int) -> str:
        """The text this id completes ("" while a character is incomplete or the id is skipped)."""
        if int(token_id) in self._skip:
            return ""
        self._window.append(int(token_id))
        text = self._decode(self._window)
        if text.endswith(INCOMPLETE) or len(text) <= len(self._done_text):
            return ""
        return self._strip.add(self._advance(text))

    def finish(self) -> str:
        """What is left: a character cut short by the end decodes to U+FFFD, as in the whole text."""
        delta = self._strip.add(self._advance(self._decode(self._window))) if self._window else ""
        self._strip.finish()
        return delta

    def _advance(self, text: str) -> str:
        """Hand out `text` (the window's decoding) past what was handed out; the window then starts
        after the ids handed out before (so the next decode keeps one id of context)."""
        delta = text[len(self._done_text):]
        self._window = self._window[self._done:]
        self._done_text = self._decode(self._window)
        self._done = len(self._window)
        return delta


class PieceDeltas:
    """Text deltas of RNNT piece ids, as `decode_pieces` joins them."""

    def __init__(self, pieces: Sequence[str]):
        self._pieces = pieces
        self._strip = StrippedDeltas()

    def add(self, ids: Iterable[int]) -> str:
        text = "".join(p for p in (self._pieces[int(i)] for i in ids) if not is_special_piece(p))
        return self._strip.add(text.replace("▁", " ")) if text else ""

    def finish(self) -> str:
        return self._strip.finish()
