"""vc-generate: speech in, transcript + answer text + spoken answer out.

    vc-generate -m mlx-community/NemotronLabs-VoiceChat-11B-4bit --audio question.wav \\
        --output-audio answer.wav -p "Be concise and answer in one sentence."
    vc-generate --demo      # offline, on a tiny synthetic checkpoint and a bundled question
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from importlib import resources
from pathlib import Path

from .config import EXTRA_DECODING_SECONDS
from .files import OutputError, check_output, output_file, remove_pending_outputs, same_file

DEFAULT_MODEL = "mlx-community/NemotronLabs-VoiceChat-11B-4bit"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vc-generate",
        description="Run NemotronLabs VoiceChat on a WAV: prints the user's transcript and the assistant's "
                    "answer, and writes the spoken answer (22.05 kHz mono PCM16).")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"checkpoint directory or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--audio", help="input audio (any format soundfile reads, 1 to 384 kHz; resampled to 16 kHz "
                                    "mono; '-': read from stdin). With --extra-decoding-seconds and the system "
                                    "prompt it must fit the model's context: about 2.9 hours for the published "
                                    "checkpoint, about 5.5 minutes for --demo's tiny one")
    p.add_argument("--output-audio", help="where to write the spoken answer (WAV; '-': to stdout, the answer "
                                           "lines then go to stderr)")
    p.add_argument("-p", "--system-prompt", default=None, help="system prompt (empty: none)")
    p.add_argument("--extra-decoding-seconds", type=float, default=EXTRA_DECODING_SECONDS, metavar="SECONDS",
                   help=f"seconds of silence appended so the model can finish answering (default: "
                        f"{EXTRA_DECODING_SECONDS:g}; counted in the input's length)")
    p.add_argument("--seed", type=int, default=0, help="seed of the speech sampler (default: 0)")
    p.add_argument("--output-json", help="write the result (everything but the samples) and timings as JSON "
                                          "('-': to stdout, in place of the answer lines)")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="ignored: the answer is as long as the input timeline (+ extra decoding seconds)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the answer lines (no progress, no timing)")
    p.add_argument("--stream", action="store_true",
                   help="run the input through a live session, 80 ms at a time, printing each channel's text as "
                        "it arrives (same result as without)")
    p.add_argument("--realtime", action="store_true",
                   help="with --stream: feed the input (resampled to 16 kHz) and the silence after it at "
                        "wall-clock speed, and end with a latency summary")
    p.add_argument("--precompile", action="store_true",
                   help="compile every kernel the model needs on dummy inputs, keep them in the disk caches, "
                        "and exit (run once when building a package or container; needs no --audio)")
    p.add_argument("--demo", action="store_true",
                   help="run offline on a freshly made tiny synthetic checkpoint and a bundled spoken question "
                        "(random weights: shows the pipeline working, not a real answer)")
    batch = p.add_argument_group("many inputs (voicechat/batch.py)")
    batch.add_argument("--batch", metavar="INPUTS", help="answer every audio file of a folder, or every line of a "
                       "JSONL manifest (path, system_prompt, seed, extra_decoding_seconds), into --output-dir")
    batch.add_argument("--output-dir", metavar="OUT", help="with --batch: OUT/NAME.wav and OUT/NAME.json an input "
                       "(OUT and its parents are made if missing); inputs already answered there are skipped")
    batch.add_argument("--ray", action="store_true", help="with --batch: a Ray Data actor pool, a model per GPU")
    batch.add_argument("--ray-address", metavar="ADDRESS", help="with --batch: the Ray cluster to join (implies --ray)")
    batch.add_argument("--workers", type=int, help="with --batch --ray: models to run (default: the cluster's GPUs)")
    p.add_argument("--version", action=_VersionAction, nargs=0,
                   help="print voicechat's version, the mlx it runs on and how its kernels launch, and exit")
    return p


class _VersionAction(argparse.Action):
    """Deferred like the rest: mlx and the extension are imported only when asked."""

    def __call__(self, parser, namespace, values, option_string=None):
        import mlx.core as mx

        from . import __version__
        from .kernels import kernel_launch

        k = kernel_launch()
        launch = {"own": "our own launch", "mlx": "MLX's launch", None: "off (no CUDA GPU)"}[k["launch"]]
        print(f"vc-generate (voicechat {__version__}) on mlx {mx.__version__}, {mx.default_device()}; "
              f"extension built for {k['backend']}; CUDA kernels: {launch}")
        parser.exit()


def _check_outputs(args: argparse.Namespace) -> None:
    """Before anything runs: each output can be written, no two outputs are one file, and no
    output is the input (a rename over it, or a write into it, loses the other)."""
    named = [(what, path) for what, path in (("--output-audio", args.output_audio),
                                             ("--output-json", args.output_json)) if path is not None]
    for what, path in named:
        if path != "-":
            try:
                check_output(path)
            except OutputError as e:
                raise _UsageError(f"{what}: {e}") from None
    stdout = "/dev/stdout" if os.path.exists("/dev/stdout") else None

    def file_of(path: str) -> str | None:  # '-' is stdout
        return stdout if path == "-" else path

    if len(named) == 2:
        (what_a, a), (what_b, b) = named
        if a == "-" and b == "-":
            raise _UsageError(f"{what_a} - and {what_b} - both want stdout; give one of them a file")
        fa, fb = file_of(a), file_of(b)
        if fa is not None and fb is not None and same_file(fa, fb):
            raise _UsageError(f"{what_a} {a} and {what_b} {b} are the same file; give each its own")
    if args.audio and args.audio != "-":
        for what, path in named:
            out = file_of(path)
            if out is not None and same_file(out, args.audio):
                raise _UsageError(f"{what} {path} is the input file (--audio {args.audio}); give another path")


class _UsageError(ValueError):
    pass


def _write_json(path: str, data: dict) -> None:
    with output_file(path) as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _to_stdout(write) -> None:
    """`write(stdout)`, its failure (EPIPE: the reader has gone; ENOSPC) one OutputError naming
    stdout. After a failure stdout is pointed at /dev/null: the interpreter's own flush at exit
    would fail again, with a traceback."""
    try:
        write()
        sys.stdout.flush()
    except OSError as e:
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        raise OutputError(e.errno, f"cannot write stdout: {e.strerror or e}") from None


def _demo_inputs(workdir: Path) -> tuple[str, str]:
    from .synthetic import make_checkpoint

    checkpoint = make_checkpoint(workdir / "tiny-voicechat", "tiny")
    question = resources.files("voicechat") / "data" / "question.wav"
    return str(checkpoint), str(question)


class _Stages:
    """Stage lines on stderr ("load: char table: 2.3 s" as each ends), on a terminal and for
    --precompile (a build's log): a line under way ticks its seconds on a terminal (tqdm), so that
    a long stage (a first run's kernel compiles) is never silent. Precompile progress
    (`precompile.Progress`) shows parts done and kernels compiled. A stage that fails prints no
    line: a bad input stays one `error:` line (a pipe or a log sees stage lines only with
    --precompile). Without `end_lines` a stage only ticks, and is erased as it ends (generate's
    codec, after the timeline's bar)."""

    def __init__(self, enabled: bool, tty: bool, end_lines: bool = True, bar_format: str = "{desc} {elapsed}"):
        self.enabled, self.tty, self.end_lines, self.bar_format = enabled, tty, end_lines, bar_format
        self.name: str | None = None
        self.start = 0.0
        self.bar = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._parts_said = -1  # the parts done when a plain progress line was last printed

    def __call__(self, name: str) -> None:
        self.end()
        if not self.enabled:
            return
        with self._lock:
            self.name, self.start = name, time.perf_counter()
            if self.tty:
                from tqdm import tqdm

                self.bar = tqdm(desc=name, bar_format=self.bar_format, file=sys.stderr, leave=False)
        if self.tty and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="vc-generate-stages", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                if self.bar is not None:
                    self.bar.refresh()

    def compile_progress(self, p) -> None:
        """A `precompile.Progress`: the line under way, and a plain line as each part ends."""
        ours = f", ours {p.own_compiled}/{p.own_total}" if p.own_total else ""
        text = f"{self.name} ({p.done}/{p.total} parts, {p.kernels} kernels compiled{ours})"
        with self._lock:
            if self.bar is not None:
                self.bar.set_description_str(text, refresh=False)
            elif self.enabled and not p.finished and p.done != self._parts_said:
                self._parts_said = p.done
                print(f"{text}: {p.elapsed:.1f} s", file=sys.stderr)

    def end(self) -> None:
        with self._lock:
            if self.name is not None:
                if self.bar is not None:
                    self.bar.close()
                    self.bar = None
                if self.end_lines:
                    print(f"{self.name}: {time.perf_counter() - self.start:.1f} s", file=sys.stderr)
                self.name = None

    def close(self, failed: bool = False) -> None:
        if failed:
            with self._lock:
                if self.bar is not None:
                    self.bar.close()  # (leave=False: the line under way is erased)
                    self.bar = None
                self.name = None
        self.end()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()


class _Progress:
    """generate's progress, on a terminal only: the timeline (a tqdm bar over frames), then the codec
    (a stage line, erased as it ends)."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.enabled = enabled
        self.stages = _Stages(enabled, tty=True, end_lines=False, bar_format="{desc}: {elapsed}")

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="frame", desc="timeline", leave=False, file=sys.stderr)
        self.bar.n = done
        self.bar.refresh()
        if done == total:  # what is left of generate is the codec's
            self.bar.close()
            self.stages("codec")

    def close(self) -> None:
        self.stages.close()
        if self.bar is not None:
            self.bar.close()


_CONTROL = {c: "\ufffd" for c in list(range(0x20)) + list(range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def _printable(text: str) -> str:
    """Text for a terminal: control characters (escape sequences of a confused model) shown as
    U+FFFD. JSON output keeps the text as generated."""
    return text.translate(_CONTROL)


def run(args: argparse.Namespace) -> int:
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    if args.batch is not None or args.output_dir or args.ray or args.ray_address or args.workers is not None:
        if args.batch is None:
            raise _UsageError("--output-dir, --ray, --ray-address and --workers go with --batch INPUTS")
        from .batch import run_batch

        return run_batch(args, say)
    if args.demo and args.audio:
        raise _UsageError("--demo brings its own audio; drop --audio (or drop --demo)")
    if args.precompile and (args.audio or args.output_audio or args.output_json or args.stream):
        raise _UsageError("--precompile compiles and exits: it takes no --audio, --output-audio, --output-json "
                          "or --stream")
    if not args.demo and not args.audio and not args.precompile:
        raise _UsageError("--audio is required (or use --demo)")
    if not 0 <= args.seed < 2**64:  # (generate refuses it too, but after the model has loaded)
        raise _UsageError(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.system_prompt is not None:
        try:  # (bytes that are not UTF-8 reach sys.argv as surrogate escapes)
            args.system_prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise _UsageError("-p/--system-prompt is not valid UTF-8 text") from None
    _check_outputs(args)
    if args.max_tokens is not None:
        say("note: -n is ignored; the answer is as long as the input timeline plus --extra-decoding-seconds")
    if args.realtime and not args.stream:
        raise _UsageError("--realtime paces a --stream run; add --stream")

    # Deferred: importing mlx and the extension takes a moment, and argument errors should not wait.
    from .audio import open_audio, open_audio_bytes, wav_bytes, write_wav

    # The input is opened and checked before the model loads: a bad path or file fails fast.
    if args.audio == "-":  # read whole: soundfile needs to seek
        audio = open_audio_bytes(sys.stdin.buffer.read())
    elif args.audio:
        audio = open_audio(args.audio)
    progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
    try:
        with contextlib.ExitStack() as stack:
            model = args.model
            if args.demo:  # a checkpoint made in a folder removed on the way out
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="vc-demo-"))
                _MADE.append(tmp)
                stack.callback(_MADE.remove, tmp)
                model, question = _demo_inputs(Path(tmp))
                audio = open_audio(question)
                say("demo: tiny synthetic checkpoint with random weights (the text is noise; the pipeline is real)")
            import mlx.core as mx

            from .precompile import first_run_here
            from .session import load

            tty = sys.stderr.isatty()
            stages = _Stages(enabled=not args.quiet and (tty or args.precompile), tty=tty)
            failed = True
            try:
                start = time.perf_counter()
                chat = load(model, progress=lambda stage: stages(f"load: {stage}"))
                load_s = time.perf_counter() - start
                if args.precompile:
                    _precompile(chat, stages, say, load_s, live=True)
                    failed = False
                    return 0
                if first_run_here(chat):  # (said only where the stages are: a bad input stays one line)
                    _precompile(chat, stages, say if stages.enabled else (lambda *a: None), load_s,
                                long_inputs=False)
                failed = False
            finally:
                stages.close(failed)
            mx.reset_peak_memory()  # so that peak_memory_gb describes generate, not the load
            if args.stream:  # (the answer lines are printed as they arrive)
                from .cli_stream import run_stream

                progress.close()
                live_lines = None if args.output_json == "-" else sys.stderr if args.output_audio == "-" else sys.stdout
                result = run_stream(chat, audio, args, live_lines, _printable, say)
            else:
                result = chat.generate(audio, system_prompt=args.system_prompt,
                                       extra_decoding_seconds=args.extra_decoding_seconds, seed=args.seed,
                                       progress=progress)
    finally:
        progress.close()

    if args.output_audio == "-":  # a pipe cannot seek: the WAV is made whole in memory first
        data = wav_bytes(result.audio, result.sample_rate)
        _to_stdout(lambda: sys.stdout.buffer.write(data))
    elif args.output_audio:
        write_wav(args.output_audio, result.audio, result.sample_rate)
    timings = {"load_s": load_s, **result.timings}
    if args.output_json:
        from .kernels import kernel_launch

        report = {**result.to_json(), "timings": timings, "kernels": kernel_launch(), "tts_thread": chat.tts_thread}
        if args.output_json == "-":  # stdout is the JSON alone, for a pipe
            _to_stdout(lambda: sys.stdout.write(json.dumps(report, indent=2) + "\n"))
        else:
            _write_json(args.output_json, report)

    if args.output_json != "-" and not args.stream:  # (with the WAV on stdout, the lines go to stderr)
        lines = sys.stderr if args.output_audio == "-" else sys.stdout
        answer = f"[user] {_printable(result.user_transcript)}\n{_printable(result.text)}\n"
        if result.function_text:
            answer += f"[function] {_printable(result.function_text)}\n"
        if lines is sys.stdout:
            _to_stdout(lambda: sys.stdout.write(answer))
        else:
            lines.write(answer)
    frames = result.prompt_frames + result.frames
    gen = result.timings["live_s" if args.stream else "generate_s"]
    audio_s = result.frames * chat.config.frame_duration
    say(f"{result.frames} frames ({audio_s:.2f} s), {1000 * gen / max(frames, 1):.1f} ms/frame, "
        f"real-time factor {gen / max(audio_s, 1e-9):.3f}, load {load_s:.1f} s")
    if not args.output_audio:
        say("note: the spoken answer was not written (--output-audio FILE keeps it)")
    return 0


def _precompile(chat, stages: _Stages, say, load_s: float, long_inputs: bool = True, live: bool = False) -> int:
    """--precompile (with the live path: the process ends after it) and a first run on a GPU: the
    model's kernels compiled and kept (`voicechat.precompile`)."""
    import mlx.core as mx

    from .precompile import precompile

    stages(f"compiling {'GPU' if mx.default_device() == mx.gpu else 'CPU'} kernels for this model (first run only)")
    last = precompile(chat, progress=stages.compile_progress, long_inputs=long_inputs, live=live)
    stages.end()
    say(f"precompiled: {last.kernels} kernels compiled in {last.elapsed:.1f} s (load {load_s:.1f} s); "
        "later runs read them from the caches")
    return 0


# Folders this run has made and not yet removed (the demo's), for the signal handler.
_MADE: list[str] = []
_SIGNALS = {signal.SIGTERM: "terminated", signal.SIGINT: "interrupted"}


def _on_signal(signum, frame):
    """SIGTERM or SIGINT: remove what this run has made (the demo's folder, a half-written output's
    temp file), say so in one line and exit 128 + the signal. Done here rather than by raising: an
    exception raised from a signal handler can be lost (CPython drops it when the signal lands
    while an import compiles a module, and the run then goes on)."""
    for folder in list(_MADE):
        shutil.rmtree(folder, ignore_errors=True)
    remove_pending_outputs()
    with contextlib.suppress(OSError):
        print(f"error: {_SIGNALS.get(signum, 'killed')}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


INTERNAL_ERROR = "error: internal error in voicechat (a bug; please report it with the traceback below)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _on_signal) for sig in _SIGNALS} if on_main_thread else {}
    try:
        return run(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # our errors are ValueErrors and OSErrors naming the problem
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, _UsageError) else 1
    except MemoryError:
        print("error: out of memory", file=sys.stderr)
        return 1
    except Exception:  # anything else is voicechat's own fault: say so, then show where
        print(INTERNAL_ERROR, file=sys.stderr)
        traceback.print_exc()
        return 70  # EX_SOFTWARE
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # (None: a handler set outside Python, which cannot be put back)
                signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
