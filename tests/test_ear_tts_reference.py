"""EAR-TTS (Network 3) against a float64 NumPy reference written from the spec
(voicechat-port-spec.md, "Network 3", and the README's clarifications), on random weights
(`numpy_reference.randomize`) of the tiny shapes: the char-aware subword encoder (softcap, masked
mean pooling, the flag embeddings), the gated audio/text fusion, the MoG trunk and heads (CFG,
top-p, Gumbel-max, low-rank mean, log-std floor), the warmup's embedding path, and whole steps
(EOS, backbone, five MoG calls, RVQ) with the noise that MLX's global generator draws in the
reference order from the same seed. The backbone's own reference is test_tts_backbone's."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from numpy_reference import (
    assert_close,
    dense,
    f64,
    gated_gelu_mlp,
    gemma_norm,
    randomize,
    sigmoid,
    softmax,
)
from test_tts_backbone import reference_forward
from voicechat.checkpoint import open_checkpoint
from voicechat.tokenizer import TextTokenizer
from voicechat.tts.ear_tts import EarTTS

EOS, PAD = 2, 12
FRAMES = 37  # the Aria prompt's length
GUMBEL_EPS = 1e-8
# Ids with characters of several lengths, the specials, the last id and two past the vocabulary.
IDS = [1, 2, 12, 16, 40, 100, 271, 300, 383, 384, 999]


class Spec:
    """The published numbers the reference uses (tts_config; the widths come from the weights)."""

    guidance, top_p, noise_scale, min_log_std = 0.2, 0.95, 0.001, -4.0
    codebooks, iterations, exponent = 31, 8, 3.0


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    """The tiny EAR-TTS with random weights, random flag buffers and the tiny tokenizer. q/k of
    the char encoder are scaled up so that its scores reach the softcap, the mixture logits so
    that top-p drops components, the log-std so that some rows meet its floor."""
    ckpt = open_checkpoint(tiny_checkpoint)
    cfg = ckpt.config.tts_config
    assert (cfg.guidance_scale, cfg.top_p, cfg.noise_scale, cfg.mog_head.min_log_std) == (
        Spec.guidance, Spec.top_p, Spec.noise_scale, Spec.min_log_std)
    assert (cfg.num_quantizers, cfg.num_iterations, cfg.exponent) == (Spec.codebooks, Spec.iterations, Spec.exponent)
    vocab = ckpt.config.text_config.vocab_size
    tts = EarTTS(cfg, vocab)
    randomize(tts, seed=11)
    rng = np.random.default_rng(12)
    enc = tts.embed_subword
    attn = enc.backbone.encoder.layers[0].self_attn
    attn.q_proj.weight = attn.q_proj.weight * 6.0
    attn.k_proj.weight = attn.k_proj.weight * 6.0
    tts.mog_head.proj_logits.weight = tts.mog_head.proj_logits.weight * 3.0
    tts.mog_head.proj_logs.weight = tts.mog_head.proj_logs.weight * 3.0
    enc.subword_flag_emb.is_continuation = mx.array(rng.integers(0, 2, vocab + 1), mx.int32)
    enc.bos_eos_emb.special_flags = mx.array(rng.integers(0, 3, vocab), mx.int32)
    tokenizer = TextTokenizer(tiny_checkpoint / "tokenizer.json")
    tts.set_tokenizer(tokenizer)
    tts.prepare()
    return tts, cfg, tokenizer


@pytest.fixture(scope="module")
def reference(model):
    tts, cfg, tokenizer = model
    return Reference(tts, cfg, tokenizer)


# --------------------------------------------------------------------------- the reference

def rope(x, base: float):
    """Rotate-half RoPE at positions 0..T-1 of x [..., T, D]: pair (x_i, x_{i + D/2}) turns by
    t * base^(-2i / D), written as a complex rotation."""
    t, d = x.shape[-2], x.shape[-1]
    turn = np.exp(1j * np.arange(t)[:, None] * base ** (-2.0 * np.arange(d // 2) / d))
    z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * turn
    return np.concatenate([z.real, z.imag], axis=-1)


def unmasking_counts(iterations: int, codebooks: int, exponent: float) -> list[int]:
    """Codebooks decided per iteration: masked_i = ceil((1 - (i / n)^e)^(1 / e) * Q), count_i =
    masked_i - masked_{i+1} (masked_n = 0)."""
    i = np.arange(iterations + 1)
    masked = np.ceil((1.0 - (i / iterations) ** exponent) ** (1.0 / exponent) * codebooks)
    masked[-1] = 0
    return [int(c) for c in masked[:-1] - masked[1:]]


class Reference:
    """The spec's EAR-TTS in float64, reading weights (and the tokenizer) only."""

    def __init__(self, tts: EarTTS, cfg, tokenizer: TextTokenizer):
        self.tts, self.cfg, self.tokenizer = tts, cfg, tokenizer
        self.vocab = tts.vocab_size
        self.eps = cfg.rms_norm_eps
        self.books = f64(tts.rvq_embs)  # [Q, K, L]
        singles = sorted((i, token) for token, i in tokenizer.vocab().items() if len(token) == 1)
        assert len(singles) == 256
        self.char_index = {token: n for n, (_, token) in enumerate(singles)}
        self.counts = [c for c in unmasking_counts(Spec.iterations, Spec.codebooks, Spec.exponent) if c]
        self.scores_seen = 0.0  # the largest |score| the char encoder met (before its softcap)

    # ---------------------------------------------------------------- text conditioning

    def chars(self, subword: int) -> list[int]:
        token = self.tokenizer.id_to_token(subword) if subword < self.vocab else None
        return [self.char_index[c] for c in token or "" if c in self.char_index]

    def char_attention(self, x, attn, ccfg):
        heads, kv_heads, d = ccfg.num_attention_heads, ccfg.num_key_value_heads, ccfg.head_dim

        def split(a, n):
            return a.reshape(a.shape[0], n, d).transpose(1, 0, 2)

        q = rope(split(dense(x, attn.q_proj.weight), heads), ccfg.rope_base)
        k = rope(split(dense(x, attn.k_proj.weight), kv_heads), ccfg.rope_base)
        v = split(dense(x, attn.v_proj.weight), kv_heads)
        k, v = (np.repeat(a, heads // kv_heads, axis=0) for a in (k, v))
        scores = q @ k.transpose(0, 2, 1) * ccfg.query_pre_attn_scalar**-0.5
        self.scores_seen = max(self.scores_seen, float(np.abs(scores).max()))
        cap = ccfg.attn_logit_softcapping
        out = softmax(np.tanh(scores / cap) * cap) @ v
        return dense(out.transpose(1, 0, 2).reshape(x.shape[0], -1), attn.o_proj.weight)

    def char_encoding(self, subword: int):
        """Embed the characters (scaled by sqrt(hidden)), one T5Gemma encoder layer, the final
        norm, the mean over characters (none: zero), `proj_embedding`."""
        enc, ccfg = self.tts.embed_subword, self.cfg.character_encoder
        chars = self.chars(subword)
        if not chars:
            return np.zeros(ccfg.hidden_size)
        x = f64(enc.embed_tokens.weight)[chars] * math.sqrt(ccfg.hidden_size)
        eps = ccfg.rms_norm_eps
        for layer in enc.backbone.encoder.layers:
            attended = self.char_attention(gemma_norm(x, layer.pre_self_attn_layernorm, eps), layer.self_attn, ccfg)
            x = x + gemma_norm(attended, layer.post_self_attn_layernorm, eps)
            fed = gated_gelu_mlp(gemma_norm(x, layer.pre_feedforward_layernorm, eps), layer.mlp)
            x = x + gemma_norm(fed, layer.post_feedforward_layernorm, eps)
        pooled = gemma_norm(x, enc.backbone.encoder.norm, eps).mean(axis=0)
        return dense(pooled, enc.proj_embedding.weight)

    def flags(self, subword: int):
        """`cont_emb[is_continuation[id]] + special_emb[special_flags[id]]`, ids past the
        vocabulary at the stored `pad_tensor`."""
        enc = self.tts.embed_subword
        cont, special = enc.subword_flag_emb, enc.bos_eos_emb
        i = subword if subword < self.vocab else int(cont.pad_tensor.item())
        j = subword if subword < self.vocab else int(special.pad_tensor.item())
        continuation = int(np.array(cont.is_continuation)[i])
        kind = int(np.array(special.special_flags)[j])
        return f64(cont.cont_emb.weight)[continuation] + f64(special.special_emb.weight)[kind]

    def condition(self, subword: int, encoded: bool = True):
        return self.flags(subword) + (self.char_encoding(subword) if encoded else 0.0)

    # ---------------------------------------------------------------- fusion and code embedding

    def fusion(self, audio, text):
        g = self.tts.gated_fusion_audio_text
        gate, scale = sigmoid(f64(g.gate)), sigmoid(f64(g.residual_scale))
        a = dense(audio / Spec.codebooks, g.audio_proj.weight, g.audio_proj.bias)
        t = dense(text, g.text_proj.weight, g.text_proj.bias)
        return gemma_norm(scale * (gate * a + (1.0 - gate) * t), g.final_norm, self.eps)

    def cfg_pair(self, audio, text):
        """[2, T, hidden]: row 0 fused with the text, row 1 with `null_emb`."""
        return np.stack([self.fusion(audio, text), self.fusion(audio, np.broadcast_to(f64(self.tts.null_emb), text.shape))])

    def code_embedding(self, code):
        """`embed_code(sum_q rvq_embs[q][code_q])`, the mask code (K) adding nothing; code [..., Q]."""
        k = self.books.shape[1]
        total = np.zeros(code.shape[:-1] + (self.books.shape[2],))
        for q in range(code.shape[-1]):
            chosen = code[..., q]
            total += np.where((chosen < k)[..., None], self.books[q][np.minimum(chosen, k - 1)], 0.0)
        return dense(total, self.tts.embed_code.weight)

    # ---------------------------------------------------------------- warmup

    def warmup_inputs(self, aria, prompt):
        """The backbone's 37 warmup inputs [2, F, hidden] from the latent [F, hidden] and the
        codec's prompt codes [F + 1, Q]."""
        k = self.books.shape[1]
        code = prompt[:FRAMES].copy()
        code[0] = code[FRAMES - 1] = k
        shifted = np.concatenate([np.zeros((1, code.shape[1]), np.int64), code[:-1]])
        embedded = self.code_embedding(shifted)
        audio_mask = np.arange(FRAMES) == FRAMES - 1
        bos = audio_mask & ~np.concatenate([[False], audio_mask[:-1]])
        before_bos = np.cumsum(bos) == 0
        embedded = np.where(before_bos[:, None], aria, embedded) + bos[:, None] * f64(self.tts.bos_emb)
        subword_mask = np.arange(FRAMES) >= FRAMES - 2
        cond = np.stack([self.condition(PAD, encoded=bool(m)) for m in subword_mask])
        return self.cfg_pair(embedded, cond), code[-1]

    # ---------------------------------------------------------------- MoG head

    def trunk(self, x):
        mog, eps = self.tts.mog_head, self.cfg.mog_head.eps
        *layers, final = mog.mlp_stack
        for layer in layers:
            x = x + gemma_norm(gated_gelu_mlp(gemma_norm(x, layer.pre_norm, eps), layer.mlp), layer.post_norm, eps)
        x = gemma_norm(x, final, eps)
        return x[0] + Spec.guidance * (x[0] - x[1])

    def mog(self, x, u):
        """x [2, T, hidden] (cond, uncond), u [T, N] -> dict of the guided state `h`, the kept
        components, the choice `c`, `mean` (mu * exp(logs) + proj_else), `logs`, and the Gumbel
        margin (best score minus the runner-up, per row)."""
        mog = self.tts.mog_head
        h = self.trunk(x)
        logits = dense(h, mog.proj_logits.weight)  # [T, N]
        probs = softmax(logits)
        more_likely = (probs[:, None, :] > probs[:, :, None]) * probs[:, None, :]  # [T, i, j]
        mass_before = more_likely.sum(axis=-1)
        keep = mass_before < Spec.top_p
        kept = np.where(keep, logits, -np.inf)
        top = kept.max(axis=-1, keepdims=True)
        log_probs = kept - top - np.log(np.exp(kept - top).sum(axis=-1, keepdims=True))
        gumbel = -np.log(-np.log(u + GUMBEL_EPS) + GUMBEL_EPS)
        scores = log_probs + gumbel
        c = scores.argmax(axis=-1)
        top2 = np.sort(scores, axis=-1)[:, -2:]
        n, rank, hidden = mog.low_mat.shape[0], mog.low_mat.shape[2], h.shape[-1]
        low = np.einsum("trh,th->tr", f64(mog.proj_mus.weight).reshape(n, rank, hidden)[c], h)
        mu = np.einsum("tlr,tr->tl", f64(mog.low_mat)[c], low)
        logs = np.maximum(dense(h, mog.proj_logs.weight), Spec.min_log_std)
        return {"h": h, "keep": keep, "c": c, "mean": mu * np.exp(logs) + dense(h, mog.proj_else.weight),
                "logs": logs, "margin": top2[:, 1] - top2[:, 0], "mass_before": mass_before,
                "unmasked_choice": (np.log(probs) + gumbel).argmax(axis=-1)}

    # ---------------------------------------------------------------- one step

    def generate(self, hidden, draws):
        """Iterative unmasking from hidden [2, hidden]; draws: per MoG call (u [N], noise [L]).
        Returns (codes [Q], the smallest decision margin met)."""
        k = self.books.shape[1]
        code = np.full(Spec.codebooks, k)
        done, margin = 0, np.inf
        for count, (u, noise) in zip(self.counts, draws):
            x = hidden + self.code_embedding(code)
            out = self.mog(x[:, None, :], u[None])
            residual = out["mean"][0] + np.exp(out["logs"][0]) * noise * Spec.noise_scale
            margin = min(margin, out["margin"][0], np.abs(out["mass_before"] - Spec.top_p).min())
            for q in range(done, done + count):
                distance = ((residual[None, :] - self.books[q]) ** 2).sum(-1)
                best = np.sort(distance)[:2]
                margin = min(margin, best[1] - best[0])
                code[q] = distance.argmin()
                residual = residual - self.books[q][code[q]]
            done += count
        return code, margin

    def step_inputs(self, previous, text_id: int, silence):
        previous = silence if text_id == EOS else previous
        return self.cfg_pair(self.code_embedding(previous)[None], self.condition(text_id)[None]), previous


def global_generator_draws(seed: int, frames: int, calls: int, n: int, latent: int):
    """The reference stream: `mx.random.seed(seed)` once, then per frame and MoG call one uniform
    (1, 1, N) and one normal (1, 1, L) from the global generator."""
    mx.random.seed(seed)
    out = []
    for _ in range(frames):
        frame = []
        for _ in range(calls):
            u = f64(mx.random.uniform(shape=(1, 1, n)))
            frame.append((u.reshape(n), f64(mx.random.normal(shape=(1, 1, latent))).reshape(latent)))
        out.append(frame)
    return out


# --------------------------------------------------------------------------- tests

def test_the_schedule_is_five_calls():
    assert unmasking_counts(8, 31, 3.0) == [0, 0, 0, 1, 1, 3, 4, 22]


def test_char_table_matches_the_spec(model, reference):
    """Every id's conditioning (char encoder + flags) as the step reads it, ids past the vocabulary
    included; the scores reach the softcap's bend."""
    tts, _, _ = model
    table = np.array(tts.char_table())
    want = np.stack([reference.condition(i) for i in range(tts.vocab_size + 1)])
    assert reference.scores_seen > 40.0  # tanh(s / 50) * 50 is 10 % below s there
    assert_close(table, want)
    for i in IDS:  # and the lookup of ids of any size
        assert_close(tts.condition(mx.array([[i]]), mx.array([[True]]))[0, 0], reference.condition(i))


def test_char_encoder_masks_and_flags_match_the_spec(model, reference):
    """The per-id encoder over a padded [2, T] batch: encoded where the mask is set, flags only
    elsewhere (the warmup's path)."""
    tts, _, _ = model
    ids = np.array([IDS[:6], IDS[5:11]])
    mask = np.array([[True, False, True, True, False, True], [False, True, True, False, True, True]])
    got = tts.embed_subword(mx.array(ids), mx.array(mask))
    want = np.stack([[reference.condition(int(i), bool(m)) for i, m in zip(r, mr)] for r, mr in zip(ids, mask)])
    assert_close(got, want)


def test_gated_fusion_matches_the_spec(model, reference):
    tts, cfg, _ = model
    rng = np.random.default_rng(5)
    audio, text = rng.standard_normal((2, 3, 4, cfg.hidden_size))
    got = tts.gated_fusion_audio_text(mx.array(audio, mx.float32), mx.array(text, mx.float32))
    assert_close(got, reference.fusion(audio, text))
    # The step's CFG pair: [code + text, code + null].
    pair = tts.fuse(mx.array(audio[:1], mx.float32), mx.array(text[:1], mx.float32))
    assert_close(pair, reference.cfg_pair(audio[0], text[0]))


def test_mog_trunk_and_heads_match_the_spec(model, reference):
    """64 rows at once: the guided trunk, the component of each row (top-p dropping some, and a
    choice that only top-p forbids), its mean and log-std (some at the floor)."""
    tts, cfg, _ = model
    mog = tts.mog_head
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 64, cfg.hidden_size))
    u = rng.uniform(size=(64, mog.num_predictions))
    want = reference.mog(x, u)
    assert not want["keep"].all() and (want["c"] != want["unmasked_choice"]).any()
    assert (want["logs"] == Spec.min_log_std).any() and (want["logs"] > Spec.min_log_std).any()
    assert want["margin"].min() > 1e-4 and np.abs(want["mass_before"] - Spec.top_p).min() > 1e-5
    xm = mx.array(x, mx.float32)
    assert_close(mog.guided(xm, cfg.guidance_scale)[0], want["h"])
    mean, logs = mog.infer(xm, cfg.guidance_scale, cfg.top_p, mx.array(u[None], mx.float32))
    assert_close(logs[0], want["logs"])
    assert_close(mean[0], want["mean"])
    # One row through the step's draw (the kernel's path on a CUDA GPU), with its noise.
    noise = rng.standard_normal(cfg.latent_size)
    for row in (0, 1, 2):
        z = mog.sample(xm[:, row : row + 1], cfg.guidance_scale, cfg.top_p, mx.array(u[row][None, None], mx.float32),
                       mx.array(noise[None, None], mx.float32), cfg.noise_scale)
        one = reference.mog(x[:, row : row + 1], u[row : row + 1])
        assert_close(z[0, 0], one["mean"][0] + np.exp(one["logs"][0]) * noise * Spec.noise_scale)


