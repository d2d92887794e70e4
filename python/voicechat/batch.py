"""vc-generate --batch: many inputs, each answered as `vc-generate` answers one file.

    vc-generate --batch recordings/ --output-dir answers/ -m MODEL        # one model, here
    vc-generate --batch manifest.jsonl --output-dir answers/ --ray        # a Ray Data actor pool, a model per GPU

INPUTS is a folder of audio files, or a JSONL manifest: one object a line, `path` (relative to the
manifest's folder) and optionally `system_prompt`, `seed` and `extra_decoding_seconds` (the
command's own options are the defaults). OUT is made if missing. Input `NAME.ext` gives
`OUT/NAME.wav` and `OUT/NAME.json`, what `vc-generate --output-audio --output-json` writes for it,
less the timings; each file is written whole or not at all, the JSON last, so a rerun skips the
inputs whose JSON is there and an interrupted job loses nothing. A bad input is reported and
skipped. `OUT/batch-summary.json` lists every input with its status and timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from glob import escape as glob_escape
from pathlib import Path

from .cli import _UsageError as UsageError
from .files import output_file

SUMMARY = "batch-summary"
MANIFEST_FIELDS = {"path", "system_prompt", "seed", "extra_decoding_seconds"}
SUMMARY_EVERY_S = 30.0  # a killed job leaves a summary this recent (a rerun makes a whole one)


@dataclass
class Job:
    """One input and its options; `problem` says why it cannot run (a bad manifest line)."""

    input: str  # the path as given, or "MANIFEST:LINE" for a line without a usable path
    stem: str | None
    path: str | None
    system_prompt: str | None
    seed: int
    extra_decoding_seconds: float
    problem: str | None = None  # (named after the manifest's line)


def audio_suffixes() -> set[str]:
    import soundfile as sf

    return {"." + f.lower() for f in sf.available_formats()} | {".mp3", ".oga", ".opus", ".aif"}


def plan(inputs: str, system_prompt: str | None, seed: int, extra: float) -> list[Job]:
    """The jobs of INPUTS (a folder or a manifest), in order. Raises UsageError for what stops
    the whole job: INPUTS missing or empty, a manifest line that is not JSON, two inputs of one
    name (they would write the same outputs)."""
    if os.path.isdir(inputs):
        suffixes = audio_suffixes()
        files = sorted(p for p in Path(inputs).iterdir()
                       if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in suffixes)
        if not files:
            raise UsageError(f"--batch {inputs}: no audio files in this folder")
        jobs = [Job(str(p), p.stem, str(p), system_prompt, seed, extra) for p in files]
    elif os.path.isfile(inputs):
        jobs = _manifest_jobs(inputs, system_prompt, seed, extra)
    else:
        raise UsageError(f"--batch {inputs}: no such folder or manifest")
    by_stem: dict[str, list[str]] = {}
    for job in jobs:
        if job.stem is not None:
            by_stem.setdefault(job.stem, []).append(job.input)
    clashes = [f"{', '.join(names)} (all {stem}.wav)" for stem, names in by_stem.items() if len(names) > 1]
    if SUMMARY in by_stem:
        clashes.append(f"{by_stem[SUMMARY][0]} (its JSON would be the summary, {SUMMARY}.json)")
    if clashes:
        raise UsageError("inputs with the same name without extension would write the same outputs: "
                         + "; ".join(clashes) + "; rename them")
    return jobs


def _manifest_jobs(manifest: str, system_prompt: str | None, seed: int, extra: float) -> list[Job]:
    base = Path(manifest).parent
    jobs = []
    try:
        with open(manifest, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise UsageError(f"--batch {manifest}: not a JSONL manifest (not UTF-8 text; a folder of audio files "
                         f"or a manifest of their paths goes here)") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{manifest}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        job = Job(where, None, None, system_prompt, seed, extra)
        jobs.append(job)
        if not isinstance(entry, dict):
            job.problem = f"{where}: a manifest line must be a JSON object"
            continue
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            job.problem = f"{where}: `path` must be a non-empty string"
            continue
        job.path = str(base / path)
        job.input, job.stem = path, Path(path).stem
        job.system_prompt = entry.get("system_prompt", system_prompt)
        job.seed = entry.get("seed", seed)
        job.extra_decoding_seconds = entry.get("extra_decoding_seconds", extra)
        problem = _bad_fields(entry)
        job.problem = f"{where}: {problem}" if problem else None
    if not jobs:
        raise UsageError(f"--batch {manifest}: the manifest lists no inputs")
    return jobs


def _bad_fields(entry: dict) -> str | None:
    unknown = set(entry) - MANIFEST_FIELDS
    if unknown:
        return f"unknown fields {', '.join(sorted(unknown))} (a line takes {', '.join(sorted(MANIFEST_FIELDS))})"
    prompt, seed, extra = entry.get("system_prompt"), entry.get("seed", 0), entry.get("extra_decoding_seconds", 0.0)
    if prompt is not None and not isinstance(prompt, str):
        return "`system_prompt` must be a string or null"
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        return "`seed` must be an integer in [0, 2**64)"
    if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not 0 <= extra <= 3600:
        return "`extra_decoding_seconds` must be a number of seconds in [0, 3600]"
    return None


def output_folder(path: str) -> Path:
    """OUT, made with its missing parents (as `mkdir -p`) and checked to take new files. A path
    that is not a folder, or cannot be made or written, is a UsageError, and the folders made on
    the way are removed again: a refused job leaves nothing behind."""
    out = Path(path)
    made: list[Path] = []
    try:
        for folder in [*reversed(out.parents), out]:
            if os.path.isdir(folder):
                continue
            if os.path.lexists(folder):  # a file, or a link to nothing
                raise UsageError(f"--output-dir {out}: {'it' if folder == out else folder} is not a folder")
            try:
                folder.mkdir()
            except OSError as e:
                raise UsageError(f"--output-dir {out}: cannot make {folder}: {e.strerror}") from None
            made.append(folder)
        try:
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError:
            raise UsageError(f"--output-dir {out}: the folder is not writable") from None
    except UsageError:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return out


def _remove_stale_temp_files(out: Path, stems: list[str]) -> None:
    """What a killed run left of the writes it had under way (`files.output_file`'s temp files)."""
    for stem in stems:
        for suffix in ("wav", "json"):
            for tmp in out.glob(f".{glob_escape(stem)}.{suffix}.*.tmp"):
                tmp.unlink(missing_ok=True)


def complete(out: Path, stem: str) -> bool:
    """Both outputs are there (the JSON is written last, and each file whole or not at all)."""
    return (out / f"{stem}.wav").is_file() and (out / f"{stem}.json").is_file()


class Answerer:
    """One loaded model answering jobs: a Ray Data actor, or the whole job's model without Ray.
    A row in, a row out: the WAV's bytes and the JSON's text, or why the input failed."""

    def __init__(self, model: str):
        from .kernels import kernel_launch
        from .session import load

        self.chat = load(model)
        self.kernels = kernel_launch()

    def __call__(self, row: dict) -> dict:
        import mlx.core as mx

        from .audio import open_audio, wav_bytes

        out = {"stem": row["stem"], "audio_seconds": 0.0, "wav": b"", "report": "", "timings": "", "error": ""}
        started = time.perf_counter()
        try:
            if row["problem"]:
                raise ValueError(row["problem"])
            audio = open_audio(row["path"])
            out["audio_seconds"] = audio.frames / audio.rate
            mx.reset_peak_memory()  # (as vc-generate after its load: the peak describes generate)
            result = self.chat.generate(audio, system_prompt=row["system_prompt"], seed=row["seed"],
                                        extra_decoding_seconds=row["extra_decoding_seconds"])
            report = {k: v for k, v in result.to_json().items() if k != "timings"}
            report.update(kernels=self.kernels, tts_thread=self.chat.tts_thread)
            out["wav"] = wav_bytes(result.audio, result.sample_rate)
            out["report"] = json.dumps(report, indent=2) + "\n"  # (vc-generate --output-json's layout)
            out["timings"] = json.dumps({**result.timings, "wall_s": time.perf_counter() - started})
        except (ValueError, OSError) as e:  # the input's fault: named, then the next input
            out["error"] = str(e)
        except Exception as e:  # a bug, but one input's: reported, and the job goes on
            traceback.print_exc()
            out["error"] = f"internal error: {type(e).__name__}: {e}"
        return out


class Summary:
    """The job's record: every input's status and timings, the totals, the throughput."""

    def __init__(self, out: Path, jobs: list[Job]):
        self.path = out / f"{SUMMARY}.json"
        self.entries = {id(job): {"input": job.input, "output": job.stem, "status": "pending", "error": None,
                                  "audio_seconds": None, "timings": None} for job in jobs}
        self.started = time.monotonic()
        self.audio_seconds = 0.0
        self.written = self.started

    def mark(self, job: Job, status: str, error: str | None = None, audio_seconds: float | None = None,
             timings: dict | None = None) -> None:
        self.entries[id(job)].update(status=status, error=error, audio_seconds=audio_seconds, timings=timings)
        self.audio_seconds += audio_seconds or 0.0
        if time.monotonic() - self.written > SUMMARY_EVERY_S:
            self.write()

    def counts(self) -> dict[str, int]:
        statuses = [e["status"] for e in self.entries.values()]
        return {s: statuses.count(s) for s in ("done", "skipped", "failed", "pending")}

    def throughput(self) -> float:
        """Hours of input answered per hour of wall clock, this run."""
        return self.audio_seconds / max(time.monotonic() - self.started, 1e-9)

    def write(self) -> None:
        self.written = time.monotonic()
        data = {**self.counts(), "wall_s": round(self.written - self.started, 3),
                "audio_seconds": round(self.audio_seconds, 3),
                "audio_hours_per_wall_hour": round(self.throughput(), 3), "inputs": list(self.entries.values())}
        with output_file(self.path) as f:
            json.dump(data, f, indent=2)
            f.write("\n")


def _answers_here(model: str, jobs: list[Job]):
    answerer = Answerer(model)
    return (answerer(asdict(job)) for job in jobs)


def _answers_on_ray(model: str, jobs: list[Job], address: str | None, workers: int | None, say):
    """A Ray Data actor pool: one model per GPU where the cluster has GPUs, else per CPU."""
    import ray

    ray.init(address=address, log_to_driver=False)
    data = ray.data.DataContext.get_current()
    data.enable_progress_bars = False  # (ours counts inputs and throughput)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    workers = workers or max(gpus, 1)
    resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    say(f"vc-generate: {workers} models on Ray ({'a GPU' if gpus else 'a CPU'} each)")
    # A block an input (up to a point): each is written as soon as it is answered.
    rows = ray.data.from_items([asdict(job) for job in jobs], override_num_blocks=min(len(jobs), 2000))
    pool = ray.data.ActorPoolStrategy(size=workers)
    return rows.map(Answerer, fn_constructor_args=(model,), compute=pool, **resources).iter_rows()


def run_batch(args: argparse.Namespace, say) -> int:
    """vc-generate --batch: 0 when every input has its outputs, 1 when some failed (each named)."""
    if args.output_dir is None:
        raise UsageError("--batch needs --output-dir OUT (where each input's .wav and .json go)")
    given = [name for name, value in (("--audio", args.audio), ("--output-audio", args.output_audio),
                                      ("--output-json", args.output_json), ("--stream", args.stream),
                                      ("--demo", args.demo)) if value]
    if given:
        raise UsageError(f"--batch writes into --output-dir; drop {', '.join(given)}")
    if not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.workers is not None and not args.workers >= 1:
        raise UsageError("--workers must be at least 1")
    jobs = plan(args.batch, args.system_prompt, args.seed, args.extra_decoding_seconds)
    out = output_folder(args.output_dir)
    _remove_stale_temp_files(out, [job.stem for job in jobs if job.stem is not None] + [SUMMARY])
    summary = Summary(out, jobs)
    pending = []
    for job in jobs:
        if job.stem is not None and complete(out, job.stem):
            summary.mark(job, "skipped")
        else:
            pending.append(job)
    say(f"vc-generate: {len(jobs)} inputs, {len(jobs) - len(pending)} already answered in {out}")
    model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    by_stem = {job.stem: job for job in pending if job.stem is not None}
    unnamed = [job for job in pending if job.stem is None]  # (manifest lines without a path)
    for job in unnamed:
        summary.mark(job, "failed", job.problem)
        print(f"error: {_naming(job, job.problem)}", file=sys.stderr)
    named = [job for job in pending if job.stem is not None]
    answers = []
    if named and (args.ray or args.ray_address is not None):
        answers = _answers_on_ray(model, named, args.ray_address, args.workers, say)
    elif named:
        answers = _answers_here(model, named)
    progress = _progress(len(jobs), len(jobs) - len(named), quiet=args.quiet)
    try:
        for row in answers:
            _record(out, summary, by_stem[row["stem"]], row, progress)
    finally:
        progress.close()
        summary.write()
    counts = summary.counts()
    say(f"vc-generate: {counts['done']} answered, {counts['skipped']} skipped (already answered), "
        f"{counts['failed']} failed; {summary.audio_seconds / 3600:.3f} h of audio at "
        f"{summary.throughput():.2f} audio h per wall h; {summary.path}")
    if counts["failed"]:
        print(f"error: {counts['failed']} of {len(jobs)} inputs failed (listed in {summary.path})", file=sys.stderr)
        return 1
    return 0


def _record(out: Path, summary: Summary, job: Job, row: dict, progress) -> None:
    if row["error"]:
        summary.mark(job, "failed", row["error"], row["audio_seconds"] or None)
        progress.write(f"error: {_naming(job, row['error'])}", file=sys.stderr)
    else:
        with output_file(out / f"{job.stem}.wav", "wb") as f:
            f.write(row["wav"])
        with output_file(out / f"{job.stem}.json") as f:  # last: now the input is complete
            f.write(row["report"])
        summary.mark(job, "done", None, row["audio_seconds"], json.loads(row["timings"]))
    progress.update(1)
    progress.set_postfix_str(f"{summary.throughput():.2f} audio h per wall h", refresh=False)


def _naming(job: Job, message: str) -> str:
    """The message, with the input's name first unless it names the file (an audio error) or
    the manifest's line (a bad line) already."""
    return message if message.startswith((job.path or job.input, job.input)) or job.problem else \
        f"{job.input}: {message}"


def _progress(total: int, initial: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="input", desc="batch", file=sys.stderr, dynamic_ncols=True,
                disable=quiet)
