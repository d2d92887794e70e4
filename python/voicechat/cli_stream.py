"""`vc-generate --stream`: the input through a live session, its text printed as it arrives.

Each channel's new text is written as soon as a frame brings it: the user's words on `[user] `
lines, the answer on lines of its own, the function channel on `[function] ` lines; a line ends when
another channel speaks. Without `--realtime` the input goes in 80 ms chunks at its own rate as fast
as the session takes them (the session resamples it), then `finish(--extra-decoding-seconds)`.
With `--realtime` it is resampled to 16 kHz first, then it and the silence to answer in are pushed
at wall-clock speed (as a 16 kHz microphone would), and a latency summary ends the run. Either
way the result equals `generate` on the same input (ids, codes, transcript; audio to float rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TextIO

import numpy as np

from .pacing import CHUNK_SECONDS, feed, speech_end

if TYPE_CHECKING:
    from .session import Result

_PREFIX = {"transcript": "[user] ", "text": "", "function_text": "[function] "}


class StreamPrinter:
    """Writes text deltas as they arrive, one line per run of a channel (see the module docstring).
    `clean`: what makes a delta fit for a terminal."""

    def __init__(self, out: TextIO | None, clean: Callable[[str], str]):
        self.out, self.clean = out, clean
        self.channel: str | None = None  # the channel of the open line

    def frames(self, frames) -> None:
        if self.out is None:
            return
        for frame in frames:
            for channel in ("transcript", "text", "function_text"):
                delta = getattr(frame, channel)
                if not delta:
                    continue
                if channel != self.channel:
                    if self.channel is not None:
                        self.out.write("\n")
                    self.out.write(_PREFIX[channel])
                    self.channel = channel
                    delta = delta.lstrip()  # (the channel's text goes on; its line starts clean)
                self.out.write(self.clean(delta))
        self.out.flush()

    def close(self) -> None:
        if self.out is not None and self.channel is not None:
            self.out.write("\n")
            self.out.flush()


def run_stream(chat, audio, args, lines: TextIO | None, clean: Callable[[str], str],
               say: Callable) -> Result:
    """The live session of `vc-generate --stream` (and `--realtime`) on an opened input
    (`audio.AudioInput`); returns its `result()`."""
    from .audio import load_audio

    data, native = audio.read(), audio.rate
    printer = StreamPrinter(lines, clean)
    with chat.live(system_prompt=args.system_prompt, seed=args.seed) as live:
        try:
            if args.realtime:
                wave = load_audio(data, chat.config.input_sample_rate, native)
                silence = np.zeros(int(round(args.extra_decoding_seconds * chat.config.input_sample_rate)), np.float32)
                log = feed(live, np.concatenate([wave, silence]), realtime=True, on_frames=printer.frames)
                summary = log.summary(speech_end(wave, chat.config.input_sample_rate))
            else:
                size = max(1, int(round(CHUNK_SECONDS * native)))
                for pos in range(0, len(data), size):
                    printer.frames(live.push(data[pos : pos + size], sample_rate=native))
                printer.frames(live.finish(args.extra_decoding_seconds))
                summary = None
        finally:
            printer.close()
        result = live.result()
    if summary is not None:
        say(_latency_line(summary))
    return result


def _latency_line(s: dict) -> str:
    line = (f"latency over {s['frames']} frames (chunk arrival -> frame audio): p50 {s.get('p50_ms', 0):.1f} ms, "
            f"p95 {s.get('p95_ms', 0):.1f} ms, p99 {s.get('p99_ms', 0):.1f} ms, max {s.get('max_ms', 0):.1f} ms; "
            f"{s.get('late', 0)} late (returned after the next chunk's arrival)")
    if "first_voice_after_speech_ms" in s:
        line += (f"; first answer audio {s['first_voice_after_speech_ms']:.0f} ms after the user stopped speaking "
                 f"({s['first_voice_frame_delay_ms']:.0f} ms of it on the timeline)")
    elif "speech_end_s" in s:
        line += "; no non-silent answer audio after the user stopped speaking"
    return line

