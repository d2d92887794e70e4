"""The engine: live sessions stepped together in one batched frame give each session exactly what it
gets alone, whatever its neighbours do and whenever they join or leave."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import pytest
import soundfile as sf

import voicechat
from live_checks import check_equal
from voicechat.audio import load_audio
from voicechat.engine import Engine, EngineFull, bucket
from voicechat.kernels.gemv import on_cuda_gpu
from voicechat.live import ContextFull
from voicechat.session import InputError, ModelBusy
from voicechat.synthetic import make_checkpoint, tiny_config

EXTRA = 0.5
PROMPT = "Be brief."
# Long enough that the session's LLM and TTS caches outgrow their first 256 slots while its
# neighbours' do not: rows of different capacities in one batch.
LONG_PROMPT = " ".join(["answer in one short sentence and keep to the facts"] * 12)


@pytest.fixture(scope="module")
def inputs(spoken_wav, spoken_wav_22k):
    speech16, _ = sf.read(str(spoken_wav), dtype="int16")
    speech22, rate22 = sf.read(str(spoken_wav_22k), dtype="float32")
    speech = load_audio(spoken_wav, 16000)
    noise = (np.random.default_rng(3).standard_normal(19000) * 0.05).astype(np.float32)
    return {"speech16k": (speech16, 16000), "speech22k": (speech22, rate22), "noise": (noise, 16000),
            "reversed": (speech[::-1].copy(), 16000), "short": (speech[:9000], 16000)}


@dataclass
class Plan:
    """One session of a schedule: its input, settings, the tick it joins at and its piece size."""

    name: str
    system_prompt: str | None
    seed: int
    join: int
    piece: int
    leave: int | None = None  # closed unfinished at this tick (no result)
    bad_inputs: bool = False


def generate_all(chat, inputs, plans):
    return {i: chat.generate(inputs[p.name][0], system_prompt=p.system_prompt, extra_decoding_seconds=EXTRA,
                             seed=p.seed, sample_rate=inputs[p.name][1])
            for i, p in enumerate(plans) if p.leave is None}


def feed_bad(session, rate):
    for bad, match in ((np.full(5, np.nan, np.float32), "NaN"), (np.zeros((2, 3, 4), np.float32), "shape"),
                       (np.zeros(5, np.complex64), "expected float")):
        with pytest.raises(InputError, match=match):
            session.feed(bad, sample_rate=rate)
    with pytest.raises(InputError, match="Hz"):
        session.feed(np.zeros(100, np.float32), sample_rate=rate + 1)


def run_schedule(chat, inputs, plans, max_sessions=8, alone=None, together=None):
    """Feed every joined session a piece a tick (then finish), one engine step a tick, until all
    are done. Returns ({plan index: (frames, result)}, the batch sizes seen, the engine's ticks);
    `alone` (a list) gets, per tick, the plan index of the session that stepped alone (or None).
    `together` (a list): the pieces of a tick go in with one `feed_many` (its refusals checked),
    and it gets the chunks perceived in batches."""
    out, frames, sessions, fed, finished = {}, {}, {}, {}, set()
    batches = []
    with Engine(chat, max_sessions=max_sessions) as engine:
        tick = 0
        while len(finished) < len(plans):
            pieces = []
            for i, p in enumerate(plans):
                if p.join == tick:
                    sessions[i] = engine.live(system_prompt=p.system_prompt, seed=p.seed)
                    frames[i], fed[i] = [], 0
                if i in finished or i not in sessions:
                    continue
                live = sessions[i]
                if p.leave == tick:
                    live.close()
                    finished.add(i)
                    continue
                samples, rate = inputs[p.name]
                if p.bad_inputs and fed[i] == 2 * p.piece:
                    if together is None:
                        feed_bad(live, rate)
                    else:
                        pieces.append((live, np.full(5, np.nan, np.float32), rate))
                if fed[i] < len(samples):
                    if together is None:
                        live.feed(samples[fed[i] : fed[i] + p.piece], sample_rate=rate)
                    else:
                        pieces.append((live, samples[fed[i] : fed[i] + p.piece], rate))
                    fed[i] += p.piece
                elif not live.ended and live.queued == 0 and fed[i] != -1:
                    live.feed_end(EXTRA)
                    fed[i] = -1
            if pieces:
                refused = engine.feed_many(pieces)
                bad = [s for s, chunk, _ in pieces if chunk.dtype == np.float32 and np.isnan(chunk).any()]
                assert set(refused) == set(bad) and all("NaN" in str(e) for e in refused.values())
            stepping_alone = engine.alone
            batches.append(engine.step())
            if alone is not None:
                alone.append(next((i for i, live in sessions.items() if live is stepping_alone), None))
            for i, live in sessions.items():
                if i in finished:
                    continue
                frames[i] += live.collect()
                if live.ended:
                    out[i] = (frames[i], live.result())
                    live.close()
                    finished.add(i)
            tick += 1
        ticks = engine.ticks
        if together is not None:
            together.append(engine.perceived_together)
    return out, batches, ticks


SCHEDULE = [
    Plan("speech16k", None, 0, join=0, piece=1280),
    Plan("noise", LONG_PROMPT, 7, join=1, piece=1280),
    Plan("noise", PROMPT, 11, join=2, piece=640, leave=9),  # leaves half way; its slot is reused
    Plan("speech22k", PROMPT, 5, join=3, piece=1279),  # resampled as it comes
    Plan("reversed", None, 2**40, join=5, piece=4000, bad_inputs=True),
    Plan("short", PROMPT, 3, join=12, piece=2000),  # joins into the slot the leaver freed
]


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "tiny_checkpoint_q4"])
def test_each_session_in_a_batch_equals_its_generate(request, inputs, checkpoint):
    with voicechat.load(request.getfixturevalue(checkpoint)) as chat:
        plans = SCHEDULE if checkpoint == "tiny_checkpoint" else SCHEDULE[:2] + SCHEDULE[4:]
        assert len(chat.prompt_ids(LONG_PROMPT)) > 200
        expected = generate_all(chat, inputs, plans)
        out, batches, ticks = run_schedule(chat, inputs, plans)
    assert max(batches) >= 4  # sessions did share frames
    assert ticks < sum(r.frames for _, r in out.values())
    assert set(out) == set(expected)
    for i, (frames, result) in out.items():
        check_equal(frames, result, expected[i])


def test_sessions_fed_together_equal_their_generate(tiny_checkpoint, inputs):
    """`feed_many` (a server's round): the chunks of a tick go through perception as one batch,
    the streamed encoders' caches filling or full. Sessions long enough to fill them, joining
    at different ticks, one with half-frame pieces, one with a bad chunk in the same call: each
    session still gets its generate's ids, codes, transcript and audio."""
    speech, _ = inputs["speech16k"]
    noise, _ = inputs["noise"]
    speech = speech.astype(np.float32) / 32768
    long_inputs = {"long": (np.concatenate([speech, noise, speech, noise, speech]), 16000),  # ~9 s: past the
                   "long2": (np.concatenate([noise, speech[::-1], noise, speech, noise]), 16000),  # 70-frame cache
                   **inputs}
    plans = [Plan("long", None, 0, join=0, piece=1280), Plan("long2", PROMPT, 4, join=2, piece=1280),
             Plan("long", PROMPT, 9, join=5, piece=640, bad_inputs=True), Plan("short", None, 1, join=30, piece=2000)]
    with voicechat.load(tiny_checkpoint) as chat:
        expected = generate_all(chat, long_inputs, plans)
        together = []
        out, batches, _ = run_schedule(chat, long_inputs, plans, together=together)
    assert together[0] >= 20 and max(batches) >= 3
    assert set(out) == set(expected)
    for i, (frames, result) in out.items():
        check_equal(frames, result, expected[i])


def test_warm_batches_traces_each_bucket_and_leaves_no_session(tiny_checkpoint):
    with voicechat.Engine(voicechat.load(tiny_checkpoint), max_sessions=5) as engine:
        assert engine.warm_batches() == 3  # batches of 2, 3-4 and 5 sessions run as 2, 4 and 8 rows
        assert engine.warm_batches(2) == 1 and engine.open_sessions == 0


def test_push_steps_the_neighbours_queued_input_in_the_same_batches(tiny_checkpoint, inputs):
    chat = voicechat.load(tiny_checkpoint)  # the references: chat.live alone
    a_samples, _ = inputs["speech16k"]
    b_samples, _ = inputs["short"]
    alone = []
    for samples, seed, prompt in ((a_samples, 1, None), (b_samples, 2, PROMPT)):
        with chat.live(system_prompt=prompt, seed=seed) as live:
            frames = [f for pos in range(0, len(samples), 3000) for f in live.push(samples[pos : pos + 3000])]
            frames += live.finish(EXTRA)
            alone.append((frames, live.result()))
    with Engine(chat, max_sessions=2) as engine:
        a, b = engine.live(seed=1), engine.live(system_prompt=PROMPT, seed=2)
        b.feed(b_samples)  # queued: stepped by a's pushes
        a_frames = [f for pos in range(0, len(a_samples), 3000) for f in a.push(a_samples[pos : pos + 3000])]
        b_frames = b.collect()
        assert b_frames and b.queued == 0
        a_frames += a.finish(EXTRA)
        b_frames += b.finish(EXTRA)
        results = a.result(), b.result()
        assert engine.ticks < results[0].frames + results[1].frames
    for (frames, result), (alone_frames, alone_result) in zip(((a_frames, results[0]), (b_frames, results[1])), alone):
        check_equal(frames, result, alone_result)
        np.testing.assert_array_equal(result.audio, alone_result.audio)


def test_slots_come_in_buckets_and_the_engine_holds_the_model(tiny_checkpoint):
    assert voicechat.Engine is Engine
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 9, 17, 33, 64, 65, 100)] == [1, 1, 2, 4, 8, 16, 32, 64, 64, 128, 128]
    chat = voicechat.load(tiny_checkpoint)
    engine = Engine(chat, max_sessions=3)
    with pytest.raises(ModelBusy):
        chat.generate(np.zeros(8000, np.float32), sample_rate=16000)
    with pytest.raises(ModelBusy):
        chat.live()
    sessions = [engine.live(seed=i) for i in range(3)]
    assert engine.slots == 4 and [s.slot for s in sessions] == [0, 1, 2]
    with pytest.raises(EngineFull):
        engine.live()
    for bad, error in (({"seed": -1}, InputError), ({"seed": 1.5}, InputError), ({"system_prompt": 3}, TypeError)):
        with pytest.raises(error):
            engine.live(**bad)
    sessions[2].close()
    assert engine.slots == 2
    sessions[0].close()
    assert engine.slots == 1 and sessions[1].slot == 0  # the one left steps alone, in slot 0
    assert engine.alone is sessions[1]
    again = engine.live(seed=9)
    assert again.slot == 1 and engine.slots == 2 and engine.alone is None
    held = again.held_bytes()
    assert held["llm_cache"] > 0 and held["tts_cache"] > 0
    engine.close()
    with pytest.raises(InputError):
        again.push(np.zeros(1280, np.float32))
    chat.generate(np.zeros(8000, np.float32), sample_rate=16000, extra_decoding_seconds=0)
    with pytest.raises(InputError, match="max_sessions"):
        Engine(chat, max_sessions=0)


