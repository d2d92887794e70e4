"""vc-generate --batch: each input's outputs are what vc-generate writes for that file with the same
options (the JSON less its timings; the peak memory is a measurement too), bad inputs are named and
skipped, and a rerun skips what is complete. On a local Ray cluster: a job over 20 inputs killed
midway and run again loses nothing and redoes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving import child_env
from voicechat import cli

MEASURED = {"timings", "peak_memory_gb"}  # differ from run to run


@pytest.fixture(scope="module")
def spoken(tmp_path_factory) -> list[Path]:
    """20 short spoken questions (espeak-ng), q00.wav ... q19.wav."""
    folder = tmp_path_factory.mktemp("spoken")
    words = ["Paris", "the moon", "a river", "music", "the time", "green tea", "a bridge", "winter", "a robot",
             "the sea", "a song", "bread", "a train", "the sun", "a garden", "coffee", "a city", "snow", "a book",
             "the wind"]
    paths = []
    for i, word in enumerate(words):
        path = folder / f"q{i:02d}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), f"What is {word}?"], check=True, capture_output=True)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory):
    """`reference(path, seed, prompt, extra)`: (WAV bytes, JSON) that vc-generate writes for one file."""
    folder = tmp_path_factory.mktemp("reference")
    made: dict[tuple, tuple[bytes, dict]] = {}

    def make(path: Path, seed: int = 0, prompt: str | None = None, extra: float = 0.2) -> tuple[bytes, dict]:
        key = (str(path), seed, prompt, extra)
        if key not in made:
            wav, report = folder / f"{len(made)}.wav", folder / f"{len(made)}.json"
            argv = ["-m", str(tiny_checkpoint), "--audio", str(path), "--output-audio", str(wav), "--output-json",
                    str(report), "--seed", str(seed), "--extra-decoding-seconds", str(extra), "-q"]
            assert cli.main(argv + (["-p", prompt] if prompt is not None else [])) == 0
            made[key] = (wav.read_bytes(), json.loads(report.read_text()))
        return made[key]

    return make


def _assert_as_vc_generate(out: Path, stem: str, expected: tuple[bytes, dict]) -> None:
    wav, report = expected
    assert (out / f"{stem}.wav").read_bytes() == wav
    got = json.loads((out / f"{stem}.json").read_text())
    assert list(got) == [k for k in report if k != "timings"]
    assert {k: v for k, v in got.items() if k not in MEASURED} == {k: v for k, v in report.items() if k not in MEASURED}


def _batch(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "voicechat.cli", "--batch", *argv], env=env or child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _outputs(out: Path) -> dict[str, int]:
    """Each input's output file and when it was written."""
    return {p.name: p.stat().st_mtime_ns for p in out.iterdir()
            if p.suffix in (".wav", ".json") and p.name != "batch-summary.json"}


def _summary(out: Path) -> dict[str, dict]:
    return {e["input"]: e for e in json.loads((out / "batch-summary.json").read_text())["inputs"]}


def test_a_folder_here_equals_vc_generate_and_a_rerun_skips_it(tiny_checkpoint, spoken, reference, tmp_path,
                                                               capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for path in spoken[:3]:
        (inputs / path.name).write_bytes(path.read_bytes())
    (inputs / "broken.wav").write_bytes(b"RIFF not really")
    (inputs / "notes.txt").write_text("not an input")
    out = tmp_path / "answers" / "out"  # made, with its parent
    argv = ["--batch", str(inputs), "--output-dir", str(out), "-m", str(tiny_checkpoint), "--seed", "4",
            "--extra-decoding-seconds", "0.2", "-q"]
    assert cli.main(argv) == 1  # one input failed
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {inputs / 'broken.wav'}: not a readable audio file (Format not recognised.)",
        f"error: 1 of 4 inputs failed (listed in {out / 'batch-summary.json'})"]
    for path in spoken[:3]:
        _assert_as_vc_generate(out, path.stem, reference(path, seed=4))
    assert sorted(p.name for p in out.iterdir()) == ["batch-summary.json"] + sorted(
        f"{p.stem}.{ext}" for p in spoken[:3] for ext in ("json", "wav"))
    summary = _summary(out)
    assert summary[str(inputs / "broken.wav")]["status"] == "failed"
    assert all(summary[str(inputs / p.name)]["status"] == "done" for p in spoken[:3])
    assert all(summary[str(inputs / p.name)]["timings"]["generate_s"] > 0 for p in spoken[:3])

    before = _outputs(out)
    assert cli.main(argv) == 1
    assert _outputs(out) == before  # nothing rewritten
    summary = _summary(out)
    assert [summary[str(inputs / p.name)]["status"] for p in spoken[:3]] == ["skipped"] * 3


