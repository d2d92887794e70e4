"""vc-serve: a real uvicorn server on a free port, real WebSocket clients, the tiny checkpoint.

A conversation through the server gives what `generate` gives on the same audio, seed and prompt;
every server event validates against the typed models of the `openai` package; bad clients get an
`error` event and never hurt another session."""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
websockets = pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402

from serving import assert_same, converse, expect, get_json, pcm16_b64, vc_serve  # noqa: E402
from serving import chat, pcm, ws_url  # noqa: E402, F401 (fixtures)
from voicechat.serve.protocol import to_pcm16  # noqa: E402

PROMPT = "Be concise."


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with vc_serve(tiny_checkpoint, "--max-sessions", "9", "--idle-timeout", "3", "--max-ahead-seconds", "20") as base:
        yield base


def test_health_and_models(server):
    health = get_json(server + "/health")
    assert health["status"] == "ok" and health["sessions"] == 0 and health["max_sessions"] == 9
    # a given --max-sessions still warms the live path before serving, and says what a frame took
    assert health["live_frame_ms"] > 0 and health["session_ms"] is None
    # the default memory limit: 90% of the GPU's memory, or of the machine's RAM on a CPU
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        info = mx.device_info()
        total = int(info.get("total_memory") or info.get("memory_size"))
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert health["memory_limit_bytes"] == int(0.9 * total)
    models = get_json(server + "/v1/models")
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


def test_a_conversation_equals_generate(ws_url, chat, pcm):
    got = converse(ws_url, pcm, instructions=PROMPT, seed=3, extra=0.4)
    assert_same(got, expect(chat, pcm, seed=3, prompt=PROMPT))
    assert len(got.of("response.done")) == 1 and len(got.of("input_audio_buffer.committed")) == 1


def test_every_server_event_is_a_realtime_event(ws_url, pcm):
    """At the API's own rates (PCM16 at 24 kHz both ways) each event parses as openai's typed model."""
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    import soxr

    pcm24 = to_pcm16(soxr.resample(pcm.astype(np.float32) / 32768, 16000, 24000))
    got = converse(ws_url, pcm24, input_rate=24000, output_rate=24000, extra=0.2)
    adapter = TypeAdapter(RealtimeServerEvent)
    kinds = set()
    for event in got.events:
        parsed = adapter.validate_python(event)
        assert parsed.type == event["type"]
        kinds.add(event["type"])
    assert {"session.updated", "response.created", "response.output_audio.delta",
            "response.output_audio_transcript.delta", "response.done"} <= kinds
    # 24 kHz out: the answer's 22.05 kHz samples resampled, as long as they should be.
    frames = len(got.of("response.output_audio.delta")) - 1  # a delta a frame, then the resampler's tail
    assert abs(len(got.audio) - frames * 0.08 * 24000) <= 8


def test_session_created_is_a_realtime_event(ws_url):
    from openai.types.realtime import SessionCreatedEvent

    with connect(ws_url) as ws:
        SessionCreatedEvent.model_validate(json.loads(ws.recv(timeout=30)))


def _next(ws, kind: str) -> dict:
    """The next event of type `kind` (frames of an answer under way may come first)."""
    while True:
        event = json.loads(ws.recv(timeout=60))
        if event["type"] == kind:
            return event
        assert event["type"] != "error", event


def _errors_then_usable(ws, message, update: dict | None = None) -> dict:
    """Sends `message`; returns the error event; then checks the connection still answers."""
    ws.send(message)
    while (error := json.loads(ws.recv(timeout=60)))["type"] != "error":
        pass
    ws.send(json.dumps({"type": "session.update", "session": update or {"instructions": "x"}}))
    _next(ws, "session.updated")
    return error["error"]


@pytest.mark.parametrize("message, code", [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_json"),
    (json.dumps({"type": "conversation.item.create"}), "unknown_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "***"}), "invalid_base64"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}), "invalid_audio"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm",
                                                                                       "rate": 44100}}}}}),
     "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty"),
    ("x" * (2 << 20), "message_too_large"),
])
def test_a_bad_message_gets_an_error_event_and_the_connection_stays(ws_url, message, code):
    with connect(ws_url, max_size=16 << 20) as ws:
        json.loads(ws.recv(timeout=30))  # session.created
        assert _errors_then_usable(ws, message)["code"] == code


