"""Key/value buffers grow by at least a quarter, in whole chunks: an hour of frames gives a couple
dozen buffer shapes (each a trace of the compiled steps), not one per chunk."""

from __future__ import annotations

import pytest

from voicechat.cache_growth import grown_capacity
from voicechat.llm.nemotron_h import KVCache

HOUR = 45_000  # 80 ms frames


@pytest.mark.parametrize("have,need,chunk", [(0, 1, 256), (0, 300, 256), (256, 257, 256), (1024, 1025, 256),
                                             (4096, 4097, 256), (4096, 9000, 256), (8, 9, 4), (1000, 1001, 1)])
def test_a_grown_capacity_is_whole_chunks_holding_need_and_a_quarter_more(have, need, chunk):
    cap = grown_capacity(need, have, chunk)
    assert cap % chunk == 0 and cap >= need and cap >= have + have // 4
    assert cap - max(need, have + have // 4) < chunk  # no more than the next chunk


def test_an_hour_of_positions_takes_a_couple_dozen_shapes_and_wastes_at_most_a_quarter():
    cache, shapes = KVCache(), []
    for end in range(1, HOUR + 1):
        cache.reserve(end, 1, 1, 1)
        capacity = cache.keys.shape[2]
        if not shapes or shapes[-1] != capacity:
            shapes.append(capacity)
        cache.offset = end
        assert end <= capacity <= end + end // 4 + KVCache.step
    assert len(shapes) <= 25, shapes
    assert shapes[0] == KVCache.step
