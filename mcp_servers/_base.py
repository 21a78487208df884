"""What every MCP server of the fleet shares: JWT verification on every request against the registry's
JWKS, the caller's verified claims inside a tool, and the gate every call passes (a policy decision,
the agent's rate limit, an audit event on NATS)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken, TokenVerifier
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.auth import ProtectedResourceMetadata
from mcp.types import CallToolResult, InputRequiredResult, ToolAnnotations
from nats.aio.client import Client as NATS
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import AnyHttpUrl
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from fleet import telemetry, transport
from fleet import tokens as fleet_tokens
from fleet.approvals import APPROVAL_GRANT, args_sha256
from fleet.bodylimit import BodyLimit
from fleet.errors import AuthError, DependencyUnavailable, ErrorCode, FleetError
from fleet.eventlog import EventLog, read_records
from fleet.mcp_errors import error_result, fleet_error_in
from fleet.natsconn import connect, key_value, service_credentials
from fleet.rates import RateLimits
from fleet.service import Readiness, serve_app, start_in_background
from fleet.settings import ServiceSettings
from fleet.tenant_keys import TenantKey
from fleet.tokens import Claims
from policy import Decision, PolicyEngine
from policy.live import enforcing, live_policy
from registry import RegistryClient

log = logging.getLogger(__name__)
audit = logging.getLogger("fleet.audit")

MCP_PATH = "/mcp"
PROTECTED_RESOURCE_PATH = "/.well-known/oauth-protected-resource"  # RFC 9728
# What a tool tells its callers about retrying it (MCP tool annotations): the client retries a call
# whose outcome it did not see only when the tool says a repeat is harmless.
READ_ONLY = ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)
KEYED_WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True)


class FleetTokenVerifier(TokenVerifier):
    """Adapts the fleet's strict verifier to the MCP SDK: a bad token is ``None`` (401)."""

    def __init__(self, verifier: fleet_tokens.TokenVerifier) -> None:
        self._verifier = verifier

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


class RegistryTokenVerifier(FleetTokenVerifier):
    """:class:`FleetTokenVerifier` for tokens addressed to ``audience``, keys from the registry's JWKS."""

    def __init__(self, registry: RegistryClient, audience: str) -> None:
        super().__init__(registry.verifier(audience))


def current_claims() -> Claims:
    """The verified claims of the request being served (never from tool arguments)."""
    token = get_access_token()
    claims = token.claims.get("fleet_claims") if token is not None and token.claims else None
    if not isinstance(claims, Claims):
        raise AuthError("no authenticated caller")
    return claims


