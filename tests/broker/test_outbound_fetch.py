"""Fetches of URLs that agents, partners and callers name (``fleet.outbound``), attacked with real
servers on this machine and the real policy: a card that drips, one too large, one on an internal
address or another host, a card path pushed into a query string, a DNS answer that changes after
the check, a partner's token endpoint on loopback; and the registry's checks of many cards at once
on a real NATS, where slow agents delay none of the others."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from a2a.server.context import ServerCallContext
from a2a.types import AgentSkill, Message, Part, Role, Task, TaskPushNotificationConfig
from google.protobuf.json_format import MessageToDict
from nats.js.errors import NotFoundError
from psycopg_pool import AsyncConnectionPool

from coordinator.a2a_surface.push import PostgresPushConfigStore, PushDispatcher, PushSigner, PushUrlPolicy
from coordinator.a2a_surface.task_store import PostgresTaskStore
from coordinator.record.access import RunAccess
from coordinator.record.runs import PostgresRunStore, RunState
from fleet import outbound
from fleet.a2a_support import build_card, sign_card
from fleet.errors import ErrorCode, FleetError
from fleet.issuer_certs import CertifiedKey, IssuerTrust, certify_issuer_key
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.tokens import Claims, TokenClient
from policy import DEFAULT_BUNDLE_DIR, RegorusEngine
from registry._cards import CARD_PATH, fetch_verified_card
from registry._records import AgentRecord, IdentityRecord
from registry._refresh import refresh_all
from registry._seal import RecordSeal
from registry._skills import SkillBinding
from registry._store import RECORDS_BUCKET, RegistryStore

Handler = Callable[[asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


class Origin:
    """A bare HTTP/1.1 server that answers each path as its handler says and records what it was
    asked (the request line and the ``Host`` header)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.routes: dict[str, Handler] = {}
        self.requests: list[tuple[str, str]] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> Origin:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._stop.set()  # a dripping handler stops
        await asyncio.gather(*self._handlers)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            target = head.split(" ")[1]
            host = next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                         if line.lower().startswith("host:")), "")  # fmt: skip
            self.requests.append((target, host))
            handler = self.routes.get(target.split("?")[0], answer(b"not here", status=404))
            await handler(writer, self._stop)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def answer(body: bytes, *, status: int = 200, length: bool = True) -> Handler:
    async def handle(writer: asyncio.StreamWriter, stop: asyncio.Event) -> None:
        sized = f"content-length: {len(body)}\r\n" if length else ""
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{sized}connection: close\r\n\r\n".encode()
        )
        writer.write(body)
        await writer.drain()

    return handle


