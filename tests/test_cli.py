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
