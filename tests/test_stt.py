"""Speech in: log-mel frontend, FastConformer perception, loading from the checkpoint."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from voicechat.audio import load_audio, write_wav
from voicechat.checkpoint import open_checkpoint
from voicechat.config import PreprocessorConfig
from voicechat.kernels.rel_pos_attention import chunked_limited_mask, rel_shift
from voicechat.stt.conformer import (
    CausalSubsampling,
    ConformerBlock,
    Perception,
    project,
    relative_positions,
    subsampled_length,
)
from voicechat.stt.mel import hann_window, log_mel, mel_filterbank, num_frames, preemphasis, preemphasis_host
from voicechat.synthetic import make_checkpoint, tiny_config

CFG = PreprocessorConfig()
LOG_GUARD = math.log(2.0**-24)


# --------------------------------------------------------------------------- an independent log-mel

def slaney_filterbank_f64(sample_rate=16000, n_fft=512, n_mels=128) -> np.ndarray:
    """Triangles through the Slaney mel points, one filter at a time, float64."""

    def hz_to_mel(f):
        return f / (200.0 / 3.0) if f < 1000.0 else 15.0 + math.log(f / 1000.0) * 27.0 / math.log(6.4)

    def mel_to_hz(m):
        return m * (200.0 / 3.0) if m < 15.0 else 1000.0 * math.exp((m - 15.0) * math.log(6.4) / 27.0)

    top = hz_to_mel(sample_rate / 2)
    edges = [mel_to_hz(top * i / (n_mels + 1)) for i in range(n_mels + 2)]
    freqs = [k * sample_rate / n_fft for k in range(n_fft // 2 + 1)]
    fb = np.zeros((n_mels, len(freqs)))
    for m in range(n_mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        for k, f in enumerate(freqs):
            if lo < f < hi:
                fb[m, k] = (f - lo) / (mid - lo) if f <= mid else (hi - f) / (hi - mid)
        fb[m] *= 2.0 / (hi - lo)
    return fb


def log_mel_f64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    y = np.empty_like(x)
    y[0] = x[0]
    y[1:] = x[1:] - 0.97 * x[:-1]
    y = np.pad(y, 256, mode="reflect")  # numpy's 'reflect' does not repeat the edge sample
    frames = 1 + len(x) // 160
    n = np.arange(400)
    window = np.zeros(512)
    window[56:456] = 0.5 - 0.5 * np.cos(2 * np.pi * n / 399)
    spec = np.fft.rfft(np.stack([y[t * 160 : t * 160 + 512] for t in range(frames)]) * window, axis=-1)
    power = spec.real**2 + spec.imag**2
    return np.log(power @ slaney_filterbank_f64().T + 2.0**-24)


@pytest.fixture(scope="module")
def speech(spoken_wav) -> np.ndarray:
    return load_audio(spoken_wav, 16000)


def _perception(path) -> Perception:
    ckpt = open_checkpoint(path)
    model = Perception(ckpt.config.audio_config)
    ckpt.load_into(model, "stt_model.perception.")
    return model


@pytest.fixture(scope="module")
def perception(tiny_checkpoint) -> Perception:
    return _perception(tiny_checkpoint)


@pytest.fixture(scope="module")
def perception_bf16(tiny_checkpoint_q4) -> Perception:
    return _perception(tiny_checkpoint_q4)


# --------------------------------------------------------------------------- log-mel

@pytest.mark.parametrize("n", [257, 400, 1599, 1600, 16000, 53213])
def test_frame_count_is_one_plus_len_over_hop(n):
    audio = mx.array(np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.1)
    mel = log_mel(audio, CFG)
    assert mel.shape == (1, 1 + n // 160, 128) == (1, num_frames(n, CFG), 128)
    assert mel.dtype == mx.float32


def test_silence_gives_the_log_guard_everywhere():
    mel = np.array(log_mel(mx.zeros((16000,)), CFG))
    np.testing.assert_allclose(mel, LOG_GUARD, rtol=0, atol=1e-6)
    assert mel.shape == (1, 101, 128)


def test_preemphasis_keeps_the_first_sample():
    x = mx.array([0.5, -0.25, 1.0, 0.0])
    np.testing.assert_allclose(np.array(preemphasis(x, 0.97)), [0.5, -0.25 - 0.485, 1.0 + 0.2425, -0.97],
                               rtol=1e-6)
    # In the full frontend: an impulse on sample 0 shows up in frame 0 with its full height.
    impulse = np.zeros(1600, dtype=np.float32)
    impulse[0] = 1.0
    np.testing.assert_allclose(np.array(log_mel(mx.array(impulse), CFG))[0], log_mel_f64(impulse),
                               rtol=1e-5, atol=1e-5)


def test_preemphasis_on_the_host_has_the_devices_bits():
    """A live session's chunks are preemphasized with numpy: the same float32 multiply and subtract
    as `preemphasis`, so the same bits, with and without the sample before the chunk."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1283) * rng.uniform(0.01, 1.0)).astype(np.float32)
    previous = np.array([rng.standard_normal()], np.float32)
    np.testing.assert_array_equal(preemphasis_host(x, 0.97), np.array(preemphasis(mx.array(x), 0.97)))
    np.testing.assert_array_equal(preemphasis_host(x, 0.97, previous),
                                  np.array(preemphasis(mx.array(x), 0.97, mx.array(previous))))
    # and each is the float64 formula to float32 rounding
    exact = x.astype(np.float64) - 0.97 * np.concatenate([previous, x[:-1]]).astype(np.float64)
    np.testing.assert_allclose(preemphasis_host(x, 0.97, previous), exact, rtol=0, atol=1e-6)