def prompt_inputs(cfg, seed=7):
    rng = np.random.default_rng(seed)
    aria = rng.standard_normal((FRAMES, cfg.hidden_size))
    prompt = rng.integers(0, cfg.codebook_size, (FRAMES + 1, cfg.num_quantizers))
    silence = rng.integers(0, cfg.codebook_size, cfg.num_quantizers)
    return aria, prompt, silence


def test_warmup_embedding_path_matches_the_spec(model, reference):
    """The warmup fills the caches with what the backbone makes of the spec's 37 inputs (the
    Aria latent before the BOS frame, code embedding + bos_emb at it, subwords 12 encoded at the
    last two positions)."""
    tts, cfg, _ = model
    aria, prompt, _ = prompt_inputs(cfg)
    cache = tts.make_cache()
    previous = tts.warmup(mx.array(aria[None], mx.float32), mx.array(prompt[None], mx.int32), cache)
    inputs, last = reference.warmup_inputs(aria, prompt)
    assert previous.reshape(-1).tolist() == last.tolist()
    want = tts.make_cache()
    tts.backbone.prefill(mx.array(inputs, mx.float32), want)
    for c in (cache, want):
        c.flush()
    for got, ref in zip(cache.buffers, want.buffers):
        assert_close(got, f64(ref))


