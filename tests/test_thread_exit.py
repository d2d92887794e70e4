"""A process that ran generate on threads other than the main one exits cleanly, with no user code
for it: MLX's per-thread compile cache is freed while the interpreter still runs (tts_thread.py,
`release_mlx_state_at_thread_exit`). Each case is a fresh interpreter whose exit code is checked:
the abort (rc 134, `terminate called without an active exception`) happens only at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPTS = {
    "one worker thread": """
        t = threading.Thread(target=generate)
        t.start()
        t.join()
    """,
    "a ThreadPoolExecutor": """
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda _: generate(), range(2)))
    """,
    "4 threads sharing a model": """
        threads = [threading.Thread(target=generate) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    """,
    "the TTS worker thread, from a worker thread": """
        chat.tts_thread = True
        t = threading.Thread(target=generate)
        t.start()
        t.join()
        assert chat._tts_worker is not None and chat._tts_worker.is_alive()  # left for the exit to end
    """,
    "an Engine's session, on a worker thread": """
        from voicechat.engine import Engine

        def engine_session():
            with Engine(chat, max_sessions=2) as engine:
                live = engine.live()
                results.append(len(live.push(soundfile.read(sys.argv[2], dtype="float32")[0])))
        t = threading.Thread(target=engine_session)
        t.start()
        t.join()
    """,
    "a live session opened here, fed from a worker thread": """
        live = chat.live()

        def feed():
            results.append(len(live.push(soundfile.read(sys.argv[2], dtype="float32")[0]) + live.finish(0.2)))
        t = threading.Thread(target=feed)
        t.start()
        t.join()
        live.close()
    """,
    "vc-serve's scheduler thread": """
        import time
        from voicechat.serve.scheduler import FrameScheduler

        frames = []
        scheduler = FrameScheduler(chat, max_sessions=2)
        handle = scheduler.open(None, 0, lambda got, done: frames.extend(got), lambda exc, fatal: None)
        handle.push(soundfile.read(sys.argv[2], dtype="int16")[0], 16000)
        deadline = time.monotonic() + 120
        while not frames and time.monotonic() < deadline:
            time.sleep(0.05)
        scheduler.stop()
        results.append(len(frames))
    """,
}

PRELUDE = """
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import soundfile

import voicechat

chat = voicechat.load(sys.argv[1])
results = []


def generate():
    results.append(chat.generate(sys.argv[2], extra_decoding_seconds=0.5).frames)
"""


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_the_process_exits_cleanly_after_generate_on_other_threads(case, tiny_checkpoint, spoken_wav):
    script = PRELUDE + textwrap.dedent(SCRIPTS[case]) + "\nassert results and min(results) > 0\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_checkpoint), str(spoken_wav)],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout == "ok\n"
    assert "terminate called" not in proc.stderr


def test_a_thread_keeps_its_compiled_steps_between_generates(tiny_checkpoint, spoken_wav):
    """The release happens when the thread ends, not after each generate: a second generate on
    the same thread, and plain MLX work there afterwards, still run."""
    script = PRELUDE + textwrap.dedent("""
        import mlx.core as mx

        def twice():
            generate()
            generate()
            mx.eval(mx.ones((3,)) + 1)  # the thread's default stream is still there

        t = threading.Thread(target=twice)
        t.start()
        t.join()
        assert len(results) == 2 and results[0] == results[1]
        print('ok')
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_checkpoint), str(spoken_wav)],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0 and proc.stdout == "ok\n", f"rc {proc.returncode}: {proc.stderr[-2000:]}"
