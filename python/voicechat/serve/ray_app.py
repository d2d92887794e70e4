"""vc-serve on Ray Serve: one loaded model per replica (a GPU each), vc-serve's app on an ingress.

    serve run voicechat.serve.ray_app:app model=mlx-community/NemotronLabs-VoiceChat-11B-4bit replicas=4
    vc-serve --ray --replicas 4 -m mlx-community/NemotronLabs-VoiceChat-11B-4bit

`ModelReplica` holds one model and the `FrameScheduler` that steps its sessions. A WebSocket is
one streaming call to it, `session`, open for the connection's life: Serve counts it as one
ongoing request, so `max_ongoing_requests` is the sessions a replica holds, Serve's router sends a
new connection only to a replica with a free slot (and keeps it there: a call stays where it
started), and autoscaling on `target_ongoing_requests` scales on active sessions.

A Serve call carries its arguments only when it starts, so the client's audio reaches the
replica through the ingress's `Mailbox` actor, which the replica reads from. The ingress runs
vc-serve's own app (`create_app`, `Connection`); only the model work crosses to the replica.
When a replica dies its calls fail at once: each of its connections gets an `error` event
(`session_lost`) and close code 1011, and Serve's router stops sending it new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray import serve

from ..engine import SLOT_BUCKETS
from ..session import InputError
from .capacity import memory_limit, round_ms
from .scheduler import FrameScheduler, NoCapacity, SessionLost

APP_NAME = "voicechat"
END = ("end",)


@ray.remote(num_cpus=0)
class Mailbox:
    """Per-session queues of the client's work, from the ingress to the replica. Items carry a
    sequence number: an async actor may start calls in another order than they were sent."""

    def __init__(self):
        self.boxes: dict[str, _Box] = {}

    def _box(self, key: str) -> "_Box":
        return self.boxes.setdefault(key, _Box())

    def put(self, key: str, seq: int, item: tuple) -> None:
        box = self._box(key)
        box.items[seq] = item
        box.ready.set()

    async def take(self, key: str) -> list[tuple]:
        """The next items in order, waiting for at least one."""
        box = self._box(key)
        while box.next not in box.items:
            if box.dropped:
                return [END]
            box.ready.clear()
            await box.ready.wait()
        out = []
        while box.next in box.items:
            out.append(box.items.pop(box.next))
            box.next += 1
        return out

    def drop(self, key: str) -> None:
        box = self.boxes.pop(key, None)
        if box is not None:
            box.dropped = True
            box.ready.set()


@dataclass
class _Box:
    items: dict[int, tuple] = field(default_factory=dict)
    next: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False


class ReplicaInputError(InputError):
    """An InputError raised on the replica, named as it was there (the `error` event's code)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class ReplicaError(RuntimeError):
    """Any other error of a session on the replica (a bug there)."""


class ModelReplica:
    """One loaded model and its scheduler; `session` serves one connection's conversations."""

    def __init__(self, model: str, max_sessions: int = 64, memory_limit_gb: float | None = None):
        from ..session import load

        self.chat = load(model)
        # by default a share of the device as Serve gave this replica (a fraction of a GPU, or all of it)
        share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0)
        self.scheduler = FrameScheduler(self.chat, max_sessions=max_sessions,
                                        memory_limit=memory_limit(memory_limit_gb, min(1.0, share or 1.0)))
        # a warm live path (kernels built and loaded, traced on the thread that steps the sessions)
        # before Serve routes a client here
        self.scheduler.call(lambda engine: (round_ms(engine, 1),
                                            engine.warm_batches(min(max_sessions, SLOT_BUCKETS[-1]))))

    def check_health(self) -> None:
        if not self.scheduler.alive():  # (Serve then replaces this replica)
            raise RuntimeError("the scheduler's thread has stopped")

    async def session(self, mailbox, key: str):
        """Yields ("ready",), then ("frames", conversation, frames, finished) and ("error",
        conversation, code, message, input_error, fatal) until the connection ends."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        handles = {}

        def on_frames(conversation):
            return lambda frames, finished: loop.call_soon_threadsafe(
                out.put_nowait, ("frames", conversation, frames, finished))

        def on_error(conversation):
            return lambda exc, fatal: loop.call_soon_threadsafe(out.put_nowait, (
                "error", conversation, type(exc).__name__, str(exc), isinstance(exc, InputError), fatal))

        async def follow_mailbox():
            try:
                while True:
                    for item in await mailbox.take.remote(key):
                        kind, conversation = item[0], item[1] if len(item) > 1 else None
                        if kind == "end":
                            return
                        if kind == "open":
                            handles[conversation] = self.scheduler.open(
                                item[2], item[3], on_frames(conversation), on_error(conversation))
                        elif kind == "close":
                            handles.pop(conversation).close()
                        else:
                            getattr(handles[conversation], kind)(*item[2:])  # push or finish
            finally:  # (the mailbox is gone with its ingress, or the connection ended)
                out.put_nowait(None)

        follower = asyncio.create_task(follow_mailbox())
        try:
            yield ("ready",)
            while (item := await out.get()) is not None:
                yield item
        finally:
            follower.cancel()
            for handle in handles.values():
                handle.close()


class _RemoteConversation:
    """A conversation on the replica, as `Connection` drives a `SessionHandle`."""

    def __init__(self, link: "ReplicaLink", conversation: int):
        self.link, self.conversation = link, conversation

    def push(self, samples, sample_rate: int) -> None:
        self.link.send("push", self.conversation, samples, sample_rate)

    def finish(self, seconds: float) -> None:
        self.link.send("finish", self.conversation, seconds)

    def close(self) -> None:
        self.link.callbacks.pop(self.conversation, None)
        self.link.send("close", self.conversation)


class ReplicaLink:
    """One connection's place on a model replica: its `session` call and its mailbox."""

    def __init__(self, model, mailbox, on_lost):
        self.model, self.mailbox, self.on_lost = model, mailbox, on_lost
        self.key = uuid.uuid4().hex
        self.seq = itertools.count()
        self.conversations = itertools.count()
        self.callbacks: dict[int, tuple] = {}
        self.stream = None
        self.reader: asyncio.Task | None = None
        self.closing = False

    async def start(self, admission_timeout_s: float) -> None:
        """Starts the session on a replica with a free slot, waiting for one at most
        `admission_timeout_s`; a replica that died before the router knew is passed over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + admission_timeout_s
        while True:
            self.stream = self.model.options(method_name="session", stream=True).remote(self.mailbox, self.key)
            try:
                await asyncio.wait_for(self.stream.__anext__(), max(0.0, deadline - loop.time()))
                break
            except asyncio.TimeoutError:
                self.stream.cancel()
                raise NoCapacity(f"no model replica had room for a session within {admission_timeout_s:g} s") \
                    from None
            except Exception:  # (the replica died between the router's choice and the call)
                if loop.time() >= deadline:
                    raise NoCapacity("no live model replica took the session") from None
                await asyncio.sleep(0.2)
        self.reader = asyncio.create_task(self._read())

    def send(self, *item) -> None:
        self.mailbox.put.remote(self.key, next(self.seq), item)

    def open(self, system_prompt: str | None, seed: int, on_frames, on_error) -> _RemoteConversation:
        conversation = next(self.conversations)
        self.callbacks[conversation] = (on_frames, on_error)
        self.send("open", conversation, system_prompt, seed)
        return _RemoteConversation(self, conversation)

    async def _read(self) -> None:
        why = "the model replica ended the session"
        try:
            async for item in self.stream:
                callbacks = self.callbacks.get(item[1])
                if callbacks is None:  # (a closed conversation's last frames)
                    continue
                if item[0] == "frames":
                    callbacks[0](item[2], item[3])
                else:
                    _, _, code, message, input_error, fatal = item
                    exc = ReplicaInputError(message, code) if input_error else ReplicaError(f"{code}: {message}")
                    callbacks[1](exc, fatal)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the replica died (RayActorError) or its call failed
            why = f"the model replica serving this session stopped ({type(e).__name__})"
        if not self.closing:
            self.on_lost(SessionLost(f"{why}; reconnect to start a new session"))

    async def close(self) -> None:
        self.closing = True
        self.send(*END)
        self.mailbox.drop.remote(self.key)
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        self.stream.cancel()


class ReplicaScheduler:
    """What `create_app` steps sessions with, on the ingress: each connection on a replica."""

    def __init__(self, model, admission_timeout_s: float):
        self.model = model
        self.mailbox = Mailbox.remote()  # owned by this ingress replica: it goes when the ingress goes
        self.admission_timeout_s = admission_timeout_s

    @contextlib.asynccontextmanager
    async def connect(self, on_lost):
        link = ReplicaLink(self.model, self.mailbox, on_lost)
        await link.start(self.admission_timeout_s)
        try:
            yield link
        finally:
            await link.close()

    def health(self) -> dict:
        return {}

    def stop(self) -> None:
        pass


@serve.ingress()
class Ingress:
    """vc-serve's app (`/`, `/health`, `/v1/models`, `/v1/realtime`) over the model replicas."""

    def __init__(self, model, settings, admission_timeout_s: float = 10.0):
        from .app import create_app

        self.asgi_app = create_app(None, settings, scheduler=ReplicaScheduler(model, admission_timeout_s))

    def __serve_build_asgi_app__(self):
        return self.asgi_app


