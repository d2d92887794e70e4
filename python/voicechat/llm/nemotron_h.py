"""Nemotron-H (Mamba-2 / attention / MLP hybrid) with the duplex model's fused input and two heads.

Key tree below `stt_model.`:

    embed_tokens                     Embedding(vocab, H)          (quantized in the published files)
    llm.layers.{i}.norm              RMSNorm(H), eps 1e-5
    llm.layers.{i}.mixer.*           Mamba-2 ('M'), attention ('*') or MLP ('-'), per hybrid_override_pattern
    llm.norm_f                       RMSNorm(H)
    lm_head, function_head           Linear(H, vocab, bias=False)

Every block is `x + mixer(RMSNorm(x))` (on the GEMV path the add rides in the mixer's last
projection, and the MLP's squared ReLU in its up projection). On the decode kernels' path no norm
is a launch of its own: a mixer's last projection also leaves the next block's RMSNorm half done
(its input times the weight, and partial sums of squares) for that block's first projection to
finish, and the Mamba conv + scan kernel does the same with the mixer's gated group norm for
out_proj (`voicechat.kernels.gemv.Prenormed`). The LLM never looks up token ids:
it runs on embeddings (`DuplexLM.fused_input` builds them). Activations are float32 whatever the
weight dtype.

After loading, `voicechat.prepare.prepare_lm` casts quantization scales / biases and the small
vectors to float32 once (`DuplexLM.cast_for_decoding`), so that no step casts weights again, and
swaps in the GEMV layers on a CUDA GPU.

Decoding state lives in a `NemotronHCache` (`NemotronH.make_cache()`): one entry per layer, a
`MambaCache` (conv window + SSM state), a `KVCache` or None (MLP). A session owns it; `copy()`
snapshots it (the Mamba states are shared, as no step writes them in place; the K/V buffers are
copied) and `reset()` empties it. The same call handles a many-position prefix and a one-position step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..cache_growth import grown_capacity
from ..config import TextConfig
from ..kernels.causal_conv import causal_conv_silu
from ..kernels.decode_attention import decode_attention, plain_kernel_takes
from ..kernels.gated_rms_norm import gated_rms_norm
from ..kernels.gemv import Prenormed, fuses_prenormed, linear, stack_linears, two_head_argmax
from ..kernels.mamba_scan import mamba_conv_scan_step, mamba_scan_packed

# --------------------------------------------------------------------------- caches


class MambaCache:
    """The last `conv_kernel - 1` conv inputs [b, K-1, C] and the SSM state [b, H, P, N] (float32)."""

    def __init__(self, conv: mx.array | None = None, ssm: mx.array | None = None):
        self.conv = conv
        self.ssm = ssm

    def copy(self) -> "MambaCache":
        return MambaCache(self.conv, self.ssm)

    def reset(self) -> None:
        self.conv = None
        self.ssm = None

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv, self.ssm) if a is not None]


class KVCache:
    """Keys and values [b, kv_heads, capacity, head_dim], grown in `step`-position chunks by at least
    a quarter (`cache_growth`).

    Eager updates rebind the attributes (functional `slice_update`). The compiled decode step on
    CUDA writes the new position's slot in place instead, which MLX does not see: `pending` is then
    that step's attention output, which every later reader of the buffers must wait for (the next
    compiled step makes its buffers depend on it; `settle()` does so for any other reader).
    `copy()` copies the buffers, so that two copies stepping on never write into each other's slots.
    """

    step = 256

    def __init__(self, keys: mx.array | None = None, values: mx.array | None = None, offset: int = 0):
        self.keys = keys
        self.values = values
        self.offset = offset
        self.pending: mx.array | None = None

    def settle(self) -> None:
        """Make the buffers depend on the last in-place write (`pending`), for readers outside the
        compiled step (no launch)."""
        if self.pending is not None and self.keys is not None:
            self.keys, self.values = mx.depends([self.keys, self.values], [self.pending])
        self.pending = None

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append k, v [b, kv_heads, L, head_dim]; return every cached position."""
        self.settle()
        start, length = self.offset, k.shape[2]
        end = start + length
        self.reserve(end, k.shape[0], k.shape[1], k.shape[3], k.dtype)
        at = mx.array([start], dtype=mx.int32)
        self.keys = mx.slice_update(self.keys, k, at, axes=(2,))
        self.values = mx.slice_update(self.values, v, at, axes=(2,))
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reserve(self, end: int, batch: int, heads: int, dim: int, dtype=mx.float32) -> None:
        """Make room for positions `< end` (capacity grows in `step`-slot chunks, by at least a
        quarter: `cache_growth`)."""
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        self.settle()
        capacity = grown_capacity(end, 0 if self.keys is None else self.keys.shape[2], self.step)
        self.keys = self._grown(self.keys, (batch, heads, capacity, dim), dtype)
        self.values = self._grown(self.values, (batch, heads, capacity, dim), dtype)

    def _grown(self, old: mx.array | None, shape: tuple[int, ...], dtype) -> mx.array:
        new = mx.zeros(shape, old.dtype if old is not None else dtype)
        if old is not None and self.offset:
            new[:, :, : self.offset] = old[:, :, : self.offset]
        return new

    @staticmethod
    def attention_mask(length: int):
        """SDPA mask for `length` new queries over the keys `update` returned."""
        return "causal" if length > 1 else None

    def copy(self) -> "KVCache":
        self.settle()
        return KVCache(own_buffer(self.keys), own_buffer(self.values), self.offset)

    def reset(self) -> None:
        self.keys = self.values = self.pending = None
        self.offset = 0

    @property
    def state(self) -> list[mx.array]:
        """The buffers (a pending write is evaluated with the step's ids, which depend on it)."""
        return [a for a in (self.keys, self.values) if a is not None]


