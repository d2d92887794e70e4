"""Many live conversations on one model: every session with input stepped together, one batched frame.

    engine = voicechat.Engine(chat, max_sessions=32)
    a = engine.live(system_prompt="Be concise.", seed=0)   # a LiveSession: push / finish / result
    b = engine.live(seed=1)
    frames = a.push(chunk, sample_rate=16000)               # as chat.live(); steps b too if b has input

    # a server's loop: feed every session, one tick, hand out the frames
    a.feed(chunk_a); b.feed(chunk_b)
    engine.step()                                            # one frame for each session with input
    a.collect(), b.collect()                                 # the frames each one completed

Each tick (`step`) runs one timeline frame for every session that has a complete 80 ms of input
queued. The LLM steps as one batch (`llm.rows.LMGroups`: a row per session, per-session Mamba
states, attention keys at per-session positions, both heads' argmax per row; `DuplexLM.decode`'s
own compiled parts, in groups of up to 4 rows). Then the TTS steps with two rows per session
(`tts.rows.TTSRows`: each session's CFG pair, its own keys, position and generator key; the
single-session step's graph and kernels over all the sessions at once). Then the codec decodes
every session's frame as one batch (`codec.push_streams`: each row its own matmuls, so each
session's samples are its own alone on any device), and each session's text. Perception and the
transcript run as input arrives: per session with `feed`, as in a `LiveSession`; with `feed_many`
(a server's round: a chunk for each of several sessions) the streamed encoders run their layers as
one batch (`stt.conformer.push_streams`: sessions whose chunks complete the same number of frames,
wherever each one is, run as a bucket's rows: `warm_batches` traces each bucket ahead), then their
transcripts as one CPU loop over all of them (`stt.rnnt.push_streams`).

A session open on its own steps alone (`Engine.alone`): its tick is `chat.live`'s frame, the
single-session step (`FrameLoop.step`: `DuplexLM.decode`, `EarTTS.step`, with every CUDA kernel
those use) on its own caches, then its codec frame. When another session joins, the first one's
state is written into row 0 of the batched arrays; when sessions leave and one is left, its row is
taken back into single-session caches (buffers of their own) and it moves to slot 0. Both moves
copy that session's caches once, at the join or the leave, never per frame. `path_ticks` counts the
ticks each way took.

While two or more are open, the batched state lives in arrays indexed by slot and stays there
between ticks (no session's keys are gathered or scattered per frame: that would copy every
session's whole cache every frame). A session takes the lowest free slot; its system prompt and
the TTS warmup run alone first (the same code as `chat.live`), then its state is written into the
slot's rows. Rows of sessions without input in a tick are computed and discarded (their state is
kept by a select; their key still lands in the slot of their position, for which the buffers hold
room, and which the row writes again before any query reads it). Slot counts come in buckets (2, 4, 8, ...) so that the compiled steps are traced
once per bucket and cache capacity, not per session count; the batch shrinks when the highest
slots free up.

Exactness: a session's ids, codes, transcript and audio are those it gets alone (`chat.live`, and
so `chat.generate`), whatever its neighbours do and whenever they join or leave: on a CPU, where
MLX computes each row independently of the others (tested), and on a CUDA GPU, where our kernels
give each session's rows the bits they get alone (the LLM's at up to 4 rows a group, the TTS's
through each kernel's `sessions` grid), and the codec runs each session's matmuls on its own rows.
On a CUDA GPU the perception `feed_many` batches rounds otherwise than a session's alone (about
1e-6: MLX's matmuls and convolutions pick their kernels by the row count), so there a session's
ids equal its generate's unless two of its logits are that close.

The engine holds the `VoiceChat` until closed (`with`, or `close()`), as `chat.sessions()` does:
meanwhile `generate()` and `live()` raise `ModelBusy`. One thread at a time steps it; every session
method takes the engine's lock.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .codec.codec import queue_streams as queue_codec, take_streams as take_codec
from .live import ContextFull, Frame, LiveSession, _decodable_codes
from .llm.rows import MAX_KERNEL_ROWS, LMGroups, LMRows
from .session import InputError, _checked_seed
from .stt.conformer import PerceptionStream, push_streams as push_perception
from .stt.rnnt import push_streams as push_transcripts
from .tts.backbone import DEFAULT_CHUNK
from .tts.rows import TTSRows
from .tts_thread import release_mlx_state_at_thread_exit

SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class TickTimes:
    """A tick's clock (`time.perf_counter()`): its start, the batched model step read back, and
    each stepped session's frame made (its codec frame and text included)."""

    started: float
    stepped: float
    delivered: dict