@dataclass
class RayOptions:
    """How the model is spread: a fixed number of replicas, or autoscaling between min and max on
    `target_sessions` active sessions per replica."""

    replicas: int | None = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    sessions_per_replica: int = 8  # a replica's limit: Serve's max_ongoing_requests
    target_sessions: int | None = None  # autoscaling's target_ongoing_requests (default: 3/4 of the limit)
    gpus_per_replica: float | None = 1.0  # 0: on CPU cores (cpus_per_replica); None: 1 where the cluster has GPUs
    cpus_per_replica: float = 1.0
    ingress_replicas: int = 1  # processes that hold the clients' WebSockets (no GPU)
    admission_timeout_s: float = 10.0  # how long a new connection waits for a free slot
    drain_timeout_s: float = 600.0  # a replica scaled down serves its sessions this long at most
    memory_limit_gb: float | None = None  # a replica's (vc-serve's --memory-limit); None: 90% of its device share

    def autoscaling(self) -> dict | None:
        if self.min_replicas is None and self.max_replicas is None:
            return None
        target = self.target_sessions or max(1, self.sessions_per_replica * 3 // 4)
        return {"min_replicas": self.min_replicas or 1, "max_replicas": self.max_replicas or self.min_replicas,
                "target_ongoing_requests": target}

    def max_sessions(self) -> int:
        return self.sessions_per_replica * max(self.replicas or 0, self.max_replicas or 0, self.min_replicas or 0, 1)


def build_app(model: str, settings, options: RayOptions):
    """The Serve application: the ingress bound to the model replicas."""
    gpus = 1.0 if options.gpus_per_replica is None else options.gpus_per_replica
    resources = {"num_gpus": gpus} if gpus else {"num_cpus": options.cpus_per_replica}
    autoscaling = options.autoscaling()
    replica = serve.deployment(ModelReplica, name="VoiceChatModel").options(
        ray_actor_options=resources, max_ongoing_requests=options.sessions_per_replica,
        graceful_shutdown_timeout_s=options.drain_timeout_s, health_check_period_s=10,
        **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": options.replicas}))
    ingress = serve.deployment(Ingress, name="VoiceChatIngress").options(
        num_replicas=options.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(100, 2 * options.max_sessions()))
    return ingress.bind(replica.bind(model, options.sessions_per_replica, options.memory_limit_gb), settings,
                        options.admission_timeout_s)


def app(args: dict):
    """The application for `serve run voicechat.serve.ray_app:app model=PATH [name=value ...]` and
    Serve config files: `model`, `model_name`, `api_key`, `allowed_origins` (comma-separated),
    `idle_timeout`, `max_ahead_seconds` as vc-serve's options, and RayOptions' fields."""
    from .app import ServerSettings
    from .connection import Limits

    args = dict(args)
    if "model" not in args:
        raise ValueError("the model argument is required: model=PATH_OR_HUB_ID")
    model = str(args.pop("model"))
    origins = args.pop("allowed_origins", "")
    limits = Limits(**{field: float(args.pop(name)) for name, field in (
        ("idle_timeout", "idle_timeout_seconds"), ("max_ahead_seconds", "max_ahead_seconds")) if name in args})
    settings = ServerSettings(model_name=args.pop("model_name", None) or model.rstrip("/").rsplit("/", 1)[-1],
                              api_key=args.pop("api_key", None), limits=limits,
                              allowed_origins=[o for o in str(origins).split(",") if o])
    numbers = {name: type_(args.pop(name)) for name, type_ in (
        ("replicas", int), ("min_replicas", int), ("max_replicas", int), ("sessions_per_replica", int),
        ("target_sessions", int), ("ingress_replicas", int), ("gpus_per_replica", float), ("cpus_per_replica", float),
        ("memory_limit_gb", float), ("admission_timeout_s", float), ("drain_timeout_s", float)) if name in args}
    if args:
        raise ValueError(f"unknown arguments: {', '.join(sorted(args))}")
    options = RayOptions(**numbers)
    settings.max_sessions = options.max_sessions()
    return build_app(model, settings, options)


def serve_forever(model: str, settings, options: RayOptions, host: str, port: int, address: str | None,
                  say=print) -> None:
    """`vc-serve --ray`: joins the Ray cluster at `address` (None: the one RAY_ADDRESS names, else a
    new one on this machine), deploys the app behind Serve's proxy at host:port, and serves until
    interrupted; then the app is deleted (the cluster stays if it was not started here)."""
    ray.init(address=address, log_to_driver=False)
    try:
        if options.gpus_per_replica is None:  # one GPU a replica where the cluster has GPUs
            options.gpus_per_replica = 1.0 if ray.cluster_resources().get("GPU", 0) else 0.0
        where = f"{options.gpus_per_replica:g} GPU" if options.gpus_per_replica else \
            f"{options.cpus_per_replica:g} CPU"
        say(f"vc-serve: deploying on Ray ({where} a replica; {ray.cluster_resources().get('GPU', 0):g} GPUs, "
            f"{ray.cluster_resources().get('CPU', 0):g} CPUs in the cluster)")
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(model, settings, options), name=APP_NAME, route_prefix="/")
        say(f"vc-serve: http://{host}:{port}/  (WebSocket /v1/realtime)")
        try:
            while True:
                time.sleep(3600)
        finally:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
