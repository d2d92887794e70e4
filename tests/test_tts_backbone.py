"""The TTS backbone: cached steps, chunked prefill and a float64 NumPy Gemma-3 reference agree,
including past the sliding window (tiny window 32)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from voicechat.checkpoint import open_checkpoint
from voicechat.tts.backbone import Backbone

PREFIX = "tts_model.tts_model.backbone."


@pytest.fixture(scope="module")
def backbone(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint)
    cfg = ckpt.config.tts_config
    model = Backbone(cfg)
    ckpt.load_into(model, PREFIX)
    return model, cfg


def inputs(cfg, t, seed=0, batch=2):
    return mx.random.normal((batch, t, cfg.hidden_size), key=mx.random.key(seed))


# --------------------------------------------------------------------------- NumPy reference

def _w(p):
    return np.asarray(p.astype(mx.float32), np.float64)


def _norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + _w(w))


def _rope(x, base):
    """Rotate-half RoPE, positions 0..T-1 on axis -2 of [B, heads, T, d]."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = np.arange(x.shape[-2])[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_forward(model: Backbone, cfg, x: mx.array) -> np.ndarray:
    """Full-sequence recompute: causal, and a sliding layer's query at p sees keys p-W+1..p."""
    h = np.asarray(x, np.float64)
    b, t, _ = h.shape
    eps = cfg.rms_norm_eps
    qpos, kpos = np.arange(t)[:, None], np.arange(t)[None, :]
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        is_global = (i + 1) % cfg.sliding_window_pattern == 0
        base = cfg.rope_global_base_freq if is_global else cfg.rope_local_base_freq
        n = _norm(h, layer.input_layernorm.weight, eps)

        def heads(lin, count):
            return (n @ _w(lin.weight).T).reshape(b, t, count, cfg.head_dim).transpose(0, 2, 1, 3)

        q = _rope(_norm(heads(a.q_proj, cfg.num_attention_heads), a.q_norm.weight, eps), base)
        k = _rope(_norm(heads(a.k_proj, cfg.num_key_value_heads), a.k_norm.weight, eps), base)
        v = heads(a.v_proj, cfg.num_key_value_heads)
        allowed = kpos <= qpos
        if not is_global:
            allowed &= kpos > qpos - cfg.sliding_window
        scores = q @ k.transpose(0, 1, 3, 2) * cfg.query_pre_attn_scalar**-0.5
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, -1) @ _w(a.o_proj.weight).T
        h = h + _norm(out, layer.post_attention_layernorm.weight, eps)
        m = _norm(h, layer.pre_feedforward_layernorm.weight, eps)
        mlp = layer.mlp
        y = (_gelu_tanh(m @ _w(mlp.gate_proj.weight).T) * (m @ _w(mlp.up_proj.weight).T)) @ _w(mlp.down_proj.weight).T
        h = h + _norm(y, layer.post_feedforward_layernorm.weight, eps)
    return _norm(h, model.norm.weight, eps)


# --------------------------------------------------------------------------- tests

def test_tiny_config_has_sliding_and_global_layers(backbone):
    model, cfg = backbone
    assert cfg.sliding_window == 32 and cfg.global_layers == [5]
    assert [layer.window for layer in model.layers] == [32] * 5 + [None] + [32]
    assert model.layers[5].self_attn.rope_base == 1e6 and model.layers[0].self_attn.rope_base == 1e4


def test_prefill_matches_the_numpy_reference_beyond_the_window(backbone):
    model, cfg = backbone
    x = inputs(cfg, 80)
    out = model.prefill(x, model.make_cache())
    np.testing.assert_allclose(np.asarray(out), reference_forward(model, cfg, x), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [8, 256])