def test_log_mel_matches_float64_numpy_on_speech(speech):
    ours = np.array(log_mel(mx.array(speech), CFG))[0]
    ref = log_mel_f64(speech)
    assert ours.shape == ref.shape == (1 + len(speech) // 160, 128)
    # Bands louder than e^-8 of full scale agree to 1e-5. Quieter ones sit near float32's noise
    # floor (~1e-7 of the frame's energy): a band 70 dB below its frame is known to ~1e-4 in log.
    loud = ref > -8.0
    assert loud.mean() > 0.2
    np.testing.assert_allclose(ours[loud], ref[loud], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=5e-4)


def test_filterbank_matches_slaney_formula_and_the_checkpoint(tiny_checkpoint, perception):
    fb = mel_filterbank(16000, 512, 128)
    assert fb.shape == (128, 257) and fb.dtype == np.float32
    np.testing.assert_allclose(fb, slaney_filterbank_f64(), rtol=1e-6, atol=1e-9)
    stored = open_checkpoint(tiny_checkpoint).tensors["stt_model.perception.preprocessor.featurizer.fb"]
    assert stored.shape == (1, 128, 257) and stored.dtype == mx.float32
    np.testing.assert_array_equal(np.array(stored)[0], fb)
    np.testing.assert_array_equal(np.array(perception.preprocessor.featurizer.fb)[0], fb)
    np.testing.assert_allclose(np.array(perception.preprocessor.featurizer.window), hann_window(400), rtol=0,
                               atol=1e-7)


def test_perception_log_mel_uses_the_stored_buffers(perception, speech):
    ours = perception.log_mel(mx.array(speech))
    np.testing.assert_array_equal(np.array(ours), np.array(log_mel(mx.array(speech), CFG)))
    # A different stored filterbank changes the output: the buffers are really used.
    f = perception.preprocessor.featurizer
    saved = f.fb
    try:
        f.fb = saved * 2.0
        doubled = perception.log_mel(mx.array(speech))
    finally:
        f.fb = saved
    np.testing.assert_allclose(np.array(doubled), np.array(ours), rtol=0, atol=0.7)
    assert not np.array_equal(np.array(doubled), np.array(ours))


# --------------------------------------------------------------------------- encoder pieces

@pytest.mark.parametrize("mel_frames,encoder_frames", [(1, 1), (2, 2), (9, 2), (16, 3), (128, 17), (333, 43)])
def test_subsampling_lengths(mel_frames, encoder_frames):
    assert subsampled_length(mel_frames) == encoder_frames
    cfg = tiny_config().audio_config.encoder
    sub = CausalSubsampling(cfg)
    out = sub(mx.zeros((1, mel_frames, 128)))
    assert out.shape == (1, encoder_frames, cfg.d_model)
    assert cfg.subsampled_features == 17
    assert sub.out.weight.shape == (cfg.d_model, cfg.subsampling_conv_channels * 17)


def test_a_53213_sample_wav_gives_43_frames(perception, tmp_path):
    path = write_wav(tmp_path / "a.wav", np.random.default_rng(1).standard_normal(53213) * 0.1, 16000)
    audio = load_audio(path, 16000)
    assert audio.shape == (53213,)
    mel = perception.log_mel(mx.array(audio))
    assert mel.shape == (1, 333, 128)
    projected, lengths, encoded = perception(mel)
    assert projected.shape == (1, 43, 192) and encoded.shape == (1, 43, 80)
    assert lengths.tolist() == [43] and lengths.dtype == mx.int32


def test_stepwise_encoder_equals_the_one_graph_encoder(perception):
    """`stepwise` (the session's way past 30 s: a wait after the subsampling and each layer) is
    only a schedule: the same encoded frames and projection."""
    mel = mx.random.normal((1, 700, perception.config.encoder.feat_in), key=mx.random.key(8))
    whole = perception(mel)
    stepwise = perception(mel, stepwise=True)
    for a, b in zip(whole, stepwise):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_lengths_follow_the_given_mel_lengths(perception):
    _, lengths, _ = perception(mx.zeros((1, 128, 128)), mx.array([100]))
    assert lengths.tolist() == [subsampled_length(100)] == [14]


def test_chunked_limited_mask_70_0_allows_self_and_70_left():
    mask = np.array(chunked_limited_mask(150, 70, 0))
    i, j = np.indices(mask.shape)
    np.testing.assert_array_equal(mask, (j <= i) & (j >= i - 70))
    assert mask[100].sum() == 71 and mask[0].sum() == 1


def test_rel_shift_hand_checked_1x1x3x5():
    x = mx.arange(15, dtype=mx.float32).reshape(1, 1, 3, 5)
    shifted = np.array(rel_shift(x))
    np.testing.assert_array_equal(shifted[0, 0], [[2, 3, 4, 0, 5], [6, 7, 8, 9, 0], [10, 11, 12, 13, 14]])
    # The first L columns: entry (i, j) is positional row L - 1 - i + j (relative position i - j).
    np.testing.assert_array_equal(shifted[0, 0, :, :3], [[2, 3, 4], [6, 7, 8], [10, 11, 12]])


def test_relative_positions_table():
    pe = np.array(relative_positions(4, 8))
    assert pe.shape == (7, 8)
    pos = np.arange(3, -4, -1)[:, None]
    div = np.exp(-np.arange(0, 8, 2) * math.log(1e4) / 8)
    np.testing.assert_allclose(pe[:, 0::2], np.sin(pos * div), atol=1e-6)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(pos * div), atol=1e-6)
    np.testing.assert_array_equal(pe[3], [0, 1, 0, 1, 0, 1, 0, 1])  # relative position 0 is the centre row
    np.testing.assert_array_equal(np.array(relative_positions(4, 8, 2, 3)), pe[2:5])


