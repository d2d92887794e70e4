"""vc-generate: the command's lines, files, JSON and every bad input of DESIGN.md."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from voicechat.cli import main


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_version_names_voicechat_mlx_and_the_kernels_launch(capsys):
    import mlx.core as mx

    import voicechat
    from voicechat.kernels import build_info

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"vc-generate (voicechat {voicechat.__version__}) on mlx {mx.__version__}")
    assert f"extension built for {build_info()['backend']}" in out and "CUDA kernels: " in out


def test_generates_lines_wav_and_json(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    wav, js = tmp_path / "answer.wav", tmp_path / "result.json"
    code, out, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", wav,
                             "--output-json", js, "-p", "Be concise.", "-n", "0")
    assert code == 0, err
    data = json.loads(js.read_text())
    from voicechat.cli import _printable

    expected = f"[user] {_printable(data['user_transcript'])}\n{_printable(data['text'])}\n"
    if data["function_text"]:
        expected += f"[function] {_printable(data['function_text'])}\n"
    assert not any(ord(ch) < 0x20 and ch not in "\n\t" for ch in out)
    assert out == expected
    assert "-n is ignored" in err
    assert "ms/frame" in err and "real-time factor" in err
    assert "not written" not in err
    info = sf.info(str(wav))
    assert (info.samplerate, info.channels, info.subtype, info.format) == (22050, 1, "PCM_16", "WAV")
    assert info.frames == data["frames"] * 1764
    for key in ("user_transcript", "text", "function_text", "sample_rate", "text_tokens", "function_tokens",
                "audio_codes"):
        assert key in data
    assert "audio" not in data
    from voicechat.session import default_tts_thread

    assert data["tts_thread"] is default_tts_thread()
    assert set(data["timings"]) >= {"load_s", "generate_s", "perception_s", "timeline_s", "codec_s"}
    # the peak after each stage of generate (reset after the load): some stage allocated something
    assert set(data["peak_memory_gb"]) == set(data["timings"]) - {"load_s", "generate_s"}
    assert max(data["peak_memory_gb"].values()) > 0
    assert data["prompt_frames"] > 0 and len(data["text_tokens"]) == data["frames"]
    assert 0 < data["host_syncs"] < data["frames"]  # a handful a run, not one a frame
    # the permissions a plain open() gives under the umask (the atomic write's temp file has 0o600)
    umask = os.umask(0)
    os.umask(umask)
    for path in (wav, js):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_json_to_stdout_is_the_json_alone(capsys, tmp_path, tiny_checkpoint, spoken_wav, monkeypatch):
    """`--output-json -` prints the JSON on stdout in place of the answer lines (a pipe reads it
    whole) and writes no file named '-'; progress and timing stay on stderr."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-json", "-")
    assert code == 0, err
    data = json.loads(out)
    assert data["frames"] > 0 and "text" in data and "timings" in data
    assert not (tmp_path / "-").exists()
    assert "ms/frame" in err
    assert "the spoken answer was not written" in err


def test_wav_to_stdout_for_a_pipe(capsysbinary, tmp_path, tiny_checkpoint, spoken_wav):
    """`--output-audio -`: stdout is the WAV alone (byte for byte the file the same seed writes), the
    answer lines go to stderr; both outputs on stdout is a usage error."""
    wav = tmp_path / "answer.wav"
    assert main([str(a) for a in ("-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", wav, "-q")]) == 0
    capsysbinary.readouterr()
    assert main([str(a) for a in ("-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", "-")]) == 0
    out, err = capsysbinary.readouterr()
    assert out == wav.read_bytes()
    assert b"[user] " in err and b"ms/frame" in err
    code = main([str(a) for a in ("-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", "-",
                                  "--output-json", "-")])
    assert code == 2 and b"both want stdout" in capsysbinary.readouterr().err


