"""The state of several streams kept as one batch's rows between steps: perception's layer caches
(`stt.conformer.push_streams`) and the codec's block contexts (`codec.codec.queue_streams`)."""

from __future__ import annotations

from typing import Callable


class StackedRows:
    """The rows one batch ran (`members`: the stream of each row, padding rows included); each
    member's `_batch` is this while its state is here. The next batch of the same streams in the
    same rows runs on the rows as they are (`holds`), and a stream's own row is sliced out
    (`row_of`) only when it runs otherwise (alone, or in another batch). Subclasses add the arrays."""

    def __init__(self, members: list):
        self.members = members

    def row_of(self, stream) -> int:
        return self.members.index(stream)

    def holds(self, order: list) -> bool:
        """These rows are `order`'s, stream for stream, and every one of them still keeps its state here."""
        return len(self.members) == len(order) and all(a is b for a, b in zip(self.members, order)) \
            and all(s._batch is self for s in order)


def padded(items: list, rows: Callable[[int], int] | None) -> list:
    """`items`, then its first item again up to `rows(len(items))` rows (a batch size's bucket:
    compiled graphs are traced for a few sizes, not every count); `items` as they are without `rows`."""
    return items + [items[0]] * ((rows(len(items)) if rows else len(items)) - len(items))