def test_the_context_full_ends_one_session_and_not_its_neighbour(tmp_path, inputs):
    config = tiny_config()
    config.text_config.max_position_embeddings = 26
    small = voicechat.load(make_checkpoint(tmp_path / "small-context", "tiny", config=config))
    samples, rate = inputs["speech16k"]
    short, _ = inputs["short"]
    short = short[:12000]  # fits the context with its extra seconds
    expected = small.generate(short, extra_decoding_seconds=0.3, seed=4, sample_rate=rate)
    room = 26 - len(small.prompt_ids(PROMPT))
    with Engine(small, max_sessions=2) as engine:
        full, other = engine.live(system_prompt=PROMPT), engine.live(seed=4)
        full.feed(np.concatenate([samples, samples]), sample_rate=rate)  # more than the context holds
        other.feed(short, sample_rate=rate)
        other.feed_end(0.3)
        engine.run()
        with pytest.raises(ContextFull, match=f"after {room} frames") as caught:
            full.collect()
        assert len(caught.value.frames) == room and full.ended
        with pytest.raises(ContextFull):
            full.feed(samples[:1280])
        check_equal(other.collect(), other.result(), expected)
        assert full.result().frames == room


def live_alone(chat, samples, rate, system_prompt, seed, piece):
    """(frames, result) of `chat.live` fed `piece` samples at a time."""
    with chat.live(system_prompt=system_prompt, seed=seed) as live:
        frames = [f for pos in range(0, len(samples), piece) for f in live.push(samples[pos : pos + piece], rate)]
        frames += live.finish(EXTRA)
        return frames, live.result()


