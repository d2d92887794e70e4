"""The audio codec (network 4): STFT / iSTFT, PRVQ, encoder / decoder lengths, causality, loading."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from voicechat.checkpoint import load_weights, open_checkpoint, subtree, to_mlx_layout
from voicechat.codec import AudioCodec, istft, stft
from voicechat.codec.codec import (_downsample, _upsample, conv_matrix, decode_context, decode_windows,
                                   transposed_conv_matrix)
from voicechat.codec.stft import StreamingISTFT, istft_reference, stft_reference, windowed_frames_in_order
from voicechat.config import CodecConfig, VoiceChatConfig
from voicechat.synthetic import make_checkpoint, tiny_config

PREFIX = "tts_model.audio_codec."
INVENTORY = Path(__file__).parent / "data" / "published-checkpoint-keys.tsv"


@pytest.fixture(scope="module")
def codec(tiny_checkpoint) -> AudioCodec:
    ckpt = open_checkpoint(tiny_checkpoint)
    model = AudioCodec(ckpt.config.codec_config)
    ckpt.load_into(model, PREFIX)
    return model


# Windows and the whole decode run other conv shapes: bit-equal on the CPU, CUDA's kernels round
# differently (up to ~7e-5 on a GPU). Missing context changes samples by > 1e-3.
WINDOW_ATOL = 1e-5 if mx.default_device() == mx.cpu else 2e-4


def _random_codes(cfg: CodecConfig, batch: int, frames: int, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, cfg.codebook_size, (batch, cfg.num_quantizers, frames)).astype(np.int32))


# --------------------------------------------------------------------------- sizes

def test_waveform_to_token_ratio_is_1764_and_stft_channels_18():
    for cfg in (CodecConfig(), tiny_config().codec_config):
        assert cfg.samples_per_frame == cfg.waveform_to_token_ratio == 1764
        assert cfg.stft_channels == 18
    assert stft(mx.zeros((1, 1764))).shape == (1, 441, 18)


# --------------------------------------------------------------------------- STFT

def _numpy_stft(wave: np.ndarray) -> np.ndarray:
    """The formula with numpy: 6 zeros each side, periodic Hann(16), frames every 4, rfft."""
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(16) / 16)
    padded = np.pad(wave.astype(np.float64), ((0, 0), (6, 6)))
    frames = (padded.shape[1] - 16) // 4 + 1
    framed = np.stack([padded[:, 4 * f : 4 * f + 16] for f in range(frames)], axis=1)
    spec = np.fft.rfft(framed * window, axis=-1)
    return np.concatenate([spec.real, spec.imag], axis=-1)


def _numpy_windowed_frames(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """irfft of each frame, clipped to +-window, times the window (float64), and the window."""
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(16) / 16)
    f = features.astype(np.float64)
    spec = f[..., :9] + 1j * f[..., 9:]
    spec[..., 0] = spec[..., 0].real  # imag of DC and Nyquist forced to zero
    spec[..., 8] = spec[..., 8].real
    framed = np.fft.irfft(spec, n=16, axis=-1)
    return np.clip(framed, -window, window) * window, window


def _numpy_istft(features: np.ndarray) -> np.ndarray:
    """The formula with numpy: irfft, clip to +-window, window, overlap-add, / max(env, 1e-10), trim 6."""
    framed, window = _numpy_windowed_frames(features)
    f = features
    frames = f.shape[1]
    out = np.zeros((f.shape[0], (frames - 1) * 4 + 16))
    env = np.zeros(out.shape[1])
    for t in range(frames):
        out[:, 4 * t : 4 * t + 16] += framed[:, t]
        env[4 * t : 4 * t + 16] += window**2
    return (out / np.maximum(env, 1e-10))[:, 6:-6]


@pytest.mark.parametrize("n", [4, 64, 1764, 1764 * 2 + 8])
def test_stft_matches_the_formula(n):
    wave = np.random.default_rng(n).uniform(-1, 1, (2, n)).astype(np.float32)
    expected = _numpy_stft(wave)
    assert expected.shape == (2, n // 4, 18)
    for fn in (stft, stft_reference):
        np.testing.assert_allclose(np.array(fn(mx.array(wave))), expected, atol=2e-6)


@pytest.mark.parametrize("frames", [1, 5, 441])
def test_istft_matches_the_formula_with_clipping(frames):
    # Features of magnitude ~3 make most frame samples exceed the window: the clip is exercised.
    features = np.random.default_rng(frames).normal(0, 3, (2, frames, 18)).astype(np.float32)
    expected = _numpy_istft(features)
    assert expected.shape == (2, 4 * frames)
    for fn in (istft, istft_reference):
        np.testing.assert_allclose(np.array(fn(mx.array(features))), expected, atol=2e-6)


def test_the_streams_inverse_dft_in_order_matches_the_formula():
    """The streamed decoder's inverse DFT (a multiply-add a basis row, elementwise, so that a batch
    of sessions gives each its bits alone) is the formula, clip included."""
    features = np.random.default_rng(11).normal(0, 3, (3, 7, 18)).astype(np.float32)
    window, inverse = StreamingISTFT(16, 4).bases()
    got = np.array(windowed_frames_in_order(mx.array(features), window, inverse))
    np.testing.assert_allclose(got, _numpy_windowed_frames(features)[0], atol=2e-6)
    # each frame alone is its rows of the batch, bit for bit
    np.testing.assert_array_equal(np.array(windowed_frames_in_order(mx.array(features[1:2, 3:4]), window, inverse)),
                                  got[1:2, 3:4])


@pytest.mark.parametrize("n", [1764, 1764 * 3, 1000])
def test_stft_then_istft_reconstructs_the_signal(n):
    # |x| <= 1 keeps every windowed frame inside +-window, so the clip does nothing.
    wave = mx.array(np.random.default_rng(1).uniform(-1, 1, (3, n)).astype(np.float32))
    out = istft(stft(wave))
    assert out.shape == (3, n)
    np.testing.assert_allclose(np.array(out), np.array(wave), atol=1e-5)


# --------------------------------------------------------------------------- PRVQ with a true answer

def _layered_codebooks(q: int, k: int, d: int, seed: int = 0) -> np.ndarray:
    """Integer codebooks where greedy residual search must recover the chosen entries exactly.

    Codebook j puts 64 * (entry - k/2) on dimension j and a small -1/0/1 pattern on the 9
    dimensions below it, so codebooks overlap; every sum is an exact float32 integer. The
    margin: a wrong entry costs >= 64^2 in squared distance, later codebooks' patterns can shift
    it by at most 2 (9 * 64 + 9 * 9 * 2) < 64^2; skipping a subtraction breaks it.
    """
    assert d >= q
    rng = np.random.default_rng(seed)
    books = np.zeros((q, k, d), dtype=np.float32)
    for j in range(q):
        books[j, :, j] = 64 * (np.arange(k) - k // 2)
        low = max(0, j - 9)
        books[j, :, low:j] = rng.integers(-1, 2, (k, j - low))
    return books


def test_prvq_recovers_the_codes_of_an_exact_sum_and_decodes_exactly(codec):
    cfg = codec.config
    books = _layered_codebooks(cfg.num_quantizers, cfg.codebook_size, cfg.latent_dim)
    model = AudioCodec(cfg)
    model.update(codec.parameters())
    model.update({"prvq": {"mus_list": [mx.array(b) for b in books]}})
    chosen = np.array(_random_codes(cfg, 2, 3, seed=5))  # [B, Q, T]
    latent = books[np.arange(cfg.num_quantizers)[None, :, None], chosen].sum(axis=1)  # exact integers

    codes = model.prvq.encode(mx.array(latent))
    assert codes.dtype == mx.int32 and codes.shape == chosen.shape
    np.testing.assert_array_equal(np.array(codes), chosen)
    np.testing.assert_array_equal(np.array(model.prvq.decode(codes)), latent)
    np.testing.assert_array_equal(np.array(model.prvq.decode_reference(codes)), latent)
    # The codes decode to exactly the waveform of the latent they came from.
    np.testing.assert_array_equal(np.array(model.decode(codes)), np.array(model.decode_latent(mx.array(latent))))


def test_codewords_add_in_codebook_order(codec):
    """`codewords_sum` adds the picked codewords q = 0, 1, ... as the reference does (so a row's
    latent is the same arithmetic in a batch of any size): equal bit for bit on means whose sums
    round, and to a float64 sum."""
    cfg = codec.config
    rng = np.random.default_rng(4)
    books = [rng.normal(0, 1, (cfg.codebook_size, cfg.latent_dim)).astype(np.float32) for _ in range(cfg.num_quantizers)]
    model = AudioCodec(cfg)
    model.update({"prvq": {"mus_list": [mx.array(b) for b in books]}})
    codes = _random_codes(cfg, 3, 4, seed=8)
    got = np.array(model.prvq.decode(codes))
    np.testing.assert_array_equal(got, np.array(model.prvq.decode_reference(codes)))
    chosen = np.array(codes)
    exact = sum(books[q].astype(np.float64)[chosen[:, q]] for q in range(cfg.num_quantizers))
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.array(model.prvq.decode(codes[1:2, :, 2:3])), got[1:2, 2:3])


def test_prvq_uses_only_the_given_leading_codebooks(codec):
    codes = _random_codes(codec.config, 1, 2)
    book, _ = codec.prvq.codebooks()
    expected = sum(np.array(book[q])[np.array(codes[0, q])] for q in range(4))
    np.testing.assert_allclose(np.array(codec.prvq.decode(codes[:, :4]))[0], expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="codebooks"):
        codec.prvq.decode(mx.zeros((1, codec.config.num_quantizers + 1, 2), dtype=mx.int32))


# --------------------------------------------------------------------------- lengths

@pytest.mark.parametrize("frames", [1, 3])
def test_encode_gives_one_code_frame_per_1764_samples(codec, frames):
    wave = mx.array(np.random.default_rng(frames).uniform(-0.5, 0.5, (2, frames * 1764)).astype(np.float32))
    codes = codec.encode(wave)
    assert codes.shape == (2, 31, frames) and codes.dtype == mx.int32
    assert 0 <= int(codes.min()) and int(codes.max()) < codec.config.codebook_size


@pytest.mark.parametrize("frames", [1, 4])
def test_decode_gives_1764_samples_per_code_frame(codec, frames):
    wave = codec.decode(_random_codes(codec.config, 2, frames))
    assert wave.shape == (2, frames * 1764) and wave.dtype == mx.float32
    assert bool(mx.isfinite(wave).all())


@pytest.mark.parametrize("shape", [(1764,), (1, 1763), (1, 1764 + 4), (1, 0)])
def test_encode_refuses_a_length_that_is_not_whole_frames(codec, shape):
    with pytest.raises(ValueError, match="multiple of 1764"):
        codec.encode(mx.zeros(shape))


# --------------------------------------------------------------------------- causality

def test_istft_frame_reaches_back_exactly_five_samples():
    # Frame f covers trimmed samples 4 f - 6 .. 4 f + 9 and the window is 0 at its first tap, so
    # the first sample that frame f changes is 4 f - 5. Small features: nothing is clipped.
    features = np.random.default_rng(0).normal(0, 0.01, (1, 12, 18)).astype(np.float32)
    changed = features.copy()
    changed[:, 8] += 0.01
    a, b = np.array(istft(mx.array(features))), np.array(istft(mx.array(changed)))
    np.testing.assert_array_equal(a[:, : 4 * 8 - 5], b[:, : 4 * 8 - 5])
    assert a[0, 4 * 8 - 5] != b[0, 4 * 8 - 5]


@pytest.mark.parametrize("t", [0, 2])
def test_decoder_is_causal_with_a_five_sample_horizon(codec, t):
    # Code frame t + 1 drives decoder STFT frames from 441 (t + 1) on, so it may change only the
    # samples from 1764 (t + 1) - 5 on (see codec.py).
    codes = _random_codes(codec.config, 1, 4, seed=t)
    changed = np.array(codes)
    changed[:, :, t + 1] = (changed[:, :, t + 1] + 7) % codec.config.codebook_size
    changed = mx.array(changed)

    a, b = codec.decoder(codec.prvq.decode(codes)), codec.decoder(codec.prvq.decode(changed))
    boundary = 441 * (t + 1)
    np.testing.assert_array_equal(np.array(a[:, :boundary]), np.array(b[:, :boundary]))
    assert not np.array_equal(np.array(a[:, boundary]), np.array(b[:, boundary]))

    wa, wb = np.array(codec.decode(codes)), np.array(codec.decode(changed))
    horizon = 1764 * (t + 1) - 5
    np.testing.assert_array_equal(wa[:, :horizon], wb[:, :horizon])
    assert not np.array_equal(wa[:, horizon : horizon + 1764], wb[:, horizon : horizon + 1764])


def test_encoder_latent_t_sees_six_samples_past_its_frame(codec):
    # STFT frame f covers samples 4 f - 6 .. 4 f + 9, so latent t reads up to 1764 (t + 1) + 5.
    wave = np.random.default_rng(3).uniform(-0.5, 0.5, (1, 3 * 1764)).astype(np.float32)
    base = np.array(codec.encode_latent(mx.array(wave)))
    later = wave.copy()
    later[:, 1764 + 6 :] = 0.0
    np.testing.assert_array_equal(np.array(codec.encode_latent(mx.array(later)))[:, :1], base[:, :1])
    edge = wave.copy()
    edge[:, 1764 + 5] += 0.5
    assert not np.array_equal(np.array(codec.encode_latent(mx.array(edge)))[:, 0], base[:, 0])


# --------------------------------------------------------------------------- windowed decode

def _decode_in_windows(codec, codes, chunk, history, ahead) -> np.ndarray:
    latent, spf = codec.prvq.decode(codes), codec.samples_per_frame
    pieces = [codec.decode_latent(latent[:, lo:hi])[:, (s - lo) * spf : (e - lo) * spf]
              for lo, hi, s, e in decode_windows(latent.shape[1], chunk, history, ahead)]
    return np.array(mx.concatenate(pieces, axis=1))


def test_decode_context_of_the_published_codec_is_three_frames_back_one_ahead():
    assert decode_context(CodecConfig()) == (3, 1)


@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_decode_windows_tile_the_input_with_one_window_length(chunk):
    history, ahead = 3, 1
    for frames in range(1, 80):
        windows = decode_windows(frames, chunk, history, ahead)
        kept = [f for _, _, s, e in windows for f in range(s, e)]
        assert kept == list(range(frames))
        assert len({hi - lo for lo, hi, _, _ in windows}) == 1
        for lo, hi, s, e in windows:
            assert 0 <= lo <= s and e <= hi <= frames
            assert lo == 0 or s - lo >= history
            assert hi == frames or hi - e >= ahead


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_windowed_decode_equals_the_whole_decode(codec, chunk):
    codes = _random_codes(codec.config, 2, 45, seed=chunk)
    whole = np.array(codec.decode(codes, chunk_frames=None))
    np.testing.assert_allclose(np.array(codec.decode(codes, chunk_frames=chunk)), whole, rtol=0, atol=WINDOW_ATOL)


def test_one_frame_less_of_context_changes_the_samples(codec):
    # The context decode_context derives is the least that is exact: a window with one frame less
    # of history (or no look-ahead) gives other samples.
    codes = _random_codes(codec.config, 1, 30, seed=9)
    whole = np.array(codec.decode(codes, chunk_frames=None))
    history, ahead = decode_context(codec.config)
    np.testing.assert_allclose(_decode_in_windows(codec, codes, 4, history, ahead), whole, rtol=0, atol=WINDOW_ATOL)
    assert np.abs(_decode_in_windows(codec, codes, 4, history - 1, ahead) - whole).max() > 1e-3
    assert np.abs(_decode_in_windows(codec, codes, 4, history, ahead - 1) - whole).max() > 1e-3


def _fresh_peak():
    """Starts a peak measurement on an empty buffer cache: a cached buffer handed out again may be
    up to twice the size asked for (MLX's allocators), so earlier tests' leftovers would count
    (inside the suite they nearly double the 320-frame decode's peak)."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()


# How much more than 4 windows' peak 20 may take beyond their output. On CUDA a window's buffers are
# freed by a completion callback on the driver's thread, which can trail the wait while the next
# windows are dispatched, so under load 20 windows can read up to ~1.8x the peak of 4. Every window
# held would be 20 windows' activations against 4's.
PEAK_GROWTH = 1.5 if mx.default_device() == mx.cpu else 2.5


def test_windowed_decode_peak_does_not_grow_with_the_answer(codec):
    # Windows are waited for as they go: 20 windows hold no more than 4 do, beyond the output
    # itself (the pieces and their concatenation). On CUDA, dispatching every window without
    # waiting held them all (buffers live until their kernels complete).
    peaks, outputs = {}, {}
    for frames in (64, 320):
        codes = _random_codes(codec.config, 1, frames, seed=frames)
        mx.eval(codes, codec.prvq.codebooks())
        _fresh_peak()
        base = mx.get_active_memory()
        wave = codec.decode(codes, chunk_frames=16)
        mx.eval(wave)
        peaks[frames], outputs[frames] = mx.get_peak_memory() - base, wave.nbytes
    assert peaks[320] - 2 * outputs[320] < PEAK_GROWTH * peaks[64], (peaks, outputs)


def test_windowed_decode_holds_a_window_of_activations_not_the_whole_answer(codec):
    codes = _random_codes(codec.config, 1, 240, seed=4)
    mx.eval(codes, codec.prvq.codebooks())
    peaks = {}
    for chunk in (None, 16):
        _fresh_peak()
        base = mx.get_active_memory()
        mx.eval(codec.decode(codes, chunk_frames=chunk))
        peaks[chunk] = mx.get_peak_memory() - base
    assert peaks[16] < peaks[None] / 4, peaks


def test_decode_refuses_a_chunk_of_no_frames(codec):
    with pytest.raises(ValueError, match="chunk_frames"):
        codec.decode(_random_codes(codec.config, 1, 2), chunk_frames=0)


# --------------------------------------------------------------------------- fast path = reference

def test_held_decoder_operands_are_views_read_by_the_stream_and_dropped_when_stale(tiny_checkpoint):
    """`AudioDecoder.hold_operands` keeps every layer's operands (taps, transposed matrices) as
    evaluated views of float32 weights: `operands()` then builds nothing in the caller's graph, a
    streamed decode reading them gives the very samples it gives without them, and once the
    weights are replaced (a dtype change) the stale views are not used; bfloat16 weights are
    never held (their float32 form would be a copy)."""
    from mlx.utils import tree_flatten

    from voicechat.codec.codec import DecoderStream
    from voicechat.llm.opcount import count_ops

    ckpt = open_checkpoint(tiny_checkpoint)
    model = AudioCodec(ckpt.config.codec_config)
    ckpt.load_into(model, PREFIX)
    decoder = model.decoder
    decoder.set_dtype(mx.float32)
    mx.eval(decoder.parameters())
    built = lambda: sum(count_ops(a).total() for _, a in tree_flatten(decoder.operands()))  # noqa: E731
    codes = mx.array(np.random.default_rng(4).integers(0, 52, (1, 31, 3)).astype(np.int32))

    def streamed():
        stream = DecoderStream(model)
        return np.concatenate([stream.push(codes[:, :, i : i + 1]) for i in range(3)] + [stream.finish()], axis=1)

    assert built() > 0
    plain = streamed()
    decoder.hold_operands()
    assert built() == 0
    np.testing.assert_array_equal(streamed(), plain)
    decoder.set_dtype(mx.bfloat16)
    mx.eval(decoder.parameters())
    assert built() > 0  # (stale: made again from the bfloat16 weights, with their casts)
    decoder.hold_operands()
    assert built() > 0
    assert {a.dtype for _, a in tree_flatten(decoder.operands())} == {mx.float32}


def test_matmul_convolutions_equal_the_mlx_layers(codec):
    rng = np.random.default_rng(0)
    enc, dec = codec.encoder.layers, codec.decoder.layers
    x = mx.array(rng.normal(size=(2, 63, enc[4].weight.shape[2])).astype(np.float32))
    np.testing.assert_allclose(np.array(_downsample(x, conv_matrix(enc[4].weight), enc[4].weight.shape[1])),
                               np.array(enc[4](x)), rtol=1e-5, atol=1e-5)
    z = mx.array(rng.normal(size=(2, 3, dec[0].weight.shape[2])).astype(np.float32))
    np.testing.assert_allclose(np.array(_upsample(z, transposed_conv_matrix(dec[0].weight), dec[0].weight.shape[1])),
                               np.array(dec[0](z)), rtol=1e-5, atol=1e-5)
    block = dec[1]
    h = mx.array(rng.normal(size=(2, 27, block.dwconv.weight.shape[0])).astype(np.float32))
    np.testing.assert_allclose(np.array(block(h)), np.array(block.reference(h)), rtol=1e-5, atol=1e-5)


def test_encode_and_decode_equal_their_references(codec):
    wave = mx.array(np.random.default_rng(7).uniform(-0.5, 0.5, (2, 2 * 1764)).astype(np.float32))
    latent, ref = codec.encode_latent(wave), codec.encode_latent_reference(wave)
    np.testing.assert_allclose(np.array(latent), np.array(ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.array(codec.encode(wave)), np.array(codec.encode_reference(wave)))
    codes = _random_codes(codec.config, 2, 2)
    np.testing.assert_allclose(np.array(codec.decode(codes)), np.array(codec.decode_reference(codes)), atol=1e-4)


# --------------------------------------------------------------------------- loading

def _loaded(path: Path) -> dict[str, np.ndarray]:
    ckpt = open_checkpoint(path)
    model = AudioCodec(ckpt.config.codec_config)
    ckpt.load_into(model, PREFIX)
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}, model


def test_torch_and_mlx_layouts_load_to_the_same_weights(tmp_path):
    torch_w, _ = _loaded(make_checkpoint(tmp_path / "torch", "tiny", layout="torch", seed=3))
    mlx_w, model = _loaded(make_checkpoint(tmp_path / "mlx", "tiny", layout="mlx", seed=3))
    assert torch_w.keys() == mlx_w.keys()
    assert len([k for k in torch_w if k.startswith("encoder.layers.")]) > 0
    for key in torch_w:
        np.testing.assert_array_equal(torch_w[key], mlx_w[key], err_msg=key)
    # Converting tensors that are already in the MLX layout changes nothing.
    tensors = {k: mx.array(v) for k, v in mlx_w.items()}
    again = to_mlx_layout(tensors, model)
    for key in tensors:
        np.testing.assert_array_equal(np.array(again[key]), mlx_w[key], err_msg=key)
    # The decoder's stage-start transposed convolutions really were converted from [in, out, k].
    raw = subtree(open_checkpoint(tmp_path / "torch").tensors, PREFIX)
    np.testing.assert_array_equal(np.array(raw["decoder.layers.0.weight"]).transpose(1, 2, 0),
                                  mlx_w["decoder.layers.0.weight"])


def test_keeps_bfloat16_weights_and_computes_as_their_float32_values(tmp_path):
    # The codec holds the checkpoint's bf16 weights (no float32 copy) and gives exactly the samples
    # of the same values stored as float32: each weight is cast where it is used.
    path = make_checkpoint(tmp_path / "bf16", "tiny", dtype="bfloat16")
    weights, model = _loaded(path)
    assert {str(v.dtype) for k, v in tree_flatten(model.parameters()) if not k.startswith("prvq.")} == {"mlx.core.bfloat16"}
    as_f32 = AudioCodec(model.config)
    as_f32.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    codes = _random_codes(model.config, 1, 20)
    wave = np.array(model.decode(codes))
    assert wave.shape == (1, 20 * 1764) and np.isfinite(wave).all()
    np.testing.assert_array_equal(wave, np.array(as_f32.decode(codes)))
    np.testing.assert_array_equal(np.array(model.decode_reference(codes)), np.array(as_f32.decode_reference(codes)))
    silence = mx.zeros((1, 3 * 1764))
    np.testing.assert_array_equal(np.array(model.encode(silence)), np.array(as_f32.encode(silence)))
    np.testing.assert_array_equal(np.array(model.encode_reference(silence)), np.array(as_f32.encode_reference(silence)))


def test_full_size_module_matches_the_published_inventory():
    # Every codec tensor of the published (torch-layout) checkpoint, at full size, fits the module.
    shapes = {}
    for line in INVENTORY.read_text().splitlines():
        if line.startswith("#"):
            continue
        name, shape, _ = line.split("\t")
        if name.startswith(PREFIX):
            shapes[name[len(PREFIX):]] = tuple(int(s) for s in shape.strip("()").split(",") if s.strip())
    assert sum(k.startswith("encoder.layers.") and k.endswith("weight") and k.count(".") == 3 for k in shapes) == 4
    model = AudioCodec(VoiceChatConfig().codec_config)
    fake = {k: mx.zeros(s, dtype=mx.bfloat16) for k, s in shapes.items()}  # lazy, never evaluated
    load_weights(model, fake, PREFIX)  # strict: raises on any missing / extra / misshapen tensor
    assert model.decoder.layers[0].weight.shape == (1536, 9, 512)
    assert len(model.encoder.layers) == len(model.decoder.layers) == 13
