"""What a run costs: CPU per run of every service of a local stack for five run shapes, beside a floor
measured in the same run from the same parts alone, and the stack's memory (PSS).

Run shapes (``ROUNDS`` rounds of ``RUNS`` runs each, ``IN_FLIGHT`` at once, after a warm-up of the same shape;
the round with the median CPU is reported):

* ``one-step``: the statistician's ``outliers`` on inline records, sent over A2A (streaming);
* ``two-step``: the demo's plan: invoice totals through the SQL analyst and ``mcp-sql``, then outliers;
* ``ten-step``: ten ``outliers`` steps, each after the one before;
* ``triggered``: the demo's trigger (an ``invoices.closed`` event on NATS makes the two-step run);
* ``approved``: a refund event makes a run that parks at the refund's approval gate; an operator's
  approval (a signal grant each, over NATS) resumes it, and the refund is made.

The CPU of each service is read from ``/proc`` before and after (every process of its tree: Postgres
with its backends, NATS, each Python service), divided by the runs; the benchmark's own client is
reported apart and not counted in the stack's figure.

The floor, measured on the same machine in the same run, from the parts alone (``bench._floor_servers``):

* a bare a2a-sdk agent (the SDK's routes, request handler and in-memory task store; no token) and the
  SDK's streaming client: CPU per round trip, server and client;
* a bare MCP server of the SDK (stateless Streamable HTTP, JSON answers, one tool) and the SDK's
  client: CPU per call, on an open session, and with a session per call (initialize, then the call);
* a bare LangGraph graph of the coordinator's shape (``bench.checkpoint_overhead.bare_graph``) on
  LangGraph's ``AsyncPostgresSaver`` on the stack's Postgres: CPU per run of one and of ten steps,
  the process's and Postgres's.

A shape's floor is one A2A round trip for the caller's request, one per step (the worker to the
specialist), one MCP call per tool call, and the bare graph of that many steps. Each service is set
beside its part: a specialist's CPU per call beside the bare agent's server, an MCP server's beside
the bare MCP server's, the workers' beside the bare graph plus the A2A client of each step.

Run: ``.venv/bin/python -m bench.cost [RUNS]`` (RUNS per round; starts and stops its own stack). With py-spy
installed (the dev extra), the services are also profiled under two-step runs (:mod:`bench._profile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import httpx2
import psycopg
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.helpers import new_data_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest, TaskState
from google.protobuf.json_format import ParseDict
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from bench import _profile
from bench._cpu import cpu_by_tree, pss_by_tree
from bench.checkpoint_overhead import bare_graph
from fleet.events import Event, event_message
from fleet.natsconn import connect
from fleet.signal_client import publish_signal
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import StackLayout, stack_admin
from fleetctl.testing.e2e import TWO_STEPS
from fleetctl.testing.pauses import SUBJECT as REFUND_SUBJECT
from fleetctl.testing.pauses import dsn, refund_policy
from fleetctl.testing.stack import running_stack

RUNS = 20  # per round
ROUNDS = 3  # per shape: the median round is reported
IN_FLIGHT = 8
FLOOR_CALLS = 200
IDLE_S = 10.0
STATS_SETTLE_S = 1.2  # Postgres's backends report their statistics at most once a second
PROFILE_S = 20.0
PROFILED = (
    "worker-1",
    "coordinator",
    "sql-analyst",
    "mcp-sql",
    "registry",
    "stats",
    "mcp-memory",
    "postgres",
)
TARGET_TWO_STEP_MS = 50.0
TARGET_SERVICE_RATIO = 3.0
INVOICES_CLOSED = "fleet.events.invoices.closed"
RECORDS = [{"name": f"r{i}", "x": v} for i, v in enumerate([1, 2, 1, 2, 40, 1])]
OUTLIERS = {"skill": "outliers", "input": {"records": RECORDS, "field": "x", "label": "name"}}
ONE_STEP = {"steps": [{"id": "outliers", **OUTLIERS}]}
TEN_STEPS = {"steps": [{"id": f"s{i}", **OUTLIERS, "after": [f"s{i - 1}"] if i else []} for i in range(10)]}
# steps per run, and tool calls per run (the SQL analyst's one query per invoice-totals step)
SHAPE_PARTS = {
    "one-step": (1, 0),
    "two-step": (2, 1),
    "ten-step": (10, 0),
    "triggered": (2, 1),
    "approved": (1, 2),  # the refund is asked once (the gate) and made once, approved
}


# ---------------------------------------------------------------------------------------------- the stack


class _Stack:
    """A running stack and what the benchmark sends it."""

    def __init__(self, layout: StackLayout, endpoints: dict[str, Any], http: httpx.AsyncClient) -> None:
        self.layout, self.endpoints, self.http = layout, endpoints, http
        self.tokens = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
        self.runs_db = dsn(layout, endpoints, "fleet")
        self._client: Any = None
        self.stats_settle_s = STATS_SETTLE_S

    async def commits(self) -> int:
        """Transactions committed in the runs database so far (``pg_stat_database``; a backend
        reports its own within a second of going idle)."""
        async with await psycopg.AsyncConnection.connect(self.runs_db, autocommit=True) as conn:
            row = await (
                await conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = 'fleet'")
            ).fetchone()
        return int(row[0]) if row else 0

    @property
    def roots(self) -> dict[str, int]:
        return {"supervisor": int(self.endpoints["supervisor_pid"]), **self.endpoints["processes"]}

    async def client(self) -> Any:
        """One A2A client for every run (a caller keeps its client)."""
        if self._client is None:
            card = (
                await self.http.get(self.endpoints["coordinator"] + "/.well-known/agent-card.json")
            ).json()
            self._client = ClientFactory(ClientConfig(streaming=True, httpx_client=self.http)).create(
                ParseDict(card, AgentCard(), ignore_unknown_fields=True)
            )
        return self._client

    async def send(self, plan: dict[str, Any], tenant: str = "acme") -> str:
        """One run over A2A, followed on its stream to the end; its id."""
        token = await self.tokens.token("coordinator", tenant, ["agent:invoke"])
        context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
        message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[new_data_part(plan)])
        state, task_id = TaskState.TASK_STATE_UNSPECIFIED, ""
        async for event in (await self.client()).send_message(
            SendMessageRequest(message=message), context=context
        ):
            kind = event.WhichOneof("payload")
            if kind == "task":
                task_id = event.task.id
            elif kind == "status_update":
                state = event.status_update.status.state
        if state != TaskState.TASK_STATE_COMPLETED:
            raise RuntimeError(f"run {task_id} ended {TaskState.Name(state)}")
        return task_id

    async def until(self, run_ids: list[str], states: tuple[str, ...], timeout_s: float = 300) -> None:
        """Until every run is in one of ``states`` (one query every 0.25 s)."""
        query = "SELECT count(*) FROM fleet_runs.runs WHERE run_id = ANY(%s) AND state = ANY(%s)"
        async with (
            await psycopg.AsyncConnection.connect(self.runs_db, autocommit=True) as conn,
            asyncio.timeout(timeout_s),
        ):
            while True:
                row = await (await conn.execute(query, (run_ids, list(states)))).fetchone()
                if row is not None and int(row[0]) == len(run_ids):
                    return
                await asyncio.sleep(0.25)

    async def failed(self, run_ids: list[str]) -> int:
        async with await psycopg.AsyncConnection.connect(self.runs_db, autocommit=True) as conn:
            query = "SELECT count(*) FROM fleet_runs.runs WHERE run_id = ANY(%s) AND state <> 'completed'"
            row = await (await conn.execute(query, (run_ids,))).fetchone()
        return int(row[0]) if row else 0


async def _bounded(n: int, one: Callable[[int], Awaitable[Any]]) -> list[Any]:
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def each(i: int) -> Any:
        async with gate:
            return await one(i)

    return await asyncio.gather(*(each(i) for i in range(n)))


async def _triggered(stack: _Stack, n: int) -> list[str]:
    """``n`` invoices.closed events published at once; the runs they make, to their end."""
    batch = uuid.uuid4().hex[:8]
    nc = await connect(stack.endpoints["nats"], "cost-producer", credentials=stack_admin(stack.endpoints))
    try:
        js, run_ids = nc.jetstream(), []
        for i in range(n):
            event_id = f"closed-{batch}-{i}"
            message = event_message(
                INVOICES_CLOSED,
                tenant="acme",
                source="cost",
                type_="invoices.closed",
                data={},
                event_id=event_id,
            )
            await js.publish(message.subject, message.payload, headers=message.headers)
            run_ids.append(
                Event(INVOICES_CLOSED, event_id, "cost", "invoices.closed", "acme", "", {}).run_id()
            )
    finally:
        await nc.close()
    await stack.until(run_ids, ("completed", "failed"))
    return run_ids


async def _approved(stack: _Stack, n: int) -> list[str]:
    """``n`` refund events; their runs park at the approval gate; an approval each resumes them."""
    tenant, batch = f"cost-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:8]
    nc = await connect(stack.endpoints["nats"], "cost-approver", credentials=stack_admin(stack.endpoints))
    try:
        js, run_ids = nc.jetstream(), []
        for i in range(n):
            event_id = f"refund-{batch}-{i}"
            data = {"subject": f"customer-{batch}-{i}", "amount_cents": 20_000 + i}
            message = event_message(
                REFUND_SUBJECT,
                tenant=tenant,
                source="cost",
                type_="refund.requested",
                data=data,
                event_id=event_id,
            )
            await js.publish(message.subject, message.payload, headers=message.headers)
            run_ids.append(
                Event(REFUND_SUBJECT, event_id, "cost", "refund.requested", tenant, "", data).run_id()
            )
        await stack.until(run_ids, ("waiting", "failed"))

        async def approve(i: int) -> None:
            body = {"action": "approve", "note": "cost"}
            await publish_signal(
                nc, run_ids[i], stack.tokens, body, tenant=tenant, signal_id=f"ok-{run_ids[i]}"
            )

        await _bounded(n, approve)
        await stack.until(run_ids, ("completed", "failed"))
    finally:
        await nc.close()
    return run_ids


def _shapes(stack: _Stack) -> dict[str, Callable[[int], Awaitable[list[str]]]]:
    def over_a2a(plan: dict[str, Any]) -> Callable[[int], Awaitable[list[str]]]:
        return lambda n: _bounded(n, lambda _: stack.send(plan))

    return {
        "one-step": over_a2a(ONE_STEP),
        "two-step": over_a2a(TWO_STEPS),
        "ten-step": over_a2a(TEN_STEPS),
        "triggered": lambda n: _triggered(stack, n),
        "approved": lambda n: _approved(stack, n),
    }


async def idle_rate(stack: _Stack, seconds: float) -> dict[str, float]:
    """CPU milliseconds per second each service spends with no run in flight (heartbeats, sweeps,
    lease renewals, the console's refresh): what a batch's figures include for its duration."""
    roots = stack.roots
    before = cpu_by_tree(roots)
    await asyncio.sleep(seconds)
    after = cpu_by_tree(roots)
    return {name: round((after[name] - before[name]) * 1000 / seconds, 2) for name in roots}


async def _batch_cost(
    stack: _Stack, shape: Callable[[int], Awaitable[list[str]]], runs: int, idle: Mapping[str, float]
) -> dict[str, Any]:
    roots = stack.roots
    await asyncio.sleep(stack.stats_settle_s)  # the last batch's statistics reach pg_stat_database
    commits_before = await stack.commits()
    before, client_before = cpu_by_tree(roots), time.process_time()
    started = time.perf_counter()
    run_ids = await shape(runs)
    elapsed = time.perf_counter() - started
    after, client_s = cpu_by_tree(roots), time.process_time() - client_before
    await asyncio.sleep(stack.stats_settle_s)
    commits = (await stack.commits() - commits_before) / runs
    per_service = {name: round((after[name] - before[name]) * 1000 / runs, 2) for name in roots}
    stack_ms = sum(per_service.values())
    background_ms = sum(idle.values()) * elapsed / runs  # what the stack would have spent idle meanwhile
    return {
        # transactions committed in the runs database per run (every statement outside a
        # transaction is one): a count, steadier than CPU time on a shared machine
        "postgres_commits_per_run": round(commits, 1),
        "runs": runs,
        "failed": await stack.failed(run_ids),
        "runs_per_s": round(runs / elapsed, 2),
        "stack_cpu_ms_per_run": round(stack_ms, 1),
        "background_cpu_ms_per_run": round(background_ms, 1),
        "stack_cpu_ms_per_run_net": round(stack_ms - background_ms, 1),
        "client_cpu_ms_per_run": round(client_s * 1000 / runs, 1),
        "cpu_ms_per_run_by_service": dict(sorted(per_service.items(), key=lambda kv: -kv[1])),
    }


async def _shape_cost(
    stack: _Stack, shape: Callable[[int], Awaitable[list[str]]], runs: int, idle: Mapping[str, float]
) -> dict[str, Any]:
    """The batch with the median stack CPU of ``ROUNDS`` batches of ``runs``, after a warm-up."""
    await shape(min(runs, IN_FLIGHT))  # warm every path of this shape
    batches = [await _batch_cost(stack, shape, runs, idle) for _ in range(ROUNDS)]
    median = sorted(batches, key=lambda b: float(b["stack_cpu_ms_per_run"]))[len(batches) // 2]
    return {
        **median,
        "failed": sum(int(b["failed"]) for b in batches),
        "rounds": ROUNDS,
        "stack_cpu_ms_per_run_rounds": [b["stack_cpu_ms_per_run"] for b in batches],
    }


async def profile_two_step(stack: _Stack, seconds: float, into: Path) -> dict[str, Any]:
    """Two-step runs sent for ``seconds`` (``IN_FLIGHT`` at once) while py-spy samples each Python
    service of ``PROFILED``: where its CPU goes."""
    pids = {n: int(stack.endpoints["processes"][n]) for n in PROFILED if n in stack.endpoints["processes"]}
    pids.pop("postgres", None)  # not Python
    recorders = _profile.record(pids, seconds, into)
    deadline = time.monotonic() + seconds
    send = _shapes(stack)["two-step"]

    async def keep_sending(_: int) -> None:
        while time.monotonic() < deadline:
            await send(1)

    await asyncio.gather(*(keep_sending(i) for i in range(IN_FLIGHT)))
    for recorder in recorders.values():
        await asyncio.to_thread(recorder.wait, 60)
    return {
        name: _profile.summarise(into / f"{name}.txt") for name in pids if (into / f"{name}.txt").exists()
    }


# ---------------------------------------------------------------------------------------------- the floor


@contextlib.contextmanager
def _floor_server(kind: str) -> Iterator[tuple[str, int]]:
    with subprocess.Popen(
        [sys.executable, "-m", "bench._floor_servers", kind], stdout=subprocess.PIPE, text=True
    ) as process:  # its pipe closed at the end
        try:
            assert process.stdout is not None
            url = process.stdout.readline().strip()
            if not url:
                raise RuntimeError(f"the {kind} floor server did not start")
            yield url, process.pid
        finally:
            process.terminate()
            process.wait(timeout=30)


async def _until_up(url: str) -> None:
    async with httpx.AsyncClient() as http, asyncio.timeout(30):
        while True:
            with contextlib.suppress(httpx.TransportError):
                await http.get(url)
                return
            await asyncio.sleep(0.05)


async def _per_call(
    pid: int, calls: int, one: Callable[[int], Awaitable[Any]], concurrent: bool
) -> dict[str, float]:
    """Server and client CPU per call (ms) of ``calls`` calls, after a warm-up."""
    for i in range(20):
        await one(i)
    before, client_before = cpu_by_tree({"server": pid})["server"], time.process_time()
    if concurrent:
        await _bounded(calls, one)
    else:
        for i in range(calls):
            await one(i)
    server = cpu_by_tree({"server": pid})["server"] - before
    client = time.process_time() - client_before
    return {"server_ms": round(server * 1000 / calls, 3), "client_ms": round(client * 1000 / calls, 3)}


async def a2a_floor(calls: int) -> dict[str, float]:
    """A bare a2a-sdk round trip: streaming SendMessage of an inline payload to its end."""
    with _floor_server("a2a") as (base, pid):
        await _until_up(base + "/.well-known/agent-card.json")
        async with httpx.AsyncClient(timeout=30) as http:
            card = (await http.get(base + "/.well-known/agent-card.json")).json()
            client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(
                ParseDict(card, AgentCard(), ignore_unknown_fields=True)
            )

            async def one(_: int) -> None:
                message = Message(
                    role=Role.ROLE_USER,
                    message_id=uuid.uuid4().hex,
                    parts=[new_data_part({"skill": "echo", "input": OUTLIERS["input"]})],
                )
                async for _event in client.send_message(SendMessageRequest(message=message)):
                    pass

            return await _per_call(pid, calls, one, concurrent=True)


async def mcp_floor(calls: int) -> dict[str, Any]:
    """A bare MCP call with the SDK: on an open session, and with a session per call."""
    with _floor_server("mcp") as (url, pid):
        await _until_up(url.removesuffix("/mcp") + "/")
        async with httpx2.AsyncClient() as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:

                async def on_session(_: int) -> None:
                    await client.call_tool("query", {"sql": "SELECT 1"})

                open_session = await _per_call(pid, calls, on_session, concurrent=False)

            async def new_session(_: int) -> None:
                async with Client(streamable_http_client(url, http_client=http)) as fresh:
                    await fresh.call_tool("query", {"sql": "SELECT 1"})

            per_call_session = await _per_call(pid, calls // 2, new_session, concurrent=False)
    return {**open_session, "session_per_call": per_call_session}


@contextlib.asynccontextmanager
async def _floor_database(admin_dsn: str) -> AsyncIterator[str]:
    name = f"floor_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as conn:
        await conn.execute(f"CREATE DATABASE {name}")
    try:
        yield admin_dsn.rsplit("/", 1)[0] + "/" + name
    finally:
        async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as conn:
            await conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


async def langgraph_floor(stack: _Stack, runs: int) -> dict[str, dict[str, float]]:
    """A bare LangGraph graph of the coordinator's shape on AsyncPostgresSaver, per run of 1, 2 and
    10 steps: this process's CPU and Postgres's."""
    postgres = {"postgres": int(stack.endpoints["processes"]["postgres"])}
    out = {}
    async with _floor_database(stack.runs_db) as url:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            max_size=IN_FLIGHT,
            open=False,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        )
        async with pool:
            saver = AsyncPostgresSaver(pool)
            await saver.setup()
            graph = bare_graph(saver)
            for steps in (1, 2, 10):
                plan = [
                    {"id": f"s{i}", "skill": "noop", "input": {}, "after": [f"s{i - 1}"] if i else []}
                    for i in range(steps)
                ]

                async def one(_: int, plan: list[dict[str, Any]] = plan) -> None:
                    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
                    await graph.ainvoke({"steps": plan, "results": {}}, config)

                for i in range(IN_FLIGHT):
                    await one(i)
                pg_before, before = cpu_by_tree(postgres)["postgres"], time.process_time()
                await _bounded(runs, one)
                pg = cpu_by_tree(postgres)["postgres"] - pg_before
                own = time.process_time() - before
                out[str(steps)] = {
                    "graph_ms": round(own * 1000 / runs, 2),
                    "postgres_ms": round(pg * 1000 / runs, 2),
                }
    return out


# ---------------------------------------------------------------------------------------------- together


def _floor_of(
    shape: str, a2a: Mapping[str, float], mcp: Mapping[str, Any], graph: Mapping[str, Any]
) -> float:
    steps, tools = SHAPE_PARTS[shape]
    hop = a2a["server_ms"] + a2a["client_ms"]
    call = mcp["server_ms"] + mcp["client_ms"]
    bare = graph[str(steps)] if str(steps) in graph else graph["1"]
    return round(float(hop * (1 + steps) + call * tools + bare["graph_ms"] + bare["postgres_ms"]), 2)


def _service_ratios(
    two_step: Mapping[str, Any], a2a: Mapping[str, float], mcp: Mapping[str, Any], graph: Mapping[str, Any]
) -> dict[str, Any]:
    """Each service of the two-step run beside its part's floor (per run: the run has one call of
    each specialist, one SQL call, one A2A request to the coordinator, and two graph steps)."""
    by = two_step["cpu_ms_per_run_by_service"]
    workers = sum(ms for name, ms in by.items() if name.startswith("worker"))
    two = graph["2"]
    floors = {
        "coordinator": a2a["server_ms"],
        "sql-analyst": a2a["server_ms"] + mcp["client_ms"],
        "stats": a2a["server_ms"],
        "mcp-sql": mcp["server_ms"],
        "workers": two["graph_ms"] + 2 * a2a["client_ms"],
        "postgres": two["postgres_ms"],
    }
    spent = {**{k: by.get(k, 0.0) for k in floors if k != "workers"}, "workers": workers}
    return {
        name: {
            "fleet_ms": round(spent[name], 2),
            "floor_ms": round(floor, 3),
            "ratio": round(spent[name] / floor, 1),
        }
        for name, floor in floors.items()
        if floor > 0
    }


async def measure(
    layout: StackLayout,
    endpoints: dict[str, Any],
    runs: int,
    floor_calls: int,
    profile_into: Path | None = None,
    idle_s: float = IDLE_S,
    stats_settle_s: float = STATS_SETTLE_S,
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), limits=limits) as http:
        stack = _Stack(layout, endpoints, http)
        stack.stats_settle_s = stats_settle_s
        memory = pss_by_tree(stack.roots)
        idle = await idle_rate(stack, idle_s)
        shapes = {}
        for name, shape in _shapes(stack).items():
            shapes[name] = await _shape_cost(stack, shape, runs, idle)
            print(
                json.dumps(
                    {name: {k: v for k, v in shapes[name].items() if k != "cpu_ms_per_run_by_service"}}
                ),
                flush=True,
            )
        profiles = await profile_two_step(stack, PROFILE_S, profile_into) if profile_into is not None else {}
        a2a = await a2a_floor(floor_calls)
        mcp = await mcp_floor(floor_calls)
        graph = await langgraph_floor(stack, max(runs, IN_FLIGHT))
    for name, result in shapes.items():
        result["floor_ms_per_run"] = _floor_of(name, a2a, mcp, graph)
        result["vs_floor"] = round(result["stack_cpu_ms_per_run"] / result["floor_ms_per_run"], 1)
    two = shapes["two-step"]
    return {
        "benchmark": "cost",
        "runs_per_shape": runs,
        "in_flight": IN_FLIGHT,
        "shapes": shapes,
        "floor": {"a2a_round_trip": a2a, "mcp_call": mcp, "langgraph_on_postgres": graph},
        "two_step_services_vs_floor": _service_ratios(two, a2a, mcp, graph),
        "two_step_cpu_ms_per_run": two["stack_cpu_ms_per_run"],
        "target_two_step_ms": TARGET_TWO_STEP_MS,
        "target_service_ratio": TARGET_SERVICE_RATIO,
        "idle_cpu_ms_per_s": dict(sorted(idle.items(), key=lambda kv: -kv[1])),
        "idle_cpu_ms_per_s_total": round(sum(idle.values()), 1),
        "memory_pss_mb": {
            name: round(b / 2**20, 1) for name, b in sorted(memory.items(), key=lambda kv: -kv[1])
        },
        "memory_pss_mb_total": round(sum(memory.values()) / 2**20, 1),
        "profiles_two_step": profiles,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def run(
    runs: int = RUNS,
    floor_calls: int = FLOOR_CALLS,
    profile: bool = False,
    idle_s: float = IDLE_S,
    stats_settle_s: float = STATS_SETTLE_S,
) -> dict[str, Any]:
    """Start a stack (with the refund trigger rule beside the shipped ones), measure (and, with
    ``profile`` and py-spy installed, profile the services under two-step runs), stop it."""
    with TemporaryDirectory(prefix="fleet-bench-") as tmp:
        policy = refund_policy(Path(tmp) / "policy")
        settings = {"FLEET_POLICY_DIR": str(policy), "FLEET_SQL_CONNECTIONS_PER_TENANT": str(IN_FLIGHT)}
        with running_stack(Path(tmp) / "fleet", **settings) as (layout, endpoints):
            into = Path(tmp) / "profiles" if profile and _profile.available() else None
            return asyncio.run(measure(layout, endpoints, runs, floor_calls, into, idle_s, stats_settle_s))


def main(runs: int = RUNS) -> dict[str, Any]:
    result = run(runs, profile=True)
    print(json.dumps(result, indent=2))
    two = result["two_step_cpu_ms_per_run"]
    print(
        f"two-step run: {two} ms of CPU (target <= {TARGET_TWO_STEP_MS:.0f} ms), {result['shapes']['two-step']['vs_floor']}x its floor"
    )
    return result


def summary_row(result: Mapping[str, Any]) -> str:
    """The benchmarks page's row."""
    two = result["shapes"]["two-step"]
    verdict = "meets" if two["stack_cpu_ms_per_run"] <= result["target_two_step_ms"] else "MISSES"
    return (
        f"| CPU per two-step run, whole stack | the same parts alone (a2a-sdk, MCP SDK, LangGraph on Postgres) "
        f"| {two['floor_ms_per_run']} ms | {two['stack_cpu_ms_per_run']} ms | **{two['vs_floor']}x** "
        f"| <= {result['target_two_step_ms']:.0f} ms ({verdict}) |"
    )