def test_a_session_alone_takes_the_single_session_step(tiny_checkpoint, inputs):
    samples, rate = inputs["speech22k"]
    chat = voicechat.load(tiny_checkpoint)
    assert getattr(chat.listening, "_decode_fns", None) is None  # the compiled decode step, made at first use
    with Engine(chat, max_sessions=4) as engine:
        live = engine.live(system_prompt=PROMPT, seed=5)
        assert engine.alone is live and engine.slots == 1 and engine.lm.slots == engine.tts.slots == 0
        frames = []
        for pos in range(0, len(samples), 1500):
            frames += live.push(samples[pos : pos + 1500], sample_rate=rate)
            # its state is its own loop's: the single-session caches, stepped a frame at a time
            assert live.loop.position == live.prompt_frames + live.frames
            assert live.loop.tts_cache.offset > live.frames
        frames += live.finish(EXTRA)
        result = live.result()
        assert engine.path_ticks == {"alone": result.frames, "rows": 0}
    assert chat.listening._decode_fns is not None  # `DuplexLM.decode` ran: chat.live's step
    expected_frames, expected = live_alone(chat, samples, rate, PROMPT, 5, 1500)
    check_equal(frames, result, expected)
    np.testing.assert_array_equal(result.audio, expected.audio)
    assert result.host_syncs == expected.host_syncs


