"""Running one service process: logging, the listening socket, the ASGI server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from fleet import telemetry
from fleet.bodylimit import BodyLimit, BodySizeLimit
from fleet.errors import PROBLEM_MEDIA_TYPE, FleetError
from fleet.settings import ServiceSettings


def problem_response(exc: FleetError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """``exc`` as an HTTP answer: its status, RFC 9457 problem details with the envelope
    (:meth:`FleetError.problem`), and ``Retry-After`` when the error says when to try again."""
    sent = dict(headers or {})
    if exc.retry_after_s is not None:
        sent.setdefault("Retry-After", str(exc.retry_after_s))
    return JSONResponse(
        exc.problem(), status_code=exc.http_status, headers=sent, media_type=PROBLEM_MEDIA_TYPE
    )


def configure_logging(service_id: str, level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format=f"%(asctime)s {service_id} %(levelname)s %(name)s: %(message)s",
    )


KEEP_ALIVE_S = 75


def listening_socket(settings: ServiceSettings) -> socket.socket:
    """The socket to serve on: the one the supervisor bound and passed down, or a new one.

    A new one names its protocol (TCP): asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only
    on connections accepted from a socket whose ``proto`` says TCP, and with Nagle on, an answer
    written in two parts (headers, body) waits for the client's delayed ACK: about 40 ms a request."""
    if settings.listen_fd is not None:
        sock = socket.socket(fileno=settings.listen_fd)
        sock.setblocking(False)
        return sock
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


async def serve_app(app: ASGIApp, settings: ServiceSettings, body_limits: Sequence[BodyLimit] = ()) -> None:
    """Serve ``app`` until SIGTERM/SIGINT; uvicorn drains in-flight requests on the way out.

    Every service gets ``/metrics`` here, and its traces go to the OTLP endpoint its settings name
    (none: tracing stays off); the spans still queued are exported on the way out. Request bodies are
    capped at ``settings.max_body_bytes``, or at the cap of the first of ``body_limits`` whose prefix
    the path starts with (:mod:`fleet.bodylimit`)."""
    tracing = telemetry.configure(settings.service_id, settings.otlp_endpoint)
    capped = BodySizeLimit(app, settings.max_body_bytes, body_limits)
    try:
        await _serve(telemetry.with_metrics(capped), settings)
    finally:
        if tracing is not None:
            tracing.shutdown()


async def _serve(app: ASGIApp, settings: ServiceSettings) -> None:
    config = uvicorn.Config(
        app,
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
        # Longer than any client keeps an idle connection (httpx: 5 s), so a client never reuses a
        # connection the server is closing at that moment (a spurious ReadError on the next call).
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
        ssl_keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
    )
    server = uvicorn.Server(config)
    await server.serve(sockets=[listening_socket(settings)])


class Readiness:
    """Liveness plus readiness: ``GET /healthz`` answers 503 until the service finished starting
    (enrolled and registered), 200 after. It is unauthenticated and reveals nothing else."""

    def __init__(self, service_id: str, kind: str) -> None:
        self._service_id = service_id
        self._kind = kind
        self._status = "starting"

    @property
    def ready(self) -> bool:
        return self._status == "ok"

    def set_ready(self) -> None:
        self._status = "ok"

    def set_failed(self, reason: str) -> None:
        self._status = f"failed: {reason}"

    async def endpoint(self, request: Request) -> JSONResponse:
        body = {"status": self._status, "service": self._service_id, "kind": self._kind}
        return JSONResponse(body, status_code=200 if self.ready else 503)


def always_ready(service_id: str, kind: str) -> Readiness:
    """A readiness that is ready from the start (for services with nothing to wait for)."""
    readiness = Readiness(service_id, kind)
    readiness.set_ready()
    return readiness


log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def start_in_background(
    readiness: Readiness, start: Callable[[], Awaitable[None]]
) -> AsyncIterator[None]:
    """Run ``start`` (enroll, register) once the server is accepting; mark ready when it is done.

    Registration must wait for the server to serve: the registry fetches our card while we register.
    If ``start`` fails for good, the process stops itself so that its supervisor sees the failure.
    """

    async def run() -> None:
        try:
            await start()
        except Exception as exc:  # any failure to start is fatal for this process
            log.exception("start-up failed")
            readiness.set_failed(type(exc).__name__)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        readiness.set_ready()

    task = asyncio.create_task(run(), name="start-up")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
