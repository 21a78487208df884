"""The parts alone, each a process of its own, for the cost benchmark's floor: what an a2a-sdk agent
and an MCP server built with the SDK cost per call when they do nothing else (no token, no policy,
no journal, no event log), so that the fleet's services can be held to a multiple of it.

``python -m bench._floor_servers a2a|mcp`` serves on a free loopback port and prints its URL.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import uvicorn
from a2a.helpers import get_data_parts, new_data_part, new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from mcp.server.mcpserver import MCPServer
from starlette.applications import Starlette

RPC_PATH = "/a2a/jsonrpc"


class _Echo(AgentExecutor):
    """Completes every task at once with its input as the artifact (what a cheap skill returns)."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        data = [d for d in get_data_parts(context.message.parts) if isinstance(d, dict)]
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        await updater.add_artifact([new_data_part(data[0] if data else {})], name="echo", last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


def a2a_app(base_url: str) -> Starlette:
    """A bare a2a-sdk agent: the SDK's card and JSON-RPC routes, its request handler, an in-memory
    task store."""
    card = AgentCard(
        name="floor",
        description="the a2a-sdk alone",
        version="1",
        supported_interfaces=[
            AgentInterface(url=base_url + RPC_PATH, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["application/json"],
        default_output_modes=["application/json"],
        skills=[AgentSkill(id="echo", name="echo", description="echo", tags=["floor"])],
    )
    handler = DefaultRequestHandler(_Echo(), InMemoryTaskStore(), card)
    return Starlette(
        routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url=RPC_PATH)]
    )


def mcp_app() -> Any:
    """A bare MCP server of the SDK: one tool that answers a fixed record, Streamable HTTP,
    stateless, JSON answers (as the fleet's servers are configured)."""
    mcp = MCPServer("floor")

    @mcp.tool()
    async def query(sql: str) -> dict[str, Any]:
        """A fixed record."""
        return {"rows": [[1, "paid"]], "truncated": False}

    return mcp.streamable_http_app(stateless_http=True, json_response=True)


def main() -> None:
    kind = sys.argv[1]
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = a2a_app(base) if kind == "a2a" else mcp_app()
    print(base + ("/mcp" if kind == "mcp" else ""), flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on")).run(sockets=[sock])


if __name__ == "__main__":
    main()