def test_a_fast_client_is_refused_past_the_limit_and_goes_on(ws_url, pcm):
    with connect(ws_url, max_size=16 << 20) as ws:
        json.loads(ws.recv(timeout=30))
        ws.send(json.dumps({"type": "session.update", "session": {
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
        json.loads(ws.recv(timeout=30))
        burst = np.zeros(int(16000 * 12.5), np.int16)  # twice at once: 25 s, past the server's 20 s ahead
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(burst)}))
        error = _errors_then_usable(ws, json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(burst)}),
                                    update={"seed": 0})
        assert error["code"] == "input_audio_buffer_overflow"


def test_an_idle_session_times_out(ws_url):
    with connect(ws_url) as ws:
        json.loads(ws.recv(timeout=30))
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["error"]["code"] == "session_idle_timeout"
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=30)


def test_concurrent_clients_each_get_what_they_get_alone(ws_url, chat, pcm):
    """Eight sessions interleaved on one model, of different lengths, prompts and seeds, each
    exactly its `generate` result."""
    cases = [(pcm[: len(pcm) - 1600 * i], f"prompt {i}" if i % 2 else "", i) for i in range(8)]
    results: dict[int, object] = {}

    def client(i, samples, prompt, seed):
        results[i] = converse(ws_url, samples, instructions=prompt, seed=seed, extra=0.24)

    threads = [threading.Thread(target=client, args=(i, *case)) for i, case in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(8))
    for i, (samples, prompt, seed) in enumerate(cases):
        assert_same(results[i], expect(chat, samples, seed=seed, prompt=prompt or None, extra=0.24))


def test_a_disconnect_mid_session_frees_its_state(server, ws_url, pcm):
    converse(ws_url, pcm, extra=0.2)  # warm: buffers the allocator keeps
    baseline = get_json(server + "/health")["active_memory_bytes"]
    for _ in range(3):
        with connect(ws_url, max_size=16 << 20) as ws:
            json.loads(ws.recv(timeout=30))
            ws.send(json.dumps({"type": "session.update", "session": {
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(pcm)}))
            while json.loads(ws.recv(timeout=60))["type"] != "response.output_audio.delta":
                pass  # the session is mid-answer when the client goes
    deadline = time.monotonic() + 60
    while (health := get_json(server + "/health"))["sessions"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health["sessions"] == 0
    time.sleep(1.0)  # the scheduler closes the dropped sessions after their queued piece
    assert get_json(server + "/health")["active_memory_bytes"] <= baseline * 1.05 + (1 << 20)


@pytest.fixture(scope="module")
def locked_server(tiny_checkpoint):
    # (a memory limit below the model's own size: no conversation can start there)
    with vc_serve(tiny_checkpoint, "--api-key", "sesame", "--max-sessions", "1",
                  "--allowed-origins", "https://app.example", "--memory-limit", "0.000001") as base:
        yield base.replace("http", "ws", 1) + "/v1/realtime"


def _opens(url, **kw) -> bool:
    try:
        with connect(url, open_timeout=30, **kw) as ws:
            return json.loads(ws.recv(timeout=30))["type"] == "session.created"
    except websockets.exceptions.InvalidStatus as e:
        assert e.response.status_code == 403
        return False


def test_the_api_key_as_a_bearer_header_or_a_subprotocol(locked_server):
    assert not _opens(locked_server)
    assert not _opens(locked_server, additional_headers={"Authorization": "Bearer wrong"})
    assert _opens(locked_server, additional_headers={"Authorization": "Bearer sesame"})
    assert _opens(locked_server, subprotocols=["realtime", "openai-insecure-api-key.sesame"])
    assert not _opens(locked_server, subprotocols=["realtime", "openai-insecure-api-key.sesam"])


def test_origins_are_checked(locked_server):
    key = {"Authorization": "Bearer sesame"}
    assert _opens(locked_server, additional_headers=key, origin="https://app.example")
    assert not _opens(locked_server, additional_headers=key, origin="https://evil.example")
    host = locked_server.split("/")[2]
    assert _opens(locked_server, additional_headers=key, origin=f"http://{host}")  # the server's own page


def test_past_max_sessions_a_client_gets_an_error_and_a_close_code(locked_server):
    key = {"Authorization": "Bearer sesame"}
    with connect(locked_server, additional_headers=key) as first:
        assert json.loads(first.recv(timeout=30))["type"] == "session.created"
        with connect(locked_server, additional_headers=key) as second:
            error = json.loads(second.recv(timeout=30))
            assert error["type"] == "error" and error["error"]["code"] == "session_limit_reached"
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                second.recv(timeout=30)
            assert closed.value.rcvd.code == 1013
        first.send(json.dumps({"type": "session.update", "session": {"instructions": "still here"}}))
        assert json.loads(first.recv(timeout=30))["type"] == "session.updated"


def test_past_the_memory_limit_no_conversation_starts_and_the_connection_stays(locked_server, pcm):
    key = {"Authorization": "Bearer sesame"}
    health = get_json(locked_server.replace("ws", "http", 1).rsplit("/v1/", 1)[0] + "/health")
    assert health["memory_limit_bytes"] == 1000
    with connect(locked_server, additional_headers=key) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        for _ in range(2):  # each new conversation is refused, once
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(pcm[:4000])}))
            error = json.loads(ws.recv(timeout=60))
            assert error["type"] == "error" and error["error"]["code"] == "session_memory_full"
            assert "memory is full" in error["error"]["message"] and "limit 0.0 MB" in error["error"]["message"]
            ws.send(json.dumps({"type": "session.update", "session": {"instructions": "still here"}}))
            assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"


