"""Event streams under abuse, on a real Postgres, the real policy and a real HTTP server (uvicorn on
loopback) serving the coordinator's run API and A2A JSON-RPC with real token checks: one LISTEN
connection for any number of streams, caps per principal and per tenant refused with
``stream_limit``, slots given back when a client goes away, keep-alives on idle streams, and the
notifier reconnecting after its connection is killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn
from a2a.server.context import ServerCallContext
from a2a.types import AgentSkill, Message, Part, Role, Task
from cryptography.hazmat.primitives.asymmetric import ec
from langgraph.checkpoint.memory import InMemorySaver
from psycopg_pool import AsyncConnectionPool
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette

from coordinator.a2a_surface.executor import CoordinatorExecutor
from coordinator.a2a_surface.handler import CoordinatorRequestHandler
from coordinator.a2a_surface.task_store import PostgresTaskStore
from coordinator.control.run_api import RUNS_PREFIX, run_routes
from coordinator.control.signals import SignalDesk
from coordinator.control.streams import KEEPALIVE, Streams, StreamSlots, a2a_keepalives
from coordinator.record.access import RunAccess
from coordinator.record.notifier import RunNotifier
from coordinator.record.operations import Ledger
from coordinator.record.runs import Lease, PostgresRunStore, RunState
from fleet.a2a_support import RPC_PATH, a2a_app, build_card
from fleet.keys import SigningKey
from fleet.service import Readiness
from fleet.tokens import Claims, TokenVerifier
from policy import Bundle, RegorusEngine

ISSUER = "fleet-registry"
WAITING = RunState.WAITING


def engine_with(**caps: Any) -> RegorusEngine:
    """The real bundle, with ``config.limits.streams`` changed by ``caps``."""
    bundle = Bundle.load()
    data = json.loads(json.dumps(bundle.data))
    data["config"]["limits"]["streams"].update(caps)
    return RegorusEngine(bundle.with_data(data))


@dataclass
class Coordinator:
    """The coordinator's stream surfaces, served on loopback."""

    url: str
    key: SigningKey
    runs: PostgresRunStore
    tasks: PostgresTaskStore
    notifier: RunNotifier
    slots: StreamSlots

    def token(self, sub: str, tenant: str = "acme") -> str:
        now = int(time.time())
        return self.key.sign(
            {
                "iss": ISSUER,
                "sub": sub,
                "aud": "coordinator",
                "tenant": tenant,
                "scope": "agent:invoke",
                "iat": now,
                "exp": now + 600,
                "jti": uuid.uuid4().hex,
            }
        )

    async def waiting_run(self, run_id: str, tenant: str = "acme", owner: str = "alice") -> Lease:
        """A run (and its A2A task) that waits for someone, leased by a worker."""
        await self.runs.create_run(
            run_id, tenant, owner, {"text": "hi"}, [{"id": "p", "wait": {"for_s": 3600}}]
        )
        claims = Claims(owner, tenant, "coordinator", frozenset({"agent:invoke"}), "jti", 0, {})
        request = Message(role=Role.ROLE_USER, message_id=f"m-{run_id}", parts=[Part(text="hi")])
        task = Task(id=run_id, context_id=f"ctx-{run_id}", history=[request])
        await self.tasks.save(task, ServerCallContext(state={"claims": claims}))
        lease = await self.runs.acquire_lease(run_id, "w", ttl_s=600)
        assert lease is not None
        await self.runs.transition(lease, RunState.WORKING, "w", {})
        await self.runs.transition(lease, WAITING, "w", {}, wait={"type": "timer", "awaited": "p"})
        return lease


