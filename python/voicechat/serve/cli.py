"""vc-serve: the model behind an OpenAI-Realtime-compatible WebSocket, with a browser page.

    vc-serve -m mlx-community/NemotronLabs-VoiceChat-11B-4bit          # http://127.0.0.1:8000
    vc-serve --demo --port 8001                                         # a tiny random-weight model
    vc-serve --ray --replicas 4 -m ...                                  # on Ray Serve: a model per GPU
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import tempfile

from ..cli import DEFAULT_MODEL


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vc-serve", description="Serve VoiceChat over the OpenAI Realtime protocol "
                                "(WebSocket /v1/realtime) with a browser page at /.")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"checkpoint directory or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--demo", action="store_true", help="serve a freshly made tiny synthetic checkpoint (random weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("VOICECHAT_API_KEY"),
                   help="require this key (Bearer header or the openai-insecure-api-key.<key> subprotocol; "
                        "default: $VOICECHAT_API_KEY, else none)")
    p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="browser origins allowed besides the server's own ('*': any)")
    p.add_argument("--max-sessions", type=_sessions, default="auto", metavar="N|auto",
                   help="concurrent sessions (default: auto, as many as a live session measured here at start "
                        "shows to stay in real time; with --ray: 8)")
    p.add_argument("--idle-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="close a session after this long without a client event (default: 120)")
    p.add_argument("--max-ahead-seconds", type=float, default=30.0, metavar="SECONDS",
                   help="refuse audio sent further than this ahead of real time (default: 30)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="past this much memory in use the largest conversation ends and no new one starts "
                        "(default: 90%% of the GPU's memory, or of the machine's RAM on a CPU)")
    p.add_argument("--model-name", default=None, help="the name /v1/models reports (default: the model's)")
    ray = p.add_argument_group("Ray Serve (the ray extra; docs/deploy.md)")
    ray.add_argument("--ray", action="store_true", help="serve on Ray Serve: a replica of the model per GPU, "
                     "--max-sessions each; joins $RAY_ADDRESS's cluster, else starts one here")
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS", help="the Ray cluster to join (implies --ray)")
    ray.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default: 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale on active sessions from this many")
    ray.add_argument("--max-replicas", type=int, default=None, help="... up to this many")
    ray.add_argument("--target-sessions", type=int, default=None,
                     help="autoscaling's aim of active sessions per replica (default: 3/4 of --max-sessions)")
    return p


def _sessions(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def _check_port(host: str, port: int) -> None:
    """Fails before the model loads if the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise OSError(f"cannot listen on {host}:{port}: {why}") from None