def test_steps_match_the_spec_with_the_global_generators_noise(model, reference):
    """Warmup, then five steps (an EOS among them) from `mx.random.key(seed)`: the codes are those
    of the spec's step (backbone recomputed over all positions) fed the reference stream of
    `mx.random.seed(seed)`."""
    tts, cfg, _ = model
    aria, prompt, silence = prompt_inputs(cfg)
    text_ids = [100, 300, EOS, 16, PAD]
    seed = 5
    draws = global_generator_draws(seed, len(text_ids), len(reference.counts), tts.mog_head.num_predictions,
                                   cfg.latent_size)
    cache = tts.make_cache()
    previous = tts.warmup(mx.array(aria[None], mx.float32), mx.array(prompt[None], mx.int32), cache)
    key = mx.random.key(seed)
    got = []
    for text_id in text_ids:
        previous, key = tts.step(previous, text_id, cache, key, mx.array(silence, mx.int32))
        got.append(np.array(previous).reshape(-1).tolist())

    sequence, code = reference.warmup_inputs(aria, prompt)
    want = []
    for text_id, frame_draws in zip(text_ids, draws):
        inputs, _ = reference.step_inputs(code, text_id, silence)
        sequence = np.concatenate([sequence, inputs], axis=1)
        hidden = reference_forward(tts.backbone, cfg, sequence)[:, -1]
        code, margin = reference.generate(hidden, frame_draws)
        assert margin > 1e-4  # no near-tie: float32 decides each choice as float64 does
        want.append(code.tolist())
    assert got == want