def test_the_warm_up_rounds_run_on_the_schedulers_thread_and_leave_no_session(chat):
    """`FrameScheduler.call` runs a job on the thread that steps the sessions (what MLX keeps per
    thread is warm there): the capacity rounds open their sessions past the engine's limit, close
    them and give the limit back; a job's error reaches the caller and the scheduler goes on."""
    from voicechat.serve.capacity import round_ms
    from voicechat.serve.scheduler import FrameScheduler

    scheduler = FrameScheduler(chat, max_sessions=1)
    try:
        assert scheduler.call(lambda engine: threading.current_thread().name) == "voicechat-scheduler"
        assert scheduler.call(lambda engine: scheduler.call(lambda again: again is engine))  # (nested: runs there)
        assert scheduler.call(lambda engine: round_ms(engine, 2)) > 0
        assert scheduler.engine.open_sessions == 0 and scheduler.engine.max_sessions == 1
        with pytest.raises(ZeroDivisionError):
            scheduler.call(lambda engine: 1 / 0)
        assert scheduler.alive() and scheduler.call(lambda engine: engine.open_sessions) == 0
    finally:
        scheduler.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        scheduler.call(lambda engine: None)


def test_past_the_memory_limit_the_largest_conversation_ends_and_the_others_go_on(chat, pcm):
    import mlx.core as mx

    from voicechat.serve.scheduler import FrameScheduler, MemoryFull

    got = {"long": [], "short": []}
    errors = {"long": [], "short": []}
    finished = threading.Event()

    def frames_to(name):
        def on_frames(frames, done):
            got[name].extend(frames)
            if done:
                finished.set()
        return on_frames

    def errors_to(name):
        return lambda exc, fatal: errors[name].append((exc, fatal))

    scheduler = FrameScheduler(chat, max_sessions=4)
    try:
        long = scheduler.open(None, 0, frames_to("long"), errors_to("long"))
        long.push(np.tile(pcm, 16)[: 25 * 16000], 16000)  # 312 frames: its caches past their first 256 slots
        deadline = time.monotonic() + 120
        while len(got["long"]) < 312 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # (its last round over: nothing of it in flight)
        assert len(got["long"]) >= 312 and not errors["long"]
        # What a new conversation's caches add crosses the limit (a session's fixed buffers, its
        # caches' first slots, are most of what the long one holds too); the long one holds the
        # most, and the new one alone stays under it.
        scheduler.memory_limit = mx.get_active_memory() + sum(long.live.held_bytes().values()) // 2
        short = scheduler.open(None, 1, frames_to("short"), errors_to("short"))
        short.push(pcm, 16000)
        short.finish(0.4)
        assert finished.wait(120), errors
    finally:
        scheduler.stop()
    (exc, fatal), = errors["long"]
    assert isinstance(exc, MemoryFull) and fatal and exc.code == "session_memory_full"
    assert "the largest" in str(exc) and int(re.search(r"after (\d+) frames", str(exc))[1]) >= 312
    assert not errors["short"]
    result = expect(chat, pcm, seed=1)
    assert "".join(f.text for f in got["short"]) == result.text
    assert "".join(f.transcript for f in got["short"]) == result.user_transcript
    assert [f.text_id for f in got["short"]] == result.text_tokens
    np.testing.assert_allclose(np.concatenate([f.audio for f in got["short"]]), result.audio, atol=1e-5)


