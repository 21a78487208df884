"""Identities for probing the registry: an enrolled test identity (an impostor: it may enroll and
register, nothing more) and a throwaway agent that serves only a signed card."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jwt
import uvicorn
from a2a.types import AgentSkill
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.json_format import MessageToDict
from jwt.algorithms import RSAAlgorithm
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deploy.enrollment import enrollment_token
from deploy.local_stack import ServiceKind, ServiceSpec
from fleet.a2a_support import build_card, sign_card
from fleet.keys import SigningKey
from fleet.service import Readiness
from fleet.settings import ServiceSettings
from fleet.tokens import client_assertion
from fleetctl.testing.e2e import Stack
from mcp_servers._base import (
    MCP_PATH,
    ToolGate,
    build_app,
    declared_tools,
    fleet_mcp_server,
)
from policy import RegorusEngine
from registry import RegistryClient

IMPOSTOR_SKILL = "impersonate"  # the skill a served card offers unless the test says otherwise


class CardServer:
    """A throwaway agent that serves only a card, which the test may swap while it runs."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.card: dict[str, Any] = {}

    def serve(
        self,
        card_key: SigningKey | None,
        *,
        host_in_card: str | None = None,
        version: str = "1",
        skills: tuple[str, ...] = (IMPOSTOR_SKILL,),
    ) -> None:
        """Serve a card signed with ``card_key`` (unsigned if None) that names ``host_in_card`` and
        offers ``skills``."""
        card = build_card(
            name="Impostor",
            description="test agent",
            version=version,
            base_url=host_in_card or self.base,
            skills=[AgentSkill(id=skill, name=skill, description="x") for skill in skills],
            token_url="http://127.0.0.1:1/oauth/token",
            required_scope="agent:invoke",
        )
        self.card = MessageToDict(sign_card(card, card_key) if card_key is not None else card)

    def app(self) -> Starlette:
        async def card(request: Request) -> JSONResponse:
            return JSONResponse(self.card)

        return Starlette(routes=[Route("/.well-known/agent-card.json", card)])


