"""The FastAPI app of `vc-serve`: health, models, the Realtime WebSocket and the browser page.

    app = create_app(voicechat.load(path), model_name="voicechat", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from importlib import resources
from urllib.parse import urlsplit

from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from .connection import Connection, Limits
from .protocol import error_event
from .scheduler import FrameScheduler, NoCapacity

API_KEY_SUBPROTOCOL = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"
CLOSE_POLICY = 1008  # authentication or origin refused
CLOSE_TRY_AGAIN = 1013  # the server holds --max-sessions already


@dataclass
class ServerSettings:
    model_name: str = "voicechat"
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # besides the server's own; "*" allows any
    max_sessions: int = 8
    limits: Limits = field(default_factory=Limits)
    live_frame_ms: float | None = None  # a live frame's p95, measured at start as the server warms up
    session_ms: float | None = None  # what each further session adds to a round (`--max-sessions auto`)
    round_ms: float | None = None  # the admitted sessions' round begun together, p95 (`--max-sessions auto`)
    memory_limit: int | None = None  # bytes in use past which the largest conversation ends (`--memory-limit`)


def _offered_subprotocols(ws: WebSocket) -> list[str]:
    header = ws.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def authorized(ws: WebSocket, api_key: str | None) -> bool:
    """The key as a Bearer header, or as the `openai-insecure-api-key.<key>` subprotocol (browsers
    cannot set headers on a WebSocket)."""
    if api_key is None:
        return True
    offered = []
    auth = ws.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        offered.append(auth[7:].strip())
    offered += [p[len(API_KEY_SUBPROTOCOL):] for p in _offered_subprotocols(ws) if p.startswith(API_KEY_SUBPROTOCOL)]
    return any(hmac.compare_digest(k.encode(), api_key.encode()) for k in offered)


def origin_allowed(ws: WebSocket, allowed: list[str]) -> bool:
    """Clients that send no Origin (not a browser) pass; a browser's page must come from this
    server or from an origin the operator allowed."""
    origin = ws.headers.get("origin")
    if origin is None or "*" in allowed:
        return True
    if origin.rstrip("/") in [a.rstrip("/") for a in allowed]:
        return True
    host = ws.headers.get("host", "")
    return bool(host) and urlsplit(origin).netloc == host


async def _refuse(ws: WebSocket, why: str) -> None:
    await ws.send_json(error_event(f"{why}; try again later", code="session_limit_reached", kind="server_error"))
    await ws.close(code=CLOSE_TRY_AGAIN, reason="too many sessions")


def create_app(chat, settings: ServerSettings | None = None, scheduler=None) -> FastAPI:
    """An app serving one loaded `VoiceChat` to many clients: their sessions share the model, and
    every session's frame of a round is stepped in one batch (`FrameScheduler`). Or, with `scheduler`
    and no `chat`, the same app in front of models elsewhere (`voicechat.serve.ray_app`)."""
    settings = settings or ServerSettings()
    scheduler = scheduler if scheduler is not None else FrameScheduler(chat, max_sessions=settings.max_sessions,
                                                                     memory_limit=settings.memory_limit)
    app = FastAPI(title="voicechat", docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.connections = 0
    started = time.time()
    static = resources.files("voicechat.serve") / "static"

    @app.on_event("shutdown")
    def _stop() -> None:
        scheduler.stop()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": settings.model_name, "sessions": app.state.connections,
                "max_sessions": settings.max_sessions, "live_frame_ms": settings.live_frame_ms,
                "session_ms": settings.session_ms, "round_ms": settings.round_ms,
                "memory_limit_bytes": settings.memory_limit,
                "uptime_s": round(time.time() - started, 1),
                **scheduler.health()}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": int(started),
                                            "owned_by": "voicechat"}]}

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(str(static / "index.html"))

    app.mount("/static", StaticFiles(directory=str(static)), name="static")

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        if not origin_allowed(ws, settings.allowed_origins) or not authorized(ws, settings.api_key):
            await ws.close(code=CLOSE_POLICY)  # before accept: the handshake is refused (HTTP 403)
            return
        offered = _offered_subprotocols(ws)
        await ws.accept(subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None)
        if app.state.connections >= settings.max_sessions:
            await _refuse(ws, f"the server holds its maximum of {settings.max_sessions} sessions")
            return
        app.state.connections += 1
        try:
            await Connection(ws, scheduler, settings.model_name, settings.limits).run()
        except NoCapacity as e:
            await _refuse(ws, str(e))
        finally:
            app.state.connections -= 1

    @app.exception_handler(404)
    async def _not_found(request, exc) -> JSONResponse:
        return JSONResponse({"error": {"message": f"no route {request.url.path}", "type": "not_found"}},
                            status_code=404)

    return app
