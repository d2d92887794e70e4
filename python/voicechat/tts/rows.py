"""EAR-TTS's frame step for many sessions at once: each session's CFG pair as two rows of one batch.

`TTSRows` holds every slot's TTS state in batched arrays: one `BackboneCache` whose batch is the
slots' CFG pairs (per window group `[2 * layers, 2 S * kv_heads, capacity, head_dim]`: slot s's
conditioned row at batch row 2s, its unconditioned row at 2s + 1, each position in the slot a
single session's cache puts it in), and each slot's position, previous codes and generator key.
A step is `EarTTS.step`'s own graph over S sessions (one compiled graph per slot count and
capacity): every launch takes the sessions' rows at once, each session's rows with the bits of
that launch alone (the kernels' `sessions` grids; on a CPU, MLX's ops and the C++ loops, whose
rows do not depend on each other), each row at its session's position and key slot, each session
drawing from its own generator key. Rows that are not `active` keep their codes, key and position
(their cache slot at their position is written and written again when they next step, before any
query reads it).

`insert` writes a single session's state into a row pair, `take` hands a row pair back as one (a
session alone steps on `EarTTS.step`); the attention's result does not depend on the buffers'
capacity (`Attention.attend_step_from`), so a session's bits do not change when it moves.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..llm.nemotron_h import own_buffer
from .backbone import BackboneCache
from .ear_tts import EarTTS


class TTSRows:
    """Every slot's EAR-TTS state (see the module docstring)."""

    def __init__(self, tts: EarTTS, slots: int, chunk: int):
        tts.prepare()
        self.tts = tts
        self.chunk = chunk
        self.rows_per_slot = 2 * tts.backbone.layers[0].self_attn.n_kv_heads  # a CFG pair's K/V rows
        self.slots = 0
        self.cache = self._empty_cache()
        self.positions = np.zeros(0, np.int32)
        # The positions as the last step left them on the device (None once the host changed them):
        # an array made on the host each step would be read from host memory by every attention launch.
        self._positions_on_device: mx.array | None = None
        q = tts.cfg.num_quantizers
        self.previous_code = mx.zeros((0, 1, q), mx.int32)
        self.keys = mx.zeros((0, 2), mx.uint32)
        self._step_fn = mx.compile(self._step_graph)
        self.resize(slots)

    def _empty_cache(self) -> BackboneCache:
        cache = self.tts.make_cache(self.chunk)
        cache.reserve(1, 2 * self.slots)
        return cache

    @property
    def buffers(self) -> list[mx.array]:
        """The K/V buffers of every slot, every write settled."""
        self.cache.flush()
        return self.cache.buffers

    # ------------------------------------------------------------------ rows

    def resize(self, slots: int) -> None:
        """`slots` rows: the first min(old, new) kept, new ones empty. At 0 the buffers go back to
        their first capacity."""
        if slots == self.slots:
            return
        rows = self.rows_per_slot
        keep = min(slots, self.slots)
        if slots == 0:
            self.slots = 0
            self.cache = self._empty_cache()
        elif slots > self.slots:
            new = slots - self.slots
            self.cache.buffers = [mx.concatenate([b, mx.zeros((b.shape[0], new * rows, *b.shape[2:]), b.dtype)], axis=1)
                                  for b in self.buffers]
        else:  # buffers of their own: the attention launches write into them in place
            self.cache.buffers = [own_buffer(b[:, : keep * rows]) for b in self.buffers]
        q = self.previous_code.shape[2]
        self.previous_code = mx.concatenate([self.previous_code[:keep], mx.zeros((slots - keep, 1, q), mx.int32)])
        self.keys = mx.concatenate([self.keys[:keep], mx.zeros((slots - keep, 2), mx.uint32)])
        self.positions = np.concatenate([self.positions[:keep], np.zeros(slots - keep, np.int32)])
        self._positions_on_device = None
        self.slots = slots
        mx.eval(self.cache.buffers, self.previous_code, self.keys)

    def insert(self, slot: int, cache: BackboneCache, position: int, previous_code: mx.array, key: mx.array) -> None:
        """Row pair `slot` takes a single session's TTS state: its cache (CFG batch 2), next
        position, previous codes `[1, 1, Q]` and generator key."""
        cache.flush()
        self.cache.flush()
        self.cache.reserve(position + 1, 2 * self.slots)
        rows = self.rows_per_slot
        buffers = []
        for buf, mine in zip(cache.buffers, self.cache.buffers):
            cap = mine.shape[2]  # >= the slots the session has written (reserved above)
            part = buf[:, :, :cap]
            if part.shape[2] < cap:
                pad = mx.zeros((part.shape[0], part.shape[1], cap - part.shape[2], part.shape[3]), part.dtype)
                part = mx.concatenate([part, pad], axis=2)
            buffers.append(mx.concatenate([mine[:, : slot * rows], part, mine[:, (slot + 1) * rows:]], axis=1))
        self.cache.buffers = buffers
        self.previous_code = _put_row(self.previous_code, slot, previous_code.reshape(1, 1, -1).astype(mx.int32))
        self.keys = _put_row(self.keys, slot, key.reshape(1, 2))
        self.positions[slot] = position
        self._positions_on_device = None
        mx.eval(self.cache.buffers, self.previous_code, self.keys)

    def take(self, slot: int) -> tuple[BackboneCache, mx.array, mx.array]:
        """Row pair `slot`'s state as a single session's (the inverse of `insert`): its cache (CFG
        batch 2, buffers of its own at the rows' capacities, which the single-session step may
        write in place; its offset the row's position), previous codes `[1, 1, Q]` and generator key."""
        rows = self.rows_per_slot
        cache = self.tts.make_cache(self.chunk)
        cache.buffers = [own_buffer(b[:, slot * rows : (slot + 1) * rows]) for b in self.buffers]
        cache.offset = int(self.positions[slot])
        previous_code, key = self.previous_code[slot : slot + 1], self.keys[slot]
        mx.eval(cache.buffers, previous_code, key)
        return cache, previous_code, key

    # ------------------------------------------------------------------ the step

    def step(self, text: mx.array, active: np.ndarray, silence: mx.array) -> mx.array:
        """One frame for every `active` row from its LLM text id `text [S]`: the codes `[S, Q]`
        (lazy; an inactive row's are its previous codes)."""
        # Room for every row's position, active or not: an inactive row still writes its key in the
        # slot of its position (past the buffers, it would land in a neighbour's slots).
        self.cache.reserve(int(self.positions.max(initial=0)) + 1, 2 * self.slots)
        positions = self._positions_on_device
        if positions is None:
            positions = mx.array(self.positions)
        codes, self.keys, self.cache.buffers, self.cache.pending, self._positions_on_device = self._step_fn(
            self.previous_code, text.astype(mx.int32), positions, self.keys, silence.astype(mx.int32).reshape(-1),
            mx.array(active), self.cache.buffers, self.cache.pending)
        self.previous_code = codes
        self.positions = self.positions + active.astype(np.int32)
        return codes.reshape(self.slots, -1)

    def _step_graph(self, previous_code, text, positions, keys, silence, active, buffers, pending):
        codes, new_keys, buffers, pending, _ = self.tts._step_graph(previous_code, text, positions, keys, silence,
                                                                    buffers, pending)
        return (mx.where(active[:, None, None], codes, previous_code), mx.where(active[:, None], new_keys, keys),
                buffers, pending, positions + active.astype(mx.int32))


def _put_row(a: mx.array, slot: int, row: mx.array) -> mx.array:
    return mx.concatenate([a[:slot], row, a[slot + 1:]]) if a.shape[0] > 1 else row
