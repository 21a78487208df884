"""The registry's bus door against a real ``nats-server`` configured as the fleet configures it:
credentials are renewed by closing a connection whose time is up (the client comes back with a fresh
assertion, checked again), a policy that refuses keeps an enrolled identity out, and one identity
holds no more connections at once than policy allows."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from fleet.buscatalog import provision
from fleet.buskeys import BusKeys, admin_credentials, stack_config
from fleet.issuer_certs import IssuerTrust
from fleet.keys import SigningKey
from fleet.natsconn import Credentials, connect
from fleet.revocations import Revocations
from fleetctl.testing.nats import embedded_nats
from policy._bundle import Bundle
from policy.engine import Decision
from policy.regorus_engine import RegorusEngine
from registry._callout import BusAuthority
from registry._records import IdentityRecord
from tests.nats_protocol import answer_to_connect


@dataclass
class Door:
    url: str
    authority: BusAuthority
    key: SigningKey
    requests: list[str]


class ShortLived:
    """The shipped bus policy, with connections renewed after ``ttl_s``."""

    def __init__(self, ttl_s: float, refuse: bool = False, connections: int | None = None) -> None:
        self._engine = RegorusEngine(Bundle.load())
        self._ttl_s = ttl_s
        self._refuse = refuse
        self._connections = connections

    async def decide(self, path: str, input_document: dict[str, Any], **_: Any) -> Decision:
        decision = await self._engine.decide(path, input_document)
        result = {**decision.result, "ttl_s": self._ttl_s}
        if self._connections is not None:
            result["connections"] = self._connections
        if self._refuse:
            result = {"allow": False, "reasons": ["refused by the test's policy"]}
        return Decision(
            decision.decision_id,
            decision.query,
            decision.revision,
            not self._refuse,
            tuple(result.get("reasons", [])),
            result,
        )


async def _door(
    tmp_path: Path,
    url: str,
    keys: BusKeys,
    policy: Any,
    key: SigningKey | None = None,
    store_answers: asyncio.Event | None = None,
    own_key: SigningKey | None = None,
) -> Door:
    """The registry's door on ``url``, with one enrolled identity, ``stats`` (of ``key``). A record
    read waits for ``store_answers`` when given (the store failing over: while it is clear, no read
    comes back), and for any identity but ``stats``, for ever."""
    key = key or SigningKey.generate()
    record = IdentityRecord(
        id="stats", kind="specialist", keys={key.kid: key.public_jwk()}, enrolled_at=time.time()
    )
    requests: list[str] = []

    async def identity(identity_id: str) -> IdentityRecord | None:
        if identity_id == "registry" and own_key is not None:  # itself: its own key, no store read
            return IdentityRecord(
                id="registry",
                kind="registry",
                keys={own_key.kid: own_key.public_jwk()},
                enrolled_at=time.time(),
            )
        requests.append(identity_id)
        if store_answers is not None:
            await store_answers.wait()
            if identity_id != record.id:
                await asyncio.Event().wait()
        return record if identity_id == record.id else None

    async def no_producer(nkey: str) -> None:
        return None

    revocations = Revocations(IssuerTrust(None, "fleet-registry"))
    authority = BusAuthority(
        keys={"callout_issuer": keys.callout_issuer, "responder": keys.responder, "system": keys.system},
        identities=identity,
        producers=no_producer,
        policy=policy,
        revocations=revocations,
        self_id="registry",
    )
    await authority.start(url)
    admin = await connect(url, "test-admin", credentials=admin_credentials(tmp_path / "keys"))
    await provision(admin)
    await revocations.follow(admin)
    await admin.close()
    return Door(url, authority, key, requests)


async def collect_what_nats_py_left() -> None:
    """nats-py 2.16 leaves the socket of a connection the server closed, or refused, to the garbage
    collector: collect it here (its ResourceWarning is nats-py's, not this test's subject) rather
    than in whichever test runs next."""
    await asyncio.sleep(0.1)  # the closed connection's tasks end
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[str, BusKeys]]:
    keys = BusKeys.load_or_create(tmp_path / "keys")
    with embedded_nats(stack_config(keys)) as url:
        yield url, keys


async def test_a_connection_whose_time_is_up_is_closed_and_comes_back_with_fresh_credentials(
    secured: tuple[str, BusKeys], tmp_path: Path
) -> None:
    url, keys = secured
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=0.5))
    reconnected = asyncio.Event()
    assertions: list[str] = []
    credentials = Credentials("stats", key=door.key)

    def assertion() -> str:
        assertions.append(credentials.assertion())
        return assertions[-1]

    async def on_reconnect() -> None:
        reconnected.set()

    options = credentials.connect_options() | {"token": assertion}
    client = await nats.connect(url, reconnected_cb=on_reconnect, reconnect_time_wait=0.1, **options)
    try:
        await asyncio.sleep(0.6)  # the connection's time passes
        assert await door.authority.sweep() == 1
        await asyncio.wait_for(reconnected.wait(), 10)
        assert len(assertions) == 2 and assertions[0] != assertions[1]
        assert door.authority.admitted == 2  # the fresh assertion was checked again, not waved through
        await client.publish("fleet.decisions.x", b"")  # and still confined to its role
        await client.flush()
    finally:
        await client.close()
        await door.authority.stop()
        await collect_what_nats_py_left()


def _raw_connect(url: str, key: SigningKey, identity: str = "stats") -> str:
    """What the bus answers a CONNECT of ``identity`` (see :func:`answer_to_connect`)."""
    options = Credentials(identity, key=key).connect_options()
    return answer_to_connect(
        int(url.rsplit(":", 1)[1]),
        lambda info: {
            "name": "raw",
            "auth_token": options["token"](),
            "sig": options["signature_cb"](info["nonce"]).decode(),
        },
    )


async def test_an_identity_holds_no_more_connections_than_policy_allows(
    secured: tuple[str, BusKeys], tmp_path: Path
) -> None:
    url, keys = secured
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=600, connections=2))
    clients = [
        await connect(url, f"stats-{n}", credentials=Credentials("stats", key=door.key)) for n in (1, 2)
    ]
    try:
        assert "Authorization Violation" in await asyncio.to_thread(_raw_connect, url, door.key)
        assert door.authority.refused == 1
        # Closed ones do not count, whichever replica let them in (the bus is asked, not a tally).
        await clients.pop().close()
        await asyncio.sleep(0.2)  # the server has dropped it
        assert "PONG" in await asyncio.to_thread(_raw_connect, url, door.key)
        assert door.authority.admitted == 3
    finally:
        for client in clients:
            await client.close()
        await door.authority.stop()
        await collect_what_nats_py_left()


async def test_an_enrolled_identity_that_policy_refuses_stays_out(
    secured: tuple[str, BusKeys], tmp_path: Path
) -> None:
    url, keys = secured
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=60, refuse=True))
    try:
        assert "Authorization Violation" in await asyncio.to_thread(_raw_connect, url, door.key)
        assert door.authority.refused >= 1 and door.authority.admitted == 0
    finally:
        await door.authority.stop()


async def _kick_all(url: str, keys: BusKeys, whose: str) -> int:
    """Close, from the system account, every connection of ``whose`` on the server."""
    system = await connect(
        url, "test-system", credentials=Credentials("registry-system", nkey_seed=keys.system.seed)
    )
    try:
        reply = await system.request(
            "$SYS.REQ.SERVER.PING.CONNZ", json.dumps({"auth": True}).encode(), timeout=2
        )
        body = json.loads(reply.data)
        server = body["server"]["id"]
        kicked = 0
        for connection in body["data"]["connections"] or []:
            if str(connection.get("authorized_user", "")).startswith(whose):
                await system.request(
                    f"$SYS.REQ.SERVER.{server}.KICK",
                    json.dumps({"cid": connection["cid"]}).encode(),
                    timeout=2,
                )
                kicked += 1
        return kicked
    finally:
        await system.close()


async def test_a_connection_refused_while_the_callout_is_away_comes_back_when_it_returns(
    secured: tuple[str, BusKeys], tmp_path: Path
) -> None:
    """A connection closed while the callout is away (the registry reconnecting after a node was
    lost) is refused on each try and is back once the callout answers again. (In a cluster the
    refusal can also come as an -ERR after the client took itself for connected, when the
    cluster's topology INFO arrived first: nats-py closes the client for good then, which
    ``FleetConnection`` turns into a reconnect; tests/cluster's node-kill test meets that race.)"""
    url, keys = secured
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=3600))
    client = await connect(url, "stats", credentials=Credentials("stats", key=door.key), patience_s=10)
    try:
        await door.authority.stop()  # the callout goes away
        assert await _kick_all(url, keys, "identity:stats:") == 1
        await asyncio.sleep(4)  # its reconnects meet a server whose callout does not answer
        door = await _door(tmp_path, url, keys, ShortLived(ttl_s=3600), key=door.key)
        async with asyncio.timeout(30):  # until the server answers it again
            while True:
                assert not client.is_closed, "the connection was closed for good"
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await client.flush(timeout=1)
                    break
                await asyncio.sleep(0.1)
        await client.publish("fleet.decisions.x", b"")
        await client.flush()
    finally:
        await client.close()
        await door.authority.stop()
        await collect_what_nats_py_left()


