"""An MCP server of a benchmark's own, served over Streamable HTTP on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from starlette.types import ASGIApp

from fleet.service import Readiness
from mcp_servers._base import build_app


@contextlib.asynccontextmanager
async def serving(mcp: MCPServer, wrap: Callable[[ASGIApp], ASGIApp] = lambda app: app) -> AsyncIterator[str]:
    """Serve ``mcp`` (its app passed through ``wrap``) until the block ends; yields its MCP URL."""
    readiness = Readiness("bench", "mcp_server")
    readiness.set_ready()

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with mcp.session_manager.run():
            yield

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    app = wrap(build_app(mcp, readiness, lifespan))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110  (uvicorn has no event to wait on)
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        server.should_exit = True
        await task