def test_windowed_table_gives_the_full_table_result():
    cfg = tiny_config().audio_config.encoder
    block = ConformerBlock(cfg)
    x = mx.random.normal((1, 90, cfg.d_model), key=mx.random.key(2))
    full = block(x, relative_positions(90, cfg.d_model))
    windowed = block(x, relative_positions(90, cfg.d_model, 89 - 70, 71), 89 - 70)
    np.testing.assert_allclose(np.array(windowed), np.array(full), rtol=1e-5, atol=1e-5)


def test_prepared_encoder_reads_held_views_and_drops_stale_ones():
    """`ConformerEncoder.prepare` holds each projection's transposed weight and each depthwise
    conv's taps as evaluated views: a product reads the held view (a Matmul alone in its graph, no
    Transpose) and gives the values of `x @ w.T`; once the weights are replaced (a dtype change)
    the held views are stale and unused, until `prepare` runs again."""
    from voicechat.llm.opcount import count_ops

    cfg = tiny_config().audio_config
    model = Perception(cfg)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    layer = model.encoder.layers[0]
    x = mx.random.normal((3, cfg.encoder.d_model), key=mx.random.key(1))

    def check(prepared: bool):
        linears = [layer.feed_forward1.linear1, layer.conv.pointwise_conv2]
        if prepared:  # (the stacked q, k and v: prepare's own layer, which a dtype change does not cast)
            linears.append(layer.self_attn._qkv)
        for linear in linears:
            w = linear.weight.reshape(linear.weight.shape[0], -1)
            rows = x.astype(w.dtype)
            mx.eval(rows)
            got, want = project(linear, rows), rows @ w.T
            counts = count_ops(got)
            assert counts == {"Matmul": 1} if prepared else counts["Transpose"] == 1
            assert mx.array_equal(got, want).item()
        taps = layer.conv.taps()
        want = layer.conv.depthwise_conv.weight
        assert len(taps) == want.shape[1] and (sum(count_ops(t).total() for t in taps) == 0) == prepared
        for j, tap in enumerate(taps):
            assert mx.array_equal(tap, want[:, j, 0]).item()

    check(prepared=False)
    model.encoder.prepare()
    check(prepared=True)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    check(prepared=False)
    model.encoder.prepare()
    check(prepared=True)


