"""The cases MCP server: tools with external effects, for the review desk.

- ``open_case`` opens a review case. It takes an idempotency key: the same key opens at most one case
  (per tenant), and a repeat returns that case. ``case_status`` answers, by key, whether the case was
  opened: a caller that lost an answer can ask instead of trying again.
- ``issue_refund`` refunds an amount, at most once per idempotency key. Policy (``fleet.tools``) says
  which refunds need an approval, given the amount and the running totals this server keeps itself:
  what was refunded with no person's approval in the caller's run and in the tenant's last 24 hours
  (counted from ``tenant_data.refunds`` under a per-tenant lock, in the transaction that adds the
  refund, so no caller can reset them and concurrent refunds cannot both slip under a limit).
  Without an approval the tool does nothing and answers ``{"status": "pending_approval",
  "approval_request": {...}}``, and the run that called it pauses at a gate until a person answers;
  the approved call carries the registry's approval grant for exactly that call
  (:mod:`fleet.approvals`), which is used up with the refund, and whose approver is recorded.
- ``post_note`` posts a note to a channel. It has neither a key nor a status query, like many real
  notification APIs: if a call times out, nobody can tell whether the note went out.

Every row is the tenant's (row-level security forced on the tables, tenant from the verified token),
and every row is an effect that tests count.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypedDict

import psycopg
from mcp.server.mcpserver import MCPServer
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from starlette.applications import Starlette

from fleet.approvals import ApprovalRequest
from fleet.errors import ErrorCode, FleetError
from fleet.pgpool import db_failure
from fleet.service import configure_logging
from fleet.settings import ServiceSettings
from mcp_servers._base import (
    KEYED_WRITE,
    READ_ONLY,
    Approval,
    ApprovalGrants,
    ToolGate,
    approval_grants_sql,
    current_claims,
    fleet_mcp_server,
    serve_mcp,
    use_grant,
)
from mcp_servers._pg import database_tool_app
from registry import RegistryClient

log = logging.getLogger(__name__)

# each tool, with the scopes a token needs to call it
TOOLS = {
    name: ["cases:write"] for name in ("open_case", "open_cases", "case_status", "post_note", "issue_refund")
}
MAX_BULK = 500
WRITER_ROLE = "fleet_cases_writer"
TENANT_SETTING = "fleet.tenant"

SCHEMA_SQL = f"""
CREATE SCHEMA IF NOT EXISTS tenant_data;
CREATE TABLE IF NOT EXISTS tenant_data.cases (
    id              bigserial PRIMARY KEY,
    tenant_id       text NOT NULL,
    idempotency_key text NOT NULL,
    subject         text NOT NULL,
    reason          text NOT NULL,
    opened_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, idempotency_key)
);
CREATE TABLE IF NOT EXISTS tenant_data.notes (
    id        bigserial PRIMARY KEY,
    tenant_id text NOT NULL,
    channel   text NOT NULL,
    body      text NOT NULL,
    posted_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE tenant_data.cases ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenant_data.cases FORCE ROW LEVEL SECURITY;
ALTER TABLE tenant_data.notes ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenant_data.notes FORCE ROW LEVEL SECURITY;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{WRITER_ROLE}') THEN
        CREATE ROLE {WRITER_ROLE} NOLOGIN NOSUPERUSER NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_policies WHERE schemaname = 'tenant_data'
                   AND tablename = 'cases' AND policyname = 'tenant_isolation') THEN
        CREATE POLICY tenant_isolation ON tenant_data.cases
            USING (tenant_id = current_setting('{TENANT_SETTING}', true))
            WITH CHECK (tenant_id = current_setting('{TENANT_SETTING}', true));
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_policies WHERE schemaname = 'tenant_data'
                   AND tablename = 'notes' AND policyname = 'tenant_isolation') THEN
        CREATE POLICY tenant_isolation ON tenant_data.notes
            USING (tenant_id = current_setting('{TENANT_SETTING}', true))
            WITH CHECK (tenant_id = current_setting('{TENANT_SETTING}', true));
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS tenant_data.refunds (
    id              bigserial PRIMARY KEY,
    tenant_id       text NOT NULL,
    idempotency_key text NOT NULL,
    subject         text NOT NULL,
    amount_cents    bigint NOT NULL,
    approval_id     text,
    approved_by     text,
    attempts        integer NOT NULL DEFAULT 1,
    refunded_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, idempotency_key)
);
ALTER TABLE tenant_data.refunds ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenant_data.refunds FORCE ROW LEVEL SECURITY;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_policies WHERE schemaname = 'tenant_data'
                   AND tablename = 'refunds' AND policyname = 'tenant_isolation') THEN
        CREATE POLICY tenant_isolation ON tenant_data.refunds
            USING (tenant_id = current_setting('{TENANT_SETTING}', true))
            WITH CHECK (tenant_id = current_setting('{TENANT_SETTING}', true));
    END IF;
