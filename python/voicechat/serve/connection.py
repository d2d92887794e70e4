"""One WebSocket client: its Realtime events in, the live session's frames out as events."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import soxr
from starlette.websockets import WebSocket, WebSocketDisconnect

from .protocol import (FUNCTION_CALL_NAME, ProtocolError, SessionConfig, decode_pcm16, encode_pcm16, error_event,
                       new_id, parse_client_event, response_object, server_event)
from .scheduler import FrameScheduler, SessionLost

CLOSE_INTERNAL_ERROR = 1011  # the model behind the session is gone


@dataclass
class Limits:
    """What one client may ask of the server."""

    max_message_bytes: int = 1 << 20  # a 1 MiB JSON event holds ~16 s of 24 kHz PCM16
    max_ahead_seconds: float = 30.0  # audio sent ahead of the wall clock, beyond which appends are refused
    idle_timeout_seconds: float = 120.0  # no client message for this long ends the connection


@dataclass
class _Response:
    """The assistant's output since the last `response.done`."""

    id: str = field(default_factory=lambda: new_id("resp"))
    message_id: str = field(default_factory=lambda: new_id("item"))
    call_id: str = field(default_factory=lambda: new_id("call"))
    function_item_id: str | None = None
    text: list[str] = field(default_factory=list)
    function_text: list[str] = field(default_factory=list)

    def message_part(self) -> dict:
        """Where the assistant message's one content part sits, as its events name it."""
        return dict(response_id=self.id, item_id=self.message_id, output_index=0, content_index=0)


