"""The offline timeline: one 80 ms frame at a time through listening, the LLM and speaking.

    chat = voicechat.load("mlx-community/NemotronLabs-VoiceChat-11B-4bit")
    result = chat.generate("question.wav", system_prompt="Be concise.")

Per timeline position t: the LLM input is `E(text[t-1]) + audio[t] + 2 E(function[t-1])`; its two
heads give `text[t]` and `function[t]` (greedy, after the system prompt); from t >= 1 the TTS turns
`text[t]` into one frame of 31 codec codes. The loop never waits for the device: ids stay on the
device and feed the next frame, the LLM step runs as one compiled graph (`DuplexLM.decode`) as
the TTS step does, evaluation is pipelined with `mx.async_eval`, and the host syncs
only every `SYNC_EVERY` frames (to bound the queued graph and keep progress honest). On a CUDA GPU
(`tts_thread`) the TTS half is built on a host thread of its own, beside the LLM half.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .audio import load_audio
from .checkpoint import Checkpoint, default_readers, open_checkpoint
from .config import EXTRA_DECODING_SECONDS, VoiceChatConfig
from .frame_loop import FrameLoop
from .held import evaluate_held
from .model import VoiceChatModel
from .prepare import prepare_listening, prepare_tts
from .stt.conformer import subsampled_length
from .stt.rnnt import emitted_tokens, greedy_table, loop_weights
from .tokenizer import TextTokenizer, decode_pieces, load_rnnt_pieces
from .tts_thread import TTSThread, WorkerThread, release_mlx_state_at_thread_exit

SYNC_EVERY = 32  # frames between host syncs in the timeline loop
# From 30 s of audio (3001 mel frames) the encoder runs a layer at a time (ConformerEncoder's
# `stepwise`): what a GPU holds in flight for the whole encoder grows with the input.
STEPWISE_MEL_FRAMES = 3000


class InputError(ValueError):
    """A generate() argument that cannot be used (too long, bad prompt, ...)."""


class ModelBusy(RuntimeError):
    """The VoiceChat is held by an open live session: one generate or session runs at a time."""


@dataclass
class Result:
    """What one `generate` call produced. `audio` is float32 mono at `sample_rate` (22050 Hz)."""

    user_transcript: str
    text: str
    function_text: str
    audio: np.ndarray = field(repr=False)
    sample_rate: int
    text_tokens: list[int]
    function_tokens: list[int]
    audio_codes: list[list[int]] = field(repr=False)  # [frames][31] as generated (before control-code replacement)
    timings: dict[str, float] = field(default_factory=dict)
    frames: int = 0
    prompt_frames: int = 0
    host_syncs: int = 0  # times the host waited for the device during generate()
    # mx.get_peak_memory() in GB after each stage (the process's peak since the last
    # mx.reset_peak_memory()): the first stage at the final value is the one that set the peak.
    peak_memory_gb: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        """Everything but the samples, with the same field names."""
        return {
            "user_transcript": self.user_transcript, "text": self.text, "function_text": self.function_text,
            "sample_rate": self.sample_rate, "text_tokens": self.text_tokens,
            "function_tokens": self.function_tokens, "audio_codes": self.audio_codes, "frames": self.frames,
            "prompt_frames": self.prompt_frames, "host_syncs": self.host_syncs, "timings": dict(self.timings),
            "peak_memory_gb": dict(self.peak_memory_gb),
        }


def default_tts_thread() -> bool:
    """Whether `generate()` builds the TTS steps on a worker thread unless told: as
    VOICECHAT_TTS_THREAD says ("0" or "1"); when unset, on where the default device is a CUDA GPU
    (whose frame loop is bound by the host), off elsewhere (on a CPU the two chains share the same
    cores)."""
    value = os.environ.get("VOICECHAT_TTS_THREAD", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"VOICECHAT_TTS_THREAD is {value!r}: use 0 or 1")
    if value:
        return value == "1"
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


class VoiceChat:
    """A loaded model: `generate()` runs the offline timeline on one input.

    `tts_thread` (on by default on a CUDA GPU, off elsewhere; VOICECHAT_TTS_THREAD=0|1 overrides):
    `generate` builds the TTS steps on a host thread of their own while this thread builds the LLM
    steps (same ids and codes as one thread; `tts_thread.py` says why it pays and the rules it
    follows). Live sessions build both on their own thread."""

    def __init__(self, checkpoint: Checkpoint, model: VoiceChatModel, tokenizer: TextTokenizer,
                 rnnt_pieces: list[str]):
        self.checkpoint = checkpoint
        self.config: VoiceChatConfig = checkpoint.config
        self.model = model
        self.tokenizer = tokenizer
        self.rnnt_pieces = rnnt_pieces
        self.listening = model.stt_model  # perception, the duplex LLM, the transcript
        self.speaking = model.tts_model  # EAR-TTS, the codec, the speaker prompt
        self.ear_tts = model.tts_model.tts_model
        self._prompt_codes: mx.array | None = None
        self._control_codes = np.array(self.speaking.control_codes)
        self._silence_codes = np.array(self.speaking.codec_silence_tokens)
        self._transcript_stream = mx.new_thread_unsafe_stream(mx.cpu)  # any calling thread
        self._transcript_weights = loop_weights(self.listening.rnnt_decoder, self.listening.rnnt_joint,
                                                host_copies=mx.default_device() == mx.gpu)
        # Streams any thread may use (see tts_thread.py): the timeline runs on the first; the TTS on
        # the second when a worker thread steps it (on one thread, one stream: no cross-stream waits).
        self._timeline_stream = mx.new_thread_unsafe_stream(mx.default_device())
        self._tts_stream = mx.new_thread_unsafe_stream(mx.default_device())
        self.tts_thread = default_tts_thread()
        self._tts_worker: WorkerThread | None = None  # made at the first threaded generate, then kept
        # Whose turn it is: None, or the token of the generate or live session that holds the model.
        self._turn = threading.Condition()
        self._holder: object | None = None
        self._holder_is_live = False
        self._streaming_in_float32 = False

    def close(self) -> None:
        """Ends the TTS worker thread, if a threaded generate made one (garbage collection and the
        interpreter's exit end it too). A later threaded generate makes a new one."""
        if self._tts_worker is not None:
            self._tts_worker.close()
            self._tts_worker = None

    def __enter__(self) -> "VoiceChat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker_thread(self) -> WorkerThread:
        """The TTS worker, one for this model's life: a thread of its own per generate would trace
        the compiled TTS step again at every call (MLX's compile cache is thread-local)."""
        if self._tts_worker is None or not self._tts_worker.is_alive():
            self._tts_worker = WorkerThread()
            weakref.finalize(self, self._tts_worker.close)  # (holds the worker, not the model)
        return self._tts_worker

    # ------------------------------------------------------------------ helpers

    @property
    def sample_rate(self) -> int:
        return self.config.output_sample_rate

    def warmup_codes(self) -> mx.array:
        """The codec's codes of 38 frames of silence `[1, 38, 31]`, from which the TTS warmup builds
        the speaker prompt (spec "Warmup"). The same every session: made once."""
        if self._prompt_codes is None:
            frames = self.speaking.audio_prompt_latents[self.config.speaker].shape[1]
            silence = mx.zeros((1, (frames + 1) * self.config.samples_per_frame))
            self._prompt_codes = self.speaking.audio_codec.encode(silence).transpose(0, 2, 1)
            mx.eval(self._prompt_codes)
        return self._prompt_codes

    def prompt_ids(self, system_prompt: str | None) -> list[int]:
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt must be a str or None, got {type(system_prompt).__name__}")
        if not system_prompt:
            return []
        c = self.config
        return [c.bos_token_id] + self.tokenizer.encode(system_prompt) + [c.eos_token_id]

    def _input_audio(self, audio, sample_rate: int | None, extra_decoding_seconds: float,
                     prompt_frames: int = 0) -> np.ndarray:
        number = isinstance(extra_decoding_seconds, (int, float, np.integer, np.floating))
        if isinstance(extra_decoding_seconds, bool) or not number or not math.isfinite(extra_decoding_seconds) \
                or extra_decoding_seconds < 0:
            raise InputError(f"extra_decoding_seconds must be a finite number >= 0, got {extra_decoding_seconds!r}")
        pre = self.config.audio_config.preprocessor

        def fits(samples: int) -> None:  # before anything is read, resampled or padded
            self._check_length(prompt_frames, subsampled_length(1 + samples // pre.hop_length))

        # (capped far past any context, so that the product stays a finite float; `fits` refuses it)
        extra = min(float(extra_decoding_seconds), 1e12)
        return load_audio(audio, self.config.input_sample_rate, sample_rate,
                          pad=int(round(extra * self.config.input_sample_rate)),
                          min_samples=pre.n_fft // 2 + 1, check=fits)

    def _check_length(self, prompt_frames: int, frames: int) -> None:
        limit = self.config.text_config.max_position_embeddings
        if prompt_frames + frames > limit:
            secs = limit * self.config.frame_duration
            raise InputError(
                f"input too long: {prompt_frames} system-prompt tokens + {frames} audio frames exceed the "
                f"model's context of {limit} positions ({secs / 60:.1f} min of audio)")

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        audio: str | os.PathLike | np.ndarray,
        system_prompt: str | None = None,
        extra_decoding_seconds: float = EXTRA_DECODING_SECONDS,
        seed: int = 0,
        *,
        sample_rate: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        pipelined: bool = True,
    ) -> Result:
        """Run the timeline on `audio` (a path, or an array at `sample_rate`: float samples, or
        int16 / int32 / uint8 PCM; mono or [samples, channels]). `seed` (0 <= seed < 2**64) seeds the
        speech sampler; the text ids do not depend on it.

        `progress(done, total)` is called as timeline frames are queued. `pipelined=False` runs
        the plain loop (a host sync per frame; same ids and codes, slower). Calls on one VoiceChat
        from several threads run one at a time (they share its streams and caches' buffers); while a
        live session is open (`live()`), generate raises `ModelBusy`.
        """
        seed = _checked_seed(seed)
        release_mlx_state_at_thread_exit()  # any thread may call this (tts_thread.py says why)
        turn = self._begin_turn(live=False)
        try:
            return self._generate(audio, system_prompt, extra_decoding_seconds, seed, sample_rate, progress,
                                  pipelined)
        finally:
            self._end_turn(turn)

    def live(self, system_prompt: str | None = None, seed: int = 0, *, keep_audio: bool = True,
             keep_input_audio: bool = False):
        """Open a live session (`voicechat.live.LiveSession`): push input chunks as they come, get
        each 80 ms frame's ids, text and audio back; `result()` after `finish()` equals `generate` on
        the same input. `system_prompt` and `seed` as in `generate` (the same errors).

        The session holds this model until it is closed (`with chat.live() as live:`, or `close()`):
        meanwhile `generate()` and another `live()` raise `ModelBusy`. A `generate()` running on
        another thread is waited for. `keep_audio`: keep the answer's samples for `result().audio`
        (318 MB an hour); `keep_input_audio`: keep the 16 kHz input (`LiveSession.input_audio`)."""
        from .live import LiveSession

        seed = _checked_seed(seed)
        self.prompt_ids(system_prompt)  # (its TypeError before the model is taken)
        turn = self._begin_turn(live=True)
        try:
            return LiveSession(self, turn, system_prompt, seed, keep_audio, keep_input_audio)
        except BaseException:
            self._end_turn(turn)
            raise

    def _stream_in_float32(self) -> None:
        """Perception and the codec compute in float32 whatever the weights' dtype. A live session
        runs perception and the codec's decoder every 80 ms, where casting bfloat16 weights at each
        call costs a cast of every weight per chunk (1.2 GB of encoder weights at full size): those
        weights become float32 once, at the first live session (exact: every bfloat16 value is a
        float32 one; 1.4 GB more than in bfloat16 at full size). Called with the model's turn held."""
        if self._streaming_in_float32:
            return
        codec = self.speaking.audio_codec
        modules = (self.listening.perception, codec.decoder, codec.prvq)
        for module in modules:
            module.set_dtype(mx.float32)
        self.listening.perception.encoder.prepare()  # (its derived arrays from the float32 weights)
        codec.prvq.codebooks()  # (its stacked codebooks from the float32 means)
        codec.decoder.hold_operands()  # (its taps and transposed matrices, views of the float32 weights)
        evaluate_held(*modules)
        self._streaming_in_float32 = True

    def sessions(self):
        """Hold this model for many live sessions stepped from one thread at a time (a server's):
        `with chat.sessions() as host: a, b = host.live(...), host.live(...)`
        (`voicechat.live.LiveHost`). Meanwhile `generate()` and `live()` raise `ModelBusy`."""
        from .live import LiveHost

        return LiveHost(self)

    def _begin_turn(self, live: bool) -> object:
        """Take the model: wait for a generate on another thread; refuse while a live session
        holds it (it may stay open indefinitely). Returns the token `_end_turn` takes."""
        with self._turn:
            while self._holder is not None:
                if self._holder_is_live:
                    raise ModelBusy("a live session is open on this VoiceChat: close it (or finish it and close it) "
                                    "before another generate() or live()")
                self._turn.wait()
            self._holder, self._holder_is_live = object(), live
            return self._holder

    def _end_turn(self, turn: object) -> None:
        with self._turn:
            if self._holder is turn:
                self._holder, self._holder_is_live = None, False
                self._turn.notify_all()

    def _generate(self, audio, system_prompt, extra_decoding_seconds, seed, sample_rate, progress,
                  pipelined) -> Result:
        c = self.config
        timings: dict[str, float] = {}
        peaks: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[name] = now - clock
            peaks[name] = mx.get_peak_memory() / 1e9
            clock = now

        ids = self.prompt_ids(system_prompt)
        prompt_frames = len(ids)
        wave = self._input_audio(audio, sample_rate, extra_decoding_seconds, prompt_frames)
        mel_frames = 1 + len(wave) // self.config.audio_config.preprocessor.hop_length
        self._check_length(prompt_frames, subsampled_length(mel_frames))  # before any heavy work
        lap("audio_s")

        perception = self.listening.perception
        mel = perception.log_mel(mx.array(wave))
        stepwise = mel.shape[1] > STEPWISE_MEL_FRAMES
        audio_embeds, lengths, encoded = perception(mel, stepwise=stepwise)
        mx.eval(audio_embeds, encoded)
        perception_syncs = 2 + len(perception.encoder.layers) if stepwise else 1
        frames = int(lengths[0].item()) if lengths is not None else audio_embeds.shape[1]
        audio_embeds, encoded = audio_embeds[:, :frames], encoded[:, :frames]
        # The transcript depends on nothing after the encoder: its sequential loop runs on a CPU
        # stream of its own, beside the timeline, and is read back at the end.
        transcript = greedy_table(encoded, self.listening.rnnt_decoder, self.listening.rnnt_joint, c.rnnt_blank_id,
                                  c.audio_config.max_symbols, stream=self._transcript_stream,
                                  weights=self._transcript_weights)
        mx.async_eval(transcript)
        lap("perception_s")

        tts = self.ear_tts
        threaded = self.tts_thread and pipelined
        with mx.stream(self._tts_stream if threaded else self._timeline_stream):
            tts_cache = tts.make_cache()
            previous_code = tts.warmup(self.speaking.audio_prompt_latents[c.speaker], self.warmup_codes(), tts_cache)
        mx.eval(previous_code)
        lap("tts_warmup_s")

        text_ids, function_ids, codes, syncs = self._timeline(
            audio_embeds, ids, previous_code, tts_cache, seed, progress, plain=not pipelined, threaded=threaded)
        # The TTS's K/V buffers (0.26 GB at full size for 30 s, 0.8 GB for 120 s) are not needed
        # by the codec: free them before it runs rather than at return.
        del tts_cache, previous_code, audio_embeds, mel
        lap("timeline_s")

        codes = codes[prompt_frames:]  # [frames, Q]
        wave_out = self._decode_audio(codes)
        lap("codec_s")

        user = decode_pieces(emitted_tokens(transcript), self.rnnt_pieces)
        lap("transcript_s")  # only what is left of the transcript once the audio is done

        text_ids = text_ids[prompt_frames:]
        function_ids = function_ids[prompt_frames:]
        skip = {c.pad_token_id, c.silence_token_id, c.bos_token_id, c.eos_token_id}
        timings["generate_s"] = sum(timings.values())
        return Result(
            user_transcript=user,
            text=self.tokenizer.decode(text_ids, skip=skip).strip(),
            function_text=self.tokenizer.decode(function_ids, skip=skip).strip(),
            audio=wave_out,
            sample_rate=c.output_sample_rate,
            text_tokens=text_ids,
            function_tokens=function_ids,
            audio_codes=codes.tolist(),
            timings=timings,
            frames=frames,
            prompt_frames=prompt_frames,
            host_syncs=syncs + perception_syncs + 3,  # + warmup, codec and transcript: one wait each
            peak_memory_gb=peaks,
        )

    def _timeline(self, audio_embeds, ids, previous_code, tts_cache, seed, progress, plain=False, threaded=False):
        """The frame loop. Returns (text ids, function ids, codes [T, Q] numpy, host syncs).

        `plain`: wait for every frame and pass its ids back as Python ints (the straightforward
        loop, kept so tests can hold the pipelined one to it). `threaded`: the TTS steps are built on
        a worker thread (`TTSThread`) fed each frame's text id."""
        c = self.config
        q = c.tts_config.num_quantizers
        prompt_frames, frames = len(ids), audio_embeds.shape[1]
        total = prompt_frames + frames
        code_out: list[mx.array] = [mx.zeros((1, 1, q), dtype=mx.int32)]  # no TTS at t = 0
        syncs = 0
        worker = TTSThread(self.ear_tts, self._tts_stream, self.speaking.codec_silence_tokens, SYNC_EVERY,
                           self._worker_thread()) if threaded else None
        try:
            loop = FrameLoop(self.listening, self.ear_tts, self._timeline_stream, c.pad_token_id,
                             self.speaking.codec_silence_tokens, previous_code, tts_cache, seed, worker, plain)
            text_out, prompt_codes = loop.prompt(ids)
            function_out = list(text_out)
            code_out += prompt_codes
            for i in range(frames):
                text_id, function_id, code = loop.step(audio_embeds, i)
                text_out.append(text_id)
                function_out.append(function_id)
                if code is not None:
                    code_out.append(code)
                if (i + 1) % SYNC_EVERY == 0:  # (the worker bounds its own half)
                    with mx.stream(self._timeline_stream):
                        if worker is None:
                            mx.eval(text_id, loop.previous_code)
                        else:  # (not the worker's code: an array two threads read is a race, see tts_thread.py)
                            mx.eval(text_id)
                    syncs += 1
                if progress is not None:
                    progress(prompt_frames + i + 1, total)
        except BaseException:  # (an interrupt, or the progress callback's error): no more TTS steps
            if worker is not None:
                worker.abort()
            raise
        if worker is not None:
            codes, worker_syncs = worker.finish()
            code_out += codes
            syncs += worker_syncs

        text = mx.concatenate(text_out).tolist()
        function = mx.concatenate(function_out).tolist()
        codes = np.array(mx.concatenate(code_out, axis=1)[0])  # [T, Q]
        return text, function, codes, syncs + loop.syncs + 1

    def _decode_audio(self, codes: np.ndarray) -> np.ndarray:
        """Control codes -> silence codes, then the codec over the whole answer."""
        codes = np.where(np.isin(codes, self._control_codes), self._silence_codes[None, :], codes)
        wave = self.speaking.audio_codec.decode(mx.array(codes.T[None].astype(np.int32)))
        return np.array(wave[0].astype(mx.float32))

    # ------------------------------------------------------------------ reference

    def text_ids_full_history(self, audio, system_prompt: str | None = None, extra_decoding_seconds: float = EXTRA_DECODING_SECONDS,
                              *, sample_rate: int | None = None) -> tuple[list[int], list[int]]:
        """Text and function ids recomputed over the whole history at every position, no caches.

        Slow (quadratic): kept as the reference the cached loop is tested against.
        """
        c = self.config
        stt = self.listening
        wave = self._input_audio(audio, sample_rate, extra_decoding_seconds)
        audio_embeds, lengths, _ = stt.perception(stt.perception.log_mel(mx.array(wave)))
        frames = int(lengths[0].item()) if lengths is not None else audio_embeds.shape[1]
        ids = self.prompt_ids(system_prompt)
        audio_channel = audio_embeds[:, :frames]
        if ids:
            audio_channel = mx.concatenate([stt.embed(mx.array([ids], dtype=mx.int32)), audio_channel], axis=1)
        text = [c.pad_token_id] * len(ids)
        function = [c.pad_token_id] * len(ids)
        for t in range(len(ids), len(ids) + frames):
            prev_text = mx.array([[c.pad_token_id] + text], dtype=mx.int32)  # position s sees id s - 1
            prev_function = mx.array([[c.pad_token_id] + function], dtype=mx.int32)
            fused = stt.fused_input(prev_text, audio_channel[:, : t + 1], prev_function)
            out = stt.step(fused, None)
            text.append(int(out.text_ids.item()))
            function.append(int(out.function_ids.item()))
        return text[len(ids):], function[len(ids):]


def _checked_seed(seed) -> int:
    # (a negative seed would reach mx.random.key as a TypeError after the encoder ran)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
        raise InputError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def load(path_or_id: str | os.PathLike | Checkpoint, *, progress: Callable[[str], None] | None = None,
         warmup: bool = False) -> VoiceChat:
    """Open a checkpoint directory or hub id and build a ready VoiceChat (weights in memory).

    A `Checkpoint` passed in is used up: its tensors are released once the model holds them.
    `progress(stage)` is called as each stage begins: "opening the checkpoint", "reading weights"
    (every tensor read, on several threads: `Checkpoint.read`; the listening model's converted),
    "char table" (the speaking model's converted, and EAR-TTS's char table computed over the
    vocabulary or read from its disk cache: `voicechat.char_table_cache`), "speaker prompt" (the
    codec encodes the TTS warmup's silence), and with `warmup` "warming up": one short generate on
    dummy audio (`precompile.warm_generate`), so that this process's first generate runs at warm
    speed (it compiles every kernel the caches lack)."""
    release_mlx_state_at_thread_exit()  # any thread may call this (tts_thread.py says why)
    say = progress or (lambda stage: None)
    say("opening the checkpoint")
    checkpoint = path_or_id if isinstance(path_or_id, Checkpoint) else \
        open_checkpoint(path_or_id, readers=default_readers())
    config = checkpoint.config
    # tokenizer.json (131072 ids) is parsed on a thread of its own while the LLM's weights are read
    # (mx.eval lets go of the GIL).
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_job = pool.submit(TextTokenizer, Path(checkpoint.path) / "tokenizer.json")
        model = VoiceChatModel(config)
        checkpoint.load_into(model, "")
        say("reading weights")
        checkpoint.read()  # on several threads (checked against the model first: no read is wasted)
        prepare_listening(model.stt_model)
        mx.eval(model.stt_model.parameters())
        tokenizer = tokenizer_job.result()
    if tokenizer.vocab_size > config.text_config.vocab_size:
        raise InputError(f"tokenizer.json has {tokenizer.vocab_size} ids but the model only "
                         f"{config.text_config.vocab_size}")
    pieces = load_rnnt_pieces(checkpoint.path, config.rnnt_vocabulary, config.audio_config.decoder.vocab_size)
    say("char table")
    prepare_tts(model.tts_model.tts_model, tokenizer)
    mx.eval(model.parameters())
    checkpoint.release()  # the model holds what it uses; converted tensors would stay twice
    chat = VoiceChat(checkpoint, model, tokenizer, pieces)
    say("speaker prompt")
    chat.warmup_codes()
    evaluate_held(model)
    if warmup:
        from .precompile import warm_generate

        say("warming up")
        warm_generate(chat)
    return chat