def section(result: Mapping[str, Any]) -> str:
    """The benchmarks page's section: per shape, per service, the floor and the memory."""
    shapes = result["shapes"]
    services = sorted({s for shape in shapes.values() for s in shape["cpu_ms_per_run_by_service"]})
    head = "| service | " + " | ".join(shapes) + " |\n|---|" + "---|" * len(shapes) + "\n"
    rows = "".join(
        f"| {s} | "
        + " | ".join(f"{shape['cpu_ms_per_run_by_service'].get(s, 0.0)}" for shape in shapes.values())
        + " |\n"
        for s in services
    )
    totals = (
        "| **stack** | "
        + " | ".join(f"**{shape['stack_cpu_ms_per_run']}**" for shape in shapes.values())
        + " |\n"
        "| floor | " + " | ".join(f"{shape['floor_ms_per_run']}" for shape in shapes.values()) + " |\n"
        "| rounds (stack) | "
        + " | ".join(
            " / ".join(str(x) for x in shape.get("stack_cpu_ms_per_run_rounds", []))
            for shape in shapes.values()
        )
        + " |\n"
        "| stack / floor | " + " | ".join(f"{shape['vs_floor']}x" for shape in shapes.values()) + " |\n"
        "| of which the idle stack's background | "
        + " | ".join(f"{shape['background_cpu_ms_per_run']}" for shape in shapes.values())
        + " |\n"
        "| Postgres commits per run | "
        + " | ".join(f"{shape.get('postgres_commits_per_run', '')}" for shape in shapes.values())
        + " |\n"
        "| runs/s (8 in flight) | "
        + " | ".join(f"{shape['runs_per_s']}" for shape in shapes.values())
        + " |\n"
        "| client (not counted) | "
        + " | ".join(f"{shape['client_cpu_ms_per_run']}" for shape in shapes.values())
        + " |\n"
    )
    floor = result["floor"]
    a2a, mcp, graph = floor["a2a_round_trip"], floor["mcp_call"], floor["langgraph_on_postgres"]
    ratios = "".join(
        f"| {name} | {r['fleet_ms']} ms | {r['floor_ms']} ms | {r['ratio']}x |\n"
        for name, r in result["two_step_services_vs_floor"].items()
    )
    memory = "".join(f"| {name} | {mb} |\n" for name, mb in result["memory_pss_mb"].items())
    return (
        "\n## What a run costs\n\n"
        f"`python -m bench cost`: CPU milliseconds per run of every service of the local stack, {result['runs_per_shape']} runs "
        f"per round, {result['in_flight']} in flight, the median of {ROUNDS} rounds per shape (see `bench/cost.py` for the "
        "shapes and the floor).\n\n"
        + head
        + rows
        + totals
        + f"\nWith no run in flight the stack spends {result['idle_cpu_ms_per_s_total']} ms of CPU a second "
        "(heartbeats, sweeps, lease renewals, refreshes); a shape's figures include that background for the "
        "batch's duration (its row above).\n"
        + "\nThe floor, from the parts alone on the same machine in the same run: a bare a2a-sdk round trip "
        f"{a2a['server_ms']} ms server + {a2a['client_ms']} ms client; a bare MCP call with the SDK "
        f"{mcp['server_ms']} ms server + {mcp['client_ms']} ms client on an open session "
        f"({mcp['session_per_call']['server_ms']} + {mcp['session_per_call']['client_ms']} ms with a session per call); "
        "a bare LangGraph graph of the coordinator's shape on AsyncPostgresSaver "
        + ", ".join(
            f"{steps} step(s) {g['graph_ms']} ms + {g['postgres_ms']} ms Postgres"
            for steps, g in graph.items()
        )
        + ".\n\nEach service of the two-step run beside its part's floor (target: at most "
        f"{result['target_service_ratio']:.0f}x):\n\n| service | fleet per run | floor | ratio |\n|---|---|---|---|\n"
        + ratios
        + f"\nMemory of the local stack (PSS, MB), {result['memory_pss_mb_total']} MB in all:\n\n| process tree | PSS MB |\n|---|---|\n"
        + memory
        + _profiles_text(result.get("profiles_two_step") or {})
        + "\nWhat has been changed so far, what each change bought, and what comes next: "
        "[performance.md](performance.md).\n"
    )


def _profiles_text(profiles: Mapping[str, Any]) -> str:
    """Where each profiled service's CPU goes under two-step runs (py-spy, the event loop on CPU)."""
    if not profiles:
        return ""
    out = [
        f"\nWhere the time goes under two-step runs ({PROFILE_S:.0f} s, {IN_FLIGHT} in flight; py-spy at "
        f"{_profile.RATE_HZ} Hz on each service's event loop, on CPU): the platform's functions with the largest "
        "share of the samples, with what they call, and the functions where the samples fell.\n"
    ]
    for name, summary in profiles.items():
        inclusive = "; ".join(f"{f} {share}%" for f, share in summary["inclusive"][:8])
        alone = "; ".join(f"{f} {share}%" for f, share in summary["self"][:5])
        out.append(f"\n- **{name}** ({summary['samples']} samples): {inclusive}. Self: {alone}.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else RUNS)