def drip(every_s: float, total: int = 1000) -> Handler:
    """Promise ``total`` bytes and send one every ``every_s`` (the card that never finishes)."""

    async def handle(writer: asyncio.StreamWriter, stop: asyncio.Event) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {total}\r\n\r\n{{".encode())
        await writer.drain()
        for _ in range(total - 1):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            if stop.is_set():
                return
            writer.write(b" ")
            await writer.drain()

    return handle


def engine_with(root: Path, **fetch: Any) -> RegorusEngine:
    """The installed bundle with ``config.limits.fetch.purposes.card`` changed as ``fetch`` says."""
    shutil.copytree(DEFAULT_BUNDLE_DIR, root)
    data = json.loads((root / "data.json").read_text())
    data["config"]["limits"]["fetch"]["purposes"]["card"].update(fetch)
    (root / "data.json").write_text(json.dumps(data))
    return RegorusEngine.from_dir(root)


POLICY = RegorusEngine.from_dir()
SKILL = "sql-query"  # held inside the fleet by policy: an internal identity enrolled for it offers it


def identity(agent_id: str, key: SigningKey, *, external: bool = False) -> IdentityRecord:
    return IdentityRecord(
        id=agent_id, kind="specialist", keys={key.kid: key.public_jwk()}, skills=[SKILL],
        external=external, enrolled_at=0,
    )  # fmt: skip


def card_body(key: SigningKey, base_url: str, version: str = "1") -> bytes:
    card = build_card(
        name="agent", description="d", version=version, base_url=base_url,
        skills=[AgentSkill(id=SKILL, name=SKILL, description="d", tags=["t"])],
        token_url="https://registry.example/oauth/token", required_scope="agent:invoke",
    )  # fmt: skip
    return json.dumps(MessageToDict(sign_card(card, key))).encode()


def resolver_of(answers: dict[str, list[list[str]]], calls: list[str]) -> outbound.Resolver:
    """DNS that answers each name with its next answer (the last one again once used up)."""

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        given = answers[host]
        return given.pop(0) if len(given) > 1 else given[0]

    return resolve


# ---------------------------------------------------------------------------------- the client
async def test_a_dripping_card_is_refused_at_the_deadline_not_held_open(tmp_path: Path) -> None:
    key = SigningKey.generate()
    async with (
        Origin() as origin,
        outbound.guarded_client("card", engine_with(tmp_path / "b", deadline_s=1), local=True) as http,
    ):
        origin.routes[CARD_PATH] = drip(every_s=0.2)  # 200 s to finish; every read within 5 s
        started = time.monotonic()
        with pytest.raises(FleetError) as caught:
            await fetch_verified_card(http, identity("a", key), origin.url)
        elapsed = time.monotonic() - started
    assert caught.value.code == ErrorCode.FETCH_TIMEOUT and caught.value.retryable
    assert elapsed < 15.0, elapsed  # the deadline is 1 s; a generous bound on a loaded machine


@pytest.mark.parametrize("sized", [True, False], ids=["declared", "undeclared"])
async def test_a_card_larger_than_the_cap_is_refused(tmp_path: Path, sized: bool) -> None:
    key = SigningKey.generate()
    async with (
        Origin() as origin,
        outbound.guarded_client("card", engine_with(tmp_path / "b", max_bytes=4096), local=True) as http,
    ):
        body = card_body(key, origin.url)
        origin.routes[CARD_PATH] = answer(body[:-1] + b',"x":"' + b"a" * 100_000 + b'"}', length=sized)
        with pytest.raises(FleetError) as caught:
            await fetch_verified_card(http, identity("a", key), origin.url)
        assert caught.value.code == ErrorCode.FETCH_TOO_LARGE
        origin.routes[CARD_PATH] = answer(body)  # within the cap: fetched and verified
        record = await fetch_verified_card(http, identity("a", key), origin.url)
    assert record.card_url == origin.url + CARD_PATH


async def test_a_card_on_an_internal_address_is_refused_outside_the_local_stack() -> None:
    key = SigningKey.generate()
    async with Origin() as origin, outbound.guarded_client("card", POLICY, local=False) as http:
        origin.routes[CARD_PATH] = answer(card_body(key, origin.url))
        for agent in (identity("researcher", key), identity("partner", key, external=True)):
            with pytest.raises(FleetError) as caught:
                await fetch_verified_card(http, agent, origin.url)
            assert caught.value.code == ErrorCode.FETCH_REFUSED, agent.id
    assert origin.requests == []


async def test_a_card_on_its_agents_own_host_is_fetched_on_the_fleets_network() -> None:
    """An agent of the fleet registers at its own name (``https://researcher:8080`` in the
    manifests), which resolves to an internal address: that is fetched; the same address under
    another name (or another agent's) is not."""
    key = SigningKey.generate()
    calls: list[str] = []
    async with Origin() as origin:
        resolve = resolver_of({"researcher": [["127.0.0.1"]], "intranet": [["127.0.0.1"]]}, calls)
        async with outbound.guarded_client("card", POLICY, local=False, resolver=resolve) as http:
            own = f"http://researcher:{origin.port}"
            origin.routes[CARD_PATH] = answer(card_body(key, own))
            record = await fetch_verified_card(http, identity("researcher", key), own)
            assert record.url.startswith(own)
            with pytest.raises(FleetError) as caught:
                await fetch_verified_card(http, identity("researcher", key), f"http://intranet:{origin.port}")
            assert caught.value.code == ErrorCode.FETCH_REFUSED
    assert origin.requests == [(CARD_PATH, f"researcher:{origin.port}")]


async def test_a_card_path_cannot_be_moved_into_a_query_and_upstream_answers_do_not_leak() -> None:
    key = SigningKey.generate()
    async with Origin() as origin, outbound.guarded_client("card", POLICY, local=True) as http:
        origin.routes["/internal/api"] = answer(b'{"AccessKeyId": "AKIA-secret"}')
        for url in (
            f"{origin.url}/internal/api?x=",
            f"{origin.url}/internal/api#",
            f"http://u:p@127.0.0.1:{origin.port}",
        ):
            with pytest.raises(FleetError) as caught:
                await fetch_verified_card(http, identity("a", key), url)
            assert caught.value.code == ErrorCode.CARD_INVALID
        assert origin.requests == []  # the internal path was never asked for
        origin.routes[CARD_PATH] = answer(b'{"AccessKeyId": "AKIA-secret"}')
        with pytest.raises(FleetError) as caught:
            await fetch_verified_card(http, identity("a", key), origin.url)
        assert "AccessKeyId" not in caught.value.message and "AKIA" not in caught.value.message
        origin.routes[CARD_PATH] = answer(b"{}", status=403)
        with pytest.raises(FleetError) as caught:
            await fetch_verified_card(http, identity("a", key), origin.url)
        assert caught.value.code == ErrorCode.CARD_INVALID and "403" not in caught.value.message


async def test_the_connection_goes_to_the_address_that_was_checked_not_a_second_answer() -> None:
    """DNS rebinding: the name answers one address when checked and another right after. The
    request goes to the checked one (with the name in ``Host``); the second is never reached, nor
    asked for: the name is resolved once per request."""
    calls: list[str] = []
    async with Origin("127.0.0.1") as checked, Origin("127.0.0.2", checked.port) as rebound:
        checked.routes["/hook"] = rebound.routes["/hook"] = answer(b"{}")
        resolve = resolver_of({"hooks.example": [["127.0.0.1"], ["127.0.0.2"]]}, calls)
        async with outbound.guarded_client("webhook", POLICY, local=True, resolver=resolve) as http:
            response = await http.post(f"http://hooks.example:{checked.port}/hook", content=b"{}")
    assert response.status_code == 200
    assert checked.requests == [("/hook", f"hooks.example:{checked.port}")]
    assert rebound.requests == [] and calls == ["hooks.example"]


async def test_a_name_that_answers_any_internal_address_is_refused_and_no_redirect_is_followed() -> None:
    calls: list[str] = []
    answers = {"mixed.example": [["8.8.8.8", "127.0.0.1"]]}
    async with Origin() as internal:
        async with outbound.guarded_client(
            "webhook", POLICY, local=False, resolver=resolver_of(answers, calls)
        ) as http:
            with pytest.raises(FleetError) as caught:
                await http.post(f"http://mixed.example:{internal.port}/", content=b"{}")
            assert caught.value.code == ErrorCode.FETCH_REFUSED
        internal.routes["/go"] = answer(b"", status=302)
        async with outbound.guarded_client("webhook", POLICY, local=True) as http:
            response = await http.get(f"{internal.url}/go", headers={"x": "y"})
    assert response.status_code == 302 and internal.requests == [("/go", f"127.0.0.1:{internal.port}")]


# ------------------------------------------------------------------ a partner's token endpoint
async def test_a_partners_token_endpoint_on_loopback_is_refused_outside_the_local_stack() -> None:
    """A partner's card names ``http://127.0.0.1:8181/...`` (the OPA sidecar of a pod) as its token
    endpoint: the worker's form POST, with a client assertion, is not sent."""
    key = SigningKey.generate()
    async with Origin() as sidecar:
        sidecar.routes["/v1/data"] = answer(b'{"access_token": "t", "expires_in": 300}')
        async with outbound.guarded_client("token_endpoint", POLICY, local=False) as http:
            client = TokenClient(
                token_url=f"{sidecar.url}/v1/data", client_id="worker-1", key=key, http=http,
                control_plane=False,
            )  # fmt: skip
            with pytest.raises(FleetError) as caught:
                await client.token("https://partner.example", "acme", ["fraud"])
        assert caught.value.code == ErrorCode.FETCH_REFUSED
        assert sidecar.requests == []
        async with outbound.guarded_client("token_endpoint", POLICY, local=True) as http:
            client = TokenClient(
                token_url=f"{sidecar.url}/v1/data", client_id="worker-1", key=key, http=http,
                control_plane=False,
            )  # fmt: skip
            assert await client.token("https://partner.example", "acme", ["fraud"]) == "t"


# ---------------------------------------------------------------------- the registry's checks
ISSUER = "fleet-registry"


@contextlib.asynccontextmanager
async def registry_store(nats_url: str) -> AsyncIterator[RegistryStore]:
    client = await connect(nats_url, "registry")
    with contextlib.suppress(NotFoundError):
        await client.jetstream().delete_key_value(RECORDS_BUCKET)  # this test's own records
    operator, key = SigningKey.generate(), SigningKey.generate()
    seal = RecordSeal(IssuerTrust(operator.public_jwk(), ISSUER), lambda kid: False)
    seal.signer = CertifiedKey(key, certify_issuer_key(operator, ISSUER, key.public_jwk()))
    try:
        yield await RegistryStore.open(client, seal)
    finally:
        await client.drain()


async def enrolled_agent(store: RegistryStore, agent_id: str, key: SigningKey, base_url: str) -> None:
    await store.put_identity(identity(agent_id, key))
    record = AgentRecord(
        id=agent_id, kind="specialist", card_url=base_url + CARD_PATH, url=base_url + "/a2a",
        version="1", skills=[], card={}, registered_at=time.time(), status="healthy",
    )  # fmt: skip
    await store.put_agent(record)


async def test_slow_agents_delay_no_other_agents_check(nats_url: str, tmp_path: Path) -> None:
    """Eight agents whose cards drip, listed before a healthy one: the round of checks ends at
    about one deadline (they run at once), the healthy agent's new card is taken, and each slow
    agent counts a failed fetch. Checked one after another, the round would take eight deadlines."""
    deadline_s, slow = 2.0, 8
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(registry_store(nats_url))
        http = await stack.enter_async_context(
            outbound.guarded_client("card", engine_with(tmp_path / "b", deadline_s=deadline_s), local=True)
        )
        for n in range(slow):
            origin = await stack.enter_async_context(Origin())
            origin.routes[CARD_PATH] = drip(every_s=0.2)
            await enrolled_agent(store, f"a-slow-{n}", SigningKey.generate(), origin.url)
        good_key, good = SigningKey.generate(), await stack.enter_async_context(Origin())
        good.routes[CARD_PATH] = answer(card_body(good_key, good.url, version="2"))
        await enrolled_agent(store, "z-good", good_key, good.url)
        assert [a.id for a in await store.agents()][-1] == "z-good"  # checked last if in turn

        started = time.monotonic()
        await refresh_all(store, http, SkillBinding(POLICY))
        elapsed = time.monotonic() - started

        checked = await store.agent("z-good")
        assert checked is not None and (checked.version, checked.status) == ("2", "healthy")
        for n in range(slow):
            stalled = await store.agent(f"a-slow-{n}")
            assert stalled is not None and stalled.failures == 1, stalled
            assert "no complete answer" in stalled.status_reason
    assert elapsed < slow * deadline_s * 0.75, elapsed  # in turn: at least slow * deadline_s


# --------------------------------------------------------------------------------- push webhooks
async def test_a_webhook_that_resolves_to_loopback_at_delivery_is_not_posted_outside_the_local_stack(
    pg_dsn: str,
) -> None:
    """A webhook's name passed the check when its config was set (here: the operator's allow-list
    of the set step stands for an answer that was public then); at delivery it resolves to
    loopback. The coordinator's dispatcher posts nothing there and records why; on the local stack
    the same delivery goes through."""
    access = RunAccess(POLICY)
    owner = Claims("operator", "acme", "coordinator", frozenset({"agent:invoke"}), "jti", 0, {})
    context = ServerCallContext(state={"claims": owner})
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
    )
    async with pool, Origin() as receiver:
        runs, configs = (
            PostgresRunStore(pool),
            PostgresPushConfigStore(pool, PushUrlPolicy(["hooks.example"]), access),
        )
        tasks = PostgresTaskStore(pool, runs, access)
        for store in (runs, tasks, configs):
            await store.setup()
        receiver.routes["/hook"] = answer(b"{}")
        await runs.create_run("r-hook", "acme", "operator", {"text": "hi"}, [{"id": "s", "skill": "x"}])
        request = Message(role=Role.ROLE_USER, message_id="m1", parts=[Part(text="hi")])
        await tasks.save(Task(id="r-hook", context_id="ctx-r-hook", history=[request]), context)
        hook = TaskPushNotificationConfig(url=f"http://hooks.example:{receiver.port}/hook")
        await configs.set_info("r-hook", hook, context)
        lease = await runs.acquire_lease("r-hook", "w", ttl_s=30)
        assert lease is not None
        await runs.transition(lease, RunState.WORKING, "w", {})
        resolve = resolver_of({"hooks.example": [["127.0.0.1"]]}, [])
        signer = PushSigner(SigningKey.generate(), "coordinator", "https://coordinator.example/jwks.json")
        for local in (False, True):
            async with pool.connection() as conn:  # due now, whatever the backoff of a failure
                await conn.execute("UPDATE fleet_runs.push_configs SET next_attempt_at = now()")
            http = outbound.guarded_client("webhook", POLICY, local=local, resolver=resolve)
            async with http:
                assert await PushDispatcher(pool, tasks, runs, signer, http).deliver_due() == 1
            async with pool.connection() as conn:
                row = await (await conn.execute("SELECT last_error FROM fleet_runs.push_configs")).fetchone()
            assert row is not None
            if not local:
                assert row[0] is not None and json.loads(row[0])["code"] == "fetch_refused", row
                assert receiver.requests == []
        assert row[0] is None and receiver.requests[0] == ("/hook", f"hooks.example:{receiver.port}")