async def test_reads_that_do_not_come_back_hold_up_no_other_connection(
    secured: tuple[str, BusKeys], tmp_path: Path
) -> None:
    """Twenty connections whose records the store never returns (the registry's own connection to
    the store down, say) are refused after a bounded wait, while ``stats``, asking beside them, is
    let in: each request is answered on its own, and none waits beyond the server's timeout."""
    url, keys = secured
    store_answers = asyncio.Event()
    store_answers.set()
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=3600), store_answers=store_answers)
    stuck = [
        asyncio.create_task(
            connect(url, f"stuck-{n}", credentials=Credentials(f"stuck-{n}", key=SigningKey.generate()))
        )
        for n in range(20)
    ]
    try:
        await asyncio.sleep(0.2)  # their requests are under way
        started = time.monotonic()
        client = await connect(url, "stats", credentials=Credentials("stats", key=door.key))
        await client.close()
        assert time.monotonic() - started < 3.0, "stats waited behind the others"
        assert door.authority.admitted == 1
    finally:
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        await door.authority.stop()
        await collect_what_nats_py_left()


async def test_a_known_identity_is_let_in_from_its_last_record_while_the_store_does_not_answer(
    secured: tuple[str, BusKeys], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record is read again (``RECORD_FRESH_S`` 0); once the store stops answering, the record
    read last lets ``stats`` back in within the server's authorization timeout."""
    monkeypatch.setattr("registry._callout.RECORD_FRESH_S", 0.0)
    url, keys = secured
    store_answers = asyncio.Event()
    store_answers.set()
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=3600), store_answers=store_answers)
    try:
        assert "PONG" in await asyncio.to_thread(_raw_connect, url, door.key)
        store_answers.clear()  # the store fails over: no read comes back
        reads = len(door.requests)
        assert "PONG" in await asyncio.to_thread(_raw_connect, url, door.key)
        assert len(door.requests) == reads + 1  # it was asked, and not waited for beyond the bound
        assert door.authority.admitted == 2
    finally:
        store_answers.set()
        await door.authority.stop()
        await collect_what_nats_py_left()