@functools.cache
def _nothing_pending() -> mx.array:
    """What a compiled step's buffers wait for when no write is pending: an evaluated array of its
    own, not the buffers themselves (with the keys passed for both, lazily evaluated teacher-forced
    steps can part from stepped ones on a GPU)."""
    nothing = mx.zeros((1,))
    mx.eval(nothing)
    return nothing


def own_buffer(a: mx.array | None) -> mx.array | None:
    """The same values in a buffer of their own (mx.array(a) would share a's): a select of a with
    itself, bit for bit."""
    return None if a is None else mx.where(mx.array(True), a, a)


class BufferKV:
    """A `KVCache`'s whole buffers inside the compiled decode step: the position is an array, so
    the step's shapes stay fixed while the cache fills (keys past the position are masked out).
    On CUDA the attention launch writes the new position into the buffers in place
    (`Attention.__call__`); elsewhere `update` does. The position is one for every row ([1]) or one
    a row ([b]: sessions stepped together, each row's key written at its own position)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, masks: dict | None = None,
                 pending: mx.array | None = None):
        # The buffers wait for the previous step's in-place write (see KVCache).
        if pending is not None:
            keys, values = mx.depends([keys, values], [pending])
        self.keys, self.values, self.offset, self.pending = keys, values, offset, pending
        self.written: mx.array | None = None  # this step's attention output, when it wrote the buffers
        # Shared by the step's attention layers: buffers of one capacity need one mask a step.
        self._masks = {} if masks is None else masks

    @property
    def per_row(self) -> bool:
        return self.offset.size > 1

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.per_row:  # k, v [b, HK, 1, D] into slot offset[r] of row r
            b, hk, _, d = k.shape
            at = mx.broadcast_to(self.offset.reshape(b, 1, 1, 1), (b, hk, 1, d))
            self.keys = mx.put_along_axis(self.keys, at, k, axis=2)
            self.values = mx.put_along_axis(self.values, at, v, axis=2)
            return self.keys, self.values
        self.keys = mx.slice_update(self.keys, k, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, v, self.offset, axes=(2,))
        return self.keys, self.values

    def attention_mask(self, length: int) -> mx.array:
        """Query i (at position offset + i) sees the slots <= its position: [length, capacity], or
        for a position a row (one query each) [b, 1, 1, capacity]."""
        key = (self.keys.shape[2], length, self.per_row)
        if key not in self._masks:
            slots = mx.arange(self.keys.shape[2])
            if self.per_row:
                if length != 1:
                    raise ValueError("a position a row steps one query a row")
                self._masks[key] = (slots[None] <= self.offset[:, None])[:, None, None, :]
            else:
                self._masks[key] = slots[None] <= (self.offset + mx.arange(length))[:, None]
        return self._masks[key]


class NemotronHCache(list):
    """Per-layer caches of one decoding session (None for MLP layers). `position` is the next
    position as an int32 device array [1] once a compiled step made it (valid while `position_at`
    equals `offset`)."""

    position: mx.array | None = None
    position_at: int = -1

    def copy(self) -> "NemotronHCache":
        new = NemotronHCache(c.copy() if c is not None else None for c in self)
        new.position, new.position_at = self.position, self.position_at
        return new

    def reset(self) -> None:
        self.position, self.position_at = None, -1
        for c in self:
            if c is not None:
                c.reset()

    @property
    def state(self) -> list[mx.array]:
        """Every array the caches hold (to `mx.eval` after a step)."""
        return [a for c in self if c is not None for a in c.state]

    @property
    def offset(self) -> int:
        """Positions seen so far (from the attention caches; 0 without attention layers)."""
        for c in self:
            if isinstance(c, KVCache):
                return c.offset
        return 0


# --------------------------------------------------------------------------- fused elementwise chains


@mx.compile
def _float32(a: mx.array) -> mx.array:
    return a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a


@mx.compile
def _fuse(text: mx.array, audio: mx.array, function: mx.array, weight: float) -> mx.array:
    return text.astype(mx.float32) + audio.astype(mx.float32) + weight * function.astype(mx.float32)


# --------------------------------------------------------------------------- mixers


def _last_projection(layer: nn.Module, x, residual: mx.array | None, emit_norm: nn.RMSNorm | None):
    """`(layer(x) + residual, the next block's norm left half done or None)`: the mixers' end."""
    if emit_norm is None or residual is None:
        return linear(layer, x, residual=residual), None
    return linear(layer, x, residual=residual, emit_norm=emit_norm)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads = cfg.mamba_num_heads
        self.head_dim = cfg.mamba_head_dim
        self.n_groups = cfg.n_groups
        self.state_size = cfg.ssm_state_size
        self.inner = cfg.mamba_inner_size
        self.conv_dim = cfg.mamba_conv_dim
        self.kernel = cfg.conv_kernel
        self.eps = cfg.layer_norm_epsilon
        self._time_step_limit = tuple(cfg.time_step_limit)
        self._conv_has_bias = cfg.use_conv_bias
        self._dt_offset = self.inner + self.conv_dim  # in_proj: gate | conv input (x, B, C) | dt

        self.in_proj = nn.Linear(cfg.hidden_size, cfg.mamba_in_proj_size, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = mx.ones((self.num_heads,))
        self.A_log = mx.zeros((self.num_heads,))
        self.D = mx.ones((self.num_heads,))
        self.norm = nn.RMSNorm(self.inner, eps=self.eps)  # holds the gated norm's weight (gated_rms_norm)
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def __call__(self, x, cache: MambaCache | None, residual: mx.array | None = None,
                 emit_norm: nn.RMSNorm | None = None):
        """x [b, L, H] (or `Prenormed`) -> (mixer output (+ residual), `emit_norm` of it left half done or None)."""
        b, L, _ = x.shape
        projected = linear(self.in_proj, x)  # gate | x B C | dt

        conv_state = cache.conv if cache is not None and cache.conv is not None else \
            mx.zeros((b, self.kernel - 1, self.conv_dim), mx.float32)
        conv_bias = self.conv1d.bias if self._conv_has_bias else None
        ssm = cache.ssm if cache is not None else None
        if L == 1:  # the decode step: conv and scan in one launch on CUDA
            # Where out_proj applies a norm's scales in its own launch, the gated norm rides along.
            carry = fuses_prenormed(self.out_proj, projected)
            y, ssm, conv_state = mamba_conv_scan_step(
                projected, conv_state, self.inner, self.conv1d.weight, conv_bias, self._dt_offset, self.A_log,
                self.D, self.dt_bias, ssm, self.num_heads, self.head_dim, self.n_groups, self.state_size,
                self._time_step_limit, gated_norm=(0, self.norm.weight, self.eps) if carry else None)
        else:
            xbc, conv_state = causal_conv_silu(conv_state, projected, self.inner, self.conv1d.weight, conv_bias)
            # The scan reads x, B, C from the conv output and dt from the projection in place.
            y, ssm = mamba_scan_packed(
                xbc, projected, self._dt_offset, self.A_log, self.D, self.dt_bias, ssm, self.num_heads,
                self.head_dim, self.n_groups, self.state_size, self._time_step_limit)
            y = y.reshape(b, L, self.inner)
        if cache is not None:
            cache.conv, cache.ssm = conv_state, ssm

        if not isinstance(y, Prenormed):
            # RMSNorm over groups of y * silu(gate), the gate read in place from the projection.
            y = gated_rms_norm(y, projected, 0, self.norm.weight, self.n_groups, self.eps)
        return _last_projection(self.out_proj, y, residual, emit_norm)


class Attention(nn.Module):
    """Grouped-query causal attention, no positional encoding."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self._qkv = None  # q, k and v as one layer (`stack()`); not in the key tree

    def stack(self) -> None:
        """Run q, k and v as one projection (one launch, and one wide GEMV instead of two narrow
        ones); the same values."""
        self._qkv = stack_linears([self.q_proj, self.k_proj, self.v_proj])

    def project(self, x) -> tuple[mx.array, mx.array, mx.array]:
        if self._qkv is None:
            return linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return tuple(mx.split(linear(self._qkv, x), [q_width, q_width + kv_width], axis=-1))

    def __call__(self, x, cache: KVCache | None, residual: mx.array | None = None,
                 emit_norm: nn.RMSNorm | None = None):
        """As `Mamba2Mixer.__call__`."""
        b, L, _ = x.shape
        q, k, v = self.project(x)
        q = q.reshape(b, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(b, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(b, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        # "causal" aligns the last query with the last key, so it also covers a prefix after a cache.
        mask = "causal" if L > 1 else None
        if isinstance(cache, BufferKV) and L == 1 and plain_kernel_takes(q, cache.keys, cache.values, (k, v)):
            # The compiled decode step on CUDA: the attention launch stores the new key and value in
            # the buffers itself (an update op would copy each whole buffer, still held by the launches
            # of the step before); what reads the buffers next waits for that launch (mx.depends).
            # Chunked at every capacity: a session's step then has the same bits whatever capacity
            # its buffers have (alone, or in rows as long as the longest session's).
            o = decode_attention(q, cache.keys, cache.values, cache.offset, self.scale, new=(k, v, cache.offset),
                                 write_cache=True, chunked=True)
            cache.written = o
            return _last_projection(self.o_proj, o, residual, emit_norm)
        if cache is not None:
            k, v = cache.update(k, v)
            mask = cache.attention_mask(L)
        if isinstance(cache, BufferKV) and L == 1:  # the compiled decode step: decode_attention's kernel on CUDA
            o = decode_attention(q, k, v, cache.offset, self.scale, mask)
        else:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            o = o.transpose(0, 2, 1, 3).reshape(b, L, -1)
        return _last_projection(self.o_proj, o, residual, emit_norm)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def __call__(self, x, cache: None = None, residual: mx.array | None = None,
                 emit_norm: nn.RMSNorm | None = None):
        """As `Mamba2Mixer.__call__`."""
        return _last_projection(self.down_proj, linear(self.up_proj, x, squared_relu=True), residual, emit_norm)


_MIXERS = {"mamba": Mamba2Mixer, "attention": Attention, "mlp": MLP}


class Block(nn.Module):
    def __init__(self, cfg: TextConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.mixer = _MIXERS[kind](cfg)

    def __call__(self, x: mx.array, cache, normed: Prenormed | None = None, next_norm: nn.RMSNorm | None = None):
        """`(x + mixer(norm(x)), next_norm of that left half done or None)`.

        The residual add rides in the mixer's last projection (one launch on the GEMV path;
        elsewhere `mixer(...) + x`, bit-identical to `x + mixer(...)`). `normed`: this block's norm
        as the previous block left it (its first projection finishes it), else MLX's rms_norm. (Formed
        whole inside the first projection's GEMV instead, the norm is slower: every row block would
        re-read x and the norm weight.)"""
        return self.mixer(normed if normed is not None else self.norm(x), cache, residual=x, emit_norm=next_norm)


# --------------------------------------------------------------------------- the stack


class NemotronH(nn.Module):
    """The hybrid stack on embeddings: [b, L, H] in, hidden states after norm_f out."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.config = cfg
        self.layers = [Block(cfg, kind) for kind in cfg.block_types]
        self.norm_f = nn.RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)

    def make_cache(self) -> NemotronHCache:
        kinds = {"mamba": MambaCache, "attention": KVCache, "mlp": lambda: None}
        return NemotronHCache(kinds[k]() for k in self.config.block_types)

    def __call__(self, embeds: mx.array, cache: list | None = None) -> mx.array:
        """embeds [b, L, H] -> hidden [b, L, H] (float32). With `cache`, continue from it and update it;
        without, run the sequence from an empty state."""
        x, _ = self.run_layers(embeds.astype(mx.float32), [None] * len(self.layers) if cache is None else cache)
        return self.norm_f(x)

    def run_layers(self, x: mx.array, cache: list, start: int = 0, end: int | None = None, normed=None):
        """Layers [start, end) on the residual stream x (float32), `cache` holding their entries:
        (x after them, the next layer's norm of it left half done (`Prenormed`) or None). `normed`:
        what layer `start - 1` left of layer `start`'s norm (decode kernels only)."""
        end = len(self.layers) if end is None else end
        for i, c in zip(range(start, end), cache):
            next_norm = self.layers[i + 1].norm if i + 1 < len(self.layers) else None
            x, normed = self.layers[i](x, c, normed, next_norm)
        return x, normed


