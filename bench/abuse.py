"""One tenant at full tilt against another: the victim's latency and failures while a hostile tenant
attacks the stack through every door a tenant has, against the same victim on the idle stack.

On a fresh local stack (``fleet up``: NATS JetStream, Postgres, the coordinator and workers, the
specialists and MCP servers, the shipped policy bundle):

* victim (tenant ``acme``): the demo's run (invoice totals through the SQL analyst and the SQL MCP
  server, then the statistician's outliers) over A2A from send to completion, one after another;
  beside them, three reads of the run API one after another, 0.2 s between rounds (``GET /v1/runs``,
  and ``GET /v1/runs/{id}`` and ``GET /v1/runs/{id}/events`` of its newest completed run). First
  ``idle_s`` on the idle stack (the baseline), then ``attack_s`` while the hostile tenant attacks
  (from the moment its streams are open). Every request has a deadline; a request that fails (an
  error, a run not completed, its deadline passed) is a failure, and counts in the percentiles at the
  time it took (a timeout at its deadline).
* hostile tenant (``globex``), from a process of its own (the victim's client shares no event loop
  with the attacker's 10 MB bodies and hundreds of streams), all at once, until the victim's last request ends (then cut; bounded by
  the window and the victim's deadlines):
  - streams: ``streams`` ``GET /v1/runs/{id}/events`` and ``streams`` A2A ``SubscribeToTask`` on a run
    of its own waiting at the approval gate, held open;
  - large bodies: 10 MB to A2A ``SendMessage``, to the run API (``POST /v1/runs/{id}/signals``) and,
    unauthenticated, to the registry's ``/v1/enroll``, ``large_bodies`` of each at once;
  - huge SQL results: ``SELECT repeat('x', 200000000)`` and a many-row query, as direct MCP calls to
    ``mcp-sql`` with the tenant's token and as plan steps (``sql-query``) of runs it submits;
  - memory flood: ``memory_writes`` facts of adversarial PII-like text (``"1234 " * 3000``) through
    ``mcp-memory``'s ``remember_many``;
  - event flood: ``events`` events on ``fleet.events.globex.<source>.invoices.closed`` as a producer
    with credentials the registry issued, each starting a run through the trigger rule.

Both tenants call with the operator identity's tokens (one tenant in each), as the other benchmarks
do: a limit kept per principal rather than per tenant counts them together.

What each attack got back is counted by outcome (HTTP status and the body's error code, JSON-RPC
code, tool error code, exception type), never by expected names: a refusal (413, 429, ...) is an
outcome like any other. Postgres connection refusals: the ``too many clients`` / reserved-slot lines
Postgres and the services logged during the attack, and a probe that opens a connection as the
fleet's own role every second.

Targets (the full form): victim p99 under attack within 2x idle for every kind of request, no victim
failure, no Postgres connection refused.

Run: ``.venv/bin/python -m bench.abuse [--short] [ATTACK...]`` (starts and stops its own stack; ATTACK:
``streams``, ``"large bodies"``, ``SQL``, ``memory``, ``events``, to make only those).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import math
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import psycopg
from a2a.helpers import new_data_part, new_text_part
from a2a.types import Message, Role, SendMessageConfiguration, SendMessageRequest
from google.protobuf.json_format import MessageToDict

from bench.throughput import Fleet
from fleet.events import event_message
from fleet.natsconn import Credentials, connect
from fleetctl import producers_cli
from fleetctl.layout import StackLayout
from fleetctl.testing.e2e import TWO_STEPS, Stack
from fleetctl.testing.mcp import call
from fleetctl.testing.stack import running_shipped_stack

VICTIM, HOSTILE = "acme", "globex"
MB = 1024 * 1024
BODY_BYTES = 10 * MB
READ_DEADLINE_S = 20.0
READ_PAUSE_S = 0.2  # between the victim's rounds of reads
ATTACK_CALL_DEADLINE_S = 120.0  # one attack request; the window bounds them all
STREAM_SETUP_S = 3.0  # the streams are opened before the victim is measured under attack
HUGE_SQL = "SELECT repeat('x', 200000000) AS x"
MANY_ROWS = 5_000_000
MANY_ROWS_SQL = f"SELECT g, repeat('y', 100) AS pad FROM generate_series(1, {MANY_ROWS}) AS g"
PII_TEXT = "1234 " * 3000
MEMORY_BATCH = 10
EVENTS_IN_FLIGHT = 64
MESSAGE_ID = "message-id-to-fill"  # in the 10 MB A2A body, replaced by a fresh id for each send
WINDOW_CLOSED = "no answer when the window closed"
TRIGGERED = "fleet.events.invoices.closed"  # the shipped rule invoices-closed starts a run per event
REFUSED_CONNECTION = re.compile(r"too many clients|remaining connection slots|connection slots are reserved")
TARGET_P99_RATIO, TARGET_FAILURES, TARGET_REFUSALS = 2.0, 0, 0
SAYS = "abuse: "  # what the hostile process says to the bench, on its stdout
HOSTILE_READY_S = 90.0  # its waiting run, at the approval gate
A2A_PATH = "/a2a/jsonrpc"
A2A_HEADERS = {"A2A-Version": "1.0"}
# A refund over the shipped threshold: the run waits at the approval gate until someone answers.
WAITING_PLAN: dict[str, Any] = {
    "steps": [
        {"id": "refund", "skill": "issue-refund", "input": {"subject": "Contoso", "amount_cents": 25_000}}
    ]
}


ATTACKS = ("streams", "large bodies", "SQL", "memory", "events")


@dataclass(frozen=True, slots=True)
class Form:
    """How hard and how long: the full form is the benchmark, the short one its smoke test."""

    name: str
    idle_s: float
    attack_s: float
    streams: int  # of each kind
    large_bodies: int  # per target, at once
    sql_calls: int  # per statement and path
    memory_writes: int
    events: int
    run_deadline_s: float  # a victim run not completed by then is a failure
    attacks: tuple[str, ...] = ATTACKS  # which to make


FULL = Form(
    "full",
    idle_s=60,
    attack_s=300,
    streams=500,
    large_bodies=20,
    sql_calls=5,
    memory_writes=2_000,
    events=10_000,
    run_deadline_s=60,
)
SHORT = Form(
    "short",
    idle_s=10,
    attack_s=20,
    streams=40,
    large_bodies=2,
    sql_calls=1,
    memory_writes=100,
    events=300,
    run_deadline_s=15,
)


@dataclass
class Victim:
    """The victim's measured requests of one phase: latencies by kind, failures."""

    took_s: dict[str, list[float]] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)

    async def timed(self, kind: str, deadline_s: float, request: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                return await request
        except Exception as exc:  # (every way a request fails is counted)
            self.failures[kind] += 1
            if len(self.samples) < 10:
                self.samples.append(f"{kind}: {failure_outcome(exc)} {str(exc)[:200]}".strip())
            return None
        finally:
            self.took_s.setdefault(kind, []).append(time.perf_counter() - started)

    def summary(self) -> dict[str, Any]:
        return {
            kind: {
                "requests": len(took),
                "p50_ms": _ms(_quantile(took, 0.5)),
                "p99_ms": _ms(_quantile(took, 0.99)),
            }
            for kind, took in self.took_s.items()
        } | {"failures": sum(self.failures.values()), "failures_by_kind": dict(self.failures)}


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (with few samples, p99 is the slowest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _code_of(body: Any) -> str:
    """The error codes in a JSON body, wherever the service put them (``code``, ``error``,
    ``error.code``, ``error.data.code``, or the ``metadata.code`` of each ``google.rpc.ErrorInfo`` in
    ``error.data``, as the A2A SDK carries it: a JSON-RPC code and the fleet's own), or ''."""
    if not isinstance(body, dict):
        return ""
    error = body.get("error")
    inner = error if isinstance(error, dict) else {}
    data = inner.get("data")
    details = data if isinstance(data, list) else [data]
    found = [body.get("code"), error, inner.get("code")]
    for detail in details:
        if isinstance(detail, dict):
            metadata = detail.get("metadata")
            found.append((metadata if isinstance(metadata, dict) else detail).get("code"))
    codes = [str(v) for v in found if isinstance(v, (str, int)) and not isinstance(v, bool)]
    return " ".join(dict.fromkeys(codes))


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def http_outcome(response: httpx.Response, text: str) -> str:
    """``http <status>``, the error codes of its body (``text``), and whether it says when to retry."""
    code = _code_of(_json_or_none(text))
    retry = " (Retry-After)" if "retry-after" in response.headers else ""
    return f"http {response.status_code}" + (f" {code}" if code else "") + retry


def failure_outcome(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # the first cause in a task group
        exc = exc.exceptions[0]
    if isinstance(exc, TimeoutError):
        return "no answer by its deadline"
    return f"exception {type(exc).__name__}"


def tool_outcome(result: Any) -> str:
    """``ok`` or ``tool error`` with the ``[code]`` the fleet's tools put first in their message."""
    if not result.is_error:
        return "ok"
    text = " ".join(getattr(part, "text", "") for part in result.content)
    found = re.search(r"\[([a-z_]+)\]", text)
    return "tool error" + (f" {found.group(1)}" if found else "")


class Hostile:
    """The hostile tenant's attacks, each counting its outcomes until the attack window closes."""

    def __init__(self, fleet: Fleet, tmp: Path, form: Form) -> None:
        self.fleet, self.tmp, self.form = fleet, tmp, form
        self.endpoints = fleet.endpoints
        self.stack = Stack(fleet.layout, fleet.endpoints)
        self.outcomes: dict[str, Counter[str]] = {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(ATTACK_CALL_DEADLINE_S), limits=limits)
        self.waiting_run = ""
        self.streams_open = asyncio.Event()
        self.sql_runs: list[str] = []  # runs whose step is a huge query

    async def sql_run_states(self) -> None:
        """Where the runs with a huge query step got to when the window closed."""
        headers = await self.token("coordinator", ["agent:invoke"])
        for run_id in self.sql_runs:
            url = f"{self.endpoints['coordinator']}/v1/runs/{run_id}"

            async def state(u: str = url) -> str:
                response = await self.http.get(u, headers=headers, timeout=READ_DEADLINE_S)
                return (
                    f"run {response.json().get('state')}"
                    if response.is_success
                    else http_outcome(response, response.text)
                )

            await self.attempt("SQL plan-step runs at the window's end", state)

    def count(self, attack: str, outcome: str) -> None:
        self.outcomes.setdefault(attack, Counter())[outcome] += 1

    async def token(self, audience: str, scopes: list[str]) -> dict[str, str]:
        token = await self.fleet.tokens.token(audience, HOSTILE, scopes)
        return {"Authorization": f"Bearer {token}"}

    async def attempt(self, attack: str, request: Callable[[], Awaitable[str]]) -> None:
        """One request of an attack, its outcome counted."""
        try:
            async with asyncio.timeout(ATTACK_CALL_DEADLINE_S):
                self.count(attack, await request())
        except asyncio.CancelledError:
            self.count(attack, WINDOW_CLOSED)
            raise
        except Exception as exc:  # (a refusal or a crash is an outcome)
            self.count(attack, failure_outcome(exc))

    def unsent(self, attack: str, left: int) -> None:
        """Requests of ``attack`` not sent before the window closed."""
        if left:
            self.outcomes.setdefault(attack, Counter())["not sent when the window closed"] += left

    async def submit(self, plan: dict[str, Any], headers: Mapping[str, str]) -> tuple[str, str]:
        """A run sent with ``returnImmediately``: its outcome and task id."""
        request = SendMessageRequest(
            message=Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[new_data_part(plan)]),
            configuration=SendMessageConfiguration(return_immediately=True),
        )
        body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": MessageToDict(request)}
        response = await self.http.post(
            self.endpoints["coordinator"] + A2A_PATH, json=body, headers={**A2A_HEADERS, **headers}
        )
        try:
            task_id = str(response.json()["result"]["task"]["id"])
        except (ValueError, KeyError, TypeError):
            task_id = ""
        return http_outcome(response, response.text), task_id

    async def prepare(self) -> None:
        """The hostile tenant's run waiting at the approval gate, which its streams follow."""
        headers = await self.token("coordinator", ["agent:invoke"])
        _, task_id = await self.submit(WAITING_PLAN, headers)
        if not task_id:
            raise RuntimeError("the hostile tenant's waiting run was not accepted")
        url = f"{self.endpoints['coordinator']}/v1/runs/{task_id}"
        async with asyncio.timeout(60):
            while (await self.http.get(url, headers=headers)).json().get("state") != "waiting":  # noqa: ASYNC110  (a run's state is read, not announced)
                await asyncio.sleep(0.2)
        self.waiting_run = task_id

    async def streams(self) -> None:
        headers = await self.token("coordinator", ["agent:invoke"])
        events_url = f"{self.endpoints['coordinator']}/v1/runs/{self.waiting_run}/events"
        subscribe = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SubscribeToTask",
            "params": {"id": self.waiting_run},
        }
        opened = [0]

        async def hold(kind: str, request: httpx.Request) -> None:
            try:
                response = await self.http.send(request, stream=True)
            except asyncio.CancelledError:
                self.count(kind, WINDOW_CLOSED)
                raise
            except Exception as exc:
                self.count(kind, failure_outcome(exc))
                return
            finally:
                opened[0] += 1
                if opened[0] == 2 * self.form.streams:
                    self.streams_open.set()
            try:
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    text = (await response.aread())[:65536].decode(errors="replace")  # a refusal
                    self.count(kind, http_outcome(response, text))
                    return
                self.count(kind, http_outcome(response, "") + " stream opened")
                first = True
                async for line in response.aiter_lines():
                    if first and line.startswith("data:"):  # an error sent as the stream's first event
                        first = False
                        code = _code_of(_json_or_none(line.removeprefix("data:")))
                        if code:
                            self.count(kind, f"first event: error {code}")
                self.count(kind, "ended by the server")
            except Exception as exc:
                self.count(kind, "then " + failure_outcome(exc))
            finally:
                await response.aclose()

        no_read_timeout = httpx.Timeout(ATTACK_CALL_DEADLINE_S, read=None)
        requests = [
            (
                "event streams",
                self.http.build_request("GET", events_url, headers=headers, timeout=no_read_timeout),
            )
            for _ in range(self.form.streams)
        ] + [
            (
                "SubscribeToTask streams",
                self.http.build_request(
                    "POST",
                    self.endpoints["coordinator"] + A2A_PATH,
                    json=subscribe,
                    headers={**A2A_HEADERS, **headers},
                    timeout=no_read_timeout,
                ),
            )
            for _ in range(self.form.streams)
        ]
        async with asyncio.TaskGroup() as group:
            for kind, request in requests:
                group.create_task(hold(kind, request))

    async def large_bodies(self) -> None:
        headers = await self.token("coordinator", ["agent:invoke"])
        text = "x" * BODY_BYTES
        message = Message(role=Role.ROLE_USER, message_id=MESSAGE_ID, parts=[new_text_part(text)])
        a2a_body = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "SendMessage",
                "params": {"message": MessageToDict(message)},
            }
        ).encode()
        signal_body = json.dumps({"action": "input", "input": {"text": text}}).encode()
        enroll_body = json.dumps({"token": text}).encode()
        json_type = {"Content-Type": "application/json"}
        targets = [
            (
                "10 MB A2A SendMessage",
                self.endpoints["coordinator"] + A2A_PATH,
                a2a_body,
                {**A2A_HEADERS, **headers},
            ),
            (
                "10 MB run API signal",
                f"{self.endpoints['coordinator']}/v1/runs/{self.waiting_run}/signals",
                signal_body,
                headers,
            ),
            ("10 MB registry enroll, no token", self.endpoints["registry"] + "/v1/enroll", enroll_body, {}),
        ]

        async def post(url: str, body: bytes, sent: Mapping[str, str]) -> str:
            body = body.replace(MESSAGE_ID.encode(), uuid.uuid4().hex.encode())  # each message its own
            response = await self.http.post(url, content=body, headers={**json_type, **sent})
            return http_outcome(response, response.text)

        async with asyncio.TaskGroup() as group:
            for name, url, body, sent in targets:
                for _ in range(self.form.large_bodies):
                    group.create_task(self.attempt(name, partial(post, url, body, sent)))

    async def sql(self) -> None:
        token = (await self.token("mcp-sql", ["sql:query"]))["Authorization"].removeprefix("Bearer ")
        headers = await self.token("coordinator", ["agent:invoke"])

        async def direct(statement: str) -> str:
            return tool_outcome(await call(self.stack, "mcp-sql", token, "query", {"sql": statement}))

        async def as_step(statement: str) -> str:
            plan = {"steps": [{"id": "huge", "skill": "sql-query", "input": {"sql": statement}}]}
            outcome, task_id = await self.submit(plan, headers)
            if task_id:
                self.sql_runs.append(task_id)
            return outcome

        async with asyncio.TaskGroup() as group:
            for label, statement in (("repeat 200 MB", HUGE_SQL), (f"{MANY_ROWS:,} rows", MANY_ROWS_SQL)):
                for _ in range(self.form.sql_calls):
                    group.create_task(self.attempt(f"SQL {label}, direct MCP", partial(direct, statement)))
                    group.create_task(self.attempt(f"SQL {label}, plan step", partial(as_step, statement)))

    async def memory(self) -> None:
        token = (await self.token("mcp-memory", ["memory:read", "memory:write"]))["Authorization"][7:]
        batches = math.ceil(self.form.memory_writes / MEMORY_BATCH)

        async def write(batch: int) -> str:
            items = [{"text": f"{batch}-{i} {PII_TEXT}", "tier": "episodic"} for i in range(MEMORY_BATCH)]
            result = await call(self.stack, "mcp-memory", token, "remember_many", {"items": items})
            for item in (result.structured_content or {}).get("result", []) if not result.is_error else []:
                self.count("memory facts", f"{item.get('status', '?')} {item.get('code', '')}".strip())
            return tool_outcome(result)

        queue = list(range(batches))

        async def writer() -> None:
            while queue:
                batch = queue.pop()
                await self.attempt(f"memory writes ({MEMORY_BATCH} per call)", partial(write, batch))

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(4):
                    group.create_task(writer())
        finally:
            self.unsent(f"memory writes ({MEMORY_BATCH} per call)", len(queue))

    async def events(self) -> None:
        producer = f"abuse-{uuid.uuid4().hex[:8]}"
        seed_file = self.tmp / f"{producer}.seed"
        with contextlib.redirect_stdout(io.StringIO()):  # what the CLI prints to its user
            await producers_cli.issue(self.fleet.layout, producer, HOSTILE, ["billing"], 3600, seed_file)
        credentials = Credentials(principal=producer, nkey_seed=seed_file.read_text().strip())
        client = await connect(self.endpoints["nats"], producer, credentials=credentials)
        js = client.jetstream()
        queue = list(range(self.form.events))

        async def publisher() -> None:
            while queue:
                i = queue.pop()
                message = event_message(
                    TRIGGERED, tenant=HOSTILE, source="billing", type_="invoices.closed", data={"i": i}
                )

                async def publish(m: Any = message) -> str:
                    await js.publish(m.subject, m.payload, headers=m.headers, timeout=30)
                    return "acknowledged"

                await self.attempt("events published", publish)

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(EVENTS_IN_FLIGHT):
                    group.create_task(publisher())
        finally:
            self.unsent("events published", len(queue))
            async with asyncio.timeout(10):
                await client.close()


