"""EAR-TTS (Network 3) on tiny synthetic checkpoints: pieces, caches, char encoder, generation."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from voicechat.checkpoint import open_checkpoint
from voicechat.synthetic import make_checkpoint
from voicechat.tokenizer import TextTokenizer
from voicechat.tts.char_encoder import CharVocabularyError, SubwordChars
from voicechat.tts.ear_tts import EarTTS
from voicechat.tts.layers import OffsetRMSNorm
from voicechat.kernels.mog_sample import top_p_keep

PREFIX = "tts_model.tts_model."


def load_tts(directory, compile=False) -> tuple[EarTTS, object]:
    ckpt = open_checkpoint(directory)
    cfg = ckpt.config
    tts = EarTTS(cfg.tts_config, cfg.text_config.vocab_size, compile=compile)
    ckpt.load_into(tts, PREFIX)
    tts.set_tokenizer(TextTokenizer(directory / "tokenizer.json"))
    return tts, ckpt


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_tts(tiny_checkpoint)


def prompt_codes(ckpt, seed=5):
    t = ckpt.config.tts_config
    return mx.random.randint(0, t.codebook_size, (1, 37, t.num_quantizers), key=mx.random.key(seed)).astype(mx.int32)


def run_session(tts, ckpt, seed, text_ids, prompt=None):
    cache = tts.make_cache()
    aria = ckpt.tensors["tts_model.audio_prompt_latents.Aria"]
    silence = ckpt.tensors["tts_model.codec_silence_tokens"]
    previous = tts.warmup(aria, prompt_codes(ckpt) if prompt is None else prompt, cache)
    key = mx.random.key(seed)
    codes = []
    for text_id in text_ids:
        previous, key = tts.step(previous, text_id, cache, key, silence)
        codes.append(previous)
    out = mx.concatenate(codes, axis=1)
    mx.eval(out)
    return out


# --------------------------------------------------------------------------- small pieces

def test_offset_rms_norm_equals_rms_norm_with_weight_plus_one():
    w = mx.random.normal((24,), key=mx.random.key(0)) * 0.1
    x = mx.random.normal((3, 5, 24), key=mx.random.key(1))
    offset = OffsetRMSNorm(24, eps=1e-6)
    offset.weight = w
    plain = nn.RMSNorm(24, eps=1e-6)
    plain.weight = w + 1.0
    assert mx.allclose(offset(x), plain(x), atol=1e-6).item()
    offset.prepare()  # the cached 1 + w gives the same numbers
    assert mx.allclose(offset(x), plain(x), atol=1e-6).item()
    xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * (1 + wn)
    np.testing.assert_allclose(np.asarray(offset(x)), ref, atol=1e-5)


def test_offset_rms_norm_computes_in_float32_from_bf16_weights():
    norm = OffsetRMSNorm(8)
    norm.weight = mx.full((8,), 0.5, mx.bfloat16)
    assert norm(mx.ones((1, 8), mx.bfloat16)).dtype == mx.float32


def test_top_p_keeps_at_least_the_largest_logit():
    logits = mx.random.normal((4, 64), key=mx.random.key(2)) * 5
    for p in (1e-9, 0.01, 0.5, 0.95):
        keep = top_p_keep(logits, p)
        top = mx.argmax(logits, axis=-1)
        assert mx.take_along_axis(keep, top[:, None], axis=-1).all().item()
    assert (top_p_keep(logits, 1e-9).sum(axis=-1) == 1).all().item()


def test_top_p_keeps_while_the_strictly_larger_mass_is_below_p():
    logits = mx.log(mx.array([[0.05, 0.5, 0.15, 0.3]]))
    assert top_p_keep(logits, 0.8).tolist() == [[False, True, False, True]]  # 0.5 + 0.3 is not < 0.8
    assert top_p_keep(logits, 0.81).tolist() == [[False, True, True, True]]
    ties = mx.log(mx.array([[0.2, 0.4, 0.4]]))
    assert top_p_keep(ties, 0.3).tolist() == [[False, True, True]]  # both of a tie, never one


def test_mask_schedule_counts_sum_to_31_for_exponent_3(tiny):
    tts, ckpt = tiny
    cfg = ckpt.config.tts_config
    assert cfg.exponent == 3.0 and cfg.num_iterations == 8
    assert cfg.mask_schedule == [0, 0, 0, 1, 1, 3, 4, 22]
    assert sum(cfg.mask_schedule) == 31
    assert tts._schedule == (1, 1, 3, 4, 22)  # five MoG calls per step


def test_depthsum_ignores_the_mask_index(tiny):
    tts, _ = tiny
    q, k = 31, tts.cfg.codebook_size
    rng = np.random.default_rng(0)
    code = rng.integers(0, k, (2, 3, q)).astype(np.int32)
    masked = code.copy()
    masked[..., 10:] = k
    books = np.asarray(tts.rvq_embs, np.float64)
    expected = sum(books[j][code[..., j]] for j in range(10))
    np.testing.assert_allclose(np.asarray(tts.depthsum(mx.array(masked))), expected, atol=1e-4)
    assert (tts.depthsum(mx.full((1, 1, q), k, mx.int32)) == 0).all().item()


def test_mog_head_infer_shapes_and_finite_for_batch_2(tiny):
    tts, _ = tiny
    mog, cfg = tts.mog_head, tts.cfg
    x = mx.random.normal((2, 3, cfg.hidden_size), key=mx.random.key(3))
    u = mx.random.uniform(shape=(1, 3, cfg.mog_head.num_predictions), key=mx.random.key(4))
    mu, logs = mog.infer(x, cfg.guidance_scale, cfg.top_p, u)
    assert mu.shape == (1, 3, cfg.latent_size) and logs.shape == (1, 3, 1)
    assert mu.dtype == mx.float32
    assert mx.isfinite(mu).all().item() and mx.isfinite(logs).all().item()
    assert (logs >= cfg.mog_head.min_log_std).all().item()


def test_mog_component_mean_equals_the_full_projection(tiny):
    tts, _ = tiny
    mog = tts.mog_head
    n, r, d = mog.num_predictions, mog.low_rank, mog.latent
    h = mx.random.normal((1, 2, mog.hidden), key=mx.random.key(6))
    c = mx.array([[3, n - 1]])
    all_mus = mog.proj_mus(h).reshape(1, 2, n, r)
    for t in range(2):
        ci = int(c[0, t])
        expected = mog.low_mat[ci] @ all_mus[0, t, ci]
        assert mx.allclose(mog.component_mean(h, c)[0, t], expected, atol=1e-5).item()


# --------------------------------------------------------------------------- char encoder

def test_char_encoder_only_scatters_masked_positions(tiny):
    tts, _ = tiny
    enc = tts.embed_subword
    ids = mx.array([[40, 41, 300, 12], [2, 100, 41, 383]])
    mask = mx.array([[True, False, True, False], [False, True, True, False]])
    out = enc(ids, mask)
    flags = enc.flags(ids)
    full = enc(ids)  # everything encoded
    m = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(out)[~m], np.asarray(flags)[~m])  # untouched: flags only
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(full)[m], atol=1e-5)
    assert not np.allclose(np.asarray(full)[~m], np.asarray(flags)[~m])  # the encoder does add something


def test_char_table_equals_the_per_id_encoder(tiny):
    tts, _ = tiny
    enc, vocab = tts.embed_subword, tts.vocab_size
    table = tts.char_table()
    assert table.shape == (vocab + 1, tts.cfg.hidden_size) and table.dtype == mx.float32
    every = enc(mx.arange(vocab)[None])[0]  # one padded batch of every id
    np.testing.assert_allclose(np.asarray(table[:vocab]), np.asarray(every), atol=2e-5)
    for i in (1, 2, 12, 16, 100, 271, 300, vocab - 1):  # one id at a time, no padding at all
        np.testing.assert_allclose(np.asarray(table[i]), np.asarray(enc(mx.array([[i]]))[0, 0]), atol=2e-5)
    # Ids beyond the vocabulary: no characters, the stored pad entry's flags.
    np.testing.assert_allclose(np.asarray(table[vocab]), np.asarray(enc(mx.array([[vocab + 7]]))[0, 0]), atol=1e-6)


def _edited_tokenizer(src, dst, renames: dict[int, str]) -> TextTokenizer:
    data = json.loads((src / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["id"] in renames:
            entry["content"] = renames[entry["id"]]
    vocab = data["model"]["vocab"]
    for token, i in list(vocab.items()):
        if i in renames:
            del vocab[token]
            vocab[renames[i]] = i
    dst.write_text(json.dumps(data))
    return TextTokenizer(dst)


def test_char_encoder_drops_unknown_characters_and_pools_empty_to_zero(tiny, tiny_checkpoint, tmp_path):
    tts, ckpt = tiny
    tok = _edited_tokenizer(tiny_checkpoint, tmp_path / "tokenizer.json", {3: "<€3>", 4: "€€"})
    other = EarTTS(ckpt.config.tts_config, tts.vocab_size)
    other.update(dict(tts.parameters()))
    other.set_tokenizer(tok)
    enc = other.embed_subword
    assert len(enc.char_ids(3)) == 3  # '<', '3', '>' kept, '€' dropped
    assert enc.char_ids(4) == ()
    table = other.char_table()
    np.testing.assert_allclose(np.asarray(table[4]), np.asarray(enc.flags(mx.array(4))), atol=1e-6)


def test_subword_chars_are_each_tokens_known_characters_in_order():
    chars = ["é", "b", "a", "\U0001f600", "\u0120"]  # (not in code point order)
    vocab = {"ab": 0, "ba€a": 2, "": 3, "\u0120é\U0001f600x": 4, "zz": 5, "a": 6, "\ud800b": 7, "out": 99}
    m = SubwordChars.build(vocab, chars, 8)
    index = {c: i for i, c in enumerate(chars)}
    for i in range(8):
        token = next((t for t, j in vocab.items() if j == i), "")
        assert m[i] == tuple(index[c] for c in token if c in index), (i, token)
    assert m[1] == () and m[2] == (1, 2, 2) and m[4] == (4, 0, 3)
    assert m.lengths.tolist() == [2, 0, 3, 0, 3, 0, 1, 1]
    other = SubwordChars.build({**vocab, "ab": 6, "a": 0}, chars, 8)
    assert other.digest() != m.digest()


def test_char_vocabulary_must_have_256_single_characters(tiny, tiny_checkpoint, tmp_path):
    tts, _ = tiny
    tok = _edited_tokenizer(tiny_checkpoint, tmp_path / "tokenizer.json", {5: "Ω"})
    assert len(tok.single_character_tokens()) == 257
    with pytest.raises(CharVocabularyError, match="257 single-character tokens"):
        tts.embed_subword.__class__(tts.cfg.character_encoder, tts.vocab_size).set_tokenizer(tok)


# --------------------------------------------------------------------------- generation

TEXT = [100, 200, 2, 50, 300]


def test_warmup_and_five_steps_give_codes_in_range(tiny):
    tts, ckpt = tiny
    codes = run_session(tts, ckpt, 0, TEXT)
    k = ckpt.config.tts_config.codebook_size
    assert codes.shape == (1, len(TEXT), 31) and codes.dtype == mx.int32
    assert ((codes >= 0) & (codes < k)).all().item()


def test_same_seed_same_codes_other_seed_other_codes(tiny):
    tts, ckpt = tiny
    a = run_session(tts, ckpt, 0, TEXT)
    b = run_session(tts, ckpt, 0, TEXT)
    c = run_session(tts, ckpt, 1, TEXT)
    assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, c).item()


def test_frame_draws_are_the_global_generators_in_the_reference_order(tiny):
    """Seeded once, MLX's global generator drawing per MoG call one uniform (1, 1, N) then one
    normal (1, 1, L), frame after frame, gives the numbers the step draws from the explicit key
    `mx.random.key(seed)`, and leaves the state the step hands on."""
    from voicechat.tts.ear_tts import frame_noise

    tts, _ = tiny
    calls, n, latent = len(tts._schedule), tts.mog_head.num_predictions, tts.cfg.latent_size
    for seed in (0, 1234):
        key = mx.random.key(seed)
        mx.random.seed(seed)
        for _ in range(3):
            uniforms, normals, key = frame_noise(key, calls, n, latent)
            for u, noise in zip(uniforms, normals):
                assert mx.array_equal(u, mx.random.uniform(shape=(1, 1, n))).item()
                assert mx.array_equal(noise, mx.random.normal(shape=(1, 1, latent))).item()
            assert mx.array_equal(key, mx.random.state[0]).item()


def test_a_step_hands_on_the_generator_state_after_its_draws(tiny):
    """Five MoG calls a frame, two draws each: after k steps the key is the global generator's
    state after 10 k draws from the same seed."""
    tts, ckpt = tiny
    cache = tts.make_cache()
    silence = ckpt.tensors["tts_model.codec_silence_tokens"]
    previous = tts.warmup(ckpt.tensors["tts_model.audio_prompt_latents.Aria"], prompt_codes(ckpt), cache)
    key = mx.random.key(9)
    for text_id in TEXT[:3]:
        previous, key = tts.step(previous, text_id, cache, key, silence)
    mx.random.seed(9)
    for _ in range(3 * len(tts._schedule)):
        mx.random.uniform(shape=(1,))
        mx.random.normal(shape=(1,))
    assert mx.array_equal(key, mx.random.state[0]).item()


def test_compiled_step_gives_the_same_codes(tiny_checkpoint, tiny):
    tts, ckpt = tiny
    compiled, _ = load_tts(tiny_checkpoint, compile=True)
    assert mx.array_equal(run_session(compiled, ckpt, 3, TEXT), run_session(tts, ckpt, 3, TEXT)).item()


def test_cfg_fusion_equals_the_fusion_of_the_concatenated_batch(tiny):
    """The step's fusion (the audio projected once, the null row's text projection made at load)
    gives the rows of the gated fusion over [(code, text), (code, null)]."""
    tts, _ = tiny
    tts.prepare()
    h = tts.cfg.hidden_size
    code = mx.random.normal((1, 3, h), key=mx.random.key(11))
    cond = mx.random.normal((1, 3, h), key=mx.random.key(12))
    null = mx.broadcast_to(tts.null_emb.astype(mx.float32), cond.shape)
    want = tts.gated_fusion_audio_text(mx.concatenate([code, code]), mx.concatenate([cond, null]))
    got = tts.fuse(code, cond)
    assert got.shape == (2, 3, h)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)


def test_stacked_projections_give_the_codes_of_separate_ones(tiny_checkpoint, tiny):
    tts, ckpt = tiny  # stacked (the default)
    tts.prepare()
    assert tts.backbone.layers[0].self_attn._qkv is not None and tts.mog_head._heads is not None
    separate = EarTTS(ckpt.config.tts_config, ckpt.config.text_config.vocab_size, compile=False,
                      stack_projections=False)
    ckpt.load_into(separate, PREFIX)
    separate.set_tokenizer(TextTokenizer(tiny_checkpoint / "tokenizer.json"))
    separate.prepare()
    assert separate.backbone.layers[0].self_attn._qkv is None and separate.mog_head._heads is None
    ids = [5, 40, 12, 2, 77, 300, 11, 9]
    np.testing.assert_array_equal(np.array(run_session(tts, ckpt, 4, ids)), np.array(run_session(separate, ckpt, 4, ids)))
    # The stack and the layers it was made of read one buffer: the step's inputs are the same numbers.
    x = mx.random.normal((2, 1, tts.cfg.hidden_size), key=mx.random.key(3))
    attn, mlp = tts.backbone.layers[1].self_attn, tts.mog_head.mlp_stack[0].mlp
    q, k, v = mx.split(attn._qkv(x), [attn.q_proj.weight.shape[0], 2 * attn.q_proj.weight.shape[0]], axis=-1)
    np.testing.assert_allclose(np.array(q), np.array(attn.q_proj(x)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(v), np.array(attn.v_proj(x)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(mlp(x)), np.array(separate.mog_head.mlp_stack[0].mlp(x)), rtol=1e-6, atol=1e-6)
    # Loading new weights drops the stacks (they would hold the old ones).
    tts.update(tts.parameters())
    assert tts.backbone.layers[0].self_attn._qkv is None


def test_eos_replaces_the_previous_code_by_silence(tiny):
    tts, ckpt = tiny
    aria = ckpt.tensors["tts_model.audio_prompt_latents.Aria"]
    silence = ckpt.tensors["tts_model.codec_silence_tokens"]
    results = []
    for previous in (mx.zeros((1, 1, 31), mx.int32), silence.reshape(1, 1, 31), None):
        cache = tts.make_cache()
        first = tts.warmup(aria, prompt_codes(ckpt), cache)
        prev = first if previous is None else previous
        codes, _ = tts.step(prev, 2, cache, mx.random.key(0), silence)
        results.append(codes)
    assert mx.array_equal(results[0], results[1]).item() and mx.array_equal(results[1], results[2]).item()
    # ... and a non-EOS id with different previous codes differs.
    outs = []
    for previous in (mx.zeros((1, 1, 31), mx.int32), silence.reshape(1, 1, 31)):
        cache = tts.make_cache()
        tts.warmup(aria, prompt_codes(ckpt), cache)
        outs.append(tts.step(previous, 100, cache, mx.random.key(0), silence)[0])
    assert not mx.array_equal(outs[0], outs[1]).item()


def test_warmup_uses_only_prompt_frame_35(tiny):
    """Frames 0 and 36 are masked, 0..35 are replaced by the Aria latent after the shift, so only
    frame 35 (seen by position 36) reaches the caches."""
    tts, ckpt = tiny
    aria = ckpt.tensors["tts_model.audio_prompt_latents.Aria"]

    def keys_after(prompt):
        cache = tts.make_cache()
        previous = tts.warmup(aria, prompt, cache)
        mx.eval(cache.buffers)
        return cache, previous

    base = prompt_codes(ckpt, 1)
    other = mx.concatenate([prompt_codes(ckpt, 2)[:, :35], base[:, 35:36], prompt_codes(ckpt, 2)[:, 36:]], axis=1)
    changed = mx.concatenate([base[:, :35], prompt_codes(ckpt, 2)[:, 35:36], base[:, 36:]], axis=1)
    (c0, p0), (c1, _), (c2, _) = keys_after(base), keys_after(other), keys_after(changed)
    extra_frame = mx.concatenate([base, prompt_codes(ckpt, 3)[:, :1]], axis=1)  # F + 1 frames: last dropped
    c3, _ = keys_after(extra_frame)
    assert all(mx.array_equal(a, b).item() for a, b in zip(c0.buffers, c3.buffers))
    assert c0.offset == 37
    assert (p0 == tts.cfg.codebook_size).all().item() and p0.shape == (1, 1, 31)
    assert all(mx.array_equal(a, b).item() for a, b in zip(c0.buffers, c1.buffers))
    assert not all(mx.array_equal(a, b).item() for a, b in zip(c0.buffers, c2.buffers))


# --------------------------------------------------------------------------- loading

@pytest.mark.parametrize("layout,dtype", [("mlx", "float32"), ("torch", "bfloat16"), ("mlx", "bfloat16")])
def test_loads_both_layouts_and_dtypes(tmp_path, tiny, layout, dtype):
    directory = make_checkpoint(tmp_path / "c", "tiny", layout=layout, dtype=dtype)
    tts, ckpt = load_tts(directory)
    assert tts.backbone.layers[0].mlp.up_proj.weight.dtype == getattr(mx, dtype)
    assert tts.embed_subword.subword_flag_emb.is_continuation.dtype == mx.int32
    codes = run_session(tts, ckpt, 0, TEXT[:2])
    assert ((codes >= 0) & (codes < ckpt.config.tts_config.codebook_size)).all().item()
    if dtype == "float32":  # same seed, same weights: the layout changes nothing
        reference, ref_ckpt = tiny
        assert mx.array_equal(codes, run_session(reference, ref_ckpt, 0, TEXT[:2])).item()


def test_loading_rejects_a_missing_tensor(tiny_checkpoint):
    from voicechat.checkpoint import CheckpointError

    ckpt = open_checkpoint(tiny_checkpoint)
    del ckpt.tensors[PREFIX + "mog_head.proj_logs.weight"]
    tts = EarTTS(ckpt.config.tts_config, ckpt.config.text_config.vocab_size)
    with pytest.raises(CheckpointError, match="mog_head.proj_logs.weight"):
        ckpt.load_into(tts, PREFIX)


def test_the_rvq_kernel_and_its_reference_give_the_same_codes(tiny, monkeypatch):
    tts, ckpt = tiny
    fast = run_session(tts, ckpt, 4, TEXT)
    monkeypatch.setenv("VOICECHAT_REFERENCE", "1")
    assert mx.array_equal(fast, run_session(tts, ckpt, 4, TEXT)).item()


def test_float32_weights_give_the_codes_of_bf16_weights(tmp_path):
    """Activations are float32 either way, so widening bf16 weights once at load (no per-call
    cast) changes nothing."""
    directory = make_checkpoint(tmp_path / "c", "tiny", dtype="bfloat16")
    tts, ckpt = load_tts(directory)
    bf16 = run_session(tts, ckpt, 2, TEXT)
    tts.set_dtype(mx.float32)
    assert tts.rvq_embs.dtype == mx.float32 and tts.embed_subword.bos_eos_emb.special_flags.dtype == mx.int32
    assert mx.array_equal(bf16, run_session(tts, ckpt, 2, TEXT)).item()


def test_full_size_module_has_every_published_tensor():
    """The published inventory's `tts_model.tts_model.*` names and shapes, and nothing else
    (parameters are lazy: nothing of the full size is allocated)."""
    from pathlib import Path

    from mlx.utils import tree_flatten

    from voicechat.config import VoiceChatConfig

    published = {}
    for line in (Path(__file__).parent / "data" / "published-checkpoint-keys.tsv").read_text().splitlines():
        if line.startswith(PREFIX):
            name, shape, _ = line.split("\t")
            published[name[len(PREFIX):]] = tuple(int(s) for s in shape.strip("()").split(",") if s.strip())
    cfg = VoiceChatConfig()
    tts = EarTTS(cfg.tts_config, cfg.text_config.vocab_size)
    ours = {k: tuple(v.shape) for k, v in tree_flatten(tts.parameters())}
    assert ours == published


def test_composed_rope_equals_mlx_fast_rope():
    from voicechat.tts.char_encoder import rotate_half_rope

    x = mx.random.normal((3, 4, 9, 24), key=mx.random.key(1))
    want = mx.fast.rope(x, 24, traditional=False, base=1e4, scale=1.0, offset=0)
    np.testing.assert_allclose(np.array(rotate_half_rope(x, 1e4)), np.array(want), rtol=1e-5, atol=1e-5)


def test_backbone_step_launches_on_cuda(tiny_checkpoint, tiny):
    """On a CUDA GPU a backbone layer is 5 launches of ours: the attention with the head norms +
    RoPE inside (one launch: buffers of <= 1024 slots), o_proj, the norm seam with gate/up, down_proj with the
    gated GELU, the norm seam with the next layer's q/k/v (the last: the final norm). Layer 0 adds
    its input norm with its q/k/v GEMV (one launch); MLX's attention and rms_norm never run. The attention
    launches store the new keys and values in the buffers themselves: no concatenation or update
    op touches the buffers, so none can copy them."""
    from voicechat.kernels.gemv import on_cuda_gpu, use_gemv
    from voicechat.llm.opcount import count_ops, custom_kernels

    if not on_cuda_gpu():
        pytest.skip("the kernels run on a CUDA GPU")
    tts, ckpt = tiny
    fresh = EarTTS(ckpt.config.tts_config, ckpt.config.text_config.vocab_size, compile=False)
    ckpt.load_into(fresh, PREFIX)
    use_gemv(fresh.backbone)
    use_gemv(fresh.mog_head)
    fresh.set_tokenizer(TextTokenizer(tiny_checkpoint / "tokenizer.json"))
    fresh.prepare()  # norm scales, the stacks
    cache = fresh.make_cache()
    x = mx.random.normal((2, 1, fresh.cfg.hidden_size))
    assert fresh.backbone.writes_cache_in_place()
    fresh.backbone.step(x, cache)
    assert cache.pending[1] == []  # no writes left to do: the launches' outputs to depend on
    cache.reserve(2, 2)
    mx.eval(x, cache.buffers, cache.pending)
    h, buffers, pending = fresh.backbone.step_arrays(x, mx.array(1, mx.int32), cache.buffers, cache.pending)
    counts = count_ops(h, *buffers, *pending[0])
    layers = fresh.cfg.num_hidden_layers
    assert "Concatenate" not in counts and "DynamicSliceUpdate" not in counts and counts.get("Depends") == 1
    assert max(cache.capacity(i) for i in range(layers)) <= 256
    assert custom_kernels(counts) == 5 * layers + 1
    assert "RMSNorm" not in counts and "RoPE" not in counts and "ScaledDotProductAttention" not in counts
    assert "Gather" not in counts  # each layer's keys are views of its window's buffer
    # Still one attention launch a layer at 768 slots (a 60 s answer): no merge launch below 1024.
    cache.reserve(700, 2)
    mx.eval(cache.buffers)
    assert max(cache.capacity(i) for i in range(layers)) == 768
    h, _, _ = fresh.backbone.step_arrays(x, mx.array(699, mx.int32), cache.buffers, cache.pending)
    assert custom_kernels(count_ops(h)) == 5 * layers + 1
    # Past 1024 slots, a merge launch for each layer whose buffer holds more (the global ones: the
    # tiny sliding window is 32).
    cache.reserve(1100, 2)
    mx.eval(cache.buffers)
    h, _, _ = fresh.backbone.step_arrays(x, mx.array(1099, mx.int32), cache.buffers, cache.pending)
    merged = sum(cache.capacity(i) > 1024 for i in range(layers))
    assert merged >= 1 and custom_kernels(count_ops(h)) == 5 * layers + 1 + merged


def _gemv_tts(tiny_checkpoint, ckpt) -> EarTTS:
    """A fresh EAR-TTS of the tiny checkpoint with our GEMV layers swapped in (as `load` does on a CUDA GPU)."""
    from voicechat.prepare import prepare_tts

    fresh = EarTTS(ckpt.config.tts_config, ckpt.config.text_config.vocab_size, compile=False)
    ckpt.load_into(fresh, PREFIX)
    return prepare_tts(fresh, TextTokenizer(tiny_checkpoint / "tokenizer.json"), kernels=True)


def test_frame_code_embedding_equals_the_code_embedding(tiny_checkpoint, tiny):
    """With the GEMV layers (one launch on a CUDA GPU, `kernels.code_embedding`): the depth sum and
    `embed_code`, equal to the composed ops of `code_embedding`, once per CFG row asked for."""
    _, ckpt = tiny
    tts = _gemv_tts(tiny_checkpoint, ckpt)
    q, k = tts.cfg.num_quantizers, tts.cfg.codebook_size
    code = mx.random.randint(0, k + 1, (1, q), key=mx.random.key(3)).astype(mx.int32)
    code = mx.where(mx.arange(q) % 3 == 0, k, code)  # some still masked
    with mx.stream(mx.cpu):
        want = np.array(tts.embed_code(tts.depthsum(code)))[:, None, :]
    got = tts.frame_code_embedding(code, rows=2)
    assert got.shape == (2, 1, tts.cfg.hidden_size)
    np.testing.assert_allclose(np.array(got), np.broadcast_to(want, got.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(tts.frame_code_embedding(code.reshape(1, 1, q))), want, rtol=1e-5, atol=1e-5)


def test_code_generation_launches_on_cuda(tiny_checkpoint, tiny):
    """On a CUDA GPU an unmasking iteration's codes land in the frame's code row inside the RVQ
    launch (no concatenation and its copy launches), its input embedding is one launch (no gather
    or sum of MLX's), and the MoG head adds it to the hidden states inside its first launch, the
    input norm and gate/up (no RMSNorm of MLX's). Our launches: per iteration the MoG head's
    2 L + 3 (the first norm with gate/up, L downs, L - 1 seams with the next gate/up, the final
    seam, the three stacked projections, the draw), the RVQ's one (the cluster kernel, which runs
    under our own launch), the embedding from the second iteration on. (MLX's own ops left are the
    frame's random draws.)"""
    from voicechat.kernels._native import kernel_launch
    from voicechat.llm.opcount import count_ops, custom_kernels

    if kernel_launch()["launch"] != "own":
        pytest.skip("the kernels run on a CUDA GPU, the RVQ's through our own launch")
    _, ckpt = tiny
    tts = _gemv_tts(tiny_checkpoint, ckpt)
    hidden = mx.random.normal((2, 1, tts.cfg.hidden_size), key=mx.random.key(4))
    codes, key = tts.generate_codes(hidden, mx.random.key(1))
    counts = count_ops(codes, key)
    for kind in ("Concatenate", "Gather", "Sum", "RMSNorm"):
        assert kind not in counts, counts
    iterations, layers = len(tts._schedule), len(tts.mog_head.mlp_stack) - 1
    want = iterations * (2 * layers + 3) + iterations + (iterations - 1)
    assert custom_kernels(counts) == want, counts
    assert codes.shape == (1, 1, tts.cfg.num_quantizers)
    mx.eval(codes)
    assert 0 <= int(codes.min()) and int(codes.max()) < tts.cfg.codebook_size


