"""The TTS half of the frame loop, built on a host thread of its own.

On a GPU the frame loop is bound by the host: MLX spends ~15 us of host time a launch, and a frame
is ~155 LLM launches and ~255 TTS launches. Frame t's TTS step needs only frame t's text id, so
while the caller's thread builds the LLM chain, a worker builds the TTS chain, fed the text ids
(device arrays, never read back) through a queue. Same ids and codes as one thread.

MLX (>= 0.31.2) gives each thread its own default stream, and a lazy array made on one thread's
default stream cannot be evaluated from another ("There is no Stream(gpu, 0) in current thread").
So both halves run on streams made with `mx.new_thread_unsafe_stream` (the LLM's text ids cross
threads; the TTS's carried arrays are made by the caller and stepped by the worker), each stream
used by one thread at a time, and what the worker carries is evaluated before it starts and after it
ends. What a compiled step closes over must be evaluated (a lazy array there would be recomputed at
every call, on the stream of the thread that made it): `voicechat.load` evaluates everything.

On by default on a CUDA GPU, off elsewhere (`VoiceChat.tts_thread`; VOICECHAT_TTS_THREAD=0|1
overrides): on a CPU the two chains would share the same cores.

Two rules keep the threads apart, as MLX updates an array's status and event without a lock
whenever a graph reads it:
- `put()` schedules every text id on the caller's thread first and hands the worker an array of its
  own (`mx.contiguous`, no kernel), so no array is read by both threads; the system prompt's
  frames take an id made from host data, not a lazy op on the caller's stream.
- The caller never waits on an array the worker carries (the code it starts from included).

The worker is one `WorkerThread` a `VoiceChat` keeps (one job per generate): MLX 0.32's compile
cache is thread-local, and a new thread per call would trace the compiled TTS step again every call.
"""

from __future__ import annotations

import queue
import threading

import mlx.core as mx

from .tts.backbone import BackboneCache

_DONE = object()  # the end of the text ids


class _ThreadStateRelease:
    """Held in a `threading.local`: CPython drops it with the rest of its thread's Python state,
    on that thread, holding the GIL, before `join()` returns, so `__del__` runs there while the
    interpreter is still whole."""

    def __del__(self):
        mx.clear_streams()


_thread_state = threading.local()


def release_mlx_state_at_thread_exit() -> None:
    """Make the calling thread free what MLX keeps for it (its compile cache and its streams)
    when it ends. Called by every voicechat entry point that runs MLX work.

    MLX 0.32.4 keeps a compile cache per thread (a `thread_local` shared_ptr): its entries hold
    the Python callables that were compiled (mlx.nn's activations, our compiled LLM and TTS
    steps). Left alone, it is destroyed by the C++ thread-local destructors after Python has let
    go of the thread; its Python objects then take the GIL, and if the interpreter is finalizing
    by then (the main thread reached exit after `join()`), CPython ends the thread inside that
    destructor: `terminate called without an active exception`, rc 134, at random. Clearing the
    thread's streams (`mx.clear_streams()`, which also clears its compile cache) at the end of the
    thread's Python life frees them while it is safe. Not on the main thread: there it would also
    drop the streams every thread shares (`mx.new_thread_unsafe_stream`), and the main thread's
    cache is freed at exit without this race."""
    if threading.current_thread() is threading.main_thread():
        return
    if getattr(_thread_state, "release", None) is None:
        _thread_state.release = _ThreadStateRelease()


class WorkerThread:
    """One host thread that runs jobs one after another, kept for a `VoiceChat`'s life.

    MLX 0.32's compile cache is thread-local: with a new thread for every call, the compiled TTS
    step would be traced again at every call. `close()` ends the thread once its jobs are done, after
    `mx.clear_streams()` on it, which frees its compile cache while the interpreter is whole (see
    `release_mlx_state_at_thread_exit`)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # jobs submitted and not yet returned
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="voicechat-tts", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Jobs submitted that have not returned yet."""
        with self._lock:
            return self._pending

    def submit(self, job) -> threading.Event:
        """Runs `job()` (which handles its own errors) after the jobs before it; the event is set
        when it has returned."""
        done = threading.Event()
        with self._lock:
            self._pending += 1
        self._jobs.put((job, done))
        return done

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _serve(self) -> None:
        try:
            while (item := self._jobs.get()) is not None:
                job, done = item
                try:
                    job()
                finally:
                    with self._lock:
                        self._pending -= 1
                    done.set()
        finally:
            mx.clear_streams()


