"""The live session: pushed in any chunks, its result equals generate() on the same input; bad input,
busy models, the end of the context; `vc-chat -m`, a live session in a terminal client."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import soundfile as sf

import voicechat
from live_checks import check_equal
from voicechat.audio import load_audio
from voicechat.live import ContextFull, LiveSession
from voicechat.stt.conformer import PerceptionStream
from voicechat.session import InputError, ModelBusy
from voicechat.synthetic import make_checkpoint, tiny_config

EXTRA = 1.0
PROMPT = "Be brief."

# The streamed codec runs its convolutions on other shapes than the whole-answer decode: on a CPU
# the samples agree to 1e-5; on a CUDA GPU other kernels round differently (up to ~5e-5).


@pytest.fixture(scope="module")
def chat(tiny_checkpoint):
    chat = voicechat.load(tiny_checkpoint)
    yield chat
    chat.close()


@pytest.fixture(scope="module")
def inputs(spoken_wav, spoken_wav_22k):
    """name -> (samples as pushed, their rate): PCM16 at 16 kHz, float at 22.05 kHz, and a 16 kHz
    input long enough for the encoder's attention cache to drop frames (> 70 frames)."""
    speech16, _ = sf.read(str(spoken_wav), dtype="int16")
    speech22, rate22 = sf.read(str(spoken_wav_22k), dtype="float32")
    speech = load_audio(spoken_wav, 16000)
    long = np.concatenate([speech, np.zeros(4000, np.float32), speech[::-1], speech])
    return {"speech16k": (speech16, 16000), "speech22k": (speech22, rate22), "long16k": (long, 16000)}


_references: dict = {}


def reference(chat, inputs, name, system_prompt=None, seed=0):
    """generate() on the same input (made once per input and settings)."""
    key = (name, system_prompt, seed)
    if key not in _references:
        samples, rate = inputs[name]
        _references[key] = chat.generate(samples, system_prompt=system_prompt, extra_decoding_seconds=EXTRA,
                                          seed=seed, sample_rate=rate)
    return _references[key]


