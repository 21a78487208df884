"""The outbox MCP server: effects outside the fleet, each keyed by an operation id.

Tools: ``post_webhook`` (POST a JSON payload to a destination the operator configured by name; a model
never supplies a URL), ``open_ticket`` and ``publish_artifact`` (name an artifact of the tenant for
publication); ``operation_status`` answers, by operation id, what happened, for reconciliation.

Every operation is a row of ``outbox.operations`` (tenant, operation id, kind, a hash of the request,
status). The effect happens under that row's lock and its status is written in the same transaction,
so one operation id makes at most one effect however often, and however concurrently, it is called;
a repeat answers the recorded result. A repeat with another request under the same id is refused. A
webhook is sent with ``Idempotency-Key: <operation id>`` and signed (``X-Fleet-Signature``, HMAC-SHA256
of the body with the destination's secret): if the server dies after the receiver answered but before
the status was written, the next call sends it again under the same key, for the receiver to drop.

When policy says an operation needs an approval (``fleet.tools``: ``approval_always``, the
destination in ``approval_destinations``, or a publication under an ``approval_over_score`` rule,
whose score this server cannot know), nothing happens: the answer is ``{"status":
"pending_approval", "code": "approval_required", "approval_request": {...}}`` (the server, the tool
and the exact arguments to approve), and the operation waits for the same call with an
``approval_grant`` (see :mod:`fleet.approvals`): the registry's grant for exactly this call,
checked here (signature, tenant, run, tool, arguments, expiry) and used up in the transaction of
the effect, whose approver is recorded from the grant. A call's own word about its approval, or
about the facts a threshold compares (a score), counts for nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import httpx
import psycopg
from mcp.server.mcpserver import MCPServer
from nats.aio.client import Client as NATS
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from pydantic import Field
from starlette.applications import Starlette

from fleet import transport
from fleet.approvals import ApprovalRequest
from fleet.artifacts import NatsArtifactStore, parse_ref
from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import connect, service_credentials
from fleet.pgpool import db_failure
from fleet.service import configure_logging
from fleet.settings import ServiceSettings
from fleet.tenant_keys import TenantKey
from mcp_servers._base import (
    KEYED_WRITE,
    READ_ONLY,
    Approval,
    ApprovalGrants,
    TenantKeys,
    ToolGate,
    approval_grants_sql,
    fleet_mcp_server,
    serve_mcp,
    use_grant,
)
from mcp_servers._pg import database_tool_app
from registry import RegistryClient

log = logging.getLogger(__name__)

TOOLS = {
    "post_webhook": ["outbox:write"],
    "open_ticket": ["outbox:write"],
    "publish_artifact": ["outbox:write"],
    "operation_status": ["outbox:write"],
}
WRITER_ROLE = "fleet_outbox_writer"
TENANT_SETTING = "fleet.tenant"
MAX_PAYLOAD_BYTES = 256 * 1024

SCHEMA_SQL = f"""
CREATE SCHEMA IF NOT EXISTS outbox;
CREATE TABLE IF NOT EXISTS outbox.operations (
    tenant_id     text NOT NULL,
    operation_id  text NOT NULL,
    kind          text NOT NULL,
    request_hash  text NOT NULL,
    status        text NOT NULL CHECK (status IN ('pending', 'pending_approval', 'done', 'failed')),
    result        jsonb,
    error         text,
    attempts      integer NOT NULL DEFAULT 0,
    requested_by  text NOT NULL,
    approval_id   text,
    approved_by   text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, operation_id)
);
CREATE TABLE IF NOT EXISTS outbox.tickets (
    id           bigserial PRIMARY KEY,
    tenant_id    text NOT NULL,
    operation_id text NOT NULL,
    title        text NOT NULL,
    body         text NOT NULL,
    opened_at    timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS outbox.publications (
    tenant_id    text NOT NULL,
    name         text NOT NULL,
    artifact     text NOT NULL,
    operation_id text NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, name)
);
{approval_grants_sql("outbox")}
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{WRITER_ROLE}') THEN
        CREATE ROLE {WRITER_ROLE} NOLOGIN NOSUPERUSER NOBYPASSRLS;
    END IF;