def test_steps_with_caches_equal_the_full_recompute(backbone, chunk):
    """37 warmup positions (more than the window), then 43 single-token steps to position 79;
    chunk 8 also grows the buffers several times and turns the sliding ones into rings."""
    model, cfg = backbone
    x = inputs(cfg, 80, seed=1)
    full = model.prefill(x, model.make_cache())
    cache = model.make_cache(chunk)
    outs = [model.prefill(x[:, :37], cache)]
    for p in range(37, 80):
        outs.append(model.step(x[:, p : p + 1], cache))
    steps = mx.concatenate(outs, axis=1)
    assert cache.offset == 80
    assert max(cache.capacity(i) for i in range(len(model.layers)) if model.layers[i].window) == 32
    np.testing.assert_allclose(np.asarray(steps), np.asarray(full), atol=5e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def stacked(tiny_checkpoint):
    """The backbone as `EarTTS.prepare` leaves it: q/k/v stacked, so that on CUDA the step's
    attention launches prepare the heads and store the new keys in the buffers themselves."""
    ckpt = open_checkpoint(tiny_checkpoint)
    cfg = ckpt.config.tts_config
    model = Backbone(cfg)
    ckpt.load_into(model, PREFIX)
    for layer in model.layers:
        layer.self_attn.stack()
    return model, cfg


def test_stacked_steps_equal_the_full_recompute(stacked):
    """The step as the model runs it: on CUDA each attention launch writes its layer's new key and
    value in place (no update op: `pending` holds only the launches to come after), elsewhere the
    pending writes. Past the window (the rings overwrite slots a previous step read), through
    buffer growth (chunk 8), compiled as EarTTS compiles it, and with every step left lazy until
    the end: the inputs are given, not made from the last output, so nothing but the cache orders
    one step's launches after the last one's."""
    from voicechat.kernels.gemv import on_cuda_gpu

    model, cfg = stacked
    assert model.writes_cache_in_place() == on_cuda_gpu()
    x = inputs(cfg, 80, seed=4)
    full = model.prefill(x, model.make_cache())
    compiled = mx.compile(model.step_arrays)
    for step_fn in (None, compiled):
        cache = model.make_cache(8)
        outs = [model.prefill(x[:, :37], cache)]
        for p in range(37, 80):
            outs.append(model.step(x[:, p : p + 1], cache, step_fn))
            assert (cache.pending[1] == []) == on_cuda_gpu()
        np.testing.assert_allclose(np.asarray(mx.concatenate(outs, axis=1)), np.asarray(full), atol=5e-5,
                                   rtol=1e-5)
        # The buffers hold what a prefill of the same positions stores.
        cache.flush()
        want = model.make_cache(8)
        model.prefill(x, want)
        for got, ref in zip(cache.buffers, want.buffers):  # (grown by steps, a buffer may hold more slots)
            n = min(got.shape[2], ref.shape[2])
            np.testing.assert_allclose(np.asarray(got[:, :, :n]), np.asarray(ref[:, :, :n]), atol=5e-5, rtol=1e-5)
            for extra in (got[:, :, n:], ref[:, :, n:]):
                assert not np.asarray(extra).any()


def test_stepping_from_position_zero_and_chunked_prefill_agree(backbone):
    model, cfg = backbone
    x = inputs(cfg, 70, seed=2)
    full = model.prefill(x, model.make_cache())
    cache = model.make_cache(8)
    stepped = mx.concatenate([model.step(x[:, p : p + 1], cache) for p in range(70)], axis=1)
    np.testing.assert_allclose(np.asarray(stepped), np.asarray(full), atol=5e-5, rtol=1e-5)
    cache = model.make_cache(8)
    chunks = [model.prefill(x[:, a:b], cache) for a, b in ((0, 20), (20, 65), (65, 70))]
    np.testing.assert_allclose(np.asarray(mx.concatenate(chunks, axis=1)), np.asarray(full), atol=5e-5, rtol=1e-5)


def _step_after_one(model, cfg):
    """A cache after a prefill of 5 positions and one step (its keys pending), and the graph of
    the next step: `(cache, h, buffers, pending)`."""
    x = inputs(cfg, 10, seed=7)
    cache = model.make_cache()
    model.prefill(x[:, :5], cache)
    model.step(x[:, 5:6], cache)
    mx.eval(cache.buffers, cache.pending)
    cache.reserve(7, x.shape[0])
    return (cache, *model.step_arrays(x[:, 6:7], mx.array(6, mx.int32), cache.buffers, cache.pending))


def test_a_step_reads_each_layers_keys_in_place(backbone):
    """The layers' keys and values are views of their window's buffer: no gather (a copy of the
    layer's keys and a launch each) anywhere in a step."""
    from voicechat.llm.opcount import count_ops

    model, cfg = backbone
    cache, h, buffers, pending = _step_after_one(model, cfg)
    counts = count_ops(h, *buffers, *pending[0])
    assert "Gather" not in counts and counts["DynamicSliceUpdate"] == len(cache.groups)


def test_a_step_writes_the_last_steps_keys_before_reading_the_buffers(backbone):
    """The buffers a step is given feed its pending writes and nothing else: every launch of the
    step reads the updated buffers. (Reading them before the update, as the step once did, kept
    them in use at the update, which on CUDA then copied them whole every step.)"""
    import re
    import tempfile

    model, cfg = backbone
    _, h, buffers, pending = _step_after_one(model, cfg)
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, h, *buffers, *pending[0])
        text = open(f.name).read()
    names = dict(re.findall(r'(\d+) \[label ="([^"]+)"', text))
    sources = set(re.findall(r'rank=source; "(\w+)"', text))
    consumers: dict[str, set[str]] = {}
    for a, b in re.findall(r'"?(\w+)"? -> "?(\w+)"?', text):
        if a in sources:
            consumers.setdefault(a, set()).add(names.get(b, b))
    updated = [c for c in consumers.values() if "DynamicSliceUpdate" in c]
    assert len(updated) >= 2 * len(buffers)  # each update's buffer and its stacked keys
    assert all(c == {"DynamicSliceUpdate"} for c in updated), updated


