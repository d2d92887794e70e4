"""The EAR-TTS backbone: Gemma-3 decoder blocks on injected embeddings, with K/V caches.

No token embedding, no input scaling, no LM head: `inputs [B, T, hidden] -> norm(blocks(inputs))`.
Layer `i` is global when `(i + 1) % sliding_window_pattern == 0` (RoPE `rope_global_base_freq`,
every past key) and sliding otherwise (RoPE `rope_local_base_freq`, the last `sliding_window`
keys).

Sliding window, exactly as Hugging Face Gemma-3 (which NeMo trains with) and mlx-lm define it:
a query at position `p` sees the keys at positions `p - window + 1 .. p`, i.e. `window` keys
including its own (`key > p - window`).

Caches are fixed-shape buffers so that a one-token step has the same shapes from call to call
and can run as one compiled graph:
- global layer: buffer of `capacity` slots, position `p` in slot `p`; grown when full, in `chunk`
  slots and by at least a quarter (`cache_growth`);
- sliding layer: the same until the buffer holds `window` slots, then a ring: position `p` in slot
  `p % window`. The ring then holds exactly the keys a query at the newest position may see.
In both, after writing position `p`, slot `s` is valid for the query at `p` iff `s <= p` (in the
ring every slot is valid once `p >= window - 1`), so a step needs only that one mask, equivalent
to "no mask" over the keys a growing cache would hold. Attention is permutation-invariant over
keys, so the ring's order does not matter (RoPE is applied before a key is stored).

Layers of one window share capacity and slot, so their keys and values live in one buffer per
window (`BackboneCache.buffers`: `[2 * layers, B * kv_heads, capacity, head_dim]`, keys of the
window's layer j at 2j, values at 2j + 1; four dimensions, as MLX-CUDA's slice update takes no
more than 10 between the buffer and its update). A step attends each layer over its buffer with
the slot of the new position holding the new key (the attention takes it beside the buffer), and
writes all of a window's new keys and values at the end, in one update: two buffer writes a step
instead of two per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..cache_growth import grown_capacity
from ..config import TTSConfig
from ..kernels._native import use_reference
from ..kernels.decode_attention import decode_attention, decode_attention_qkv
from ..kernels.gemv import linear, on_cuda_gpu, stack_linears
from ..kernels.qkv_heads import qkv_heads, rope_inv_freq
from .layers import GatedMLP, OffsetRMSNorm, add_and_norm, add_and_norm_linear, norm_linear

DEFAULT_CHUNK = 256  # cache slots added at a time (20 s of frames)


class Attention(nn.Module):
    """Gemma-3 self-attention: q/k RMS norms (offset) before RoPE (rotate-half form)."""

    def __init__(self, cfg: TTSConfig, rope_base: float, window: int | None):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.rope_base = float(rope_base)
        self.window = window
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self._qkv = None  # q, k and v as one layer (`stack()`); not in the key tree

    def stack(self) -> None:
        self._qkv = stack_linears([self.q_proj, self.k_proj, self.v_proj])
        self._inv_freq = rope_inv_freq(self.head_dim, self.rope_base)

    def unstack(self) -> None:
        self._qkv = None

    def fuses_step(self) -> bool:
        """Whether a step's head norms and RoPE run inside the attention launch (CUDA, stacked q/k/v)."""
        return self._qkv is not None and on_cuda_gpu() and self.q_norm.eps == self.k_norm.eps

    def project(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as [B, heads, T, head_dim] (float32), RoPE at positions offset.. ."""
        if self._qkv is not None:
            return self.heads(self._qkv(x), offset)
        return self._heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), offset)

    def heads(self, qkv: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """`project` from the stacked q/k/v projection's output [B, T, (H + 2 HK) * D]."""
        if on_cuda_gpu() and self.q_norm.eps == self.k_norm.eps:
            # one launch for the head norms, RoPE and the layout (same formula, HF's angle rounding)
            return qkv_heads(qkv, self.q_norm.scale, self.k_norm.scale, self._inv_freq, offset,
                             self.n_heads, self.n_kv_heads, self.q_norm.eps)
        q_width = self.n_heads * self.head_dim
        q, k, v = mx.split(qkv, [q_width, q_width + self.n_kv_heads * self.head_dim], axis=-1)
        return self._heads(q, k, v, offset)

    def _heads(self, q: mx.array, k: mx.array, v: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        b, t, _ = q.shape
        q = self.q_norm(q.reshape(b, t, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(b, t, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=offset)
        return q, k, v.astype(mx.float32)

    def attend_step(self, q: mx.array, k: mx.array, v: mx.array, offset: mx.array, mask: mx.array,
                    new: tuple[mx.array, mx.array, mx.array], sessions: int = 1) -> mx.array:
        """One query at `offset` over the whole buffers k, v (`mask`: their slots <= offset), with
        `new = (k, v, slot)`: the new position's key and value, seen in that slot (not yet written
        there). Our kernel on CUDA (its two launches at any capacity: see `attend_step_from`),
        composed MLX ops elsewhere (`kernels.decode_attention`)."""
        out = decode_attention(q, k, v, offset, self.scale, mask, new=new, chunked=True)
        return linear(self.o_proj, out, sessions=sessions)

    def attend_step_from(self, z, qkv, k: mx.array, v: mx.array, offset: mx.array, mask: mx.array, slot: mx.array,
                         write_cache: bool = False, sessions: int = 1):
        """One step from the layer's normed input `z`, or from its stacked q/k/v projection `qkv`
        already made: `(o_proj(attention), new key, new value)`, the new key and value seen in
        `slot` of the buffers k, v. On a CUDA GPU with the stacked projection (`fuses_step`), the
        head norms and RoPE run inside the attention launch (`decode_attention_qkv`): one launch a
        layer fewer; `write_cache` (only then) has that launch store the new key and value in the
        buffers too. `offset` and `slot` hold one value, or one a row (sessions' rows at their own
        positions); `sessions`: the rows are that many CFG pairs, each pair's bits its own alone.

        The attention takes its two launches at any capacity (`chunked`): a row's result then does
        not depend on how many slots the buffers hold, which sessions stepped together need (their
        buffers have the longest one's capacity), and a session alone gets the same bits."""
        if qkv is None and self._qkv is not None:
            qkv = linear(self._qkv, z, sessions=sessions)
        if qkv is not None and self.fuses_step():
            out, k_new, v_new = decode_attention_qkv(qkv, self.q_norm.scale, self.k_norm.scale, self._inv_freq,
                                                     self.q_norm.eps, k, v, offset, self.scale, slot, self.n_heads,
                                                     mask, write_cache=write_cache, chunked=True)
            return linear(self.o_proj, out, sessions=sessions), k_new, v_new
        if write_cache:
            raise ValueError("write_cache needs the fused CUDA step (Attention.fuses_step)")
        q, k_new, v_new = self.project(z, offset) if qkv is None else self.heads(qkv, offset)
        return self.attend_step(q, k, v, offset, mask, (k_new, v_new, slot), sessions), k_new, v_new

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TTSConfig, index: int):
        super().__init__()
        is_global = cfg.is_global_layer(index)
        base = cfg.rope_global_base_freq if is_global else cfg.rope_local_base_freq
        self.self_attn = Attention(cfg, base, None if is_global else cfg.sliding_window)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)

    @property
    def window(self) -> int | None:
        return self.self_attn.window

    def after_attention(self, h: mx.array, attn_out: mx.array, next_norm: OffsetRMSNorm,
                        next_qkv=None, sessions: int = 1) -> tuple[mx.array, mx.array]:
        """`h + post_attn(attn_out)`, then `+ post_ff(mlp(pre_ff(.)))`: returns the residual stream
        and `next_norm` of it (the next layer's input norm, or the final one), or, given the next
        layer's stacked q/k/v layer `next_qkv`, that layer applied to it. Each norm seam and the
        projection after it are one launch on a CUDA GPU once stacked (`add_and_norm_linear`).
        `sessions`: the rows are that many sessions' CFG pairs (one step of each)."""
        mlp = self.mlp
        if mlp._gate_up is not None:
            h, gate_up = add_and_norm_linear(h, attn_out, self.post_attention_layernorm,
                                             self.pre_feedforward_layernorm, mlp._gate_up, sessions)
            out = mlp.down_from(gate_up, sessions)
        else:
            h, z = add_and_norm(h, attn_out, self.post_attention_layernorm, self.pre_feedforward_layernorm)
            out = mlp(z)
        if next_qkv is not None:
            return add_and_norm_linear(h, out, self.post_feedforward_layernorm, next_norm, next_qkv, sessions)
        return add_and_norm(h, out, self.post_feedforward_layernorm, next_norm)


def window_groups(windows: list[int | None]) -> tuple[list[int | None], list[tuple[int, int]]]:
    """The distinct windows in order of first use, and each layer's (group, index in group)."""
    groups: list[int | None] = []
    place, counts = [], {}
    for window in windows:
        if window not in counts:
            groups.append(window)
            counts[window] = 0
        place.append((groups.index(window), counts[window]))
        counts[window] += 1
    return groups, place


@dataclass
class BackboneCache:
    """The K/V of every layer, one float32 buffer per window (`window_groups`):
    `buffers[g] [2 * layers of g, B * kv_heads, capacity, head_dim]` (layer j's keys at 2j, its
    values at 2j + 1); and the next position.

    A single-token step leaves `pending` (see `settle`) what the next reader of the buffers must
    come after. Elsewhere than CUDA these are its new keys (stacked per window, with their slots):
    the next step writes them first, before any of its launches reads the buffers. On CUDA the
    step's attention launches have written them in place already (`Backbone.writes_cache_in_place`),
    and `pending` holds those launches' outputs (with no slots), on which the next reader's buffers
    are made to depend. `flush()` settles them for any other reader."""

    windows: list[int | None]
    kv_heads: int
    head_dim: int
    chunk: int = DEFAULT_CHUNK
    buffers: list[mx.array | None] = field(default_factory=list)
    offset: int = 0
    pending: tuple[list[mx.array], list[mx.array]] | None = None  # see `settle`
    # The next position as the last compiled step computed it on the device (int32 scalar), valid
    # while `position_at == offset`: an array made on the host for each step would be read from
    # host-written memory by every attention launch (see `EarTTS.step`).
    position: mx.array | None = None
    position_at: int = -1

    @property
    def state(self) -> list[mx.array]:
        """Every array the cache carries from step to step (to `mx.eval` where it changes hands)."""
        pending = [a for part in self.pending for a in part] if self.pending is not None else []
        position = [self.position] if self.position is not None else []
        return [b for b in self.buffers if b is not None] + pending + position

    def position_array(self) -> mx.array:
        """`offset` as an int32 scalar array, the device's own when a step left it."""
        return self.position if self.position_at == self.offset else mx.array(self.offset, mx.int32)

    def __post_init__(self):
        self.groups, self.place = window_groups(self.windows)
        self.sizes = [sum(1 for g, _ in self.place if g == i) for i in range(len(self.groups))]
        if not self.buffers:
            self.buffers = [None] * len(self.groups)

    def capacity(self, i: int) -> int:
        buf = self.buffers[self.place[i][0]]
        return 0 if buf is None else buf.shape[2]

    def layer_kv(self, i: int) -> tuple[mx.array, mx.array]:
        """Layer `i`'s key and value buffers `[B, kv_heads, capacity, head_dim]` (views), with
        every stored position written."""
        self.flush()
        g, j = self.place[i]
        return layer_kv(self.buffers[g], j, self.kv_heads)

    def flush(self) -> None:
        """Settle the last step's pending writes (`settle`)."""
        if self.pending is not None:
            self.buffers = settle(self.buffers, self.pending)
            self.pending = None

    def reserve(self, end: int, batch: int) -> None:
        """Make room for positions `< end`: global buffers hold `end` slots, sliding ones
        `min(end, window)` (beyond that the ring reuses slots)."""
        for g, window in enumerate(self.groups):
            need = end if window is None else min(end, window)
            buf = self.buffers[g]
            have = 0 if buf is None else buf.shape[2]
            if need <= have:
                continue
            self.flush()  # the bigger buffer copies the old one: after every write to it
            buf = self.buffers[g]
            cap = grown_capacity(need, have, self.chunk)
            if window is not None:
                cap = min(cap, window)
            pad = mx.zeros((2 * self.sizes[g], batch * self.kv_heads, cap - have, self.head_dim), mx.float32)
            self.buffers[g] = pad if buf is None else mx.concatenate([buf, pad], axis=2)

    def slot_positions(self, i: int) -> mx.array:
        """Absolute position held by each slot of layer `i` (-1 where nothing is stored yet)."""
        slots = mx.arange(self.capacity(i))
        last = self.offset - 1
        window = self.windows[i]
        pos = slots if window is None else last - mx.remainder(last - slots, window)
        return mx.where(slots < self.offset, pos, -1)


def layer_kv(buffer: mx.array, j: int, kv_heads: int) -> tuple[mx.array, mx.array]:
    """Keys and values `[B, kv_heads, capacity, head_dim]` of a window buffer's layer j (views).

    Sliced with ranges: MLX runs an integer index (`buffer[2 * j]`) as a gather, a launch and a
    copy of the layer's keys each step."""
    _, bh, cap, d = buffer.shape
    shape = (bh // kv_heads, kv_heads, cap, d)
    return buffer[2 * j : 2 * j + 1].reshape(shape), buffer[2 * j + 1 : 2 * j + 2].reshape(shape)


def stacked_kv(pairs: list[tuple[mx.array, mx.array]]) -> mx.array:
    """`[(k, v) [B, HK, T, D] per layer]` -> `[2 * layers, B * HK, T, D]` in one concatenation."""
    b, hk, t, d = pairs[0][0].shape
    flat = mx.concatenate([a for pair in pairs for a in pair], axis=0)
    return flat.reshape(2 * len(pairs), b * hk, t, d)


def settle(buffers: list[mx.array], pending: tuple[list[mx.array], list[mx.array]]) -> list[mx.array]:
    """The buffers once a step's `pending` writes are done: `(stacks, slots)` written here, or
    `(outputs, [])` of launches that wrote in place, which the returned buffers (the same memory)
    then depend on (`mx.depends`, no launch). Without that edge MLX could run a later step's
    launches before an earlier one's wherever the later input does not come from the earlier
    output (teacher-forced steps, one lazy graph): reads before the writes they need, or a write
    over a slot an earlier step still reads."""
    stacks, slots = pending
    if not slots:
        return mx.depends(buffers, stacks)
    return write_stacks(buffers, stacks, slots)


def write_stacks(buffers: list[mx.array], stacks: list[mx.array], slots: list[mx.array]) -> list[mx.array]:
    """`stacks[g] [2 * layers of g, B * HK, 1, D]` into slot `slots[g]` of `buffers[g]`, one update
    each: one slot for every batch row, or `[B]` slots, one a row (sessions at their own positions)."""
    return [_write_slot(buf, stack, slot) for buf, stack, slot in zip(buffers, stacks, slots)]


def _write_slot(buffer: mx.array, stack: mx.array, slot: mx.array) -> mx.array:
    if slot.size == 1:
        return mx.slice_update(buffer, stack, mx.reshape(slot, (1,)), axes=(2,))
    per_row = stack.shape[1] // slot.size  # the K/V heads of a batch row
    index = mx.broadcast_to(mx.repeat(slot, per_row).reshape(1, -1, 1, 1), stack.shape)
    return mx.put_along_axis(buffer, index, stack, axis=2)


def write_step_kv(buffers: list[mx.array], new_kv: list[list[tuple[mx.array, mx.array]]],
                  slots: list[mx.array]) -> list[mx.array]:
    """A step's cache writes: window g's new keys and values (`new_kv[g]`, a (k, v) `[B, HK, 1, D]`
    per layer of the window, in order) into slot `slots[g]` of `buffers[g]`, one update each."""
    return write_stacks(buffers, [stacked_kv(kv) for kv in new_kv], slots)


class Backbone(nn.Module):
    """`layers.N.*` and `norm`: the Gemma-3 stack without embeddings or head."""

    def __init__(self, cfg: TTSConfig):
        super().__init__()
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.layers]

    def norm_after(self, i: int) -> OffsetRMSNorm:
        """The norm that reads layer i's output: the next layer's input norm, or the final one."""
        return self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm

    def _qkv_after(self, i: int):
        """The next layer's stacked q/k/v layer (None for the last layer or unstacked)."""
        return self.layers[i + 1].self_attn._qkv if i + 1 < len(self.layers) else None

    def _layer_input(self, attn: Attention, z, qkv, offset):
        """q, k, v of a layer from its normed input z, or from its q/k/v projection already made."""
        return attn.project(z, offset) if qkv is None else attn.heads(qkv, offset)

    def _next(self, layer: DecoderLayer, i: int, h: mx.array, attn_out: mx.array, sessions: int = 1):
        """(h, z, qkv) after layer i: z the next norm's output, or qkv the next layer's projection."""
        next_qkv = self._qkv_after(i)
        h, out = layer.after_attention(h, attn_out, self.norm_after(i), next_qkv, sessions)
        return (h, None, out) if next_qkv is not None else (h, out, None)

    def writes_cache_in_place(self) -> bool:
        """Whether a step's attention launches store every layer's new key and value in the cache's
        buffers themselves (CUDA, our kernels): then no update op touches the buffers. An update
        cannot be done in place on CUDA while launches that read the buffer are in flight (MLX keeps
        their inputs until they complete), which a pipelined loop always has when the device runs
        behind: it copied all of the K/V every step (~0.8 GB at 120 s)."""
        return not use_reference() and all(layer.self_attn.fuses_step() for layer in self.layers)

    def make_cache(self, chunk: int = DEFAULT_CHUNK) -> BackboneCache:
        attn = self.layers[0].self_attn
        return BackboneCache(self.windows, attn.n_kv_heads, attn.head_dim, chunk)

    # ------------------------------------------------------------------ multi-token (prefill)

    def prefill(self, x: mx.array, cache: BackboneCache) -> mx.array:
        """Run `x [B, T, hidden]` at positions `cache.offset ..` (causal, windowed) and store its
        keys; returns the final-norm hidden states `[B, T, hidden]`."""
        b, t, _ = x.shape
        cache.flush()
        start = cache.offset
        query_pos = mx.arange(start, start + t)[:, None]
        h = x.astype(mx.float32)
        z, qkv = self.layers[0].input_layernorm(h), None
        new_kv = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._layer_input(attn, z, qkv, start)
            if cache.capacity(i):
                old_k, old_v = cache.layer_kv(i)
                key_pos = mx.concatenate([cache.slot_positions(i), mx.arange(start, start + t)])
                k_all = mx.concatenate([old_k, k], axis=2)
                v_all = mx.concatenate([old_v, v], axis=2)
            else:
                key_pos, k_all, v_all = mx.arange(start, start + t), k, v
            mask = (key_pos[None, :] >= 0) & (key_pos[None, :] <= query_pos)
            if layer.window is not None:
                mask = mask & (key_pos[None, :] > query_pos - layer.window)
            h, z, qkv = self._next(layer, i, h, attn.attend(q, k_all, v_all, mask))
            new_kv.append((k, v))
        cache.reserve(start + t, b)
        positions = mx.arange(start, start + t)
        for g, window in enumerate(cache.groups):
            update = stacked_kv([kv for kv, (group, _) in zip(new_kv, cache.place) if group == g])
            pos = positions
            if window is not None and t > window:  # only the last `window` keys are ever seen again
                update, pos = update[:, :, -window:], positions[-window:]
            slots = pos if window is None else mx.remainder(pos, window)
            cache.buffers[g][:, :, slots] = update
        cache.offset = start + t
        return z

    # ------------------------------------------------------------------ one token

    def step_arrays(self, x: mx.array, offset: mx.array, buffers: list[mx.array], pending=None, sessions: int = 1):
        """Pure function of arrays (compilable): one token `x [B, 1, hidden]` at position
        `offset` (int32 scalar array) with the cache's `buffers` and `pending` writes (see
        `BackboneCache`); returns `(hidden [B, 1, hidden], buffers', pending')`. With `sessions`
        S > 1, x holds S sessions' CFG pairs (B = 2 S: session s at rows 2s, 2s + 1) and `offset [S]`
        each session's position; each pair's rows get the bits that pair gets stepped alone.

        The previous step's pending writes are settled first (`settle`). Each layer then attends
        over its buffer with the new position's slot holding its new key (the attention takes that
        key beside the buffer); the new keys and values of a window's layers are stacked into this
        step's pending write, or, where `writes_cache_in_place`, the attention launches store them
        and pending' holds those launches' key outputs. The buffers must already have room
        (`BackboneCache.reserve(offset + 1)`)."""
        in_place = self.writes_cache_in_place()
        if pending is not None:
            buffers = settle(buffers, pending)
        groups, place = window_groups(self.windows)
        h = x.astype(mx.float32)
        if sessions > 1:  # a position a row: each session's for both rows of its pair
            offset = mx.repeat(offset, 2)
        first = self.layers[0]
        if first.self_attn._qkv is not None:  # the input norm and q/k/v in one launch (CUDA)
            h, qkv = norm_linear(h, first.input_layernorm, first.self_attn._qkv, sessions=sessions)
            z = None
        else:
            z, qkv = first.input_layernorm(h), None
        slots = [offset if window is None else mx.remainder(offset, window) for window in groups]
        masks = {}  # buffers of one capacity share the mask
        new_kv: list[list] = [[] for _ in groups]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            g, j = place[i]
            capacity = buffers[g].shape[2]
            if capacity not in masks:
                masks[capacity] = (mx.arange(capacity) <= offset if sessions == 1
                                   else (mx.arange(capacity)[None] <= offset[:, None])[:, None, None, :])
            old_k, old_v = layer_kv(buffers[g], j, attn.n_kv_heads)
            out, k, v = attn.attend_step_from(z, qkv, old_k, old_v, offset, masks[capacity], slots[g],
                                              write_cache=in_place, sessions=sessions)
            h, z, qkv = self._next(layer, i, h, out, sessions)
            new_kv[g].append((k, v))
        if in_place:
            return z, buffers, ([k for kv in new_kv for k, _ in kv], [])
        return z, buffers, ([stacked_kv(kv) for kv in new_kv], slots)

    def step(self, x: mx.array, cache: BackboneCache, step_fn=None) -> mx.array:
        """One token through the stack with the caches (uncompiled unless `step_fn` is given)."""
        cache.reserve(cache.offset + 1, x.shape[0])
        fn = step_fn or self.step_arrays
        h, cache.buffers, cache.pending = fn(x, mx.array(cache.offset, mx.int32), cache.buffers, cache.pending)
        cache.offset += 1
        return h