@contextlib.asynccontextmanager
async def coordinator(
    pg_dsn: str, engine: RegorusEngine, keepalive_s: float = 30.0
) -> AsyncIterator[Coordinator]:
    key = SigningKey.generate()
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    verifier = TokenVerifier(lookup, issuer=ISSUER, audience="coordinator")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, max_size=4, open=False, kwargs={"autocommit": True}
    )
    runs = PostgresRunStore(pool)
    tasks = PostgresTaskStore(pool, runs, RunAccess(engine))
    desk = SignalDesk(pool, runs, engine, submit=_nothing)
    notifier = RunNotifier(pg_dsn, backoff_s=0.05)
    slots = StreamSlots(engine)
    streams = Streams(notifier, slots, keepalive_s)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    card = build_card(
        name="coordinator",
        description="streams under test",
        version="0",
        base_url=url,
        skills=[AgentSkill(id="orchestrate", name="o", description="o", tags=["o"])],
        token_url=url + "/oauth/token",
        required_scope="agent:invoke",
    )
    # Never planned with here: a refused SendMessage must not reach the delegator at all.
    executor = CoordinatorExecutor(None, engine, runs, tasks, _nothing, streams, desk)  # type: ignore[arg-type]
    handler = CoordinatorRequestHandler(
        tasks=tasks, runs=runs, desk=desk, streams=streams, agent_executor=executor, agent_card=card
    )
    routes = run_routes(runs, Ledger(pool), _nothing, streams, InMemorySaver(), engine, desk)
    app = a2a_app(
        card=card,
        handler=handler,
        readiness=Readiness("coordinator", "coordinator"),
        verifier=verifier,
        required_scope="agent:invoke",
        lifespan=_no_lifespan,
        extra_routes=routes,
        protected_prefixes=(RPC_PATH, RUNS_PREFIX),
    )
    async with pool, notifier:
        await runs.setup()
        await tasks.setup()
        await desk.setup()
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:  # the socket listens already: requests wait in its backlog until uvicorn serves
            yield Coordinator(url, key, runs, tasks, notifier, slots)
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 30)
            sock.close()


@contextlib.asynccontextmanager
async def _no_lifespan(app: Starlette) -> AsyncIterator[None]:
    yield


async def _nothing(*args: Any) -> None:
    return None


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


class HeldStreams:
    """Open SSE streams held by one client, closed together at the end."""

    def __init__(self, http: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> None:
        self._http = http
        self._stack = stack

    async def open(self, url: str, token: str) -> httpx.Response:
        request = self._http.build_request("GET", url, headers={"authorization": f"Bearer {token}"})
        response = await self._http.send(request, stream=True)
        self._stack.push_async_callback(response.aclose)
        return response


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), limits=limits) as client:
        yield client


