"""The tool plane's costs, each beside its baseline in the same run.

- Gate: a tool call over Streamable HTTP to an MCP server that verifies the token and asks policy
  (the fleet's own verifier and Rego bundle, the same code the servers run), against the same server
  and tool with neither. Target: <= 1.15x at p50 and p99.
- Sandbox start: a call running ``pass`` in a fresh sandbox (bubblewrap, launcher, limits, workspace
  hand-back) as the caller waits for it, its slot's sandbox started ahead and ready (the steady state
  at a rate the slot keeps up with), against starting the same interpreter on ``pass`` without it.
  Target: <= 20 ms more at p50. Also reported: the cold start (no sandbox started ahead) and how long
  a slot takes after a call until its next sandbox is ready (the rate it keeps up with).
- SQL at a million rows: the SQL tool's query for one tenant (its login role, row-level security, the
  read-only cursor) on a 1,000,000-row table of 100 tenants, against the same statement with an
  explicit tenant filter as the table's owner (no row-level security) on a plain connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import psycopg
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from pydantic import AnyHttpUrl

from bench._mcp import serving
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.tokens import TokenVerifier, any_public_key
from fleetctl.testing.nats import embedded_nats
from fleetctl.testing.postgres import embedded_postgres
from mcp_servers._base import AUDIT_STREAM, READ_ONLY, AuditTrail, FleetTokenVerifier, ToolGate
from mcp_servers.sandbox.confinement import Confinement
from mcp_servers.sandbox.runner import Limits, Sandbox, find_bwrap, find_python, prepare_runtime
from mcp_servers.sql._schema import OWNER_SETTING, ensure_schema
from mcp_servers.sql.server import SqlServerSettings, SqlTools, TenantPools
from policy import Bundle, RegorusEngine
from policy.live import LivePolicy

GATE_TARGET_RATIO = 1.15
SANDBOX_TARGET_MS = 20.0
ROWS, TENANTS = 1_000_000, 100


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples) * 1000, 3),
        "p99_ms": round(_pct(samples, 0.99) * 1000, 3),
        "n": len(samples),
    }


# -- the gate ---------------------------------------------------------------------------------------


STATEMENTS = [f"SELECT * FROM tenant_data.invoices WHERE id = {n}" + " " * (n % 40) for n in range(40)]


def _server(gate: ToolGate | None, key: SigningKey, *, distinct: bool = False) -> MCPServer:
    """The bench's MCP server; with ``gate``, as every fleet server: the token verified, then the
    gate (policy decision, rate limit, audit event on NATS). ``distinct``: each call's argument
    summary differs, so no decision is ever remembered (the engine evaluates every one)."""
    if gate is not None:
        public = any_public_key(key.public_jwk())

        async def lookup(kid: str) -> Any:
            return public

        verifier = TokenVerifier(lookup, issuer="fleet-registry", audience="mcp-bench")
        mcp = MCPServer(
            "bench",
            token_verifier=FleetTokenVerifier(verifier),
            auth=AuthSettings(
                issuer_url=AnyHttpUrl("http://127.0.0.1:1"),
                resource_server_url=None,
                validate_token_resource=False,
            ),
        )
    else:
        mcp = MCPServer("bench")
    calls = iter(range(10**9))

    @mcp.tool(annotations=READ_ONLY)
    async def query(sql: str) -> dict[str, Any]:
        """Answers a fixed record: the measurement is the gate, not the work. Its summary for policy
        is the SQL tool's (the statement's length)."""
        if gate is not None:
            summary: dict[str, Any] = {"sql_length": len(sql)}
            if distinct:
                summary["call"] = next(calls)
            await gate.allow("query", summary)
        return {"rows": [[1, "paid"]], "truncated": False}

    return mcp


async def _calls(url: str, token: str | None, n: int) -> list[float]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    samples = []
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        for i in range(n):
            started = time.perf_counter()
            result = await client.call_tool("query", {"sql": STATEMENTS[i % len(STATEMENTS)]})
            samples.append(time.perf_counter() - started)
            assert not result.is_error, result.content
    return samples


async def gate(nats_url: str, rounds: int = 20, per_round: int = 100) -> dict[str, Any]:
    key = SigningKey.generate()
    now = int(time.time())
    token = key.sign(
        {
            "iss": "fleet-registry",
            "sub": "sql-analyst",
            "aud": "mcp-bench",
            "tenant": "acme",
            "scope": "sql:query",
            "iat": now,
            "exp": now + 3600,
            "jti": uuid.uuid4().hex,
        }
    )
    broker = await connect(nats_url, "bench-audit")
    # The fleet's bundle as the servers load it, with the bench agent's rate set above what the bench
    # sends (the default would stop it: the limiter still runs for every call).
    bundle = Bundle.load()
    data = {**bundle.data, "config": {**bundle.data["config"], "tool_rates": {
        "default": {"per_minute": 6000, "burst": 600},
        "agents": {"sql-analyst": {"per_minute": 6_000_000, "burst": 100_000}},
    }}}  # fmt: skip
    pushed = dataclasses.replace(bundle, data=data)

    async def embedded(b: Bundle) -> RegorusEngine:
        return RegorusEngine(b)

    # As a server runs it: the live policy (decision log records on NATS too) behind the gate.
    policies = {
        name: LivePolicy(f"bench-{name}", embedded, RegorusEngine(pushed)) for name in ("gated", "uncached")
    }
    gates = {name: ToolGate(policies[name], "mcp-sql", AuditTrail(f"bench-{name}")) for name in policies}
    samples: dict[str, list[float]] = {"gated": [], "uncached": [], "bare": []}
    try:
        async with (
            gates["gated"].trail.publishing(broker),  # type: ignore[union-attr]
            gates["uncached"].trail.publishing(broker),  # type: ignore[union-attr]
            policies["gated"].decisions.publishing(broker),
            policies["uncached"].decisions.publishing(broker),
            serving(_server(gates["gated"], key)) as gated_url,
            serving(_server(gates["uncached"], key, distinct=True)) as uncached_url,
            serving(_server(None, key)) as bare_url,
        ):
            urls = {"gated": (gated_url, token), "uncached": (uncached_url, token), "bare": (bare_url, None)}
            for url, bearer in urls.values():  # warm all three
                await _calls(url, bearer, 50)
            for _ in range(rounds):  # interleaved, so drift of the machine hits all alike
                for name, (url, bearer) in urls.items():
                    samples[name] += await _calls(url, bearer, per_round)
        stored = (await broker.jetstream().stream_info(AUDIT_STREAM)).state.messages
    finally:
        await broker.close()
    g, u, b = _summary(samples["gated"]), _summary(samples["uncached"]), _summary(samples["bare"])
    return {
        "gate_fleet": g,
        "gate_uncached": u,
        "gate_baseline": b,
        "gate_ratio_p50": round(g["p50_ms"] / b["p50_ms"], 3),
        "gate_ratio_p99": round(g["p99_ms"] / b["p99_ms"], 3),
        "gate_uncached_ratio_p50": round(u["p50_ms"] / b["p50_ms"], 3),
        "gate_uncached_ratio_p99": round(u["p99_ms"] / b["p99_ms"], 3),
        "gate_audit_messages": stored,
        "gate_target_ratio": GATE_TARGET_RATIO,
    }


# -- the sandbox ------------------------------------------------------------------------------------


async def sandbox_start(n: int = 40) -> dict[str, Any]:
    """``sandbox_fleet``: the latency of ``Sandbox.run("pass")`` as its caller sees it, with the pool
    at steady state: one slot whose next sandbox (bubblewrap and the launcher, started ahead, used for
    this one call and then discarded) is ready when the call comes, so calls are spaced by at least
    ``sandbox_refill`` (the time from a call's return until the slot's next sandbox waits for its
    job; a slot keeps up with about 1000 / that many calls a second, faster calls wait for the start
    under way, at worst the cold start). ``sandbox_cold``: the same call on a sandbox with nothing
    started ahead (bubblewrap, the interpreter and the launcher all start in the call), the latency
    of a first call or of one beyond the pool. ``sandbox_baseline``: ``python -I -B -c pass``, the
    same interpreter, no sandbox. ``sandbox_unconfined`` and ``sandbox_unconfined_cold``: the first
    two without the confinement layers (seccomp, --disable-userns, the per-call cgroup), so
    ``sandbox_layers_ms_p50`` is what the layers cost a call. All interleave, each measured while
    nothing else runs."""
    python = find_python()
    bwrap, launcher = prepare_runtime(
        Path("/tmp") / f"fleet-bench-sandbox-{uuid.uuid4().hex[:8]}", find_bwrap(), python
    )
    warm = Sandbox(bwrap, launcher, python, uid_base=63100, slots=1)
    cold = Sandbox(bwrap, launcher, python, uid_base=63101, slots=1, prestart=False)
    bare = Confinement.none()
    bare_warm = Sandbox(bwrap, launcher, python, uid_base=63102, slots=1, confinement=bare)
    bare_cold = Sandbox(bwrap, launcher, python, uid_base=63103, slots=1, prestart=False, confinement=bare)
    limits = Limits(wall_s=10)
    started_ahead = 0

    async def sandboxed(sandbox: Sandbox) -> None:
        nonlocal started_ahead
        outcome = await sandbox.run("pass", b"", limits)
        assert outcome.exit_code == 0, outcome.stderr
        started_ahead += sandbox is warm and bool(outcome.info.get("warm"))

    async def plain() -> None:
        process = await asyncio.create_subprocess_exec(str(python), "-I", "-B", "-c", "pass")
        assert await process.wait() == 0

    async def timed(fn: Callable[[], Awaitable[None]]) -> float:
        started = time.perf_counter()
        await fn()
        return time.perf_counter() - started

    inside, refill, outside, cold_start, unconfined, unconfined_cold = [], [], [], [], [], []
    try:
        await warm.prestart(limits)
        await bare_warm.prestart(limits)
        for _ in range(3):
            for sandbox in (warm, bare_warm):
                await sandboxed(sandbox)
                await sandbox.ready()
            await sandboxed(cold)
            await sandboxed(bare_cold)
            await plain()
        started_ahead = 0
        for _ in range(n):
            inside.append(await timed(lambda: sandboxed(warm)))
            refill.append(await timed(warm.ready))  # the slot's next sandbox, started after the call
            outside.append(await timed(plain))
            cold_start.append(await timed(lambda: sandboxed(cold)))
            unconfined.append(await timed(lambda: sandboxed(bare_warm)))
            await bare_warm.ready()
            unconfined_cold.append(await timed(lambda: sandboxed(bare_cold)))
    finally:
        for sandbox in (warm, cold, bare_warm, bare_cold):
            await sandbox.close()
    s, p, c = _summary(inside), _summary(outside), _summary(cold_start)
    u, uc = _summary(unconfined), _summary(unconfined_cold)
    return {
        "sandbox_unconfined": u,
        "sandbox_unconfined_cold": uc,
        "sandbox_layers_ms_p50": round(s["p50_ms"] - u["p50_ms"], 2),
        "sandbox_layers_cold_ms_p50": round(c["p50_ms"] - uc["p50_ms"], 2),
        "sandbox_fleet": s,
        "sandbox_baseline": p,
        "sandbox_overhead_ms_p50": round(s["p50_ms"] - p["p50_ms"], 2),
        "sandbox_target_ms": SANDBOX_TARGET_MS,
        "sandbox_started_ahead": f"{started_ahead}/{n}",
        "sandbox_refill": _summary(refill),
        "sandbox_cold": c,
        "sandbox_cold_overhead_ms_p50": round(c["p50_ms"] - p["p50_ms"], 2),
    }


# -- SQL at a million rows --------------------------------------------------------------------------


async def sql_million(dsn: str, n: int = 30) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        await ensure_schema(admin)
        await admin.execute("ALTER TABLE tenant_data.invoices DISABLE ROW LEVEL SECURITY")
        await admin.execute(
            "INSERT INTO tenant_data.invoices (tenant_id, customer, amount, issued_on, status)"
            " SELECT 't' || (g %% %s), 'c' || (g %% 997), (g %% 5000) + 0.5,"
            " date '2026-01-01' + (g %% 300)::int, (ARRAY['open', 'paid', 'overdue'])[1 + g %% 3] FROM generate_series(1, %s) g",
            (TENANTS, ROWS),
        )
        await admin.execute("ALTER TABLE tenant_data.invoices ENABLE ROW LEVEL SECURITY")
        await admin.execute("ANALYZE tenant_data.invoices")
    settings = SqlServerSettings(
        service_id="mcp-sql", key_file=Path("/nonexistent"), public_url="http://127.0.0.1:1", pg_dsn=dsn
    )
    pools = TenantPools(settings)
    tools = SqlTools(pools, settings)
    statements = {
        "aggregate": "SELECT status, count(*), sum(amount) FROM tenant_data.invoices GROUP BY status",
        "lookup": "SELECT id, customer, amount FROM tenant_data.invoices WHERE customer = 'c7' ORDER BY id LIMIT 20",
    }
    result: dict[str, Any] = {"sql_rows": ROWS, "sql_tenants": TENANTS}
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as owner:
            for name, statement in statements.items():
                filtered = statement.replace(
                    "FROM tenant_data.invoices", "FROM tenant_data.invoices WHERE tenant_id = 't42'"
                )
                filtered = filtered.replace("WHERE tenant_id = 't42' WHERE", "WHERE tenant_id = 't42' AND")
                fleet, baseline = [], []
                tool_rows = (await tools.query("t42", statement))["rows"]
                await owner.execute("SELECT set_config(%s, 't42', false)", (OWNER_SETTING,))
                owner_rows = await (await owner.execute(filtered)).fetchall()
                assert len(tool_rows) == len(owner_rows), (tool_rows, owner_rows)
                for _ in range(n):
                    started = time.perf_counter()
                    await tools.query("t42", statement)
                    fleet.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await (await owner.execute(filtered)).fetchall()
                    baseline.append(time.perf_counter() - started)
                f, b = _summary(fleet), _summary(baseline)
                result[f"sql_{name}"] = {
                    "statement": statement,
                    "fleet": f,
                    "baseline": b,
                    "ratio_p50": round(f["p50_ms"] / b["p50_ms"], 2),
                }
    finally:
        await pools.aclose()
    return result


def main() -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "tool_plane"}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-tool-plane-") as tmp:
        # Logged as a server logs (its INFO lines, e.g. each policy decision, to a file), so the gate
        # pays what it pays in the fleet; the client libraries of the bench itself stay quiet.
        logging.basicConfig(
            filename=Path(tmp) / "server.log",
            level=logging.INFO,
            format="%(asctime)s mcp-bench %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        for noisy in ("httpx", "httpx2", "mcp"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        with embedded_nats() as nats_url:
            result.update(asyncio.run(gate(nats_url)))
        result.update(asyncio.run(sandbox_start()))
        with embedded_postgres() as dsn:
            result.update(asyncio.run(sql_million(dsn)))
        logging.shutdown()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
