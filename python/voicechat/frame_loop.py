"""The timeline's frames through the duplex LLM and the TTS, one at a time: the loop body that
`VoiceChat.generate` (all frames queued, synced every few) and a `LiveSession` (synced every
frame) share.

Per timeline position t: the LLM input is `E(text[t-1]) + audio[t] + 2 E(function[t-1])` (pad at
t = 0); its two heads give `text[t]` and `function[t]`; from t >= 1 the TTS turns `text[t]` into one
frame of codes. The system prompt's positions enter on the audio channel in one LLM call and emit
pad (the TTS still steps through them, on pad, to keep its timeline). Ids stay on the device and
feed the next position; nothing here waits for the device unless `plain`.
"""

from __future__ import annotations

import mlx.core as mx

from .llm.nemotron_h import NemotronHCache
from .tts.backbone import BackboneCache
from .tts_thread import TTSThread


class FrameLoop:
    """One timeline's state: the LLM cache and last ids, the TTS's cache, previous code and key
    (here, or carried by `worker`, a started `TTSThread`'s job, when the TTS steps on a thread of
    its own). Runs on `stream`.

    `prompt(ids)` first (with or without a system prompt), then `step(audio_frame)` per frame.
    `plain`: the eager LLM step, its ids read back at once (the straightforward loop, kept so that
    tests can hold the compiled one to it)."""

    def __init__(self, listening, tts, stream: mx.Stream, pad_id: int, silence: mx.array, previous_code: mx.array,
                 tts_cache: BackboneCache, seed: int, worker: TTSThread | None = None, plain: bool = False):
        self.lm, self.tts, self.stream, self.silence = listening, tts, stream, silence
        self.pad_id, self.plain, self.worker = pad_id, plain, worker
        self.pad = mx.array([[pad_id]], dtype=mx.int32)
        self.previous_code, self.tts_cache = previous_code, tts_cache
        self.key = mx.random.key(seed)
        self.cache: NemotronHCache | None = None
        self.position = 0  # the next timeline position
        self.syncs = 0  # host waits made by `plain` steps
        self.prev_text, self.prev_function = self.pad, self.pad
        if worker is not None:
            worker.start(previous_code, tts_cache, self.key)

    def prompt(self, ids: list[int]) -> tuple[list[mx.array], list[mx.array]]:
        """Start the timeline with the system prompt `ids` (none: just the LLM cache). Returns the
        prompt positions' text ids (pad; also their function ids) and the codes the TTS made for
        positions 1.. of the prompt (none on a worker)."""
        codes: list[mx.array] = []
        with mx.stream(self.stream):
            self.cache = self.lm.make_cache()
            if not ids:
                return [], codes
            frames = len(ids)
            prompt = self.lm.embed(mx.array([ids], dtype=mx.int32))
            pads = mx.broadcast_to(self.pad, (1, frames))
            self.lm.step(self.lm.fused_input(pads, prompt, pads), self.cache)
            mx.async_eval(*self.cache.state)
            pad_id = mx.array([self.pad_id], dtype=mx.int32)  # made from host data: no lazy op to share
            for _ in range(1, frames):
                code = self._tts_step(pad_id)
                if code is not None:
                    codes.append(code)
        self.position = frames
        return [pad_id] * frames, codes

    def resume(self, cache: NemotronHCache, position: int, prev_text: mx.array, prev_function: mx.array,
               tts_cache: BackboneCache, previous_code: mx.array, key: mx.array) -> None:
        """Go on from a timeline's state kept elsewhere (the batched engine's rows hand a session's
        state back this way): the LLM cache, the next position, the last ids `[1, 1]`, the TTS's
        cache, previous code `[1, 1, Q]` and key. Not on a worker (it carries the TTS state)."""
        if self.worker is not None:
            raise ValueError("a loop whose TTS steps on a worker cannot take another TTS state")
        self.cache, self.position, self.prev_text, self.prev_function = cache, position, prev_text, prev_function
        self.tts_cache, self.previous_code, self.key = tts_cache, previous_code, key

    def step(self, audio: mx.array, index: int = 0) -> tuple[mx.array, mx.array, mx.array | None]:
        """The next position with frame `index` of `audio [1, T, H]` on the audio channel: `(text id
        [1], function id [1], codes [1, 1, Q])`, all lazy; codes are None at position 0 (no TTS
        there) and on a worker (it keeps its own).

        The frame is sliced here, on the loop's stream: a slice made on the caller's stream would
        make every frame wait across streams, which costs host time a frame on a GPU."""
        lm = self.lm
        with mx.stream(self.stream):
            audio_frame = audio[:, index : index + 1]
            if self.plain:  # the eager step, read back at once
                out = lm.step(lm.fused_input(self.prev_text, audio_frame, self.prev_function), self.cache)
                text_id = mx.array([out.text_ids.item()], dtype=mx.int32)
                function_id = mx.array([out.function_ids.item()], dtype=mx.int32)
                self.syncs += 1
            else:  # the same step as one compiled graph, left on the device
                text_id, function_id = lm.decode(self.prev_text, audio_frame, self.prev_function, self.cache)
                mx.async_eval(text_id, function_id)
        return text_id, function_id, self.speak(text_id, function_id)

    def speak(self, text_id: mx.array, function_id: mx.array) -> mx.array | None:
        """The rest of a position once the LLM has made its ids `[1]` (here, in `step`, or in
        sessions' batched rows): the TTS step (from position 1; its codes `[1, 1, Q]` returned,
        lazy, else None) and the ids kept for the next position."""
        with mx.stream(self.stream):
            code = None
            if self.position >= 1:
                code = self._tts_step(int(text_id.item()) if self.plain else text_id)
            self.prev_text, self.prev_function = text_id[None], function_id[None]
        self.position += 1
        return code

    def _tts_step(self, text_id) -> mx.array | None:
        """This position's TTS step: on the worker, or here (its codes returned)."""
        if self.worker is not None:
            self.worker.put(text_id)
            return None
        self.previous_code, self.key = self.tts.step(self.previous_code, text_id, self.tts_cache, self.key,
                                                     self.silence)
        (mx.eval if self.plain else mx.async_eval)(self.previous_code, self.key)
        return self.previous_code
