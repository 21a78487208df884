"""Policy distribution on a real NATS: processes (here, :class:`LivePolicy` objects on their own
connections) swap in a pushed bundle only if it compiles, report what they enforce, start on the
pushed bundle, roll back, and record every decision in the decision log without its input; and they
enforce only pushes signed by the operator or an author it certified, whoever can write the bucket."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from fleet.eventlog import read_records
from fleet.keys import SigningKey
from fleet.natsconn import connect, key_value
from policy import Bundle, PolicyError, PolicySigner, PushVerifier, RegorusEngine, certify_author
from policy.live import (
    BUNDLE_KEY,
    DECISIONS_STREAM,
    HISTORY,
    POLICY_BUCKET,
    STATUS_BUCKET,
    LivePolicy,
    bundle_message,
    enforcing,
    push,
    pushed,
    rollback,
    statuses,
)

OPERATOR_KEY = SigningKey.generate()  # the fleet's trust root: every process knows its public key
OPERATOR = PolicySigner.operator(OPERATOR_KEY)
VERIFIER = PushVerifier(OPERATOR_KEY.public_jwk())
CALL = {"server": "mcp-sql", "tool": "query", "tenant": "acme", "subject": "a", "scopes": ["sql:query"],
        "arguments": {"sql_length": 40}}  # fmt: skip


def with_max_sql(length: int) -> Bundle:
    """The installed bundle, with the SQL tool's longest statement set to ``length``."""
    bundle = Bundle.load()
    config = json.loads(json.dumps(bundle.data["config"]))
    config["tools"]["mcp-sql"]["query"]["max_sql_length"] = length
    return bundle.with_data({**bundle.data, "config": config}, f"test-{length}")


def broken() -> Bundle:
    bundle = Bundle.load()
    return bundle.with_modules(
        (*bundle.modules, ("broken.rego", "package fleet.broken\n\nallow {\n")), "broken"
    )


async def embedded(bundle: Bundle) -> RegorusEngine:
    return RegorusEngine(bundle)


def process(name: str) -> LivePolicy:
    return LivePolicy(name, embedded, RegorusEngine(Bundle.load()), verifier=VERIFIER)


@pytest.fixture
async def broker(nats_url: str) -> AsyncIterator[NATS]:
    client = await connect(nats_url, "policy-admin")
    js = client.jetstream()
    for bucket in (POLICY_BUCKET, STATUS_BUCKET):  # this test's own pushes and reports
        with contextlib.suppress(NotFoundError):
            await js.delete_key_value(bucket)
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(DECISIONS_STREAM)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def running(nats_url: str, *names: str) -> AsyncIterator[list[LivePolicy]]:
    async with contextlib.AsyncExitStack() as stack:
        policies = []
        for name in names:
            client = await connect(nats_url, name)
            stack.push_async_callback(client.close)
            policies.append(await stack.enter_async_context(enforcing(process(name), client)))
        yield policies


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.01)


async def test_a_push_is_enforced_by_every_process_and_a_broken_one_by_none(
    nats_url: str, broker: NATS
) -> None:
    ten, broken_bundle = with_max_sql(10), broken()
    async with running(nats_url, "svc-a", "svc-b") as policies:
        installed = policies[0].revision
        assert (await policies[0].decide("fleet.tools.decision", CALL)).allow
        seq = await push(broker, ten, "tester", signer=OPERATOR)
        await until(lambda: all(p.revision == ten.revision for p in policies))
        for policy in policies:
            decision = await policy.decide("fleet.tools.decision", CALL)
            assert not decision.allow and decision.reasons == ("SQL is longer than 10 characters",)

        refused_seq = await push(broker, broken_bundle, "tester", signer=OPERATOR)
        await until(lambda: all(p._seq == refused_seq for p in policies))
        assert all(p.revision == ten.revision for p in policies)  # the last good one keeps serving
        reports = {r["service"]: r for r in await statuses(broker)}
        assert {n: (r["revision"], r["seq"]) for n, r in reports.items()} == {
            "svc-a": (ten.revision, refused_seq),
            "svc-b": (ten.revision, refused_seq),
        }
        assert all(r["refused"]["revision"] == broken_bundle.revision for r in reports.values())
        assert all("does not compile" in r["refused"]["error"] for r in reports.values())
        assert seq < refused_seq and installed != ten.revision
    assert await statuses(broker) == []  # a process that stops withdraws its report