@pytest.mark.parametrize("length", [1, 9, 75])
def test_block_output_shapes(length):
    cfg = tiny_config().audio_config.encoder
    block = ConformerBlock(cfg)
    x = mx.random.normal((1, length, cfg.d_model), key=mx.random.key(length))
    y = block(x, relative_positions(length, cfg.d_model))
    assert y.shape == x.shape and y.dtype == mx.float32
    assert bool(mx.isfinite(y).all())


# --------------------------------------------------------------------------- the loaded perception

def test_encoder_output_for_speech_is_finite_and_shaped(perception, speech):
    mel = perception.log_mel(mx.array(speech))
    projected, lengths, encoded = perception(mel)
    frames = subsampled_length(mel.shape[1])
    assert projected.shape == (1, frames, 192) and encoded.shape == (1, frames, 80)
    assert projected.dtype == mx.float32 and encoded.dtype == mx.float32
    assert lengths.tolist() == [frames]
    assert bool(mx.isfinite(projected).all()) and bool(mx.isfinite(encoded).all())
    assert float(mx.abs(encoded).max()) > 0.1


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("which", ["perception", "perception_bf16"])
def test_encoder_is_causal(request, which, speech, reference, monkeypatch):
    perception = request.getfixturevalue(which)
    if reference:
        monkeypatch.setenv("VOICECHAT_REFERENCE", "1")
    audio = speech[: 16000]
    base = perception(perception.log_mel(mx.array(audio)))[2]
    rng = np.random.default_rng(0)
    for i in (0, 3, 11):
        # Encoder frame i sees mel frames <= 8 i, which see samples <= 1280 i + 255.
        changed = audio.copy()
        start = 1280 * i + 256
        changed[start:] += rng.standard_normal(len(audio) - start).astype(np.float32) * 0.05
        other = perception(perception.log_mel(mx.array(changed)))[2]
        np.testing.assert_array_equal(np.array(other[:, : i + 1]), np.array(base[:, : i + 1]))
        assert not np.array_equal(np.array(other[:, i + 1]), np.array(base[:, i + 1]))


def test_fast_path_equals_reference_path(perception, speech, monkeypatch):
    mel = perception.log_mel(mx.array(speech))
    fast = perception(mel)
    monkeypatch.setenv("VOICECHAT_REFERENCE", "1")
    ref = perception(mel)
    for a, b in zip(fast, ref):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def test_bfloat16_weights_give_float32_activations(tiny_checkpoint_q4, speech):
    model = _perception(tiny_checkpoint_q4)  # its own copy: the test casts the weights
    assert model.encoder.layers[0].self_attn.linear_q.weight.dtype == mx.bfloat16
    projected, lengths, encoded = model(model.log_mel(mx.array(speech)))
    assert projected.dtype == mx.float32 and encoded.dtype == mx.float32
    assert bool(mx.isfinite(projected).all()) and bool(mx.isfinite(encoded).all())
    # Same as running the float32-cast weights: activations never drop to bfloat16.
    model.update(tree_map(lambda w: w.astype(mx.float32), model.parameters()))
    _, _, encoded32 = model(model.log_mel(mx.array(speech)))
    np.testing.assert_allclose(np.array(encoded), np.array(encoded32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["torch", "mlx"])
def test_loads_both_layouts(tmp_path, layout):
    path = make_checkpoint(tmp_path / layout, "tiny", layout=layout)
    ckpt = open_checkpoint(path)
    model = Perception(ckpt.config.audio_config)
    ckpt.load_into(model, "stt_model.perception.")
    conv0 = model.encoder.pre_encode.conv[0].weight
    assert conv0.shape == (24, 3, 3, 1)
    assert model.encoder.layers[0].conv.depthwise_conv.weight.shape == (80, 9, 1)
    stored = ckpt.tensors["stt_model.perception.encoder.pre_encode.conv.0.weight"]
    expected = stored.transpose(0, 2, 3, 1) if layout == "torch" else stored
    np.testing.assert_array_equal(np.array(conv0), np.array(expected))
    projected, _, _ = model(mx.zeros((1, 40, 128)))
    assert projected.shape == (1, 6, 192)


def test_layouts_give_the_same_encoder_output(tmp_path):
    """The same random weights written in both layouts load to the same numbers."""
    outs = []
    for layout in ("torch", "mlx"):
        ckpt = open_checkpoint(make_checkpoint(tmp_path / layout, "tiny", layout=layout, seed=5))
        model = Perception(ckpt.config.audio_config)
        ckpt.load_into(model, "stt_model.perception.")
        mel = mx.random.normal((1, 64, 128), key=mx.random.key(0))
        outs.append(np.array(model(mel)[0]))
    np.testing.assert_array_equal(outs[0], outs[1])
