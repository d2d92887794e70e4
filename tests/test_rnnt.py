"""RNNT transcript branch: the C++ greedy loop, the modules, loading, piece decoding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.audio import load_audio
from voicechat.checkpoint import open_checkpoint
from voicechat.kernels.rnnt_greedy import (GreedyState, emitted_tokens, initial_state, rnnt_greedy,
                                          rnnt_greedy_reference, rnnt_greedy_streams)
from voicechat.stt.conformer import Perception
from voicechat.stt.rnnt import (RNNTDecoder, RNNTJoint, TranscriptStream, greedy_decode, greedy_decode_reference,
                                greedy_table, loop_weights, push_streams)
from voicechat.synthetic import make_checkpoint
from voicechat.tokenizer import decode_pieces

VOCAB = 40  # tiny: blank = 40


def _weights(frames, hidden, joint, vocab, dtype, seed, blank_bias=0.0, layers=2):
    rng = np.random.default_rng(seed)

    def w(*shape, std=1.0):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * np.float32(std)).astype(dtype)

    enc_proj = mx.array(rng.standard_normal((frames, joint)).astype(np.float32))
    lstm = [(w(4 * hidden, hidden, std=hidden**-0.5), w(4 * hidden, hidden, std=hidden**-0.5),
             w(4 * hidden, std=0.1)) for _ in range(layers)]
    out_b = np.zeros(vocab + 1, dtype=np.float32)
    out_b[vocab] = blank_bias
    return (enc_proj, w(vocab + 1, hidden), lstm, w(joint, hidden, std=hidden**-0.5), w(joint, std=0.1),
            w(vocab + 1, joint, std=joint**-0.5), mx.array(out_b).astype(dtype))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("frames", [1, 6, 90])
@pytest.mark.parametrize("blank_bias", [-4.0, 1.0, 2.0])
def test_kernel_equals_reference(dtype, frames, blank_bias):
    args = _weights(frames, 48, 56, VOCAB, dtype, seed=frames, blank_bias=blank_bias)
    out = rnnt_greedy(*args, VOCAB, 10)
    ref = rnnt_greedy_reference(*args, VOCAB, 10)
    assert out.shape == (frames, 10) and out.dtype == mx.int32
    np.testing.assert_array_equal(np.array(out), np.array(ref))


def test_kernel_mixes_blanks_and_emissions():
    """The equality above is worth something: this case has blank frames, single and multiple emissions."""
    out = np.array(rnnt_greedy(*_weights(90, 48, 56, VOCAB, mx.float32, seed=90, blank_bias=1.5), VOCAB, 10))
    per_frame = (out >= 0).sum(axis=1)
    assert (per_frame == 0).any() and (per_frame == 1).any() and (per_frame > 1).any()
    # Emissions fill each row from the left.
    assert all((row[: n] >= 0).all() and (row[n:] == -1).all() for row, n in zip(out, per_frame))


def test_a_stream_of_its_own_gives_the_same_table_beside_other_work():
    args = _weights(90, 48, 56, VOCAB, mx.float32, seed=90, blank_bias=1.5)
    expected = np.array(rnnt_greedy(*args, VOCAB, 10))
    table = rnnt_greedy(*args, VOCAB, 10, stream=mx.new_stream(mx.cpu))
    mx.async_eval(table)
    busy = mx.random.normal((256, 256))
    for _ in range(20):  # other work on the default stream meanwhile
        busy = mx.tanh(busy @ busy.T / 256)
    mx.eval(busy)
    np.testing.assert_array_equal(np.array(table), expected)
    if mx.is_available(mx.gpu):
        with pytest.raises(ValueError, match="CPU stream"):
            rnnt_greedy(*args, VOCAB, 10, stream=mx.new_stream(mx.gpu))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("threads", [2, 3, 5, 200])
def test_every_thread_count_gives_the_same_table(dtype, threads):
    """The workers split hidden units, joint units and classes (unevenly here: 48, 56 and 41 rows;
    200 is clamped to the 48 hidden units); each dot product stays whole in one thread, so the
    tables are identical, and equal the reference's."""
    args = _weights(90, 48, 56, VOCAB, dtype, seed=7, blank_bias=1.5)
    one = np.array(rnnt_greedy(*args, VOCAB, 10, threads=1))
    assert (one >= 0).sum() > 30  # many emissions: many LSTM steps across the workers
    np.testing.assert_array_equal(np.array(rnnt_greedy(*args, VOCAB, 10, threads=threads)), one)
    np.testing.assert_array_equal(np.array(rnnt_greedy_reference(*args, VOCAB, 10)), one)