END $$;
"""
_TABLES = ("operations", "tickets", "publications")


class OutboxSettings(ServiceSettings):
    outbox_destinations: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description='webhook destinations by name: {"name": {"url": "https://...", "secret": "..."}} (JSON)',
    )
    outbox_timeout_s: float = 10.0


class OperationResult(TypedDict):
    operation_id: str
    status: str  # done, failed, pending (try again: the effect may not have happened), pending_approval
    replayed: bool  # true: nothing happened now, this is what the operation id did before
    result: dict[str, Any] | None
    error: str | None
    code: str | None  # approval_required with pending_approval
    approval_request: dict[str, Any] | None  # with pending_approval: what to approve (fleet.approvals)
    approved_by: str | None  # the approver of the call that made the effect (from its grant)


class OperationStatus(TypedDict):
    operation_id: str
    status: str  # unknown, pending, pending_approval, done, failed
    kind: str | None
    result: dict[str, Any] | None
    error: str | None
    attempts: int


def request_hash(kind: str, request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([kind, request], sort_keys=True).encode()).hexdigest()


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class OutboxTools:
    def __init__(self, pool: AsyncConnectionPool[Any], settings: OutboxSettings) -> None:
        self._pool = pool
        self._settings = settings
        self.http = httpx.AsyncClient(
            timeout=settings.outbox_timeout_s, follow_redirects=False, event_hooks=transport.hooks()
        )
        self.artifacts: NatsArtifactStore | None = None

    @contextlib.asynccontextmanager
    async def _tenant_tx(self, tenant: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT set_config(%s, %s, true)", (TENANT_SETTING, tenant))
            yield conn

    async def perform(
        self,
        tenant: str,
        caller: str,
        operation_id: str,
        kind: str,
        request: dict[str, Any],
        *,
        needs_approval: bool,
        approval: Approval | None,
        approval_request: ApprovalRequest,
        key: TenantKey | None = None,
    ) -> OperationResult:
        """Do the operation once (see the module's doc). ``approval``: the call's verified grant
        (used up here, with the effect); ``approval_request``: what a person would approve.
        ``key``: the tenant's key, for a publication (whose artifact is looked up with it)."""
        digest = request_hash(kind, request)
        async with self._tenant_tx(tenant) as conn:
            await conn.execute(
                "INSERT INTO outbox.operations (tenant_id, operation_id, kind, request_hash, status, requested_by)"
                " VALUES (%s, %s, %s, %s, 'pending', %s) ON CONFLICT DO NOTHING",
                (tenant, operation_id, kind, digest, caller),
            )
        async with self._tenant_tx(tenant) as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                "SELECT * FROM outbox.operations WHERE tenant_id = %s AND operation_id = %s FOR UPDATE",
                (tenant, operation_id),
            )
            row = await cursor.fetchone()
            assert row is not None
            if row["request_hash"] != digest:
                raise FleetError(
                    ErrorCode.CONFLICT, "this operation id was used for another request; use a new id"
                )
            if approval is not None:  # used once, whatever follows: refused (and rolled back) if not
                await use_grant(conn, "outbox", tenant, approval_request.tool, approval)
            if row["status"] in ("done", "failed"):
                return _result(
                    operation_id, row["status"], True, row["result"], row["error"], row["approved_by"]
                )
            if needs_approval and approval is None:
                await conn.execute(
                    "UPDATE outbox.operations SET status = 'pending_approval', updated_at = now()"
                    " WHERE tenant_id = %s AND operation_id = %s",
                    (tenant, operation_id),
                )
                pending = _result(operation_id, "pending_approval", False, None, None, None)
                return {
                    **pending,
                    "code": "approval_required",
                    "approval_request": approval_request.to_json(),
                }
            status, result, error = await self._effect(conn, tenant, operation_id, kind, request, key)
            await conn.execute(
                "UPDATE outbox.operations SET status = %s, result = %s, error = %s, attempts = attempts + 1,"
                " approval_id = %s, approved_by = %s, updated_at = now() WHERE tenant_id = %s AND operation_id = %s",
                (
                    status,
                    Jsonb(result) if result is not None else None,
                    error,
                    approval.jti if approval else None,
                    approval.approver if approval else None,
                    tenant,
                    operation_id,
                ),
            )
        return _result(operation_id, status, False, result, error, approval.approver if approval else None)

    async def _effect(
        self,
        conn: psycopg.AsyncConnection[Any],
        tenant: str,
        operation_id: str,
        kind: str,
        request: dict[str, Any],
        key: TenantKey | None,
    ) -> tuple[str, dict[str, Any] | None, str | None]:
        if kind == "webhook":
            return await self._post(tenant, operation_id, request)
        if kind == "ticket":
            cursor = await conn.execute(
                "INSERT INTO outbox.tickets (tenant_id, operation_id, title, body) VALUES (%s, %s, %s, %s) RETURNING id",
                (tenant, operation_id, request["title"], request["body"]),
            )
            row = await cursor.fetchone()
            assert row is not None
            return "done", {"ticket_id": int(row[0])}, None
        if kind == "publication":
            assert self.artifacts is not None and key is not None and key.tenant == tenant
            if not await self.artifacts.exists(key, request["artifact"]):
                return "failed", None, "no such artifact for this tenant"
            await conn.execute(
                "INSERT INTO outbox.publications (tenant_id, name, artifact, operation_id) VALUES (%s, %s, %s, %s)"
                " ON CONFLICT (tenant_id, name) DO UPDATE SET artifact = EXCLUDED.artifact,"
                " operation_id = EXCLUDED.operation_id, published_at = now()",
                (tenant, request["name"], request["artifact"], operation_id),
            )
            return (
                "done",
                {"name": request["name"], "artifact": "artifact:sha256:" + request["artifact"]},
                None,
            )
        raise AssertionError(kind)

    async def _post(
        self, tenant: str, operation_id: str, request: dict[str, Any]
    ) -> tuple[str, dict[str, Any] | None, str | None]:
        destination = self._settings.outbox_destinations[request["destination"]]
        body = json.dumps(
            {"operation_id": operation_id, "tenant": tenant, "payload": request["payload"]}, sort_keys=True
        ).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": operation_id}
        if destination.get("secret"):
            headers["X-Fleet-Signature"] = sign(destination["secret"], body)
        try:
            response = await self.http.post(destination["url"], content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise FleetError(
                ErrorCode.TOOL_FAILED,
                f"the destination did not answer ({type(exc).__name__}); the operation is still"
                " pending: call again with the same operation id",
            ) from exc
        if response.status_code >= 500 or response.status_code == 429:
            raise FleetError(
                ErrorCode.TOOL_FAILED,
                f"the destination answered {response.status_code}; the operation is still pending:"
                " call again with the same operation id",
            )
        if response.is_success:
            return "done", {"http_status": response.status_code}, None
        return (
            "failed",
            {"http_status": response.status_code},
            f"the destination refused ({response.status_code})",
        )

    async def status(self, tenant: str, operation_id: str) -> OperationStatus:
        async with self._tenant_tx(tenant) as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                "SELECT kind, status, result, error, attempts FROM outbox.operations"
                " WHERE tenant_id = %s AND operation_id = %s",
                (tenant, operation_id),
            )
            row = await cursor.fetchone()
        if row is None:
            return OperationStatus(
                operation_id=operation_id, status="unknown", kind=None, result=None, error=None, attempts=0
            )
        return OperationStatus(
            operation_id=operation_id,
            status=str(row["status"]),
            kind=str(row["kind"]),
            result=row["result"],
            error=row["error"],
            attempts=int(row["attempts"]),
        )