def test_audio_from_stdin(capsys, tmp_path, tiny_checkpoint, spoken_wav, monkeypatch):
    """`--audio -` reads the input from stdin (a pipe): the same answer as from the file; an empty
    or unreadable stdin is one error line."""
    import io

    code, from_file, _ = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "-q")
    assert code == 0
    for data, want in ((spoken_wav.read_bytes(), 0), (b"", 1), (b"not audio at all", 1)):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        code, out, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", "-", "-q")
        assert code == want, err
        if want == 0:
            assert out == from_file
        else:
            assert err.startswith("error: stdin: ") and err.count("\n") == 1, err
            assert "BytesIO" not in err  # soundfile's name for the buffer is not the user's


def test_same_seed_gives_a_byte_identical_wav(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    paths = [tmp_path / f"{i}.wav" for i in range(3)]
    results = [tmp_path / f"{i}.json" for i in range(3)]
    for path, result, seed in zip(paths, results, (0, 0, 1)):
        assert run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", path,
                       "--output-json", result, "--seed", seed, "-q")[0] == 0
    first, again, other = (json.loads(r.read_text()) for r in results)
    # where a difference starts: the ids, the codes, or only the samples (the codec)
    assert again["text_tokens"] == first["text_tokens"] and again["function_tokens"] == first["function_tokens"]
    assert again["audio_codes"] == first["audio_codes"]
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert other["audio_codes"] != first["audio_codes"]
    assert paths[0].read_bytes() != paths[2].read_bytes()


def test_quiet_prints_only_the_answer(capsys, tiny_checkpoint_q4, spoken_wav):
    code, out, err = run_cli(capsys, "-m", tiny_checkpoint_q4, "--audio", spoken_wav, "--quiet")
    assert code == 0 and err == ""
    assert out.startswith("[user] ")