async def test_rollback_walks_back_through_the_pushes(nats_url: str, broker: NATS) -> None:
    a, b, c = with_max_sql(100), with_max_sql(200), with_max_sql(300)
    async with running(nats_url, "svc") as (policy,):
        for bundle in (a, b, c):
            await push(broker, bundle, "tester", signer=OPERATOR)
        await until(lambda: policy.revision == c.revision)
        for expected in (b, a):
            _, target = await rollback(broker, "tester", signer=OPERATOR, verifier=VERIFIER)
            assert target.revision == expected.revision
            await until(lambda expected=expected: policy.revision == expected.revision)
        with pytest.raises(PolicyError, match="no earlier revision"):
            await rollback(broker, "tester", signer=OPERATOR, verifier=VERIFIER)
    assert [bundle.revision for _, bundle, _ in await pushed(broker)] == [
        a.revision, b.revision, c.revision, b.revision, a.revision,
    ]  # fmt: skip


async def test_a_pushed_bundle_cannot_claim_another_contents_revision(nats_url: str, broker: NATS) -> None:
    forged = dataclasses.replace(with_max_sql(5), revision=Bundle.load().revision)  # the installed name
    async with running(nats_url, "svc") as (policy,):
        seq = await push(broker, forged, "someone", signer=OPERATOR)
        await until(lambda: policy._seq == seq)
        assert policy.revision == Bundle.load().revision  # signed for a name its content does not have
        assert policy._refused is not None and policy._refused["reason"] == "bad_signature"
        assert (await policy.decide("fleet.tools.decision", CALL)).allow


async def test_a_process_that_starts_after_a_push_enforces_it_before_it_serves(
    nats_url: str, broker: NATS
) -> None:
    await push(broker, with_max_sql(20), "tester", signer=OPERATOR)
    async with running(nats_url, "late") as (late,):
        assert late.revision == with_max_sql(20).revision  # on return from follow(), before any decision
        assert not (await late.decide("fleet.tools.decision", CALL)).allow


async def test_every_decision_is_logged_with_a_hash_of_its_input_never_the_input(
    nats_url: str, broker: NATS
) -> None:
    secret_call = {**CALL, "arguments": {"sql_length": 40, "note": "card 4111 1111 1111 1111"}}
    async with running(nats_url, "logger") as (policy,):
        first = await policy.decide("fleet.tools.decision", secret_call)
        second = await policy.decide("fleet.tools.decision", secret_call)  # remembered: still logged
        revision = policy.revision
    records = await read_records(broker, "fleet.decisions.logger")
    assert [r["decision_id"] for r in records] == [first.decision_id, second.decision_id]
    record = records[0]
    assert record["path"] == "fleet/tools/decision" and record["requested_by"] == "logger"
    assert record["bundles"] == {"fleet": {"revision": revision}}
    assert record["result"]["allow"] is True and record["metrics"]["timer_server_handler_ns"] > 0
    # RFC 3339 in UTC, as OPA writes it (not epoch seconds)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", record["timestamp"]), record["timestamp"]
    logged_at = dt.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
    assert abs((dt.datetime.now(dt.UTC) - logged_at).total_seconds()) < 60
    assert record["input_sha256"] == records[1]["input_sha256"] and len(record["input_sha256"]) == 64
    assert "4111" not in json.dumps(records)


# ------------------------------------------------------------------------ signed pushes: attacks
ALICE_KEY = SigningKey.generate()  # a policy author's key
LOOSE = with_max_sql(4500)  # what an attacker wants in force: the SQL tool takes CALL again


async def write(broker: NATS, message: bytes) -> int:
    """Put ``message`` in the bucket as anyone who can write it does, past every check of ``push``."""
    bucket = await key_value(broker, POLICY_BUCKET, history=HISTORY)
    return int(await bucket.put(BUNDLE_KEY, message))


def message_at(bundle: Bundle, signer: PolicySigner, pushed_at: float) -> bytes:
    """A push of ``bundle`` signed by ``signer`` as if at ``pushed_at``."""
    facts: dict[str, Any] = {"pushed_by": signer.author, "pushed_at": pushed_at, "note": ""}
    body = {"revision": bundle.revision, "modules": [list(m) for m in bundle.modules], "data": bundle.data}
    return json.dumps(body | facts | signer.sign(bundle, facts)).encode()


