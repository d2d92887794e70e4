"""Live conversation: the cache-aware online session, one 80 ms frame at a time.

    with chat.live(system_prompt=None, seed=0) as live:
        for chunk in microphone_chunks:                        # any length; float or int16 PCM
            for frame in live.push(chunk, sample_rate=16000):  # the frames this chunk completed
                play(frame.audio)                              # 22.05 kHz float32
        tail = live.finish(extra_decoding_seconds=3.0)         # silence in, the last frames out
        result = live.result()                                 # a Result, like generate()'s

Exactness: `result()` equals `chat.generate(the same samples, extra_decoding_seconds, seed)` (ids,
codes and transcript identical, audio to float rounding), and the frames' audio concatenated is
`result().audio`. Everything causal runs incrementally with caches (`PerceptionStream`,
`TranscriptStream`, `FrameLoop`, `DecoderStream`); what the offline pass takes from the input's end
(the last mel frames' reflection, the subsampling's right pad, the codec's last samples) comes at
`finish()`. Input at another rate is resampled with a `soxr.ResampleStream`, whose chunks join to
`soxr.resample` of the whole signal bit for bit (python-soxr 1.1: tested).

Audio lag: 6 samples (0.27 ms). A frame's last 6 samples overlap the next frame in the codec's
iSTFT, so each frame returns the 1764 samples that became final (the first frame 1758) and
`finish()` (or the frame that fills the context) returns the last 6 with the last frame.

Limits: the session ends at the model's context (`max_position_embeddings` positions, system
prompt included) with `ContextFull`. What grows with time: the LLM's attention keys and values
and EAR-TTS's global layers' (bounded by that context), the ids and codes kept for `result()`
(a few hundred bytes a frame) and, with `keep_audio` (default), the answer's samples (318 MB an
hour). The input is kept only with `keep_input_audio`. See docs/live.md.

One session or generate at a time per `VoiceChat`: while a session is open, `generate()` and
another `live()` raise `ModelBusy` (a session may stay open indefinitely); `live()` called while a
`generate()` runs on another thread waits for it. Calls on one session are serialized.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .audio import AudioError, check_samples, to_mono
from .codec.codec import DecoderStream
from .config import EXTRA_DECODING_SECONDS
from .frame_loop import FrameLoop
from .session import InputError, Result
from .stt.conformer import PerceptionStream
from .stt.rnnt import TranscriptStream
from .text_stream import PieceDeltas, TokenDeltas
from .tts_thread import release_mlx_state_at_thread_exit
from .tokenizer import decode_pieces


class ContextFull(InputError):
    """The session's timeline reached the model's context: the session has ended. `frames`: the
    frames this call completed before the limit (the last one carries the final samples);
    `result()` holds everything the session produced."""

    def __init__(self, message: str, frames: list["Frame"], limit: int):
        super().__init__(message)
        self.frames = frames
        self.limit = limit


@dataclass
class Frame:
    """One 80 ms timeline frame of a live session. The text fields are the new text of each
    channel (deltas: joined, a channel's give the stripped text `generate` returns)."""

    index: int  # timeline position after the system prompt (0, 1, 2, ...)
    text_id: int
    function_id: int
    text: str
    function_text: str
    transcript: str  # the user's words the speech recognizer emitted at this frame
    audio: np.ndarray = field(repr=False)  # float32 samples at 22.05 kHz this frame made final


class _Growing:
    """An int32 array `[n, width]` appended to row by row, grown by doubling (no per-row objects)."""

    def __init__(self, width: int):
        self._data = np.zeros((64, width), np.int32)
        self.size = 0

    def append(self, row) -> None:
        if self.size == self._data.shape[0]:
            self._data = np.concatenate([self._data, np.zeros_like(self._data)])
        self._data[self.size] = row
        self.size += 1

    @property
    def values(self) -> np.ndarray:
        return self._data[: self.size]


@mx.compile
def _decodable_codes(codes: mx.array, control: mx.array, silence: mx.array) -> mx.array:
    """codes `[1, Q, 1]` with every control code replaced by its codebook's silence code (one fused
    launch)."""
    is_control = (codes[..., None] == control).any(axis=-1)
    return mx.where(is_control, silence.reshape(1, -1, 1), codes).astype(mx.int32)


class LiveSession:
    """A live conversation on a `VoiceChat` (made by `VoiceChat.live`; see the module docstring).

    `keep_audio` (default True): keep the answer's samples for `result().audio` (otherwise that is
    empty). `keep_input_audio` (default False): keep the 16 kHz input (`input_audio`)."""

    def __init__(self, chat, turn: object, system_prompt: str | None, seed: int, keep_audio: bool,
                 keep_input_audio: bool):
        """`turn`: the model's turn this session holds (`VoiceChat._begin_turn`), released at close."""
        release_mlx_state_at_thread_exit()  # here and in push / finish: any thread may feed a session
        self.chat = chat
        c = chat.config
        self.config = c
        self.keep_audio, self.keep_input_audio = bool(keep_audio), bool(keep_input_audio)
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self.limit = c.text_config.max_position_embeddings
        ids = chat.prompt_ids(system_prompt)
        chat._check_length(len(ids), 1)
        self.prompt_frames = len(ids)
        self._rate: int | None = None  # the input's sample rate, set by the first chunk
        self._channels: int | None = None
        self._resampler = None
        self.input_samples = 0  # 16 kHz samples taken in
        self._input: list[np.ndarray] = []
        self._audio: list[np.ndarray] = []
        self._ended = False  # finish() ran, or the context is full
        self._context_full = False
        self._closed = False
        self.host_syncs = 0
        self._control_codes = chat._control_codes
        self._silence_codes = chat._silence_codes
        skip = {c.pad_token_id, c.silence_token_id, c.bos_token_id, c.eos_token_id}
        decode = chat.tokenizer.decode
        self._text = TokenDeltas(decode, skip)
        self._function = TokenDeltas(decode, skip)
        self._transcript = PieceDeltas(chat.rnnt_pieces)
        self._text_ids: list[int] = []
        self._function_ids: list[int] = []
        self._transcript_ids: list[int] = []
        self._codes = _Growing(c.tts_config.num_quantizers)

        with mx.stream(chat._timeline_stream):
            chat._stream_in_float32()
            self.perception = PerceptionStream(chat.listening.perception)
            self.transcript = TranscriptStream(chat.listening.rnnt_decoder, chat.listening.rnnt_joint,
                                               c.rnnt_blank_id, c.audio_config.max_symbols,
                                               stream=chat._transcript_stream, weights=chat._transcript_weights)
            self.decoder = DecoderStream(chat.speaking.audio_codec)
        tts = chat.ear_tts
        with mx.stream(chat._timeline_stream):
            tts_cache = tts.make_cache()
            previous_code = tts.warmup(chat.speaking.audio_prompt_latents[c.speaker], chat.warmup_codes(), tts_cache)
        mx.eval(previous_code)
        self._finalizer = weakref.finalize(self, chat._end_turn, turn)
        # A live frame is waited for: its TTS step is built here, on the calling thread. Handed to
        # the model's TTS worker (as `generate` does, where frames overlap), the step's codes would
        # also wait for the hand-over, and the codec could not be queued behind the step.
        self.loop = FrameLoop(chat.listening, tts, chat._timeline_stream, c.pad_token_id,
                              chat.speaking.codec_silence_tokens, previous_code, tts_cache, seed)
        _, prompt_codes = self.loop.prompt(ids)
        mx.eval(prompt_codes, self.loop.cache.state)
        self.host_syncs += 2

    # ------------------------------------------------------------------ API

    @property
    def frames(self) -> int:
        """Timeline frames after the system prompt so far."""
        return self._codes.size

    @property
    def input_audio(self) -> np.ndarray:
        """The 16 kHz input taken in (with `keep_input_audio`; before the appended silence)."""
        if not self.keep_input_audio:
            raise InputError("the input is not kept: open the session with keep_input_audio=True")
        return np.concatenate(self._input) if self._input else np.zeros(0, np.float32)

    def held_bytes(self) -> dict[str, int]:
        """Bytes the session holds, by what they are for (docs/live.md says which grow with time)."""
        with self._lock:
            arrays = lambda xs: sum(int(a.nbytes) for a in xs)  # noqa: E731
            return {
                "llm_cache": arrays(self.loop.cache.state) if self.loop.cache is not None else 0,
                "tts_cache": arrays(self.loop.tts_cache.state),
                "encoder_cache": self.perception.state_nbytes,
                "ids_and_codes": self._codes.values.nbytes + 8 * (len(self._text_ids) + len(self._function_ids)
                                                                  + len(self._transcript_ids)),
                "output_audio": arrays(self._audio),
                "input_audio": arrays(self._input),
            }

    def push(self, chunk, sample_rate: int = 16000) -> list[Frame]:
        """Take a chunk of input (`[samples]` or `[samples, channels]`; float in [-1, 1] or int16 /
        int32 / uint8 PCM) and return the frames it completed (0 or more). Bad input raises
        `InputError` and changes nothing."""
        release_mlx_state_at_thread_exit()
        with self._lock:
            return self._take(self._accept(chunk, sample_rate), end=False)

    def finish(self, extra_decoding_seconds: float = EXTRA_DECODING_SECONDS) -> list[Frame]:
        """End the input: `extra_decoding_seconds` of silence go in (as in `generate`), and the last
        frames come out, the last one with the final samples and text."""
        number = isinstance(extra_decoding_seconds, (int, float, np.integer, np.floating))
        if isinstance(extra_decoding_seconds, bool) or not number or not math.isfinite(extra_decoding_seconds) \
                or extra_decoding_seconds < 0:
            raise InputError(f"extra_decoding_seconds must be a finite number >= 0, got {extra_decoding_seconds!r}")
        release_mlx_state_at_thread_exit()
        with self._lock:
            self._check_open()
            tail = np.zeros(0, np.float32)
            if self._resampler is not None:
                tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True).astype(np.float32, copy=False)
                self._resampler = None
            self.input_samples += tail.size
            if self.keep_input_audio and tail.size:
                self._input.append(tail.copy())
            extra = int(round(extra_decoding_seconds * self.config.input_sample_rate))
            samples = np.concatenate([tail, np.zeros(extra, np.float32)])
            total = self.input_samples + samples.size
            if total <= self.config.audio_config.preprocessor.n_fft // 2:
                self._end()
                raise AudioError(f"audio is too short ({total} samples at {self.config.input_sample_rate} Hz)")
            return self._take(samples, end=True, count_input=False)

    def result(self) -> Result:
        """What the session produced, as `generate` returns it (after `finish()`, or once the
        context is full)."""
        with self._lock:
            if not self._ended:
                raise InputError("the session is still open: call finish() first")
            c = self.config
            skip = {c.pad_token_id, c.silence_token_id, c.bos_token_id, c.eos_token_id}
            tok = self.chat.tokenizer
            audio = np.concatenate(self._audio) if self._audio else np.zeros(0, np.float32)
            return Result(
                user_transcript=decode_pieces(self._transcript_ids, self.chat.rnnt_pieces),
                text=tok.decode(self._text_ids, skip=skip).strip(),
                function_text=tok.decode(self._function_ids, skip=skip).strip(),
                audio=audio,
                sample_rate=c.output_sample_rate,
                text_tokens=list(self._text_ids),
                function_tokens=list(self._function_ids),
                audio_codes=self._codes.values.tolist(),
                timings={"live_s": self._ended_at - self._started},
                frames=self.frames,
                prompt_frames=self.prompt_frames,
                host_syncs=self.host_syncs,
                peak_memory_gb={"live_s": mx.get_peak_memory() / 1e9},
            )

    def close(self) -> None:
        """Let the model go (another session or generate may start). A session not finished is
        abandoned: its TTS steps still queued are dropped. `result()` still works after `finish()`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._ended:
                self._end()
            self._finalizer()

    def __enter__(self) -> "LiveSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._context_full:
            raise ContextFull(self._full_message(), [], self.limit)
        if self._ended or self._closed:
            raise InputError("the session has ended (finish() or close() was called); open a new one with chat.live()")

    def _accept(self, chunk, sample_rate) -> np.ndarray:
        """A pushed chunk as the 16 kHz samples that go on (InputError; nothing changed)."""
        self._check_open()
        samples = self._samples(chunk, sample_rate)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=False).astype(np.float32, copy=False)
        return samples

    def _samples(self, chunk, sample_rate) -> np.ndarray:
        """The chunk as mono float32 at its own rate, checked (InputError; nothing changed)."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float, np.integer, np.floating)) \
                or not np.isfinite(sample_rate) or sample_rate != int(sample_rate) or sample_rate <= 0:
            raise InputError(f"sample_rate must be a positive whole number of Hz, got {sample_rate!r}")
        rate = int(sample_rate)
        if self._rate is not None and rate != self._rate:
            raise InputError(f"this session's input is at {self._rate} Hz; a chunk at {rate} Hz cannot continue it")
        try:
            data = np.asarray(chunk)
        except Exception as e:
            raise InputError(f"audio chunk: not an array of samples ({e})") from None
        if data.ndim not in (1, 2):
            raise InputError(f"audio chunk must be [samples] or [samples, channels], got shape {data.shape}")
        channels = 1 if data.ndim == 1 else data.shape[1]
        if self._channels is not None and channels != self._channels:
            raise InputError(f"this session's input has {self._channels} channel(s); a chunk of shape "
                             f"{data.shape} cannot continue it")
        if data.shape[0] == 0 or channels == 0:
            return np.zeros(0, np.float32)
        try:
            samples = to_mono(check_samples(data, "audio chunk"))
        except AudioError as e:
            raise InputError(str(e)) from None
        if self._rate is None:
            self._rate = rate
            if rate != self.config.input_sample_rate:
                import soxr

                self._resampler = soxr.ResampleStream(rate, self.config.input_sample_rate, 1, dtype="float32",
                                                      quality="HQ")
        self._channels = channels
        return np.ascontiguousarray(samples, dtype=np.float32)

    def _perceive(self, samples: np.ndarray, end: bool, count_input: bool) -> tuple[mx.array, mx.array]:
        """16 kHz samples (counted, and kept if asked) through perception: the projected audio
        channel and the encoder frames they complete (lazy; on the timeline's stream)."""
        if count_input:
            self._count_input(samples)
        projected, encoded = self.perception.push(samples)
        if end:
            last_projected, last_encoded = self.perception.finish()
            projected = mx.concatenate([projected, last_projected], axis=1)
            encoded = mx.concatenate([encoded, last_encoded], axis=1)
        return projected, encoded

    def _count_input(self, samples: np.ndarray) -> None:
        self.input_samples += samples.size
        if self.keep_input_audio and samples.size:
            self._input.append(samples.copy())

    def _take(self, samples: np.ndarray, end: bool, count_input: bool = True) -> list[Frame]:
        """16 kHz samples in; the frames they complete out (`end`: the input's end)."""
        with mx.stream(self.chat._timeline_stream):
            projected, encoded = self._perceive(samples, end, count_input)
            if projected.shape[1] == 0:
                mx.eval(self.perception.state)
                if end:
                    self._end()
                return []
            table = self.transcript.push(encoded)
            # Queued, not waited for: the first frame's step is built while the device runs the
            # perception and the CPU the transcript loop.
            mx.async_eval(table, *self.perception.state)
        frames: list[Frame] = []
        emitted = None
        for i in range(projected.shape[1]):
            if self.prompt_frames + self.frames >= self.limit:  # (a frame that filled it ended the session)
                self._context_full = True
                self._end(frames[-1] if frames else None)
                raise ContextFull(self._full_message(), frames, self.limit)
            text_id, function_id, codes, audio = self._read_frame(*self._queue_frame(projected, i))
            if emitted is None:
                emitted = np.array(table)
            frames.append(self._emit(text_id, function_id, codes, emitted[i], audio))
        if end:
            self._end(frames[-1])
        elif self.prompt_frames + self.frames >= self.limit:  # the last frame the context holds
            self._context_full = True
            self._end(frames[-1])
        return frames

    def _queue_frame(self, projected: mx.array,
                     i: int) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None]:
        """Frame i of `projected` through the LLM and the TTS (`FrameLoop.step`) and its codes through
        the codec, all queued on the device, nothing read back (for `_read_frame`). The codec's graph
        is built and launched while the device still runs the step: on a GPU a frame then waits for
        the codec's kernels only, not for their launching too. Position 0 (no TTS step, codes 0) is
        decoded once read back (`_emit`)."""
        return self._queue_codec(*self.loop.step(projected, i))  # (codes None at position 0)

    def _queue_codec(self, text_id: mx.array, function_id: mx.array,
                     code: mx.array | None) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None]:
        """A stepped frame's codes queued through the codec (see `_queue_frame`)."""
        framed = None
        if code is not None:
            with mx.stream(self.chat._timeline_stream):
                framed = self.decoder.queue(self._decodable_on_device(code))
                mx.async_eval(framed, self.decoder.contexts)
        return text_id, function_id, code, framed

    def _read_frame(self, text_id: mx.array, function_id: mx.array, code: mx.array | None,
                    framed: mx.array | None) -> tuple[int, int, np.ndarray, np.ndarray | None]:
        """A queued frame read back: its text id, function id, codes `[Q]` and samples (None when
        the codec has not run it yet)."""
        text_id, function_id, codes = self._read_step(text_id, function_id, code)
        return text_id, function_id, codes, None if framed is None else self.decoder.take(framed)[0]

    def _read_step(self, text_id: mx.array, function_id: mx.array,
                   code: mx.array | None) -> tuple[int, int, np.ndarray]:
        """A queued step's ids and codes `[Q]` read back."""
        with mx.stream(self.chat._timeline_stream):
            mx.eval(text_id, function_id, *([] if code is None else [code]))
            self.host_syncs += 1
            codes = np.zeros(self.config.tts_config.num_quantizers, np.int32) if code is None \
                else np.array(code).reshape(-1)
            return int(text_id.item()), int(function_id.item()), codes

    def _decodable(self, codes: np.ndarray) -> np.ndarray:
        """A frame's codes as the codec takes them: control codes -> the silence codes."""
        return np.where(np.isin(codes, self._control_codes), self._silence_codes, codes).astype(np.int32)

    def _decodable_on_device(self, code: mx.array) -> mx.array:
        """`_decodable` of a frame's codes `[1, 1, Q]` left on the device: `[1, Q, 1]` int32."""
        return _decodable_codes(code.reshape(1, -1, 1), self.chat.speaking.control_codes,
                                self.chat.speaking.codec_silence_tokens)

    def _emit(self, text_id: int, function_id: int, codes: np.ndarray, transcript_row: np.ndarray,
              audio: np.ndarray | None = None) -> Frame:
        """The next frame from its ids and codes (read back): its audio decoded (unless `audio`, its
        samples already decoded, is given), every channel's text delta, and all of it kept for
        `result()`."""
        index = self.frames
        if audio is None:
            with mx.stream(self.chat._timeline_stream):
                audio = self.decoder.push(mx.array(self._decodable(codes)[None, :, None]))[0]
        self._codes.append(codes)
        self._text_ids.append(text_id)
        self._function_ids.append(function_id)
        tokens = [int(t) for t in transcript_row if t >= 0]
        self._transcript_ids += tokens
        frame = Frame(index, text_id, function_id, self._text.add(text_id), self._function.add(function_id),
                      self._transcript.add(tokens), audio)
        if self.keep_audio:
            self._audio.append(audio)
        return frame

    def _end(self, last: Frame | None = None) -> None:
        """The timeline ends: the last samples and text go to `last` (the session's last frame)."""
        if self._ended:
            return
        self._ended = True
        self._ended_at = time.perf_counter()
        tail = self.decoder.finish()
        tail = tail[0] if tail.size else np.zeros(0, np.float32)
        texts = self._text.finish(), self._function.finish(), self._transcript.finish()
        if last is not None:
            last.audio = np.concatenate([last.audio, tail])
            last.text, last.function_text, last.transcript = (a + b for a, b in
                                                              zip((last.text, last.function_text, last.transcript), texts))
        if self.keep_audio and tail.size:
            self._audio.append(tail)

    def _full_message(self) -> str:
        audio_frames = self.limit - self.prompt_frames
        return (f"the model's context is full: {self.limit} positions ({self.prompt_frames} system-prompt + "
                f"{audio_frames} audio frames, {audio_frames * self.config.frame_duration / 60:.1f} min of audio); "
                f"the session ended after {audio_frames} frames (result() holds them)")


class LiveHost:
    """Holds a `VoiceChat` for many live sessions at once, all stepped from one thread at a time
    (a server's scheduler): `host.live(...)` as `chat.live(...)`, without the one-session rule.
    Made by `VoiceChat.sessions()`; `close()` (or `with`) lets the model go.

    Its sessions build their TTS steps on the stepping thread, as every live session does."""

    def __init__(self, chat):
        self.chat = chat
        self._turn = chat._begin_turn(live=True)
        self._closed = False

    def live(self, system_prompt: str | None = None, seed: int = 0, *, keep_audio: bool = True,
             keep_input_audio: bool = False) -> LiveSession:
        if self._closed:
            raise InputError("this LiveHost is closed")
        from .session import _checked_seed

        seed = _checked_seed(seed)
        self.chat.prompt_ids(system_prompt)
        # A token of its own: closing one session does not let the model go.
        return LiveSession(self.chat, object(), system_prompt, seed, keep_audio, keep_input_audio)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.chat._end_turn(self._turn)

    def __enter__(self) -> "LiveHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