class Window:
    """The attack window: what runs in it is cut when it closes, at the latest at ``hard_until``
    (monotonic, the clock of asyncio's loop)."""

    def __init__(self, hard_until: float) -> None:
        self.hard_until = hard_until
        self.timeouts: list[asyncio.Timeout] = []

    async def within(self, work: Awaitable[None]) -> bool:
        """Run ``work`` until it ends (True) or the window closes (False)."""
        try:
            async with asyncio.timeout_at(self.hard_until) as timeout:
                self.timeouts.append(timeout)
                try:
                    await work
                finally:
                    self.timeouts.remove(timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        now = asyncio.get_running_loop().time()
        for timeout in self.timeouts:
            if not timeout.expired():
                timeout.reschedule(now)


async def _bounded(name: str, attack: Awaitable[None], window: Window, hostile: Hostile) -> None:
    """``attack`` until the window closes; what it had not finished is noted."""
    try:
        if not await window.within(attack):
            hostile.count(name, "still running when the window closed")
    except Exception as exc:  # (an attack that fails is reported, the bench goes on)
        hostile.count(name, f"attack stopped: {failure_outcome(exc)}: {str(exc)[:120]}")


async def _victim_loop(fleet: Fleet, victim: Victim, until: float, run_deadline_s: float, run_id: str) -> str:
    """The victim's workload until ``until`` (monotonic): runs one after another, and beside them
    reads one after another (``READ_PAUSE_S`` apart) of the newest run that completed (``run_id`` at
    first); returns the newest."""
    newest = [run_id]

    async def runs() -> None:
        while time.monotonic() < until:
            done = await victim.timed("run", run_deadline_s, fleet.run(TWO_STEPS, VICTIM))
            newest[0] = done or newest[0]

    async def reads() -> None:
        while time.monotonic() < until:
            await _victim_reads(fleet, victim, newest[0])
            await asyncio.sleep(READ_PAUSE_S)

    async with asyncio.TaskGroup() as group:
        group.create_task(runs())
        group.create_task(reads())
    return newest[0]


async def _victim_reads(fleet: Fleet, victim: Victim, run_id: str) -> None:
    """The three reads. The token is the client's (cached), bounded but not timed."""
    http, base = fleet.http, fleet.endpoints["coordinator"]
    try:
        async with asyncio.timeout(READ_DEADLINE_S):
            headers = dict((await fleet.context(VICTIM)).service_parameters or {})
    except Exception as exc:  # (no token: the reads fail)
        victim.failures["token"] += 1
        victim.samples.append(f"token: {failure_outcome(exc)}")
        return

    async def read(url: str) -> httpx.Response:
        response = await http.get(url, headers=headers)
        response.raise_for_status()
        return response

    await victim.timed("GET /v1/runs", READ_DEADLINE_S, read(f"{base}/v1/runs"))
    await victim.timed("GET /v1/runs/{id}", READ_DEADLINE_S, read(f"{base}/v1/runs/{run_id}"))
    await victim.timed("GET /v1/runs/{id}/events", READ_DEADLINE_S, read(f"{base}/v1/runs/{run_id}/events"))


class PostgresWatch:
    """Connection refusals: lines Postgres and the services log, and a probe as the fleet's role."""

    def __init__(self, layout: StackLayout, endpoints: Mapping[str, Any]) -> None:
        password = (layout.keys_dir / "postgres-fleet-password.secret").read_text().strip()
        self.dsn = f"postgresql://fleet:{password}@127.0.0.1:{endpoints['postgres_port']}/fleet"
        self.logs = sorted(layout.home.joinpath("logs").glob("*.log"))
        self.offsets: dict[Path, int] = {}
        self.probe_refusals, self.probes, self.backends_max, self.max_connections = 0, 0, 0, 0
        self.probe_samples: list[str] = []

    def mark(self) -> None:
        self.offsets = {path: path.stat().st_size for path in self.logs}

    def refusals_logged(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for path in self.logs:
            with path.open("rb") as fh:
                fh.seek(self.offsets.get(path, 0))
                lines = sum(1 for line in fh if REFUSED_CONNECTION.search(line.decode(errors="replace")))
            if lines:
                found[path.stem] = lines
        return found

    async def probe(self) -> None:
        """Every second, until cancelled or cut by the window."""
        while True:
            self.probes += 1
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=5) as conn:
                    query = "SELECT count(*), current_setting('max_connections')::int FROM pg_stat_activity"
                    row = await (await conn.execute(query)).fetchone()
                    if row:
                        self.backends_max = max(self.backends_max, int(row[0]))
                        self.max_connections = int(row[1])
            except psycopg.Error as exc:
                self.probe_refusals += 1
                if len(self.probe_samples) < 3:
                    self.probe_samples.append(str(exc).strip()[:200])
            await asyncio.sleep(1)


def hostile_process(spec_file: Path) -> None:
    """The hostile tenant, in a process of its own (``python -m bench.abuse --hostile SPEC``): its
    waiting run, then ``ready``; on ``go`` (a line on stdin) every attack of the form, ``streams open``
    once its streams are held, until ``stop`` (or stdin's end) or the window's hard end; then the
    outcomes, as JSON, to the spec's ``out`` file. What it says is on stdout, lines prefixed
    :data:`SAYS`."""
    spec = json.loads(spec_file.read_text())
    outcomes: dict[str, Counter[str]] = {}
    try:
        asyncio.run(_hostile(spec, outcomes))
    finally:
        counted = {name: dict(counts.most_common()) for name, counts in sorted(outcomes.items())}
        Path(spec["out"]).write_text(json.dumps(counted))


async def _hostile(spec: dict[str, Any], outcomes: dict[str, Counter[str]]) -> None:
    form = Form(**(spec["form"] | {"attacks": tuple(spec["form"]["attacks"])}))
    layout = StackLayout.at(Path(spec["home"]))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    def say(what: str) -> None:
        print(SAYS + what, flush=True)

    async def line() -> str:
        return str(await asyncio.to_thread(sys.stdin.readline)).strip()

    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0), limits=limits) as http:
        hostile = Hostile(Fleet(layout, spec["endpoints"], http), Path(spec["tmp"]), form)
        hostile.outcomes = outcomes
        try:
            await hostile.prepare()
            say("ready")
            if await line() != "go":
                return
            loop = asyncio.get_running_loop()
            window = Window(loop.time() + form.attack_s + form.run_deadline_s + READ_DEADLINE_S)
            attacks = {
                "streams": hostile.streams,
                "large bodies": hostile.large_bodies,
                "SQL": hostile.sql,
                "memory": hostile.memory,
                "events": hostile.events,
            }

            async def announce_streams() -> None:
                await hostile.streams_open.wait()
                say("streams open")

            async def until_stopped() -> None:
                await line()  # "stop", or the end of stdin
                window.close()

            async with asyncio.TaskGroup() as group:
                for name in form.attacks:
                    group.create_task(_bounded(name, attacks[name](), window, hostile))
                group.create_task(window.within(announce_streams()))
                group.create_task(until_stopped())
            await hostile.sql_run_states()
        finally:
            await hostile.http.aclose()


