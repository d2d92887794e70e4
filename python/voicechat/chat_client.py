"""vc-chat: talk to VoiceChat from a terminal, through a `vc-serve` URL or a model loaded here.

    vc-chat ws://127.0.0.1:8000/v1/realtime            # microphone in, speaker out; Ctrl-C ends the turn
    vc-chat -m ./checkpoint                             # the same, with the model in this process
    vc-chat URL --audio-file question.wav --output-audio answer.wav --no-playback
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys
import threading
import time

import numpy as np

INPUT_RATE = 16000
OUTPUT_RATE = 22050
CHUNK_SECONDS = 0.08


class Printer:
    """The user's transcript and the assistant's text as they arrive, each on a line of its own."""

    def __init__(self, out=sys.stdout):
        self.out, self.channel = out, None

    def write(self, channel: str, text: str) -> None:
        if not text:
            return
        if channel != self.channel:
            if self.channel is not None:
                self.out.write("\n")
            self.out.write({"user": "[user] ", "function": "[function] ", "assistant": ""}[channel])
            self.channel = channel
        self.out.write(text)
        self.out.flush()

    def end(self) -> None:
        if self.channel is not None:
            self.out.write("\n")
            self.out.flush()
        self.channel = None


class Player:
    """Plays float32 samples at OUTPUT_RATE as they come (sounddevice), or does nothing."""

    def __init__(self, enabled: bool, device=None):
        self.stream = None
        if enabled:
            import sounddevice as sd

            self.stream = sd.OutputStream(samplerate=OUTPUT_RATE, channels=1, dtype="float32", device=device)
            self.stream.start()

    def play(self, samples: np.ndarray) -> None:
        if self.stream is not None and len(samples):
            self.stream.write(samples.astype(np.float32).reshape(-1, 1))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.stop()
            self.stream.close()


def file_chunks(path: str, realtime: bool):
    """16 kHz float chunks of 80 ms from an audio file (any format soundfile reads), paced at
    wall-clock speed when `realtime` (from the first chunk taken). The file is read and checked
    here, before any chunk is asked for."""
    from .audio import load_audio

    return _chunks(load_audio(path, INPUT_RATE), realtime)


def _chunks(wave: np.ndarray, realtime: bool):
    step = int(CHUNK_SECONDS * INPUT_RATE)
    start = time.monotonic()
    for i in range(0, len(wave), step):
        if realtime:
            time.sleep(max(0.0, start + i / INPUT_RATE - time.monotonic()))
        yield wave[i : i + step]


def microphone_chunks(device, stop: threading.Event):
    """16 kHz float chunks of 80 ms from the microphone until `stop` is set. The microphone opens,
    and the user is told to speak, at the first chunk asked for (once the model or the server is
    ready)."""
    import sounddevice as sd

    chunks: queue.Queue = queue.Queue()
    with sd.InputStream(samplerate=INPUT_RATE, channels=1, dtype="float32", device=device,
                        blocksize=int(CHUNK_SECONDS * INPUT_RATE),
                        callback=lambda data, frames, t, status: chunks.put(data[:, 0].copy())):
        print("listening: speak, then Ctrl-C to end your turn", file=sys.stderr)
        try:
            while not stop.is_set():
                try:
                    yield chunks.get(timeout=0.1)
                except queue.Empty:
                    continue
        except KeyboardInterrupt:  # the end of the user's turn, not of the program
            return


def _pcm16(samples: np.ndarray) -> str:
    from .serve.protocol import encode_pcm16

    return encode_pcm16(samples)


def run_remote(url: str, args, chunks, printer: Printer, player: Player) -> np.ndarray:
    """Streams `chunks` to a vc-serve URL; returns the answer's samples."""
    from websockets.sync.client import connect

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    audio: list[np.ndarray] = []
    done = threading.Event()
    failure: list[str] = []
    with connect(url, additional_headers=headers, max_size=16 << 20) as ws:
        session = {"type": "realtime", "instructions": args.system_prompt or "", "seed": args.seed,
                   "audio": {"input": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}},
                             "output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}}}}
        if args.extra_decoding_seconds is not None:
            session["extra_decoding_seconds"] = args.extra_decoding_seconds
        ws.send(json.dumps({"type": "session.update", "session": session}))

        def receive() -> None:
            for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind == "conversation.item.input_audio_transcription.delta":
                    printer.write("user", event["delta"])
                elif kind == "response.output_audio_transcript.delta":
                    printer.write("assistant", event["delta"])
                elif kind == "response.function_call_arguments.delta":
                    printer.write("function", event["delta"])
                elif kind == "response.output_audio.delta":
                    pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2").astype(np.float32) / 32767.0
                    audio.append(pcm)
                    player.play(pcm)
                elif kind == "error":
                    failure.append(event["error"]["message"])
                    if event["error"].get("type") == "server_error":
                        break
                elif kind == "response.done" and event["response"]["status"] == "completed":
                    break
            done.set()

        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        try:
            for chunk in chunks:
                ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _pcm16(chunk)}))
        finally:
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while not done.wait(0.2):
                pass
    if failure:
        raise RuntimeError(failure[0])
    return np.concatenate(audio) if audio else np.zeros(0, np.float32)