def unsigned() -> bytes:
    return bundle_message(LOOSE, "operator:root")


def signed_by_another_operator() -> bytes:
    return bundle_message(LOOSE, "operator:root", signer=PolicySigner.operator(SigningKey.generate()))


def signed_by_an_uncertified_identity() -> bytes:
    return bundle_message(LOOSE, "alice", signer=PolicySigner("alice", ALICE_KEY))


def signed_by_a_self_certified_author() -> bytes:
    certificate = certify_author(SigningKey.generate(), "alice", ALICE_KEY.public_jwk())
    return bundle_message(LOOSE, "alice", signer=PolicySigner.author_of(ALICE_KEY, certificate))


def certified_without_the_right_to_push() -> bytes:
    certificate = OPERATOR_KEY.sign(
        {"sub": "alice", "aud": "fleet-policy", "jwk": ALICE_KEY.public_jwk(), "rights": ["policy:read"],
         "iat": int(time.time()), "exp": int(time.time()) + 3600},
        typ="policy-author+jwt",
    )  # fmt: skip
    return bundle_message(LOOSE, "alice", signer=PolicySigner.author_of(ALICE_KEY, certificate))


def with_modules_changed_after_signing() -> bytes:
    body = json.loads(bundle_message(with_max_sql(11), "operator:me", signer=OPERATOR))
    extra = ["zz_extra.rego", "package fleet.extra\n\nopen := true\n"]
    body |= {"modules": [*body["modules"], extra], "data": LOOSE.data}
    return json.dumps(body).encode()


def with_facts_changed_after_signing() -> bytes:
    body = json.loads(bundle_message(LOOSE, "operator:me", "", signer=OPERATOR))
    return json.dumps(body | {"pushed_by": "operator:someone-else"}).encode()


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (unsigned, "unsigned"),
        (signed_by_another_operator, "bad_signature"),
        (signed_by_an_uncertified_identity, "unauthorized"),
        (signed_by_a_self_certified_author, "unauthorized"),
        (certified_without_the_right_to_push, "unauthorized"),
        (with_modules_changed_after_signing, "bad_signature"),
        (with_facts_changed_after_signing, "bad_signature"),
    ],
)
async def test_a_push_not_signed_by_the_operator_or_a_certified_author_is_refused_by_every_process(
    nats_url: str, broker: NATS, forge: Any, reason: str
) -> None:
    ten = with_max_sql(10)
    async with running(nats_url, "svc-a", "svc-b") as policies:
        await push(broker, ten, "operator:me", signer=OPERATOR)
        await until(lambda: all(p.revision == ten.revision for p in policies))
        forged_seq = await write(broker, forge())
        await until(lambda: all(p.refused and p.refused["seq"] == forged_seq for p in policies))
        for policy in policies:
            assert policy.revision == ten.revision, policy.refused
            assert policy.refused is not None and policy.refused["reason"] == reason, policy.refused
            assert not (await policy.decide("fleet.tools.decision", CALL)).allow  # the forged one would allow
        reports = await statuses_when(broker, lambda rs: all(r["seq"] == forged_seq for r in rs))
    assert {(r["revision"], r["refused"]["reason"]) for r in reports} == {(ten.revision, reason)}


