"""The LLM's rows (`LMRows`): a row that sits out a tick leaves its neighbours' state alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import voicechat
from voicechat.llm.rows import CAPACITY_STEP, LMRows


def _neighbour_after(chat, first_position: int):
    """Row 1 (a session after its system prompt) stepped 4 ticks beside row 0 at `first_position`,
    row 0 stepping only in the first: row 1's ids and attention keys."""
    with chat.live(system_prompt="Be brief.", seed=0) as live:
        loop = live.loop
        cache, position, prev_text, prev_function = loop.cache, loop.position, loop.prev_text, loop.prev_function
        with mx.stream(chat._timeline_stream):
            rows = LMRows(chat.listening, 2, chat.config.pad_token_id)
            rows.insert(1, cache, position, prev_text, prev_function)
            rows.positions[0] = first_position  # row 0: empty state at that position
            audio = mx.array(np.random.default_rng(0).standard_normal((2, 1, chat.config.text_config.hidden_size)),
                             mx.float32)
            ids = []
            for tick in range(4):
                text, function = rows.step(audio * (tick + 1), np.array([tick == 0, True]))
                ids.append((int(text[1].item()), int(function[1].item())))
            taken, end, _, _ = rows.take(1)
        keys = [np.array(c.keys[:, :, :end]) for c in taken if getattr(c, "keys", None) is not None]
    return ids, keys


def test_a_row_sitting_out_at_the_end_of_the_buffers_does_not_write_past_them(tiny_checkpoint):
    """Row 0 steps from the last slot of the buffers' first capacity to the slot just past it, then
    sits out (its key still goes to the slot of its position): the buffers must grow for it too, or
    that key lands past its row, in row 1's slots. Row 1 gets the same ids and keys as beside an
    empty row 0."""
    chat = voicechat.load(tiny_checkpoint)
    beside_empty = _neighbour_after(chat, 0)
    beside_edge = _neighbour_after(chat, CAPACITY_STEP - 1)
    assert beside_edge[0] == beside_empty[0]
    assert len(beside_edge[1]) == len(beside_empty[1]) > 0
    for a, b in zip(beside_edge[1], beside_empty[1]):
        np.testing.assert_array_equal(a, b)
