"""vc-generate: speech in, transcript + answer text + spoken answer out.

    vc-generate -m mlx-community/NemotronLabs-VoiceChat-11B-4bit --audio question.wav \\
        --output-audio answer.wav -p "Be concise and answer in one sentence."
    vc-generate --demo      # offline, on a tiny synthetic checkpoint and a bundled question
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

from .config import EXTRA_DECODING_SECONDS
from .files import atomic_output

DEFAULT_MODEL = "mlx-community/NemotronLabs-VoiceChat-11B-4bit"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vc-generate",
        description="Run NemotronLabs VoiceChat on a WAV: prints the user's transcript and the assistant's "
                    "answer, and writes the spoken answer (22.05 kHz mono PCM16).")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"checkpoint directory or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--audio", help="input audio (any format soundfile reads; resampled to 16 kHz mono; '-': "
                                    "read from stdin)")
    p.add_argument("--output-audio", help="where to write the spoken answer (WAV; '-': to stdout, the answer "
                                           "lines then go to stderr)")
    p.add_argument("-p", "--system-prompt", default=None, help="system prompt (empty: none)")
    p.add_argument("--extra-decoding-seconds", type=float, default=EXTRA_DECODING_SECONDS, metavar="SECONDS",
                   help=f"seconds of silence appended so the model can finish answering (default: {EXTRA_DECODING_SECONDS:g})")
    p.add_argument("--seed", type=int, default=0, help="seed of the speech sampler (default: 0)")
    p.add_argument("--output-json", help="write the result (everything but the samples) and timings as JSON "
                                          "('-': to stdout, in place of the answer lines)")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="ignored: the answer is as long as the input timeline (+ extra decoding seconds)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the answer lines (no progress, no timing)")
    p.add_argument("--precompile", action="store_true",
                   help="compile every kernel the model needs on dummy inputs, keep them in the disk caches, "
                        "and exit (run once when building a package or container; needs no --audio)")
    p.add_argument("--demo", action="store_true",
                   help="run offline on a freshly made tiny synthetic checkpoint and a bundled spoken question "
                        "(random weights: shows the pipeline working, not a real answer)")
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


def _check_output_path(path: str | None, what: str) -> None:
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise _UsageError(f"{what} {path}: is a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise _UsageError(f"{what} {path}: directory {parent} does not exist")
    try:  # a file made and dropped there, before the model runs, not after (os.access says yes to root)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError:
        raise _UsageError(f"{what} {path}: directory {parent} is not writable") from None


class _UsageError(ValueError):
    pass


def _write_json_atomic(path: str, data: dict) -> None:
    with atomic_output(path) as f:
        json.dump(data, f, indent=2)
        f.write("\n")


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
    --precompile)."""

    def __init__(self, enabled: bool, tty: bool):
        self.enabled, self.tty = enabled, tty
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

                self.bar = tqdm(desc=name, bar_format="{desc} {elapsed}", file=sys.stderr, leave=False)
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
    """A tqdm bar over timeline frames, on a terminal only."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.enabled = enabled

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="frame", desc="timeline", leave=False, file=sys.stderr)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_CONTROL = {c: "\ufffd" for c in list(range(0x20)) + list(range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def _printable(text: str) -> str:
    """Text for a terminal: control characters (escape sequences of a confused model) shown as
    U+FFFD. JSON output keeps the text as generated."""
    return text.translate(_CONTROL)


def run(args: argparse.Namespace) -> int:
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    if args.demo and args.audio:
        raise _UsageError("--demo brings its own audio; drop --audio (or drop --demo)")
    if args.precompile and (args.audio or args.output_audio or args.output_json):
        raise _UsageError("--precompile compiles and exits: it takes no --audio, --output-audio or --output-json")
    if not args.demo and not args.audio and not args.precompile:
        raise _UsageError("--audio is required (or use --demo)")
    if not 0 <= args.seed < 2**64:  # (generate refuses it too, but after the model has loaded)
        raise _UsageError(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.output_audio == "-" and args.output_json == "-":
        raise _UsageError("--output-audio - and --output-json - both want stdout; give one of them a file")
    for path, what in ((args.output_audio, "--output-audio"), (args.output_json, "--output-json")):
        if path != "-":
            _check_output_path(path, what)
    if args.max_tokens is not None:
        say("note: -n is ignored; the answer is as long as the input timeline plus --extra-decoding-seconds")

    # Deferred: importing mlx and the extension takes a moment, and argument errors should not wait.
    import mlx.core as mx

    from .audio import read_audio_bytes, wav_bytes, write_wav
    from .session import load

    with tempfile.TemporaryDirectory(prefix="vc-demo-") as tmp:
        model, audio, rate = args.model, args.audio, None
        if audio == "-":  # read whole before the model loads: a bad pipe fails fast
            audio, rate = read_audio_bytes(sys.stdin.buffer.read())
        if args.demo:
            model, audio = _demo_inputs(Path(tmp))
            say("demo: tiny synthetic checkpoint with random weights (the text is noise; the pipeline is real)")
        tty = sys.stderr.isatty()
        stages = _Stages(enabled=not args.quiet and (tty or args.precompile), tty=tty)
        failed = True
        try:
            start = time.perf_counter()
            chat = load(model, progress=lambda stage: stages(f"load: {stage}"))
            load_s = time.perf_counter() - start
            if args.precompile:
                code = _precompile(chat, stages, say, load_s)
                failed = False
                return code
            if _first_run_on_a_gpu(chat):  # (said only where the stages are: a bad input stays one line)
                _precompile(chat, stages, say if stages.enabled else (lambda *a: None), load_s, long_inputs=False)
            stages("generate")
            mx.reset_peak_memory()  # so that peak_memory_gb describes generate, not the load
            progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
            try:
                result = chat.generate(audio, system_prompt=args.system_prompt,
                                       extra_decoding_seconds=args.extra_decoding_seconds, seed=args.seed,
                                       sample_rate=rate, progress=progress)
            finally:
                progress.close()
            failed = False
        finally:
            stages.close(failed)

    if args.output_audio == "-":  # a pipe cannot seek: the WAV is made whole in memory first
        sys.stdout.buffer.write(wav_bytes(result.audio, result.sample_rate))
        sys.stdout.flush()
    elif args.output_audio:
        write_wav(args.output_audio, result.audio, result.sample_rate)
    timings = {"load_s": load_s, **result.timings}
    if args.output_json:
        from .kernels import kernel_launch

        report = {**result.to_json(), "timings": timings, "kernels": kernel_launch(), "tts_thread": chat.tts_thread}
        if args.output_json == "-":  # stdout is the JSON alone, for a pipe
            json.dump(report, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            _write_json_atomic(args.output_json, report)

    if args.output_json != "-":  # (with the WAV on stdout, the lines go to stderr)
        lines = sys.stderr if args.output_audio == "-" else sys.stdout
        print(f"[user] {_printable(result.user_transcript)}", file=lines)
        print(_printable(result.text), file=lines)
        if result.function_text:
            print(f"[function] {_printable(result.function_text)}", file=lines)
    frames = result.prompt_frames + result.frames
    gen = result.timings["generate_s"]
    audio_s = result.frames * chat.config.frame_duration
    say(f"{result.frames} frames ({audio_s:.2f} s), {1000 * gen / max(frames, 1):.1f} ms/frame, "
        f"real-time factor {gen / max(audio_s, 1e-9):.3f}, load {load_s:.1f} s")
    if not args.output_audio:
        say("note: the spoken answer was not written (--output-audio FILE keeps it)")
    return 0


def _first_run_on_a_gpu(chat) -> bool:
    """Whether this run compiles ahead (`voicechat.precompile`, side by side) before it generates:
    on a CUDA GPU where no precompile finished for this model (VOICECHAT_PRECOMPILE=0: never; then
    the kernels compile one by one as generate meets them)."""
    import os

    from .kernels.gemv import on_cuda_gpu
    from .precompile import is_precompiled

    return os.environ.get("VOICECHAT_PRECOMPILE", "") != "0" and on_cuda_gpu() and not is_precompiled(chat)


def _precompile(chat, stages: _Stages, say, load_s: float, long_inputs: bool = True) -> int:
    """--precompile (and a first run on a GPU): the model's kernels compiled and kept
    (`voicechat.precompile`)."""
    import mlx.core as mx

    from .precompile import precompile

    stages(f"compiling {'GPU' if mx.default_device() == mx.gpu else 'CPU'} kernels for this model (first run only)")
    last = precompile(chat, progress=stages.compile_progress, long_inputs=long_inputs)
    stages.end()
    say(f"precompiled: {last.kernels} kernels compiled in {last.elapsed:.1f} s (load {load_s:.1f} s); "
        "later runs read them from the caches")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # our errors are ValueErrors naming the problem
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, _UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