def test_sessions_move_between_stepping_alone_and_the_rows_exactly(tiny_checkpoint, inputs):
    plans = [
        Plan("speech16k", PROMPT, 1, join=0, piece=1280),  # alone, then with the next, alone, with the last
        Plan("short", None, 2, join=3, piece=1280),  # joins (a batch of 2) and ends first
        Plan("noise", LONG_PROMPT, 3, join=22, piece=1280),  # joins in slot 1; alone in slot 0 once the first ends
    ]
    with voicechat.load(tiny_checkpoint) as chat:
        expected = generate_all(chat, inputs, plans)
        alone = []
        out, batches, ticks = run_schedule(chat, inputs, plans, alone=alone)
    owners = [i for n, i in enumerate(alone) if n == 0 or alone[n - 1] != i]
    assert owners == [0, None, 0, None, 2]
    assert max(batches) == 2
    for i, (frames, result) in out.items():
        check_equal(frames, result, expected[i])


@pytest.mark.skipif(not on_cuda_gpu(), reason="full size wants a CUDA GPU")
def test_sessions_at_full_size_on_a_gpu_have_the_bits_they_have_alone(tmp_path):
    """The contract where rows could round otherwise: at the published shapes (random 4-bit
    weights), five sessions starting at different points of their input, stepped together (eight
    slots: the LLM's rows in groups of 4 and the TTS's CFG pairs on our kernels, empty slots among
    them; the codec frames as one batch), each give `chat.live`'s ids, codes, transcript and
    samples bit for bit."""
    from voicechat.synthetic import random_checkpoint

    chat = voicechat.load(random_checkpoint(tmp_path / "full", "full", quantize=4))
    speech = load_audio(str(resources.files("voicechat") / "data" / "question.wav"), 16000)  # (no espeak-ng needed)
    piece = chat.config.input_samples_per_frame
    inputs = [np.concatenate([np.zeros(3 * piece * i, np.float32), speech[: piece * (16 + 3 * i)]]) for i in range(5)]
    expected = [live_alone(chat, x, 16000, None, i, piece) for i, x in enumerate(inputs)]
    with Engine(chat, max_sessions=5) as engine:
        sessions = [engine.live(seed=i) for i in range(5)]
        for pos in range(0, max(x.size for x in inputs), piece):
            engine.feed_many([(s, x[pos : pos + piece], 16000) for s, x in zip(sessions, inputs) if pos < x.size])
            engine.step()
        for s in sessions:
            s.feed_end(EXTRA)
        engine.run()
        got = [(s.collect(), s.result()) for s in sessions]
        assert engine.path_ticks["rows"] > 0
    for (frames, result), (_, want) in zip(got, expected):
        check_equal(frames, result, want)
        np.testing.assert_array_equal(result.audio, want.audio)
