"""One thread that runs every live session's model work: all sessions' frames in one batch a round.

MLX's streams are used by one thread at a time, so every session's input, step and close runs on
this thread, through one `voicechat.engine.Engine`. Audio is queued in pieces of one 80 ms frame:
each round feeds one piece from each session that has work (`Engine.feed_many`: their perception
as one batch), then one engine tick steps every
session with a complete frame together (one batched frame), then each session's frames go out. A
client that sends a minute of audio at once is stepped a frame a round like the others.

A tick costs about the same for one session as for all of them (the batch's weights are read once
either way), so a round waits for the pieces of the sessions that are streaming (a piece in the
last two frames, input not ended) while the oldest waiting piece can still make its frame in real
time: until one frame after it arrived, less the longest of the recent rounds' batched work (feed,
tick, hand-out; a session's start is not counted). Clients whose pieces arrive a few milliseconds
apart then share one tick instead of taking one each.

A conversation's caches grow with its length (docs/live.md: up to 0.4 GB a minute at full size),
so with `memory_limit` set, the memory in use is checked after every round: past the limit, the
conversation holding the most ends with `MemoryFull` (its state is freed at once; its client may
start another), and no new one starts while the memory stays past it. One long conversation then
never takes the memory the others need.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from ..engine import Engine, EngineFull
from ..live import ContextFull
from ..session import InputError

FRAME_SECONDS = 0.08


class MemoryFull(InputError):
    """The server's memory limit was reached: the conversation holding the most has ended, or a new
    one cannot start yet."""

    code = "session_memory_full"


class SessionLost(RuntimeError):
    """The model behind a connection is gone (a Ray replica that died): the connection ends."""


class NoCapacity(RuntimeError):
    """No model has room for another session: the client is told to try again later."""


@dataclass
class Work:
    kind: str  # "push", "finish" or "close"
    samples: np.ndarray | None = None
    sample_rate: int = 0
    seconds: float = 0.0
    arrived: float = 0.0  # time.monotonic() when it was queued


class SessionHandle:
    """A live session as the scheduler runs it. `on_frames(frames, finished)` and
    `on_error(exc, fatal)` are called on the scheduler's thread."""

    def __init__(self, scheduler: "FrameScheduler", system_prompt: str | None, seed: int,
                 on_frames: Callable[[list, bool], None], on_error: Callable[[BaseException, bool], None]):
        self.scheduler = scheduler
        self.system_prompt, self.seed = system_prompt, seed
        self.on_frames, self.on_error = on_frames, on_error
        self.work: collections.deque[Work] = collections.deque()
        self.live = None  # the EngineSession, made on the scheduler's thread at its first work
        self.closed = False
        self.finishing = False  # its input has ended: the last frames are on their way
        self.last_push = float("-inf")  # time.monotonic() of its last piece

    def push(self, samples: np.ndarray, sample_rate: int) -> None:
        piece = max(1, int(round(FRAME_SECONDS * sample_rate)))
        with self.scheduler.lock:
            self.last_push = time.monotonic()
            for start in range(0, len(samples), piece):
                self.work.append(Work("push", samples[start : start + piece], sample_rate, arrived=self.last_push))
            self.scheduler.wake.notify()

    def streaming(self, now: float) -> bool:
        """Its client is sending audio: a piece in the last two frames, its input not ended."""
        return not self.closed and not self.finishing and now - self.last_push < 2 * FRAME_SECONDS

    def finish(self, seconds: float) -> None:
        with self.scheduler.lock:
            self.work.append(Work("finish", seconds=seconds))
            self.scheduler.wake.notify()

    def close(self) -> None:
        """Drops the queued work and frees the session's state (on the scheduler's thread)."""
        with self.scheduler.lock:
            self.work.clear()
            self.work.append(Work("close"))
            self.closed = True
            self.scheduler.wake.notify()


