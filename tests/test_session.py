"""The offline timeline end to end on tiny synthetic checkpoints and a real spoken WAV."""

import threading
import time

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten

import voicechat
from voicechat.session import InputError
from voicechat.tts_thread import TTSThread


@pytest.fixture(scope="module")
def chat(tiny_checkpoint):
    return voicechat.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def chat_q4(tiny_checkpoint_q4):
    return voicechat.load(tiny_checkpoint_q4)


@pytest.fixture(scope="module")
def result(chat, spoken_wav):
    return chat.generate(spoken_wav, seed=0)


def test_result_shapes_and_lengths(chat, result, spoken_wav):
    import soundfile as sf

    samples = sf.info(str(spoken_wav)).frames
    mel_frames = 1 + (samples + 3 * 16000) // 160
    frames = mel_frames
    for _ in range(3):
        frames = frames // 2 + 1
    assert result.frames == frames
    assert len(result.text_tokens) == len(result.function_tokens) == frames
    assert len(result.audio_codes) == frames and all(len(c) == 31 for c in result.audio_codes)
    assert result.audio_codes[0] == [0] * 31  # no TTS at position 0
    assert result.audio.dtype == np.float32 and result.audio.shape == (frames * 1764,)
    assert result.sample_rate == 22050
    assert np.all(np.isfinite(result.audio)) and np.abs(result.audio).max() > 0
    k = chat.config.tts_config.codebook_size
    assert all(0 <= c < k for row in result.audio_codes for c in row)
    assert all(0 <= t < chat.config.text_config.vocab_size for t in result.text_tokens + result.function_tokens)
    assert set(result.timings) >= {"perception_s", "tts_warmup_s", "timeline_s", "codec_s", "transcript_s", "generate_s"}
    # a handful, not one per frame (the TTS worker thread, on by default on a GPU, waits on its own half)
    assert result.host_syncs <= (7 + 2 * (frames // 32) if chat.tts_thread else 5 + frames // 32)
    # the running peak memory after each stage: every stage, never falling, above zero
    peaks = result.peak_memory_gb
    assert list(peaks) == [k for k in result.timings if k != "generate_s"]
    assert all(a <= b for a, b in zip(list(peaks.values()), list(peaks.values())[1:]))
    assert list(peaks.values())[0] > 0


def test_intermediates_are_finite(chat, spoken_wav):
    from voicechat.audio import load_audio

    p = chat.listening.perception
    wave = load_audio(spoken_wav, 16000)
    mel = p.log_mel(mx.array(wave))
    projected, lengths, encoded = p(mel)
    cache = chat.listening.make_cache()
    out = chat.listening.step(chat.listening.fused_input(mx.array([[12]]), projected[:, :1], mx.array([[12]])), cache)
    for a in (mel, projected, encoded, out.text_logits, out.function_logits):
        assert bool(mx.all(mx.isfinite(a)).item())


def test_texts_decode_without_the_special_ids(chat, result):
    skip = {12, 11, 1, 2}
    assert result.text == chat.tokenizer.decode(result.text_tokens, skip=skip).strip()
    assert result.function_text == chat.tokenizer.decode(result.function_tokens, skip=skip).strip()


def test_cached_loop_equals_full_history_recompute(chat, result, spoken_wav):
    text, function = chat.text_ids_full_history(spoken_wav)
    assert text == result.text_tokens
    assert function == result.function_tokens


def test_same_seed_same_output_other_seed_other_codes(chat, result, spoken_wav):
    again = chat.generate(spoken_wav, seed=0)
    assert np.array_equal(again.audio, result.audio)
    assert again.audio_codes == result.audio_codes and again.text_tokens == result.text_tokens
    other = chat.generate(spoken_wav, seed=1)
    assert other.text_tokens == result.text_tokens and other.function_tokens == result.function_tokens
    assert other.audio_codes != result.audio_codes


def test_system_prompt_is_a_prefix_that_is_dropped(chat, result, spoken_wav):
    prompt = "Be concise and answer in one sentence."
    with_prompt = chat.generate(spoken_wav, system_prompt=prompt)
    ids = chat.prompt_ids(prompt)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) > 5
    assert with_prompt.prompt_frames == len(ids)
    assert with_prompt.frames == result.frames
    assert len(with_prompt.text_tokens) == len(result.text_tokens)
    assert with_prompt.audio.shape == result.audio.shape
    assert with_prompt.text_tokens != result.text_tokens  # the prompt conditions the answer
    text, function = chat.text_ids_full_history(spoken_wav, system_prompt=prompt)
    assert (text, function) == (with_prompt.text_tokens, with_prompt.function_tokens)


def test_quantized_checkpoint_runs_end_to_end(chat_q4, spoken_wav):
    r = chat_q4.generate(spoken_wav)
    assert np.all(np.isfinite(r.audio)) and r.audio.shape == (r.frames * 1764,)
    text, function = chat_q4.text_ids_full_history(spoken_wav)
    assert text == r.text_tokens and function == r.function_tokens


def test_array_input_and_extra_seconds(chat, spoken_wav):
    from voicechat.audio import read_audio

    data, rate = read_audio(spoken_wav)
    a = chat.generate(data[:, 0], sample_rate=rate, extra_decoding_seconds=0.5)
    b = chat.generate(spoken_wav, extra_decoding_seconds=0.5)
    assert a.text_tokens == b.text_tokens and np.array_equal(a.audio, b.audio)
    longer = chat.generate(spoken_wav, extra_decoding_seconds=1.5)
    assert longer.frames - a.frames == 12 or longer.frames - a.frames == 13  # +1 s = 12.5 frames


def test_inputs_past_the_context_are_refused(chat, spoken_wav):
    limit = chat.config.text_config.max_position_embeddings
    with pytest.raises(InputError, match="system-prompt tokens"):
        chat.generate(spoken_wav, system_prompt="word " * (limit + 10))
    seconds = limit * 0.08 + 10
    with pytest.raises(InputError, match="context"):
        chat.generate(np.zeros(int(seconds * 16000), np.float32), sample_rate=16000)
    with pytest.raises(InputError, match="extra_decoding_seconds"):
        chat.generate(spoken_wav, extra_decoding_seconds=-1)
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(InputError, match="seed must be an integer"):
            chat.generate(spoken_wav, seed=seed)
    for extra in (float("nan"), float("inf"), "3"):
        with pytest.raises(InputError, match="extra_decoding_seconds must be a finite number"):
            chat.generate(spoken_wav, extra_decoding_seconds=extra)
    for prompt in (123, b"Be brief."):
        with pytest.raises(TypeError, match="system_prompt must be a str or None"):
            chat.generate(spoken_wav, system_prompt=prompt)


def test_pipelined_loop_equals_the_plain_loop(chat, result, spoken_wav):
    """Ids kept on the device and async evaluation change nothing: the loop that waits for every
    frame and feeds Python ints back gives the same ids, codes and samples (same seed)."""
    plain = chat.generate(spoken_wav, seed=0, pipelined=False)
    assert plain.text_tokens == result.text_tokens and plain.function_tokens == result.function_tokens
    assert plain.audio_codes == result.audio_codes
    assert np.array_equal(plain.audio, result.audio)
    assert plain.host_syncs > result.frames > result.host_syncs


def test_the_tts_worker_is_on_by_default_only_on_a_cuda_gpu_and_the_environment_sets_it(
        tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("VOICECHAT_TTS_THREAD", raising=False)
    device = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        assert voicechat.load(tiny_checkpoint).tts_thread is False
    finally:
        mx.set_default_device(device)
    if mx.default_device() == mx.gpu and getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        assert voicechat.load(tiny_checkpoint).tts_thread is True
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setenv("VOICECHAT_TTS_THREAD", value)
        assert voicechat.load(tiny_checkpoint).tts_thread is want
    monkeypatch.setenv("VOICECHAT_TTS_THREAD", "yes")
    with pytest.raises(ValueError, match="VOICECHAT_TTS_THREAD is 'yes': use 0 or 1"):
        voicechat.load(tiny_checkpoint)


def test_the_tts_thread_gives_one_answer_a_seed_across_fresh_loads(tiny_checkpoint, result, spoken_wav):
    """What test_cli's same-seed test does with the worker on (an array read by both threads can give
    one seed two WAVs): each load its own streams and compiled steps, each first generate threaded."""
    for _ in range(2):
        with voicechat.load(tiny_checkpoint) as chat:
            chat.tts_thread = True
            again = chat.generate(spoken_wav, seed=0)
            worker = chat._tts_worker
        assert again.text_tokens == result.text_tokens and again.audio_codes == result.audio_codes
        assert np.array_equal(again.audio, result.audio)
        assert not worker.is_alive()  # closed with the model


@pytest.mark.parametrize("system_prompt", [None, "Be brief."])
def test_the_tts_on_its_own_thread_changes_nothing(chat, result, spoken_wav, system_prompt):
    """`tts_thread` (the TTS steps built on a worker thread, fed the LLM's text ids on the device)
    gives the same ids, codes and samples as the loop on one thread, and leaves its worker idle."""
    default = chat.tts_thread
    try:
        chat.tts_thread = False
        one = chat.generate(spoken_wav, seed=0, system_prompt=system_prompt)
        chat.tts_thread = True
        two = chat.generate(spoken_wav, seed=0, system_prompt=system_prompt)
    finally:
        chat.tts_thread = default
    if system_prompt is None:
        assert one.audio_codes == result.audio_codes
    assert two.text_tokens == one.text_tokens and two.function_tokens == one.function_tokens
    assert two.audio_codes == one.audio_codes
    assert np.array_equal(two.audio, one.audio)
    assert chat._tts_worker.is_alive() and chat._tts_worker.pending == 0
    frames = two.frames + two.prompt_frames  # the worker's waits add to the caller's, a handful still
    assert one.host_syncs <= 5 + frames // 32 and two.host_syncs <= 7 + 2 * (frames // 32)


def test_threaded_generates_share_one_worker_thread_until_close(tiny_checkpoint, result, spoken_wav):
    """A VoiceChat keeps one TTS worker thread across generates (a thread per call traced the
    compiled TTS step again every call: MLX's compile cache is thread-local); close() ends it, and
    a later threaded generate starts another that gives the same answer."""
    chat = voicechat.load(tiny_checkpoint)
    chat.tts_thread = True
    first = chat.generate(spoken_wav, seed=0)
    worker = chat._tts_worker
    second = chat.generate(spoken_wav, seed=0)
    assert chat._tts_worker is worker and worker.is_alive()
    assert second.audio_codes == first.audio_codes == result.audio_codes
    chat.close()
    assert not worker.is_alive() and chat._tts_worker is None
    third = chat.generate(spoken_wav, seed=0)
    assert chat._tts_worker is not worker and chat._tts_worker.is_alive()  # (thread ids are reused)
    assert third.audio_codes == result.audio_codes
    chat.close()


_FROM_A_THREAD = """
import json, sys, threading
import mlx.core as mx
import voicechat

chat = voicechat.load(sys.argv[1])
out = {}

def call():
    try:
        r = chat.generate(sys.argv[2], seed=0)
        out.update(codes=r.audio_codes, text=r.text_tokens)
    except Exception as e:
        out["error"] = repr(e)
    finally:
        mx.clear_streams()  # what a caller's thread does before it ends (see the README)

caller = threading.Thread(target=call)
caller.start()
caller.join()
print(json.dumps(out))
"""


def test_generate_from_a_thread_of_the_callers_own(tiny_checkpoint, result, spoken_wav):
    """A server calls generate() from its own threads, not the one that loaded the model (a fresh
    process: nothing else has touched the model's arrays first). Nothing the model or the session
    holds may be a lazy array of the loading thread's streams (a module-level constant was), the
    result is the same, and the process exits cleanly (MLX aborted at exit over a finished thread's
    streams)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FROM_A_THREAD, str(tiny_checkpoint), str(spoken_wav)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in out, out["error"]
    assert out["codes"] == result.audio_codes and out["text"] == result.text_tokens


class _Stop(Exception):
    pass


def test_a_failing_progress_callback_stops_the_tts_thread(chat, result, spoken_wav):
    """An error in the caller's loop (here the progress callback's, as an interrupt would be) ends
    generate() with that error without stepping the queued frames, leaves the worker idle, and the
    next generate() gives the same result as before."""
    def stop_at_10(done, total):
        if done == 10:
            raise _Stop(f"{done} of {total}")

    default = chat.tts_thread
    chat.tts_thread = True
    try:
        with pytest.raises(_Stop, match="10 of"):
            chat.generate(spoken_wav, seed=0, progress=stop_at_10)
        assert chat._tts_worker.pending == 0
        again = chat.generate(spoken_wav, seed=0)
    finally:
        chat.tts_thread = default
    assert again.audio_codes == result.audio_codes and again.text_tokens == result.text_tokens


def _warmed_up_tts(chat):
    """A fresh TTS cache after the speaker-prompt warmup, on the worker's stream, and the last code:
    what `generate` hands a TTSThread."""
    tts = chat.ear_tts
    with mx.stream(chat._tts_stream):
        cache = tts.make_cache()
        previous = tts.warmup(chat.speaking.audio_prompt_latents[chat.config.speaker], chat.warmup_codes(), cache)
    return cache, previous


def test_an_error_in_the_tts_thread_reaches_the_caller(chat):
    """A TTS step that fails on the worker raises in the caller's thread, at its next `put()` (the
    caller's loop stops early) and at `finish()`, and the worker's job ends (a silence row of the
    wrong size cannot be reshaped to the frame's codes)."""
    tts = chat.ear_tts
    cache, previous = _warmed_up_tts(chat)
    worker = TTSThread(tts, chat._tts_stream, mx.zeros((5,), mx.int32), sync_every=4, worker=chat._worker_thread())
    worker.start(previous, cache, mx.random.key(0))
    with pytest.raises(ValueError, match="reshape"):
        for _ in range(500):  # the worker's error stops the caller at a put() once it has failed
            worker.put(mx.array([chat.config.pad_token_id], mx.int32))
            time.sleep(0.01)
    worker.abort()
    with pytest.raises(ValueError, match="reshape"):
        worker.finish()
    assert chat._tts_worker.pending == 0


def test_the_tts_worker_is_handed_ids_scheduled_on_the_callers_thread(chat):
    """`put()` schedules each id on the caller's thread. An id still lazy would be evaluated by the
    worker: on the caller's own default stream MLX refuses that ("There is no Stream(...) in current
    thread", what this test would see), and on a stream both threads use, two threads would encode
    into it at once (the system prompt's frames once handed the worker such a pad id: where the
    threaded loop crashed on the GPU). The same codes either way."""
    tts, c = chat.ear_tts, chat.config

    def codes(make_id):
        cache, previous = _warmed_up_tts(chat)
        worker = TTSThread(tts, chat._tts_stream, chat.speaking.codec_silence_tokens, sync_every=4,
                           worker=chat._worker_thread())
        worker.start(previous, cache, mx.random.key(3))
        for i in range(6):
            worker.put(make_id(c.pad_token_id - i))
        made, _ = worker.finish()
        return [np.array(code) for code in made]

    settled = codes(lambda i: mx.array([i], dtype=mx.int32))
    lazy = codes(lambda i: mx.array([i - 7], dtype=mx.int32) + 7)  # an Add on this thread's default stream
    assert len(lazy) == 6 and all(np.array_equal(a, b) for a, b in zip(lazy, settled))
    assert chat._tts_worker.pending == 0


def test_the_tts_worker_is_handed_arrays_of_its_own(chat):
    """MLX updates an array's status and event, unlocked, whenever a graph reads it: an id the caller
    reads again (its next LLM step) must not be the array the worker reads (a shared one can give
    one seed two answers). `put()` hands over a view of its own, scheduled."""
    worker = TTSThread(chat.ear_tts, chat._tts_stream, chat.speaking.codec_silence_tokens, sync_every=4,
                       worker=chat._worker_thread())
    text_id = mx.array([5], dtype=mx.int32) + 2
    worker.put(text_id)
    handed = worker._ids.get_nowait()
    assert handed is not text_id
    assert handed.item() == 7 and text_id.item() == 7


def test_every_array_the_loaded_model_holds_is_evaluated(chat):
    """Derived private arrays too (norm scales, RoPE frequencies): a compiled step closing over a
    lazy array computes it again at every call, and the TTS worker thread could not evaluate one
    made on this thread's default stream (MLX raises "There is no Stream(...) in current thread")."""
    arrays = [(k, a) for k, a in tree_flatten(chat.model) if isinstance(a, mx.array)]
    failed = []

    def evaluate_each():
        for k, a in arrays:
            try:
                mx.eval(a)
            except RuntimeError:
                failed.append(k)

    other = threading.Thread(target=evaluate_each)
    other.start()
    other.join()
    assert len(arrays) > 400 and failed == []
