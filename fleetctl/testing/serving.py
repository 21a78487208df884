"""An ASGI app served for real in a test: uvicorn on a loopback socket that listens before the
server starts (so a request never races the start), stopped and closed on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Literal

import uvicorn
from starlette.types import ASGIApp


def loopback_socket() -> tuple[socket.socket, str]:
    """A listening socket on 127.0.0.1 (a free port) and its base URL: for an app that must know
    its own URL (an agent's card) before it is served."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # see listening_socket
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def serving(
    app: ASGIApp, *, lifespan: Literal["on", "off"] = "on", bound: tuple[socket.socket, str] | None = None
) -> AsyncIterator[str]:
    """Serve ``app`` for the ``with`` block, on ``bound`` (from :func:`loopback_socket`) or a new
    loopback socket; its base URL."""
    sock, url = bound or loopback_socket()
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=1)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # the lifespan (e.g. an MCP session manager) is up
            if task.done():
                task.result()  # it failed to start: say why
            await asyncio.sleep(0.01)
        yield url
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()
