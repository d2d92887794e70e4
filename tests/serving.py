"""Helpers for the server tests: a real `vc-serve` process on a free port, a Realtime client, and
the fixtures that compare a server's answers with `generate`'s (a test module imports `ws_url`,
`chat` and `pcm` and defines its own `server`)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    """This process's environment with its import path, so a child imports the same voicechat
    (the installed package, or the source tree under PYTHONPATH)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def vc_serve(checkpoint: Path, *flags: str, timeout: float = 120.0):
    """A `vc-serve` subprocess serving `checkpoint`; yields its base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "voicechat.serve.cli", "-m", str(checkpoint), "--port", str(port),
                             *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vc-serve exited {proc.returncode}: {proc.stdout.read()}")
            try:
                get_json(base + "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("vc-serve did not come up")
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pcm16_b64(pcm: np.ndarray) -> str:
    """int16 samples as the protocol's base64 PCM16 little-endian."""
    assert pcm.dtype == np.int16
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


@dataclass
class Conversation:
    """What a client collected from one conversation."""

    events: list[dict] = field(default_factory=list)

    def joined(self, kind: str) -> str:
        return "".join(e["delta"] for e in self.events if e["type"] == kind)

    @property
    def transcript(self) -> str:
        return self.joined("conversation.item.input_audio_transcription.delta")

    @property
    def text(self) -> str:
        return self.joined("response.output_audio_transcript.delta") + self.joined("response.output_text.delta")

    @property
    def function_text(self) -> str:
        return self.joined("response.function_call_arguments.delta")

    @property
    def audio(self) -> np.ndarray:
        parts = [np.frombuffer(base64.b64decode(e["delta"]), dtype="<i2") for e in self.events
                 if e["type"] == "response.output_audio.delta"]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def converse(ws_url: str, pcm: np.ndarray, *, instructions: str = "", seed: int = 0, input_rate: int = 16000,
             output_rate: int = 22050, extra: float | None = None, chunk_seconds: float = 0.08,
             headers: dict | None = None, timeout: float = 300.0) -> Conversation:
    """One conversation over a real WebSocket: session.update, `pcm` (int16 at `input_rate`) in
    chunks, commit, every event until response.done."""
    from websockets.sync.client import connect

    out = Conversation()
    session = {"type": "realtime", "instructions": instructions, "seed": seed,
               "audio": {"input": {"format": {"type": "audio/pcm", "rate": input_rate}},
                         "output": {"format": {"type": "audio/pcm", "rate": output_rate}}}}
    if extra is not None:
        session["extra_decoding_seconds"] = extra
    with connect(ws_url, additional_headers=headers, max_size=16 << 20, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.update", "session": session}))
        step = int(chunk_seconds * input_rate)
        for i in range(0, len(pcm), step):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(pcm[i : i + step])}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        deadline = time.monotonic() + timeout
        while True:
            event = json.loads(ws.recv(timeout=max(1.0, deadline - time.monotonic())))
            out.events.append(event)
            if event["type"] == "error":
                raise AssertionError(f"server error: {event['error']}")
            if event["type"] == "response.done" and event["response"]["status"] == "completed":
                return out


@pytest.fixture(scope="module")
def ws_url(server):
    """The Realtime endpoint of the module's `server` (its base URL)."""
    return server.replace("http", "ws", 1) + "/v1/realtime"


@pytest.fixture(scope="module")
def chat(tiny_checkpoint):
    """The tiny checkpoint loaded in this process: what the server's answers are compared with."""
    import voicechat

    with voicechat.load(tiny_checkpoint) as chat:
        yield chat


@pytest.fixture(scope="module")
def pcm(spoken_wav):
    """A spoken question, int16 at 16 kHz."""
    samples, rate = sf.read(spoken_wav, dtype="int16")
    assert rate == 16000
    return samples[: int(1.6 * rate)]  # a short question keeps the many-client tests quick


def expect(chat, pcm: np.ndarray, seed: int = 0, prompt: str | None = None, extra: float = 0.4):
    """What `generate` answers to `pcm` (16 kHz) with these options."""
    return chat.generate(pcm, system_prompt=prompt, seed=seed, sample_rate=16000, extra_decoding_seconds=extra)


def assert_same(got: Conversation, result) -> None:
    """A conversation through a server gave what `generate` gave."""
    from voicechat.serve.protocol import to_pcm16

    assert got.text == result.text
    assert got.function_text == result.function_text
    assert got.transcript == result.user_transcript
    np.testing.assert_array_equal(got.audio, to_pcm16(result.audio))
