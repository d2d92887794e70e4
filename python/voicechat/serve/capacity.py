"""How many live sessions this machine steps in real time: `vc-serve`'s default `--max-sessions`.

A live session of silence runs here first. Its frames past the encoder's full attention cache, the
live path's steady state, give the frame time. Sessions step in turn, so `sessions` is how many of
those frames fit in an 80 ms frame with `HEADROOM_MS` to spare (at least 1). The run also compiles
and traces the live path before the first client comes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

FRAME_MS = 80.0
HEADROOM_MS = 20.0
WARMUP_FRAMES = 75  # past the encoder's 70-frame cache: its compiled chunk is traced by then
MEASURED_FRAMES = 25


@dataclass
class Capacity:
    frame_ms_p95: float  # a live frame's time here, 95th percentile of the measured frames
    sessions: int  # the sessions in turn whose frames fit one 80 ms frame with the headroom


def sessions_for(frame_ms: float, most: int = 1024) -> int:
    """Frames of `frame_ms` that fit one 80 ms frame with `HEADROOM_MS` to spare: 1 to `most`."""
    return max(1, min(most, int((FRAME_MS - HEADROOM_MS) // frame_ms) if frame_ms > 0 else most))


def measure(chat) -> Capacity:
    """Run a live session of silence on `chat` and return the capacity it shows."""
    chunk = np.zeros(chat.config.input_sample_rate * int(FRAME_MS) // 1000, np.float32)
    times = []
    with chat.live() as live:
        for _ in range(WARMUP_FRAMES + MEASURED_FRAMES):
            start = time.perf_counter()
            live.push(chunk)
            times.append((time.perf_counter() - start) * 1e3)
        live.finish(0.0)
    measured = np.array(times[WARMUP_FRAMES:])
    p95 = float(np.percentile(measured, 95))
    return Capacity(frame_ms_p95=p95, sessions=sessions_for(p95))