class TenantKeys:
    """The tenant keys this server holds for its callers (see :mod:`fleet.tenant_keys`): each asked
    of the registry with the verified token of a caller of that tenant, kept in memory only, for at
    most ``KEEP_S`` (less if the registry says so), at most ``MAX_TENANTS`` at once. Never logged."""

    KEEP_S = 120.0
    MAX_TENANTS = 256

    def __init__(self, registry: RegistryClient, clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._clock = clock
        self._keys: dict[str, tuple[float, TenantKey]] = {}

    async def for_caller(self, claims: Claims) -> TenantKey:
        """The key of the tenant of ``claims`` (the current caller's), asked for with its token."""
        now = self._clock()
        cached = self._keys.get(claims.tenant)
        if cached is not None and cached[0] > now:
            return cached[1]
        key, expires_in = await self._registry.tenant_key(claims.token, claims.tenant)
        if len(self._keys) >= self.MAX_TENANTS:
            self._keys = {t: kept for t, kept in self._keys.items() if kept[0] > now}
            if len(self._keys) >= self.MAX_TENANTS:
                self._keys.pop(next(iter(self._keys)))  # the oldest kept
        self._keys[claims.tenant] = (now + min(self.KEEP_S, expires_in), key)
        return key


@dataclass(frozen=True, slots=True)
class Approval:
    """A verified approval grant for the call being served (see :mod:`fleet.approvals`)."""

    jti: str
    approver: str  # the person who approved (the grant's verified subject), or "policy"
    by: str  # "person" or "policy"
    op_id: str
    decision_id: str
    run_id: str
    args_sha256: str
    expires_at: int


class ApprovalGrants:
    """Checks the approval grant of a gated call: the registry's signature (its keys, as for
    tokens), addressed to this server, unexpired, and bound to the caller's tenant (from its
    token), the caller's run (ditto), this tool and the SHA-256 of these exact arguments. That it
    is used once is the tool's to record, in the transaction of the effect (:meth:`use`)."""

    def __init__(self, registry: RegistryClient, server_id: str) -> None:
        self.server_id = server_id
        self._verifier = registry.verifier(server_id, grant=APPROVAL_GRANT)

    async def verify(self, claims: Claims, tool: str, arguments: dict[str, Any], grant: str) -> Approval:
        """The approval ``grant`` carries for this call, or a :class:`FleetError`
        (``approval_invalid``, ``approval_grant_expired``, ``approval_mismatch``)."""
        if len(grant) > MAX_GRANT_CHARS:
            raise FleetError(ErrorCode.APPROVAL_INVALID, "the approval grant is not one the registry issued")
        try:
            verified = await self._verifier.verify(grant)
        except FleetError as exc:
            code = (
                ErrorCode.APPROVAL_GRANT_EXPIRED
                if exc.message == "token expired"
                else ErrorCode.APPROVAL_INVALID
            )
            raise FleetError(code, f"the approval grant is refused: {exc.message}") from exc
        raw = verified.raw
        given = raw.get("approval")
        bound: dict[str, Any] = given if isinstance(given, dict) else {}
        wrong = []
        if verified.tenant != claims.tenant:
            wrong.append("tenant")
        if not raw.get("run_id") or raw.get("run_id") != claims.raw.get("run_id"):
            wrong.append("run")
        if bound.get("server") != self.server_id or bound.get("tool") != tool:
            wrong.append("tool")
        if bound.get("args_sha256") != args_sha256(arguments):
            wrong.append("arguments")
        if wrong:
            raise FleetError(
                ErrorCode.APPROVAL_MISMATCH, f"the approval grant is for another {', '.join(wrong)}"
            )
        return Approval(
            jti=verified.jti,
            approver=str(bound.get("approver") or verified.sub),
            by=str(bound.get("by", "person")),
            op_id=str(bound.get("op_id", "")),
            decision_id=str(bound.get("decision_id", "")),
            run_id=str(raw["run_id"]),
            args_sha256=str(bound["args_sha256"]),
            expires_at=verified.expires_at,
        )


MAX_GRANT_CHARS = 8192


def approval_grants_sql(schema: str) -> str:
    """The table where a server records the approval grants it used (one row per grant, in the
    transaction of the effect it allowed), row-level security by tenant like its other tables."""
    return f"""
CREATE TABLE IF NOT EXISTS {schema}.approval_grants (
    tenant_id    text NOT NULL,
    jti          text NOT NULL,
    run_id       text NOT NULL,
    op_id        text NOT NULL,
    tool         text NOT NULL,
    args_sha256  text NOT NULL,
    approver     text NOT NULL,
    approved_by  text NOT NULL,
    decision_id  text NOT NULL,
    expires_at   timestamptz NOT NULL,
    used_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, jti)
);
ALTER TABLE {schema}.approval_grants ENABLE ROW LEVEL SECURITY;
ALTER TABLE {schema}.approval_grants FORCE ROW LEVEL SECURITY;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_policies WHERE schemaname = '{schema}'
                   AND tablename = 'approval_grants' AND policyname = 'tenant_isolation') THEN
        CREATE POLICY tenant_isolation ON {schema}.approval_grants
            USING (tenant_id = current_setting('fleet.tenant', true))
            WITH CHECK (tenant_id = current_setting('fleet.tenant', true));
    END IF;
END $$;
"""


async def use_grant(conn: Any, schema: str, tenant: str, tool: str, approval: Approval) -> None:
    """Record ``approval``'s grant as used, in the caller's transaction (that of the effect): a
    grant used before is refused (``approval_replayed``), and the transaction with it."""
    cursor = await conn.execute(
        f"INSERT INTO {schema}.approval_grants (tenant_id, jti, run_id, op_id, tool, args_sha256, approver,"
        " approved_by, decision_id, expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, to_timestamp(%s))"
        " ON CONFLICT (tenant_id, jti) DO NOTHING RETURNING jti",
        (
            tenant,
            approval.jti,
            approval.run_id,
            approval.op_id,
            tool,
            approval.args_sha256,
            approval.approver,
            approval.by,
            approval.decision_id,
            approval.expires_at,
        ),
    )
    if await cursor.fetchone() is None:
        raise FleetError(ErrorCode.APPROVAL_REPLAYED, "this approval grant was used already")


AUDIT_STREAM = "FLEET_AUDIT"
AUDIT_MAX_AGE_S = 90 * 24 * 3600.0
AUDIT_MAX_PENDING = 10_000  # events not yet stored; beyond that, calls are refused, not run unaudited


class AuditTrail(EventLog):
    """One event per tool call, kept in the JetStream stream ``FLEET_AUDIT`` (subject
    ``fleet.audit.tools.<server>``): who called which tool for which tenant, on whose behalf, with what
    summary of its arguments, and what the gate decided (decision id and bundle revision). Batched
    (see :mod:`fleet.eventlog`); when the broker stays away until ``AUDIT_MAX_PENDING`` events wait,
    the gate refuses calls: nothing runs unaudited."""

    def __init__(self, server_id: str, max_pending: int = AUDIT_MAX_PENDING) -> None:
        super().__init__(
            AUDIT_STREAM,
            "fleet.audit.>",
            f"fleet.audit.tools.{server_id}",
            max_age_s=AUDIT_MAX_AGE_S,
            max_pending=max_pending,
        )

    def keep(self, event: dict[str, Any]) -> None:
        """Record ``event``, or refuse the call it is about (a :class:`FleetError`)."""
        try:
            self.record(event)
        except FleetError:
            raise DependencyUnavailable(
                "the audit trail cannot keep up (is NATS down?); the call was refused"
            ) from None


async def read_audit(client: NATS, server_id: str, *, wait_s: float = 1.0) -> list[dict[str, Any]]:
    """Every audit event of ``server_id`` the stream holds, oldest first."""
    return await read_records(client, f"fleet.audit.tools.{server_id}", wait_s=wait_s)


RUN_CALLS_BUCKET = "fleet-run-tool-calls"
RUN_CALLS_TTL_S = 14 * 24 * 3600.0


class RunCalls:
    """How many tool calls each run has made, over every MCP server of the fleet (NATS KV, one key per
    tenant and run, raised by compare-and-set). Counted only for calls whose decision names a cap."""

    def __init__(self) -> None:
        self._bucket: Any = None

    async def open(self, client: NATS) -> None:
        self._bucket = await key_value(client, RUN_CALLS_BUCKET, history=1, ttl_s=RUN_CALLS_TTL_S)

    async def count(self, tenant: str, run_id: str) -> int:
        """Count one more call of the run; the number it is (1 for the first)."""
        if self._bucket is None:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "the run call counter is not open", retryable=True
            )
        key = hashlib.sha256(f"{tenant}\0{run_id}".encode()).hexdigest()
        for _ in range(50):
            try:
                entry = await self._bucket.get(key)
                current, revision = int(entry.value or b"0"), entry.revision
            except KeyNotFoundError:
                current, revision = 0, None
            try:
                if revision is None:
                    await self._bucket.create(key, str(current + 1).encode())
                else:
                    await self._bucket.update(key, str(current + 1).encode(), last=revision)
                return current + 1
            except (KeyWrongLastSequenceError, BadRequestError):
                continue  # another call counted first: count again
        raise FleetError(ErrorCode.CONFLICT, f"too many concurrent calls of run {run_id}", retryable=True)