def chunk_sizes(kind: str, total: int, rate: int, seed: int = 0) -> list[int]:
    if kind == "whole":
        return [total]
    if kind == "80ms":
        return [int(0.08 * rate)] * (total // int(0.08 * rate) + 1)
    rng = np.random.default_rng(seed)  # one sample up to several seconds
    sizes = [1, 1, 2, 3, 1, 250, 7]
    while sum(sizes) < total:
        sizes.append(int(rng.choice([1, 13, 160, 1279, 4000, 3 * rate])))
    return sizes


def run_live(chat, samples, rate, sizes, system_prompt=None, seed=0, bad_inputs=False, **options):
    """Push `samples` in `sizes`, then finish(EXTRA). Returns (every frame, the result)."""
    frames = []
    with chat.live(system_prompt=system_prompt, seed=seed, **options) as live:
        pos = 0
        for i, size in enumerate(sizes):
            if pos >= len(samples):
                break
            if bad_inputs and i == 3:
                for bad, match in ((np.full(5, np.nan, np.float32), "NaN"), (np.zeros((2, 3, 4), np.float32), "shape"),
                                   (np.array(["a", "b"]), "expected float"), (np.zeros(5, np.complex64), "expected float"),
                                   (np.zeros((5, 2), samples.dtype), "channel")):
                    with pytest.raises(InputError, match=match):
                        live.push(bad, sample_rate=rate)
                with pytest.raises(InputError, match="Hz"):
                    live.push(samples[pos : pos + size], sample_rate=rate + 1)
                for wrong_rate in (0, -16000, 1.5, True, "16000"):
                    with pytest.raises(InputError, match="sample_rate"):
                        live.push(samples[pos : pos + size], sample_rate=wrong_rate)
                assert live.push(samples[:0], sample_rate=rate) == []
            frames += live.push(samples[pos : pos + size], sample_rate=rate)
            pos += size
        frames += live.finish(extra_decoding_seconds=EXTRA)
        return frames, live.result()


@pytest.mark.parametrize("name,kind,options", [
    ("speech16k", "whole", {}),                                  # PCM16 whole
    ("speech16k", "80ms", {}),
    ("speech16k", "random", {"bad_inputs": True}),               # bad chunks refused in between
    ("speech22k", "random", {}),                                 # resampled as it comes
    ("long16k", "random", {}),                                   # past the encoder's 70-frame cache
    ("speech16k", "80ms", {"system_prompt": PROMPT, "seed": 5, "tts_thread": True}),
    ("long16k", "80ms", {"tts_thread": True}),
])
def test_live_result_equals_generate(chat, inputs, name, kind, options):
    options = dict(options)
    threaded = options.pop("tts_thread", False)
    samples, rate = inputs[name]
    expected = reference(chat, inputs, name, options.get("system_prompt"), options.get("seed", 0))
    if name == "long16k":
        assert expected.frames > 80
    chat.tts_thread = threaded
    try:
        frames, result = run_live(chat, samples, rate, chunk_sizes(kind, len(samples), rate), **options)
    finally:
        chat.tts_thread = False
    check_equal(frames, result, expected)
    assert chat._tts_worker is None  # a live session steps its TTS on its own thread, whatever tts_thread says


def test_chunks_that_complete_no_frame_build_no_matmul_of_zero_rows(chat, inputs, monkeypatch):
    """MLX-CUDA's addmm divides by the row count (SIGFPE on zero rows): a chunk shorter than a frame,
    an empty finish and a finish that completes nothing new must not build one."""
    import mlx.core as mx

    seen = []
    for name in ("addmm", "matmul"):
        real = getattr(mx, name)

        def spy(*args, _real=real, _name=name, **kw):
            a, b = args[-2], args[-1]
            seen.append((_name, tuple(a.shape), tuple(b.shape)))
            return _real(*args, **kw)

        monkeypatch.setattr(mx, name, spy)
    samples, rate = inputs["speech16k"]
    with chat.live() as live:
        for pos in range(0, 16000, 640):  # half frames: every other push completes nothing
            live.push(samples[pos : pos + 640], sample_rate=rate)
        live.push(samples[:0], sample_rate=rate)
        live.finish(extra_decoding_seconds=0.0)
    assert seen, "the session built no matmul through mx.addmm / mx.matmul: the spy watches nothing"
    assert [s for s in seen if 0 in s[1] or 0 in s[2]] == []


def test_a_live_session_casts_perception_and_codec_weights_once_and_changes_no_value(tmp_path, inputs):
    """bfloat16 weights (as published): the first live session makes perception's and the codec
    decoder's float32 for good (no cast per chunk), and generate gives the same ids and samples
    before and after, as the live session does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from voicechat.held import held
    from voicechat.llm.opcount import count_ops
    from voicechat.synthetic import random_checkpoint

    chat = voicechat.load(random_checkpoint(tmp_path / "bf16", "tiny", quantize=4, dtype="bfloat16"))
    modules = (chat.listening.perception, chat.speaking.audio_codec.decoder, chat.speaking.audio_codec.prvq)
    dtypes = lambda: {v.dtype for m in modules for _, v in tree_flatten(m.parameters())}  # noqa: E731
    samples, rate = inputs["speech16k"]
    chunk = load_audio(samples, 16000, rate)[:4000]

    def chunk_ops():
        stream = PerceptionStream(chat.listening.perception)
        projected, encoded = stream.push(chunk)
        return count_ops(projected, encoded, stream.state)

    assert mx.bfloat16 in dtypes()
    casts_before = chunk_ops()["AsType"]
    before = chat.generate(samples, extra_decoding_seconds=EXTRA, sample_rate=rate)
    frames = []
    with chat.live() as live:
        assert dtypes() == {mx.float32}
        # The codec's stacked codebooks are made from the float32 means with the cast, not by the
        # first frame that decodes (on whatever thread steps it).
        prvq = chat.speaking.audio_codec.prvq
        kept = held(prvq, "_codebooks", tuple(prvq.mus_list))
        assert kept is not None
        book = kept[0]
        assert book.dtype == mx.float32
        # and the decoder's operands (taps, transposed matrices) held as views of its float32 weights
        operands = tree_flatten(chat.speaking.audio_codec.decoder.operands())
        assert sum(count_ops(a).total() for _, a in operands) == 0
        for pos in range(0, len(samples), 1280):
            frames += live.push(samples[pos : pos + 1280], sample_rate=rate)
        frames += live.finish(extra_decoding_seconds=EXTRA)
        live_result = live.result()
        assert prvq.codebooks()[0] is book
    after = chat.generate(samples, extra_decoding_seconds=EXTRA, sample_rate=rate)
    ops_after = chunk_ops()
    chat.close()
    assert ops_after["AsType"] <= 4 < casts_before, (casts_before, ops_after)
    # the encoder's depthwise taps were held again from the float32 weights (none sliced and
    # squeezed in the chunk's graph), and its layers' frames are matmul rows (none flattened)
    assert ops_after["Squeeze"] == ops_after["Flatten"] == 0, ops_after
    for result in (live_result, after):
        assert result.text_tokens == before.text_tokens and result.audio_codes == before.audio_codes
        assert result.user_transcript == before.user_transcript
    np.testing.assert_array_equal(after.audio, before.audio)
    check_equal(frames, live_result, before)


def test_control_codes_become_silence_on_the_device_as_on_the_host(chat):
    import mlx.core as mx

    control = np.array(chat.speaking.control_codes)
    silence = np.array(chat.speaking.codec_silence_tokens)
    rng = np.random.default_rng(3)
    cases = [rng.integers(0, 1024, silence.size).astype(np.int32) for _ in range(4)]
    for j, code in enumerate(control):  # each control code, at one position and at every one
        cases[j][j::3] = code
    cases.append(np.full(silence.size, control[-1], np.int32))
    with chat.live() as live:
        for codes in cases:
            host = live._decodable(codes)
            assert not np.array_equal(host, codes) or not np.isin(codes, control).any()
            got = np.array(live._decodable_on_device(mx.array(codes.reshape(1, 1, -1))))
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, host[None, :, None])
    np.testing.assert_array_equal(live._decodable(cases[-1]), silence)


def test_the_input_is_kept_only_when_asked_and_the_audio_unless_told(chat, inputs):
    samples, rate = inputs["speech16k"]
    expected = reference(chat, inputs, "speech16k")
    frames, result = run_live(chat, samples, rate, [4000] * 20, keep_input_audio=True, keep_audio=False)
    assert result.audio.size == 0 and result.audio_codes == expected.audio_codes
    with chat.live() as live:
        live.push(samples[:3000])
        with pytest.raises(InputError, match="keep_input_audio"):
            live.input_audio  # noqa: B018
    with chat.live(keep_input_audio=True) as live:
        live.push(samples[:3000])
        live.push(samples[3000:])
        np.testing.assert_array_equal(live.input_audio, samples.astype(np.float32) / 32768)


def test_live_refuses_what_generate_refuses(chat, inputs):
    limit = chat.config.text_config.max_position_embeddings
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(InputError, match="seed must be an integer"):
            chat.live(seed=seed)
    for prompt in (123, b"Be brief."):
        with pytest.raises(TypeError, match="system_prompt must be a str or None"):
            chat.live(system_prompt=prompt)
    with pytest.raises(InputError, match="system-prompt tokens"):
        chat.live(system_prompt="word " * (limit + 10))
    with chat.live() as live:
        for extra in (-1, float("nan"), float("inf"), "3"):
            with pytest.raises(InputError, match="extra_decoding_seconds must be a finite number"):
                live.finish(extra_decoding_seconds=extra)
        with pytest.raises(InputError, match="finish"):
            live.result()
        live.push(inputs["speech16k"][0])
        live.finish(0.5)
        assert live.result().frames > 0
        with pytest.raises(InputError, match="ended"):
            live.push(inputs["speech16k"][0])
        with pytest.raises(InputError, match="ended"):
            live.finish()
    # the refusals above left the model free
    assert chat.generate(inputs["speech16k"][0], sample_rate=16000, extra_decoding_seconds=0.2).frames > 0


def test_an_open_session_holds_the_model_until_closed(chat, inputs):
    samples, rate = inputs["speech16k"]
    live = chat.live()
    with pytest.raises(ModelBusy, match="live session is open"):
        chat.generate(samples, sample_rate=rate)
    with pytest.raises(ModelBusy):
        chat.live()
    live.push(samples[:5000])
    live.close()  # not finished: abandoned
    with pytest.raises(InputError, match="ended"):
        live.push(samples[:100])
    with chat.live() as again:  # the model is free again
        assert isinstance(again, LiveSession)


def test_a_session_opened_during_a_generate_waits_for_it(chat, inputs):
    samples, rate = inputs["speech16k"]
    generating, release = threading.Event(), threading.Event()
    opened: list = []

    def progress(done, total):
        generating.set()
        release.wait()

    worker = threading.Thread(target=lambda: chat.generate(samples, sample_rate=rate, progress=progress))
    worker.start()
    generating.wait()
    opener = threading.Thread(target=lambda: opened.append(chat.live()))
    opener.start()
    opener.join(timeout=0.5)
    assert not opened  # still waiting for the generate
    release.set()
    worker.join()
    opener.join()
    assert isinstance(opened[0], LiveSession)
    opened[0].close()


def test_the_context_full_ends_the_session_with_one_clear_error(tmp_path, inputs):
    config = tiny_config()
    config.text_config.max_position_embeddings = 26
    small = voicechat.load(make_checkpoint(tmp_path / "small-context", "tiny", config=config))
    samples, rate = inputs["speech16k"]
    prompt_frames = len(small.prompt_ids(PROMPT))
    room = 26 - prompt_frames
    frames = []
    twice = np.concatenate([samples, samples])  # more frames than the context holds
    with small.live(system_prompt=PROMPT) as live:
        with pytest.raises(ContextFull, match=f"after {room} frames") as caught:
            for pos in range(0, len(twice), 1280):
                frames += live.push(twice[pos : pos + 1280], sample_rate=rate)
        frames += caught.value.frames
        assert isinstance(caught.value, InputError) and caught.value.limit == 26
        for call in (lambda: live.push(samples[:1280]), live.finish):  # the session has ended
            with pytest.raises(ContextFull):
                call()
        result = live.result()
    assert result.frames == room == len(frames) and result.prompt_frames == prompt_frames
    np.testing.assert_array_equal(np.concatenate([f.audio for f in frames]), result.audio)
    assert result.audio.size == room * 1764  # the last frame carries the final samples
    # the frames before the end equal generate() on the input cut short (which fits the context)
    cut = small.generate(samples[: 16000], system_prompt=PROMPT, extra_decoding_seconds=0, sample_rate=rate)
    assert cut.frames < room
    assert result.text_tokens[: cut.frames - 1] == cut.text_tokens[:-1]
    assert result.audio_codes[: cut.frames - 1] == cut.audio_codes[:-1]


def vc_chat(*argv: str, env: dict | None = None, timeout: float = 300):
    """`vc-chat` run as a user runs it, in a process of its own."""
    import subprocess
    import sys

    from serving import child_env

    return subprocess.run([sys.executable, "-m", "voicechat.chat_client", *argv], env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_vc_chat_with_a_model_here_warms_it_then_streams_a_file(chat, tiny_checkpoint, spoken_wav, tmp_path):
    """`vc-chat -m`: the model is loaded and its live path warmed before the file is read, and the
    transcript and the answer WAV equal generate's (the answer as PCM16)."""
    out = tmp_path / "answer.wav"
    proc = vc_chat("-m", str(tiny_checkpoint), "--audio-file", str(spoken_wav), "--fast", "--no-playback",
                   "--output-audio", str(out), "--seed", "5", "-p", PROMPT, "--extra-decoding-seconds", "0.4")
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in proc.stderr.splitlines() if line.startswith("vc-chat:")]
    assert steps == [f"vc-chat: loading {tiny_checkpoint}", "vc-chat: warming up the live path"]
    result = chat.generate(str(spoken_wav), system_prompt=PROMPT, seed=5, extra_decoding_seconds=0.4)
    heard = "".join(line[len("[user] "):] for line in proc.stdout.splitlines() if line.startswith("[user] "))
    assert heard == result.user_transcript
    got, rate = sf.read(out, dtype="float32")  # PCM16 back to float: within one step of the samples
    assert rate == 22050 and got.shape == result.audio.shape
    np.testing.assert_allclose(got, np.clip(result.audio, -1.0, 1.0), atol=1.5 / 32768)