@pytest.mark.parametrize("nan_at", [0, 13, 14, 27])
def test_nan_logits_pick_as_one_scan_would_with_any_thread_count(nan_at):
    """`tok = 0; for k: if l[k] > l[tok]: tok = k`: a NaN at index 0 is chosen, elsewhere never.
    With 3 workers the 41 classes split at 13 and 27: a NaN first in a slice, and one inside."""
    args = list(_weights(20, 48, 56, VOCAB, mx.float32, seed=8, blank_bias=1.0))
    out_b = np.array(args[6])
    out_b[nan_at] = np.nan
    args[6] = mx.array(out_b)
    tables = [np.array(rnnt_greedy(*args, VOCAB, 4, threads=n)) for n in (1, 2, 3)]
    for table in tables[1:]:
        np.testing.assert_array_equal(table, tables[0])
    if nan_at == 0:
        assert (tables[0] == 0).all()  # the NaN wins every query, never blank: max_symbols each frame
    else:
        assert nan_at not in tables[0] and (tables[0] >= 0).sum() > 0


def test_one_layer_and_full_width_float16():
    args = _weights(7, 64, 40, 24, mx.float16, seed=1, blank_bias=1.5, layers=1)
    np.testing.assert_array_equal(np.array(rnnt_greedy(*args, 24, 4)), np.array(rnnt_greedy_reference(*args, 24, 4)))


@pytest.mark.parametrize("greedy", [rnnt_greedy, rnnt_greedy_reference])
def test_blank_only_frames_emit_nothing(greedy):
    args = _weights(12, 48, 56, VOCAB, mx.float32, seed=2, blank_bias=100.0)
    assert emitted_tokens(greedy(*args, VOCAB, 10)) == []


@pytest.mark.parametrize("greedy", [rnnt_greedy, rnnt_greedy_reference])
@pytest.mark.parametrize("max_symbols", [1, 3, 10])
def test_max_symbols_bounds_each_frame(greedy, max_symbols):
    args = _weights(9, 48, 56, VOCAB, mx.float32, seed=3, blank_bias=-100.0)
    out = np.array(greedy(*args, VOCAB, max_symbols))
    assert out.shape == (9, max_symbols)
    assert (out >= 0).all() and (out < VOCAB).all()  # every frame stops at the bound, never at blank


def test_blank_row_of_the_embedding_is_never_read():
    args = list(_weights(20, 48, 56, VOCAB, mx.float32, seed=4, blank_bias=1.0))
    base = np.array(rnnt_greedy(*args, VOCAB, 10))
    embed = np.array(args[1])
    embed[VOCAB] = 1e4
    args[1] = mx.array(embed)
    np.testing.assert_array_equal(np.array(rnnt_greedy(*args, VOCAB, 10)), base)
    np.testing.assert_array_equal(np.array(rnnt_greedy_reference(*args, VOCAB, 10)), base)


def test_bad_arguments_are_errors():
    args = list(_weights(3, 8, 6, 5, mx.float32, seed=5))
    with pytest.raises(ValueError, match="blank_id"):
        rnnt_greedy(*args, 9, 10)
    with pytest.raises(ValueError, match="max_symbols"):
        rnnt_greedy(*args, 5, 0)
    with pytest.raises(ValueError, match="threads"):
        rnnt_greedy(*args, 5, 10, threads=-1)
    args[3] = args[3][:, :4]
    with pytest.raises(ValueError, match="pred_w"):
        rnnt_greedy(*args, 5, 10)


# --------------------------------------------------------------------------- several streams at once