class ToolGate:
    """What every call of one server's tools passes before it runs: the caller's verified claims
    (the tenant comes from the token, never from arguments), a policy decision (tenant, agent,
    actors, tool, a summary of the arguments), the agent's rate limit from that decision, and an
    audit event whatever the outcome."""

    def __init__(
        self,
        engine: PolicyEngine,
        server_id: str,
        trail: AuditTrail | None = None,
        limits: RateLimits | None = None,
        run_calls: RunCalls | None = None,
    ) -> None:
        """``trail``: where audit events go (None: only the log, for a server with no broker);
        ``run_calls``: the fleet's count of each run's calls (None: a cap policy names is refused)."""
        self.engine = engine
        self.server_id = server_id
        self.trail = trail
        self.limits = limits or RateLimits()
        self.run_calls = run_calls

    async def allow(
        self, tool: str, arguments: dict[str, Any], declared_scopes: Sequence[str] = ()
    ) -> Claims:
        """:meth:`authorize`, for a tool that needs only the caller's claims."""
        return (await self.authorize(tool, arguments, declared_scopes))[0]

    async def authorize(
        self, tool: str, arguments: dict[str, Any], declared_scopes: Sequence[str] = ()
    ) -> tuple[Claims, Decision]:
        """The current caller's claims and the decision to let it run ``tool``; a :class:`FleetError`
        (``policy_denied``, ``policy_unavailable``, ``rate_limited``) if it may not.
        ``declared_scopes``: what the server declares the tool needs (policy uses it for a server
        that its data does not name, see ``fleet.tools``)."""
        claims = current_claims()
        agent = claims.actors[0] if claims.actors else claims.sub  # who makes this call
        event: dict[str, Any] = {
            "server": self.server_id,
            "tool": tool,
            "tenant": claims.tenant,
            "agent": agent,
            "subject": claims.sub,
            "actors": list(claims.actors),
            "run_id": claims.raw.get("run_id"),
            "arguments": arguments,
        }
        try:
            decision = await self.engine.decide(
                "fleet.tools.decision",
                {
                    "server": self.server_id,
                    "tool": tool,
                    "tenant": claims.tenant,
                    "subject": claims.sub,
                    "agent": agent,
                    "actors": list(claims.actors),  # who passed the caller's token down, nearest first
                    "scopes": sorted(claims.scopes),
                    "declared_scopes": list(declared_scopes),
                    "arguments": arguments,
                },
                log_decision=self.trail is None,  # else its audit event records it
            )
        except FleetError as exc:
            self._audit(event, "policy_unavailable", None)
            raise FleetError(
                exc.code, "policy could not be evaluated; the call was refused", retryable=exc.retryable
            ) from exc
        if not decision.allow:
            self._audit(event, "denied", decision)
            raise FleetError(
                ErrorCode.POLICY_DENIED,
                f"{'; '.join(decision.reasons)} (decision {decision.decision_id})",
                details={"decision_id": decision.decision_id, "reasons": list(decision.reasons)},
            )
        wait_s = self.limits.take((claims.tenant, agent, tool), decision.result.get("rate_limit"))
        if wait_s:
            self._audit(event, "rate_limited", decision)
            raise FleetError(
                ErrorCode.RATE_LIMITED,
                f"{agent} calls {self.server_id}/{tool} more often than policy"
                f" allows; retry in {min(wait_s, 3600):.1f} s",
                retryable=True,
                retry_after_s=max(1, math.ceil(min(wait_s, 3600))),
            )
        cap = decision.result.get("run_call_limit")
        if cap is not None:
            if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
                self._audit(event, "policy_unavailable", decision)
                raise FleetError(
                    ErrorCode.POLICY_UNAVAILABLE, f"run_call_limit must be a whole number, not {cap!r}"
                )
            await self._count_run_call(event, decision, cap)
        self._audit(event, "allowed", decision)
        return claims, decision

    async def _count_run_call(self, event: dict[str, Any], decision: Decision, cap: int) -> None:
        """Count the call against its run's cap (policy's ``run_call_limit``); refuse it beyond."""
        run_id = event["run_id"]
        if not run_id:
            return  # a call outside any run has no run budget
        try:
            if self.run_calls is None:
                raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "no run call counter here")
            made = await self.run_calls.count(event["tenant"], str(run_id))
        except FleetError as exc:
            self._audit(event, "policy_unavailable", decision)
            raise FleetError(
                exc.code, "the run's tool calls cannot be counted; the call was refused"
            ) from exc
        except Exception as exc:
            self._audit(event, "policy_unavailable", decision)
            raise DependencyUnavailable(
                f"the run's tool calls cannot be counted ({exc!r}); the call was refused"
            ) from exc
        if made > cap:
            self._audit(event, "run_limit", decision)
            raise FleetError(
                ErrorCode.POLICY_DENIED,
                f"run {run_id} has made the {cap} tool calls policy allows it"
                f" (decision {decision.decision_id})",
            )

    def _audit(self, event: dict[str, Any], outcome: str, decision: Decision | None) -> None:
        event["outcome"] = outcome
        if decision is not None:
            event["decision_id"], event["revision"] = decision.decision_id, decision.revision
            event["reasons"] = list(decision.reasons)
        if outcome != "allowed" or self.trail is None:
            audit.info(
                "tool=%s sub=%s actors=%s run=%s tenant=%s outcome=%s decision=%s",
                event["tool"],
                event["subject"],
                ">".join(event["actors"]) or "-",
                event["run_id"] or "-",
                event["tenant"],
                outcome,
                event.get("decision_id", "-"),
            )
        if self.trail is not None:
            self.trail.keep(event)