class HostileProcess:
    """The parent's end of :func:`hostile_process`: the victim's client and the attacker's do not
    share an event loop (or a process), as they would not in the field: an attacker's own client work
    (10 MB bodies, hundreds of streams) is not counted in the victim's latency."""

    def __init__(self, layout: StackLayout, endpoints: Mapping[str, Any], form: Form, tmp: Path) -> None:
        self.spec = tmp / "hostile.json"
        self.out, self.log = tmp / "hostile-outcomes.json", tmp / "hostile.log"
        spec = {
            "home": str(layout.home),
            "endpoints": dict(endpoints),
            "form": dataclasses.asdict(form),
            "tmp": str(tmp),
            "out": str(self.out),
        }
        self.spec.write_text(json.dumps(spec))
        self.said: dict[str, asyncio.Event] = {"ready": asyncio.Event(), "streams open": asyncio.Event()}
        self.proc: asyncio.subprocess.Process | None = None
        self.listening: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The process, once its waiting run waits at the approval gate."""
        with self.log.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.abuse", "--hostile", str(self.spec),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            )  # fmt: skip
        self.listening = asyncio.create_task(self._listen())
        try:
            async with asyncio.timeout(HOSTILE_READY_S):
                await self.said["ready"].wait()
        except TimeoutError:
            raise RuntimeError(f"the hostile process was not ready: {self._log_tail()}") from None

    async def _listen(self) -> None:
        assert self.proc and self.proc.stdout
        async for raw in self.proc.stdout:
            text = raw.decode(errors="replace").strip()
            if text.startswith(SAYS) and text.removeprefix(SAYS) in self.said:
                self.said[text.removeprefix(SAYS)].set()

    async def send(self, line: str) -> None:
        assert self.proc and self.proc.stdin
        with contextlib.suppress(ConnectionError):  # (it ended already: its log says why)
            self.proc.stdin.write(line.encode() + b"\n")
            await self.proc.stdin.drain()

    async def outcomes(self) -> dict[str, dict[str, int]]:
        """Stop the attacks; what they got back once the process has ended."""
        assert self.proc and self.proc.stdin
        await self.send("stop")
        self.proc.stdin.close()
        try:
            async with asyncio.timeout(ATTACK_CALL_DEADLINE_S + 60):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            raise RuntimeError(f"the hostile process did not stop: {self._log_tail()}") from None
        if not self.out.exists():
            raise RuntimeError(f"the hostile process ended {self.proc.returncode}: {self._log_tail()}")
        return dict(json.loads(self.out.read_text()))

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    async def close(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self.listening:
            self.listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.listening


async def _attack_phase(
    fleet: Fleet, hostile: HostileProcess, watch: PostgresWatch, form: Form, run_id: str
) -> tuple[Victim, dict[str, dict[str, int]]]:
    """The victim under attack, and what each attack got back."""
    until = time.monotonic() + form.attack_s
    watch.mark()
    await hostile.send("go")
    victim = Victim()
    probing = asyncio.create_task(watch.probe())
    try:
        if "streams" in form.attacks:  # the victim is measured with the streams held
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STREAM_SETUP_S + form.streams * 0.05):
                    await hostile.said["streams open"].wait()
        await _victim_loop(fleet, victim, until, form.run_deadline_s, run_id)
    finally:
        probing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probing
    return victim, await hostile.outcomes()


def _ratios(idle: dict[str, Any], attacked: dict[str, Any], quantile: str) -> dict[str, float | None]:
    """Attacked over idle, by kind of request (None where a side has nothing to compare)."""
    return {
        kind: round(attacked[kind][quantile] / idle[kind][quantile], 2)
        if kind in attacked and idle[kind][quantile]
        else None
        for kind in idle
        if isinstance(idle[kind], dict) and quantile in idle[kind]
    }


async def measure(layout: StackLayout, endpoints: dict[str, Any], form: Form, tmp: Path) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0), limits=limits) as http:
        fleet = Fleet(layout, endpoints, http)
        took = {"warm-up": time.monotonic()}
        async with asyncio.timeout(4 * form.run_deadline_s):
            run_id = await fleet.run(TWO_STEPS, VICTIM)
        idle = Victim()
        took["idle"] = time.monotonic()
        run_id = await _victim_loop(fleet, idle, time.monotonic() + form.idle_s, form.run_deadline_s, run_id)
        hostile = HostileProcess(layout, endpoints, form, tmp)
        watch = PostgresWatch(layout, endpoints)
        try:
            took["waiting run"] = time.monotonic()
            await hostile.start()
            took["attack"] = time.monotonic()
            attacked, outcomes = await _attack_phase(fleet, hostile, watch, form, run_id)
            took["end"] = time.monotonic()
        finally:
            await hostile.close()
    phases = list(took.items())
    idle_summary, attacked_summary = idle.summary(), attacked.summary()
    ratios = _ratios(idle_summary, attacked_summary, "p99_ms")
    known = [r for r in ratios.values() if r is not None]
    logged = watch.refusals_logged()
    refusals = sum(logged.values()) + watch.probe_refusals
    worst = max(known) if known else None
    return {
        "benchmark": "abuse",
        "form": form.name,
        "victim_tenant": VICTIM,
        "hostile_tenant": HOSTILE,
        "idle_s": form.idle_s,
        "attack_s": form.attack_s,
        "attacks_made": list(form.attacks),
        "load": {
            "streams_each": form.streams,
            "large_bodies_each": form.large_bodies,
            "body_bytes": BODY_BYTES,
            "sql_calls_each": form.sql_calls,
            "memory_writes": form.memory_writes,
            "events": form.events,
        },
        "idle": idle_summary,
        "attacked": attacked_summary,
        "p99_ratio": ratios,
        "p50_ratio": _ratios(idle_summary, attacked_summary, "p50_ms"),
        "worst_p99_ratio": worst,
        "victim_failures": attacked_summary["failures"],
        "victim_failures_idle": idle_summary["failures"],
        "victim_failure_samples": attacked.samples,
        "postgres_refusals": refusals,
        "postgres_refusals_logged": logged,
        "postgres_probe": {
            "tries": watch.probes,
            "refused": watch.probe_refusals,
            "samples": watch.probe_samples,
            "backends_max": watch.backends_max,
            "max_connections": watch.max_connections,
        },
        "attacks": outcomes,
        "took_s": {name: round(phases[i + 1][1] - at, 1) for i, (name, at) in enumerate(phases[:-1])},
        "target_p99_ratio": TARGET_P99_RATIO,
        "target_victim_failures": TARGET_FAILURES,
        "target_postgres_refusals": TARGET_REFUSALS,
        "target_met": worst is not None
        and worst <= TARGET_P99_RATIO
        and attacked_summary["failures"] == TARGET_FAILURES
        and refusals == TARGET_REFUSALS,
    }


def main(quick: bool = False, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """The full form, or the short one if ``quick``; ``only``: these attacks alone (names in
    :data:`ATTACKS`), to see what one of them does."""
    form = SHORT if quick else FULL
    if only:
        unknown = set(only) - set(ATTACKS)
        if unknown:
            raise SystemExit(f"unknown attacks {sorted(unknown)}; known: {list(ATTACKS)}")
        form = dataclasses.replace(form, attacks=only)
    started = time.monotonic()
    with (
        TemporaryDirectory(prefix="fleet-bench-") as tmp,
        running_shipped_stack(Path(tmp) / "fleet") as (layout, endpoints),
    ):
        up_s = time.monotonic() - started
        result = asyncio.run(measure(layout, endpoints, form, Path(tmp)))
        stopping = time.monotonic()
    result["took_s"] = {"stack up": round(up_s, 1), **result["took_s"]}
    result["took_s"]["stack down"] = round(time.monotonic() - stopping, 1)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--hostile"]:
        hostile_process(Path(args[1]))
    else:
        main(quick="--short" in args, only=tuple(a for a in args if a != "--short"))


def _verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def summary_row(result: Mapping[str, Any]) -> str:
    """The target's row in the page's summary table."""
    idle, attacked = result["idle"]["run"], result["attacked"].get("run", {})
    return (
        f"| one tenant at full tilt against another: the victim's runs and reads ({result['form']} form) "
        f"| the same victim on the idle stack | run p99 {idle['p99_ms']} ms "
        f"| run p99 {attacked.get('p99_ms', '-')} ms; {result['victim_failures']} victim failures, "
        f"{result['postgres_refusals']} Postgres refusals | **{result['worst_p99_ratio']}x** (worst p99) "
        f"| <= {result['target_p99_ratio']:.0f}x, 0 failures, 0 refusals ({_verdict(result['target_met'])}) |"
    )


def _victim_rows(result: Mapping[str, Any]) -> str:
    idle, attacked = result["idle"], result["attacked"]
    rows = ""
    for kind, ratio in result["p99_ratio"].items():
        was, now = idle[kind], attacked.get(kind, {"requests": 0, "p50_ms": "-", "p99_ms": "-"})
        rows += (
            f"| `{kind}` | {was['requests']} | {was['p50_ms']} ms | {was['p99_ms']} ms | {now['requests']} "
            f"| {now['p50_ms']} ms | {now['p99_ms']} ms | {result['p50_ratio'].get(kind)}x | **{ratio}x** "
            f"| {attacked['failures_by_kind'].get(kind, 0)} |\n"
        )
    return rows


def _attack_rows(result: Mapping[str, Any]) -> str:
    return "".join(
        f"| {name} | {', '.join(f'{outcome}: {count}' for outcome, count in outcomes.items())} |\n"
        for name, outcomes in result["attacks"].items()
    )


# What earlier code measured, kept on the page beside the current numbers (they are not re-measured).
EARLIER = """
Earlier measurements, same machine. The short form (10 s idle as the baseline in the same run, then
20 s of attack with 40 streams of each kind, 2 bodies per target, 1 SQL statement of each kind per
path, 100 memory facts, 300 events; the hostile tenant's client then shared the victim's process):