def _starts(args, frames_before, seeds):
    """A start for each stream: the utterance's start (0 frames before), or the state after
    decoding that many frames of its own."""
    _, *weights = args
    starts = []
    for before, seed in zip(frames_before, seeds):
        start = initial_state(len(weights[1]), weights[0].shape[1], VOCAB)
        if before:
            enc = mx.array(np.random.default_rng(seed + 100).standard_normal((before, args[0].shape[1]), np.float32))
            _, start = rnnt_greedy(enc, *weights, VOCAB, 6, start=start)
        starts.append(start)
    return starts


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("streams", [2, 7])
def test_streams_decoded_together_get_what_each_gets_alone(dtype, threads, streams):
    """Streams of different lengths (none, one frame, many), each from a start of its own, in one
    call: each gets the table, LSTM state and last token of its call alone, bit for bit. Widths
    that are not a multiple of 8 (44 hidden, 52 joint units) take the dot products' tails."""
    args = _weights(4, 44, 52, VOCAB, dtype, seed=11, blank_bias=1.0)
    _, *weights = args
    rng = np.random.default_rng(streams)
    frames = [9, 3, 0, 1, 14, 2, 6][:streams]
    encs = [mx.array(rng.standard_normal((f, 52), np.float32)) for f in frames]
    starts = _starts(args, [0, 2, 0, 5, 1, 0, 3][:streams], seeds=range(streams))
    together = rnnt_greedy_streams(encs, *weights, VOCAB, 6, starts, threads=threads)
    emitted = 0
    for enc, start, (table, state) in zip(encs, starts, together):
        alone, alone_state = rnnt_greedy(enc, *weights, VOCAB, 6, threads=1, start=start)
        np.testing.assert_array_equal(np.array(table), np.array(alone))
        np.testing.assert_array_equal(np.array(state.lstm), np.array(alone_state.lstm))
        np.testing.assert_array_equal(np.array(state.last), np.array(alone_state.last))
        reference, _ = rnnt_greedy_reference(enc, *weights, VOCAB, 6, start)
        np.testing.assert_array_equal(np.array(table), np.array(reference))
        emitted += int((np.array(table) >= 0).sum())
    assert emitted > 10  # many LSTM steps, in several streams at once
    lasts = {int(np.array(state.last)[0]) for _, state in together[1:]}
    assert len(lasts) > 1 or streams == 2  # the streams went their own ways


def test_streams_need_a_start_each():
    args = _weights(2, 8, 8, VOCAB, mx.float32, seed=12)
    enc, *weights = args
    with pytest.raises(ValueError, match="starts"):
        rnnt_greedy_streams([enc, enc], *weights, VOCAB, 4, [initial_state(2, 8, VOCAB)])


def test_transcript_streams_pushed_together_equal_each_pushed_alone(tiny_checkpoint, encoded):
    """`push_streams` (a server's round): three transcripts fed pieces of their own, together, give
    each one's tables and state fed alone."""
    ckpt, decoder, joint = _load(tiny_checkpoint)
    weights = loop_weights(decoder, joint)
    stream = mx.new_stream(mx.cpu)

    def streams():
        return [TranscriptStream(decoder, joint, VOCAB, 10, stream=stream, weights=weights) for _ in range(3)]

    together, alone = streams(), streams()
    frames = encoded.shape[1]
    pieces = [[(0, 3), (3, 4), (4, frames)], [(2, 9), (9, 9), (9, frames)], [(0, frames), (0, 0), (0, 1)]]
    for step in range(3):
        parts = [encoded[:, a:b] for a, b in (p[step] for p in pieces)]
        tables = push_streams(together, parts)
        for s, part, table in zip(alone, parts, tables):
            np.testing.assert_array_equal(np.array(table), np.array(s.push(part)))
    for a, b in zip(together, alone):
        np.testing.assert_array_equal(np.array(a.state.lstm), np.array(b.state.lstm))
        assert int(a.state.last[0]) == int(b.state.last[0])
    assert len({int(s.state.last[0]) for s in together}) > 1
    other = TranscriptStream(decoder, joint, VOCAB, 10, stream=stream, weights=loop_weights(decoder, joint))
    with pytest.raises(ValueError, match="share"):
        push_streams([together[0], other], [encoded, encoded])


# --------------------------------------------------------------------------- the loaded modules

def _load(path):
    ckpt = open_checkpoint(path)
    audio = ckpt.config.audio_config
    decoder, joint = RNNTDecoder(audio.decoder), RNNTJoint(audio.joint)
    ckpt.load_into(decoder, "stt_model.rnnt_decoder.")
    ckpt.load_into(joint, "stt_model.rnnt_joint.")
    return ckpt, decoder, joint


@pytest.fixture(scope="module")
def encoded(tiny_checkpoint, spoken_wav):
    ckpt = open_checkpoint(tiny_checkpoint)
    perception = Perception(ckpt.config.audio_config)
    ckpt.load_into(perception, "stt_model.perception.")
    return perception(perception.log_mel(mx.array(load_audio(spoken_wav, 16000))))[2]