async def test_a_door_full_of_waiting_requests_refuses_one_more_but_never_the_registry_itself(
    secured: tuple[str, BusKeys], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the door's requests all waiting on the store (its cap 2 here, each read waiting 5 s),
    one more connection is refused at once, while the registry's own is let in: its way back to
    the store is never shut by the others."""
    monkeypatch.setattr("registry._callout.MAX_ANSWERING", 2)
    monkeypatch.setattr("registry._callout.STORE_WAIT_S", 5.0)
    url, keys = secured
    own = SigningKey.generate()
    store_answers = asyncio.Event()
    store_answers.set()
    door = await _door(tmp_path, url, keys, ShortLived(ttl_s=3600), store_answers=store_answers, own_key=own)
    stuck = [  # each ends by itself: the server gives up on its answer after 3 s
        asyncio.create_task(asyncio.to_thread(_raw_connect, url, SigningKey.generate(), f"stuck-{n}"))
        for n in range(2)
    ]
    try:
        await asyncio.sleep(0.3)  # both are waiting on the store
        assert "Authorization Violation" in await asyncio.to_thread(_raw_connect, url, door.key)
        assert door.authority.refused == 1 and door.authority.admitted == 0
        # one try, while the two still wait: let in at once
        assert "PONG" in await asyncio.to_thread(_raw_connect, url, own, "registry")
        assert door.authority.admitted == 1
    finally:
        await asyncio.gather(*stuck, return_exceptions=True)
        await door.authority.stop()
        await collect_what_nats_py_left()