def _result(
    operation_id: str,
    status: str,
    replayed: bool,
    result: dict[str, Any] | None,
    error: str | None,
    approved_by: str | None,
) -> OperationResult:
    return OperationResult(
        operation_id=operation_id,
        status=status,
        replayed=replayed,
        result=result,
        error=error,
        code=None,
        approval_request=None,
        approved_by=approved_by,
    )


def _text(value: str, name: str, limit: int) -> str:
    if not value.strip() or len(value) > limit:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"{name} must be 1 to {limit} characters")
    return value


def _webhook_summary(destination: str, payload: dict[str, Any]) -> dict[str, Any]:
    """What policy sees of a webhook: where it goes, and the amount it reports if it names one
    (``amount_cents``, an integer), so a rule can ask for approval above an amount."""
    amount = payload.get("amount_cents")
    if isinstance(amount, int) and not isinstance(amount, bool):
        return {"destination": destination, "amount_cents": abs(amount)}  # a credit is an amount too
    return {"destination": destination}


def build_server(
    settings: OutboxSettings, registry: RegistryClient, gate: ToolGate, tools: OutboxTools
) -> MCPServer:
    mcp = fleet_mcp_server(
        "fleet-outbox",
        settings,
        registry,
        "Effects outside the fleet (webhooks, tickets, publications), each at most once per"
        " operation id, with operation_status for reconciliation.",
    )
    keys = TenantKeys(registry)

    grants = ApprovalGrants(registry, settings.service_id)

    async def perform(
        tool: str,
        kind: str,
        arguments: dict[str, Any],
        request: dict[str, Any],
        facts: dict[str, Any],
        grant: str,
    ) -> OperationResult:
        """``arguments``: the call's own, exactly (what a grant is bound to), its grant aside."""
        claims, decision = await gate.authorize(tool, facts)
        approval = await grants.verify(claims, tool, arguments, grant) if grant else None
        # Only a publication looks at the tenant's artifacts: only it asks for the tenant's key.
        key = await keys.for_caller(claims) if kind == "publication" else None
        try:
            return await tools.perform(
                claims.tenant,
                claims.sub,
                _text(str(arguments["operation_id"]), "operation_id", 300),
                kind,
                request,
                needs_approval=bool(decision.result.get("approval_required")),
                approval=approval,
                approval_request=ApprovalRequest(settings.service_id, tool, arguments),
                key=key,
            )
        except psycopg.Error as exc:
            raise db_failure(exc, "the operation was not recorded") from exc

    @mcp.tool(annotations=KEYED_WRITE)
    async def post_webhook(
        operation_id: str, destination: str, payload: dict[str, Any], approval_grant: str = ""
    ) -> OperationResult:
        """POST a JSON payload to a configured destination (by name), at most once per operation id.
        ``approval_grant``: the registry's grant for exactly this call, when policy asks for one."""
        if destination not in settings.outbox_destinations:
            raise FleetError(
                ErrorCode.INVALID_REQUEST,
                f"no destination {destination!r}; known: {sorted(settings.outbox_destinations)}",
            )
        if len(json.dumps(payload)) > MAX_PAYLOAD_BYTES:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"the payload is at most {MAX_PAYLOAD_BYTES} bytes")
        return await perform(
            "post_webhook",
            "webhook",
            {"operation_id": operation_id, "destination": destination, "payload": payload},
            {"destination": destination, "payload": payload},
            _webhook_summary(destination, payload),
            approval_grant,
        )

    @mcp.tool(annotations=KEYED_WRITE)
    async def open_ticket(
        operation_id: str, title: str, body: str, approval_grant: str = ""
    ) -> OperationResult:
        """Open a ticket, at most once per operation id (``approval_grant``: when policy asks for one)."""
        request = {"title": _text(title, "title", 200), "body": _text(body, "body", 20_000)}
        arguments = {"operation_id": operation_id, "title": title, "body": body}
        return await perform("open_ticket", "ticket", arguments, request, {}, approval_grant)

    @mcp.tool(annotations=KEYED_WRITE)
    async def publish_artifact(
        operation_id: str, artifact: str, name: str, approval_grant: str = ""
    ) -> OperationResult:
        """Publish an artifact of your tenant (artifact:sha256:...) under a name, once per operation id.
        Under a score threshold (``approval_over_score``) every publication needs an
        ``approval_grant``: a person's, or policy's on the score the fleet computed for the report
        (this server cannot know it, and takes no caller's word for it)."""
        digest = parse_ref(artifact)
        request = {"artifact": digest, "name": _text(name, "name", 200)}
        arguments = {"operation_id": operation_id, "artifact": artifact, "name": name}
        return await perform("publish_artifact", "publication", arguments, request, {}, approval_grant)

    @mcp.tool(annotations=READ_ONLY)
    async def operation_status(operation_id: str) -> OperationStatus:
        """What an operation id did: unknown, pending, pending_approval, done or failed, with its result."""
        claims, _ = await gate.authorize("operation_status", {})
        return await tools.status(claims.tenant, _text(operation_id, "operation_id", 300))

    return mcp


