"""A small real tool plane for the agent loop's tests, in the test's event loop: the registry (its
own app, on a real NATS), an MCP server of invoice tools registered with it (tokens verified on every
request), and a specialist identity enrolled for the tools' scope, with the kit's real
:class:`~specialists.kit.Toolbox`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from a2a.types import AgentSkill
from google.protobuf.json_format import MessageToDict
from mcp.server.mcpserver import MCPServer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deploy.enrollment import enrollment_token
from deploy.local_stack import ServiceSpec
from fleet.a2a_support import build_card, sign_card
from fleet.errors import ErrorCode, FleetError
from fleet.issuer_certs import certify_issuer_key
from fleet.keys import SigningKey
from fleet.service import Readiness
from fleet.settings import DEFAULT_ISSUER, ServiceSettings
from mcp_servers._base import KEYED_WRITE, MCP_PATH, READ_ONLY, build_app, declared_tools, fleet_mcp_server
from registry import RegistryClient
from registry.server import build_app as registry_app
from specialists.kit import Toolbox, mcp_http_client

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
SCOPE = "ledger:read"
# What the invoice tool answers besides the invoice: secrets the model must never see.
PASSWORD = "hunter2-staging"
API_KEY = "sk-live-0123456789abcdefghijklmnop"


@dataclass
class ToolPlane:
    """The running tool plane: the MCP server's id, the specialist's registry client and toolbox,
    each tool call the server served (tool name, arguments), the invoices paid by key, and the
    batch jobs polled."""

    server_id: str
    registry: RegistryClient
    toolbox: Toolbox
    served: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    paid: dict[str, str] = field(default_factory=dict)  # invoice paid, by idempotency key
    jobs: dict[str, int] = field(default_factory=dict)  # a job's percent done, moved by each status read
    job_step: int = 20  # how far a job moves at each status read (0: it never moves)
    job_note: str = ""  # what every status answer says besides (an injection, in the review tests)


class _Started:
    """Wraps an app to tell when its lifespan startup is over (complete or failed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.done = asyncio.Event()
        self.failed = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                self.failed = str(message.get("message", "startup failed"))
            await send(message)
            if message["type"] in ("lifespan.startup.complete", "lifespan.startup.failed"):
                self.done.set()

        await self.app(scope, receive, sending)


def _listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, sock: socket.socket) -> AsyncIterator[None]:
    """Serve ``app`` on ``sock`` for the block, once its lifespan startup completed."""
    started = _Started(app)
    server = uvicorn.Server(uvicorn.Config(started, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    waiting = asyncio.create_task(started.done.wait())
    try:
        await asyncio.wait({task, waiting}, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if not started.done.is_set() or started.failed:
            raise RuntimeError(f"the app did not start: {started.failed or 'timed out'}")
        yield
    finally:
        waiting.cancel()
        server.should_exit = True
        await asyncio.wait_for(task, STOP_TIMEOUT_S)


def _settings(
    tmp: Path, identity: str, url: str, registry_url: str, nats_url: str, **more: Any
) -> ServiceSettings:
    return ServiceSettings(
        service_id=identity,
        key_file=tmp / f"{identity}.key",
        public_url=url,
        registry_url=registry_url,
        nats_url=nats_url,
        state_dir=tmp / identity,
        operator_jwk_file=tmp / "operator.jwk.json",
        **{"local_stack": True, **more},  # every part is on this machine's loopback
    )


def _invoice_server(
    settings: ServiceSettings, registry: RegistryClient, plane: ToolPlane
) -> tuple[Starlette, MCPServer]:
    mcp = fleet_mcp_server("ledger", settings, registry)

    @mcp.tool(annotations=READ_ONLY)
    async def lookup_invoice(number: str) -> dict[str, Any]:
        """Looks an invoice up by its number."""
        plane.served.append(("lookup_invoice", {"number": number}))
        return {
            "number": number,
            "customer": "Initech",
            "total": 1250.0,
            "note": f"portal login: password={PASSWORD}",
            "api_key": API_KEY,
        }

    @mcp.tool(annotations=KEYED_WRITE)
    async def pay_invoice(number: str, idempotency_key: str) -> dict[str, Any]:
        """Pays an invoice, once per idempotency key."""
        first = idempotency_key not in plane.paid
        plane.paid.setdefault(idempotency_key, number)
        plane.served.append(("pay_invoice", {"number": number, "idempotency_key": idempotency_key}))
        return {"number": number, "paid": True, "replayed": not first}

    @mcp.tool(annotations=READ_ONLY)
    async def job_status(job: str) -> dict[str, Any]:
        """A batch job's state: it moves on each time it is asked (by the plane's step)."""
        before = plane.jobs.get(job, 0)
        done = plane.jobs[job] = min(100, before + plane.job_step)
        plane.served.append(("job_status", {"job": job}))
        # What the job did since it was last asked: a line per batch of 50 invoices.
        log = [
            f"batch {n}: invoices {n * 50} to {n * 50 + 49} checked" for n in range(before // 10, done // 10)
        ]
        answer: dict[str, Any] = {"job": job, "state": "done" if done == 100 else "running", "log": log}
        return {**answer, "done_percent": done, **({"note": plane.job_note} if plane.job_note else {})}

    @mcp.tool()
    async def void_invoice(number: str) -> dict[str, Any]:
        """Voids an unpaid invoice."""
        plane.served.append(("void_invoice", {"number": number}))
        raise FleetError(ErrorCode.CONFLICT, f"invoice {number} is paid; it cannot be voided")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with mcp.session_manager.run():
            yield

    return build_app(mcp, Readiness(settings.service_id, "mcp_server"), lifespan), mcp


def _card_app(registry: RegistryClient, base_url: str, skills: list[AgentSkill]) -> Starlette:
    """What a specialist serves for the registry to check: only its signed card."""
    card = build_card(
        name="Ledger agent",
        description="checks invoices",
        version="1",
        base_url=base_url,
        skills=skills,
        token_url=registry.token_url,
        required_scope="agent:invoke",
    )
    document = MessageToDict(sign_card(card, registry.key, jku=registry.own_keys_url))

    async def served(request: Request) -> JSONResponse:
        return JSONResponse(document)

    return Starlette(routes=[Route("/.well-known/agent-card.json", served)])


@contextlib.asynccontextmanager
async def tool_plane(
    nats_url: str, tmp: Path, skills: tuple[AgentSkill, ...] = ()
) -> AsyncIterator[ToolPlane]:
    """The registry, the invoice MCP server and a specialist's toolbox, for the block; with
    ``skills``, the specialist also serves a signed card offering them and registers it."""
    suffix = uuid.uuid4().hex[:6]
    server_id, agent_id = f"mcp-ledger-{suffix}", f"ledger-agent-{suffix}"
    operator = SigningKey.generate()
    (tmp / "operator.jwk.json").write_text(json.dumps(operator.public_jwk()))
    registry_key = SigningKey.load_or_create(tmp / "registry.key")  # as fleet up: the key, certified
    cert = certify_issuer_key(operator, DEFAULT_ISSUER, registry_key.public_jwk())
    (tmp / "registry.issuer-cert.jwt").write_text(cert)
    registry_sock, mcp_sock, card_sock = _listening(), _listening(), _listening()
    registry_url = f"http://127.0.0.1:{registry_sock.getsockname()[1]}"
    mcp_url = f"http://127.0.0.1:{mcp_sock.getsockname()[1]}"
    agent_url = f"http://127.0.0.1:{card_sock.getsockname()[1]}"

    def enrolled(
        identity: str, kind: Any, scopes: tuple[str, ...], url: str, offers: tuple[str, ...] = ()
    ) -> ServiceSettings:
        spec = ServiceSpec(identity, kind, "x:y", scopes=scopes, skills=offers)
        token = enrollment_token(operator, spec)
        return _settings(tmp, identity, url, registry_url, nats_url, enrollment_token=token)

    registry_settings = _settings(
        tmp,
        "registry",
        registry_url,
        registry_url,
        nats_url,
        issuer_cert_file=tmp / "registry.issuer-cert.jwt",
        card_refresh_s=0,
    )
    server_settings = enrolled(server_id, "mcp_server", ("registry:read", "registry:write"), mcp_url)
    agent_scopes = ("registry:read", "registry:write", SCOPE)
    # Without skills the toolbox's calls have no caller to act for: the client takes tokens in its
    # own name for the tenant, which a worker's kind may (a specialist acts only for its callers).
    # With skills it is the specialist that offers them (discovery offers specialists only).
    agent_settings = enrolled(
        agent_id, "specialist" if skills else "worker", agent_scopes, agent_url, tuple(s.id for s in skills)
    )
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        await stack.enter_async_context(serving(registry_app(registry_settings), registry_sock))
        server_registry = RegistryClient(server_settings, http)
        stack.push_async_callback(server_registry.aclose)
        agent_registry = RegistryClient(agent_settings, http)
        stack.push_async_callback(agent_registry.aclose)
        mcp_http = await stack.enter_async_context(mcp_http_client())
        toolbox = Toolbox(agent_registry, mcp_http)
        stack.push_async_callback(toolbox.aclose)
        plane = ToolPlane(server_id, agent_registry, toolbox)
        app, mcp = _invoice_server(server_settings, server_registry, plane)
        await stack.enter_async_context(serving(app, mcp_sock))
        tools = await declared_tools(
            mcp, {"lookup_invoice": [SCOPE], "void_invoice": [SCOPE], "job_status": [SCOPE]}
        )
        await server_registry.join_as_mcp_server(mcp_url + MCP_PATH, tools)
        await agent_registry.enroll()
        if skills:
            await stack.enter_async_context(
                serving(_card_app(agent_registry, agent_url, list(skills)), card_sock)
            )
            await agent_registry.register_agent(agent_url)
        else:
            card_sock.close()
        yield plane