class Connection:
    """Runs one client's conversation; every model call goes through the shared scheduler."""

    def __init__(self, ws: WebSocket, scheduler: FrameScheduler, model_name: str, limits: Limits):
        self.ws = ws
        self.scheduler = scheduler
        self.limits = limits
        self.config = SessionConfig(model=model_name)
        self.session_id = new_id("sess")
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.place = None  # where this connection's conversations run (`scheduler.connect`)
        self.handle = None
        self.started_at: float | None = None  # wall clock at the conversation's first audio
        self.received_seconds = 0.0
        self.committed = False
        self.user_item = new_id("item")
        self.transcript: list[str] = []
        self.response: _Response | None = None
        self.resampler = None  # 22.05 -> 24 kHz for the output, one stream a conversation
        self._sending = asyncio.Lock()  # the receive loop and the outbox both send

    # ------------------------------------------------------------------ scheduler callbacks (its thread)

    def _on_frames(self, frames: list, finished: bool) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, ("frames", frames, finished))

    def _on_error(self, exc: BaseException, fatal: bool) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, ("error", exc, fatal))

    # ------------------------------------------------------------------ the connection's life

    async def run(self) -> None:
        """Raises `NoCapacity` before `session.created` when no model has room for the session."""
        async with self.scheduler.connect(self._on_lost) as self.place:
            await self.send(server_event("session.created", session=self.config.to_event(self.session_id)))
            sender = asyncio.create_task(self._send_outbox())
            try:
                await self._receive_loop()
            finally:
                if self.handle is not None:
                    self.handle.close()
                sender.cancel()

    def _on_lost(self, exc: BaseException) -> None:
        self._on_error(exc, True)

    async def send(self, event: dict) -> None:
        async with self._sending:
            await self.ws.send_json(event)

    async def _receive_loop(self) -> None:
        while True:
            try:
                message = await asyncio.wait_for(self.ws.receive(), self.limits.idle_timeout_seconds)
            except asyncio.TimeoutError:
                if self.committed:  # waiting for its answer is not idling
                    continue
                await self.send(error_event(f"no event for {self.limits.idle_timeout_seconds:g} s: the session "
                                            "is closed", code="session_idle_timeout"))
                await self.ws.close(code=1000, reason="idle timeout")
                return
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text") if message.get("text") is not None else message.get("bytes", b"")
            try:
                await self._handle(parse_client_event(data, self.limits.max_message_bytes))
            except ProtocolError as e:
                await self.send(error_event(str(e), e.code, e.param, e.event_id))

    async def _handle(self, event: dict) -> None:
        kind, event_id = event["type"], event.get("event_id")
        if kind == "session.update":
            try:
                self.config.update(event.get("session"), audio_started=self.handle is not None)
            except ProtocolError as e:
                e.event_id = event_id
                raise
            await self.send(server_event("session.updated", session=self.config.to_event(self.session_id)))
        elif kind == "input_audio_buffer.append":
            self._append(decode_pcm16(event.get("audio"), event_id), event_id)
        elif kind == "input_audio_buffer.commit":
            if self.handle is None or self.committed:
                raise ProtocolError("nothing to commit: append audio first", code="input_audio_buffer_commit_empty",
                                    event_id=event_id)
            self.committed = True
            self.handle.finish(self.config.extra_decoding_seconds)
            await self.send(server_event("input_audio_buffer.committed", item_id=self.user_item,
                                         previous_item_id=None))
        elif kind == "output_audio_buffer.clear":
            await self.send(server_event("output_audio_buffer.cleared", response_id=self._response().id))
        elif kind == "response.cancel":
            # The client stops playing this response; the duplex model goes on listening, and what
            # it says next belongs to a new response.
            if self.response is not None:
                await self._response_done("cancelled")

    def _append(self, pcm: np.ndarray, event_id: str | None) -> None:
        if self.committed:
            raise ProtocolError("this conversation is committed: wait for response.done before sending more audio",
                                code="conversation_committed", event_id=event_id)
        now = time.monotonic()
        if self.started_at is None:
            self.started_at = now
        seconds = len(pcm) / self.config.input_rate
        ahead = self.received_seconds + seconds - (now - self.started_at)
        if ahead > self.limits.max_ahead_seconds:
            raise ProtocolError(f"audio is arriving faster than real time: {ahead:.1f} s ahead of the clock, over "
                                f"the limit of {self.limits.max_ahead_seconds:g} s; this append is dropped",
                                code="input_audio_buffer_overflow", event_id=event_id)
        self.received_seconds += seconds
        if self.handle is None:
            self.handle = self.place.open(self.config.instructions or None, self.config.seed,
                                              self._on_frames, self._on_error)
        self.handle.push(pcm, self.config.input_rate)

    # ------------------------------------------------------------------ frames -> events

    def _response(self) -> _Response:
        if self.response is None:
            self.response = _Response()
        return self.response

    async def _send_outbox(self) -> None:
        while True:
            kind, payload, flag = await self.outbox.get()
            try:
                if kind == "frames":
                    for frame in payload:
                        await self._send_frame(frame)
                    if flag:
                        await self._conversation_done()
                else:
                    await self._send_error(payload, flag)
            except (WebSocketDisconnect, RuntimeError):
                return  # the client is gone: the receive loop ends the session

    async def _send_frame(self, frame) -> None:
        new_response = self.response is None
        response = self._response()
        if new_response:
            await self.send(server_event("response.created", response=response_object(
                response.id, "in_progress", [], self.config.output_rate, self.config.output_modalities)))
        if frame.transcript:
            self.transcript.append(frame.transcript)
            await self.send(server_event("conversation.item.input_audio_transcription.delta", item_id=self.user_item,
                                         content_index=0, delta=frame.transcript))
        where = response.message_part()
        if frame.text:
            response.text.append(frame.text)
            kind = "response.output_audio_transcript.delta" if "audio" in self.config.output_modalities \
                else "response.output_text.delta"
            await self.send(server_event(kind, delta=frame.text, **where))
        if frame.function_text:
            if response.function_item_id is None:
                response.function_item_id = new_id("item")
            response.function_text.append(frame.function_text)
            await self.send(server_event("response.function_call_arguments.delta", response_id=response.id,
                                         item_id=response.function_item_id, output_index=1, call_id=response.call_id,
                                         delta=frame.function_text))
        if "audio" in self.config.output_modalities and len(frame.audio):
            await self.send(server_event("response.output_audio.delta", delta=encode_pcm16(self._resample(frame.audio)),
                                         **where))

    def _resample(self, audio: np.ndarray, last: bool = False) -> np.ndarray:
        if self.config.output_rate == 22050:
            return audio
        if self.resampler is None:
            self.resampler = soxr.ResampleStream(22050, self.config.output_rate, 1, dtype="float32", quality="HQ")
        return self.resampler.resample_chunk(np.asarray(audio, dtype=np.float32), last=last)

    async def _conversation_done(self) -> None:
        response = self._response()
        where = response.message_part()
        if self.resampler is not None and "audio" in self.config.output_modalities:
            tail = self._resample(np.zeros(0, np.float32), last=True)
            if len(tail):
                await self.send(server_event("response.output_audio.delta", delta=encode_pcm16(tail), **where))
        transcript = "".join(self.transcript)
        await self.send(server_event("conversation.item.input_audio_transcription.completed", item_id=self.user_item,
                                     content_index=0, transcript=transcript,
                                     usage={"type": "duration", "seconds": round(self.received_seconds, 3)}))
        await self._response_done("completed")
        # A new conversation may follow on this connection, from an empty timeline.
        self.handle.close()
        self.handle, self.started_at, self.received_seconds, self.committed = None, None, 0.0, False
        self.user_item, self.transcript, self.resampler = new_id("item"), [], None

    async def _response_done(self, status: str) -> None:
        response, self.response = self._response(), None
        text, function = "".join(response.text), "".join(response.function_text)
        where = response.message_part()
        audio = "audio" in self.config.output_modalities
        if audio:
            await self.send(server_event("response.output_audio_transcript.done", transcript=text, **where))
            await self.send(server_event("response.output_audio.done", **where))
        else:
            await self.send(server_event("response.output_text.done", text=text, **where))
        content = {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
        items = [{"id": response.message_id, "object": "realtime.item", "type": "message", "role": "assistant",
                  "status": "completed" if status == "completed" else "incomplete", "content": [content]}]
        if response.function_item_id is not None:
            await self.send(server_event("response.function_call_arguments.done", response_id=response.id,
                                         item_id=response.function_item_id, output_index=1, call_id=response.call_id,
                                         name=FUNCTION_CALL_NAME, arguments=function))
            items.append({"id": response.function_item_id, "object": "realtime.item", "type": "function_call",
                          "call_id": response.call_id, "name": FUNCTION_CALL_NAME, "arguments": function,
                          "status": "completed" if status == "completed" else "incomplete"})
        await self.send(server_event("response.done", response=response_object(
            response.id, status, items, self.config.output_rate, self.config.output_modalities)))

    async def _send_error(self, exc: BaseException, fatal: bool) -> None:
        from ..session import InputError

        if isinstance(exc, SessionLost):
            await self.send(error_event(str(exc), code="session_lost", kind="server_error"))
            await self.ws.close(code=CLOSE_INTERNAL_ERROR, reason="model lost")
            return
        if isinstance(exc, InputError):
            await self.send(error_event(str(exc), code=getattr(exc, "code", type(exc).__name__)))
        else:
            await self.send(error_event(f"internal error: {type(exc).__name__}: {exc}", code="server_error",
                                        kind="server_error"))
        if fatal:
            if self.handle is not None:
                self.handle.close()
            self.handle = None
            self.response, self.started_at, self.received_seconds, self.committed = None, None, 0.0, False
