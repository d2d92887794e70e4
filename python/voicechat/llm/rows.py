"""The duplex LLM's decode step for many sessions at once: one row per slot, each at its own position.

`LMRows` holds every slot's decoding state in batched arrays whose first axis is the slot: per
Mamba layer the conv window `[S, K-1, C]` and SSM state `[S, H, P, N]`, per attention layer the
keys and values `[S, HK, capacity, D]` (slot s's position p in slot p of its row), and each
slot's position and previous ids. A step runs every slot through the same layers as
`DuplexLM.decode` (one compiled graph per slot count and capacity); rows that are not `active`
keep their state (a select), so sessions step only when they have input.

The state stays in place between frames, so a frame reads each weight once for all rows and copies
no session's keys and values; a joining session's state (made alone, system prompt and all) is
written into a free row (`insert`), a row is dropped by forgetting it, and `take` hands a row back
as a single session's cache (the engine's last session then steps alone).

Exactness: each row is computed by the ops the single-session step runs on it (the attention's
mask and the key write take the row's own position; keys past a row's position are masked out and
contribute exact zeros), so where the backend's ops give a row's result independently of the
other rows (MLX on a CPU: tested), a session's ids are the same alone or in any batch. The
single-session kernels (one row, one position) are not used here: on a GPU the rows take MLX's
own ops (quantized matmul for many rows, attention with per-row masks); a session alone steps on
`DuplexLM.decode` instead.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .nemotron_h import DuplexLM, KVCache, MambaCache, NemotronHCache, own_buffer

CAPACITY_STEP = KVCache.step  # attention slots added at a time (as a single session's cache grows)


class RowsKV:
    """One attention layer's keys and values for every row, inside the compiled step: the new key
    goes to each row's own position, and each row sees the slots up to it."""

    def __init__(self, keys: mx.array, values: mx.array, positions: mx.array):
        self.keys, self.values, self.positions = keys, values, positions

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """k, v `[S, HK, 1, D]` into slot `positions[s]` of row s; the whole buffers back."""
        s, hk, _, d = k.shape
        index = mx.broadcast_to(self.positions.reshape(s, 1, 1, 1), (s, hk, 1, d))
        self.keys = mx.put_along_axis(self.keys, index, k, axis=2)
        self.values = mx.put_along_axis(self.values, index, v, axis=2)
        return self.keys, self.values

    def attention_mask(self, length: int) -> mx.array:
        """Row s's query sees the slots <= its position: `[S, 1, 1, capacity]`."""
        if length != 1:
            raise ValueError("RowsKV steps one position per row")
        slots = mx.arange(self.keys.shape[2])
        return (slots[None] <= self.positions[:, None])[:, None, None, :]


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
        self.state: list[mx.array] = []  # per layer: conv, ssm | keys, values | nothing
        self.positions = np.zeros(0, np.int32)  # each row's next position
        self.prev_text = mx.zeros((0, 1), mx.int32)
        self.prev_function = mx.zeros((0, 1), mx.int32)
        self._step_fn = mx.compile(self._step_graph)
        self.resize(slots)

    # ------------------------------------------------------------------ rows

    def _empty_rows(self, n: int) -> list[mx.array]:
        out = []
        for layer, kind in zip(self.lm.llm.layers, self.kinds):
            if kind == "mamba":
                m = layer.mixer
                out += [mx.zeros((n, m.kernel - 1, m.conv_dim), mx.float32),
                        mx.zeros((n, m.num_heads, m.head_dim, m.state_size), mx.float32)]
            elif kind == "attention":
                shape = (n, self.heads, self.capacity, self.head_dim)
                out += [mx.zeros(shape, mx.float32), mx.zeros(shape, mx.float32)]
        return out

    def resize(self, slots: int) -> None:
        """`slots` rows: the first min(old, new) kept, new ones empty. At 0 the buffers go back to
        their first capacity."""
        if slots == self.slots:
            return
        if slots == 0:
            self.capacity = CAPACITY_STEP
            self.state = self._empty_rows(0)
        keep = min(slots, self.slots)
        if slots > self.slots:
            extra = self._empty_rows(slots - self.slots)
            self.state = [mx.concatenate([a, b]) for a, b in zip(self.state, extra)] if self.state else extra
            pad = mx.full((slots - self.slots, 1), self.pad_id, mx.int32)
            self.prev_text = mx.concatenate([self.prev_text, pad])
            self.prev_function = mx.concatenate([self.prev_function, pad])
        else:
            self.state = [a[:keep] for a in self.state]
            self.prev_text, self.prev_function = self.prev_text[:keep], self.prev_function[:keep]
        self.positions = np.concatenate([self.positions[:keep], np.zeros(max(0, slots - keep), np.int32)])
        self.slots = slots
        mx.eval(self.state, self.prev_text, self.prev_function)

    def _reserve(self, end: int) -> None:
        """Room for positions `< end` in every row (grown `CAPACITY_STEP` slots at a time)."""
        if end <= self.capacity:
            return
        capacity = -(-end // CAPACITY_STEP) * CAPACITY_STEP
        grown = []
        for a, kind in zip(self.state, self._array_kinds()):
            if kind == "kv":
                pad = mx.zeros((a.shape[0], a.shape[1], capacity - a.shape[2], a.shape[3]), a.dtype)
                a = mx.concatenate([a, pad], axis=2)
            grown.append(a)
        self.state, self.capacity = grown, capacity

    def _array_kinds(self) -> list[str]:
        return [k for kind in self.kinds for k in {"mamba": ("mamba", "mamba"), "attention": ("kv", "kv")}.get(kind, ())]

    def insert(self, slot: int, cache: NemotronHCache, position: int, prev_text: mx.array,
               prev_function: mx.array) -> None:
        """Row `slot` takes a single session's state: its cache (batch 1, as `FrameLoop.prompt`
        left it), next position and previous ids `[1, 1]`."""
        self._reserve(max(cache.offset, position) + 1)
        rows = []
        for c, kind in zip(cache, self.kinds):
            if kind == "mamba":
                rows += [c.conv, c.ssm]
            elif kind == "attention":
                c.settle()
                rows += [c.keys, c.values]
        new_state = []
        for a, row, kind in zip(self.state, rows, self._array_kinds()):
            if row is None:  # (a session without a system prompt has not run this layer yet)
                row = mx.zeros_like(a[:1])
            elif kind == "kv":
                row = row[:, :, : min(row.shape[2], self.capacity)]
                if row.shape[2] < self.capacity:
                    pad = mx.zeros((1, row.shape[1], self.capacity - row.shape[2], row.shape[3]), row.dtype)
                    row = mx.concatenate([row, pad], axis=2)
            new_state.append(_put_row(a, slot, row.astype(a.dtype)))
        self.state = new_state
        self.prev_text = _put_row(self.prev_text, slot, prev_text.reshape(1, 1).astype(mx.int32))
        self.prev_function = _put_row(self.prev_function, slot, prev_function.reshape(1, 1).astype(mx.int32))
        self.positions[slot] = position
        mx.eval(self.state, self.prev_text, self.prev_function)

    def take(self, slot: int) -> tuple[NemotronHCache, int, mx.array, mx.array]:
        """Row `slot`'s state as a single session's (the inverse of `insert`): its cache (batch 1,
        buffers of its own at the rows' capacity, which the single-session step may write in
        place), next position and previous ids `[1, 1]`."""
        position = int(self.positions[slot])
        cache = self.lm.make_cache()
        arrays = iter(self.state)
        for c, kind in zip(cache, self.kinds):
            if kind == "mamba":
                c.conv, c.ssm = (own_buffer(next(arrays)[slot : slot + 1]) for _ in range(2))
            elif kind == "attention":
                c.keys, c.values = (own_buffer(next(arrays)[slot : slot + 1]) for _ in range(2))
                c.offset = position
        prev_text, prev_function = self.prev_text[slot : slot + 1], self.prev_function[slot : slot + 1]
        mx.eval(cache.state, prev_text, prev_function)
        return cache, position, prev_text, prev_function

    # ------------------------------------------------------------------ the step

    def step(self, audio: mx.array, active: np.ndarray) -> tuple[mx.array, mx.array]:
        """One position for every `active` row: `audio [S, 1, H]` (any values in inactive rows).
        Returns each row's text and function ids `[S]` (lazy; meaningless for inactive rows).
        Inactive rows keep their state and position."""
        self._reserve(int(self.positions[active].max(initial=0)) + 1)
        text, function, self.prev_text, self.prev_function, *self.state = self._step_fn(
            self.prev_text, audio, self.prev_function, mx.array(self.positions), mx.array(active), self.state)
        self.positions = self.positions + active.astype(np.int32)
        return text, function

    def _step_graph(self, prev_text, audio, prev_function, positions, active, state):
        lm = self.lm
        x = lm.fused_input(prev_text, audio, prev_function).astype(mx.float32)
        arrays = iter(state)
        caches = []
        for kind in self.kinds:
            if kind == "mamba":
                caches.append(MambaCache(next(arrays), next(arrays)))
            elif kind == "attention":
                caches.append(RowsKV(next(arrays), next(arrays), positions))
            else:
                caches.append(None)
        x, _ = lm.llm.run_layers(x, caches)
        last = lm.llm.norm_f(x)[:, -1]
        text_logits, function_logits = lm.heads(last)
        text = mx.argmax(text_logits, axis=-1).astype(mx.int32)
        function = mx.argmax(function_logits, axis=-1).astype(mx.int32)
        keep = active.reshape(-1, 1)
        new_state = []
        old = iter(state)
        for c in caches:
            if isinstance(c, MambaCache):
                for new in (c.conv, c.ssm):
                    before = next(old)
                    new_state.append(mx.where(keep.reshape(-1, *([1] * (before.ndim - 1))), new, before))
            elif isinstance(c, RowsKV):
                # An inactive row's key lands in the slot of its next position, which it writes
                # again before any query reads it.
                next(old), next(old)
                new_state += [c.keys, c.values]
        return [text, function, mx.where(keep, text[:, None], prev_text),
                mx.where(keep, function[:, None], prev_function), *new_state]


def _put_row(a: mx.array, slot: int, row: mx.array) -> mx.array:
    """`a` with row `slot` (first axis) replaced by `row [1, ...]`."""
    return mx.concatenate([a[:slot], row, a[slot + 1:]]) if a.shape[0] > 1 else row