def build_app(
    mcp: MCPServer,
    readiness: Readiness,
    lifespan: Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]],
    scopes: Mapping[str, Sequence[str]] | None = None,
) -> Starlette:
    """The Starlette app of an MCP server: ``/healthz`` (open), ``/mcp`` (token required) and, for
    a server with a resource URL (:func:`auth_settings`), its RFC 9728 protected-resource metadata
    (open): the resource, the registry as its authorization server, and the scopes its tools declare
    (``scopes``, by tool name).

    ``lifespan`` must enter ``mcp.session_manager.run()`` (mounted apps get no lifespan of their own).
    """
    auth = mcp.settings.auth
    public = str(auth.resource_server_url) if auth is not None and auth.resource_server_url else None
    mcp_app = mcp.streamable_http_app(
        streamable_http_path=MCP_PATH,
        stateless_http=True,
        json_response=True,
        transport_security=addressed_as(public),
    )
    routes: list[Route | Mount] = [Route("/healthz", readiness.endpoint)]
    if auth is not None and auth.resource_server_url is not None:
        metadata = ProtectedResourceMetadata(
            resource=auth.resource_server_url,
            authorization_servers=[auth.issuer_url],
            scopes_supported=sorted({scope for named in (scopes or {}).values() for scope in named}) or None,
            resource_name=getattr(mcp, "server_id", None) or mcp.name,
        ).model_dump(mode="json", exclude_none=True)
        # The registry's issuer exactly as its own metadata says it (RFC 8414 3.3 compares the
        # strings): its URL without the slash pydantic adds to a bare origin.
        metadata["authorization_servers"] = [str(auth.issuer_url).rstrip("/")]

        async def protected_resource(request: Request) -> Response:
            return JSONResponse(metadata, headers={"Cache-Control": "max-age=3600"})

        # Where RFC 9728 puts it for the resource's path, and at the root, where clients look when
        # a 401 names no metadata (both ahead of the SDK's own route, which knows no scopes).
        routes.append(Route(f"{PROTECTED_RESOURCE_PATH}{MCP_PATH}", protected_resource))
        routes.append(Route(PROTECTED_RESOURCE_PATH, protected_resource))
    routes.append(Mount("/", app=mcp_app))
    return Starlette(routes=routes, lifespan=lifespan)