@pytest.mark.parametrize("problem, lines, message", [
    ("duplicate names", ['{"path": "a/q.wav"}', '{"path": "b/q.flac"}'],
     "inputs with the same name without extension would write the same outputs: a/q.wav, b/q.flac (all q.wav)"),
    ("the summary's name", ['{"path": "batch-summary.wav"}'], "(its JSON would be the summary, batch-summary.json)"),
    ("a line that is not JSON", ['{"path": "a.wav"}', '{"path": "b.wav",'], "manifest.jsonl:2: not JSON"),
    ("no lines", ["", "  "], "the manifest lists no inputs"),
])
def test_a_manifest_that_cannot_run_is_one_error_up_front(problem, lines, message, tmp_path, capsys):
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    assert cli.main(["--batch", str(manifest), "--output-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.jsonl"]


def test_an_audio_file_given_as_inputs_is_one_error(spoken_wav, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["--batch", str(spoken_wav), "--output-dir", str(out), "-q"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not a JSONL manifest (not UTF-8 text" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--batch", "nowhere"], "--batch needs --output-dir"),
    (["--batch", "nowhere", "--output-dir", "."], "no such folder or manifest"),
    (["--output-dir", "."], "go with --batch INPUTS"),
    (["--ray", "--audio", "x.wav"], "go with --batch INPUTS"),
    (["--batch", ".", "--output-dir", ".", "--audio", "x.wav"], "drop --audio"),
])
def test_batch_misuse(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_an_output_dir_that_cannot_be_used_is_one_error_and_leaves_nothing(tmp_path, capsys):
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text('{"path": "q.wav"}\n')
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cases = [(blocker, "it is not a folder"), (blocker / "out", f"{blocker} is not a folder"),
             (tmp_path / "new" / ("x" * 300), f"cannot make {tmp_path / 'new' / ('x' * 300)}: File name too long"),
             (Path("/proc/vc-batch/out"), "cannot make /proc/vc-batch"),  # procfs makes no folder, for root either
             (Path("/proc"), "the folder is not writable")]
    if os.geteuid() != 0:  # root may write a folder whose mode says no
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases += [(locked / "out", f"cannot make {locked / 'out'}: Permission denied"),
                  (locked, "the folder is not writable")]
    before = sorted(tmp_path.iterdir())
    for out, message in cases:
        assert cli.main(["--batch", str(manifest), "--output-dir", str(out), "-q"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --output-dir {out}: {message}"), err
        assert sorted(tmp_path.iterdir()) == before  # ("new" is made, then removed)


def test_on_ray_killed_midway_and_resumed_loses_nothing_and_redoes_nothing(ray_cluster, tiny_checkpoint, spoken,
                                                                          reference, tmp_path):
    options = {p.stem: {"seed": i, "extra_decoding_seconds": 0.2 if i % 2 else 0.4,
                        **({"system_prompt": "Be brief."} if i % 3 == 0 else {})} for i, p in enumerate(spoken)}
    manifest = tmp_path / "jobs" / "manifest.jsonl"
    manifest.parent.mkdir()
    lines = [json.dumps({"path": os.path.relpath(p, manifest.parent), **options[p.stem]}) for p in spoken]
    lines.insert(5, json.dumps({"path": "missing.wav"}))
    lines.insert(9, json.dumps({"path": "q99.wav", "seed": -1}))
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "answers" / "out"  # made by the first run, with its parent
    argv = [str(manifest), "--output-dir", str(out), "-m", str(tiny_checkpoint), "--ray-address", ray_cluster,
            "--workers", "2"]

    first = _batch(*argv)
    deadline = time.monotonic() + 300
    while len(list(out.glob("*.json"))) < 4:
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    finished = {Path(name).stem for name in _outputs(out) if name.endswith(".json")}
    kept = {name: t for name, t in _outputs(out).items() if Path(name).stem in finished}
    assert 4 <= len(finished) < len(spoken), "the job ended before it could be interrupted"

    second = _batch(*argv)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 1, err  # the two bad lines
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert sorted(errors[:2]) == sorted([f"error: {manifest}:10: `seed` must be an integer in [0, 2**64)",
                                         f"error: {manifest.parent / 'missing.wav'}: no such file"]), errors
    assert errors[2:] == [f"error: 2 of 22 inputs failed (listed in {out / 'batch-summary.json'})"]
    assert {name: t for name, t in _outputs(out).items() if name in kept} == kept  # nothing redone
    summary = _summary(out)
    statuses = {p.stem: summary[os.path.relpath(p, manifest.parent)]["status"] for p in spoken}
    assert {stem for stem, status in statuses.items() if status == "skipped"} == finished
    assert {stem for stem, status in statuses.items() if status == "done"} == {p.stem for p in spoken} - finished
    assert summary["missing.wav"]["status"] == summary["q99.wav"]["status"] == "failed"
    assert not list(out.glob(".*.tmp"))
    for path in spoken:
        o = options[path.stem]
        _assert_as_vc_generate(out, path.stem, reference(path, o["seed"], o.get("system_prompt"),
                                                         o["extra_decoding_seconds"]))