class EngineFull(RuntimeError):
    """The engine already holds `max_sessions` open sessions."""


def bucket(n: int) -> int:
    """The slot count that holds `n` rows: the smallest bucket >= n (powers of two past the list)."""
    for size in SLOT_BUCKETS:
        if size >= n:
            return size
    return 1 << (max(n, 1) - 1).bit_length()


class Engine:
    """Owns a loaded `VoiceChat` and steps its live sessions together (see the module docstring).
    `max_sessions`: the most sessions open at once (`live` raises `EngineFull` past it)."""

    def __init__(self, chat, max_sessions: int = 64):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise InputError(f"max_sessions must be a whole number >= 1, got {max_sessions!r}")
        self.chat = chat
        self.max_sessions = max_sessions
        self._lock = threading.RLock()
        self._turn = chat._begin_turn(live=True)
        self._closed = False
        c = chat.config
        self._silence = chat.speaking.codec_silence_tokens
        self._zero_codes = np.zeros(c.tts_config.num_quantizers, np.int32)
        self._audio_width = c.text_config.hidden_size
        self.sessions: list[EngineSession | None] = [None]
        with mx.stream(chat._timeline_stream):
            self.lm = LMGroups(chat.listening, 0, c.pad_token_id)
            self.tts = TTSRows(chat.ear_tts, 0, DEFAULT_CHUNK)
            self._no_audio = mx.zeros((1, 1, self._audio_width), mx.float32)
            mx.eval(self._no_audio)
        self._alone: EngineSession | None = None
        self.ticks = 0
        # Ticks by the path they took: "alone" (a session on its own `FrameLoop.step`: the
        # single-session kernels) or "rows" (the batched steps); a tick in turn counts each session.
        self.path_ticks = {"alone": 0, "rows": 0}
        self.last_tick: TickTimes | None = None  # when the last tick's parts were done (perf_counter)
        self.perceived_together = 0  # chunks whose encoder layers ran in a batch of two or more (feed_many)

    # ------------------------------------------------------------------ sessions

    def live(self, system_prompt: str | None = None, seed: int = 0, *, keep_audio: bool = True,
             keep_input_audio: bool = False) -> "EngineSession":
        """A new session, as `chat.live(...)` makes one (the same arguments and errors)."""
        seed = _checked_seed(seed)
        self.chat.prompt_ids(system_prompt)  # (its TypeError first)
        with self._lock:
            if self._closed:
                raise InputError("this Engine is closed")
            open_now = sum(s is not None for s in self.sessions)
            if open_now >= self.max_sessions:
                raise EngineFull(f"the engine holds its maximum of {self.max_sessions} sessions")
            slot = next((i for i, s in enumerate(self.sessions) if s is None), len(self.sessions))
            session = EngineSession(self, slot, system_prompt, seed, keep_audio, keep_input_audio)
            if open_now == 0:
                self.sessions = [session]
                self._alone = session  # steps on its own loop
                return session
            self._resize(max(slot + 1, self.slots))
            if self._alone is not None:  # no longer alone: its state goes into its rows
                alone, self._alone = self._alone, None
                alone._join()
            self.sessions[slot] = session
            session._join()
            return session

    @property
    def slots(self) -> int:
        """Slots in use (a bucket): rows of the batched state, or 1 while a session steps alone."""
        return len(self.sessions)

    @property
    def alone(self) -> "EngineSession | None":
        """The session that steps on its own `FrameLoop` (the only one open), or None."""
        return self._alone

    @property
    def open_sessions(self) -> int:
        return sum(s is not None for s in self.sessions)

    def _resize(self, rows: int) -> None:
        """Slots for `rows` (a bucket). One slot has no batched rows: its session steps alone."""
        size = bucket(rows)
        with mx.stream(self.chat._timeline_stream):
            self.lm.resize(size if size > 1 else 0)
            self.tts.resize(size if size > 1 else 0)
        self.sessions = (self.sessions + [None] * size)[:size]

    def _release(self, session: "EngineSession") -> None:
        """The session no longer steps: its slot is free, and the batch shrinks if it can; the one
        session left steps alone, in slot 0."""
        with self._lock:
            if session.slot < len(self.sessions) and self.sessions[session.slot] is session:
                self.sessions[session.slot] = None
            if self._alone is session:
                self._alone = None
            if self._closed:
                return
            left = [s for s in self.sessions if s is not None]
            if len(left) == 1 and self._alone is None:
                last = left[0]
                with mx.stream(self.chat._timeline_stream):
                    last._leave_rows()
                self.sessions = [last]
                last.slot, self._alone = 0, last
            used = max((i + 1 for i, s in enumerate(self.sessions) if s is not None), default=1)
            self._resize(used)

    # ------------------------------------------------------------------ the tick

    def step(self) -> int:
        """One frame for every session with a complete 80 ms of input queued, as one batch; each
        session's frame goes to its `collect()`. Returns how many sessions stepped."""
        release_mlx_state_at_thread_exit()  # any thread may step the engine (tts_thread.py says why)
        with self._lock:
            ready = [s for s in self.sessions if s is not None and s._queue]
            if not ready:
                return 0
            if self._alone is not None:
                started = time.perf_counter()
                stepped, delivered = self._step_in_turn(ready)
                self.ticks += 1
                self.last_tick = TickTimes(started, stepped, delivered)
                return len(ready)
            started = time.perf_counter()
            chat = self.chat
            rows = self.slots
            active = np.zeros(rows, bool)
            audio = [self._no_audio] * rows
            for s in ready:
                active[s.slot] = True
                audio[s.slot] = s._queue[0][0]
            self.ticks += 1
            self.path_ticks["rows"] += 1
            # Timeline position 0 has no TTS step (its codes are zeros).
            speaking = active & (self.lm.positions >= 1)
            with mx.stream(chat._timeline_stream):
                text, function = self.lm.step(mx.concatenate(audio, axis=0), active)
                codes = self.tts.step(text, speaking, self._silence)
                # The codec batch is queued behind the step (its codes never leave the device), so
                # its launches overlap the step's run; position 0 decodes zero codes, as alone.
                heard = mx.where(mx.array(speaking)[:, None], codes, 0)[mx.array([s.slot for s in ready])]
                framed, contexts = queue_codec([s.decoder for s in ready], _decodable_codes(
                    heard[:, :, None], chat.speaking.control_codes, self._silence), rows=bucket)
                mx.async_eval(text, function, codes, framed, contexts)
                text, function, codes = np.array(text), np.array(function), np.array(codes)
            times = TickTimes(started, time.perf_counter(), {})
            # Read by slot before any frame is handed out: a session that ends frees its slot, and
            # the one left then moves to slot 0.
            ids = [(int(text[s.slot]), int(function[s.slot])) for s in ready]
            frame_codes = [codes[s.slot] if speaking[s.slot] else self._zero_codes for s in ready]
            with mx.stream(chat._timeline_stream):
                audio = take_codec([s.decoder for s in ready], framed)
            for s, (text_id, function_id), c, samples in zip(ready, ids, frame_codes, audio):
                s.host_syncs += 1
                s._deliver(text_id, function_id, c, samples)
                times.delivered[s] = time.perf_counter()
            self.last_tick = times
            return len(ready)

    def _step_in_turn(self, ready: list["EngineSession"]) -> tuple[float, dict]:
        """Each ready session's frame as `chat.live` makes it (`FrameLoop.step` with the
        single-session kernels, then its own codec frame, on its own caches), one session after
        another. Every session's step and codec frame are queued before any is read back, so the
        device runs them back to back while the host builds the next. Each session's codec runs on
        its own row, not in a batch: a batch's products may round otherwise on a GPU, and a session
        in turn gets `chat.live`'s samples bit for bit. Returns when the steps were read back, and
        when each session's frame was delivered."""
        queued = [(s, s._queue_frame(s._queue[0][0], 0)) for s in ready]
        self.path_ticks["alone"] += len(ready)
        return _read_and_deliver(queued)

    def feed_many(self, chunks: list[tuple["EngineSession", object, int]]) -> dict["EngineSession", InputError]:
        """`session.feed(chunk, sample_rate)` for every `(session, chunk, sample_rate)` (one chunk a
        session), with their perception as one batch (`stt.conformer.push_streams`: the streamed
        encoders whose chunks complete the same number of frames run their layers together, one
        compiled graph for all), and their transcripts as one loop (`stt.rnnt.push_streams`: the
        transcript weights read once a step for all the sessions).
        Returns the sessions whose chunk was refused, with the error (each of them unchanged);
        the others' frames are queued for `step`."""
        release_mlx_state_at_thread_exit()
        with self._lock:
            refused: dict[EngineSession, InputError] = {}
            accepted: list[tuple[EngineSession, np.ndarray]] = []
            for session, chunk, sample_rate in chunks:
                try:
                    accepted.append((session, session._accept(chunk, sample_rate)))
                except InputError as e:
                    refused[session] = e
            if not accepted:
                return refused
            for session, samples in accepted:
                session._count_input(samples)
            with mx.stream(self.chat._timeline_stream):
                perceived, together = push_perception([s.perception for s, _ in accepted], [x for _, x in accepted],
                                                      rows=bucket)
                heard = [i for i, (projected, _) in enumerate(perceived) if projected.shape[1]]
                tables = dict(zip(heard, push_transcripts([accepted[i][0].transcript for i in heard],
                                                          [perceived[i][1] for i in heard])))
            self.perceived_together += together
            pending = []
            for i, ((session, _), (projected, encoded)) in enumerate(zip(accepted, perceived)):
                pending += session._queue_frames(projected, encoded, table=tables.get(i))
            with mx.stream(self.chat._timeline_stream):
                mx.async_eval(pending)
            return refused

    def warm_batches(self, sessions: int | None = None) -> int:
        """Trace, on this thread, the streamed encoder's compiled chunk for every batch `feed_many`
        can make of 2 up to `sessions` (default `max_sessions`) sessions: silence through fresh
        streams, a chunk each, one batch a bucket (`bucket`: the batch sizes perception runs as);
        the LLM's step for each group size its rows take (2 and 4 rows: `LMGroups`), on rows of
        their own; and, while no session is open, the TTS rows' step for each bucket (on empty
        rows, none active). A round that first meets a bucket then replays its graph instead of
        tracing it (and, on a first run, compiling its kernels) while every session waits. Returns
        the perception buckets traced."""
        release_mlx_state_at_thread_exit()
        count = self.max_sessions if sessions is None else sessions
        sizes = sorted({bucket(n) for n in range(2, count + 1)})
        chunk = np.zeros(self.chat.config.input_samples_per_frame, np.float32)
        with self._lock:
            self.chat._stream_in_float32()  # (as a live session does first: the weights it reads)
            perception = self.chat.listening.perception
            with mx.stream(self.chat._timeline_stream):
                for size in sizes:
                    streams = [PerceptionStream(perception) for _ in range(size)]
                    out, _ = push_perception(streams, [chunk] * size, rows=bucket)
                    mx.eval(out, [s.state for s in streams])
                for rows in sorted({min(size, MAX_KERNEL_ROWS) for size in sizes}):
                    lm = LMRows(self.chat.listening, rows, self.chat.config.pad_token_id)
                    mx.eval(lm.step(mx.zeros((rows, 1, self._audio_width), mx.float32), np.ones(rows, bool)))
                if self.open_sessions == 0:
                    for size in sizes:
                        self.tts.resize(size)
                        mx.eval(self.tts.step(mx.zeros(size, mx.int32), np.zeros(size, bool), self._silence))
                    self.tts.resize(0)
        return len(sizes)

    def run(self) -> None:
        """Step until no session has input queued."""
        while self.step():
            pass

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        """Close every session and let the model go."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # (no slot moves while the sessions close)
            for s in list(self.sessions):
                if s is not None:
                    s.close()
            self.chat._end_turn(self._turn)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_and_deliver(queued: list[tuple["EngineSession", tuple]]) -> tuple[float, dict]:
    """Each session's queued frame (`LiveSession._queue_codec`'s) read back, all of them before any
    is delivered (a session that ends frees its slot); returns when they were read back, and when
    each session's frame was delivered."""
    frames = [(s, s._read_frame(*lazy)) for s, lazy in queued]
    read = time.perf_counter()
    delivered = {}
    for s, (text_id, function_id, codes, audio) in frames:
        s._deliver(text_id, function_id, codes, audio)
        delivered[s] = time.perf_counter()
    return read, delivered


