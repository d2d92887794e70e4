"""Compiling ahead of time: every kernel a model's `generate` needs, compiled once on dummy inputs.

    chat = voicechat.load(path)
    voicechat.precompile(chat, progress=print)   # or: vc-generate -m PATH --precompile

A first run compiles kernels for minutes: MLX JIT-compiles its own ops and every fused graph
(NVRTC on a CUDA GPU, the system C++ compiler on a CPU), and our CUDA kernels compile through
NVRTC (`csrc/cuda/own_launch.h`). All of it lands in disk caches (MLX_PTX_CACHE_DIR, VOICECHAT_CUBIN_DIR,
on a CPU $TMPDIR/mlx), so it is paid once per machine: `precompile` pays it up front, on dummy
inputs, in parallel where MLX allows, and says how far it is (`progress`).

What runs:
- our CUDA kernels first, side by side: the LLM step, the TTS step and the speech encoder are
  traced once on a thread of their own with our launch in discovery (`csrc/cuda/own_launch.h`: nothing
  compiles or launches, each kernel's text is recorded), and the texts the cubin cache lacks
  compile on a pool of one thread a CPU core (`compile_kernel_texts`);
- then MLX's kernels, part by part. Where the checkpoint is on disk and the machine has the cores
  and memory (`worker_processes`), each part (`PROCESS_PARTS`) runs in a worker process of its
  own (`python -m voicechat.precompile --worker`), which loads the checkpoint and compiles into a
  kernel cache of its own, merged into the shared one as it ends. Else they run as threads here
  (`PARTS`): the timeline on the calling thread (the system-prompt prefill and the LLM's compiled
  decode parts, the TTS warmup and compiled step on the thread generate steps it on), the speech
  encoder with the RNNT transcript loop and the codec's decode window on threads of their own.
  Either way the LLM and the TTS also run once at a K/V capacity past 1024 slots (the decode
  attention kernels' split form, inputs of 82 s and more) and the speech encoder past 30 s (a layer
  at a time), unless `long_inputs` is off;
- last, on the calling thread, one short `generate`: it finds every kernel compiled and warms what
  MLX keeps per thread, so that the caller's next `generate` runs at warm speed;
- with `live`, then a short live session of silence (`warm_live`): the live path's own shapes
  (the streamed encoder's compiled chunk, one shape from the first frame; the streamed codec).
  It casts perception's and the codec decoder's weights to float32 as any live session does
  (1.4 GB more at full size), so `vc-generate --precompile`, which exits after it, asks for it,
  and a first run's precompile before a `generate` does not.

What MLX-CUDA 0.32.4 allows at once, and so the rules here:
- MLX's JIT cache is one per process behind one lock held over the whole NVRTC compile
  (`get_jit_module`): two threads of a process never compile MLX kernels at the same time (a
  thread that builds graphs, encodes launches or compiles our kernels runs beside one that does).
  Its CPU backend holds one lock over each compiler run the same way. Only processes compile MLX's
  kernels side by side.
- MLX writes its disk cache in place (no temporary name; a kernel file first, the names of its
  kernels after): processes that share a cache folder may read each other's half-written files. So
  each worker compiles into a folder of its own, seeded with links to the shared folder's files (MLX
  writes only files it lacks), and its new files are moved into the shared folder whole (a link
  under a temporary name, renamed; MLX's kernel files last), never over one that is there.
- Our kernels compile outside our own lock and with Python's GIL released (`loaded_function` in
  csrc/cuda/own_launch.cpp, and `ext.nvrtc_cubin`): distinct kernels compile on several threads at once,
  one NVRTC program each; a cubin file is written under a temporary name and renamed, so processes
  share the cubin folder.
- MLX keeps per thread: the compile cache of `mx.compile` (a graph traced on one thread is traced
  again on another), the cuDNN plan caches of convolutions and attention, the cuBLAS and cuDNN
  handles, the command encoders. So the compiled LLM decode runs on the calling thread and the TTS
  step on the thread that generate steps it on, and the final `generate` warms the rest.
- Parts that run as threads read disjoint weights (no array is read by two threads at once:
  tts_thread.py), and each thread evaluates on its own default stream.

The ids and codes a later `generate` gives do not depend on whether `precompile` ran (tested).
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .audio import load_audio
from .session import STEPWISE_MEL_FRAMES, VoiceChat
from .stt.rnnt import emitted_tokens, greedy_table
from .tts_thread import WorkerThread

# The parts when they run as threads of this process (`PROCESS_PARTS` in worker processes); the
# last with `live` only.
PARTS = ("our kernels", "timeline", "speech encoder", "codec", "long context", "warm generate", "live session")
# Frames of the live warm-up: every chunk of the live path has one shape from the first frame; a
# few more than one trace and warm what MLX keeps per thread.
LIVE_FRAMES = 12
# Seconds of the dummy input of the timeline and the warm generate.
DUMMY_SECONDS = 2.0
# K/V slots from which the decode attention kernels take their split form (csrc/ops/decode_attention.cpp)
SPLIT_CAPACITY = 1025


@dataclass
class Progress:
    """Where a `precompile` is: parts done of `total`, the part last started or finished, kernels
    compiled so far (new files in the kernel caches) and seconds since it began."""

    done: int
    total: int
    part: str
    kernels: int
    elapsed: float
    finished: bool = False
    own_compiled: int = 0  # of our kernels the cache lacked (`own_total`), compiled so far
    own_total: int = 0


def kernel_cache_folders() -> list[Path]:
    """The folders compiled kernels land in: MLX's (MLX_PTX_CACHE_DIR on a CUDA GPU, its CPU
    compiler's $TMPDIR/mlx/<version>/cpu) and ours (VOICECHAT_CUBIN_DIR)."""
    folders = []
    if mx.default_device() == mx.gpu and os.environ.get("MLX_PTX_CACHE_DIR"):
        folders.append(Path(os.environ["MLX_PTX_CACHE_DIR"]))
    else:
        folders.append(Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu")
    if os.environ.get("VOICECHAT_CUBIN_DIR"):
        folders.append(Path(os.environ["VOICECHAT_CUBIN_DIR"]))
    return folders


_KERNEL_SUFFIXES = (".ptx", ".cubin", ".so")


def count_kernels(folders: list[Path] | None = None) -> int:
    """Compiled kernel files in the kernel caches (MLX's .ptx / .so, our .cubin)."""
    n = 0
    for folder in kernel_cache_folders() if folders is None else folders:
        for _, _, files in os.walk(folder):
            n += sum(1 for f in files if f.endswith(_KERNEL_SUFFIXES))
    return n


def dummy_audio(seconds: float, rate: int = 16000) -> np.ndarray:
    """The bundled spoken question cut or padded with silence to `seconds`."""
    question = load_audio(str(resources.files("voicechat") / "data" / "question.wav"), rate)
    out = np.zeros(int(seconds * rate), np.float32)
    out[: min(len(out), len(question))] = question[: len(out)]
    return out


def own_launch_active() -> bool:
    """Whether our kernels launch through our own launch here, with a cubin cache to fill."""
    from .kernels import kernel_launch

    return kernel_launch()["launch"] == "own" and bool(os.environ.get("VOICECHAT_CUBIN_DIR"))


def discover_own_kernels(chat: VoiceChat, long_inputs: bool = True) -> list[tuple[str, str]]:
    """The (text, arch) of each of our CUDA kernels that `chat`'s generate launches and the cubin
    cache lacks: the LLM step (after a system-prompt prefill), the TTS step and the speech encoder
    traced on a thread of their own with our launch in discovery, never evaluated. Empty where our
    own launch does not run (a CPU, MLX's launch, no cubin folder)."""
    from .kernels import ext
    from .llm.nemotron_h import _nothing_pending

    if not own_launch_active():
        return []
    _nothing_pending()  # cached for the process: made here, not on the thread that ends below
    errors: list[BaseException] = []

    def trace() -> None:
        ext.own_launch_discovery(True)
        try:
            _trace_for_discovery(chat, long_inputs)
        except BaseException as e:  # raised again on the caller's thread
            errors.append(e)
        finally:
            ext.own_launch_discovery(False)

    tracer = WorkerThread()  # its compile cache (traces holding discovery's zeros) ends with it
    try:
        tracer.submit(trace).wait()
    finally:
        tracer.close()
    found = ext.own_launch_discovered()
    if errors:
        raise errors[0]
    if found:  # the copy our launch makes of a non-contiguous input, compiled at its first eval
        arch = found[0][1]
        copy = ext.strided_copy_text(arch)
        path = Path(os.environ["VOICECHAT_CUBIN_DIR"]) / f"{ext.own_kernel_file_name(copy)}.cubin"
        if ext.read_cached_cubin(str(path), copy) is None:
            found.append((copy, arch))
    return [tuple(f) for f in found]


def _trace_for_discovery(chat: VoiceChat, long_inputs: bool) -> None:
    """The graphs whose kernels discovery records, built on this thread's stream and dropped
    (never evaluated)."""
    for capacity in [0, SPLIT_CAPACITY] if long_inputs else [0]:
        _llm_steps(chat, capacity, 2, evaluate=False)
        _tts_steps(chat, capacity, 1, evaluate=False)
    c = chat.config
    perception = chat.listening.perception
    perception(perception.log_mel(mx.array(dummy_audio(DUMMY_SECONDS, c.input_sample_rate))))


def _llm_steps(chat: VoiceChat, capacity: int, steps: int, evaluate: bool = True) -> None:
    """The LLM as generate runs it on dummy audio: with `capacity` 0 a 3-position system prompt's
    prefill, else K/V buffers of `capacity` slots; then `steps` compiled decode steps. `evaluate`:
    on the timeline's stream, queued and settled as generate does; else only built."""
    c = chat.config
    stt, t = chat.listening, c.text_config
    pad = mx.array([[c.pad_token_id]], mx.int32)
    audio = mx.zeros((1, 1, t.hidden_size), mx.float32)
    with mx.stream(chat._timeline_stream if evaluate else mx.default_stream(mx.default_device())):
        cache = stt.make_cache()
        if capacity:
            for entry in cache:
                if hasattr(entry, "reserve"):
                    entry.reserve(capacity, 1, t.num_key_value_heads, t.head_dim)
        else:
            prompt = stt.embed(mx.array([[c.bos_token_id, c.bos_token_id, c.eos_token_id]], mx.int32))
            stt.step(stt.fused_input(mx.broadcast_to(pad, (1, 3)), prompt, mx.broadcast_to(pad, (1, 3))), cache)
        text, function = pad, pad
        for _ in range(steps):
            text, function = stt.decode(text, audio, function, cache, queue=evaluate)
            if evaluate:
                mx.async_eval(text, function)
            text, function = text[None], function[None]
        if evaluate:
            mx.eval(text, cache.state)


def _tts_steps(chat: VoiceChat, capacity: int, steps: int, evaluate: bool = True) -> None:
    """The TTS as generate runs it: the warmup, K/V buffers of `capacity` slots if not 0, then
    `steps` compiled steps on pad. `evaluate`: on generate's TTS stream (call it on the thread
    generate steps the TTS on: `_on_tts_thread`); else only built."""
    c = chat.config
    tts = chat.ear_tts
    stream = (chat._tts_stream if chat.tts_thread else chat._timeline_stream) if evaluate \
        else mx.default_stream(mx.default_device())
    with mx.stream(stream):
        cache = tts.make_cache()
        previous = tts.warmup(chat.speaking.audio_prompt_latents[c.speaker], chat.warmup_codes(), cache)
        if capacity:
            cache.reserve(capacity, 2)
        key, text = mx.random.key(0), mx.array([c.pad_token_id], mx.int32)
        for _ in range(steps):
            previous, key = tts.step(previous, text, cache, key, chat.speaking.codec_silence_tokens)
            if evaluate:
                mx.async_eval(previous, key)
        if evaluate:
            mx.eval(previous, key, cache.state)


def compile_kernel_texts(texts: list[tuple[str, str]], threads: int | None = None,
                         done: Callable[[int], None] | None = None) -> list[str]:
    """Compiles each (text, arch) with NVRTC into the cubin cache (VOICECHAT_CUBIN_DIR), on
    `threads` threads (default: one a CPU core), skipping those it holds already; `done(n)` after
    each. Returns the errors (one line each): a kernel that does not compile here is left to the
    launch, which compiles it again and says what failed."""
    from concurrent.futures import ThreadPoolExecutor

    from .kernels import ext

    folder = Path(os.environ.get("VOICECHAT_CUBIN_DIR") or "")
    if not texts or not str(folder) or str(folder) == ".":
        return []
    finished, errors, lock = [0], [], threading.Lock()

    def one(item: tuple[str, str]) -> None:
        text, arch = item
        path = str(folder / f"{ext.own_kernel_file_name(text)}.cubin")
        try:
            if ext.read_cached_cubin(path, text) is None:
                ext.write_cached_cubin(path, text, ext.nvrtc_cubin(text, arch))
        except Exception as e:  # (RuntimeError from NVRTC, OSError from the cache)
            lines = [line for line in str(e).splitlines() if line.strip()]
            with lock:
                errors.append(" ".join(lines[:2]))  # what failed, and NVRTC's first line about it
        with lock:
            finished[0] += 1
            n = finished[0]
        if done is not None:
            done(n)

    workers = max(1, min(len(texts), threads or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="voicechat-nvrtc") as pool:
        list(pool.map(one, texts))
    return errors


def _marker(chat: VoiceChat) -> Path:
    """The file a finished `precompile` leaves for this model's shapes, this code, this MLX, this
    device and these kernel cache folders (emptied folders are not seen: the caches then fill again
    as generate runs)."""
    import hashlib
    import json

    from . import cache_root
    from .char_table_cache import code_digest, device_text

    env = {k: os.environ.get(k, "") for k in ("MLX_PTX_CACHE_DIR", "VOICECHAT_CUBIN_DIR", "VOICECHAT_OWN_LAUNCH",
                                               "VOICECHAT_REFERENCE", "TMPDIR")}
    what = json.dumps([chat.config.to_dict(), code_digest(), mx.__version__, device_text(), env], sort_keys=True,
                      default=str)
    return Path(cache_root()) / "voicechat" / "precompiled" / f"{hashlib.sha256(what.encode()).hexdigest()}.json"


def is_precompiled(chat: VoiceChat) -> bool:
    """Whether `precompile` finished for this model here (see `_marker`): vc-generate's first run on
    a CUDA GPU precompiles when it did not."""
    return _marker(chat).is_file()


def _mark_precompiled(chat: VoiceChat, last: "Progress") -> None:
    import json

    from .files import output_file

    path = _marker(chat)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with output_file(path) as f:
            json.dump({"seconds": last.elapsed, "kernels": last.kernels, "own_kernels": last.own_total}, f)
    except OSError:  # a cache folder that cannot be written costs the next run another precompile
        pass


def first_run_here(chat: VoiceChat) -> bool:
    """Whether a front end compiles ahead (`precompile`, side by side) before its first work: on a
    CUDA GPU where no precompile finished for this model. VOICECHAT_PRECOMPILE=0: never (the
    kernels then compile one by one as they are met); =1: wherever none finished, on any device."""
    from .kernels.gemv import on_cuda_gpu

    flag = os.environ.get("VOICECHAT_PRECOMPILE", "")
    return flag != "0" and (flag == "1" or on_cuda_gpu()) and not is_precompiled(chat)


def compile_ahead(chat: VoiceChat, say: Callable[[str], None], live: bool = True) -> bool:
    """On a first run (`first_run_here`), `precompile` without the long inputs' shapes (with the
    live path's where `live`), each part and every few seconds said in a line; returns whether it
    ran. What the live front ends (vc-chat -m, vc-serve) do before their first conversation."""
    if not first_run_here(chat):
        return False
    said = {"done": -1, "at": 0.0}

    def progress(p: Progress) -> None:
        if not p.finished and (p.done != said["done"] or p.elapsed - said["at"] >= 5.0):
            said.update(done=p.done, at=p.elapsed)
            say(f"compiling kernels for this model (first run only): {p.done}/{p.total} parts done, "
                f"{p.kernels} kernels compiled, {p.elapsed:.0f} s")

    last = precompile(chat, progress=progress, long_inputs=False, live=live)
    say(f"precompiled: {last.kernels} kernels compiled in {last.elapsed:.1f} s; later runs read them from the caches")
    return True


def warm_generate(chat: VoiceChat, seconds: float = DUMMY_SECONDS) -> None:
    """One short `generate` on the calling thread (with a system prompt): a fresh process's next
    `generate` then runs at warm speed (what MLX keeps per thread is made here)."""
    chat.generate(dummy_audio(seconds, chat.config.input_sample_rate), system_prompt="Hi.",
                  sample_rate=chat.config.input_sample_rate, extra_decoding_seconds=0.0)


def warm_live(chat: VoiceChat, frames: int = LIVE_FRAMES) -> None:
    """A live session of `frames` 80 ms chunks of silence on the calling thread, then its end."""
    rate = chat.config.input_sample_rate
    chunk = np.zeros(int(round(rate * chat.config.frame_duration)), np.float32)
    with chat.live() as live:
        for _ in range(frames):
            live.push(chunk, sample_rate=rate)
        live.finish(0.0)


def _speech_encoder(chat: VoiceChat, long_inputs: bool) -> None:
    """The encoder at a short length (and past STEPWISE_MEL_FRAMES), and the transcript loop."""
    c = chat.config
    perception = chat.listening.perception
    lengths = [DUMMY_SECONDS]
    if long_inputs:
        hop = c.audio_config.preprocessor.hop_length
        lengths.append((STEPWISE_MEL_FRAMES + 8) * hop / c.input_sample_rate)
    for seconds in lengths:
        mel = perception.log_mel(mx.array(dummy_audio(seconds, c.input_sample_rate)))
        embeds, _, encoded = perception(mel, stepwise=mel.shape[1] > STEPWISE_MEL_FRAMES)
        mx.eval(embeds, encoded)
    transcript = greedy_table(encoded[:, :8], chat.listening.rnnt_decoder, chat.listening.rnnt_joint,
                              c.rnnt_blank_id, c.audio_config.max_symbols,
                              stream=mx.new_thread_unsafe_stream(mx.cpu), weights=chat._transcript_weights)
    emitted_tokens(transcript)


def _codec(chat: VoiceChat) -> None:
    """The codec's decode over a few windows of silence codes."""
    frames = int(round(DUMMY_SECONDS / chat.config.frame_duration))
    # (the host copy of the silence codes: the TTS reads the array itself on another thread meanwhile)
    codes = np.broadcast_to(chat._silence_codes, (frames, chat.config.tts_config.num_quantizers))
    chat._decode_audio(np.ascontiguousarray(codes))


def _timeline(chat: VoiceChat) -> None:
    """The system-prompt prefill and the frame loop on dummy audio embeddings, on generate's threads
    and streams (the LLM here, the TTS on its worker where generate puts it there)."""
    c = chat.config
    frames = int(round(DUMMY_SECONDS / c.frame_duration))
    threaded = chat.tts_thread
    tts = chat.ear_tts
    with mx.stream(chat._tts_stream if threaded else chat._timeline_stream):
        tts_cache = tts.make_cache()
        previous = tts.warmup(chat.speaking.audio_prompt_latents[c.speaker], chat.warmup_codes(), tts_cache)
    mx.eval(previous)
    embeds = mx.zeros((1, frames, c.text_config.hidden_size), mx.float32)
    chat._timeline(embeds, chat.prompt_ids("Hi."), previous, tts_cache, 0, None, threaded=threaded)


def _long_context(chat: VoiceChat) -> None:
    """One LLM decode step and one TTS step with K/V buffers past SPLIT_CAPACITY slots."""
    _llm_steps(chat, SPLIT_CAPACITY, 1)
    _on_tts_thread(chat, lambda: _tts_steps(chat, SPLIT_CAPACITY, 1))


def _on_tts_thread(chat: VoiceChat, job: Callable[[], None]) -> None:
    """Runs `job` where generate steps the TTS: its worker thread, or here."""
    if not chat.tts_thread:
        job()
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            job()
        except BaseException as e:  # raised again on the caller's thread
            errors.append(e)

    chat._worker_thread().submit(run).wait()
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- parts in processes

# The parts worker processes run (each process has MLX's JIT lock to itself), heaviest first.
PROCESS_PARTS = ("llm", "tts", "codec", "speech encoder")


def _run_part(chat: VoiceChat, part: str, long_inputs: bool) -> None:
    frames = int(round(DUMMY_SECONDS / chat.config.frame_duration))
    capacities = [0, SPLIT_CAPACITY] if long_inputs else [0]
    if part == "llm":
        for capacity in capacities:
            _llm_steps(chat, capacity, 1 if capacity else frames)
    elif part == "tts":
        _on_tts_thread(chat, lambda: [_tts_steps(chat, capacity, 1 if capacity else frames) for capacity in capacities])
    elif part == "codec":
        _codec(chat)
    elif part == "speech encoder":
        _speech_encoder(chat, long_inputs)
    else:
        raise ValueError(f"no precompile part named {part!r}")


def worker_processes(chat: VoiceChat) -> int:
    """How many processes `precompile` spreads the parts over (0: threads of this one). Only where
    the checkpoint is on disk (a worker loads it whole). VOICECHAT_PRECOMPILE_PROCESSES=N sets the
    number (0: none; at most one a part); else as many as parts, CPU cores (one left to this
    process) and memory allow (each worker holds the model once more: on a GPU its free memory,
    else the free RAM), if two or more (one worker would only add its load to the same serial
    compiles; on 2 cores the workers' loads and the kernels each compiles for itself cost more than
    they overlap)."""
    from .checkpoint import CheckpointError, safetensors_files

    value = os.environ.get("VOICECHAT_PRECOMPILE_PROCESSES", "")
    if value and not value.isdigit():
        raise ValueError(f"VOICECHAT_PRECOMPILE_PROCESSES is {value!r}: use a whole number (0: threads only)")
    try:
        safetensors_files(Path(chat.checkpoint.path))
    except CheckpointError:  # weights made in memory (`synthetic.random_checkpoint`): no process can load them
        return 0
    if value:
        return min(int(value), len(PROCESS_PARTS))
    if mx.default_device() == mx.gpu:
        free = int(mx.device_info().get("free_memory", 0))
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    fits = int(max(0, free - 2 * 2**30) // max(1, int(1.25 * chat.checkpoint.nbytes)))
    count = min(len(PROCESS_PARTS), fits, (os.cpu_count() or 1) - 1)
    return count if count >= 2 else 0


def _mlx_cache(env: dict[str, str]) -> Path:
    """MLX's kernel cache folder in a process with environment `env` (kernel_cache_folders' first)."""
    if mx.default_device() == mx.gpu and env.get("MLX_PTX_CACHE_DIR"):
        return Path(env["MLX_PTX_CACHE_DIR"])
    return Path(env.get("TMPDIR") or tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def _files(folder: Path) -> list[Path]:
    """Every file below `folder` (relative), MLX's kernel files (.ptx, .so) last: a reader finds a
    kernel file only once the files that go with it are there."""
    found = [Path(root, f).relative_to(folder) for root, _, files in os.walk(folder) for f in files
             if not f.endswith(".tmp")]
    return sorted(found, key=lambda p: (p.suffix in _KERNEL_SUFFIXES, str(p)))


_temp_names = itertools.count()


def _place(source: Path, target: Path) -> None:
    """`source`'s bytes at `target`, which appears whole (a link or copy under a temp name, renamed)."""
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    # (short: MLX's own names run up to 245 characters of the 255 a name may have)
    tmp = target.with_name(f".vc-{os.getpid()}-{next(_temp_names)}.tmp")
    try:
        try:
            os.link(source, tmp)
        except OSError:  # (another file system)
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def merge_kernel_cache(private: Path, shared: Path) -> int:
    """Moves the kernel files a worker compiled in `private` into `shared`, each whole (MLX writes
    its own in place, so a worker compiles into a folder of its own); files `shared` has are kept.
    Returns how many files were added."""
    added = 0
    for rel in _files(private):
        if not (shared / rel).exists():
            _place(private / rel, shared / rel)
            added += 1
    return added


def _seed_kernel_cache(shared: Path, private: Path) -> None:
    """`private` starts with `shared`'s files (links where one file system holds both): a worker
    compiles only what is not there yet, and MLX writes only files it lacks."""
    for rel in _files(shared) if shared.is_dir() else []:
        _place(shared / rel, private / rel)


def _run_in_processes(chat: VoiceChat, count: int, long_inputs: bool, extra_folders: list[tuple[Path, int]],
                      finished: Callable[[str], None]) -> list[str]:
    """PROCESS_PARTS on `count` worker processes (`python -m voicechat.precompile --worker`), each
    loading the checkpoint and compiling into a kernel cache of its own, merged into this one's as
    it ends. Returns one line for each worker that failed (what it compiled is kept all the same)."""
    import shutil
    import subprocess

    groups = [list(PROCESS_PARTS[i::count]) for i in range(count)]
    shared = _mlx_cache(dict(os.environ))
    shared.mkdir(parents=True, exist_ok=True)
    workers = []
    try:
        for parts in groups:
            root = Path(tempfile.mkdtemp(prefix=".voicechat-precompile-", dir=shared.parent))
            env = dict(os.environ)
            if mx.default_device() == mx.gpu:
                env["MLX_PTX_CACHE_DIR"] = str(root / "ptx")
            else:
                env["TMPDIR"] = str(root)
            private = _mlx_cache(env)
            _seed_kernel_cache(shared, private)
            extra_folders.append((private, count_kernels([private])))
            cmd = [sys.executable, "-m", "voicechat.precompile", "--worker", ",".join(parts),
                   "--model", str(chat.checkpoint.path)] + (["--long-inputs"] if long_inputs else [])
            with open(root / "stderr", "w") as err:  # (a file: a full pipe would stall the worker)
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
            workers.append((proc, parts, root, private))
        failures = []
        running = list(workers)
        while running:  # each worker as it ends (progress says so then, its kernels merged then)
            ended = [w for w in running if w[0].poll() is not None]
            if not ended:
                time.sleep(0.05)
                continue
            proc, parts, root, private = ended[0]
            running.remove(ended[0])
            if proc.returncode != 0:
                err = (root / "stderr").read_text(errors="replace")
                last = [line for line in err.splitlines() if line.strip()][-1:] or [f"exit {proc.returncode}"]
                failures.append(f"{', '.join(parts)}: {last[0]}")
            extra_folders[:] = [(f, n) for f, n in extra_folders if f != private]  # (counted in `shared` now)
            merge_kernel_cache(private, shared)
            for part in parts:
                finished(part)
        return failures
    finally:
        for proc, _, root, private in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            extra_folders[:] = [(f, n) for f, n in extra_folders if f != private]
            shutil.rmtree(root, ignore_errors=True)


def _worker(argv: list[str]) -> int:
    """`python -m voicechat.precompile --worker PARTS --model DIR [--long-inputs]`: one worker."""
    import argparse

    from .session import load

    p = argparse.ArgumentParser(prog="python -m voicechat.precompile")
    p.add_argument("--worker", required=True, help="parts, comma-separated: " + ", ".join(PROCESS_PARTS))
    p.add_argument("--model", required=True)
    p.add_argument("--long-inputs", action="store_true")
    args = p.parse_args(argv)
    with load(args.model) as chat:
        for part in args.worker.split(","):
            _run_part(chat, part, args.long_inputs)
    return 0


# --------------------------------------------------------------------------- precompile


def precompile(chat: VoiceChat, progress: Callable[[Progress], None] | None = None, *,
               long_inputs: bool = True, processes: int | None = None, every: float = 0.5,
               live: bool = False) -> Progress:
    """Run every part of `chat`'s generate once on dummy inputs (`PARTS`), so that the kernels it
    needs are compiled and kept in the disk caches, and this process's next `generate` runs at
    warm speed. `progress(Progress)` is called from a thread of its own every `every` seconds and
    whenever a part ends (the last call has `finished`). `long_inputs`: also the shapes of inputs
    past 30 s (the encoder a layer at a time) and 82 s (split attention). `processes`: worker
    processes for the parts (default `worker_processes(chat)`; 0: threads of this process).
    `live`: also a live session of silence (`warm_live`; see the module docstring for its memory).
    Returns the last Progress.

    Safe on a model in use by nobody else (it runs generate's own paths, under its lock)."""
    count = worker_processes(chat) if processes is None else processes
    folders = kernel_cache_folders()
    extra_folders: list[tuple[Path, int]] = []  # the workers' own caches while they run, and their files at start
    start, before = time.perf_counter(), count_kernels(folders)
    parts = ["our kernels", *(PROCESS_PARTS if count else [p for p in PARTS[1:-2]
                                                        if long_inputs or p != "long context"]), "warm generate",
             *(["live session"] if live else [])]
    state = {"done": 0, "part": parts[0], "own_compiled": 0, "own_total": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def snapshot(finished: bool = False) -> Progress:
        with lock:
            done, part, own, own_total = state["done"], state["part"], state["own_compiled"], state["own_total"]
            extra = list(extra_folders)
        kernels = max(0, count_kernels(folders) - before) + sum(count_kernels([f]) - n for f, n in extra)
        return Progress(done, len(parts), part, kernels, time.perf_counter() - start, finished, own, own_total)

    def report() -> None:
        while not stop.wait(every):
            progress(snapshot())

    def finished(part: str) -> None:
        with lock:
            state["done"] += 1
            state["part"] = part
        if progress is not None:
            progress(snapshot())

    ticker = threading.Thread(target=report, name="voicechat-precompile-progress", daemon=True)
    if progress is not None:
        ticker.start()
    helpers = [WorkerThread(), WorkerThread()]
    errors: list[BaseException] = []
    failed: list[str] = []

    def job(fn: Callable[[], None], part: str) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
                finished(part)
            except BaseException as e:
                errors.append(e)
        return run

    def own_kernels(texts: list[tuple[str, str]]) -> None:
        def compiled(n: int) -> None:
            with lock:
                state["own_compiled"] = n

        not_compiled = compile_kernel_texts(texts, done=compiled)
        if not_compiled:  # the launch compiles them again, and falls back to MLX's launch if it must
            print(f"voicechat: {len(not_compiled)} of our kernels did not compile ahead ({not_compiled[0]}); their "
                  "first launch compiles them again", file=sys.stderr)

    try:
        turn = chat._begin_turn(live=False)  # (a generate or live session on another thread waits, or is refused)
        try:
            texts = discover_own_kernels(chat, long_inputs)
            with lock:
                state["own_total"] = len(texts)
            if count:  # our kernels first (the workers read them), then MLX's in the workers
                job(lambda: own_kernels(texts), "our kernels")()
                failed = _run_in_processes(chat, count, long_inputs, extra_folders, finished)
                if failed:  # (a GPU short of memory, ...): what they did not compile, generate compiles
                    print(f"voicechat: a precompile worker failed ({failed[0]}); the kernels it did not compile "
                          "compile as generate meets them", file=sys.stderr)
            else:
                # NVRTC on a pool of threads beside the codec's MLX kernels; the speech encoder (one
                # of ours) and the timeline (most of ours) after it, reading the cubins it wrote
                ours = helpers[0].submit(job(lambda: own_kernels(texts), "our kernels"))
                waits = [ours, helpers[0].submit(job(lambda: _speech_encoder(chat, long_inputs), "speech encoder")),
                         helpers[1].submit(job(lambda: _codec(chat), "codec"))]
                ours.wait()
                _timeline(chat)
                finished("timeline")
                if long_inputs:
                    _long_context(chat)
                    finished("long context")
                for w in waits:
                    w.wait()
            if errors:
                raise errors[0]
        finally:
            chat._end_turn(turn)
        with lock:
            state["part"] = "warm generate"
        warm_generate(chat)
        finished("warm generate")
        if live:
            with lock:
                state["part"] = "live session"
            warm_live(chat)
            finished("live session")
    finally:
        for h in helpers:
            h.close()
        stop.set()
        if progress is not None:
            ticker.join()
    last = snapshot(finished=True)
    if not failed:  # (else the next first run precompiles again)
        _mark_precompiled(chat, last)
    if progress is not None:
        progress(last)
    return last


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