async def statuses_when(broker: NATS, check: Any, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The processes' reports once ``check`` holds of them."""
    deadline = time.monotonic() + timeout_s
    while not check(reports := await statuses(broker)) or not reports:
        assert time.monotonic() < deadline, reports
        await asyncio.sleep(0.01)
    return reports


async def test_a_push_signed_by_an_author_the_operator_certified_is_enforced(
    nats_url: str, broker: NATS
) -> None:
    certificate = certify_author(OPERATOR_KEY, "alice", ALICE_KEY.public_jwk(), lifetime_s=3600)
    alice = PolicySigner.author_of(ALICE_KEY, certificate)
    ten, twenty = with_max_sql(10), with_max_sql(20)
    async with running(nats_url, "svc-a", "svc-b") as policies:
        await push(broker, ten, "alice:laptop", signer=alice)
        await until(lambda: all(p.revision == ten.revision for p in policies))
        assert all(p.refused is None for p in policies)
        await push(broker, twenty, "operator:me", signer=OPERATOR)
        await until(lambda: all(p.revision == twenty.revision for p in policies))
        _, target = await rollback(broker, "alice:laptop", signer=alice, verifier=VERIFIER)
        assert target.revision == ten.revision
        await until(lambda: all(p.revision == ten.revision for p in policies))
        reports = await statuses_when(broker, lambda rs: all(r["author"] == "alice" for r in rs))
    assert {r["revision"] for r in reports} == {ten.revision}
    assert [facts["author"] for _, _, facts in await pushed(broker, VERIFIER)] == [
        "alice",
        "operator",
        "alice",
    ]


async def test_a_process_that_starts_after_a_forged_push_enforces_the_last_valid_one(
    nats_url: str, broker: NATS
) -> None:
    twenty = with_max_sql(20)
    await push(broker, twenty, "operator:me", signer=OPERATOR)
    await write(broker, signed_by_another_operator())
    forged_seq = await write(broker, unsigned())
    async with running(nats_url, "late") as (late,):
        assert late.revision == twenty.revision  # on return from follow(), before any decision
        assert late.refused is not None and (late.refused["seq"], late.refused["reason"]) == (
            forged_seq,
            "unsigned",
        )
        assert not (await late.decide("fleet.tools.decision", CALL)).allow
    assert [bundle.revision for _, bundle, _ in await pushed(broker, VERIFIER)] == [twenty.revision]


async def test_a_process_that_starts_when_no_kept_push_is_valid_enforces_its_own_bundle(
    nats_url: str, broker: NATS
) -> None:
    await write(broker, signed_by_an_uncertified_identity())
    await write(broker, unsigned())
    async with running(nats_url, "late") as (late,):
        assert late.revision == Bundle.load().revision
        assert late.refused is not None and late.refused["reason"] == "unsigned"


async def test_a_valid_push_written_again_does_not_replace_a_newer_one(nats_url: str, broker: NATS) -> None:
    ten = with_max_sql(10)
    old = bundle_message(LOOSE, "operator:me", signer=OPERATOR)  # once in force, then replaced
    async with running(nats_url, "svc") as (policy,):
        await write(broker, old)
        await until(lambda: policy.revision == LOOSE.revision)
        await push(broker, ten, "operator:me", signer=OPERATOR)
        await until(lambda: policy.revision == ten.revision)
        replayed = await write(broker, old)
        await until(lambda: policy.refused is not None and policy.refused["seq"] == replayed)
        assert policy.revision == ten.revision and policy.refused["reason"] == "stale"
    async with running(nats_url, "late") as (late,):
        assert late.revision == ten.revision  # the newest signed push, not the last written


async def test_an_author_certificate_counts_when_the_push_was_signed_not_when_it_is_read(
    nats_url: str, broker: NATS
) -> None:
    now = time.time()
    expired = certify_author(  # valid for an hour, two hours ago
        OPERATOR_KEY, "alice", ALICE_KEY.public_jwk(), lifetime_s=3600, issued_at=now - 7200
    )
    alice = PolicySigner.author_of(ALICE_KEY, expired)
    twenty = with_max_sql(20)
    await write(broker, message_at(twenty, alice, now - 5400))  # pushed while alice was certified
    async with running(nats_url, "a-month-later") as (late,):
        assert late.revision == twenty.revision and late.refused is None
        refused_seq = await push(broker, with_max_sql(10), "alice", signer=alice)  # pushed now: expired
        await until(lambda: late.refused is not None and late.refused["seq"] == refused_seq)
        assert late.revision == twenty.revision and late.refused["reason"] == "unauthorized"


async def test_a_process_without_the_operator_key_enforces_no_push(nats_url: str, broker: NATS) -> None:
    client = await connect(nats_url, "keyless")
    try:
        keyless = LivePolicy("keyless", embedded, RegorusEngine(Bundle.load()))
        async with enforcing(keyless, client):
            seq = await push(broker, with_max_sql(10), "operator:me", signer=OPERATOR)
            await until(lambda: keyless.refused is not None and keyless.refused["seq"] == seq)
            assert keyless.revision == Bundle.load().revision
            assert keyless.refused["reason"] == "no_trust_root"
    finally:
        await client.close()
