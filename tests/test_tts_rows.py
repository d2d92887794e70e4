"""EAR-TTS sessions stepped together (`TTSRows`): each session's codes, generator key and cache are
those of its single-session steps (`EarTTS.step`), bit for bit, wherever each one is, whichever
rows step in a tick, and when a session moves in and out of the rows. On a CPU the rows run MLX's
ops and the C++ loops; on a CUDA GPU (the checkpoint loaded with our kernels) each kernel's
`sessions` grid."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from voicechat.tts.backbone import DEFAULT_CHUNK
from voicechat.tts.rows import TTSRows

SESSIONS = 3


def _text_ids(chat, seed: int, frames: int) -> np.ndarray:
    """Text ids the LLM might give: pads, words, an EOS now and then (the silence codes' path)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, chat.config.text_config.vocab_size, frames)
    ids[rng.random(frames) < 0.2] = chat.ear_tts.eos_id
    return ids.astype(np.int32)


def _session(chat, frames_before: int, seed: int):
    """A session's TTS state after its warmup and `frames_before` steps alone."""
    tts = chat.ear_tts
    cache = tts.make_cache()
    previous = tts.warmup(chat.speaking.audio_prompt_latents[chat.config.speaker], chat.warmup_codes(), cache)
    key = mx.random.key(seed)
    silence = chat.speaking.codec_silence_tokens
    for text_id in _text_ids(chat, seed + 100, frames_before):
        previous, key = tts.step(previous, int(text_id), cache, key, silence)
    mx.eval(previous, key, cache.state)
    return cache, previous, key


def _alone(chat, state, text_ids):
    cache, previous, key = state
    codes = []
    for text_id in text_ids:
        previous, key = chat.ear_tts.step(previous, int(text_id), cache, key, chat.speaking.codec_silence_tokens)
        codes.append(np.array(previous).reshape(-1))
    cache.flush()
    return codes, np.array(key), cache


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "tiny_checkpoint_q4"])
def test_sessions_stepped_together_get_the_codes_they_get_alone(request, checkpoint):
    chat = voicechat.load(request.getfixturevalue(checkpoint))
    frames = 12
    # Positions apart by more than a cache chunk: the rows' buffers are the longest one's.
    before = [0, 7, DEFAULT_CHUNK + 3]
    texts = [_text_ids(chat, s, frames) for s in range(SESSIONS)]
    # Session 1 sits out ticks 3 and 4 (no input): its state must not move.
    active = np.ones((frames, SESSIONS), bool)
    active[3:5, 1] = False
    expected = []
    for s in range(SESSIONS):
        mine = [texts[s][t] for t in range(frames) if active[t, s]]
        expected.append(_alone(chat, _session(chat, before[s], s), mine))
    with mx.stream(chat._timeline_stream):
        rows = TTSRows(chat.ear_tts, 4, DEFAULT_CHUNK)  # a bucket: slot 3 stays empty
        for s in range(SESSIONS):
            cache, previous, key = _session(chat, before[s], s)
            rows.insert(s, cache, cache.offset, previous, key)
        got = [[] for _ in range(SESSIONS)]
        for t in range(frames):
            step_active = np.zeros(4, bool)
            step_active[:SESSIONS] = active[t]
            text = np.zeros(4, np.int32)
            text[:SESSIONS] = [texts[s][t] for s in range(SESSIONS)]
            codes = np.array(rows.step(mx.array(text), step_active, chat.speaking.codec_silence_tokens))
            for s in range(SESSIONS):
                if active[t, s]:
                    got[s].append(codes[s])
        taken = [rows.take(s) for s in range(SESSIONS)]
    for s, (want_codes, want_key, want_cache) in enumerate(expected):
        assert len(got[s]) == len(want_codes)
        for t, (a, b) in enumerate(zip(got[s], want_codes)):
            np.testing.assert_array_equal(a, b, err_msg=f"session {s}, frame {t}")
        cache, _, key = taken[s]
        np.testing.assert_array_equal(np.array(key), want_key)
        assert cache.offset == want_cache.offset
        for mine, theirs in zip(cache.buffers, want_cache.buffers):
            end = min(mine.shape[2], theirs.shape[2], cache.offset)  # the slots written so far
            np.testing.assert_array_equal(np.array(mine[:, :, :end]), np.array(theirs[:, :, :end]))


def test_a_row_sitting_out_at_the_end_of_the_buffers_does_not_write_past_them(tiny_checkpoint):
    """A row without input still runs (its results discarded); its key goes to the slot of its
    position. When that position is the buffers' capacity and the rows that step are far below
    it, the buffers must grow for it too, or that key lands past its row: in a neighbour's slots."""
    chat = voicechat.load(tiny_checkpoint)
    warmed = _session(chat, 0, 0)[0].offset
    before = [DEFAULT_CHUNK - 1 - warmed, 3]  # session 0 at position 255: the last slot of the first capacity
    frames = 6
    texts = [_text_ids(chat, 10 + s, frames) for s in range(2)]
    active = np.ones((frames, 2), bool)
    active[1:4, 0] = False  # then at position 256, session 0 sits out while session 1 steps
    expected = [_alone(chat, _session(chat, before[s], s), [texts[s][t] for t in range(frames) if active[t, s]])
                for s in range(2)]
    with mx.stream(chat._timeline_stream):
        rows = TTSRows(chat.ear_tts, 2, DEFAULT_CHUNK)
        for s in range(2):
            cache, previous, key = _session(chat, before[s], s)
            rows.insert(s, cache, cache.offset, previous, key)
        assert rows.positions[0] == DEFAULT_CHUNK - 1
        got = [[], []]
        for t in range(frames):
            text = mx.array(np.array([texts[0][t], texts[1][t]]))
            codes = np.array(rows.step(text, active[t], chat.speaking.codec_silence_tokens))
            for s in range(2):
                if active[t, s]:
                    got[s].append(codes[s])
        taken = [rows.take(s)[0] for s in range(2)]
    for s, (want_codes, _, want_cache) in enumerate(expected):
        np.testing.assert_array_equal(np.stack(got[s]), np.stack(want_codes), err_msg=f"session {s}")
        for mine, theirs in zip(taken[s].buffers, want_cache.buffers):
            end = min(mine.shape[2], theirs.shape[2], want_cache.offset)
            np.testing.assert_array_equal(np.array(mine[:, :, :end]), np.array(theirs[:, :, :end]))
