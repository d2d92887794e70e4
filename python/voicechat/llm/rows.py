"""The duplex LLM's decode step for many sessions at once: one row per slot, each at its own position.

`LMRows` holds every slot's decoding state in batched arrays whose first axis is the slot: per
Mamba layer the conv window `[S, K-1, C]` and SSM state `[S, H, P, N]`, per attention layer the
keys and values `[S, HK, capacity, D]` (slot s's position p in slot p of its row), and each
slot's position and previous ids. A step is `DuplexLM.decode`'s own compiled parts
(`DuplexLM.decode_rows`) with a position a row; rows that are not `active` keep their state (a
select), so sessions step only when they have input.

The state stays in place between frames, so a frame reads each weight once for all rows and copies
no session's keys and values; a joining session's state (made alone, system prompt and all) is
written into a free row (`insert`), a row is dropped by forgetting it, and `take` hands a row back
as a single session's cache (the engine's last session then steps alone).

Exactness: each row is computed by the ops the single-session step runs on it (the attention
takes the row's own position, chunked whatever the buffers' capacity; keys past a row's position
are masked out), so where the backend gives a row's result independently of the other rows, a
session's ids are the same alone or in any batch: MLX on a CPU, and on a CUDA GPU our kernels at
the rows they take (1, 2 or 4: `MAX_KERNEL_ROWS`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .nemotron_h import DuplexLM, KVCache, NemotronHCache, _nothing_pending, own_buffer

CAPACITY_STEP = KVCache.step  # attention slots added at a time (as a single session's cache grows)
MAX_KERNEL_ROWS = 4  # rows the CUDA kernels give each row's alone bits at (the 4-bit GEMV: 1, 2 or 4)


class LMRows:
    """Every slot's LLM decoding state (see the module docstring). `slots` rows to begin with;
    `resize` changes the count (rows kept by index)."""

    def __init__(self, lm: DuplexLM, slots: int, pad_id: int):
        self.lm = lm
        cfg = lm.llm.config
        self.kinds = [layer.kind for layer in lm.llm.layers]
        self.pad_id = pad_id
        self.heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.capacity = CAPACITY_STEP
        self.slots = 0
        # per layer: [conv, ssm] | [keys, values, what their last in-place write was] | []
        self.layers: list[list[mx.array]] = [[] for _ in self.kinds]
        self.positions = np.zeros(0, np.int32)  # each row's next position
        self.prev_text = mx.zeros((0, 1), mx.int32)
        self.prev_function = mx.zeros((0, 1), mx.int32)
        self.resize(slots)

    @property
    def state(self) -> list[mx.array]:
        """Every row's state arrays (the Mamba states, the key and value buffers)."""
        return [a for arrays in self.layers for a in arrays[:2]]

    # ------------------------------------------------------------------ rows

    def _empty_rows(self, n: int) -> list[list[mx.array]]:
        out = []
        for layer, kind in zip(self.lm.llm.layers, self.kinds):
            if kind == "mamba":
                m = layer.mixer
                out.append([mx.zeros((n, m.kernel - 1, m.conv_dim), mx.float32),
                            mx.zeros((n, m.num_heads, m.head_dim, m.state_size), mx.float32)])
            elif kind == "attention":
                shape = (n, self.heads, self.capacity, self.head_dim)
                out.append([mx.zeros(shape, mx.float32), mx.zeros(shape, mx.float32), _nothing_pending()])
            else:
                out.append([])
        return out

    def _settled(self) -> None:
        """The buffers made to depend on their last in-place write, for readers outside the step
        (a copy of them); nothing pending after."""
        for kind, arrays in zip(self.kinds, self.layers):
            if kind == "attention" and arrays:
                keys, values, pending = arrays
                arrays[:] = [*mx.depends([keys, values], [pending]), _nothing_pending()]

    def resize(self, slots: int) -> None:
        """`slots` rows: the first min(old, new) kept, new ones empty. At 0 the buffers go back to
        their first capacity."""
        if slots == self.slots:
            return
        if slots == 0:
            self.capacity = CAPACITY_STEP
            self.layers = self._empty_rows(0)
        self._settled()
        keep = min(slots, self.slots)
        if slots > self.slots:
            extra = self._empty_rows(slots - self.slots)
            self.layers = [[mx.concatenate([a, b]) for a, b in zip(old[:2], new[:2])] + new[2:]
                           for old, new in zip(self.layers, extra)] if self.slots else extra
            pad = mx.full((slots - self.slots, 1), self.pad_id, mx.int32)
            self.prev_text = mx.concatenate([self.prev_text, pad])
            self.prev_function = mx.concatenate([self.prev_function, pad])
        else:
            self.layers = [[a[:keep] for a in arrays[:2]] + arrays[2:] for arrays in self.layers]
            self.prev_text, self.prev_function = self.prev_text[:keep], self.prev_function[:keep]
        self.positions = np.concatenate([self.positions[:keep], np.zeros(max(0, slots - keep), np.int32)])
        self.slots = slots
        mx.eval(self.layers, self.prev_text, self.prev_function)

    def _reserve(self, end: int) -> None:
        """Room for positions `< end` in every row (grown `CAPACITY_STEP` slots at a time)."""
        if end <= self.capacity:
            return
        self._settled()
        capacity = -(-end // CAPACITY_STEP) * CAPACITY_STEP
        for kind, arrays in zip(self.kinds, self.layers):
            if kind == "attention":
                a = arrays[0]
                pad = mx.zeros((a.shape[0], a.shape[1], capacity - a.shape[2], a.shape[3]), a.dtype)
                arrays[:2] = [mx.concatenate([b, pad], axis=2) for b in arrays[:2]]
        self.capacity = capacity

    def insert(self, slot: int, cache: NemotronHCache, position: int, prev_text: mx.array,
               prev_function: mx.array) -> None:
        """Row `slot` takes a single session's state: its cache (batch 1, as `FrameLoop.prompt`
        left it), next position and previous ids `[1, 1]`."""
        self._reserve(max(cache.offset, position) + 1)
        self._settled()
        for c, kind, arrays in zip(cache, self.kinds, self.layers):
            if kind == "mamba":
                rows = [c.conv, c.ssm]
            elif kind == "attention":
                c.settle()
                rows = [c.keys, c.values]
            else:
                continue
            for i, (a, row) in enumerate(zip(arrays[:2], rows)):
                if row is None:  # (a session without a system prompt has not run this layer yet)
                    row = mx.zeros_like(a[:1])
                elif kind == "attention":
                    row = row[:, :, : min(row.shape[2], self.capacity)]
                    if row.shape[2] < self.capacity:
                        pad = mx.zeros((1, row.shape[1], self.capacity - row.shape[2], row.shape[3]), row.dtype)
                        row = mx.concatenate([row, pad], axis=2)
                arrays[i] = _put_row(a, slot, row.astype(a.dtype))
        self.prev_text = _put_row(self.prev_text, slot, prev_text.reshape(1, 1).astype(mx.int32))
        self.prev_function = _put_row(self.prev_function, slot, prev_function.reshape(1, 1).astype(mx.int32))
        self.positions[slot] = position
        mx.eval(self.layers, self.prev_text, self.prev_function)

    def take(self, slot: int) -> tuple[NemotronHCache, int, mx.array, mx.array]:
        """Row `slot`'s state as a single session's (the inverse of `insert`): its cache (batch 1,
        buffers of its own at the rows' capacity, which the single-session step may write in
        place), next position and previous ids `[1, 1]`."""
        position = int(self.positions[slot])
        self._settled()
        cache = self.lm.make_cache()
        for c, kind, arrays in zip(cache, self.kinds, self.layers):
            if kind == "mamba":
                c.conv, c.ssm = (own_buffer(a[slot : slot + 1]) for a in arrays)
            elif kind == "attention":
                c.keys, c.values = (own_buffer(a[slot : slot + 1]) for a in arrays[:2])
                c.offset = position
        prev_text, prev_function = self.prev_text[slot : slot + 1], self.prev_function[slot : slot + 1]
        mx.eval(cache.state, prev_text, prev_function)
        return cache, position, prev_text, prev_function

    # ------------------------------------------------------------------ the step

    def step(self, audio: mx.array, active: np.ndarray) -> tuple[mx.array, mx.array]:
        """One position for every `active` row: `audio [S, 1, H]` (any values in inactive rows).
        Returns each row's text and function ids `[S]` (lazy; meaningless for inactive rows).
        Inactive rows keep their state and position (an inactive row's key lands in the slot of its
        next position, which it writes again before any query reads it)."""
        # Room for every row's position, active or not: an inactive row's key lands in the slot of
        # its position too (past the buffers, it would land in a neighbour's slots).
        self._reserve(int(self.positions.max(initial=0)) + 1)
        text, function, _, new_state = self.lm.decode_rows(self.prev_text, audio, self.prev_function,
                                                           mx.array(self.positions), self.layers)
        arrays = iter(new_state)
        layers = [[next(arrays) for _ in old] for old in self.layers]
        everyone = bool(active.all())
        keep = None if everyone else mx.array(active)
        for kind, old, new in zip(self.kinds, self.layers, layers):
            if kind == "mamba" and keep is not None:
                new[:] = [mx.where(keep.reshape(-1, *([1] * (b.ndim - 1))), a, b) for a, b in zip(new, old)]
        self.layers = layers
        text, function = text[:, None], function[:, None]
        self.prev_text = text if everyone else mx.where(keep[:, None], text, self.prev_text)
        self.prev_function = function if everyone else mx.where(keep[:, None], function, self.prev_function)
        self.positions = self.positions + active.astype(np.int32)
        return text[:, 0], function[:, 0]


class LMGroups:
    """`LMRows` in groups of at most `group` rows (slot s: row s % group of group s // group), each
    group stepped as one batch: the CUDA kernels give a row its alone bits at up to
    `MAX_KERNEL_ROWS` rows, so more sessions step as several such batches. The same interface as
    `LMRows`."""

    def __init__(self, lm: DuplexLM, slots: int, pad_id: int, group: int = MAX_KERNEL_ROWS):
        self.lm, self.pad_id, self.group = lm, pad_id, group
        self.groups: list[LMRows] = []
        self.slots = 0
        self.resize(slots)

    def _where(self, slot: int) -> tuple[LMRows, int]:
        return self.groups[slot // self.group], slot % self.group

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([g.positions for g in self.groups]) if self.groups else np.zeros(0, np.int32)

    @property
    def state(self) -> list[mx.array]:
        return [a for g in self.groups for a in g.state]

    def resize(self, slots: int) -> None:
        """`slots` rows (kept by index): full groups, then one of the rest."""
        sizes = [min(self.group, slots - start) for start in range(0, slots, self.group)]
        while len(self.groups) > len(sizes):
            self.groups.pop().resize(0)
        while len(self.groups) < len(sizes):
            self.groups.append(LMRows(self.lm, 0, self.pad_id))
        for g, size in zip(self.groups, sizes):
            g.resize(size)
        self.slots = slots

    def insert(self, slot: int, *state) -> None:
        group, row = self._where(slot)
        group.insert(row, *state)

    def take(self, slot: int):
        group, row = self._where(slot)
        return group.take(row)

    def step(self, audio: mx.array, active: np.ndarray) -> tuple[mx.array, mx.array]:
        """Each group with an active row stepped (`LMRows.step`); the rows' ids `[S]`, zeros for
        the groups that did not step."""
        text, function = [], []
        for i, g in enumerate(self.groups):
            rows = slice(i * self.group, i * self.group + g.slots)
            if active[rows].any():
                t, f = g.step(audio[rows], active[rows])
            else:
                t = f = mx.zeros((g.slots,), mx.int32)
            text.append(t)
            function.append(f)
        return mx.concatenate(text), mx.concatenate(function)


def _put_row(a: mx.array, slot: int, row: mx.array) -> mx.array:
    """`a` with row `slot` (first axis) replaced by `row [1, ...]`."""
    return mx.concatenate([a[:slot], row, a[slot + 1:]]) if a.shape[0] > 1 else row