class TTSThread:
    """Steps `tts` once per text id given to `put`, on a worker thread, on `stream`.

    `start()` takes the carried state (the warmed-up cache, the previous code and the key), `put()`
    each frame's text id, `finish()` waits for the worker and returns the codes of every frame (and
    the host syncs it made); an error in the worker is raised there, or by the next `put()`, after
    which the caller must `abort()`. `abort()` stops a worker whose codes are no longer wanted (the
    caller's loop failed) without stepping the ids still queued. `worker`: the thread to step on (a
    `WorkerThread` the caller keeps, as `VoiceChat` does)."""

    def __init__(self, tts, stream: mx.Stream, silence: mx.array, sync_every: int, worker: WorkerThread):
        self.tts, self.stream, self.silence, self.sync_every = tts, stream, silence, sync_every
        self._ids: queue.SimpleQueue = queue.SimpleQueue()
        self._codes: list[mx.array] = []
        self._error: BaseException | None = None
        self._worker = worker
        self._done: threading.Event | None = None  # set when the job has returned
        self._aborted = False
        self.syncs = 0

    def start(self, previous_code: mx.array, cache: BackboneCache, key: mx.array) -> None:
        # made on the caller's thread: settled, so that the worker's graphs hold no pending work of it
        mx.eval(previous_code, key, cache.state)
        self.syncs += 1
        self._done = self._worker.submit(lambda: self._run(previous_code, cache, key))

    def put(self, text_id: mx.array) -> None:
        if self._error is not None:  # the worker failed: stop the caller's loop now
            raise self._error
        # The worker gets an array of its own, scheduled here, on the caller's thread and stream.
        # Own: MLX updates an array's status and event whenever a graph reads it (is_available,
        # detach_event: plain stores, no lock), and the caller reads its id again (the next LLM
        # step's input, its syncs), so one array shared by both threads is a data race (crashes,
        # or a cross-stream wait skipped: one seed, two answers). Scheduled: an id still lazy would
        # be encoded by the worker's eval into the caller's stream while the caller encodes there
        # too. A contiguous input makes `mx.contiguous` a view: no kernel.
        handoff = mx.contiguous(text_id)
        mx.async_eval(handoff)
        self._ids.put(handoff)

    def finish(self) -> tuple[list[mx.array], int]:
        """The codes `[1, 1, Q]` of every frame put, evaluated, and the worker's host syncs."""
        self._join()
        if self._error is not None:
            raise self._error
        return self._codes, self.syncs

    def abort(self) -> None:
        self._aborted = True
        self._join()

    def _join(self) -> None:
        if self._done is not None:
            self._ids.put(_DONE)
            self._done.wait()
            self._done = None

    def _run(self, previous_code: mx.array, cache: BackboneCache, key: mx.array) -> None:
        text_id = None
        try:
            with mx.stream(self.stream):
                frames = 0
                while (text_id := self._ids.get()) is not _DONE:
                    if self._aborted:
                        return
                    previous_code, key = self.tts.step(previous_code, text_id, cache, key, self.silence)
                    frames += 1
                    self._codes.append(previous_code)
                    mx.async_eval(previous_code, key)
                    if frames % self.sync_every == 0:  # bound what is in flight
                        mx.eval(previous_code)
                        self.syncs += 1
                # settled here: the caller reads the codes and drops the cache on its own thread
                mx.eval(self._codes, key, cache.state)
                self.syncs += 1
        except BaseException as e:  # raised again by finish(), on the caller's thread
            self._error = e
            if text_id is not _DONE:
                while self._ids.get() is not _DONE:  # let the caller's loop run to its end
                    pass
