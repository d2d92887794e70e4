"""The subset of OpenAI's Realtime API (GA event names and shapes) that `vc-serve` speaks.

Client events: `session.update`, `input_audio_buffer.append`, `input_audio_buffer.commit`,
`output_audio_buffer.clear`, `response.cancel`. Server events: `session.created`,
`session.updated`, `input_audio_buffer.committed`,
`conversation.item.input_audio_transcription.delta` / `.completed` (the user's transcript),
`response.created`, `response.output_audio_transcript.delta` (or `response.output_text.delta` for a
text-only session: the assistant's text), `response.output_audio.delta` (base64 PCM16),
`response.function_call_arguments.delta` / `.done` (the function channel), `response.done`,
`output_audio_buffer.cleared` and `error`.

Extensions: the session's `seed` (the speech sampler's) and `extra_decoding_seconds` (silence
decoded after a commit), and the PCM rates 16000 in and 22050 (the model's own) out beside the
API's 24000.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..config import EXTRA_DECODING_SECONDS

INPUT_RATES = (16000, 24000)
OUTPUT_RATES = (24000, 22050)
FUNCTION_CALL_NAME = "function_channel"
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "output_audio_buffer.clear", "response.cancel")
MAX_EXTRA_DECODING_SECONDS = 60.0


class ProtocolError(ValueError):
    """A client event the server cannot use: sent back as an `error` event, the connection stays."""

    def __init__(self, message: str, code: str = "invalid_request_error", param: str | None = None,
                 event_id: str | None = None):
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id


_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{next(_ids):012d}"


@dataclass
class SessionConfig:
    """What `session.update` may set. `instructions` is the system prompt."""

    model: str
    instructions: str = ""
    input_rate: int = 24000
    output_rate: int = 24000
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    seed: int = 0
    extra_decoding_seconds: float = EXTRA_DECODING_SECONDS

    def to_event(self, session_id: str) -> dict:
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "instructions": self.instructions, "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": self.input_rate}, "turn_detection": None},
                "output": {"format": {"type": "audio/pcm", "rate": self.output_rate}},
            },
            "seed": self.seed, "extra_decoding_seconds": self.extra_decoding_seconds,
        }

    def update(self, session: object, audio_started: bool) -> None:
        """Applies a `session.update`'s `session` object (only the fields it names)."""
        if not isinstance(session, dict):
            raise ProtocolError("session.update needs a `session` object", param="session")
        if "instructions" in session:
            value = session["instructions"]
            if value is not None and not isinstance(value, str):
                raise ProtocolError("session.instructions must be a string", param="session.instructions")
            if audio_started and (value or "") != self.instructions:
                raise ProtocolError("instructions are the conversation's start: set them before the first audio",
                                    param="session.instructions")
            self.instructions = value or ""
        if "seed" in session:
            seed = session["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
                raise ProtocolError("session.seed must be an integer in [0, 2**64)", param="session.seed")
            if audio_started and seed != self.seed:
                raise ProtocolError("the seed is the conversation's start: set it before the first audio",
                                    param="session.seed")
            self.seed = seed
        if "extra_decoding_seconds" in session:
            secs = session["extra_decoding_seconds"]
            if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not math.isfinite(secs) \
                    or not 0 <= secs <= MAX_EXTRA_DECODING_SECONDS:
                raise ProtocolError(f"session.extra_decoding_seconds must be a number in [0, "
                                    f"{MAX_EXTRA_DECODING_SECONDS:g}]", param="session.extra_decoding_seconds")
            self.extra_decoding_seconds = float(secs)
        if "output_modalities" in session:
            modalities = session["output_modalities"]
            if modalities not in (["audio"], ["text"]):
                raise ProtocolError('session.output_modalities must be ["audio"] or ["text"]',
                                    param="session.output_modalities")
            self.output_modalities = list(modalities)
        audio = session.get("audio")
        if audio is not None:
            if not isinstance(audio, dict):
                raise ProtocolError("session.audio must be an object", param="session.audio")
            for name, rates in (("input", INPUT_RATES), ("output", OUTPUT_RATES)):
                rate = _format_rate(audio.get(name), name, rates)
                if rate is None:
                    continue
                if audio_started and rate != getattr(self, f"{name}_rate"):
                    raise ProtocolError(f"the {name} format cannot change once audio has arrived",
                                        param=f"session.audio.{name}.format")
                setattr(self, f"{name}_rate", rate)


def _format_rate(part: object, name: str, rates: tuple[int, ...]) -> int | None:
    if part is None:
        return None
    if not isinstance(part, dict):
        raise ProtocolError(f"session.audio.{name} must be an object", param=f"session.audio.{name}")
    fmt = part.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type", "audio/pcm") != "audio/pcm":
        raise ProtocolError(f"session.audio.{name}.format must be audio/pcm (PCM16 little-endian mono)",
                            param=f"session.audio.{name}.format")
    rate = fmt.get("rate", 24000)
    if rate not in rates or isinstance(rate, bool):
        raise ProtocolError(f"session.audio.{name}.format.rate must be one of {', '.join(map(str, rates))}, "
                            f"got {rate!r}", code="invalid_value", param=f"session.audio.{name}.format.rate")
    return int(rate)


def parse_client_event(text: str | bytes, max_bytes: int) -> dict:
    """A client message as an event dict with a known `type`; raises ProtocolError otherwise."""
    if len(text) > max_bytes:
        raise ProtocolError(f"message of {len(text)} bytes exceeds the limit of {max_bytes}", code="message_too_large")
    if isinstance(text, bytes):
        raise ProtocolError("binary messages are not part of the protocol: send JSON text events")
    try:
        event = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}", code="invalid_json") from None
    if not isinstance(event, dict):
        raise ProtocolError("an event must be a JSON object", code="invalid_json")
    event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
    kind = event.get("type")
    if kind not in CLIENT_EVENTS:
        raise ProtocolError(f"unknown event type {kind!r}; this server takes {', '.join(CLIENT_EVENTS)}",
                            code="unknown_event", param="type", event_id=event_id)
    return event


def decode_pcm16(audio: object, event_id: str | None) -> np.ndarray:
    """Base64 PCM16 little-endian mono -> int16 samples."""
    if not isinstance(audio, str):
        raise ProtocolError("input_audio_buffer.append needs `audio`, base64 PCM16", param="audio", event_id=event_id)
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("`audio` is not valid base64", code="invalid_base64", param="audio",
                            event_id=event_id) from None
    if len(raw) % 2:
        raise ProtocolError(f"`audio` has {len(raw)} bytes: PCM16 needs an even number", code="invalid_audio",
                            param="audio", event_id=event_id)
    return np.frombuffer(raw, dtype="<i2")


def encode_pcm16(samples: np.ndarray) -> str:
    """Float samples in [-1, 1] -> base64 PCM16 little-endian (clipped, rounded)."""
    return base64.b64encode(to_pcm16(samples).astype("<i2").tobytes()).decode("ascii")


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32767.0), -32768, 32767).astype(np.int16)


def error_event(message: str, code: str = "invalid_request_error", param: str | None = None,
                event_id: str | None = None, kind: str = "invalid_request_error") -> dict:
    error = {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}
    return {"type": "error", "event_id": new_id("event"), "error": error}


def server_event(kind: str, **fields) -> dict:
    return {"type": kind, "event_id": new_id("event"), **fields}


def response_object(response_id: str, status: str, items: list[dict], output_rate: int,
                    modalities: list[str]) -> dict:
    return {"id": response_id, "object": "realtime.response", "status": status, "output": items,
            "output_modalities": list(modalities),
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": output_rate}}}}
