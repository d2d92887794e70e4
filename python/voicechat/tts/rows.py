"""EAR-TTS's frame step for many sessions at once: each session's CFG pair as two rows of one batch.

`TTSRows` holds every slot's TTS state in batched arrays: per window group the keys and values
`[2 * layers, 2 S * kv_heads, capacity, head_dim]` (slot s's conditioned row at batch row 2s, its
unconditioned row at 2s + 1, each position in the slot a single session's cache puts it in), and
each slot's position, previous codes and generator key. A step runs the same computation as
`EarTTS.step` on every row (one compiled graph per slot count and capacity): the code embedding
and gated fusion per session, the backbone on the 2S rows with each row's RoPE position, attention
mask and key slot, then per session the guided MoG draws (its own generator key: the draws a
session makes are those it makes alone) and the RVQ searches. Rows that are not `active` keep
their codes, key and position.

Exactness rests on the same property as `voicechat.llm.rows`: each row goes through the ops the
single-session step runs on it, and slots past a row's position are masked out (exact zeros).
The single-session kernels (one CFG pair, one position) are not used: on a GPU the rows take
MLX's own ops; the RVQ search takes the same C++ loop on a CPU. `insert` writes a single session's
state into a row pair, `take` hands a row pair back as one (a session alone steps on `EarTTS.step`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels.decode_attention import decode_attention_reference
from ..kernels.gemv import on_cuda_gpu
from ..kernels.mog_sample import choose_component, component_mean
from ..kernels.rvq import rvq_search
from .backbone import BackboneCache, layer_kv, stacked_kv, window_groups
from ..llm.nemotron_h import own_buffer
from .ear_tts import EarTTS, frame_noise


class TTSRows:
    """Every slot's EAR-TTS state (see the module docstring)."""

    def __init__(self, tts: EarTTS, slots: int, chunk: int):
        tts.prepare()
        self.tts = tts
        attn = tts.backbone.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self.groups, self.place = window_groups(tts.backbone.windows)
        self.sizes = [sum(1 for g, _ in self.place if g == i) for i in range(len(self.groups))]
        self.chunk = chunk
        self.capacities = [0] * len(self.groups)
        self.buffers: list[mx.array] = []
        self.slots = 0
        self.positions = np.zeros(0, np.int32)
        q = tts.cfg.num_quantizers
        self.previous_code = mx.zeros((0, 1, q), mx.int32)
        self.keys = mx.zeros((0, 2), mx.uint32)
        # The RVQ search of a CPU step is the C++ loop for any row count, as a single session's is.
        self._rvq_method = "auto" if on_cuda_gpu() else "fused"
        self._step_fn = mx.compile(self._step_graph)
        self._reserve(1)
        self.resize(slots)

    # ------------------------------------------------------------------ rows

    def _capacity(self, g: int, end: int) -> int:
        cap = -(-end // self.chunk) * self.chunk
        return cap if self.groups[g] is None else min(cap, self.groups[g])

    def _reserve(self, end: int) -> None:
        """Room for positions `< end` in every row (as `BackboneCache.reserve` makes it)."""
        for g in range(len(self.groups)):
            cap = max(self.capacities[g], self._capacity(g, end))
            if cap == self.capacities[g]:
                continue
            shape = (2 * self.sizes[g], 2 * self.slots * self.kv_heads, cap - self.capacities[g], self.head_dim)
            pad = mx.zeros(shape, mx.float32)
            self.buffers = self.buffers if self.buffers else [None] * len(self.groups)
            old = self.buffers[g]
            self.buffers[g] = pad if old is None else mx.concatenate([old, pad], axis=2)
            self.capacities[g] = cap

    def resize(self, slots: int) -> None:
        """`slots` rows: the first min(old, new) kept, new ones empty. At 0 the buffers go back to
        their first capacity."""
        if slots == self.slots:
            return
        if slots == 0:
            self.capacities, self.buffers = [0] * len(self.groups), []
            self.slots = 0
            self._reserve(1)
        rows = 2 * self.kv_heads
        keep = min(slots, self.slots)
        if slots > self.slots:
            new = slots - self.slots
            self.buffers = [mx.concatenate([b, mx.zeros((b.shape[0], new * rows, b.shape[2], b.shape[3]), b.dtype)],
                                           axis=1) for b in self.buffers]
            q = self.previous_code.shape[2]
            self.previous_code = mx.concatenate([self.previous_code, mx.zeros((new, 1, q), mx.int32)])
            self.keys = mx.concatenate([self.keys, mx.zeros((new, 2), mx.uint32)])
        else:
            self.buffers = [b[:, : keep * rows] for b in self.buffers]
            self.previous_code, self.keys = self.previous_code[:keep], self.keys[:keep]
        self.positions = np.concatenate([self.positions[:keep], np.zeros(max(0, slots - keep), np.int32)])
        self.slots = slots
        mx.eval(self.buffers, self.previous_code, self.keys)

    def insert(self, slot: int, cache: BackboneCache, position: int, previous_code: mx.array, key: mx.array) -> None:
        """Row pair `slot` takes a single session's TTS state: its cache (CFG batch 2), next
        position, previous codes `[1, 1, Q]` and generator key."""
        cache.flush()
        self._reserve(position + 1)
        rows = 2 * self.kv_heads
        for g, buf in enumerate(cache.buffers):
            cap = self.capacities[g]
            part = buf[:, :, :cap]
            if part.shape[2] < cap:
                pad = mx.zeros((part.shape[0], part.shape[1], cap - part.shape[2], part.shape[3]), part.dtype)
                part = mx.concatenate([part, pad], axis=2)
            b = self.buffers[g]
            self.buffers[g] = mx.concatenate([b[:, : slot * rows], part, b[:, (slot + 1) * rows:]], axis=1)
        self.previous_code = _put_row(self.previous_code, slot, previous_code.reshape(1, 1, -1).astype(mx.int32))
        self.keys = _put_row(self.keys, slot, key.reshape(1, 2))
        self.positions[slot] = position
        mx.eval(self.buffers, self.previous_code, self.keys)

    def take(self, slot: int) -> tuple[BackboneCache, mx.array, mx.array]:
        """Row pair `slot`'s state as a single session's (the inverse of `insert`): its cache (CFG
        batch 2, buffers of its own at the rows' capacities, which the single-session step may
        write in place; its offset the row's position), previous codes `[1, 1, Q]` and generator key."""
        position = int(self.positions[slot])
        rows = 2 * self.kv_heads
        cache = self.tts.backbone.make_cache(self.chunk)
        cache.buffers = [own_buffer(b[:, slot * rows : (slot + 1) * rows]) for b in self.buffers]
        cache.offset = position
        previous_code, key = self.previous_code[slot : slot + 1], self.keys[slot]
        mx.eval(cache.buffers, previous_code, key)
        return cache, previous_code, key

    # ------------------------------------------------------------------ the step

    def step(self, text: mx.array, active: np.ndarray, silence: mx.array) -> mx.array:
        """One frame for every `active` row from its LLM text id `text [S]`: the codes `[S, Q]`
        (lazy; an inactive row's are its previous codes)."""
        self._reserve(int(self.positions[active].max(initial=0)) + 1)
        codes, self.keys, *self.buffers = self._step_fn(
            self.previous_code, text.astype(mx.int32), mx.array(self.positions), self.keys,
            silence.astype(mx.int32).reshape(-1), mx.array(active), self.buffers)
        self.previous_code = codes
        self.positions = self.positions + active.astype(np.int32)
        return codes.reshape(self.slots, -1)

    def _step_graph(self, previous_code, text, positions, keys, silence, active, buffers):
        tts = self.tts
        s = previous_code.shape[0]
        code = mx.where((text == tts.eos_id)[:, None, None], silence[None, None, :], previous_code)
        cond = tts._char_table[mx.minimum(text, tts.vocab_size)][:, None]  # [S, 1, hidden]
        x = self._fuse(tts.code_embedding(code), cond)  # [2S, 1, hidden]
        offsets = mx.repeat(positions, 2)  # each row of a CFG pair at its session's position
        hidden, buffers = self._backbone(x, offsets, buffers)
        codes, new_keys = self._codes(hidden, keys)
        keep = active.reshape(s, 1, 1)
        return [mx.where(keep, codes, previous_code), mx.where(active[:, None], new_keys, keys), *buffers]

    def _fuse(self, code_embed: mx.array, cond: mx.array) -> mx.array:
        """`GatedFusion.cfg_pair` for every session: rows (code + text, code + null) per session."""
        fusion = self.tts.gated_fusion_audio_text
        s, t, h = cond.shape
        text = fusion.text_proj(cond.astype(mx.float32))
        null = mx.broadcast_to(self.tts._null_text, (s, t, h))
        pairs = mx.stack([text, null], axis=1).reshape(2 * s, t, h)
        audio = mx.repeat(fusion._audio(code_embed), 2, axis=0)
        return fusion._mix(audio, pairs)

    def _backbone(self, x: mx.array, offsets: mx.array, buffers: list[mx.array]):
        """`Backbone.step_arrays` with a position per row; the new keys written at the end."""
        backbone = self.tts.backbone
        rows = x.shape[0]
        slots = [offsets if window is None else mx.remainder(offsets, window) for window in self.groups]
        masks = [(mx.arange(buf.shape[2])[None] <= offsets[:, None])[:, None, None, :] for buf in buffers]
        h = x.astype(mx.float32)
        z = backbone.layers[0].input_layernorm(h)
        new_kv: list[list] = [[] for _ in self.groups]
        for i, layer in enumerate(backbone.layers):
            attn = layer.self_attn
            g, j = self.place[i]
            old_k, old_v = layer_kv(buffers[g], j, attn.n_kv_heads)
            if attn._qkv is not None:
                qkv = attn._qkv(z)
                width = attn.n_heads * attn.head_dim
                q, k, v = mx.split(qkv, [width, width + attn.n_kv_heads * attn.head_dim], axis=-1)
            else:
                q, k, v = attn.q_proj(z), attn.k_proj(z), attn.v_proj(z)
            q, k, v = attn._heads(q, k, v, offsets)
            slot = slots[g].reshape(rows, 1, 1, 1)
            out = decode_attention_reference(q, old_k, old_v, None, attn.scale, masks[g], new=(k, v, slot))
            h, z = layer.after_attention(h, attn.o_proj(out), backbone.norm_after(i))
            new_kv[g].append((k, v))
        written = []
        for g, buf in enumerate(buffers):
            update = stacked_kv(new_kv[g])  # [2 layers, rows * HK, 1, D]
            index = mx.repeat(slots[g], self.kv_heads).reshape(1, -1, 1, 1)
            index = mx.broadcast_to(index, update.shape)
            written.append(mx.put_along_axis(buf, index, update, axis=2))
        return z, written

    def _codes(self, hidden: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
        """`EarTTS.generate_codes` for every session: hidden `[2S, 1, hidden]` -> codes `[S, 1, Q]`."""
        tts = self.tts
        cfg, mog = tts.cfg, tts.mog_head
        q, d = cfg.num_quantizers, cfg.latent_size
        s = keys.shape[0]
        calls = len(tts._schedule)
        uniforms, normals, keys = mx.vmap(lambda k: frame_noise(k, calls, mog.num_predictions, d))(keys)
        code = mx.broadcast_to(tts._all_masked, (s, q))
        done = 0
        for count, u, noise in zip(tts._schedule, uniforms, normals):
            add = None if done == 0 else mx.repeat(tts.code_embedding(code.reshape(s, 1, q)), 2, axis=0)
            z = mog.trunk(hidden, add)  # [2S, 1, hidden], not yet guided
            guided = z[0::2] + cfg.guidance_scale * (z[0::2] - z[1::2])
            latent = self._draw(guided, u.reshape(s, 1, -1), noise.reshape(s, 1, d))
            code, _ = rvq_search(latent.reshape(s, d), tts.rvq_embs, done, count, tts._rvq_norms, into=code,
                                 method=self._rvq_method)
            done += count
        return code.reshape(s, 1, q), keys

    def _draw(self, h: mx.array, u: mx.array, noise: mx.array) -> mx.array:
        """`mog_sample_reference` per row: `h [S, 1, hidden]` -> `z [S, 1, latent]`."""
        cfg, mog = self.tts.cfg, self.tts.mog_head
        y = mog._heads(h) if mog._heads is not None else mx.concatenate(list(mog.projections(h)), axis=-1)
        n = mog.num_predictions
        logits, log_std, rest = y[..., :n], y[..., n : n + 1], y[..., n + 1:]
        c = choose_component(logits, cfg.top_p, u)
        mu = component_mean(h.astype(mx.float32), c, mog.proj_mus.weight, mog.low_mat)
        logs = mx.maximum(log_std, mog.min_log_std)
        return (mu * mx.exp(logs) + rest) + mx.exp(logs) * noise * cfg.noise_scale


def _put_row(a: mx.array, slot: int, row: mx.array) -> mx.array:
    return mx.concatenate([a[:slot], row, a[slot + 1:]]) if a.shape[0] > 1 else row
