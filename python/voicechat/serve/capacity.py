"""How many live sessions this machine steps in real time: `vc-serve`'s default `--max-sessions`.

Rounds of live sessions of silence run here first, as the server steps them and on the thread that
steps them (`FrameScheduler.call`; `Engine.feed_many`, then one tick): with one session and with
two, each past a warm-up that meets and traces every shape of the live path. The 95th percentiles
give a round's fixed cost and each session's share (sessions share work, so a round is not simply
the sessions' single frames added up: their perception runs as one batch, their LLM steps as
batched rows, and their TTS and codec back to back or as batched rows), and that line's estimate
is the most whose round fits an 80 ms frame with `HEADROOM_MS` to spare.

The estimate is then checked: that many new sessions run together from their first frame, and the
95th percentile of all their rounds must fit too (clients that arrive together meet exactly that:
their first rounds, the first frames' work of every session at once). A count that misses is
re-estimated from what it measured, lower, and checked again; `sessions` is the first that fits
(at least 1). The run also compiles and traces the live path, on the thread that steps the
sessions, before the first client comes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

FRAME_MS = 80.0
HEADROOM_MS = 20.0
WARMUP_FRAMES = 15  # every live shape met and traced (the encoder's chunks have one shape from the first)
MEASURED_FRAMES = 25
MEASURED_SESSIONS = (1, 2)


@dataclass
class Capacity:
    frame_ms_p95: float  # a round of one session (its live frame), 95th percentile of the measured rounds
    session_ms: float  # what each further session adds to a round (from the rounds of one and two)
    sessions: int  # the sessions whose round fits one 80 ms frame with the headroom
    round_ms_p95: float  # `sessions` new sessions' rounds from their first frame, 95th percentile


MEMORY_FRACTION = 0.9  # `vc-serve`'s default memory limit: this much of the device's memory


def device_memory() -> int | None:
    """The default device's memory in bytes: a GPU's own (MLX's device_info), else the machine's RAM."""
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        info = mx.device_info()
        size = info.get("total_memory") or info.get("memory_size")
        return int(size) if size else None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # (a platform without these names)
        return None


def memory_limit(gb: float | None, share: float = 1.0) -> int | None:
    """A server's memory limit in bytes: `gb` where given, else `MEMORY_FRACTION` of `share` of the
    device's memory (None where that is unknown: no limit)."""
    if gb is not None:
        return int(gb * 1e9)
    total = device_memory()
    return None if total is None else int(MEMORY_FRACTION * total * share)


def sessions_for(session_ms: float, fixed_ms: float = 0.0, most: int = 1024) -> int:
    """The most sessions whose round, `fixed_ms + sessions * session_ms`, fits one 80 ms frame with
    `HEADROOM_MS` to spare: 1 to `most`."""
    budget = FRAME_MS - HEADROOM_MS - max(fixed_ms, 0.0)
    if session_ms <= 0:
        return most if budget > 0 else 1
    return max(1, min(most, int(budget // session_ms)))


def verified_sessions(estimate: int, fixed_ms: float, round_p95: Callable[[int], float]) -> tuple[int, float | None]:
    """The most sessions, from `estimate` down, whose measured round (`round_p95(n)`) fits one 80 ms
    frame with `HEADROOM_MS` to spare, and that round; a count that misses is re-estimated from its
    own measurement (`fixed_ms` plus its per-session share), below the last. One session is always
    admitted, unmeasured here (None)."""
    n = estimate
    while n > 1:
        p95 = round_p95(n)
        if p95 + HEADROOM_MS <= FRAME_MS:
            return n, p95
        n = min(n - 1, sessions_for((p95 - fixed_ms) / n, fixed_ms))
    return 1, None


def round_ms(engine, sessions: int, *, from_start: bool = False, over_ms: float | None = None) -> float:
    """The 95th percentile of rounds (a chunk fed to every session, one tick) of `sessions` live
    sessions of silence on `engine` (a `voicechat.Engine`: opened here, beside any it holds and
    past its session limit, and closed after), after the warmup; `from_start`: of every round, from
    the sessions' first frame. With `over_ms`, the run stops as soon as more than 5% of its rounds
    have taken longer (its 95th percentile is then past `over_ms` whatever the rest would take) and
    gives the percentile of the rounds so far. Run it on the thread that steps the engine's
    sessions (`FrameScheduler.call`): what MLX keeps per thread is then warm for them."""
    c = engine.chat.config
    rate, chunk = c.input_sample_rate, np.zeros(c.input_samples_per_frame, np.float32)
    rounds = WARMUP_FRAMES + MEASURED_FRAMES
    first = 0 if from_start else WARMUP_FRAMES
    times = []
    limit, lives = engine.max_sessions, []
    engine.max_sessions = max(limit, engine.open_sessions + sessions)
    try:
        lives = [engine.live() for _ in range(sessions)]
        for _ in range(rounds):
            start = time.perf_counter()
            engine.feed_many([(live, chunk, rate) for live in lives])
            engine.step()
            for live in lives:
                live.collect()
            times.append((time.perf_counter() - start) * 1e3)
            if over_ms is not None and p95_past(times[first:], rounds - first, over_ms):
                break
    finally:
        for live in lives:
            live.close()
        engine.max_sessions = limit
    return float(np.percentile(np.array(times[first:]), 95))


def p95_past(times_ms: list[float], rounds: int, over_ms: float) -> bool:
    """Whether the 95th percentile of `rounds` rounds, of which `times_ms` are the first, is past
    `over_ms` whatever the others take: more than 5% of all of them already are."""
    return sum(t > over_ms for t in times_ms) > 0.05 * rounds


def measure(engine, say: Callable[[str], None] = lambda message: None) -> Capacity:
    """Run rounds of one and of two live sessions of silence on `engine` (as `round_ms`), then
    check the estimate they give (see the module docstring); the capacity found. `say` hears each
    check."""
    one, two = (round_ms(engine, n) for n in MEASURED_SESSIONS)
    # Each further session counts as at least 5% of a lone frame, however close the two rounds measure.
    session_ms = max(two - one, 0.05 * one)
    fixed_ms = one - session_ms
    estimate = sessions_for(session_ms, fixed_ms)

    def check(n: int) -> float:
        say(f"checking {n} sessions begun together ({WARMUP_FRAMES + MEASURED_FRAMES} frames of silence)")
        return round_ms(engine, n, from_start=True, over_ms=FRAME_MS - HEADROOM_MS)

    sessions, checked = verified_sessions(estimate, fixed_ms, check)
    return Capacity(frame_ms_p95=one, session_ms=session_ms, sessions=sessions,
                    round_ms_p95=one if checked is None else checked)
