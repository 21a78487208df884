"""Many runs paused at a gate with no worker process alive, then resumed: the scenario of the durable
pauses issue, shared by its test (a few hundred runs) and its benchmark (10,000).

1. ``n`` refund events arrive on NATS; a trigger rule makes each a run whose one step is a refund
   over the approval threshold: the tool does nothing and the run parks at the gate.
2. Every worker process is stopped (SIGTERM). The runs wait with no process held; the disk they use
   is measured (tables of the runs database, after ``VACUUM FULL``, against before step 1).
3. ``n`` approvals arrive over NATS (``fleet.signals.<run>``, each with a signal grant the operator
   asked for); the coordinator records them and queues the runs. Still no worker runs.
4. The workers start again (new processes, same identities); every run resumes, the approved call
   refunds, the run completes. Effects are counted at the tool.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg

from deploy.enrollment import enrollment_token
from deploy.local_stack import OPERATOR_ID, service
from fleet.events import event_message
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.signal_client import publish_signal
from fleet.tokens import TokenClient
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import StackLayout, stack_admin
from policy import DEFAULT_BUNDLE_DIR

SUBJECT = "fleet.events.refunds.requested"
TENANT = "bulk"
RULE = {
    "name": "refund-requested",
    "subject": SUBJECT,
    "type": "refund.requested",
    "steps": [
        {
            "id": "refund",
            "skill": "issue-refund",
            "input": {
                "subject": {"$event": "data.subject"},
                "amount_cents": {"$event": "data.amount_cents"},
            },
        }
    ],
}


def refund_policy(root: Path, bulk_tenants: tuple[str, ...] = ()) -> Path:
    """The shipped bundle plus the refund trigger rule; the event ingest and token issue rates of
    ``bulk_tenants`` raised out of the way, as an operator sizes them for a tenant that works in
    bulk (the shipped 100 events a second, burst 2,000, would spread 10,000 events over 80 s by
    policy alone and dead-letter some as ``rate_limited``; 10,000 approvals need a signal grant
    each, over the shipped 200 tokens a second)."""
    bundle = root / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    data["config"]["triggers"] = [RULE, *data["config"]["triggers"]]
    for tenant in bulk_tenants:
        for limit in ("event_ingest", "token_issue"):
            data["config"]["limits"]["fair"][limit]["tenants"][tenant] = {
                "per_second": 100_000,
                "burst": 100_000,
            }
    (bundle / "data.json").write_text(json.dumps(data))
    return bundle


def dsn(layout: StackLayout, endpoints: dict[str, Any], database: str) -> str:
    password = (layout.keys_dir / "postgres-password.secret").read_text().strip()
    return f"postgresql://postgres:{password}@127.0.0.1:{endpoints['postgres_port']}/{database}"


async def _scalar(url: str, query: str, *params: Any) -> Any:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(query, params)
        row = await cursor.fetchone()
    return row[0] if row else None


async def _until(url: str, query: str, tenant: str, want: int, timeout_s: float) -> float:
    """Seconds until ``query`` (for ``tenant``) counts ``want``; raise on timeout, saying how far it got."""
    started = time.perf_counter()
    got = -1
    while time.perf_counter() - started < timeout_s:
        got = int(await _scalar(url, query, tenant))
        if got >= want:
            return time.perf_counter() - started
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{query!r}: {got} of {want} after {timeout_s:.0f} s")


async def disk_bytes(url: str) -> dict[str, dict[str, int]]:
    """Every table of the run schema (found, not listed: a table added later counts too), in bytes:
    ``grown``, its size on disk as it is (with indexes and TOAST, dead rows and free space
    included); ``live``, the bytes of its live rows (``pg_column_size`` of each, which is what a row
    holds, compressed where Postgres compressed it, without the page's per-row overhead); and
    ``compacted``, its size after ``VACUUM FULL`` (indexes and TOAST included)."""
    sizes = {}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        listed = await conn.execute(
            "SELECT format('%I.%I', schemaname, relname) FROM pg_stat_user_tables"
            " WHERE schemaname = 'fleet_runs' ORDER BY relname"
        )
        for (table,) in await listed.fetchall():
            size = "SELECT pg_total_relation_size(%s::regclass)"
            grown = await _scalar_on(conn, size, table)
            live = await _scalar_on(conn, f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {table} t")
            await conn.execute(f"VACUUM FULL {table}")
            sizes[table] = {"grown": grown, "live": live, "compacted": await _scalar_on(conn, size, table)}
    return sizes


async def _scalar_on(conn: psycopg.AsyncConnection[Any], query: str, *args: Any) -> int:
    row = await (await conn.execute(query, args or None)).fetchone()
    assert row is not None
    return int(row[0])


def _per_run(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], n: int) -> dict[str, Any]:
    """What ``n`` runs added between two :func:`disk_bytes`, per run: in all and by table (each
    table they wrote to). The growth before vacuum is from the compacted state ``before`` left."""
    empty = {"grown": 0, "live": 0, "compacted": 0}
    disk = {
        table: {
            "live": sizes["live"] - before.get(table, empty)["live"],
            "compacted": sizes["compacted"] - before.get(table, empty)["compacted"],
            "grown": sizes["grown"] - before.get(table, empty)["compacted"],
        }
        for table, sizes in after.items()
    }
    touched = {table: d for table, d in disk.items() if any(d.values())}
    return {
        "live": round(sum(d["live"] for d in touched.values()) / n),
        "compacted": round(sum(d["compacted"] for d in touched.values()) / n),
        "grown": round(sum(d["grown"] for d in touched.values()) / n),
        "by_table": {
            table.removeprefix("fleet_runs."): {key: round(size / n) for key, size in d.items()}
            for table, d in sorted(touched.items(), key=lambda kv: -kv[1]["live"])
        },
    }


async def submitted_paused_disk(layout: StackLayout, endpoints: dict[str, Any], n: int) -> dict[str, Any]:
    """The disk of ``n`` refund runs submitted by a caller (the run API, which admits a run as A2A
    does: the caller's context, its run grant, its task record) that park at the approval gate,
    per run, as :func:`_per_run` counts it. They are left waiting."""
    tenant = f"asked-{uuid.uuid4().hex[:8]}"
    runs_db = dsn(layout, endpoints, "fleet")
    before = await disk_bytes(runs_db)
    async with httpx.AsyncClient(timeout=30) as http:
        tokens = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
        token = await tokens.token("coordinator", tenant, ["agent:invoke"])
        for i in range(n):
            step = {
                "id": "refund",
                "skill": "issue-refund",
                "input": {"subject": f"asked-{i}", "amount_cents": 20_000},
            }
            started = await http.post(
                endpoints["coordinator"] + "/v1/runs",
                json={"steps": [step]},
                headers={"Authorization": f"Bearer {token}"},
            )
            started.raise_for_status()
    waiting = "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND state = 'waiting'"
    await _until(runs_db, waiting, tenant, n, 300)
    await asyncio.sleep(1)  # the workers' last writes of the parks (the pruning of checkpoints)
    return _per_run(before, await disk_bytes(runs_db), n)


def stop_workers(endpoints: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Stop every worker process: SIGTERM, and SIGKILL for one still alive after 20 s (a worker
    busy with a backlog may take longer to drain than a pause should wait). Their environments,
    to start them again."""
    workers = {name: pid for name, pid in endpoints["processes"].items() if name.startswith("worker")}
    layout = StackLayout.at(Path(endpoints["data_dir"]))
    environments = {name: {**os.environ, **layout.read_service_env(name)} for name in workers}
    for stop, grace_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        for pid in workers.values():
            if _running(pid):
                os.kill(pid, stop)
        deadline = time.monotonic() + grace_s
        while any(_running(pid) for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    return environments


def start_workers(
    layout: StackLayout, environments: dict[str, dict[str, str]]
) -> list[subprocess.Popen[bytes]]:
    """The same workers again, as new processes: a fresh enrollment token each, their own port."""
    operator = SigningKey.load_or_create(layout.key_file(OPERATOR_ID))
    started = []
    for name, env in environments.items():
        env = {k: v for k, v in env.items() if k != "FLEET_LISTEN_FD"}
        env["FLEET_ENROLLMENT_TOKEN"] = enrollment_token(operator, service(name))
        with (layout.home / "logs" / f"{name}-restarted.log").open("ab") as log:  # the child keeps its copy
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "fleetctl", "serve", name],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    return started


def operator_signer(layout: StackLayout, endpoints: dict[str, Any], http: httpx.AsyncClient) -> TokenClient:
    """The operator's credentials (its key), which ask for a signal grant per signal."""
    return operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)


async def _signal_all(
    nc: Any, signer: TokenClient, tenant: str, run_ids: list[str], concurrency: int = 64
) -> None:
    """Approve every run over NATS: a signal grant each, asked for and published as it comes."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for run_id in run_ids:
        queue.put_nowait(run_id)

    async def signer_task() -> None:
        while not queue.empty():
            run_id = queue.get_nowait()
            body = {"action": "approve", "note": "bulk"}
            await publish_signal(nc, run_id, signer, body, tenant=tenant, signal_id=f"approve-{run_id}")

    await asyncio.gather(*(signer_task() for _ in range(concurrency)))


async def _publish_all(
    nc: Any, items: list[tuple[str, bytes, dict[str, str]]], concurrency: int = 64
) -> None:
    js = nc.jetstream()
    queue: asyncio.Queue[tuple[str, bytes, dict[str, str]]] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def publisher() -> None:
        while not queue.empty():
            subject, payload, headers = queue.get_nowait()
            await js.publish(subject, payload, headers=headers)

    await asyncio.gather(*(publisher() for _ in range(concurrency)))


async def pause_and_resume(
    layout: StackLayout, endpoints: dict[str, Any], n: int, timeout_s: float, tenant: str = ""
) -> dict[str, Any]:
    """Run the scenario on a running stack (started with :func:`refund_policy`) for a tenant of its
    own (one that no other run has); what happened."""
    tenant = tenant or f"bulk-{uuid.uuid4().hex[:8]}"
    runs_db, data_db = dsn(layout, endpoints, "fleet"), dsn(layout, endpoints, "fleet_data")
    before = await disk_bytes(runs_db)
    batch = uuid.uuid4().hex[:8]
    nc = await connect(endpoints["nats"], "pause-harness", credentials=stack_admin(endpoints))
    restarted: list[subprocess.Popen[bytes]] = []
    try:
        events = []
        for i in range(n):
            message = event_message(
                SUBJECT,
                tenant=tenant,
                source="harness",
                type_="refund.requested",
                data={"subject": f"customer-{batch}-{i}", "amount_cents": 20_000 + i},
                event_id=f"refund-{batch}-{i}",
            )
            events.append((message.subject, message.payload, message.headers))
        started = time.perf_counter()
        await _publish_all(nc, events)
        waiting = "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND state = 'waiting'"
        await _until(runs_db, waiting, tenant, n, timeout_s)
        pause_s = time.perf_counter() - started  # from the first publish
        effects_while_paused = int(
            await _scalar(data_db, "SELECT count(*) FROM tenant_data.refunds WHERE tenant_id = %s", tenant)
        )

        environments = stop_workers(endpoints)
        alive = [
            name
            for name, pid in endpoints["processes"].items()
            if name.startswith("worker") and _running(pid)
        ]
        disk = _per_run(before, await disk_bytes(runs_db), n)
        held = int(
            await _scalar(runs_db, "SELECT count(*) FROM fleet_runs.runs WHERE lease_owner IS NOT NULL")
        )

        run_ids = [
            str(r)
            for r in await _all(
                runs_db, "SELECT run_id FROM fleet_runs.runs WHERE tenant = %s AND state = 'waiting'", tenant
            )
        ]
        started = time.perf_counter()  # a signal grant each is part of sending an approval
        async with httpx.AsyncClient(timeout=30) as http:
            await _signal_all(nc, operator_signer(layout, endpoints, http), tenant, run_ids)
        applied = "SELECT count(*) FROM fleet_runs.signals WHERE tenant = %s AND outcome = 'applied'"
        await _until(runs_db, applied, tenant, n, timeout_s)
        approvals_s = time.perf_counter() - started
        queued = int(
            await _scalar(
                runs_db,
                "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND state = 'submitted'",
                tenant,
            )
        )

        restarted = start_workers(layout, environments)
        started = time.perf_counter()
        ended = "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND state IN ('completed', 'failed')"
        await _until(runs_db, ended, tenant, n, timeout_s)
        resume_s = time.perf_counter() - started
        failed = await _all(  # a run that failed after its approval, by the code it failed with
            runs_db,
            "SELECT coalesce(e.payload->'error'->'cause'->'cause'->>'code', e.payload->'error'->>'code'), count(*)"
            " FROM fleet_runs.runs r JOIN fleet_runs.events e ON e.run_id = r.run_id AND e.type = 'run.failed'"
            " WHERE r.tenant = %s AND r.state = 'failed' GROUP BY 1",
            tenant,
        )

        refunds = await _all(
            data_db,
            "SELECT count(*), count(DISTINCT subject), coalesce(max(attempts), 0), count(approval_id)"
            " FROM tenant_data.refunds WHERE tenant_id = %s",
            tenant,
            row=True,
        )
        per_run = await _all(
            runs_db,
            "SELECT count(*) FILTER (WHERE type = 'approval.granted'), count(*) FILTER (WHERE type = 'run.completed'),"
            " count(*) FILTER (WHERE type = 'operation.intent') FROM fleet_runs.events e"
            " JOIN fleet_runs.runs r USING (run_id) WHERE r.tenant = %s GROUP BY run_id",
            tenant,
        )
    finally:
        await nc.close()
        for process in restarted:
            process.terminate()
        for process in restarted:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return {
        "runs": n,
        "tenant": tenant,
        "pause_s": round(pause_s, 1),
        "effects_while_paused": effects_while_paused,
        "workers_alive_while_paused": alive,
        "leases_held_while_paused": held,
        # the live bytes of the rows a paused run keeps, over every table it wrote to
        "disk_bytes_per_paused_run": disk["live"],
        "disk_compacted_bytes_per_paused_run": disk["compacted"],
        "disk_growth_bytes_per_paused_run_before_vacuum": disk["grown"],
        "disk_bytes_per_paused_run_by_table": disk["by_table"],
        "approvals_s": round(approvals_s, 1),
        "queued_without_workers": queued,
        "resume_s": round(resume_s, 1),
        "failed_after_approval": {str(code): int(count) for code, count in failed},
        "refunds": refunds[0],
        "distinct_subjects": refunds[1],
        "max_attempts_at_tool": refunds[2],
        "refunds_with_approval": refunds[3],
        "per_run_events": sorted({tuple(row) for row in per_run}),
    }


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


async def _all(url: str, query: str, tenant: str, row: bool = False) -> Any:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(query, (tenant,))
        rows = await cursor.fetchall()
    if row:
        return list(rows[0])
    return [r[0] if len(r) == 1 else tuple(r) for r in rows]