| victim request | before the limits (90178d2): idle p99 → attacked p99, ratio | with the limits (dd51c13) | with per-tenant caps on runs in flight and shares of scan threads (12e6465) |
|---|---|---|---|
| run (send to completion) | 671 → 15,009 ms (cut at the deadline), 22x | 1,663 → 10,920 ms, 6.6x | 1,145 → 2,359 ms, 2.1x (p50 145 → 398 ms, 2.7x) |
| `GET /v1/runs` | 27 → 4,944 ms, 184x | 44 → 2,384 ms, 54x | 12 → 104 ms, 8.4x |
| `GET /v1/runs/{id}` | 21 → 214 ms, 10x | 66 → 391 ms, 5.9x | 9.5 → 36 ms, 3.8x |
| `GET /v1/runs/{id}/events` | 96 → 2,267 ms, 24x | 117 → 916 ms, 7.8x | 100 → 190 ms, 1.9x |
| victim failures under attack | 2 | 0 | 0 |
| Postgres connections refused (most backends) | 0 (137) | 0 (51) | 0 (52) |

The short form's 2.1x for the run was flattered by its baseline: about one idle run in ten waited
about a second for a worker's poll (idle p99 1.1 s for a p50 of 145 ms); workers now wake on a
doorbell (c6cf344) and the idle p99 is about 200 ms. The full form (60 s idle, 300 s of attack, 500
streams of each kind, 20 bodies per target, 5 statements of each kind per path, 2,000 memory facts,
10,000 events; the hostile tenant in a process of its own), before this page's run:

| code | run p50 ratio | run p99: idle → attacked, ratio | reads' p99 ratios |
|---|---|---|---|
| the ingest on a pool of its own, the doorbell (92863a7) | 3.48x | 193 → 1,206 ms, 6.2x | 3.7x, 3.2x, 4.6x |
| a tenant's share of runs in flight 1 while another has work (36b28ad) | 3.35x | 247 → 1,675 ms, 6.8x | 0.35x, 2.1x, 3.0x |

Where the CPU went in the attack's first minute (36b28ad, per service process tree, of the 2 cores'
200%): mcp-memory 57% (the memory flood's scans), coordinator 34% (25% idle: the event ingest and the
held streams), workers 39% (55% idle), NATS 14% (7% idle); the victim alone keeps the stack at about
127% before its client and Postgres.

Why the target is missed: every refusal holds (bodies, streams, SQL bytes, connections), no victim
request fails and Postgres refuses nobody, but the hostile tenant's admitted work (its scans, its
share of runs in flight, its ingest) still takes most of two cores that every service shares, and the
victim's run crosses about fifteen process hops, each waiting for a core. The shares bound what a
tenant holds (threads, slots, connections), not the CPU it burns inside them; meeting 2x on a shared
2-core host needs a CPU share per tenant in the services that burn it (memory scans first).
"""


def section(result: Mapping[str, Any]) -> str:
    """The page's section on one tenant at full tilt against another."""
    load, probe = result["load"], result["postgres_probe"]
    logged = ", ".join(f"{name} {n}" for name, n in result["postgres_refusals_logged"].items()) or "none"
    samples = "".join(f"- `{sample}`\n" for sample in result["victim_failure_samples"])
    return (
        "\n## One tenant at full tilt against another (`bench/abuse.py`)\n\n"
        f"{result['measured_on']}\n\n"
        f"The victim (`{result['victim_tenant']}`) runs the demo's run (invoice totals through the SQL "
        "analyst and the SQL MCP server, then outliers) over A2A, send to completion, one after another, "
        f"and beside them reads the run API (the list, its newest run, that run's events), "
        f"{READ_PAUSE_S} s between rounds: {result['idle_s']} s on the idle stack, then "
        f"{result['attack_s']} s while `{result['hostile_tenant']}` attacks with, at once: "
        f"{load['streams_each']} run event streams and {load['streams_each']} A2A `SubscribeToTask` "
        f"streams held on a run of its own waiting at the approval gate; {load['large_bodies_each']} "
        f"bodies of {load['body_bytes'] // MB} MB each to A2A `SendMessage`, the run API's signals and "
        f"the registry's `/v1/enroll` (no token); `{HUGE_SQL}` and a "
        f"{MANY_ROWS:,}-row query, {load['sql_calls_each']} of each as a direct MCP call and as a plan step; "
        f'{load["memory_writes"]:,} memory facts of `"1234 " * 3000`; {load["events"]:,} events as a '
        "producer, each starting a run through the trigger rule. A victim request that fails or passes "
        "its deadline is a failure and counts in the percentiles at the time it took.\n\n"
        + (
            f"**Only these attacks were made**: {', '.join(result['attacks_made'])}.\n\n"
            if len(result.get("attacks_made", ATTACKS)) < len(ATTACKS)
            else ""
        )
        + "| victim request | idle: requests | idle p50 | idle p99 | attacked: requests | attacked p50 "
        "| attacked p99 | p50 ratio | p99 ratio | failures under attack |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        f"{_victim_rows(result)}\n"
        f"Targets: victim p99 within {result['target_p99_ratio']:.0f}x of idle for every request "
        f"(worst **{result['worst_p99_ratio']}x**), no victim failure (**{result['victim_failures']}**), "
        f"no Postgres connection refused (**{result['postgres_refusals']}**): "
        f"{_verdict(result['target_met'])}.\n\n"
        f"Postgres: refusals logged during the attack: {logged}; a probe connecting as the fleet's role "
        f"every second was refused {probe['refused']} times of {probe['tries']}; at most "
        f"{probe['backends_max']} backends seen (`max_connections` {probe['max_connections']}).\n\n"
        + (f"Victim failures (first of them):\n\n{samples}\n" if samples else "")
        + "What each attack got back (outcome: count):\n\n| attack | outcomes |\n|---|---|\n"
        + _attack_rows(result)
        + EARLIER
    )