def addressed_as(public_url: str | None) -> TransportSecuritySettings | None:
    """The MCP SDK's DNS-rebinding check, for a server whose public URL is ``public_url``: a request
    must be addressed (``Host``) to that name, or to this machine's loopback (a local stack, a
    health probe), and come from no other web origin. The SDK's own default admits loopback names
    only, which refused every request to a deployed server by its service name (``mcp-sql:8080``);
    None: no public URL known, the SDK's default."""
    if public_url is None:
        return None
    parts = urlsplit(public_url)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[parts.netloc, "127.0.0.1:*", "localhost:*", "[::1]:*"],
        allowed_origins=[f"{parts.scheme}://{parts.netloc}"],
    )


async def serve_mcp(app: Starlette, settings: ServiceSettings) -> None:
    """Serve an MCP server's app (:func:`fleet.service.serve_app`); ``/mcp`` takes bodies up to
    ``settings.max_mcp_body_bytes``, every other route ``settings.max_body_bytes``."""
    await serve_app(app, settings, [BodyLimit(MCP_PATH, settings.max_mcp_body_bytes, jsonrpc=True)])


async def declared_tools(mcp: MCPServer, scopes: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """What the server registers of its tools: each one's name, description and the scopes a token
    needs to call it (``scopes``, by tool name), and whether a repeated call is harmless (its
    annotations: the client retries only those). Agents load these from the registry."""
    return [
        {
            "name": tool.name,
            "description": (tool.description or "")[:2000],
            "scopes": list(scopes.get(tool.name, ())),
            "read_only": bool(tool.annotations and tool.annotations.read_only_hint),
            "idempotent": bool(tool.annotations and tool.annotations.idempotent_hint),
        }
        for tool in await mcp.list_tools()
    ]


def tool_server_app(
    settings: ServiceSettings,
    *,
    tools: Mapping[str, Sequence[str]],
    make_server: Callable[[RegistryClient, ToolGate], MCPServer],
    resources: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
) -> Starlette:
    """The whole app of one MCP server process: the registry client and the gate its tools use (the
    policy engine, rate limits, the audit trail on NATS), ``resources`` (database pools, stores)
    entered before it serves, and its registration (with each tool's scopes from ``tools``) once it
    accepts requests."""
    if not settings.nats_url:
        raise FleetError(ErrorCode.INVALID_REQUEST, "an MCP server needs FLEET_NATS_URL (its audit trail)")
    http = new_http()
    registry = RegistryClient(settings, http)
    policy = live_policy(settings)
    gate = ToolGate(policy, settings.service_id, AuditTrail(settings.service_id), run_calls=RunCalls())
    mcp = make_server(registry, gate)
    readiness = Readiness(settings.service_id, "mcp_server")

    async def start() -> None:
        await registry.join_as_mcp_server(settings.public_url + MCP_PATH, await declared_tools(mcp, tools))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            stack.push_async_callback(registry.aclose)
            await registry.ready_for_bus()
            broker = await connect(
                settings.nats_url,
                f"{settings.service_id}-audit",
                replicas=settings.nats_replicas,
                credentials=service_credentials(settings),
            )
            stack.push_async_callback(broker.close)
            assert gate.trail is not None
            await stack.enter_async_context(gate.trail.publishing(broker))
            await stack.enter_async_context(enforcing(policy, broker))
            assert gate.run_calls is not None
            await gate.run_calls.open(broker)
            if resources is not None:
                await stack.enter_async_context(resources())
            await stack.enter_async_context(mcp.session_manager.run())
            await stack.enter_async_context(start_in_background(readiness, start))
            yield

    return build_app(mcp, readiness, lifespan, tools)


class TracedMCPServer(MCPServer):
    """An MCP server whose every tool call is an ``execute_tool`` SERVER span (the child of the
    caller's span its request's ``traceparent`` names) and a sample of the tool latency histogram,
    by tool and outcome (``ok``; ``error``: an error answer or a refusal of the gate)."""

    def __init__(self, name: str, server_id: str, max_result_bytes: int | None = None, **kwargs: Any) -> None:
        """``max_result_bytes``: a tool result larger than this (as JSON) is answered with a
        ``result_too_large`` error instead (None: no cap)."""
        super().__init__(name, **kwargs)
        self.server_id = server_id
        self.max_result_bytes = max_result_bytes

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        """The tool's answer, traced and timed (its arguments and result are in neither)."""
        started = time.perf_counter()
        outcome = "error"
        claims = _claims_or_none()
        span = telemetry.execute_tool_span(
            name,
            kind=SpanKind.SERVER,
            server=self.server_id,
            run_id=claims.run_id if claims else "",
            tenant=claims.tenant if claims else "",
            parent=None if _in_a_span() else _headers_of(context),
        )
        try:
            with span as current:
                try:
                    answer = await super().call_tool(name, arguments, context)
                except ToolError as exc:
                    answer = error_result(_failure_of(name, exc))
                result = self._capped(name, answer, claims)
                if isinstance(result, CallToolResult) and result.is_error:
                    current.set_attribute("error.type", "tool_error")
                    current.set_status(Status(StatusCode.ERROR))
                else:
                    outcome = "ok"
                return result
        finally:
            tool = name if self._tool_manager.get_tool(name) is not None else "unknown"  # bounded labels
            telemetry.TOOL_CALL_SECONDS.labels(self.server_id, tool, outcome).observe(
                time.perf_counter() - started
            )

    def _capped(
        self, name: str, result: CallToolResult | InputRequiredResult, claims: Claims | None
    ) -> CallToolResult | InputRequiredResult:
        """``result``, or a ``result_too_large`` error when it is larger than ``max_result_bytes``."""
        if self.max_result_bytes is None or not isinstance(result, CallToolResult) or result.is_error:
            return result
        size = len(result.model_dump_json(by_alias=True, exclude_none=True).encode())
        if size <= self.max_result_bytes:
            return result
        log.warning(
            "result_too_large server=%s tool=%s sub=%s tenant=%s bytes=%d cap=%d",
            self.server_id,
            name,
            claims.sub if claims else "-",
            claims.tenant if claims else "-",
            size,
            self.max_result_bytes,
        )
        message = (
            f"the result of {name} has {size} bytes, more than the {self.max_result_bytes} this server"
            " answers; ask for less"
        )
        details = {"bytes": size, "max_bytes": self.max_result_bytes}
        return error_result(FleetError(ErrorCode.RESULT_TOO_LARGE, message, details=details))


def _failure_of(tool: str, exc: ToolError) -> FleetError:
    """What a tool call that raised ``exc`` is answered with: the FleetError the tool (or its gate)
    raised, as it is; the SDK's own refusals (no such tool, arguments that fail the input schema) as
    ``invalid_request`` with its text; anything else as ``internal``, logged here with its traceback
    and not shown to the caller."""
    error = fleet_error_in(exc)
    if error is not None:
        log.info("tool %s refused or failed: %s", tool, error.code)
        return error
    if isinstance(exc, UnexpectedToolError):
        log.error("tool %s raised an unexpected exception", tool, exc_info=exc)
        return FleetError(ErrorCode.INTERNAL, f"{tool} failed; the server logged why")
    log.info("tool %s refused its call: %s", tool, exc)
    return FleetError(ErrorCode.INVALID_REQUEST, str(exc))


def _in_a_span() -> bool:
    """Whether the MCP SDK's own span of the request is current: it took its parent from the
    request's ``_meta`` trace context, and ours nests under it; else ours takes the HTTP headers'."""
    return trace.get_current_span().get_span_context().is_valid


def _claims_or_none() -> Claims | None:
    try:
        return current_claims()
    except AuthError:
        return None


def _headers_of(context: Context[Any, Any] | None) -> dict[str, str] | None:
    """The HTTP headers of the request a tool call came in (where its trace context is)."""
    if context is None:
        return None
    try:
        request = context.request_context.request
    except ValueError:  # no request context: a call made in process
        return None
    headers = getattr(request, "headers", None)
    return dict(headers) if headers is not None else None


def fleet_mcp_server(
    name: str, settings: ServiceSettings, registry: RegistryClient, instructions: str | None = None
) -> MCPServer:
    """An MCP server that verifies every request's token (addressed to this service, keys from the
    registry's JWKS) before any tool runs, traces and times every tool call, and answers a tool result
    larger than ``settings.mcp_max_result_bytes`` with ``result_too_large``."""
    return TracedMCPServer(
        name,
        settings.service_id,
        max_result_bytes=settings.mcp_max_result_bytes,
        instructions=instructions,
        token_verifier=RegistryTokenVerifier(registry, settings.service_id),
        auth=auth_settings(settings),
    )


def auth_settings(settings: ServiceSettings) -> AuthSettings:
    """Tokens come from the registry; the server is the resource at its public ``/mcp`` URL, which
    its 401s name (``resource_metadata`` in ``WWW-Authenticate``, RFC 9728) so that a standard MCP
    client finds the registry from there. The audience of a token is checked by the fleet's own
    verifier (the server's id), so the SDK's check of the resource is left off."""
    return AuthSettings(
        issuer_url=AnyHttpUrl(settings.registry_url),
        resource_server_url=AnyHttpUrl(settings.public_url.rstrip("/") + MCP_PATH),
        validate_token_resource=False,
    )


def new_http() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0), event_hooks=transport.hooks())