def test_vc_chat_streams_a_file_and_writes_the_answer(ws_url, chat, spoken_wav, tmp_path):
    """The terminal client through the server: the transcript and answer lines, and a WAV equal to
    generate's answer (each PCM16)."""
    import subprocess
    import sys

    from serving import child_env

    out = tmp_path / "answer.wav"
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "voicechat.chat_client", ws_url, "--audio-file", str(spoken_wav),
                           "--fast", "--no-playback", "--output-audio", str(out), "--seed", "5", "-p", PROMPT,
                           "--extra-decoding-seconds", "0.4"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = chat.generate(str(spoken_wav), system_prompt=PROMPT, seed=5, extra_decoding_seconds=0.4)
    heard = "".join(line[len("[user] "):] for line in proc.stdout.splitlines() if line.startswith("[user] "))
    assert heard == result.user_transcript
    got, rate = sf.read(out, dtype="int16")
    assert rate == 22050
    np.testing.assert_allclose(got, to_pcm16(result.audio), atol=1)


def test_max_sessions_by_default_is_what_live_rounds_measured_here_allow(tiny_checkpoint):
    from voicechat.serve.capacity import sessions_for

    with vc_serve(tiny_checkpoint) as base:
        health = get_json(base + "/health")
    frame_ms, session_ms, round_ms = health["live_frame_ms"], health["session_ms"], health["round_ms"]
    assert isinstance(frame_ms, float) and frame_ms > 0 and 0 < session_ms and round_ms > 0
    # the estimate from one and two sessions, checked with that many begun together
    sessions = health["max_sessions"]
    assert 1 <= sessions <= sessions_for(session_ms, frame_ms - session_ms)
    assert sessions == 1 or round_ms + 20 <= 80


@pytest.mark.parametrize("estimate,fixed_ms,cost,found,measured", [
    (5, 10.0, lambda n: 10 + 10 * n, (5, 60), [5]),  # the estimate fits (exactly 60 + 20)
    (5, 10.0, lambda n: 10 + 14 * n, (3, 52), [5, 3]),  # 14 ms a session, re-estimated: 50 // 14
    (6, 10.0, lambda n: 10 + 10 * n + (5 if n > 4 else 0), (4, 50), [6, 4]),  # 65 / 6 a session: 50 // 10.8
    (4, 0.0, lambda n: 100.0, (1, None), [4, 2]),  # nothing fits: one session, not measured
    (1, 0.0, lambda n: 100.0, (1, None), []),
    (3, 70.0, lambda n: 75.0, (1, None), [3]),  # the fixed cost alone leaves no room
])
def test_the_estimate_is_checked_and_lowered_until_its_measured_round_fits(estimate, fixed_ms, cost, found, measured):
    from voicechat.serve.capacity import verified_sessions

    asked = []

    def round_p95(n):
        asked.append(n)
        return float(cost(n))

    assert verified_sessions(estimate, fixed_ms, round_p95) == found
    assert asked == measured


@pytest.mark.parametrize("session_ms,fixed_ms,sessions", [(12.4, 0.0, 4), (30.0, 0.0, 2), (30.1, 0.0, 1),
                                                          (50.0, 0.0, 1), (200.0, 0.0, 1), (0.01, 0.0, 1024),
                                                          (5.0, 20.0, 8), (5.0, 60.0, 1), (0.0, 10.0, 1024)])
def test_sessions_whose_round_fits_an_80_ms_frame_with_20_ms_to_spare(session_ms, fixed_ms, sessions):
    from voicechat.serve.capacity import sessions_for

    assert sessions_for(session_ms, fixed_ms) == sessions


