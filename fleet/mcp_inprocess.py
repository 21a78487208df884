"""An MCP server of the fleet called in this process, as a caller whose token would have verified as
given claims: the server runs as it does behind HTTP (its tools, its gate, its policy), only the
token check is left out. The tests of a tool server (``mcp_servers.kit.ToolServer.test_client``, the
project's in-process tier ``fleetctl.testing.mcp``) call through it, with the MCP SDK's in-memory
client: no stack, no HTTP, no registry."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator

from mcp import Client
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import MCPServer

from fleet.tokens import Claims


def claims_for(
    sub: str,
    tenant: str,
    scopes: Iterable[str],
    *,
    audience: str = "mcp-test",
    run_id: str | None = "run-7",
    act: str | None = None,
) -> Claims:
    """The claims a verified token of ``sub`` in ``tenant`` would carry (``act``: the agent that
    passed the caller's token on, RFC 8693; ``run_id``: the run it was issued for)."""
    raw = {"sub": sub, "tenant": tenant, "run_id": run_id, **({"act": {"sub": act}} if act else {})}
    return Claims(
        sub=sub,
        tenant=tenant,
        audience=audience,
        scopes=frozenset(scopes),
        jti=uuid.uuid4().hex,
        expires_at=int(time.time()) + 300,
        raw=raw,
    )


@contextlib.contextmanager
def calling_as(claims: Claims) -> Iterator[None]:
    """What the MCP SDK's bearer-auth middleware sets for a request whose token verified as
    ``claims``: the tools' :func:`mcp_servers._base.current_claims` reads them from here."""
    token = AccessToken(
        token="t", client_id=claims.sub, scopes=sorted(claims.scopes), claims={"fleet_claims": claims}
    )
    reset = auth_context_var.set(AuthenticatedUser(token))
    try:
        yield
    finally:
        auth_context_var.reset(reset)


@contextlib.asynccontextmanager
async def in_process(server: MCPServer, claims: Claims) -> AsyncIterator[Client]:
    """An MCP client of ``server`` in this process (the SDK's in-memory transport) whose every call
    is made as ``claims``. The server runs as it would behind HTTP, its gate and its policy
    included; only the token check is left out (the claims are given as verified)."""
    with calling_as(claims):  # the server's tasks start inside: they carry the caller
        async with Client(server) as client:
            yield client


__all__ = ["calling_as", "claims_for", "in_process"]