def test_pending_keys_are_written_by_the_next_step_or_a_flush(backbone):
    model, cfg = backbone
    x = inputs(cfg, 8, seed=5)
    cache = model.make_cache()
    model.prefill(x[:, :5], cache)
    before = [np.array(b) for b in cache.buffers]
    model.step(x[:, 5:6], cache)
    assert cache.pending is not None and cache.offset == 6
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, cache.buffers))  # slot 5 not yet
    k5, _ = cache.layer_kv(0)  # flushes
    assert cache.pending is None and float(mx.abs(k5[:, :, 5]).max()) > 0


def test_compiled_step_equals_the_uncompiled_step(backbone):
    model, cfg = backbone
    x = inputs(cfg, 45, seed=3)
    compiled = mx.compile(model.step_arrays)
    a, b = model.make_cache(), model.make_cache()
    model.prefill(x[:, :36], a)
    model.prefill(x[:, :36], b)
    for p in range(36, 45):
        ha = model.step(x[:, p : p + 1], a)
        hb = model.step(x[:, p : p + 1], b, compiled)
        np.testing.assert_allclose(np.asarray(ha), np.asarray(hb), atol=1e-6)


def test_a_sliding_query_sees_exactly_window_keys(backbone):
    """One sliding layer, window 32: the query at p depends on the input at p - 31 but not p - 32."""
    _, cfg = backbone
    one = dataclasses.replace(cfg, num_hidden_layers=1, sliding_window_pattern=1000)
    model = Backbone(one)
    mx.eval(model.parameters())
    x = inputs(one, 60, seed=4, batch=1)
    p = 50

    def step_output(x):
        cache = model.make_cache()
        model.prefill(x[:, :p], cache)
        return model.step(x[:, p : p + 1], cache)

    base = step_output(x)
    bump = mx.zeros_like(x)
    outside = step_output(x + bump.at[:, p - 32].add(3.0))
    inside = step_output(x + bump.at[:, p - 31].add(3.0))
    assert mx.array_equal(base, outside).item()
    assert not mx.allclose(base, inside, atol=1e-3).item()
