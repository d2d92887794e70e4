"""Each streaming piece of a live session equals its whole-signal version: log-mel, the cache-aware
perception, the resumable RNNT greedy loop, the codec's streaming decoder and iSTFT, text deltas."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from voicechat.audio import load_audio
from voicechat.codec.codec import DecoderStream
from voicechat.codec.codec import push_streams as codec_push_streams
from voicechat.codec.stft import StreamingISTFT, _envelope, envelope_at, istft
from voicechat.config import PreprocessorConfig
from voicechat.kernels.gemv import on_cuda_gpu
from voicechat.kernels.rnnt_greedy import initial_state, rnnt_greedy, rnnt_greedy_reference
from voicechat.llm.opcount import by_kind, kernel_count, op_labels
from voicechat.stt.conformer import PerceptionStream, push_streams
from voicechat.stt.mel import StreamingLogMel, log_mel
from voicechat.stt.rnnt import TranscriptStream, greedy_table
from voicechat.synthetic import build_tokenizer
from voicechat.text_stream import PieceDeltas, TokenDeltas
from voicechat.tokenizer import decode_pieces

from test_rnnt import VOCAB, _weights

# The streamed codec runs its convolutions on other shapes than the whole-answer decode: on a CPU
# the samples agree to 1e-5; on a CUDA GPU other kernels round differently (up to ~5e-5).
AUDIO_ATOL = 1e-5 if mx.default_device() == mx.cpu else 1e-4


def _chunks(total: int, kind: str, rng: np.random.Generator) -> list[int]:
    """Chunk sizes covering `total`: 'whole', 'tiny' (single items first, then the rest), 'random'."""
    if kind == "whole":
        return [total]
    if kind == "tiny":
        return [1] * min(total, 700) + [max(0, total - 700)]
    sizes = []
    while sum(sizes) < total:
        sizes.append(int(rng.integers(1, max(2, total // 4))))
    return sizes


def _streamed(push, finish, data, sizes, axis=0):
    """Outputs of `push` over `data` cut into `sizes` along `axis`, then `finish()`'s."""
    out, pos = [], 0
    for size in sizes:
        if pos >= data.shape[axis]:
            break
        out.append(push(np.take(data, range(pos, min(pos + size, data.shape[axis])), axis=axis)))
        pos += size
    out.append(finish())
    return out


