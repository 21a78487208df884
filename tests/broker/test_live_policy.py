"""Policy distribution on a real NATS: processes (here, :class:`LivePolicy` objects on their own
connections) swap in a pushed bundle only if it compiles, report what they enforce, start on the
pushed bundle, roll back, and record every decision in the decision log without its input."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from fleet.eventlog import read_records
from fleet.natsconn import connect
from policy import Bundle, PolicyError, RegorusEngine
from policy.live import (
    DECISIONS_STREAM,
    POLICY_BUCKET,
    STATUS_BUCKET,
    LivePolicy,
    enforcing,
    push,
    pushed,
    rollback,
    statuses,
)

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
    return LivePolicy(name, embedded, RegorusEngine(Bundle.load()))


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
        seq = await push(broker, ten, "tester")
        await until(lambda: all(p.revision == ten.revision for p in policies))
        for policy in policies:
            decision = await policy.decide("fleet.tools.decision", CALL)
            assert not decision.allow and decision.reasons == ("SQL is longer than 10 characters",)

        refused_seq = await push(broker, broken_bundle, "tester")
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
            await push(broker, bundle, "tester")
        await until(lambda: policy.revision == c.revision)
        for expected in (b, a):
            _, target = await rollback(broker, "tester")
            assert target.revision == expected.revision
            await until(lambda expected=expected: policy.revision == expected.revision)
        with pytest.raises(PolicyError, match="no earlier revision"):
            await rollback(broker, "tester")
    assert [bundle.revision for _, bundle, _ in await pushed(broker)] == [
        a.revision, b.revision, c.revision, b.revision, a.revision,
    ]  # fmt: skip


async def test_a_pushed_bundle_cannot_claim_another_contents_revision(nats_url: str, broker: NATS) -> None:
    forged = dataclasses.replace(with_max_sql(5), revision=Bundle.load().revision)  # the installed name
    async with running(nats_url, "svc") as (policy,):
        await push(broker, forged, "someone")
        await until(lambda: policy.revision != Bundle.load().revision)
        assert policy.revision == with_max_sql(5).revision.replace(
            "test-5", Bundle.load().revision.split("+")[0]
        )
        assert not (await policy.decide("fleet.tools.decision", CALL)).allow


async def test_a_process_that_starts_after_a_push_enforces_it_before_it_serves(
    nats_url: str, broker: NATS
) -> None:
    await push(broker, with_max_sql(20), "tester")
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
    assert record["input_sha256"] == records[1]["input_sha256"] and len(record["input_sha256"]) == 64
    assert "4111" not in json.dumps(records)
