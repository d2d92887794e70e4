"""Feeding a live session like a microphone, and what its latency was.

`feed(live, samples)` pushes 16 kHz samples in 80 ms chunks, at wall-clock speed (`realtime`: each
chunk is pushed when its last sample would have been spoken) or as fast as possible, and records
per frame when the chunk that completed it arrived and when `push` returned it. `LatencyLog.summary`
reports the latency from arrival to return (p50, p95, max), the frames that came back late (after
the next chunk's arrival: one frame duration after their own, so a session that keeps up has none),
and, given where the user stopped speaking, how long until the first non-silent answer audio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

CHUNK_SECONDS = 0.08
SILENCE_RMS = 0.01  # a frame of audio (or 10 ms of input) quieter than this is silence


@dataclass
class LatencyLog:
    """Per frame: its timeline index, when its chunk arrived, when it was returned, its audio's RMS."""

    chunk_seconds: float = CHUNK_SECONDS
    index: list[int] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    returned: list[float] = field(default_factory=list)
    rms: list[float] = field(default_factory=list)
    start: float = 0.0  # when the first sample was (as if) spoken
    realtime: bool = False  # the input was paced at wall-clock speed

    def add(self, frames, arrived: float, returned: float) -> None:
        for frame in frames:
            self.index.append(frame.index)
            self.arrived.append(arrived)
            self.returned.append(returned)
            audio = np.asarray(frame.audio, dtype=np.float64)
            self.rms.append(float(np.sqrt(np.mean(audio * audio))) if audio.size else 0.0)

    def summary(self, speech_end_s: float | None = None, silence_rms: float = SILENCE_RMS) -> dict:
        """Latencies in ms; `late`: frames returned more than one chunk after their chunk arrived;
        `first_voice_after_speech_ms` (paced input only): from the moment the user stopped speaking
        (`speech_end_s` into the input) to the return of the first frame at or after it whose audio
        is not silent (wall clock), and `first_voice_frame_delay_ms` the same on the timeline (what
        the model waited, in frames, whatever the speed)."""
        latency = (np.array(self.returned) - np.array(self.arrived)) * 1000.0
        out = {"frames": len(latency)}
        if len(latency):
            out.update(p50_ms=float(np.percentile(latency, 50)), p95_ms=float(np.percentile(latency, 95)),
                       p99_ms=float(np.percentile(latency, 99)), max_ms=float(latency.max()),
                       late=int((latency > self.chunk_seconds * 1000.0).sum()))
        if speech_end_s is not None:
            first = next((i for i, (idx, rms) in enumerate(zip(self.index, self.rms))
                          if (idx + 1) * self.chunk_seconds > speech_end_s and rms > silence_rms), None)
            out["speech_end_s"] = speech_end_s
            if first is not None:
                if self.realtime:
                    out["first_voice_after_speech_ms"] = (self.returned[first] - (self.start + speech_end_s)) * 1000.0
                out["first_voice_frame_delay_ms"] = ((self.index[first] + 1) * self.chunk_seconds - speech_end_s) * 1000.0
        return out


def speech_end(samples: np.ndarray, rate: int = 16000, silence_rms: float = SILENCE_RMS) -> float:
    """Seconds into `samples` where the last 10 ms louder than `silence_rms` ends (0: all silence)."""
    hop = rate // 100
    n = len(samples) // hop
    if n == 0:
        return 0.0
    blocks = np.asarray(samples[: n * hop], dtype=np.float64).reshape(n, hop)
    loud = np.nonzero(np.sqrt((blocks * blocks).mean(axis=1)) > silence_rms)[0]
    return float((loud[-1] + 1) * hop / rate) if loud.size else 0.0


def feed(live, samples: np.ndarray, realtime: bool, on_frames: Callable | None = None,
         chunk_seconds: float = CHUNK_SECONDS, rate: int = 16000) -> LatencyLog:
    """Push `samples` (16 kHz mono, the silence to answer in included) in chunks, then `finish(0)`;
    `on_frames(frames)` after each call. Returns the log (`finish`'s frames are not in it: they
    arrive with the end of the input, not with a chunk)."""
    log = LatencyLog(chunk_seconds, realtime=realtime)
    size = max(1, int(round(chunk_seconds * rate)))
    log.start = time.perf_counter()
    for pos in range(0, len(samples), size):
        chunk = samples[pos : pos + size]
        due = log.start + (pos + len(chunk)) / rate  # its last sample has been spoken
        if realtime:
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        arrived = time.perf_counter()
        frames = live.push(chunk, sample_rate=rate)
        log.add(frames, arrived, time.perf_counter())
        if on_frames is not None:
            on_frames(frames)
    frames = live.finish(extra_decoding_seconds=0.0)
    if on_frames is not None:
        on_frames(frames)
    return log