def same_frames(actual, desired) -> None:
    """Encoder frames made in other pieces (chunks against the whole signal, a stream alone against
    a batch of streams): bit for bit on a CPU. MLX's CUDA matmul picks its kernel by the row count,
    which rounds otherwise: on a CUDA GPU they agree to float rounding."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    if on_cuda_gpu():
        np.testing.assert_allclose(actual, desired, rtol=1e-4, atol=1e-5)
    else:
        np.testing.assert_array_equal(actual, desired)


@pytest.fixture(scope="module")
def chat(tiny_checkpoint):
    return voicechat.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def long_input(spoken_wav):
    """Speech, reversed speech and silence: over 70 encoder frames (the attention's left context)."""
    speech = load_audio(spoken_wav, 16000)
    return np.concatenate([speech, speech[::-1], np.zeros(16000, np.float32), speech, np.zeros(3217, np.float32)])


# --------------------------------------------------------------------------- log-mel

@pytest.mark.parametrize("kind", ["whole", "tiny", "random"])
def test_streaming_log_mel_equals_the_whole_signals(kind):
    cfg = PreprocessorConfig()
    rng = np.random.default_rng(len(kind))
    x = (rng.standard_normal(16000 + 1234) * 0.1).astype(np.float32)
    # On the CPU, where an op's rows do not depend on how many it sees: the framing, padding and
    # normalisation are then checked bit for bit (a GPU's FFT and matmul round by batch size).
    with mx.stream(mx.cpu):
        stream = StreamingLogMel(cfg)
        out = _streamed(lambda c: np.array(stream.push(c)), lambda: np.array(stream.finish()), x,
                        _chunks(len(x), kind, rng))
        np.testing.assert_array_equal(np.concatenate(out, axis=1), np.array(log_mel(mx.array(x), cfg)))
    # frames come as soon as their samples exist (frame j: samples up to 160 j + 255); finish() the rest
    before_end = (len(x) - 256) // 160 + 1
    assert out[-1].shape[1] == 1 + len(x) // 160 - before_end


def test_log_mel_frames_of_several_streams_at_once_equal_each_alone():
    """`take` then `frames_of` on the spans of several streams at the same point (a server round):
    each row is the frames its stream makes alone, bit for bit on the CPU, and their log-mel."""
    cfg = PreprocessorConfig()
    rng = np.random.default_rng(9)
    signals = [(rng.standard_normal(1280 * 6) * scale).astype(np.float32) for scale in (0.01, 0.1, 0.5)]
    with mx.stream(mx.cpu):
        together = [StreamingLogMel(cfg) for _ in signals]
        alone = [StreamingLogMel(cfg) for _ in signals]
        for at in range(0, 1280 * 6, 1280):
            spans = [s.take(x[at : at + 1280]) for s, x in zip(together, signals)]
            assert len({span.size for span in spans}) == 1
            rows = np.array(together[0].frames_of(np.stack(spans)))
            for row, stream, x in zip(rows, alone, signals):
                np.testing.assert_array_equal(row, np.array(stream.push(x[at : at + 1280]))[0])
        for stream, x in zip(together, signals):  # and the last frames, at the end, the whole signal's
            whole, made = np.array(log_mel(mx.array(x), cfg))[0], stream.frames
            assert made == alone[0].frames
            np.testing.assert_array_equal(np.array(stream.finish())[0], whole[made:])


def test_streaming_log_mel_refuses_what_log_mel_refuses():
    stream = StreamingLogMel(PreprocessorConfig())
    assert stream.push(np.ones(256, np.float32)).shape == (1, 0, 128)
    with pytest.raises(ValueError, match="too short"):
        stream.finish()


# --------------------------------------------------------------------------- perception

@pytest.mark.parametrize("kind", ["whole", "tiny", "random"])
def test_perception_stream_equals_the_whole_signal_pass(chat, long_input, kind):
    perception = chat.listening.perception
    projected, lengths, encoded = perception(perception.log_mel(mx.array(long_input)))
    assert encoded.shape[1] > 80  # well past the attention cache's length
    stream = PerceptionStream(perception)

    def push(chunk):
        out = stream.push(chunk)
        mx.eval(out, stream.state)
        return out

    out = _streamed(push, stream.finish, long_input, _chunks(len(long_input), kind, np.random.default_rng(7)))
    same_frames(np.concatenate([np.array(p) for p, _ in out], axis=1), np.array(projected))
    same_frames(np.concatenate([np.array(e) for _, e in out], axis=1), np.array(encoded))
    assert stream.frames == int(lengths[0].item())
    assert all(c.keys.shape[2] <= 70 for c in stream.caches)  # bounded by the left context


def test_perception_stream_runs_every_chunk_as_one_compiled_graph(chat, long_input):
    """80 ms chunks from the first frame to well past the 70-frame attention context: the caches
    hold 70 frames' keys from the start (zeros the attention skips), so every one-frame chunk is
    the same compiled graph (the same primitives, elementwise chains fused) while the cache fills
    and after, and its frames are still the whole-signal pass's (`same_frames`)."""
    perception = chat.listening.perception
    _, _, encoded = perception(perception.log_mel(mx.array(long_input)))
    left = perception.config.encoder.att_context_size[0]
    stream = PerceptionStream(perception)
    out, ops = [], {}  # frames before the chunk -> primitives of its graph (one-frame chunks)
    for pos in range(0, len(long_input), 1280):
        before = stream.frames
        _, e = stream.push(long_input[pos : pos + 1280])
        assert all(c.keys.shape[2] == left for c in stream.caches)
        if e.shape[1] == 1:
            ops[before] = kernel_count(by_kind(op_labels(e, stream.state)))
        mx.eval(e, stream.state)
        out.append(np.array(e))
    out.append(np.array(stream.finish()[1]))
    # (the first chunk's graph also projects the position table, which later chunks read as leaves)
    later = {before: n for before, n in ops.items() if before}
    assert min(later) < 5 and max(later) > left + 5 and len(set(later.values())) == 1, ops
    same_frames(np.concatenate(out, axis=1), np.array(encoded))


def test_perception_streams_pushed_together_equal_each_pushed_alone(chat, long_input):
    """Four streams at different points of the input (caches filling and full), three in 80 ms
    chunks and one in 40 ms chunks, pushed together: every stream's frames and caches are those it
    makes alone (`same_frames`), and the streams whose chunks completed equal frame counts ran as one
    batch, filling or full."""
    perception = chat.listening.perception
    starts, sizes = [0, 30 * 1280, 75 * 1280, 80 * 1280], [1280, 1280, 1280, 640]
    together = [PerceptionStream(perception) for _ in starts]
    alone = [PerceptionStream(perception) for _ in starts]
    for stream_pair, start in zip(zip(together, alone), starts):  # the caches of the later ones filled first
        for stream in stream_pair:
            for at in range(0, start, 1280):
                mx.eval(stream.push(long_input[at : at + 1280]), stream.state)
    batched = []
    for tick in range(40):
        chunks = [long_input[a + tick * n :][:n] for a, n in zip(starts, sizes)]
        got, ran_together = push_streams(together, chunks, rows=lambda m: 4 * m)  # (rows past the streams too)
        mx.eval(got, [s.state for s in together])
        for stream, chunk, (projected, encoded) in zip(alone, chunks, got):
            want = stream.push(chunk)
            mx.eval(want, stream.state)
            same_frames(np.array(projected), np.array(want[0]))
            same_frames(np.array(encoded), np.array(want[1]))
        batched.append(ran_together)
        for a, b in zip(together, alone):
            assert a.frames == b.frames
    for a, b in zip(together, alone):  # (each stream's own caches, out of the batch)
        for x, y in zip(a.caches, b.caches):
            for u, v in zip(x.state, y.state):
                same_frames(np.array(u), np.array(v))
    # the three 80 ms streams (two of them filling their caches) batch at every tick, the 40 ms
    # one with them every second tick, until the later streams' input ends
    assert batched[:10] == [4, 3] * 5 and min(batched) >= 2, str(batched)


def test_a_batch_of_the_same_streams_runs_on_its_rows_as_they_are(chat, long_input):
    """Three streams batched tick after tick keep their caches as the batch's rows (not stacked
    again each tick); one of them pushed alone in between takes its own caches out, and the next
    batch stacks them again. Every chunk's frames and the final caches are each stream's alone."""
    perception = chat.listening.perception
    starts = [0, 20 * 1280, 62 * 1280]
    together = [PerceptionStream(perception) for _ in starts]
    alone = [PerceptionStream(perception) for _ in starts]
    for stream_pair, start in zip(zip(together, alone), starts):
        for stream in stream_pair:
            for at in range(0, start, 1280):
                mx.eval(stream.push(long_input[at : at + 1280]), stream.state)
    held = []
    for tick in range(12):
        chunks = [long_input[a + tick * 1280 :][:1280] for a in starts]
        if tick == 6:  # the second stream alone this tick, the others together
            got = [together[1].push(chunks[1])]
            pair, _ = push_streams([together[0], together[2]], [chunks[0], chunks[2]], rows=lambda m: m + 1)
            got = [pair[0], got[0], pair[1]]
        else:
            got, ran_together = push_streams(together, chunks, rows=lambda m: m + 1)
            assert ran_together == 3, (tick, [g[0].shape for g in got])
        mx.eval(got, [s.state for s in together])
        held.append(together[0]._batch.caches)
        for stream, chunk, (projected, encoded) in zip(alone, chunks, got):
            want = stream.push(chunk)
            mx.eval(want, stream.state)
            same_frames(np.array(projected), np.array(want[0]))
            same_frames(np.array(encoded), np.array(want[1]))
    assert all(held[t] is held[t + 1] for t in (0, 1, 2, 3, 4, 8, 9, 10))  # the same rows, run as they are
    assert held[5] is not held[6] and held[6] is not held[7]  # restacked after the composition changed
    for a, b in zip(together, alone):
        assert a.state_nbytes == b.state_nbytes
        for x, y in zip(a.caches, b.caches):
            for u, v in zip(x.state, y.state):
                same_frames(np.array(u), np.array(v))


# --------------------------------------------------------------------------- RNNT

@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("blank_bias", [-4.0, 1.5])
def test_greedy_resumed_in_pieces_equals_one_call(dtype, blank_bias):
    args = _weights(90, 48, 56, VOCAB, dtype, seed=3, blank_bias=blank_bias)
    whole = np.array(rnnt_greedy(*args, VOCAB, 10))
    assert (whole >= 0).any()
    for run in (rnnt_greedy, rnnt_greedy_reference):
        state, tables, pos = initial_state(2, 48, VOCAB), [], 0
        for size in (1, 2, 7, 30, 50):
            table, state = run(args[0][pos : pos + size], *args[1:], VOCAB, 10, start=state)
            tables.append(np.array(table))
            pos += size
        np.testing.assert_array_equal(np.concatenate(tables), whole)


def test_transcript_stream_equals_greedy_table(chat, long_input):
    lm, c = chat.listening, chat.config
    _, _, encoded = lm.perception(lm.perception.log_mel(mx.array(long_input)))
    whole = np.array(greedy_table(encoded, lm.rnnt_decoder, lm.rnnt_joint, c.rnnt_blank_id, c.audio_config.max_symbols))
    stream = TranscriptStream(lm.rnnt_decoder, lm.rnnt_joint, c.rnnt_blank_id, c.audio_config.max_symbols)
    tables, pos = [], 0
    for size in (1, 1, 5, 13, 200):
        tables.append(np.array(stream.push(encoded[:, pos : pos + size])))
        pos += size
    np.testing.assert_array_equal(np.concatenate(tables), whole)
    assert (whole >= 0).sum() > 3


# --------------------------------------------------------------------------- codec

@pytest.mark.parametrize("frames,sizes", [(1, [1]), (2, [1, 1]), (23, [1] * 23), (23, [2, 3, 5, 13]), (23, [23])])
def test_decoder_stream_equals_decode(chat, frames, sizes):
    codec = chat.speaking.audio_codec
    codes = mx.array(np.random.default_rng(frames).integers(0, 52, (1, 31, frames)).astype(np.int32))
    stream = DecoderStream(codec)
    out = _streamed(lambda c: stream.push(mx.array(c)), stream.finish, np.array(codes), sizes, axis=2)
    assert out[0].shape[1] == sizes[0] * 1764 - 6 and out[-1].shape[1] == 6  # the 6-sample lag
    np.testing.assert_allclose(np.concatenate(out, axis=1), np.array(codec.decode(codes)), rtol=0, atol=AUDIO_ATOL)


def test_decoder_streams_pushed_together_equal_each_pushed_alone(chat):
    """`codec.push_streams` (an engine's tick): three decoder streams at different points, batched
    frame after frame with padding rows, keep their contexts as the batch's rows (not stacked again
    each frame); one pushed alone in between takes its own out, and the next batch stacks them
    again. Every frame's samples and the final contexts are each stream's alone, bit for bit on
    any device (each row its own matmul, the sums in order)."""
    codec = chat.speaking.audio_codec
    rng = np.random.default_rng(5)
    starts = [0, 3, 7]
    together = [DecoderStream(codec) for _ in starts]
    alone = [DecoderStream(codec) for _ in starts]
    for pair, start in zip(zip(together, alone), starts):
        lead = mx.array(rng.integers(0, 52, (1, 31, start)).astype(np.int32)) if start else None
        for stream in pair:
            if lead is not None:
                stream.push(lead)
    held = []
    for frame in range(8):
        codes = rng.integers(0, 52, (3, 31, 1)).astype(np.int32)
        if frame == 4:  # the second stream alone this frame, the others together
            middle = together[1].push(mx.array(codes[1:2]))[0]
            pair = codec_push_streams([together[0], together[2]], mx.array(codes[[0, 2]]), rows=lambda m: m + 1)
            got = [pair[0], middle, pair[1]]
        else:
            got = codec_push_streams(together, mx.array(codes), rows=lambda m: m + 1)
        held.append(together[0]._batch)
        for stream, code, samples in zip(alone, codes, got):
            np.testing.assert_array_equal(samples, stream.push(mx.array(code[None]))[0])
    assert all(held[t] is held[t + 1] for t in (0, 1, 2, 5, 6))  # the same rows, run as they are
    assert held[3] is not held[4] and held[4] is not held[5]  # stacked again after the composition changed
    for a, b in zip(together, alone):
        for x, y in zip(a.contexts, b.contexts):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        np.testing.assert_array_equal(a.finish(), b.finish())


def test_streaming_istft_equals_istft():
    rng = np.random.default_rng(0)
    features = mx.array(rng.standard_normal((2, 37, 18)).astype(np.float32))
    stream = StreamingISTFT()
    out = [stream.push(features[:, a:b]) for a, b in ((0, 1), (1, 4), (4, 5), (5, 37))] + [stream.finish()]
    np.testing.assert_allclose(np.concatenate(out, axis=1), np.array(istft(features)), rtol=0, atol=1e-6)


def test_envelope_at_is_the_whole_envelope():
    frames = 9
    whole = np.array(_envelope(frames, 16, 4))
    np.testing.assert_array_equal(envelope_at(np.arange(6, 6 + frames * 4), frames, 16, 4), whole)


# --------------------------------------------------------------------------- text deltas

@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(384)


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _joined(deltas, ids):
    parts = [deltas.add(i) for i in ids] + [deltas.finish()]
    return parts


def test_token_deltas_hold_back_characters_cut_between_tokens(tokenizer):
    text = "  Paris, café 日本 😀 — naïve résumé…  "
    ids = tokenizer.encode(text).ids
    # byte-level tokens split the multi-byte characters: some ids alone are not whole characters
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    parts = _joined(TokenDeltas(_decode(tokenizer)), ids)
    assert "".join(parts) == text.strip()
    assert not any("\ufffd" in p for p in parts)


@pytest.mark.parametrize("seed", range(6))
def test_token_deltas_join_to_the_stripped_decode_of_random_ids(tokenizer, seed):
    """Random ids: stray continuation bytes, cut characters, specials, whitespace runs, skipped ids."""
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, 384, 300)]
    ids[:5] = [12, 11, 1, tokenizer.token_to_id("Ġ"), 2]  # skipped ids and a space first
    skip = {12, 11, 1, 2}
    expected = tokenizer.decode([i for i in ids if i not in skip], skip_special_tokens=False).strip()
    assert "".join(_joined(TokenDeltas(_decode(tokenizer), skip), ids)) == expected


def test_piece_deltas_join_to_decode_pieces():
    pieces = ["<unk>", "<en-US>", "▁what", "▁is", "▁", "a", "<s>", "b", "▁the"]
    ids = [4, 1, 2, 0, 3, 5, 6, 7, 4, 4, 8, 4]
    deltas = PieceDeltas(pieces)
    parts = [deltas.add([i]) for i in ids] + [deltas.finish()]
    assert "".join(parts) == decode_pieces(ids, pieces) == "what isab   the"