def test_stereo_other_rate_input_is_converted(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    # made with soundfile + soxr (the package's own readers), not sox: the GPU machine has no sox
    stereo = tmp_path / "stereo44k.wav"
    mono, rate = sf.read(str(spoken_wav), dtype="float32")
    resampled = soxr.resample(mono, rate, 44100)
    sf.write(str(stereo), np.stack([resampled, 0.5 * resampled], axis=1), 44100, subtype="PCM_16")
    assert sf.info(str(stereo)).channels == 2
    assert run_cli(capsys, "-m", tiny_checkpoint, "--audio", stereo, "-q")[0] == 0


def test_demo_runs_offline_as_a_console_script(tmp_path):
    exe = shutil.which("vc-generate", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "voicechat.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(cmd + ["--demo", "--output-audio", str(tmp_path / "demo.wav")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[user] ")
    assert "demo:" in proc.stderr
    assert sf.info(str(tmp_path / "demo.wav")).samplerate == 22050


def test_python_dash_m_voicechat_is_vc_generate():
    """`python -m voicechat` (where the console scripts are not on PATH) runs the same command."""
    proc = subprocess.run([sys.executable, "-m", "voicechat", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("vc-generate (voicechat ")


def _broken_copy(tmp_path, src, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _set_config(d, **fields):
    data = json.loads((d / "config.json").read_text())
    data.update(fields)
    (d / "config.json").write_text(json.dumps(data))


def _bad_audio(tmp_path, kind):
    p = tmp_path / f"{kind}.wav"
    if kind == "text":
        p.write_text("this is not audio")
    elif kind == "empty":
        sf.write(str(p), np.zeros(0, np.float32), 16000)
    elif kind == "nan":
        sf.write(str(p), np.full(16000, np.nan, np.float32), 16000, subtype="FLOAT")
    return p


@pytest.mark.parametrize("kind,needle", [("text", "not a readable audio file"), ("empty", "no samples"),
                                         ("nan", "NaN"), ("missing", "no such file")])
def test_bad_audio_is_one_clear_line(capsys, tmp_path, tiny_checkpoint, kind, needle):
    audio = _bad_audio(tmp_path, kind) if kind != "missing" else tmp_path / "nope.wav"
    out_wav = tmp_path / "out.wav"
    code, out, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", audio, "--output-audio", out_wav)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err
    assert not out_wav.exists() and not list(tmp_path.glob(".out.wav*"))


def test_bad_checkpoints_are_one_clear_line(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    cases = []
    d = _broken_copy(tmp_path, tiny_checkpoint, "type")
    _set_config(d, model_type="llama")
    cases.append((d, "model_type"))
    d = _broken_copy(tmp_path, tiny_checkpoint, "speaker")
    _set_config(d, speaker="Zed")
    cases.append((d, "speaker"))
    d = _broken_copy(tmp_path, tiny_checkpoint, "shape")
    import mlx.core as mx

    tensors = mx.load(str(d / "model.safetensors"))
    tensors["tts_model.tts_model.embed_code.weight"] = mx.zeros((5, 5))
    mx.save_safetensors(str(d / "model.safetensors"), tensors)
    cases.append((d, "tts_model.tts_model.embed_code.weight has shape (5, 5)"))
    from voicechat.synthetic import make_checkpoint

    d = make_checkpoint(tmp_path / "shards", "tiny", shards=2)
    (d / "model-00001-of-00002.safetensors").unlink()
    cases.append((d, "missing shard"))
    cases.append((tmp_path / "no-such-dir", "no such checkpoint directory"))
    for ckpt, needle in cases:
        code, out, err = run_cli(capsys, "-m", ckpt, "--audio", spoken_wav)
        assert code == 1, (ckpt, err)
        assert err.count("\n") == 1 and needle in err, err


def test_bad_paths_and_arguments(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    code, _, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio",
                           tmp_path / "missing" / "a.wav")
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    unwritable = [Path("/proc")]  # procfs takes no new file, from root either
    if os.geteuid() != 0:  # root may write a folder whose mode says no
        unwritable.append(tmp_path / "locked")
        unwritable[-1].mkdir(mode=0o500)
    for folder in unwritable:
        code, _, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", folder / "a.wav")
        assert code == 2 and f"directory {folder} is not writable" in err and err.count("\n") == 1, err
    code, _, err = run_cli(capsys, "-m", tiny_checkpoint)
    assert code == 2 and "--audio is required" in err
    code, _, err = run_cli(capsys, "-m", tmp_path / "not-loaded", "--audio", spoken_wav, "--seed", "-1")
    assert code == 2 and "--seed must be in [0, 2**64)" in err and err.count("\n") == 1  # before any load
    code, _, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "-p", "word " * 5000)
    assert code == 1 and "system-prompt tokens" in err and err.count("\n") == 1


# --------------------------------------------------------------------------- issue 57: a hostile user

def _cli(*args) -> list[str]:
    """The command line of vc-generate in a fresh interpreter that imports this checkout."""
    return [sys.executable, "-m", "voicechat", *[str(a) for a in args]]


def _env(**extra) -> dict:
    import voicechat

    package_root = str(Path(voicechat.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _one_error_line(err: str, needle: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_devices_fifos_and_symlinks_are_written_to_not_replaced(capsys, tmp_path, tiny_checkpoint, spoken_wav,
                                                                 memory_device):
    import stat
    import threading

    null, full = memory_device("null", 3), memory_device("full", 7)
    fifo = tmp_path / "answer.json"
    os.mkfifo(fifo)
    got = bytearray()

    def read():
        with open(fifo, "rb") as f:
            got.extend(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code, _, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", null,
                           "--output-json", fifo, "-q")
    reader.join(timeout=60)  # (a daemon: a FIFO replaced by a file leaves it waiting for a writer)
    assert code == 0, err
    assert stat.S_ISCHR(os.stat(null).st_mode) and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(bytes(got))["frames"] > 0  # the JSON went through the FIFO
    (tmp_path / "real").mkdir()
    link = tmp_path / "answer.wav"
    link.symlink_to(tmp_path / "real" / "answer.wav")
    code, _, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--output-audio", link,
                           "--output-json", full, "-q")
    _one_error_line(err, f"cannot write {full}: No space left on device")
    assert code == 1 and stat.S_ISCHR(os.stat(full).st_mode)
    assert link.is_symlink() and sf.info(str(tmp_path / "real" / "answer.wav")).samplerate == 22050
    assert sorted(os.listdir(tmp_path)) == ["answer.json", "answer.wav", "full", "null", "real"]


def test_one_file_twice_or_the_input_as_an_output_is_refused_before_anything_runs(capsys, tmp_path, spoken_wav):
    """(The model does not exist: these are refused before it would be looked for.)"""
    (tmp_path / "link.wav").symlink_to(spoken_wav)
    os.link(spoken_wav, tmp_path / "hard.wav")
    out = tmp_path / "out.wav"
    for outputs, needle in ((["--output-audio", out, "--output-json", out], "are the same file"),
                            (["--output-audio", out, "--output-json", tmp_path / "." / "out.wav"], "are the same file"),
                            (["--output-audio", "/dev/stdout", "--output-json", "-"], "are the same file"),
                            (["--output-audio", spoken_wav], "is the input file"),
                            (["--output-json", tmp_path / "link.wav"], "is the input file"),
                            (["--output-audio", tmp_path / "hard.wav"], "is the input file")):
        code, _, err = run_cli(capsys, "-m", tmp_path / "no-model", "--audio", spoken_wav, *outputs)
        assert code == 2, err
        _one_error_line(err, needle)
    assert not out.exists() and sf.info(str(spoken_wav)).frames > 0


def test_a_closed_stdout_is_one_error_line(tmp_path, tiny_checkpoint, spoken_wav):
    """`vc-generate --output-json - | head -c 0`: EPIPE is one line naming stdout; no traceback, and
    none from the interpreter's own flush at exit."""
    proc = subprocess.Popen(_cli("-m", tiny_checkpoint, "--audio", spoken_wav, "--output-json", "-", "-q"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()  # the reader has gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    _one_error_line(err, "cannot write stdout: Broken pipe")


def test_absurd_extra_decoding_seconds_are_refused_before_padding(capsys, tiny_checkpoint, spoken_wav):
    """1e9 s of padding is 58 TiB: refused from the length, not a MemoryError traceback (nor, for
    1e305 s, an OverflowError from its sample count)."""
    for seconds in ("1e9", "1e305"):
        code, _, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav, "--extra-decoding-seconds",
                               seconds)
        assert code == 1
        _one_error_line(err, "input too long")


def test_a_long_pad_costs_no_memory_before_it_is_refused(tiny_checkpoint, spoken_wav, measured_run):
    """1e5 s of padding (6.4 GB of samples) is refused before any of it is allocated: the whole
    process, model load included, stays far below that."""
    code, _, err, peak_mib = measured_run(_cli("-m", tiny_checkpoint, "--audio", spoken_wav,
                                               "--extra-decoding-seconds", "1e5", "-q"), env=_env())
    assert code == 1
    _one_error_line(err, "input too long")
    assert peak_mib < 1024, peak_mib


def test_bad_audio_is_reported_before_the_model_loads(capsys, tmp_path, spoken_wav):
    """A typo in the path, or a header claiming 1 Hz, is reported before the checkpoint is looked
    for (the one named here does not exist: its error would come first otherwise)."""
    import struct

    one_hz = tmp_path / "one-hz.wav"
    data = bytearray(spoken_wav.read_bytes())
    struct.pack_into("<I", data, data.find(b"fmt ") + 12, 1)
    one_hz.write_bytes(bytes(data))
    for audio, needle in ((tmp_path / "questoin.wav", "questoin.wav: no such file"),
                          (one_hz, "sample rate 1 Hz is outside 1000..384000 Hz")):
        code, _, err = run_cli(capsys, "-m", tmp_path / "no-model", "--audio", audio)
        assert code == 1
        _one_error_line(err, needle)


def test_a_system_prompt_that_is_not_utf8_is_one_error_line(capsys, tmp_path, spoken_wav):
    """`-p $'\\xff'` reaches sys.argv as a lone surrogate: refused before anything runs."""
    code, _, err = run_cli(capsys, "-m", tmp_path / "no-model", "--audio", spoken_wav, "-p", "\udcff")
    assert code == 2
    _one_error_line(err, "-p/--system-prompt is not valid UTF-8 text")


def test_a_bug_in_voicechat_says_so_before_its_traceback(capsys, tiny_checkpoint, spoken_wav, tmp_path, monkeypatch):
    """An exception that is not a voicechat error (here MLX failing where it never should) is
    announced as an internal error, then shown with its traceback; no output is left behind."""
    import mlx.core as mx

    from voicechat.cli import INTERNAL_ERROR

    def broken():
        raise RuntimeError("the device vanished")

    monkeypatch.setattr(mx, "reset_peak_memory", broken)
    code, out, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", spoken_wav,
                             "--output-audio", tmp_path / "a.wav")
    assert code == 70 and out == ""
    assert err.startswith(INTERNAL_ERROR + "\nTraceback (most recent call last):"), err
    assert err.rstrip().endswith("RuntimeError: the device vanished")
    assert os.listdir(tmp_path) == []


def test_a_file_name_that_is_not_utf8_is_read(capsys, tmp_path, tiny_checkpoint, spoken_wav):
    name = os.fsencode(tmp_path) + b"/question-\xff.wav"
    with open(name, "wb") as f:
        f.write(spoken_wav.read_bytes())
    code, out, err = run_cli(capsys, "-m", tiny_checkpoint, "--audio", os.fsdecode(name), "-q",
                             "--output-audio", os.fsdecode(os.fsencode(tmp_path) + b"/answer-\xff.wav"))
    assert code == 0, err
    assert sf.info(os.fsencode(tmp_path) + b"/answer-\xff.wav").samplerate == 22050


def test_help_says_how_long_an_input_may_be(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "about 2.9 hours for the published checkpoint" in text
    assert "about 5.5 minutes for --demo's tiny one" in text


def _demo_folders(folder: Path) -> list[str]:
    """vc-demo's folders in `folder` (MLX may make a folder of its own there)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("vc-demo-"))


def test_sigterm_removes_the_demo_folder(tmp_path):
    """SIGTERM during --demo ends with one line and exit 143, the demo's folder removed (the signal
    lands while the run imports and compiles modules: it is not lost there)."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(_cli("--demo", "-q"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(TMPDIR=str(tmp), HF_HUB_OFFLINE="1"))
    while not _demo_folders(tmp) and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    _one_error_line(err.decode(), "error: terminated")
    assert _demo_folders(tmp) == []


def test_no_demo_folder_without_demo(tmp_path, spoken_wav):
    """Without --demo no folder is made: seen while the command waits on its stdin, before any
    model is loaded (then SIGTERM ends it)."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(_cli("-m", tmp_path / "no-model", "--audio", "-"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(TMPDIR=str(tmp)))

    def reading_stdin() -> bool:  # blocked in read(0, ...): /proc/PID/syscall is "0 0x0 ..."
        try:
            return Path(f"/proc/{proc.pid}/syscall").read_text().startswith("0 0x0 ")
        except OSError:
            return False

    while not reading_stdin() and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()
    assert _demo_folders(tmp) == []
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    _one_error_line(err.decode(), "error: terminated")


def test_progress_on_a_terminal_shows_the_load_the_timeline_and_the_codec(tmp_path, tiny_checkpoint, spoken_wav):
    """On a terminal the bar does not sit at 100% through the codec: the load and the codec are
    stages of their own."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (a new pty has 0 columns)
    proc = subprocess.Popen(_cli("-m", tiny_checkpoint, "--audio", spoken_wav), stdout=subprocess.PIPE,
                            stderr=slave, env=_env())
    os.close(slave)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's last writer has gone
            break
        if not chunk:
            break
        shown.extend(chunk)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    text = shown.decode(errors="replace")
    load, timeline, codec = text.find("load: "), text.find("timeline:"), text.find("codec: ")
    assert -1 < load < timeline < codec, text
