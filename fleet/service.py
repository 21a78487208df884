"""Running one service process: logging, the listening socket, the ASGI server."""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from fleet.settings import ServiceSettings


def configure_logging(service_id: str, level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format=f"%(asctime)s {service_id} %(levelname)s %(name)s: %(message)s",
    )


def listening_socket(settings: ServiceSettings) -> socket.socket:
    """The socket to serve on: the one the supervisor bound and passed down, or a new one."""
    if settings.listen_fd is not None:
        sock = socket.socket(fileno=settings.listen_fd)
        sock.setblocking(False)
        return sock
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


async def serve_app(app: ASGIApp, settings: ServiceSettings) -> None:
    """Serve ``app`` until SIGTERM/SIGINT; uvicorn drains in-flight requests on the way out."""
    config = uvicorn.Config(
        app,
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    await server.serve(sockets=[listening_socket(settings)])


def health_endpoint(service_id: str, kind: str) -> object:
    """A Starlette endpoint for ``GET /healthz`` (unauthenticated; reveals nothing but liveness)."""

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "service": service_id, "kind": kind})

    return healthz
