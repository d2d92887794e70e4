"""EAR-TTS (`tts_model.tts_model.*`): text ids and previous codes in, 31 codec codes per frame out.

    tts = EarTTS(config.tts_config, config.text_config.vocab_size)
    checkpoint.load_into(tts, "tts_model.tts_model.")
    tts.set_tokenizer(tokenizer)
    cache = tts.make_cache()
    previous = tts.warmup(aria_latent, prompt_codes, cache)
    key = mx.random.key(seed)
    for text_id in text_ids:
        previous, key = tts.step(previous, text_id, cache, key, silence_codes)

Every forward runs batch 2 for classifier-free guidance: row 0 conditioned on the text, row 1 on
`null_emb`. Activations are float32 whatever the stored weight dtype. A step runs on the device
from end to end (EOS check, char-table row, fusion, backbone, 5 MoG calls, RVQ) as one compiled
graph; its randomness comes only from the explicit key, drawn in the reference order
(`frame_noise`: a seed gives the codes that `mx.random.seed(seed)` and the global generator give).
Call `prepare()` at load time (char table, norm scales, RVQ norms) so the first frame does not pay
for it. With bf16 weights, `tts.set_dtype(mx.float32)` after loading removes the per-call weight
cast of every matmul (same codes, tested; twice the memory). `prepare()` also stacks the
projections that share an input (q/k/v, gate/up, the MoG's logits/log-std/rest) into one layer
each (`stack_projections=False`: separate), so a frame launches fewer kernels;
`voicechat.prepare.prepare_tts` swaps in the GEMV layers before it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..char_table_cache import cached_table, table_key
from ..config import ConfigError, TTSConfig
from ..held import evaluate_held
from .backbone import DEFAULT_CHUNK, Backbone, BackboneCache
from .char_encoder import CharAwareSubwordEncoder
from .layers import OffsetRMSNorm, prepare_norms, stack_projections, unprepare_norms, unstack_projections
from .mog_head import MoGHead

from ..kernels._native import use_reference
from ..kernels.code_embedding import code_embedding
from ..kernels.gemv import linear, on_cuda_gpu
from ..kernels.rvq import codebook_norms, rvq_search

EOS_ID = 2
PAD_ID = 12


class GatedFusion(nn.Module):
    """`final_norm(sigmoid(s) * (sigmoid(g) * audio_proj(audio / Q) + (1 - sigmoid(g)) * text_proj(text)))`."""

    def __init__(self, hidden: int, num_quantizers: int, eps: float):
        super().__init__()
        self.num_quantizers = num_quantizers
        self.audio_proj = nn.Linear(hidden, hidden, bias=True)
        self.text_proj = nn.Linear(hidden, hidden, bias=True)
        self.gate = mx.zeros((hidden,))
        self.residual_scale = mx.array(0.0)
        self.final_norm = OffsetRMSNorm(hidden, eps)

    def __call__(self, audio: mx.array, text: mx.array) -> mx.array:
        return self._mix(self._audio(audio), self.text_proj(text.astype(mx.float32)))

    def cfg_pair(self, audio: mx.array, text: mx.array, null_text: mx.array) -> mx.array:
        """This fusion over the CFG batch [(audio, text), (audio, null)] -> [2, T, hidden], the audio
        projected once and the null row's text projection given (`null_text`, made once): the
        same rows as `__call__` on the concatenated batch, in two launches fewer. Sessions stepped
        together: `audio, text [S, T, hidden]` -> `[2 S, T, hidden]`, session s's pair at rows 2s,
        2s + 1, each with the bits it has alone."""
        s, t, h = text.shape
        projected = linear(self.text_proj, text.astype(mx.float32), sessions=s)
        pair = mx.where(_CONDITIONED_ROW, projected[:, None], null_text)  # [S, 2, T, hidden]
        return self._mix(self._audio(audio, s)[:, None], pair).reshape(2 * s, t, h)

    def _audio(self, audio: mx.array, sessions: int = 1) -> mx.array:
        return linear(self.audio_proj, audio.astype(mx.float32) / self.num_quantizers, sessions=sessions)

    def _mix(self, a: mx.array, t: mx.array) -> mx.array:
        """The gated sum of the projected audio `a` and text `t`, scaled and normed."""
        gate = mx.sigmoid(self.gate.astype(mx.float32))
        scale = mx.sigmoid(self.residual_scale.astype(mx.float32))
        return self.final_norm(scale * (gate * a + (1.0 - gate) * t))


def frame_noise(key: mx.array, calls: int, num_predictions: int, latent: int):
    """One frame's random draws in the reference order, from the generator state `key`: per MoG
    call one uniform `(1, 1, num_predictions)`, then one normal `(1, 1, latent)`, each drawn with
    the generator's next key (`key, sub = split(key)`, the step of MLX's global generator).

    Returns `(uniforms, normals, key)`: `calls` arrays each and the state after them. From
    `mx.random.key(seed)` the frames' draws are the numbers that `mx.random.seed(seed)` and the
    same draws from the global generator give; the state is explicit, so each session (and thread)
    carries its own. The keys form a chain (each split reads the last one); the draws of one
    distribution are one batched draw over their keys (a draw from a batch of keys gives, row by
    row, the draws from each key)."""
    subs = []
    for _ in range(2 * calls):
        key, sub = mx.random.split(key)
        subs.append(sub)
    uniform = mx.vmap(lambda k: mx.random.uniform(shape=(1, 1, num_predictions), key=k))
    normal = mx.vmap(lambda k: mx.random.normal(shape=(1, 1, latent), key=k))
    uniforms, normals = uniform(_key_rows(subs[0::2])), normal(_key_rows(subs[1::2]))
    # Rows taken as range slices (views): an integer index is a gather, a launch each.
    return ([uniforms[i : i + 1].reshape(1, 1, num_predictions) for i in range(calls)],
            [normals[i : i + 1].reshape(1, 1, latent) for i in range(calls)], key)


def _key_rows(keys: list[mx.array]) -> mx.array:
    """The keys as the rows of one `[n, 2]` array: a select per key, which a compiled step fuses
    into one launch (`mx.stack` copies each key in a launch of its own)."""
    rows = mx.array([[i] for i in range(len(keys))], mx.int32)
    out = mx.broadcast_to(keys[0], (len(keys), keys[0].shape[0]))
    for i, k in enumerate(keys[1:], 1):
        out = mx.where(rows == i, k, out)
    return out


# Row 0 of a CFG batch sees the text. Made as data, not as an op: a lazy array made at import
# would belong to the importing thread's stream (and a compiled step would recompute it each call).
_CONDITIONED_ROW = mx.array([[[True]], [[False]]])


class EarTTS(nn.Module):
    """The RVQ EAR-TTS model; attribute names are the checkpoint keys below `tts_model.tts_model.`."""

    def __init__(self, cfg: TTSConfig, vocab_size: int, eos_id: int = EOS_ID, pad_id: int = PAD_ID,
                 compile: bool = True, stack_projections: bool = True):
        super().__init__()
        for flag in ("use_gated_fusion_for_text_audio", "use_subword_flag_emb", "use_bos_eos_emb"):
            if not getattr(cfg, flag):
                raise ConfigError(f"config.json: tts_config.{flag}: only true is supported (the published model)")
        self.cfg = cfg
        self.vocab_size, self.eos_id, self.pad_id = vocab_size, eos_id, pad_id
        self.compile = compile
        # q/k/v, gate/up and the MoG's three projections as one layer each (fewer launches a frame)
        self.stacks_projections = stack_projections
        h = cfg.hidden_size
        self.backbone = Backbone(cfg)
        self.bos_emb = mx.zeros((h,))
        self.null_emb = mx.zeros((h,))
        self.embed_code = nn.Linear(cfg.latent_size, h, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(cfg.character_encoder, vocab_size)
        self.gated_fusion_audio_text = GatedFusion(h, cfg.num_quantizers, cfg.rms_norm_eps)
        # Builds a speaker latent from prompt audio; unused: the published Aria latent is stored.
        self.audio_prompt_projection_W = mx.zeros((h, h))
        self.mog_head = MoGHead(h, cfg.latent_size, cfg.mog_head)
        self.rvq_embs = mx.zeros((cfg.num_quantizers, cfg.codebook_size, cfg.latent_size))
        self._schedule = tuple(c for c in cfg.mask_schedule if c > 0)
        self.decode_kernels = False  # our GEMV layers swapped in (`voicechat.prepare`)
        self._invalidate()

    # ------------------------------------------------------------------ load-time work

    def update(self, parameters: dict, strict: bool = True) -> "EarTTS":
        super().update(parameters, strict)
        self._invalidate()  # everything derived from the old weights is stale
        return self

    def _invalidate(self) -> None:
        self._weights_ready = False
        self._rvq_flat = None
        self._rvq_norms = None
        self._rvq_offsets = self._all_masked = self._null_text = None
        self._char_table = None
        # Where the char table came from: "cache", "computed" (and kept on disk), "computed, not
        # kept" (`voicechat.char_table_cache`); None before it is made.
        self.char_table_source: str | None = None
        self._step_fn = None
        unprepare_norms(self)
        unstack_projections(self)

    def set_tokenizer(self, tokenizer) -> None:
        """Build the char vocabulary and the subword -> chars map (`TextTokenizer`); the
        conditioning table is computed on first use."""
        self.embed_subword.set_tokenizer(tokenizer)
        self._char_table = self.char_table_source = None
        self._step_fn = None

    def _prepare_weights(self) -> None:
        if self._weights_ready:
            return
        prepare_norms(self)
        if self.stacks_projections:  # the per-frame networks only (the char encoder runs at load time)
            stack_projections(self.backbone)
            stack_projections(self.mog_head)
        q, k, d = self.rvq_embs.shape
        # One zero row per codebook: index K (mask) contributes nothing to a depth sum. Held in
        # float32 (exact; 65 MB at full size) so that a depth sum is a gather and a sum, no cast.
        padded = mx.concatenate([self.rvq_embs.astype(mx.float32), mx.zeros((q, 1, d), mx.float32)], axis=1)
        self._rvq_flat = padded.reshape(q * (k + 1), d)
        self._rvq_norms = codebook_norms(self.rvq_embs)
        # Constants of every step, made once: inside the compiled step an arange or a full is a
        # launch each time.
        self._rvq_offsets = mx.arange(q, dtype=mx.int32) * (k + 1)  # codebook q's first row in _rvq_flat
        self._all_masked = mx.full((1, q), k, mx.int32)  # a frame before any code is chosen
        # The unconditioned CFG row's text projection: the same every step.
        self._null_text = self.gated_fusion_audio_text.text_proj(self.null_emb.astype(mx.float32)[None, None])
        # These and every other derived array (norm scales, stacks, RoPE frequencies), held by the
        # module, evaluated: the compiled step closes over them.
        evaluate_held(self)
        self._weights_ready = True

    def char_table(self) -> mx.array:
        """`[vocab + 1, hidden]`: the text conditioning of every id (last row: ids >= vocab), read
        from the disk cache when it holds this encoder's (`voicechat.char_table_cache`)."""
        self._prepare_weights()
        if self._char_table is None:
            encoder = self.embed_subword
            if not encoder.has_vocabulary:
                raise RuntimeError("the TTS char encoder has no vocabulary yet: call set_tokenizer(tokenizer)")
            self._char_table, self.char_table_source = cached_table(
                lambda: table_key(encoder, self.cfg.character_encoder.to_dict(), encoder.vocabulary_digest,
                                  self.decode_kernels),
                (self.vocab_size + 1, encoder.hidden_size), encoder.table)
        return self._char_table

    def prepare(self) -> None:
        """Do all load-time work now (norm scales, RVQ norms, the char table, the step graph)."""
        self.char_table()
        if self._step_fn is None:
            self._step_fn = mx.compile(self._step_graph) if self.compile else self._step_graph

    # ------------------------------------------------------------------ pieces

    def depthsum(self, code: mx.array) -> mx.array:
        """`sum_q rvq_embs[q][code[..., q]]` with index K (mask) adding zero: [..., Q] -> [..., latent]."""
        self._prepare_weights()
        index = code.astype(mx.int32) + self._rvq_offsets
        return self._rvq_flat[index].sum(axis=-2)

    def code_embedding(self, code: mx.array) -> mx.array:
        return self.embed_code(self.depthsum(code))

    def frame_code_embedding(self, code: mx.array, rows: int = 1, sessions: int = 1) -> mx.array:
        """One frame's `code_embedding` (its Q codes in any shape) as `[rows, 1, hidden]` (the same
        row each time): one launch on a CUDA GPU with our GEMV layer (the depth sum and `embed_code`
        in `kernels.code_embedding`), the same ops as `code_embedding` elsewhere. `sessions` S: a
        frame a session (`[S, Q]`), `[S * rows, 1, hidden]`, each session's rows its frame's alone."""
        self._prepare_weights()
        if self.decode_kernels and on_cuda_gpu() and not use_reference():
            return code_embedding(code, self._rvq_flat, self.embed_code["weight"], rows, sessions=sessions)
        out = self.code_embedding(code.reshape(sessions, 1, -1))
        return out if rows == 1 else mx.repeat(out, rows, axis=0)

    def condition(self, ids: mx.array, mask: mx.array) -> mx.array:
        """Text conditioning `[B, T, hidden]`: the char encoder where `mask`, flags everywhere."""
        table = self.char_table()
        ids = ids.astype(mx.int32)
        encoded = table[mx.minimum(ids, self.vocab_size)]
        return mx.where(mask[..., None], encoded, self.embed_subword.flags(ids))

    def fuse(self, code_embed: mx.array, cond: mx.array) -> mx.array:
        """CFG batch of backbone inputs: [code + text, code + null] -> [2, T, hidden]."""
        self._prepare_weights()
        return self.gated_fusion_audio_text.cfg_pair(code_embed, cond, self._null_text)

    def generate_codes(self, hidden: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
        """Iterative unmasking of one frame: hidden [2, 1, hidden] -> (codes [1, 1, Q] int32, key).

        `key` is the generator state; the new state comes back (`frame_noise`). Sessions stepped
        together: hidden `[2 S, 1, hidden]` (their CFG pairs) and a key a session `[S, 2]` ->
        `([S, 1, Q], keys [S, 2])`, each session's codes and key those it gets alone."""
        self._prepare_weights()
        cfg, mog = self.cfg, self.mog_head
        q, d = cfg.num_quantizers, cfg.latent_size
        s = hidden.shape[0] // 2
        calls = len(self._schedule)
        if key.ndim == 1:
            uniforms, normals, key = frame_noise(key, calls, mog.num_predictions, d)
        else:  # a batch of keys draws, row by row, each key's numbers
            uniforms, normals, key = mx.vmap(lambda k: frame_noise(k, calls, mog.num_predictions, d))(key)
        code = self._all_masked if s == 1 else mx.broadcast_to(self._all_masked, (s, q))
        # The search's kernel takes up to 8 rows with method "auto" (beyond, MLX's matmuls, whose
        # rows round otherwise); "fused" keeps it at any row count.
        method = "auto" if s <= 8 else "fused"
        done = 0
        for count, u, noise in zip(self._schedule, uniforms, normals):
            # The MoG head's input is hidden + the embedding of the codes so far (added inside its
            # first launch). All codes are the mask at first, whose embedding is exactly zero.
            embedded = None if done == 0 else self.frame_code_embedding(code, rows=2, sessions=s)
            z = mog.sample(hidden, cfg.guidance_scale, cfg.top_p, u, noise, cfg.noise_scale, add=embedded,
                           sessions=s)
            # The chosen codes land in their columns of the row (on CUDA the kernels write them there).
            code, _ = rvq_search(z.reshape(s, d), self.rvq_embs, done, count, self._rvq_norms, into=code,
                                 method=method)
            done += count
        return code.reshape(s, 1, q), key

    # ------------------------------------------------------------------ session API

    def make_cache(self, chunk: int = DEFAULT_CHUNK) -> BackboneCache:
        return self.backbone.make_cache(chunk)

    def warmup(self, aria_latent: mx.array, prompt_codes: mx.array, cache: BackboneCache) -> mx.array:
        """Fill the caches with the speaker prompt; returns `previous_code [1, 1, Q]` (all mask).

        `aria_latent [1, F, hidden]` (F = 37); `prompt_codes [1, F + 1, Q]`: the codec's encoding
        of `(F + 1) * 1764` zero samples (`[1, F, Q]`, the last frame already dropped, is accepted
        too). Frames 0 and F - 1 are set to the mask code here. Positions 0..F-1 use a causal
        (windowed) mask."""
        self.prepare()
        frames, q, k = aria_latent.shape[1], self.cfg.num_quantizers, self.cfg.codebook_size
        if prompt_codes.ndim == 3 and prompt_codes.shape[1] == frames + 1:
            prompt_codes = prompt_codes[:, :frames]
        if aria_latent.shape != (1, frames, self.cfg.hidden_size) or prompt_codes.shape != (1, frames, q):
            raise ValueError(f"warmup: aria_latent {aria_latent.shape} and prompt_codes {prompt_codes.shape} "
                             f"must be [1, F, {self.cfg.hidden_size}] and [1, F (+ 1), {q}]")
        if cache.offset != 0:
            raise ValueError("warmup: the cache is not empty (make a new one with make_cache())")
        pos = mx.arange(frames)
        code = mx.where(((pos == 0) | (pos == frames - 1))[None, :, None], k, prompt_codes.astype(mx.int32))
        # Teacher forcing: each frame sees the previous frame's code (the first sees code 0).
        shifted = mx.concatenate([mx.zeros((1, 1, q), mx.int32), code[:, :-1]], axis=1)
        code_embed = self.code_embedding(shifted)
        audio_mask = pos == frames - 1
        bos_mask = audio_mask & ~mx.concatenate([mx.array([False]), audio_mask[:-1]])
        pre_bos = mx.cumsum(bos_mask.astype(mx.int32)) == 0
        code_embed = mx.where(pre_bos[None, :, None], aria_latent.astype(mx.float32), code_embed)
        code_embed = code_embed + bos_mask[None, :, None] * self.bos_emb.astype(mx.float32)
        ids = mx.full((1, frames), self.pad_id, mx.int32)
        cond = self.condition(ids, (pos >= frames - 2)[None, :])
        self.backbone.prefill(self.fuse(code_embed, cond), cache)
        return code[:, -1:]

    def step(self, previous_code: mx.array, text_id, cache: BackboneCache, key: mx.array,
             silence_codes: mx.array) -> tuple[mx.array, mx.array]:
        """One timeline frame: `(codes [1, 1, Q] int32, new_key)`.

        `text_id` (int or int array) is the LLM's text id at this frame; on EOS the previous code
        is replaced by `silence_codes [Q]` first. Nothing here waits for the device."""
        self.prepare()
        q = self.cfg.num_quantizers
        text = mx.array(text_id, mx.int32) if not isinstance(text_id, mx.array) else text_id.astype(mx.int32)
        cache.reserve(cache.offset + 1, 2)
        codes, key, cache.buffers, cache.pending, cache.position = self._step_fn(
            previous_code.astype(mx.int32).reshape(1, 1, q), text.reshape(1), cache.position_array(),
            key, silence_codes.astype(mx.int32).reshape(q), cache.buffers, cache.pending)
        cache.offset += 1
        cache.position_at = cache.offset
        return codes, key

    def _step_graph(self, previous_code, text_id, offset, key, silence, buffers, pending):
        """One frame of `step`, or of S sessions stepped together (`tts.rows`): previous codes
        `[S, 1, Q]`, text ids `[S]`, positions `[S]` (one session: a scalar), keys `[S, 2]` (one
        session: `[2]`) and the buffers of their CFG pairs; each session's codes, key and cache
        writes are those it gets stepped alone."""
        s = previous_code.shape[0]
        code = mx.where((text_id == self.eos_id)[:, None, None], silence[None, None, :], previous_code)
        cond = self._char_table[mx.minimum(text_id, self.vocab_size)][:, None]  # [S, 1, hidden]
        x = self.fuse(self.frame_code_embedding(code, sessions=s), cond)
        hidden, buffers, pending = self.backbone.step_arrays(x, offset, buffers, pending, sessions=s)
        codes, key = self.generate_codes(hidden, key)
        return codes, key, buffers, pending, offset + 1  # the next step's position, on the device