END $$;
ALTER TABLE tenant_data.refunds ADD COLUMN IF NOT EXISTS run_id text;
ALTER TABLE tenant_data.refunds ADD COLUMN IF NOT EXISTS approved_as text;
CREATE INDEX IF NOT EXISTS refunds_by_run ON tenant_data.refunds (tenant_id, run_id);
CREATE INDEX IF NOT EXISTS refunds_by_time ON tenant_data.refunds (tenant_id, refunded_at);
{approval_grants_sql("tenant_data")}
GRANT SELECT, INSERT ON tenant_data.approval_grants TO {WRITER_ROLE};
GRANT SELECT, INSERT ON tenant_data.refunds TO {WRITER_ROLE};
GRANT UPDATE (attempts) ON tenant_data.refunds TO {WRITER_ROLE};
GRANT USAGE ON SEQUENCE tenant_data.refunds_id_seq TO {WRITER_ROLE};
GRANT USAGE ON SCHEMA tenant_data TO {WRITER_ROLE};
ALTER TABLE tenant_data.cases ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 1;
GRANT SELECT, INSERT ON tenant_data.cases, tenant_data.notes TO {WRITER_ROLE};
GRANT UPDATE (attempts) ON tenant_data.cases TO {WRITER_ROLE};
GRANT USAGE ON SEQUENCE tenant_data.cases_id_seq, tenant_data.notes_id_seq TO {WRITER_ROLE};
"""


class CasesSettings(ServiceSettings):
    statement_timeout_ms: int = 30_000


class CaseResult(TypedDict):
    case_id: int
    created: bool


class BulkCase(BaseModel):
    subject: str
    case_id: int
    created: bool


class BulkResult(BaseModel):  # a model, not a TypedDict: it nests (pydantic needs that on 3.11)
    cases: list[BulkCase]


class CaseStatus(TypedDict):
    status: str  # "opened" or "unknown"
    case_id: int | None


class NoteResult(TypedDict):
    note_id: int


class RefundResult(TypedDict):
    status: str  # "refunded" or "pending_approval"
    refund_id: int | None
    created: bool  # false for a repeat of a refund already made under the key
    why: str
    code: str | None  # approval_required with pending_approval
    approval_request: dict[str, Any] | None  # with pending_approval: what to approve (fleet.approvals)
    approved_by: str | None  # who approved the refund (from its grant)


class RefundTotals(TypedDict):
    """What was refunded with no person's approval: in the caller's run, and in the tenant's last
    24 hours (before this refund). Policy compares them with its cumulative limits."""

    run_unattended_cents: int
    run_unattended_refunds: int
    tenant_unattended_cents_24h: int
    tenant_unattended_refunds_24h: int


# The refunds no person approved: none, or policy's.
_UNATTENDED = "(approved_as IS NULL OR approved_as = 'policy')"
Decide = Callable[[RefundTotals], Awaitable[tuple[bool, str]]]


class CaseTools:
    def __init__(self, pool: AsyncConnectionPool[Any], settings: CasesSettings) -> None:
        self._pool = pool
        self._settings = settings

    @contextlib.asynccontextmanager
    async def _tenant_tx(self, tenant: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, true), set_config(%s, %s, true)",
                (str(self._settings.statement_timeout_ms), TENANT_SETTING, tenant),
            )
            yield conn

    async def open_case(self, tenant: str, key: str, subject: str, reason: str) -> CaseResult:
        try:
            async with self._tenant_tx(tenant) as conn:
                cursor = await conn.execute(
                    "INSERT INTO tenant_data.cases (tenant_id, idempotency_key, subject, reason)"
                    " VALUES (%s, %s, %s, %s) ON CONFLICT (tenant_id, idempotency_key) DO NOTHING"
                    " RETURNING id",
                    (tenant, key, subject, reason),
                )
                row = await cursor.fetchone()
                if row is not None:
                    return CaseResult(case_id=int(row[0]), created=True)
                cursor = await conn.execute(
                    "SELECT id FROM tenant_data.cases WHERE tenant_id = %s AND idempotency_key = %s",
                    (tenant, key),
                )
                existing = await cursor.fetchone()
        except psycopg.Error as exc:
            raise db_failure(exc, "could not open the case") from exc
        assert existing is not None
        return CaseResult(case_id=int(existing[0]), created=False)

    async def open_cases(self, tenant: str, cases: list[tuple[str, str, str]]) -> BulkResult:
        """Open many cases in one statement; a key seen before returns its case and counts the
        repeat (``attempts``), so tests can tell work that was redone from effects that repeated."""
        try:
            async with self._tenant_tx(tenant) as conn:
                cursor = await conn.execute(
                    "INSERT INTO tenant_data.cases (tenant_id, idempotency_key, subject, reason)"
                    " SELECT %s, key, subject, reason FROM unnest(%s::text[], %s::text[], %s::text[])"
                    " AS given(key, subject, reason)"
                    " ON CONFLICT (tenant_id, idempotency_key)"
                    " DO UPDATE SET attempts = tenant_data.cases.attempts + 1"
                    " RETURNING idempotency_key, id, xmax = 0",
                    (tenant, [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]),
                )
                rows = {
                    key: (int(case_id), bool(created)) for key, case_id, created in await cursor.fetchall()
                }
        except psycopg.Error as exc:
            raise db_failure(exc, "could not open the cases") from exc
        return BulkResult(
            cases=[
                BulkCase(subject=subject, case_id=rows[key][0], created=rows[key][1])
                for key, subject, _ in cases
            ]
        )

    async def refund(
        self,
        tenant: str,
        run_id: str,
        key: str,
        subject: str,
        amount_cents: int,
        approval: Approval | None,
        decide: Decide,
    ) -> RefundResult:
        """Refund once per key; a repeat returns the refund and counts the attempt. ``decide``:
        policy's answer for the running totals (whether an approval is needed, and the decision
        id), asked under the tenant's refund lock, in the transaction that adds the refund."""
        try:
            async with self._tenant_tx(tenant) as conn:
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"fleet.refunds/{tenant}",))
                if approval is not None:
                    await use_grant(conn, "tenant_data", tenant, "issue_refund", approval)
                needs_approval, decision_id = await decide(await self._totals(conn, tenant, run_id))
                cursor = await conn.execute(
                    "UPDATE tenant_data.refunds SET attempts = attempts + 1"
                    " WHERE tenant_id = %s AND idempotency_key = %s RETURNING id, approved_by",
                    (tenant, key),
                )
                repeat = await cursor.fetchone()
                if repeat is not None:
                    return _refund("refunded", int(repeat[0]), False, "", repeat[1])
                if needs_approval and approval is None:
                    why = f"a refund of {amount_cents / 100:.2f} to {subject} needs approval (decision {decision_id})"
                    return {
                        **_refund("pending_approval", None, False, why, None),
                        "code": "approval_required",
                    }
                cursor = await conn.execute(
                    "INSERT INTO tenant_data.refunds (tenant_id, idempotency_key, subject, amount_cents, run_id,"
                    " approval_id, approved_by, approved_as) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
                    (
                        tenant,
                        key,
                        subject,
                        amount_cents,
                        run_id or None,
                        approval.jti if approval else None,
                        approval.approver if approval else None,
                        approval.by if approval else None,
                    ),
                )
                row = await cursor.fetchone()
        except psycopg.Error as exc:
            raise db_failure(exc, "could not refund") from exc
        assert row is not None
        return _refund("refunded", int(row[0]), True, "", approval.approver if approval else None)

    async def _totals(self, conn: psycopg.AsyncConnection[Any], tenant: str, run_id: str) -> RefundTotals:
        cursor = await conn.execute(
            "SELECT coalesce(sum(amount_cents) FILTER (WHERE run_id = %s), 0),"
            " count(*) FILTER (WHERE run_id = %s),"
            " coalesce(sum(amount_cents) FILTER (WHERE refunded_at > now() - interval '24 hours'), 0),"
            " count(*) FILTER (WHERE refunded_at > now() - interval '24 hours')"
            f" FROM tenant_data.refunds WHERE tenant_id = %s AND {_UNATTENDED}",
            (run_id or None, run_id or None, tenant),
        )
        row = await cursor.fetchone()
        assert row is not None
        return RefundTotals(
            run_unattended_cents=int(row[0]),
            run_unattended_refunds=int(row[1]),
            tenant_unattended_cents_24h=int(row[2]),
            tenant_unattended_refunds_24h=int(row[3]),
        )

    async def case_status(self, tenant: str, key: str) -> CaseStatus:
        async with self._tenant_tx(tenant) as conn:
            cursor = await conn.execute(
                "SELECT id FROM tenant_data.cases WHERE tenant_id = %s AND idempotency_key = %s",
                (tenant, key),
            )
            row = await cursor.fetchone()
        return CaseStatus(status="opened" if row else "unknown", case_id=int(row[0]) if row else None)

    async def post_note(self, tenant: str, channel: str, body: str) -> NoteResult:
        try:
            async with self._tenant_tx(tenant) as conn:
                cursor = await conn.execute(
                    "INSERT INTO tenant_data.notes (tenant_id, channel, body) VALUES (%s, %s, %s) RETURNING id",
                    (tenant, channel, body),
                )
                row = await cursor.fetchone()
        except psycopg.Error as exc:
            raise db_failure(exc, "could not post the note") from exc
        assert row is not None
        return NoteResult(note_id=int(row[0]))