def test_vc_chat_with_a_bad_model_path_is_one_error_line(tmp_path, spoken_wav):
    out = tmp_path / "answer.wav"
    proc = vc_chat("-m", str(tmp_path / "missing"), "--audio-file", str(spoken_wav), "--no-playback",
                   "--output-audio", str(out), timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "missing" in errors[0]
    assert not out.exists()


def test_vc_chat_refuses_a_bad_file_before_loading_the_model(tmp_path):
    """The file is checked first: with a junk file and a model path that does not exist, the one
    error is the file's (no load was tried)."""
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF" + bytes(100))
    out = tmp_path / "answer.wav"
    proc = vc_chat("-m", str(tmp_path / "no-model"), "--audio-file", str(junk), "--no-playback",
                   "--output-audio", str(out), timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:") and "junk.wav" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("output", ["missing-dir/answer.wav", "question.wav"])
def test_vc_chat_refuses_an_output_it_cannot_write_before_any_work(tmp_path, spoken_wav, output):
    """An output in a directory that does not exist, or the input file itself: one error line
    before the model loads (the model path does not exist either: no load is tried) and the
    input untouched."""
    import shutil
    question = tmp_path / "question.wav"
    shutil.copy(spoken_wav, question)
    before = question.read_bytes()
    proc = vc_chat("-m", str(tmp_path / "no-model"), "--audio-file", str(question), "--no-playback",
                   "--output-audio", str(tmp_path / output), timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "no-model" not in lines[0] and str(tmp_path / output) in lines[0]
    assert question.read_bytes() == before


def test_vc_chat_compiles_ahead_on_a_first_run_then_only_warms(tiny_checkpoint, spoken_wav, tmp_path):
    """VOICECHAT_PRECOMPILE=1 (a first run's precompile on any device, as a CUDA GPU's by default):
    the first vc-chat -m says its precompile's progress and runs the conversation; the next, on the
    caches and marker it left, only warms the live path. Both answers are the same."""
    from serving import child_env

    env = dict(child_env(), VOICECHAT_PRECOMPILE="1", VOICECHAT_PRECOMPILE_PROCESSES="0",
               XDG_CACHE_HOME=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    answers, steps = [], []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.wav"
        proc = vc_chat("-m", str(tiny_checkpoint), "--audio-file", str(spoken_wav), "--fast", "--no-playback",
                       "--output-audio", str(out), env=env)
        assert proc.returncode == 0, proc.stderr
        steps.append([line for line in proc.stderr.splitlines() if line.startswith("vc-chat:")])
        answers.append(sf.read(out, dtype="int16")[0])
    first, second = steps
    assert first[0].startswith("vc-chat: loading") and first[-1].startswith("vc-chat: precompiled: ")
    assert any(line.startswith("vc-chat: compiling kernels for this model (first run only): ") for line in first)
    assert not any("warming" in line for line in first)
    assert second[1:] == ["vc-chat: warming up the live path"]
    np.testing.assert_array_equal(answers[0], answers[1])