class _TranscriptRows:
    """A chunk's transcript table `[frames, max_symbols]`: queued on its CPU stream with the chunk's
    perception, read back at its first frame's delivery, so that the transcript loops of a round's
    chunks run while the ticks use the GPU instead of before them."""

    def __init__(self, table: mx.array):
        self._table: mx.array | None = table
        self._rows: np.ndarray | None = None

    def row(self, i: int) -> np.ndarray:
        if self._rows is None:
            self._rows, self._table = np.array(self._table), None
        return self._rows[i]


class EngineSession(LiveSession):
    """A `LiveSession` stepped by an `Engine`: `push`, `finish`, `result`, `close` as there (`push`
    and `finish` step the engine until this session's input is used up, stepping the others'
    queued input in the same batches). For a server's loop, `feed` and `feed_end` only queue the
    input (and check it: `InputError` changes nothing), `Engine.step` runs the frames, and
    `collect` returns this session's frames so far."""

    def __init__(self, engine: Engine, slot: int, system_prompt, seed, keep_audio, keep_input_audio):
        # The system prompt and the TTS warmup run alone, as in `chat.live`: the state is in `self.loop`
        # (a session alone steps on it) until `_join` moves it into the batched rows.
        super().__init__(engine.chat, object(), system_prompt, seed, keep_audio, keep_input_audio)
        self._lock = engine._lock
        self.engine, self.slot = engine, slot
        self._queue: collections.deque = collections.deque()  # [audio frame [1, 1, H], (transcript, row), last]
        self._outbox: list[Frame] = []
        self._overflow = False  # input arrived past the context: ContextFull once its frames are out

    def _join(self) -> None:
        """The session's LLM and TTS state goes from its loop into its slot's rows."""
        loop, engine = self.loop, self.engine
        with mx.stream(self.chat._timeline_stream):
            engine.lm.insert(self.slot, loop.cache, loop.position, loop.prev_text, loop.prev_function)
            engine.tts.insert(self.slot, loop.tts_cache, loop.tts_cache.offset, loop.previous_code, loop.key)
        loop.cache = loop.tts_cache = None  # the slot's rows hold the state now

    def _leave_rows(self) -> None:
        """The session's state goes from its slot's rows back into its loop (it steps alone)."""
        engine, loop = self.engine, self.loop
        loop.resume(*engine.lm.take(self.slot), *engine.tts.take(self.slot))

    # ------------------------------------------------------------------ API

    def feed(self, chunk, sample_rate: int = 16000) -> None:
        """Take a chunk (as `push`) and queue its frames for `Engine.step`."""
        LiveSession.push(self, chunk, sample_rate)

    def feed_end(self, extra_decoding_seconds: float | None = None) -> None:
        """End the input (as `finish`); the last frames are queued for `Engine.step`."""
        args = () if extra_decoding_seconds is None else (extra_decoding_seconds,)
        LiveSession.finish(self, *args)

    def push(self, chunk, sample_rate: int = 16000) -> list[Frame]:
        with self._lock:
            self.feed(chunk, sample_rate)
            return self._drain()

    def finish(self, extra_decoding_seconds: float | None = None) -> list[Frame]:
        with self._lock:
            self.feed_end(extra_decoding_seconds)
            return self._drain()

    def collect(self) -> list[Frame]:
        """The frames made since the last call. Once input past the model's context has been fed,
        raises `ContextFull` (its `frames`: these frames) after the last frame that fits."""
        with self._lock:
            frames, self._outbox = self._outbox, []
            if self._overflow and self._context_full:
                self._overflow = False
                raise ContextFull(self._full_message(), frames, self.limit)
            return frames

    @property
    def queued(self) -> int:
        """Frames waiting for a tick."""
        return len(self._queue)

    @property
    def ended(self) -> bool:
        """The timeline is over (`finish` done, or the context full): `result()` may be read."""
        return self._ended

    def held_bytes(self) -> dict[str, int]:
        """As `LiveSession.held_bytes`; in a batch, the LLM's and TTS's caches counted as this
        session's share of the engine's rows (rows are as long as the longest session's)."""
        with self._lock:
            engine = self.engine
            if self.loop.cache is not None:  # (stepping alone: its own caches)
                return LiveSession.held_bytes(self)
            share = lambda arrays, rows: sum(int(a.nbytes) for a in arrays) // max(rows, 1)  # noqa: E731
            return {
                "llm_cache": share(engine.lm.state, engine.slots),
                "tts_cache": share(engine.tts.buffers, engine.slots),
                "encoder_cache": self.perception.state_nbytes,
                "ids_and_codes": self._codes.values.nbytes + 8 * (len(self._text_ids) + len(self._function_ids)
                                                                  + len(self._transcript_ids)),
                "output_audio": sum(int(a.nbytes) for a in self._audio),
                "input_audio": sum(int(a.nbytes) for a in self._input),
            }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._queue.clear()
            super().close()
            self.engine._release(self)

    # ------------------------------------------------------------------ internals

    def _drain(self) -> list[Frame]:
        while self._queue:
            self.engine.step()
        return self.collect()

    def _take(self, samples: np.ndarray, end: bool, count_input: bool = True) -> list[Frame]:
        """16 kHz samples through perception and the transcript; the frames they complete queued."""
        with mx.stream(self.chat._timeline_stream):
            projected, encoded = self._perceive(samples, end, count_input)
            mx.async_eval(self._queue_frames(projected, encoded, end))
        return []

    def _queue_frames(self, projected: mx.array, encoded: mx.array, end: bool = False,
                      table: mx.array | None = None) -> list[mx.array]:
        """A chunk's perceived frames through the transcript (unless `table`, their transcript
        table, is given), queued for the ticks. Returns what the caller evaluates (`mx.async_eval`:
        queued, not waited for, so that the tick's steps are built while the device runs
        perception; a round's sessions in one call)."""
        pending = list(self.perception.state)
        with mx.stream(self.chat._timeline_stream):
            count = projected.shape[1]
            if count:
                table = self.transcript.push(encoded) if table is None else table
                rows = _TranscriptRows(table)
                room = self.limit - self.prompt_frames - self.frames - len(self._queue)
                for i in range(min(count, room)):
                    self._queue.append([projected[:, i : i + 1], (rows, i), False])
                pending += [table, *(entry[0] for entry in self._queue)]
                if count > room:
                    self._overflow = True
        if end:
            if self._queue:
                self._queue[-1][2] = True
            else:
                self._end()
        return pending

    def _deliver(self, text_id: int, function_id: int, codes: np.ndarray, audio: np.ndarray | None) -> None:
        """This session's frame of a tick (its samples decoded in the tick's codec batch, or here
        when `audio` is None): kept, handed to `collect`."""
        _, (table, row), last = self._queue.popleft()
        frame = self._emit(text_id, function_id, np.array(codes, np.int32).reshape(-1), table.row(row), audio)
        self._outbox.append(frame)
        if last:
            self._end(frame)
        elif self.prompt_frames + self.frames >= self.limit:  # the last frame the context holds
            self._context_full = True
            self._queue.clear()
            self._end(frame)

    def _end(self, last: Frame | None = None) -> None:
        if self._ended:
            return
        super()._end(last)
        self.engine._release(self)