def _serve_on_ray(args: argparse.Namespace, model: str, settings) -> int:
    try:
        from .ray_app import RayOptions, serve_forever
    except ImportError as e:
        print(f"error: vc-serve --ray needs the ray extra: pip install 'voicechat[ray]' ({e.name} is missing)",
              file=sys.stderr)
        return 2
    counts = (args.replicas, args.min_replicas, args.max_replicas, args.target_sessions)
    if any(n is not None and not 1 <= n <= 4096 for n in counts) or (
            args.replicas is not None and (args.min_replicas or args.max_replicas)) or \
            (args.min_replicas or 1) > (args.max_replicas or args.min_replicas or 1):
        print("error: give --replicas, or --min-replicas/--max-replicas, each 1..4096", file=sys.stderr)
        return 2
    if os.path.exists(model):  # a replica's working directory is not this one
        model = os.path.abspath(model)
    options = RayOptions(replicas=args.replicas or 1, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         sessions_per_replica=args.max_sessions, target_sessions=args.target_sessions,
                         gpus_per_replica=None, memory_limit_gb=args.memory_limit)
    settings.max_sessions = options.max_sessions()
    serve_forever(model, settings, options, args.host, args.port, args.ray_address,
                  say=lambda line: print(line, file=sys.stderr))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import uvicorn
        import websockets  # noqa: F401
    except ImportError as e:
        print(f"error: vc-serve needs the serve extra: pip install 'voicechat[serve]' ({e.name} is missing)",
              file=sys.stderr)
        return 2
    from .app import ServerSettings, create_app
    from .connection import Limits

    if args.max_sessions == "auto" and (args.ray or args.ray_address):
        args.max_sessions = 8  # (each replica's limit is set before the replicas load a model)
    if args.max_sessions != "auto" and not 1 <= args.max_sessions <= 1024 or not 0 < args.port < 65536 \
            or not args.idle_timeout > 0 or not args.max_ahead_seconds > 0 \
            or args.memory_limit is not None and not 0 < args.memory_limit < 1e6:
        print("error: --max-sessions must be 1..1024, --port 1..65535, and the timeouts and --memory-limit positive",
              file=sys.stderr)
        return 2

    def say(message: str) -> None:
        print(f"vc-serve: {message}", file=sys.stderr, flush=True)

    try:
        _check_port(args.host, args.port)
        with tempfile.TemporaryDirectory(prefix="vc-serve-") as tmp:
            if args.demo:
                from ..synthetic import make_checkpoint

                say("making a tiny synthetic checkpoint (random weights)")
                model = make_checkpoint(os.path.join(tmp, "ckpt"), size="tiny")
            else:
                model = args.model
            name = args.model_name or ("voicechat-demo" if args.demo else os.path.basename(str(model).rstrip("/")))
            settings = ServerSettings(model_name=name, api_key=args.api_key or None,
                                      allowed_origins=list(args.allowed_origins),
                                      max_sessions=8 if args.max_sessions == "auto" else args.max_sessions,
                                      limits=Limits(max_ahead_seconds=args.max_ahead_seconds,
                                                    idle_timeout_seconds=args.idle_timeout))
            if args.ray or args.ray_address:  # (each replica takes its own memory limit, from its device)
                return _serve_on_ray(args, str(model), settings)
            from ..precompile import compile_ahead
            from ..session import load
            from .capacity import memory_limit
            from .scheduler import FrameScheduler

            settings.memory_limit = memory_limit(args.memory_limit)
            say(f"loading {model}")
            chat = load(model)
            # (without precompile's live session: the warm-up rounds below step the live path)
            compile_ahead(chat, say, live=False)
            # The warm-up and capacity rounds run on the scheduler's thread, where the sessions step.
            scheduler = FrameScheduler(chat, max_sessions=settings.max_sessions, memory_limit=settings.memory_limit)
            try:
                if args.max_sessions == "auto":
                    from .capacity import MEASURED_FRAMES, WARMUP_FRAMES, measure

                    say(f"measuring live rounds here (one session, then two: {WARMUP_FRAMES + MEASURED_FRAMES} frames "
                        f"of silence each)")
                    capacity = scheduler.call(lambda engine: measure(engine, say))
                    settings.max_sessions = scheduler.engine.max_sessions = capacity.sessions
                    settings.live_frame_ms = capacity.frame_ms_p95
                    settings.session_ms = capacity.session_ms
                    settings.round_ms = capacity.round_ms_p95
                    say(f"a live frame takes {capacity.frame_ms_p95:.1f} ms here (p95), each further session "
                        f"{capacity.session_ms:.1f} ms; {capacity.sessions} begun together: a round "
                        f"{capacity.round_ms_p95:.1f} ms (p95): --max-sessions {capacity.sessions}")
                else:  # the first client gets a warm live path all the same (kernels built and loaded)
                    from .capacity import MEASURED_FRAMES, WARMUP_FRAMES, round_ms

                    say(f"warming up the live path ({WARMUP_FRAMES + MEASURED_FRAMES} frames of silence)")
                    settings.live_frame_ms = scheduler.call(lambda engine: round_ms(engine, 1))
                    say(f"a live frame takes {settings.live_frame_ms:.1f} ms here (p95)")
                if settings.max_sessions > 1:  # (past the largest listed bucket a round is far from real time)
                    from ..engine import SLOT_BUCKETS

                    batches = min(settings.max_sessions, SLOT_BUCKETS[-1])
                    say(f"tracing the batched speech encoder and LLM step for up to {batches} sessions")
                    scheduler.call(lambda engine: engine.warm_batches(batches))
            except BaseException:  # (an interrupt or a failed warm-up: the thread ends before the process)
                scheduler.stop()
                raise
            app = create_app(chat, settings, scheduler=scheduler)
            say(f"http://{args.host}:{args.port}/  (WebSocket /v1/realtime)")
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning", ws_max_size=16 << 20,
                        ws_ping_interval=20, ws_ping_timeout=20)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