# --------------------------------------------------------------------------- the duplex LM


# Layers in each compiled part of a decode step, first to last (the last part takes the rest). The
# first is small so that the device starts early; later ones grow, as the host builds and encodes a
# layer faster than the device runs it (~40 against ~60 us a layer at full size).
DECODE_PARTS = (2, 3, 4, 6, 9, 14)


def decode_parts(n_layers: int) -> list[tuple[int, int]]:
    """[first, last) layer ranges of the decode step's parts for a stack of n_layers."""
    bounds, first = [], 0
    for size in DECODE_PARTS:
        if first + size >= n_layers:
            break
        bounds.append((first, first + size))
        first += size
    return bounds + [(first, n_layers)]


class StepOutput(NamedTuple):
    text_ids: mx.array  # [b] greedy id of lm_head at the last position
    function_ids: mx.array  # [b] greedy id of function_head at the last position
    hidden: mx.array  # [b, L, H] after norm_f
    text_logits: mx.array  # [b, vocab] at the last position
    function_logits: mx.array  # [b, vocab]


class DuplexLM(nn.Module):
    """Token embedding, Nemotron-H and the text / function heads (keys below `stt_model.`)."""

    def __init__(self, text_cfg: TextConfig, function_channel_weight: float = 2.0):
        super().__init__()
        h, vocab = text_cfg.hidden_size, text_cfg.vocab_size
        self.function_channel_weight = float(function_channel_weight)
        self.embed_tokens = nn.Embedding(vocab, h)
        self.llm = NemotronH(text_cfg)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.function_head = nn.Linear(h, vocab, bias=False)
        self.decode_kernels = False  # both heads' argmax in one pass of our kernel (`voicechat.prepare`)

    def make_cache(self) -> NemotronHCache:
        return self.llm.make_cache()

    # ------------------------------------------------------------ compiled decode

    def decode(self, prev_text_ids: mx.array, audio: mx.array, prev_function_ids: mx.array,
               cache: NemotronHCache, queue: bool = True) -> tuple[mx.array, mx.array]:
        """One timeline position as a few compiled graphs: the fused input of the previous ids
        ([b, 1] each) and the audio frame [b, 1, H], every layer with `cache` (updated), and both
        heads' greedy ids (int32 [b] each). The same ids as `step(fused_input(...), cache)`.

        Compiled, a step costs a few calls from Python and its elementwise chains fuse. Its shapes
        must not change from step to step, so the attention layers see their whole cache buffers
        with the position as an array (keys past it masked out); the graphs are traced again only
        when the buffers grow (every `KVCache.step` positions).

        The layers run in parts (`DECODE_PARTS`), each compiled on its own. With `queue` each part
        but the last is queued (`mx.async_eval`) as soon as it is built, so that the device starts
        on the first layers while Python builds and encodes the rest: a step the caller waits on no
        longer waits for its whole graph to be built first (MLX-CUDA launches its work as CUDA
        graphs of many ops, so without this the device starts late in the step).
        `queue=False` leaves the whole step lazy (to count its ops, or to build several steps
        before one evaluation).
        """
        cfg = self.llm.config
        b, offset = audio.shape[0], cache.offset
        layer_state = []
        for layer, c in zip(self.llm.layers, cache):
            if layer.kind == "mamba":
                mixer = layer.mixer
                if c.conv is None:
                    c.conv = mx.zeros((b, mixer.kernel - 1, mixer.conv_dim), mx.float32)
                if c.ssm is None:
                    c.ssm = mx.zeros((b, mixer.num_heads, mixer.head_dim, mixer.state_size), mx.float32)
                layer_state.append([c.conv, c.ssm])
            elif layer.kind == "attention":
                c.reserve(offset + 1, b, cfg.num_key_value_heads, cfg.head_dim)
                layer_state.append([c.keys, c.values, _nothing_pending() if c.pending is None else c.pending])
            else:
                layer_state.append([])
        # The position as the last step computed it on the device: an array made on the host for
        # each step would be read from host-written memory by every attention launch.
        position = cache.position if cache.position_at == offset else mx.array([offset], mx.int32)
        text, function, cache.position, new_state = self.decode_rows(prev_text_ids, audio, prev_function_ids,
                                                                     position, layer_state, queue)
        cache.position_at = offset + 1
        arrays = iter(new_state)
        for c in cache:
            if isinstance(c, MambaCache):
                c.conv, c.ssm = next(arrays), next(arrays)
            elif isinstance(c, KVCache):
                c.keys, c.values, c.pending, c.offset = next(arrays), next(arrays), next(arrays), offset + 1
        return text, function

    def decode_rows(self, prev_text_ids: mx.array, audio: mx.array, prev_function_ids: mx.array,
                    position: mx.array, layer_state: list[list[mx.array]], queue: bool = True):
        """`decode`'s compiled parts on a state given layer by layer (a Mamba layer's conv and SSM
        states, an attention layer's key and value buffers and what their last in-place write was,
        nothing for an MLP), at `position` (int32, [1] for every row, or [b]: a position a row, as
        sessions stepped together are). Returns (text ids [b], function ids [b], the next position,
        the new state flat, layer by layer). A row's ops are those it gets alone: the attention
        takes each row's own position (chunked: not the buffers' capacity), and on a CUDA GPU the
        kernels give a row the bits they give it alone at the rows they take (1, 2 or 4)."""
        if getattr(self, "_decode_fns", None) is None:
            self._decode_fns = [(first, last, mx.compile(functools.partial(self._decode_part, first, last)))
                                for first, last in decode_parts(len(self.llm.layers))]
        carry = [prev_text_ids, audio, prev_function_ids]
        new_state = []
        for first, last, fn in self._decode_fns:
            state = [a for per_layer in layer_state[first:last] for a in per_layer]
            out = fn(carry, position, state)
            carry, part_state = out[: len(out) - len(state)], out[len(out) - len(state):]
            new_state += part_state
            if queue and last < len(self.llm.layers):
                mx.async_eval(carry, part_state)
        text, function, position = carry
        return text, function, position, new_state

    def _decode_part(self, first: int, last: int, carry: list, offset: mx.array, state: list) -> list:
        """Layers [first, last) of a decode step (compiled per part by `decode`). carry: the previous
        ids and the audio frame for the first part, else the residual stream and what the layer
        before left of this part's first norm (its `Prenormed` arrays, when the kernels made one).
        Returns the next part's carry (the last part's: both ids and the next position), then the
        layers' new cache state."""
        layers = self.llm.layers
        if first == 0:
            x, normed = self.fused_input(*carry).astype(mx.float32), None
        else:
            x, *pre = carry
            normed = Prenormed(pre[0], pre[1], 1, layers[first].norm.eps) if pre else None
        arrays = iter(state)
        caches, masks = [], {}
        for layer in layers[first:last]:
            if layer.kind == "mamba":
                caches.append(MambaCache(next(arrays), next(arrays)))
            elif layer.kind == "attention":
                caches.append(BufferKV(next(arrays), next(arrays), offset, masks, pending=next(arrays)))
            else:
                caches.append(None)
        x, normed = self.llm.run_layers(x, caches, first, last, normed)
        # An attention layer hands back its buffers and what the next step must wait for: its
        # attention output when that wrote the buffers in place, else what this step waited for.
        new_state = [a for c in caches if c is not None
                     for a in ((c.conv, c.ssm) if isinstance(c, MambaCache) else
                               (c.keys, c.values, c.pending if c.written is None else c.written))]
        if last < len(layers):
            if normed is not None and normed.groups != 1:
                raise AssertionError("a block hands the next one a plain RMSNorm (one group)")
            return [x, *((normed.weighted, normed.partials) if normed is not None else ()), *new_state]
        text, function = self.greedy(self.llm.norm_f(x)[:, -1])
        return [text.astype(mx.int32), function.astype(mx.int32), offset + 1, *new_state]

    def cast_for_decoding(self, keep_quantization_scales: bool = False) -> "DuplexLM":
        """Load-time casts for decoding; call once after loading weights (`voicechat.prepare`
        does, and swaps in the GEMV layers). Returns self.

        Activations are float32, so every op mixing them with bf16 quantization scales / biases,
        norm weights or Mamba vectors would cast those to float32 on every step (for the scales of
        the two 131072-wide heads alone, a full copy per step). Cast them once here instead; the
        values are unchanged (bf16 -> float32 is exact). Packed 4/8-bit weights stay as they are,
        and so do dense matrices (a bf16 checkpoint keeps its memory; its GEMVs promote per call).
        `keep_quantization_scales` leaves the scales and biases of quantized layers as stored, for
        the GEMV layers, which read them in bf16.
        """
        from mlx.utils import tree_flatten, tree_unflatten

        def small(path: str, a: mx.array) -> mx.array:
            name = path.rsplit(".", 1)[-1]
            dense_matrix = a.ndim == 2 and name == "weight" and a.dtype != mx.uint32
            quant_param = name in ("scales", "biases") and keep_quantization_scales
            keep = dense_matrix or quant_param or not mx.issubdtype(a.dtype, mx.floating) or a.dtype == mx.float32
            return a if keep else a.astype(mx.float32)

        # Only this network's parts: a subclass (the listening model) adds modules with rules of their own.
        # The embedding always dequantizes in float32 (a lookup, not a GEMV: bf16 scales would round it).
        for part in (self.embed_tokens, self.llm, self.lm_head, self.function_head):
            params = [(k, small(k, v) if part is not self.embed_tokens else _float32(v))
                      for k, v in tree_flatten(part.parameters())]
            part.update(tree_unflatten(params))
            mx.eval(part.parameters())
        return self

    def embed(self, ids: mx.array) -> mx.array:
        """Token embeddings in float32 (the system prompt enters the audio channel this way)."""
        return self.embed_tokens(ids).astype(mx.float32)

    def fused_input(self, prev_text_ids: mx.array, audio_frames: mx.array, prev_function_ids: mx.array) -> mx.array:
        """E(prev_text) + audio + w * E(prev_function), float32; ids [b, L], audio [b, L, H].

        Both id rows go through one embedding lookup.
        """
        n = prev_text_ids.shape[-1]
        both = self.embed_tokens(mx.concatenate([prev_text_ids, prev_function_ids], axis=-1))
        return _fuse(both[..., :n, :], audio_frames, both[..., n:, :], self.function_channel_weight)

    def heads(self, last: mx.array) -> tuple[mx.array, mx.array]:
        """Text and function logits of hidden states [..., H]."""
        return self.lm_head(last), self.function_head(last)

    def step(self, fused: mx.array, cache: list | None = None) -> StepOutput:
        """Run fused [b, L, H] through the LLM (updating `cache`), greedy ids of both heads at the
        last position. Nothing is evaluated here."""
        hidden = self.llm(fused, cache)
        logits = self.heads(hidden[:, -1])  # lazy: computed only if read
        return StepOutput(*self.greedy(hidden[:, -1], logits), hidden, *logits)

    def greedy(self, last: mx.array, logits: tuple[mx.array, mx.array] | None = None) -> tuple[mx.array, mx.array]:
        """Both heads' greedy ids of hidden states [b, H] (after norm_f); `logits`: the heads' output
        on `last` when the caller already built it (the argmax then reads it)."""
        if self.decode_kernels:
            ids = two_head_argmax(last, self.lm_head, self.function_head)  # one pass, no logits written
            return ids[..., 0], ids[..., 1]
        text_logits, function_logits = self.heads(last) if logits is None else logits
        return mx.argmax(text_logits, axis=-1), mx.argmax(function_logits, axis=-1)

    __call__ = step


# --------------------------------------------------------------------------- op budget


def count_step_ops(lm: DuplexLM, length: int = 1, cache: NemotronHCache | None = None):
    """Primitives one decode call runs: fused input from previous ids + `length` positions + both
    heads' argmax + the cache update, after a warm-up step (weights and cache evaluated).

    Returns a Counter of primitive names (see `voicechat.llm.opcount.kernel_count`).
    """
    from .opcount import count_ops

    h = lm.llm.config.hidden_size
    mx.eval(lm.parameters())
    cache = lm.make_cache() if cache is None else cache
    ids = mx.full((1, length), 12, dtype=mx.int32)
    audio = mx.zeros((1, length, h), mx.float32)
    warm = lm.step(lm.fused_input(ids[:, :1], audio[:, :1], ids[:, :1]), cache)
    mx.eval(warm.text_ids, cache.state, ids, audio)
    out = lm.step(lm.fused_input(ids, audio, ids), cache)
    return count_ops(out.text_ids, out.function_ids, cache.state)