@pytest.mark.parametrize("blank_bias", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("which", ["tiny_checkpoint", "tiny_checkpoint_q4"])
def test_greedy_decode_equals_the_spec_loop_on_real_encoder_output(request, encoded, which, blank_bias):
    ckpt, decoder, joint = _load(request.getfixturevalue(which))
    blank = ckpt.config.rnnt_blank_id
    assert blank == decoder.blank_id == VOCAB
    out = joint.joint_net[2]
    out.bias = out.bias + mx.array(np.eye(VOCAB + 1, dtype=np.float32)[blank] * blank_bias).astype(out.bias.dtype)
    ids = greedy_decode(encoded, decoder, joint, blank, ckpt.config.audio_config.max_symbols)
    assert ids == greedy_decode_reference(encoded, decoder, joint, blank, ckpt.config.audio_config.max_symbols)
    assert all(0 <= i < VOCAB for i in ids)
    assert len(ids) <= encoded.shape[1] * 10
    if blank_bias == 0.5:
        assert 0 < len(ids) < encoded.shape[1] * 10


@pytest.mark.parametrize("which", ["tiny_checkpoint", "tiny_checkpoint_q4"])
def test_host_copies_of_the_loop_weights_give_the_same_table(request, encoded, which):
    """The session's float32 copies (bf16 weights in the q4 checkpoint) change no token."""
    ckpt, decoder, joint = _load(request.getfixturevalue(which))
    blank = ckpt.config.rnnt_blank_id
    own, copies = loop_weights(decoder, joint), loop_weights(decoder, joint, host_copies=True)
    flat_own = [own.embed, *[w for layer in own.lstm for w in layer], *own[2:]]
    flat_copies = [copies.embed, *[w for layer in copies.lstm for w in layer], *copies[2:]]
    for a, b in zip(flat_own, flat_copies):
        assert b.dtype == mx.float32 and np.array_equal(np.array(a.astype(mx.float32)), np.array(b))
    table = greedy_table(encoded, decoder, joint, blank, 10)
    assert (np.array(table) >= 0).any()
    np.testing.assert_array_equal(np.array(greedy_table(encoded, decoder, joint, blank, 10, weights=copies)),
                                  np.array(table))


def test_reference_switch_routes_greedy_decode(tiny_checkpoint, encoded, monkeypatch):
    ckpt, decoder, joint = _load(tiny_checkpoint)
    fast = greedy_decode(encoded, decoder, joint, VOCAB, 10)
    monkeypatch.setenv("VOICECHAT_REFERENCE", "1")
    assert greedy_decode(encoded, decoder, joint, VOCAB, 10) == fast


@pytest.mark.parametrize("layout", ["torch", "mlx"])
def test_loads_both_layouts(tmp_path, layout):
    ckpt, decoder, joint = _load(make_checkpoint(tmp_path / layout, "tiny", layout=layout))
    lstm = decoder.prediction.dec_rnn.lstm
    assert len(lstm) == 2 and lstm[0].Wx.shape == (192, 48) and lstm[1].bias.shape == (192,)
    assert decoder.prediction.embed.weight.shape == (41, 48)
    assert joint.joint_net[2].weight.shape == (41, 56)
    if layout == "torch":  # one bias = bias_ih + bias_hh
        t = ckpt.tensors
        base = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."
        np.testing.assert_allclose(np.array(lstm[1].bias), np.array(t[base + "bias_ih_l1"] + t[base + "bias_hh_l1"]),
                                   rtol=1e-6)
    ids = greedy_decode(mx.random.normal((1, 5, 80), key=mx.random.key(0)), decoder, joint, VOCAB, 10)
    assert len(ids) <= 50


def test_lstm_step_matches_the_torch_cell_formula(tiny_checkpoint):
    _, decoder, _ = _load(tiny_checkpoint)
    state = decoder.initial_state()
    out, new_state = decoder.step(7, state)
    x = np.array(decoder.prediction.embed.weight[7:8])
    for layer, (h, c) in zip(decoder.prediction.dec_rnn.lstm, new_state):
        g = x @ np.array(layer.Wx).T + np.array(layer.bias)  # h0 = 0
        i, f, gg, o = np.split(g, 4, axis=-1)
        sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        c_ref = sig(i) * np.tanh(gg)
        h_ref = sig(o) * np.tanh(c_ref)
        np.testing.assert_allclose(np.array(c), c_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(h), h_ref, rtol=1e-5, atol=1e-6)
        x = h_ref
    np.testing.assert_allclose(np.array(out), x, rtol=1e-5, atol=1e-6)


def test_piece_decoding():
    pieces = ["<unk>", "<pad>", "<s>", "</s>", "<en-US>", "▁what", "▁is", "▁the", "▁cap", "ital", "?", "<fra-Latn>"]
    assert decode_pieces([4, 5, 6, 7, 8, 9, 10, 11, 0, 3], pieces) == "what is the capital?"
    assert decode_pieces([2, 1], pieces) == ""
    # Only exact specials and tag-shaped pieces are dropped.
    assert decode_pieces([0, 1, 2], ["<x>", "▁<y>", "<en-us-x>"]) == "<x> <y><en-us-x>"