async def backends(dsn: str) -> int:
    """The server's client backends connected to this test's database."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


def events_url(c: Coordinator, run_id: str) -> str:
    return f"{c.url}/v1/runs/{run_id}/events"


async def test_streams_over_the_principal_cap_are_refused_with_429_and_the_slot_comes_back_on_disconnect(
    pg_dsn: str, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    async with coordinator(pg_dsn, engine_with(per_principal=3)) as c, contextlib.AsyncExitStack() as stack:
        await c.waiting_run("r1")
        held = HeldStreams(http, stack)
        alice = c.token("alice")
        opened = [await held.open(events_url(c, "r1"), alice) for _ in range(3)]
        assert [r.status_code for r in opened] == [200, 200, 200]

        refused = await http.get(events_url(c, "r1"), headers={"authorization": f"Bearer {alice}"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "stream_limit"
        assert "per principal" in refused.json()["error"]["message"]
        [logged] = [r.getMessage() for r in caplog.records if r.name == "coordinator.control.streams"]
        assert "principal alice of tenant acme has 3 open" in logged
        assert c.slots.open_for("acme", "alice") == 3

        # The client goes away: its slot is free again, and the same request now gets its stream.
        await opened[0].aclose()
        await until(lambda: c.slots.open_for("acme", "alice") == 2 and c.notifier.watching == 2)
        again = await held.open(events_url(c, "r1"), alice)
        assert again.status_code == 200


async def test_streams_over_the_tenant_cap_are_refused_and_another_tenant_still_streams(
    pg_dsn: str, http: httpx.AsyncClient
) -> None:
    engine = engine_with(per_principal=3, per_tenant=4)
    async with coordinator(pg_dsn, engine) as c, contextlib.AsyncExitStack() as stack:
        for owner in ("alice", "bob", "carol"):  # each principal follows its own run
            await c.waiting_run(f"r-{owner}", owner=owner)
        await c.waiting_run("g1", tenant="globex", owner="dave")
        held = HeldStreams(http, stack)
        statuses = [
            (await held.open(events_url(c, f"r-{sub}"), c.token(sub))).status_code
            for sub in ("alice", "alice", "alice", "bob", "carol")
        ]
        assert statuses == [200, 200, 200, 200, 429]  # carol is the tenant's fifth
        other = await held.open(events_url(c, "g1"), c.token("dave", "globex"))
        assert other.status_code == 200
        assert c.slots.open_for("acme") == 4 and c.slots.open_for("globex") == 1


async def test_streams_over_the_process_cap_are_refused_whatever_the_tenant(
    pg_dsn: str, http: httpx.AsyncClient
) -> None:
    async with coordinator(pg_dsn, engine_with(per_process=2)) as c, contextlib.AsyncExitStack() as stack:
        callers = [("a1", "acme", "alice"), ("g1", "globex", "dave"), ("i1", "initech", "erin")]
        for run_id, tenant, owner in callers:
            await c.waiting_run(run_id, tenant=tenant, owner=owner)
        held = HeldStreams(http, stack)
        answers = [await held.open(events_url(c, run), c.token(sub, tenant)) for run, tenant, sub in callers]
        assert [a.status_code for a in answers] == [200, 200, 429]
        assert "as many streams open as it serves" in json.loads(await answers[2].aread())["error"]["message"]


async def test_a_subscribe_over_the_cap_is_a_json_rpc_error_with_the_stable_code(
    pg_dsn: str, http: httpx.AsyncClient
) -> None:
    async with coordinator(pg_dsn, engine_with(per_principal=1)) as c, contextlib.AsyncExitStack() as stack:
        await c.waiting_run("r1")
        first = await HeldStreams(http, stack).open(events_url(c, "r1"), c.token("alice"))
        assert first.status_code == 200
        answer = await subscribe(http, c, "r1", c.token("alice"))
        assert answer.status_code == 200
        assert_refused(answer)
        assert c.slots.open_for("acme", "alice") == 1  # the refused call holds nothing


def assert_refused(answer: httpx.Response) -> None:
    """A JSON-RPC error (not a stream) with the stable code and when to try again."""
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == -32603 and error["message"].startswith("at most 1 streams")
    [info] = error["data"]  # the SDK carries the data as a google.rpc.ErrorInfo's metadata
    envelope = info["metadata"]  # the error's envelope, as data
    assert (envelope["code"], envelope["retryable"], envelope["retry_after_s"]) == ("stream_limit", True, 5)
    assert envelope["message"] == error["message"]


async def test_a_message_over_the_cap_is_refused_before_anything_is_planned_or_recorded(
    pg_dsn: str, http: httpx.AsyncClient
) -> None:
    async with coordinator(pg_dsn, engine_with(per_principal=1)) as c, contextlib.AsyncExitStack() as stack:
        await c.waiting_run("r1")
        first = await HeldStreams(http, stack).open(events_url(c, "r1"), c.token("alice"))
        assert first.status_code == 200
        for method in ("SendMessage", "SendStreamingMessage"):
            message = {"messageId": f"m-{method}", "role": "ROLE_USER", "parts": [{"text": "invoice totals"}]}
            body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {"message": message}}
            headers = {"authorization": f"Bearer {c.token('alice')}", "A2A-Version": "1.0"}
            answer = await http.post(c.url + RPC_PATH, json=body, headers=headers)
            assert_refused(answer)
        assert [r.run_id for r in await c.runs.list_runs("acme")] == ["r1"]  # no run was created
        assert c.slots.open_for("acme", "alice") == 1


async def subscribe(http: httpx.AsyncClient, c: Coordinator, task_id: str, token: str) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": task_id}}
    headers = {"authorization": f"Bearer {token}", "A2A-Version": "1.0"}
    return await http.post(c.url + RPC_PATH, json=body, headers=headers)


async def test_a_subscriber_that_goes_away_gives_its_slot_back(pg_dsn: str, http: httpx.AsyncClient) -> None:
    async with coordinator(pg_dsn, engine_with()) as c:
        await c.waiting_run("r1")
        body = {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": "r1"}}
        headers = {"authorization": f"Bearer {c.token('alice')}", "A2A-Version": "1.0"}
        async with http.stream("POST", c.url + RPC_PATH, json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    assert json.loads(line[5:])["result"]["task"]["id"] == "r1"
                    break
            assert c.slots.open_for("acme", "alice") == 1
            assert c.notifier.watching == 1
        await until(lambda: c.slots.open == 0 and c.notifier.watching == 0)


async def test_an_idle_stream_gets_keep_alives(pg_dsn: str, http: httpx.AsyncClient) -> None:
    async with coordinator(pg_dsn, engine_with(), keepalive_s=0.2) as c:
        await c.waiting_run("r1")
        headers = {"authorization": f"Bearer {c.token('alice')}"}
        seen: list[str] = []
        async with http.stream("GET", events_url(c, "r1"), headers=headers) as response, asyncio.timeout(10):
            async for line in response.aiter_lines():
                seen.append(line)
                if seen.count(KEEPALIVE.strip()) == 2:
                    break
        assert seen[0] == "id: 1" and KEEPALIVE.strip() in seen


@pytest.fixture
def a2a_ping() -> Iterator[None]:
    before = EventSourceResponse.DEFAULT_PING_INTERVAL
    a2a_keepalives(0.2)
    yield None
    EventSourceResponse.DEFAULT_PING_INTERVAL = before


async def test_an_idle_a2a_subscription_gets_keep_alives(
    pg_dsn: str, http: httpx.AsyncClient, a2a_ping: None
) -> None:
    async with coordinator(pg_dsn, engine_with()) as c:
        await c.waiting_run("r1")
        body = {"jsonrpc": "2.0", "id": 1, "method": "SubscribeToTask", "params": {"id": "r1"}}
        headers = {"authorization": f"Bearer {c.token('alice')}", "A2A-Version": "1.0"}
        pings = 0
        async with http.stream("POST", c.url + RPC_PATH, json=body, headers=headers) as response:
            async with asyncio.timeout(10):
                async for line in response.aiter_lines():
                    pings += line.startswith(": ping")
                    if pings == 2:
                        break
        assert pings == 2


async def test_many_streams_share_one_listen_connection_and_postgres_connections_stay_flat(
    pg_dsn: str, http: httpx.AsyncClient
) -> None:
    """The attack of H1: far more streams on one waiting run than Postgres has connections (200).
    The old code held one LISTEN connection per stream, and Postgres refused every new
    connection, for every tenant and service, from about the 190th."""
    streams = 260
    engine = engine_with(per_principal=1000, per_tenant=1000, per_process=1000)
    async with coordinator(pg_dsn, engine) as c, contextlib.AsyncExitStack() as stack:
        lease = await c.waiting_run("r1")
        await c.waiting_run("g1", tenant="globex", owner="dave")
        before = await backends(pg_dsn)
        held = HeldStreams(http, stack)
        opened = await asyncio.gather(
            *(held.open(events_url(c, "r1"), c.token("alice")) for _ in range(streams))
        )
        assert all(r.status_code == 200 for r in opened)
        await until(lambda: c.notifier.watching == streams)
        assert await backends(pg_dsn) <= before  # pool (4) + the one LISTEN connection, at most
        assert c.slots.open_for("acme", "alice") == streams

        # Every stream is woken by one notification and reads the new event.
        await c.runs.append(lease, "run.note", "w", {"text": "still waiting"})
        readers = [aiter(r.aiter_lines()) for r in opened[:20]]
        for reader in readers:
            async with asyncio.timeout(15):
                while not (await anext(reader)).startswith("event: run.note"):
                    pass

        # Another tenant's run still works: its stream gets its events, and Postgres takes new
        # connections.
        other = await held.open(events_url(c, "g1"), c.token("dave", "globex"))
        assert other.status_code == 200
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            assert await (await conn.execute("SELECT 1")).fetchone() == (1,)
        assert await backends(pg_dsn) <= before


async def test_the_notifier_reconnects_after_its_connection_is_killed_and_misses_nothing(
    pg_dsn: str,
) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}
    )
    async with pool, RunNotifier(pg_dsn, backoff_s=0.05) as notifier:
        runs = PostgresRunStore(pool)
        await runs.setup()
        await runs.create_run("r1", "acme", "alice", {})
        lease = await runs.acquire_lease("r1", "w", ttl_s=60)
        assert lease is not None
        seen: list[str] = []
        reading = asyncio.Event()

        async def read() -> None:
            async for event in runs.follow("r1", "acme", 0, notifier):
                seen.append(event.type)
                reading.set()

        reader = asyncio.create_task(read())
        async with asyncio.timeout(15):
            await reading.wait()
            killed = notifier.backend_pid
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_terminate_backend(%s)", (killed,))
            await runs.append(lease, "run.note", "w", {})  # committed while nobody may listen
            await until(lambda: notifier.listening and notifier.backend_pid not in (None, killed))
            await until(lambda: "run.note" in seen)
            await runs.transition(lease, RunState.COMPLETED, "w", {})
            await reader
        assert seen == ["run.submitted", "run.note", "run.completed"]