def load_local(model: str):
    """The model loaded in this process, its live path warmed (on a first run, every kernel compiled
    ahead, `precompile.compile_ahead`; else a session of silence): the first frames of the
    conversation then meet no kernel build, and no input is read before it is ready."""
    from .precompile import compile_ahead, warm_live
    from .session import load

    def say(message: str) -> None:
        print(f"vc-chat: {message}", file=sys.stderr, flush=True)

    say(f"loading {model}")
    chat = load(model)
    try:
        if not compile_ahead(chat, say):
            say("warming up the live path")
            warm_live(chat)
    except BaseException:
        chat.close()
        raise
    return chat


def run_local(chat, args, chunks, printer: Printer, player: Player) -> np.ndarray:
    """Streams `chunks` through a live session of `chat` (`load_local`)."""
    from .config import EXTRA_DECODING_SECONDS

    audio: list[np.ndarray] = []

    def show(frames) -> None:
        for frame in frames:
            printer.write("user", frame.transcript)
            printer.write("assistant", frame.text)
            printer.write("function", frame.function_text)
            audio.append(frame.audio)
            player.play(frame.audio)

    with chat.live(system_prompt=args.system_prompt or None, seed=args.seed) as live:
        for chunk in chunks:
            show(live.push(chunk, sample_rate=INPUT_RATE))
        extra = EXTRA_DECODING_SECONDS if args.extra_decoding_seconds is None else args.extra_decoding_seconds
        show(live.finish(extra_decoding_seconds=extra))
    return np.concatenate(audio) if audio else np.zeros(0, np.float32)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vc-chat", description="Talk to VoiceChat: microphone in, speaker out.")
    p.add_argument("url", nargs="?", help="a vc-serve WebSocket URL (ws://host:port/v1/realtime)")
    p.add_argument("-m", "--model", help="load this checkpoint here instead of connecting to a server")
    p.add_argument("--audio-file", help="stream this file instead of the microphone")
    p.add_argument("--fast", action="store_true", help="with --audio-file: send it as fast as it is taken")
    p.add_argument("--output-audio", help="also write the answer to this WAV (22.05 kHz PCM16)")
    p.add_argument("--no-playback", action="store_true", help="do not play the answer")
    p.add_argument("-p", "--system-prompt", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-decoding-seconds", type=float, default=None, metavar="SECONDS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    p.add_argument("--input-device", default=None, help="microphone (index or name)")
    p.add_argument("--output-device", default=None, help="speaker (index or name)")
    return p


def _device(value):
    return int(value) if value is not None and value.isdigit() else value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list_devices:
        try:
            import sounddevice as sd
        except (ImportError, OSError) as e:
            print(f"error: audio devices need sounddevice and PortAudio ({e})", file=sys.stderr)
            return 1
        print(sd.query_devices())
        return 0
    if bool(args.url) == bool(args.model):
        print("error: give a vc-serve URL or -m MODEL (one of them)", file=sys.stderr)
        return 2
    stop = threading.Event()
    printer = Printer()
    chat = None
    try:
        player = Player(not args.no_playback, _device(args.output_device))
        try:
            if args.output_audio:  # what can be known of the output before any work
                from .files import check_output, same_file

                check_output(args.output_audio)
                if args.audio_file and same_file(args.output_audio, args.audio_file):
                    raise ValueError(f"--output-audio {args.output_audio} is the --audio-file; "
                                     "give it a file of its own")
            if args.audio_file:  # a bad file is refused before the model loads
                chunks = file_chunks(args.audio_file, realtime=not args.fast)
            if args.model:
                chat = load_local(args.model)
            if not args.audio_file:
                chunks = microphone_chunks(_device(args.input_device), stop)
            if chat is None:
                audio = run_remote(args.url, args, chunks, printer, player)
            else:
                audio = run_local(chat, args, chunks, printer, player)
        finally:
            printer.end()
            player.close()
            if chat is not None:
                chat.close()
        if args.output_audio:
            from .audio import write_wav

            write_wav(args.output_audio, audio, OUTPUT_RATE)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
