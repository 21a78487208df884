"""The gate every MCP tool call passes (``mcp_servers._base.ToolGate``), with the fleet's own bundle
in the real Rego engine and the audit trail on a real NATS: the decision, the agent's rate limit
from policy, and one audit event per call whatever the outcome."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from typing import Any

from fleet.natsconn import connect
from fleetctl.testing.mcp import calling_as as as_caller
from fleetctl.testing.mcp import claims_for
from mcp_servers._base import AuditTrail, RateLimits, RunCalls, ToolGate, read_audit
from policy import Bundle, RegorusEngine
from tests.raising import raises_code


def engine_with_rates(agents: dict[str, Any], **more: Any) -> RegorusEngine:
    """The fleet's bundle, with ``agents``' own rates (and ``more`` of its config) in its data, as a
    policy author would set them."""
    bundle = Bundle.load()
    config = {
        **bundle.data["config"],
        "tool_rates": {**bundle.data["config"]["tool_rates"], "agents": agents},
        **more,
    }
    return RegorusEngine(dataclasses.replace(bundle, data={**bundle.data, "config": config}))


def calling_as(
    sub: str, tenant: str, scopes: set[str], act: str | None = None, run_id: str | None = "run-7"
) -> contextlib.AbstractContextManager[None]:
    """A request to mcp-sql whose token verified as these claims (``act``: the agent that passed the
    caller's token on, RFC 8693)."""
    return as_caller(claims_for(sub, tenant, scopes, audience="mcp-sql", run_id=run_id, act=act))


async def test_every_call_is_audited_on_nats_with_its_outcome(nats_url: str) -> None:
    trail = f"mcp-sql-{uuid.uuid4().hex[:6]}"  # this test's own subject on the session's broker
    gate = ToolGate(engine_with_rates({}), "mcp-sql", AuditTrail(trail))
    assert gate.trail is not None
    client = await connect(nats_url, trail)
    try:
        async with gate.trail.publishing(client):
            with calling_as("sql-analyst", "acme", {"sql:query"}):
                claims = await gate.allow("query", {"sql_length": 40})
                with raises_code("policy_denied", r"the token lacks scope sql:write"):
                    await gate.allow("execute", {"sql_length": 40})
            with calling_as("sql-analyst", "globex", set()), raises_code("policy_denied"):
                await gate.allow("query", {"sql_length": 10})
    finally:
        await client.close()
    assert claims.tenant == "acme"
    reader = await connect(nats_url, "audit-reader")
    try:
        events = await read_audit(reader, trail)
    finally:
        await reader.close()
    assert [(e["tool"], e["tenant"], e["outcome"]) for e in events] == [
        ("query", "acme", "allowed"),
        ("execute", "acme", "denied"),
        ("query", "globex", "denied"),
    ]
    first = events[0]
    assert first["server"] == "mcp-sql" and first["subject"] == "sql-analyst" and first["run_id"] == "run-7"
    assert first["arguments"] == {"sql_length": 40} and first["revision"] == gate.engine.revision
    assert len({e["decision_id"] for e in events}) == 3  # a decision each, remembered or not
    assert events[1]["reasons"] == ["the token lacks scope sql:write"]


async def test_an_agent_over_its_rate_is_refused_and_others_are_not(nats_url: str) -> None:
    now = [1000.0]
    gate = ToolGate(
        engine_with_rates({"sql-analyst": {"per_minute": 60, "burst": 2}}),
        "mcp-sql",
        AuditTrail("mcp-sql-rates"),
        RateLimits(clock=lambda: now[0]),
    )
    assert gate.trail is not None
    with calling_as("sql-analyst", "acme", {"sql:query"}):
        await gate.allow("query", {"sql_length": 1})
        await gate.allow("query", {"sql_length": 1})
        with raises_code("rate_limited", r"sql-analyst calls mcp-sql/query .* retry in 1.0 s"):
            await gate.allow("query", {"sql_length": 1})
    with calling_as("sql-analyst", "globex", {"sql:query"}):
        await gate.allow("query", {"sql_length": 1})  # its own bucket in another tenant
    with (
        calling_as("operator", "acme", {"sql:query"}, act="sql-analyst"),
        raises_code("rate_limited") as refused,
    ):
        await gate.allow("query", {"sql_length": 1})  # the agent is held to its rate whoever it acts for
    assert refused.value.retryable and refused.value.retry_after_s == 1
    with calling_as("reporter", "acme", {"sql:query"}):
        for _ in range(20):
            await gate.allow("query", {"sql_length": 1})  # the fleet's default rate for everyone else
    now[0] += 1.0  # a second refills one call at 60 a minute
    with calling_as("sql-analyst", "acme", {"sql:query"}):
        await gate.allow("query", {"sql_length": 1})
        with raises_code("rate_limited"):
            await gate.allow("query", {"sql_length": 1})
    assert gate.trail.pending == 27  # every call, refused or not, is an event


async def test_a_call_is_refused_when_its_audit_event_cannot_be_kept() -> None:
    gate = ToolGate(engine_with_rates({}), "mcp-sql", AuditTrail("mcp-sql", max_pending=2))
    with calling_as("sql-analyst", "acme", {"sql:query"}):
        await gate.allow("query", {"sql_length": 1})
        await gate.allow("query", {"sql_length": 1})  # the broker is away: nothing is being published
        with raises_code("dependency_unavailable", r"the audit trail cannot keep up"):
            await gate.allow("query", {"sql_length": 1})


async def test_a_run_is_held_to_its_tool_calls_across_servers(nats_url: str) -> None:
    limits = {"run_call_limits": {"default": None, "tenants": {"acme": 3}}}
    engine = engine_with_rates({}, **limits)
    sql_broker, sandbox_broker = await connect(nats_url, "mcp-sql"), await connect(nats_url, "mcp-sandbox")
    try:
        counters = RunCalls(), RunCalls()  # each server's own, on its own connection
        await counters[0].open(sql_broker)
        await counters[1].open(sandbox_broker)
        sql = ToolGate(engine, "mcp-sql", run_calls=counters[0])
        sandbox = ToolGate(engine, "mcp-sandbox", run_calls=counters[1])
        run = f"run-{uuid.uuid4().hex[:8]}"
        scopes = {"sql:query", "sandbox:list"}
        with calling_as("analyst", "acme", scopes, run_id=run):
            await asyncio.gather(sql.allow("query", {"sql_length": 1}), sandbox.allow("workspace_files", {}))
            await sql.allow("query", {"sql_length": 1})  # the run's third call, each counted once
            with raises_code("policy_denied", rf"run {run} has made the 3 tool calls"):
                await sandbox.allow("workspace_files", {})
        with calling_as("analyst", "acme", scopes, run_id=f"{run}-other"):
            await sandbox.allow("workspace_files", {})  # another run has its own count
        with calling_as("analyst", "acme", scopes, run_id=None):
            for _ in range(5):
                await sql.allow("query", {"sql_length": 1})  # outside any run: no run budget
        with calling_as("analyst", "globex", scopes, run_id=run):
            for _ in range(5):
                await sql.allow("query", {"sql_length": 1})  # globex has no cap, and its own run ids
    finally:
        await sql_broker.close()
        await sandbox_broker.close()
