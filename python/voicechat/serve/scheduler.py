"""One thread that runs every live session's model work, fairly, a frame at a time.

MLX's streams are used by one thread at a time and the loaded model steps one frame at a time,
so every session's `push`, `finish` and close runs on this thread. Audio is queued in pieces of
one 80 ms frame: each round takes one piece from each session that has work, so a client that
sends a minute of audio at once delays the others by at most a frame each round.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..live import ContextFull
from ..session import InputError

FRAME_SECONDS = 0.08


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


class SessionHandle:
    """A live session as the scheduler runs it. `on_frames(frames, finished)` and
    `on_error(exc, fatal)` are called on the scheduler's thread."""

    def __init__(self, scheduler: "FrameScheduler", system_prompt: str | None, seed: int,
                 on_frames: Callable[[list, bool], None], on_error: Callable[[BaseException, bool], None]):
        self.scheduler = scheduler
        self.system_prompt, self.seed = system_prompt, seed
        self.on_frames, self.on_error = on_frames, on_error
        self.work: collections.deque[Work] = collections.deque()
        self.live = None  # the LiveSession, made on the scheduler's thread at its first work
        self.closed = False

    def push(self, samples: np.ndarray, sample_rate: int) -> None:
        piece = max(1, int(round(FRAME_SECONDS * sample_rate)))
        with self.scheduler.lock:
            for start in range(0, len(samples), piece):
                self.work.append(Work("push", samples[start : start + piece], sample_rate))
            self.scheduler.wake.notify()

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
    """Owns the model's thread of work for all sessions of one loaded `VoiceChat`."""

    def __init__(self, chat):
        self.chat = chat
        self.host = chat.sessions()  # the model is the server's while it runs
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.sessions: list[SessionHandle] = []
        self._stopping = False
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
        import mlx.core as mx

        return {"active_memory_bytes": mx.get_active_memory()}

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
            self.wake.notify()
        self._thread.join(timeout=30)
        self.host.close()

    def _next_round(self) -> list[tuple[SessionHandle, Work]]:
        with self.lock:
            while not self._stopping and not any(h.work for h in self.sessions):
                self.wake.wait()
            if self._stopping and not any(h.work for h in self.sessions):
                return []
            round_ = []
            for handle in self.sessions:
                if handle.work:
                    round_.append((handle, handle.work.popleft()))
            return round_

    def _run(self) -> None:
        while True:
            round_ = self._next_round()
            if not round_:
                return
            for handle, work in round_:
                self._do(handle, work)

    def _do(self, handle: SessionHandle, work: Work) -> None:
        if work.kind == "close":
            self._close(handle)
            return
        if handle.closed:
            return
        try:
            if handle.live is None:
                # The answer's samples go to the client as they come: none kept for result().
                handle.live = self.host.live(system_prompt=handle.system_prompt or None, seed=handle.seed,
                                             keep_audio=False)
            if work.kind == "push":
                frames = handle.live.push(work.samples, sample_rate=work.sample_rate)
                handle.on_frames(frames, False)
            else:
                frames = handle.live.finish(extra_decoding_seconds=work.seconds)
                handle.on_frames(frames, True)
                self._end_live(handle)
        except InputError as e:
            fatal = isinstance(e, ContextFull)
            handle.on_error(e, fatal)
            if fatal:
                self._end_live(handle)
        except Exception as e:  # a bug: this session ends, the others go on
            traceback.print_exc()
            handle.on_error(e, True)
            self._end_live(handle)

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
