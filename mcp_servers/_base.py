"""What every MCP server of the fleet shares: JWT verification on every request against the registry's
JWKS, the caller's verified claims inside a tool, the per-call policy decision, and an audit line."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken, TokenVerifier
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import AnyHttpUrl
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from fleet.errors import FleetError
from fleet.service import Readiness
from fleet.settings import ServiceSettings
from fleet.tokens import Claims
from policy import Decision, PolicyEngine
from registry import RegistryClient

log = logging.getLogger(__name__)
audit = logging.getLogger("fleet.audit")

MCP_PATH = "/mcp"


class RegistryTokenVerifier(TokenVerifier):
    """Adapts the fleet's strict verifier to the MCP SDK: a bad token is ``None`` (401)."""

    def __init__(self, registry: RegistryClient, audience: str) -> None:
        self._verifier = registry.verifier(audience)

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            claims = await self._verifier.verify(token)
        except FleetError as exc:
            log.info("rejected a bearer token: %s", exc.message)
            return None
        return AccessToken(
            token=token,
            client_id=claims.sub,
            scopes=sorted(claims.scopes),
            expires_at=claims.expires_at,
            subject=claims.sub,
            claims={"fleet_claims": claims, **claims.raw},
        )


def current_claims() -> Claims:
    """The verified claims of the request being served (never from tool arguments)."""
    token = get_access_token()
    claims = token.claims.get("fleet_claims") if token is not None and token.claims else None
    if not isinstance(claims, Claims):
        raise ToolError("no authenticated caller")
    return claims


def authorize_call(
    engine: PolicyEngine,
    server_id: str,
    tool: str,
    arguments: dict[str, Any],
    declared_scopes: Sequence[str] = (),
) -> Claims:
    """Ask policy whether the current caller may run ``tool``; raise a tool error if not.
    ``declared_scopes``: what the server declares the tool needs (policy uses it for a server that
    its data does not name, see ``fleet.tools``)."""
    return authorize(engine, server_id, tool, arguments, declared_scopes)[0]


def authorize(
    engine: PolicyEngine,
    server_id: str,
    tool: str,
    arguments: dict[str, Any],
    declared_scopes: Sequence[str] = (),
) -> tuple[Claims, Decision]:
    """:func:`authorize_call`, with the decision (e.g. whether the call needs an approval)."""
    claims = current_claims()
    try:
        decision = engine.decide(
            "fleet.tools.decision",
            {
                "server": server_id,
                "tool": tool,
                "tenant": claims.tenant,
                "subject": claims.sub,
                "actors": list(claims.actors),  # who passed the caller's token down, nearest first
                "scopes": sorted(claims.scopes),
                "declared_scopes": list(declared_scopes),
                "arguments": arguments,
            },
        )
    except FleetError as exc:
        audit.warning("tool=%s sub=%s tenant=%s outcome=policy_unavailable", tool, claims.sub, claims.tenant)
        raise ToolError(f"[{exc.code}] policy could not be evaluated; the call was refused") from exc
    audit.info(
        "tool=%s sub=%s actors=%s run=%s tenant=%s allow=%s decision=%s revision=%s",
        tool,
        claims.sub,
        ">".join(claims.actors) or "-",
        claims.raw.get("run_id", "-"),
        claims.tenant,
        decision.allow,
        decision.decision_id,
        decision.revision,
    )
    if not decision.allow:
        raise ToolError(f"[policy_denied] {'; '.join(decision.reasons)} (decision {decision.decision_id})")
    return claims, decision


def build_app(
    mcp: MCPServer,
    readiness: Readiness,
    lifespan: Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]],
) -> Starlette:
    """The Starlette app of an MCP server: ``/healthz`` (open) and ``/mcp`` (token required).

    ``lifespan`` must enter ``mcp.session_manager.run()`` (mounted apps get no lifespan of their own).
    """
    mcp_app = mcp.streamable_http_app(streamable_http_path=MCP_PATH, stateless_http=True, json_response=True)
    return Starlette(
        routes=[Route("/healthz", readiness.endpoint), Mount("/", app=mcp_app)],
        lifespan=lifespan,
    )


async def declared_tools(mcp: MCPServer, scopes: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """What the server registers of its tools: each one's name, description and the scopes a token
    needs to call it (``scopes``, by tool name). Agents load these from the registry."""
    return [
        {
            "name": tool.name,
            "description": (tool.description or "")[:2000],
            "scopes": list(scopes.get(tool.name, ())),
        }
        for tool in await mcp.list_tools()
    ]


def auth_settings(settings: ServiceSettings) -> AuthSettings:
    return AuthSettings(
        issuer_url=AnyHttpUrl(settings.registry_url),
        resource_server_url=None,
        validate_token_resource=False,  # the verifier checks the audience itself
    )


def new_http() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0))