@pytest.mark.parametrize("times,rounds,past", [
    ([61.0] * 5, 100, False), ([61.0] * 6, 100, True), ([60.0] * 50, 100, False),  # more than 5%, longer than 60
    ([10.0] * 90 + [70.0] * 5, 100, False), ([70.0, 10.0, 70.0], 20, True), ([70.0], 20, False), ([], 20, False),
])
def test_a_check_stops_once_its_p95_is_past_the_budget_whatever_the_rest_take(times, rounds, past):
    from voicechat.serve.capacity import p95_past

    assert p95_past(times, rounds, 60.0) is past
    if past:  # whatever the other rounds take, their 95th percentile is past 60 ms
        assert np.percentile(times + [0.0] * (rounds - len(times)), 95) > 60.0


@pytest.mark.parametrize("flag,value", [("--max-sessions", v) for v in ("0", "1025", "many", "2.5")]
                         + [("--memory-limit", v) for v in ("0", "-1", "nan", "inf", "lots")])
def test_a_bad_limit_is_one_error_line(flag, value, capsys):
    from voicechat.serve.cli import main

    try:
        code = main(["--demo", flag, value])
    except SystemExit as e:  # (argparse's refusal of what is not a number)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and flag.lstrip("-") in err[-1] and "error" in err[-1]


def test_a_first_run_precompiles_with_progress_before_serving(tiny_checkpoint, tmp_path):
    """VOICECHAT_PRECOMPILE=1 (a first run's precompile on any device, as a CUDA GPU's by default):
    vc-serve says its precompile's progress, then warms the live path, traces the batched speech
    encoder for its sessions, then serves."""
    import subprocess
    import sys

    from serving import child_env, free_port

    env = dict(child_env(), VOICECHAT_PRECOMPILE="1", VOICECHAT_PRECOMPILE_PROCESSES="0",
               XDG_CACHE_HOME=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "voicechat.serve.cli", "-m", str(tiny_checkpoint),
                             "--port", str(free_port()), "--max-sessions", "3"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        for line in proc.stderr:  # until it says where it serves
            lines.append(line.rstrip("\n"))
            if line.startswith("vc-serve: http://"):
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert lines and lines[-1].startswith("vc-serve: http://"), lines
    steps = [line.split(":")[1].strip() for line in lines if line.startswith("vc-serve:")]
    compiled = steps.index("precompiled")
    assert steps[:compiled].count("compiling kernels for this model (first run only)") >= 1
    warmed = steps.index("warming up the live path (40 frames of silence)")
    assert warmed > compiled
    assert steps.index("tracing the batched speech encoder and LLM step for up to 3 sessions") > warmed


def test_a_round_waits_for_the_streaming_sessions_pieces_while_the_oldest_can_still_be_in_time(chat):
    """`FrameScheduler.gather_until` at given moments: a round waits for a piece of each session
    that is streaming (a piece in the last two frames, input not ended) until one frame after the
    oldest queued piece arrived, less the longest recent round; not for a session that stopped
    sending or ended its input, nor once that moment has passed."""
    from voicechat.serve.scheduler import FRAME_SECONDS, FrameScheduler, Work

    scheduler = FrameScheduler(chat, max_sessions=4)
    try:
        a = scheduler.open(None, 0, lambda *_: None, lambda *_: None)
        b = scheduler.open(None, 1, lambda *_: None, lambda *_: None)
        with scheduler.lock:  # (the scheduler's thread waits for work meanwhile)
            t = 1000.0
            a.last_push, b.last_push = t, t - 0.01  # both streaming; a's piece is queued, b's is not
            a.work.append(Work("push", np.zeros(1280, np.float32), 16000, arrived=t))
            scheduler._round_seconds.extend([0.02, 0.03])
            until = t + FRAME_SECONDS - 0.03
            assert scheduler.gather_until(t + 0.001) == pytest.approx(until)
            assert scheduler.gather_until(until + 0.001) is None  # a's frame would be late: go
            b.finishing = True  # b's input has ended: nothing more of it to wait for
            assert scheduler.gather_until(t + 0.001) is None
            b.finishing = False
            assert scheduler.gather_until(t + 2 * FRAME_SECONDS + 0.005) is None  # b stopped sending
            b.work.append(Work("push", np.zeros(1280, np.float32), 16000, arrived=t + 0.002))
            assert scheduler.gather_until(t + 0.003) is None  # every streaming session has its piece
            a.work.clear(), b.work.clear()
    finally:
        scheduler.stop()