@contextlib.asynccontextmanager
async def card_server() -> AsyncIterator[CardServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    served = CardServer(f"http://127.0.0.1:{sock.getsockname()[1]}")
    server = uvicorn.Server(uvicorn.Config(served.app(), log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield served  # the socket already listens: requests wait in its backlog until uvicorn serves
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def serve_card(
    card_key: SigningKey, *, host_in_card: str | None = None, skills: tuple[str, ...] = (IMPOSTOR_SKILL,)
) -> AsyncIterator[str]:
    """A throwaway agent that serves only a card (signed with ``card_key``, offering ``skills``);
    its base URL."""
    async with card_server() as served:
        served.serve(card_key, host_in_card=host_in_card, skills=skills)
        yield served.base


class Impostor:
    """An identity enrolled with the operator's consent, used to probe the registry."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.id = f"impostor-{uuid.uuid4().hex[:8]}"
        self.key = SigningKey.generate()
        self.registry = stack.endpoints["registry"]

    def enrollment_token(
        self,
        scopes: tuple[str, ...] = ("registry:write", "registry:read"),
        kind: ServiceKind = "specialist",
        skills: tuple[str, ...] = (IMPOSTOR_SKILL,),
        *,
        external: bool = False,
    ) -> str:
        """A token to enroll with: the card it serves (``serve_card``) offers ``IMPOSTOR_SKILL``."""
        operator = SigningKey.load_or_create(self.stack.layout.key_file("operator"))
        spec = ServiceSpec(self.id, kind, "x:y", scopes=scopes, skills=skills)
        return enrollment_token(operator, spec, external=external)

    async def enroll(self, http: httpx.AsyncClient, token: str) -> httpx.Response:
        body = {"id": self.id, "public_jwk": self.key.public_jwk(), "enrollment_token": token}
        return await http.post(self.registry + "/v1/enroll", json=body)

    async def request_token(
        self,
        http: httpx.AsyncClient,
        scope: str = "registry:write",
        assertion: str | None = None,
        audience: str = "registry",
    ) -> httpx.Response:
        form = {
            "grant_type": "client_credentials",
            "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
            "client_assertion": assertion
            or client_assertion(self.key, self.id, self.registry + "/oauth/token"),
            "audience": audience,
            "tenant": "acme",
            "scope": scope,
        }
        return await http.post(self.registry + "/oauth/token", data=form)

    async def register(self, http: httpx.AsyncClient, url: str) -> httpx.Response:
        token = (await self.request_token(http)).json()["access_token"]
        return await http.put(
            f"{self.registry}/v1/agents/{self.id}",
            json={"url": url},
            headers={"Authorization": f"Bearer {token}"},
        )


@contextlib.asynccontextmanager
async def team_mcp_server(stack: Stack, tmp: Path, scope: str) -> AsyncIterator[str]:
    """An MCP server another team deploys while the fleet runs: its own identity (enrolled with the
    operator's consent), one tool ``whoami`` that declares ``scope`` and answers with what the
    server sees of its caller, registered with the registry. Yields its id once it is registered."""
    server_id = f"mcp-team-{uuid.uuid4().hex[:6]}"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    operator = SigningKey.load_or_create(stack.layout.key_file("operator"))
    spec = ServiceSpec(server_id, "mcp_server", "x:y", scopes=("registry:read", "registry:write"))
    settings = ServiceSettings(
        service_id=server_id,
        key_file=tmp / f"{server_id}.key",
        public_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
        registry_url=stack.endpoints["registry"],
        nats_url=stack.endpoints["nats"],
        enrollment_token=enrollment_token(operator, spec),
        operator_jwk_file=stack.layout.operator_jwk_file,
    )
    scopes = {"whoami": [scope]}
    gate = ToolGate(RegorusEngine.from_dir(), server_id)  # the fleet's bundle, as every server loads it
    async with httpx.AsyncClient() as http:
        registry = RegistryClient(settings, http)
        mcp = fleet_mcp_server("team", settings, registry)

        @mcp.tool()
        async def whoami() -> dict[str, Any]:
            """Who this server sees calling: the subject, the tenant and the chain of actors."""
            claims = await gate.allow("whoami", {}, scopes["whoami"])
            return {"sub": claims.sub, "tenant": claims.tenant, "actors": list(claims.actors)}

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with mcp.session_manager.run():
                yield

        server = uvicorn.Server(
            uvicorn.Config(build_app(mcp, Readiness(server_id, "mcp_server"), lifespan), log_level="warning")
        )
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await registry.join_as_mcp_server(
                settings.public_url + MCP_PATH, await declared_tools(mcp, scopes)
            )
            yield server_id
        finally:
            server.should_exit = True
            await task
            await registry.aclose()


class PartnerIdp:
    """An identity provider outside the fleet (a partner company's): an RS256 and an ES256 key, and
    its JWKS served over HTTP from a thread (it outlives every test's event loop). The shared stack
    trusts it (``FLEET_EXTERNAL_ISSUERS``), mapped to the tenant ``globex``."""

    name = "partner"
    issuer = "https://idp.partner.example"
    audience = "agent-fleet"
    tenant = "globex"

    def __init__(self) -> None:
        self.es_key = SigningKey.generate()
        self.rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        rsa_jwk = json.loads(RSAAlgorithm.to_jwk(self.rsa_key.public_key()))
        jwks = json.dumps(
            {"keys": [self.es_key.public_jwk(), {**rsa_jwk, "kid": "partner-rsa", "alg": "RS256"}]}
        )

        class Jwks(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(jwks.encode())

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Jwks)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.jwks_url = f"http://127.0.0.1:{self._server.server_address[1]}/jwks.json"

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "issuer": self.issuer,
            "jwks_url": self.jwks_url,
            "audience": self.audience,
            "tenant": self.tenant,
        }

    def claims(self, sub: str = "alice", **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": sub,
            "aud": self.audience,
            "iat": now,
            "exp": now + 600,
            **overrides,
        }
        return {k: v for k, v in claims.items() if v is not None}

    def token(self, sub: str = "alice", **overrides: Any) -> str:
        """An RS256 token, as most providers sign them."""
        claims = self.claims(sub, **overrides)
        return jwt.encode(claims, self.rsa_key, algorithm="RS256", headers={"kid": "partner-rsa"})

    def es256_token(self, sub: str = "alice", **overrides: Any) -> str:
        return self.es_key.sign(self.claims(sub, **overrides))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