class FrameScheduler:
    """Owns the model's thread of work for all sessions of one loaded `VoiceChat`
    (`max_sessions`: the most conversations the engine holds at once; `memory_limit`: bytes of
    MLX's active memory past which the largest conversation ends, None for none)."""

    def __init__(self, chat, max_sessions: int = 64, memory_limit: int | None = None):
        self.chat = chat
        self.memory_limit = memory_limit
        self.engine = Engine(chat, max_sessions=max_sessions)  # the model is the server's while it runs
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.sessions: list[SessionHandle] = []
        self._calls: collections.deque[tuple[Callable, concurrent.futures.Future]] = collections.deque()
        self._stopping = False
        self._round_seconds: collections.deque[float] = collections.deque(maxlen=16)  # the recent rounds' times
        self._thread = threading.Thread(target=self._run, name="voicechat-scheduler", daemon=True)
        self._thread.start()

    @contextlib.asynccontextmanager
    async def connect(self, on_lost: Callable[[BaseException], None]):
        """A connection's place on the model, for its life: `open` its conversations there. Here
        the model is in this process and cannot be lost, so the place is the scheduler itself."""
        yield self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> dict:
        return {"active_memory_bytes": mx.get_active_memory()}

    def call(self, job: Callable[[Engine], object]):
        """`job(engine)` run on the scheduler's thread between rounds; its result (or its error).
        What MLX keeps per thread (compiled graphs' traces, cuDNN plans, CUDA graphs) is then that
        thread's, where every session steps: a server's warm-up and capacity rounds run here
        (`serve.capacity`), so that its first clients do not trace again."""
        if threading.current_thread() is self._thread:  # (a job of its own: waiting would never end)
            return job(self.engine)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self._stopping:
                raise RuntimeError("the scheduler has stopped")
            self._calls.append((job, future))
            self.wake.notify()
        return future.result()

    def open(self, system_prompt: str | None, seed: int, on_frames, on_error) -> SessionHandle:
        handle = SessionHandle(self, system_prompt, seed, on_frames, on_error)
        with self.lock:
            self.sessions.append(handle)
        return handle

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            for handle in self.sessions:
                handle.work.clear()
                handle.work.append(Work("close"))
            for _, future in self._calls:
                future.set_exception(RuntimeError("the scheduler has stopped"))
            self._calls.clear()
            self.wake.notify()
        self._thread.join(timeout=30)
        self.engine.close()

    def _busy(self) -> bool:
        """Work queued, or frames waiting for a tick (called with the lock held)."""
        return bool(self._calls) or any(h.work or (h.live is not None and h.live.queued) for h in self.sessions)

    def _next_round(self) -> list[tuple[SessionHandle, Work]] | None:
        with self.lock:
            while not self._stopping and not self._busy():
                self.wake.wait()
            self._gather()
            if self._stopping and not any(h.work for h in self.sessions):
                return None
            return [(handle, handle.work.popleft()) for handle in self.sessions if handle.work]

    def _gather(self) -> None:
        """Wait (lock held) for the pieces of the streaming sessions that have none queued, while
        the oldest queued piece can still make its frame in real time (see the module docstring)."""
        while not self._stopping:
            until = self.gather_until(time.monotonic())
            if until is None:
                return
            self.wake.wait(until - time.monotonic())

    def gather_until(self, now: float) -> float | None:
        """When the next round should start at the latest if it waits for more pieces (lock held),
        or None to start it now: nothing to wait for (no streaming session lacks a piece, or a call
        is queued), or no time left."""
        if self._calls or not any(h.streaming(now) and not h.work for h in self.sessions):
            return None
        oldest = min((h.work[0].arrived for h in self.sessions if h.work), default=now)
        until = oldest + FRAME_SECONDS - max(self._round_seconds, default=0.0)
        return until if until > now else None

    def _run(self) -> None:
        while True:
            round_ = self._next_round()
            if round_ is None:
                return
            self._run_calls()
            self._round(round_)

    def _round(self, round_: list[tuple[SessionHandle, Work]]) -> None:
        """The round's other work (a session's start among it), then its pieces fed together, one
        tick and the frames handed out: the part whose time `gather_until` allows for."""
        pushes = []
        for handle, work in round_:
            if work.kind == "push" and handle.live is not None and not handle.closed:
                pushes.append((handle, work))  # perceived together below
            else:
                self._do(handle, work)
        started = time.monotonic()
        self._feed_and_step(pushes)
        self._round_seconds.append(time.monotonic() - started)

    def _feed_and_step(self, pushes: list[tuple[SessionHandle, Work]]) -> None:
        """The pieces of open sessions fed together, one engine tick, each session's frames out."""
        if pushes:
            self._feed(pushes)
        try:
            stepped = self.engine.step()
        except Exception as e:  # a bug: every stepping session ends, the server goes on
            traceback.print_exc()
            for handle in list(self.sessions):
                if handle.live is not None:
                    self._fail(handle, e)
            return
        if stepped:
            for handle in list(self.sessions):
                if handle.live is not None:
                    self._hand_out(handle)
        self._hold_memory()

    def _run_calls(self) -> None:
        while True:
            with self.lock:
                if not self._calls:
                    return
                job, future = self._calls.popleft()
            try:
                future.set_result(job(self.engine))
            except BaseException as e:  # (the caller gets it)
                future.set_exception(e)

    def _do(self, handle: SessionHandle, work: Work) -> None:
        if work.kind == "close":
            self._close(handle)
            return
        if handle.closed:
            return
        try:
            if handle.live is None:
                if self._memory_full():
                    self._drop(handle)
                    handle.on_error(MemoryFull(f"the server's memory is full ({_size(mx.get_active_memory())} in use, "
                                               f"limit {_size(self.memory_limit)}): no new conversation can start "
                                               f"now; try again later"), True)
                    return
                # The answer's samples go to the client as they come: none kept for result().
                handle.live = self.engine.live(system_prompt=handle.system_prompt or None, seed=handle.seed,
                                               keep_audio=False)
                handle.finishing = False
            if work.kind == "push":
                handle.live.feed(work.samples, sample_rate=work.sample_rate)
            else:
                handle.live.feed_end(work.seconds)
                handle.finishing = True
                if handle.live.ended:  # (no frame was left to make)
                    self._hand_out(handle)
        except InputError as e:
            self._refuse(handle, e)
        except EngineFull as e:  # (more conversations at once than the engine holds)
            handle.on_error(e, True)
        except Exception as e:  # a bug: this session ends, the others go on
            traceback.print_exc()
            self._fail(handle, e)

    def _memory_full(self) -> bool:
        return self.memory_limit is not None and mx.get_active_memory() > self.memory_limit

    def _hold_memory(self) -> None:
        """Past the memory limit, the conversation holding the most ends (one a round: its state is
        freed at once, and the next round checks again)."""
        if not self._memory_full():
            return
        open_ = [h for h in self.sessions if h.live is not None]
        if not open_:
            return
        largest = max(open_, key=lambda h: sum(h.live.held_bytes().values()))
        live = largest.live
        held = sum(live.held_bytes().values())
        self._fail(largest, MemoryFull(
            f"the server's memory is full ({_size(mx.get_active_memory())} in use, limit {_size(self.memory_limit)}): "
            f"this conversation, the largest ({_size(held)} after {live.frames} frames, "
            f"{live.frames * FRAME_SECONDS / 60:.1f} min), has ended; a new one may start"))

    def _feed(self, pushes: list[tuple[SessionHandle, Work]]) -> None:
        """The round's chunks of open sessions, their perception as one batch (`Engine.feed_many`);
        a refused chunk is its session's error, as in `_do`."""
        try:
            refused = self.engine.feed_many([(h.live, w.samples, w.sample_rate) for h, w in pushes])
        except Exception as e:  # a bug: these sessions end, the others go on
            traceback.print_exc()
            for handle, _ in pushes:
                self._fail(handle, e)
            return
        for handle, _ in pushes:
            error = refused.get(handle.live)
            if error is not None:
                self._refuse(handle, error)

    def _refuse(self, handle: SessionHandle, error: InputError) -> None:
        """A bad client event is its session's error; a full context also ends the session."""
        fatal = isinstance(error, ContextFull)
        handle.on_error(error, fatal)
        if fatal:
            self._end_live(handle)

    def _fail(self, handle: SessionHandle, error: Exception) -> None:
        """The session ends on `error` (a bug met on its work, or the memory limit); the others go on."""
        self._drop(handle)
        handle.on_error(error, True)
        self._end_live(handle)

    def _drop(self, handle: SessionHandle) -> None:
        """The handle takes no more work: what its client queued after the error that ends it would
        otherwise begin a new conversation before the client hears of the error."""
        with self.lock:
            handle.work.clear()
            handle.closed = True

    def _hand_out(self, handle: SessionHandle) -> None:
        """The session's frames of this round to its client; its end once finish's frames are out."""
        live = handle.live
        try:
            frames = live.collect()
        except ContextFull as e:
            if e.frames:
                handle.on_frames(e.frames, False)
            handle.on_error(e, True)
            self._end_live(handle)
            return
        if handle.finishing and live.ended:
            handle.on_frames(frames, True)
            self._end_live(handle)
        elif frames:
            handle.on_frames(frames, False)

    def _end_live(self, handle: SessionHandle) -> None:
        """The conversation is over: its state is freed; a later push starts a new one."""
        live, handle.live = handle.live, None
        if live is not None:
            live.close()

    def _close(self, handle: SessionHandle) -> None:
        self._end_live(handle)
        with self.lock:
            if handle in self.sessions:
                self.sessions.remove(handle)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