async def _prepare(admin: psycopg.AsyncConnection[Any]) -> None:
    async with admin.transaction():
        await admin.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.mcp_outbox.schema'))")
        await admin.execute(SCHEMA_SQL)
        for table in _TABLES:
            await admin.execute(f"ALTER TABLE outbox.{table} ENABLE ROW LEVEL SECURITY")
            await admin.execute(f"ALTER TABLE outbox.{table} FORCE ROW LEVEL SECURITY")
            exists = await (
                await admin.execute(
                    "SELECT 1 FROM pg_policies WHERE schemaname = 'outbox' AND tablename = %s"
                    " AND policyname = 'tenant_isolation'",
                    (table,),
                )
            ).fetchone()
            if exists is None:
                await admin.execute(
                    f"CREATE POLICY tenant_isolation ON outbox.{table}"
                    f" USING (tenant_id = current_setting('{TENANT_SETTING}', true))"
                    f" WITH CHECK (tenant_id = current_setting('{TENANT_SETTING}', true))"
                )
        await admin.execute(f"GRANT USAGE ON SCHEMA outbox TO {WRITER_ROLE}")
        await admin.execute(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA outbox TO {WRITER_ROLE}")
        await admin.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO {WRITER_ROLE}")
        # A used grant stays used: the writer may only add to the record.
        await admin.execute(f"REVOKE UPDATE, DELETE ON outbox.approval_grants FROM {WRITER_ROLE}")


def build_app_for(settings: OutboxSettings) -> Starlette:
    holder: dict[str, OutboxTools] = {}

    def make(registry: RegistryClient, gate: ToolGate, pool: AsyncConnectionPool[Any]) -> MCPServer:
        holder["tools"] = OutboxTools(pool, settings)
        return build_server(settings, registry, gate, holder["tools"])

    @contextlib.asynccontextmanager
    async def artifacts() -> AsyncIterator[None]:
        tools = holder["tools"]
        client: NATS = await connect(
            settings.nats_url,
            settings.service_id,
            replicas=settings.nats_replicas,
            credentials=service_credentials(settings),
        )
        try:
            tools.artifacts = await NatsArtifactStore.open(client)
            yield
        finally:
            await tools.http.aclose()
            await client.close()

    return database_tool_app(
        settings, role=WRITER_ROLE, tools=TOOLS, prepare=_prepare, make_server=make, more=artifacts
    )


async def main(settings: ServiceSettings) -> None:
    outbox_settings = OutboxSettings.from_env(settings.service_id)
    configure_logging(outbox_settings.service_id, outbox_settings.log_level)
    await serve_mcp(build_app_for(outbox_settings), outbox_settings)
