"""vc-serve on Ray Serve: a local Ray cluster, Serve's own HTTP proxy, two CPU replicas of the tiny
checkpoint, real WebSocket clients.

Each replica holds three sessions at most, so six sessions at once fill both. A conversation gives
what `generate` gives; a replica killed mid-session ends its own three sessions with an `error`
event and close code 1011, the other three finish as if nothing happened, and a new session after
that is served."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from serving import Conversation, assert_same, converse, expect, free_port, get_json, pcm16_b64  # noqa: E402
from serving import chat, pcm, ws_url  # noqa: E402, F401 (fixtures)

SESSIONS_PER_REPLICA = 3
APP = "voicechat"


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_checkpoint):
    """The base URL of Serve's proxy with the app deployed: two replicas of three sessions each."""
    from voicechat.serve.ray_app import app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app({"model": str(tiny_checkpoint), "replicas": 2, "sessions_per_replica": SESSIONS_PER_REPLICA,
                   "gpus_per_replica": 0, "admission_timeout_s": 60}), name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def _replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP}#VoiceChatModel#"))


class PacedClient(threading.Thread):
    """One session: connects, sends its audio at wall-clock pace, commits once `may_commit` is set,
    and records every event and the close code."""

    def __init__(self, url: str, pcm: np.ndarray, seed: int, started: threading.Barrier,
                 may_commit: threading.Event):
        super().__init__(daemon=True)
        self.url, self.pcm, self.seed, self.started, self.may_commit = url, pcm, seed, started, may_commit
        self.events: list[dict] = []
        self.close_code: int | None = None
        self.answering = threading.Event()  # the first audio of the answer came back
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with connect(self.url, max_size=16 << 20, open_timeout=60) as ws:
                ws.send(json.dumps({"type": "session.update", "session": {
                    "seed": self.seed, "extra_decoding_seconds": 0.4,
                    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                              "output": {"format": {"type": "audio/pcm", "rate": 22050}}}}}))
                while self._next(ws)["type"] != "session.updated":
                    pass
                self.started.wait(timeout=120)
                sender = threading.Thread(target=self._send, args=(ws,), daemon=True)
                sender.start()
                try:
                    while (event := self._next(ws))["type"] not in ("response.done", "error"):
                        if event["type"] == "response.output_audio.delta":
                            self.answering.set()
                    if event["type"] == "error":  # the server closes next
                        ws.recv(timeout=30)
                except ConnectionClosed as e:
                    self.close_code = e.rcvd.code if e.rcvd else None
                sender.join(timeout=30)
        except BaseException as e:  # reported by the test
            self.failure = e

    def _next(self, ws) -> dict:
        event = json.loads(ws.recv(timeout=120))
        self.events.append(event)
        return event

    def _send(self, ws) -> None:
        step = int(0.08 * 16000)
        try:
            for i in range(0, len(self.pcm), step):
                ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(self.pcm[i : i + step])}))
                time.sleep(0.08)
            self.may_commit.wait(timeout=120)
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        except ConnectionClosed:
            pass

    def conversation(self) -> Conversation:
        return Conversation(events=self.events)


def _sessions(ws_url, pcm, seeds, may_commit: threading.Event) -> list[PacedClient]:
    started = threading.Barrier(len(seeds))
    clients = [PacedClient(ws_url, pcm, seed, started, may_commit) for seed in seeds]
    for c in clients:
        c.start()
    return clients


def test_health_models_and_page(server):
    health = get_json(server + "/health")
    assert health["status"] == "ok" and health["sessions"] == 0 and health["max_sessions"] == 2 * SESSIONS_PER_REPLICA
    assert get_json(server + "/v1/models")["data"][0]["object"] == "model"
    import urllib.request

    with urllib.request.urlopen(server + "/", timeout=10) as r:
        assert b"<html" in r.read().lower()
    assert len(_replica_actors()) == 2


def test_six_sessions_on_two_replicas_each_equal_generate(ws_url, chat, pcm):
    """Six at once: each was admitted (`session.created` comes once a replica has taken it), so
    both replicas hold three."""
    seeds = list(range(10, 16))
    may_commit = threading.Event()
    may_commit.set()
    clients = _sessions(ws_url, pcm, seeds, may_commit)
    for c in clients:
        c.join(timeout=300)
    for c, seed in zip(clients, seeds):
        assert c.failure is None, c.failure
        assert c.events[-1]["type"] == "response.done", c.events[-1]
        assert_same(c.conversation(), expect(chat, pcm, seed=seed))


def test_a_killed_replica_ends_only_its_own_sessions(ws_url, chat, pcm):
    seeds = list(range(20, 26))
    may_commit = threading.Event()  # no session ends before the kill
    clients = _sessions(ws_url, pcm, seeds, may_commit)
    for c in clients:
        assert c.answering.wait(timeout=120), c.failure
    victim = _replica_actors()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"))
    may_commit.set()
    for c in clients:
        c.join(timeout=300)
        assert c.failure is None, c.failure

    lost = [c for c in clients if c.events[-1]["type"] == "error"]
    done = [c for c in clients if c.events[-1]["type"] == "response.done"]
    assert len(lost) == SESSIONS_PER_REPLICA and len(done) == 6 - SESSIONS_PER_REPLICA
    for c in lost:
        error = c.events[-1]["error"]
        assert error["code"] == "session_lost" and "replica" in error["message"], error
        assert c.close_code == 1011
    for c in done:
        assert_same(c.conversation(), expect(chat, pcm, seed=c.seed))

    # A new session goes to a live replica.
    got = converse(ws_url, pcm, seed=7, extra=0.4)
    assert_same(got, expect(chat, pcm, seed=7))


@pytest.mark.parametrize("flags", [["--replicas", "2", "--min-replicas", "1"], ["--replicas", "0"],
                                   ["--min-replicas", "3", "--max-replicas", "2"]])
def test_vc_serve_ray_misuse_is_one_error_line(flags, tiny_checkpoint, capsys):
    from voicechat.serve.cli import main

    assert main(["--ray", "-m", str(tiny_checkpoint), "--port", str(free_port()), *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: give --replicas"), err