def _refund(
    status: str, refund_id: int | None, created: bool, why: str, approved_by: str | None
) -> RefundResult:
    return RefundResult(
        status=status,
        refund_id=refund_id,
        created=created,
        why=why,
        code=None,
        approval_request=None,
        approved_by=approved_by,
    )


def _text(value: str, name: str, limit: int) -> str:
    if not value.strip() or len(value) > limit:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"{name} must be 1 to {limit} characters")
    return value


def build_server(
    settings: CasesSettings, registry: RegistryClient, gate: ToolGate, tools: CaseTools
) -> MCPServer:
    mcp = fleet_mcp_server(
        "fleet-cases",
        settings,
        registry,
        "Review cases and notes for the caller's tenant.",
    )

    @mcp.tool(annotations=KEYED_WRITE)
    async def open_case(subject: str, reason: str, idempotency_key: str) -> CaseResult:
        """Open a review case (at most one per idempotency key; a repeat returns the same case)."""
        claims = await gate.allow("open_case", {})
        key = _text(idempotency_key, "idempotency_key", 300)
        return await tools.open_case(
            claims.tenant, key, _text(subject, "subject", 200), _text(reason, "reason", 2000)
        )

    @mcp.tool(annotations=KEYED_WRITE)
    async def open_cases(cases: list[dict[str, str]]) -> BulkResult:
        """Open many review cases at once: items {subject, reason, idempotency_key}; at most one
        case per key, a repeat returns the same case."""
        claims = await gate.allow("open_cases", {"count": len(cases)})
        if not 0 < len(cases) <= MAX_BULK:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"send 1 to {MAX_BULK} cases")
        keys = [_text(str(c.get("idempotency_key", "")), "idempotency_key", 300) for c in cases]
        if len(set(keys)) != len(keys):
            raise FleetError(ErrorCode.INVALID_REQUEST, "idempotency keys must differ within one call")
        given = [
            (
                key,
                _text(str(c.get("subject", "")), "subject", 200),
                _text(str(c.get("reason", "")), "reason", 2000),
            )
            for key, c in zip(keys, cases, strict=True)
        ]
        return await tools.open_cases(claims.tenant, given)

    @mcp.tool(annotations=READ_ONLY)
    async def case_status(idempotency_key: str) -> CaseStatus:
        """Whether a case was opened under this idempotency key (and its id)."""
        claims = await gate.allow("case_status", {})
        return await tools.case_status(claims.tenant, _text(idempotency_key, "idempotency_key", 300))

    @mcp.tool()
    async def post_note(channel: str, body: str) -> NoteResult:
        """Post a note to a channel. Not idempotent, and there is no way to ask afterwards."""
        claims = await gate.allow("post_note", {})
        return await tools.post_note(claims.tenant, _text(channel, "channel", 100), _text(body, "body", 4000))

    grants = ApprovalGrants(registry, settings.service_id)

    @mcp.tool(annotations=KEYED_WRITE)
    async def issue_refund(
        subject: str, amount_cents: int, idempotency_key: str, approval_grant: str = ""
    ) -> RefundResult:
        """Refund an amount (in cents) to a subject, at most once per idempotency key. A refund
        that policy says needs approval (by its amount, or by what the run and the tenant have
        refunded with no person's approval) is made only with ``approval_grant``, the registry's
        grant for exactly this call; without, nothing happens and the answer is
        {"status": "pending_approval", "why": ..., "approval_request": ...}."""
        if not 0 < amount_cents <= 10**9:
            raise FleetError(ErrorCode.INVALID_REQUEST, "amount_cents must be 1 to 1000000000")
        arguments = {"subject": subject, "amount_cents": amount_cents, "idempotency_key": idempotency_key}
        key, name = _text(idempotency_key, "idempotency_key", 300), _text(subject, "subject", 200)
        claims = current_claims()
        approval = (
            await grants.verify(claims, "issue_refund", arguments, approval_grant) if approval_grant else None
        )

        async def decide(totals: RefundTotals) -> tuple[bool, str]:
            _, decision = await gate.authorize("issue_refund", {"amount_cents": amount_cents, **totals})
            return bool(decision.result.get("approval_required")), decision.decision_id

        refunded = await tools.refund(claims.tenant, claims.run_id, key, name, amount_cents, approval, decide)
        if refunded["status"] == "pending_approval":
            request = ApprovalRequest(settings.service_id, "issue_refund", arguments)
            return {**refunded, "approval_request": request.to_json()}
        return refunded

    return mcp


async def _prepare(admin: psycopg.AsyncConnection[Any]) -> None:
    async with admin.transaction():
        await admin.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.mcp_sql.schema'))")
        await admin.execute(SCHEMA_SQL)


def build_app_for(settings: CasesSettings) -> Starlette:
    return database_tool_app(
        settings,
        role=WRITER_ROLE,
        tools=TOOLS,
        prepare=_prepare,
        make_server=lambda registry, gate, pool: build_server(
            settings, registry, gate, CaseTools(pool, settings)
        ),
    )


async def main(settings: ServiceSettings) -> None:
    cases_settings = CasesSettings.from_env(settings.service_id)
    configure_logging(cases_settings.service_id, cases_settings.log_level)
    await serve_mcp(build_app_for(cases_settings), cases_settings)
