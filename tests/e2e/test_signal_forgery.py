"""Attacks on the NATS signal channel (``fleet.signals.<run>``, stream ``FLEET_SIGNALS``), against a
real stack: whoever can read the stream (or the subject) holds every stored message, so a signal
must carry nothing that works a second time. A signal carries a single-use signal grant bound to its
run, action, id and body; a bearer token is refused (and not kept); a grant is no bearer token.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from fleet.errors import AuthError
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.signal_client import (
    GRANT_HEADER,
    OUTCOMES_PREFIX,
    SIGNALS_PREFIX,
    SIGNALS_STREAM,
    publish_signal,
    sign_signal,
)
from fleet.tokens import SignalBinding, TokenClient, TokenVerifier, peek
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import Stack, all_events, send, token_claims, user_message
from tests.e2e.a2a_helpers import fresh_tenant

pytestmark = pytest.mark.e2e

REFUND = {
    "steps": [
        {"id": "refund", "skill": "issue-refund", "input": {"subject": "Contoso", "amount_cents": 25_000}}
    ]
}
APPROVER_SCOPES = ("agent:invoke", "runs:approve")


@pytest.fixture
async def nats(stack: Stack) -> AsyncIterator[NATS]:
    client = await connect(
        stack.endpoints["nats"], "test-signal-forgery", credentials=stack_admin(stack.endpoints)
    )
    yield client
    await client.close()


@pytest.fixture
async def signer(stack: Stack) -> AsyncIterator[TokenClient]:
    """The operator's own credentials, as an automation holding the operator key has them."""
    async with httpx.AsyncClient(timeout=30) as http:
        yield operator_token_client(stack.layout, stack.endpoints["registry"] + "/oauth/token", http)


async def paused_run(stack: Stack, tenant: str) -> str:
    """A refund run of ``tenant`` waiting at its approval gate."""
    token = stack.token("coordinator", tenant=tenant)
    async with asyncio.timeout(120):
        outcome = await send(stack, user_message(data=REFUND), token=token)
    assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
    return outcome.task_id


async def run_api(stack: Stack, token: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        url, headers = stack.endpoints["coordinator"] + path, {"Authorization": f"Bearer {token}"}
        if body is None:
            return await http.get(url, headers=headers)
        return await http.post(url, headers=headers, json=body)


async def state_and_signals(stack: Stack, run_id: str, tenant: str) -> tuple[str, list[dict[str, Any]]]:
    token = stack.token("coordinator", tenant=tenant)
    run = (await run_api(stack, token, f"/v1/runs/{run_id}")).json()
    signals = (await run_api(stack, token, f"/v1/runs/{run_id}/signals")).json()["signals"]
    return run["state"], signals


async def outcome_of(
    nats: NATS, run_id: str, payload: bytes, headers: dict[str, str], subject_run: str = ""
) -> dict[str, Any]:
    """Publish a message on ``fleet.signals.<subject_run or run_id>`` and wait for its outcome."""
    target = subject_run or run_id
    outcomes = await nats.subscribe(OUTCOMES_PREFIX + target)
    try:
        ack = await nats.jetstream().publish(SIGNALS_PREFIX + target, payload, headers=headers)
        assert not ack.duplicate
        outcome: dict[str, Any] = json.loads((await outcomes.next_msg(timeout=30)).data)
        return outcome
    finally:
        await outcomes.unsubscribe()


async def stolen(nats: NATS, run_id: str) -> tuple[bytes, dict[str, str]]:
    """The stored message of the last signal sent to ``run_id``, as any reader of the stream has it."""
    stored = await nats.jetstream().get_last_msg(SIGNALS_STREAM, SIGNALS_PREFIX + run_id)
    return stored.data or b"", dict(stored.headers or {})


async def genuine_extend(nats: NATS, signer: TokenClient, run_id: str, tenant: str) -> None:
    """The operator moves the run's deadline over NATS: a signal that leaves the run waiting."""
    outcomes = await nats.subscribe(OUTCOMES_PREFIX + run_id)
    try:
        await publish_signal(nats, run_id, signer, {"action": "extend", "extend_s": 60}, tenant=tenant)
        applied = json.loads((await outcomes.next_msg(timeout=30)).data)
    finally:
        await outcomes.unsubscribe()
    assert applied["outcome"] == "applied", applied


def refused(outcome: dict[str, Any], says: str) -> None:
    assert (outcome["outcome"], outcome["error"]["code"]) == ("refused", "unauthenticated"), outcome
    assert says in outcome["error"]["message"], outcome


async def test_a_signal_with_a_bearer_token_in_authorization_is_refused_and_not_kept(
    stack: Stack, nats: NATS
) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    bearer = stack.token("coordinator", tenant=tenant, scopes=APPROVER_SCOPES)
    headers = {"Nats-Msg-Id": uuid.uuid4().hex, "Authorization": f"Bearer {bearer}"}
    outcome = await outcome_of(nats, run_id, b'{"action": "approve"}', headers)
    refused(outcome, "never a bearer token")
    assert await state_and_signals(stack, run_id, tenant) == ("waiting", [])
    with pytest.raises(NotFoundError):  # erased: the token is not kept for the stream's readers
        await nats.jetstream().get_last_msg(SIGNALS_STREAM, SIGNALS_PREFIX + run_id)


async def test_a_stolen_grant_sent_again_with_a_new_signal_id_is_refused(
    stack: Stack, nats: NATS, signer: TokenClient
) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    await genuine_extend(nats, signer, run_id, tenant)
    payload, headers = await stolen(nats, run_id)
    outcome = await outcome_of(nats, run_id, payload, {**headers, "Nats-Msg-Id": uuid.uuid4().hex})
    refused(outcome, "the signal grant is for another signal id")
    state, signals = await state_and_signals(stack, run_id, tenant)
    assert (state, [s["action"] for s in signals]) == ("waiting", ["extend"])  # extended once


async def test_a_stolen_grant_sent_to_another_run_is_refused(
    stack: Stack, nats: NATS, signer: TokenClient
) -> None:
    tenant = fresh_tenant()
    first, second = await paused_run(stack, tenant), await paused_run(stack, tenant)
    # A grant for an approval of the first run, taken in flight (never stored), put on the second.
    payload, headers = await sign_signal(signer, first, {"action": "approve"}, tenant=tenant)
    outcome = await outcome_of(nats, first, payload, headers, subject_run=second)
    refused(outcome, "the signal grant is for another run")
    assert await state_and_signals(stack, second, tenant) == ("waiting", [])
    assert await state_and_signals(stack, first, tenant) == ("waiting", [])


async def test_a_stolen_grant_with_another_body_or_action_is_refused(
    stack: Stack, nats: NATS, signer: TokenClient
) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    # The signer meant to reject; the thief keeps the grant and the id, and approves instead.
    _, headers = await sign_signal(signer, run_id, {"action": "reject", "note": "no"}, tenant=tenant)
    approve = await outcome_of(nats, run_id, b'{"action": "approve"}', headers)
    refused(approve, "the signal grant is for another action, body")
    # The same action with another body (a note, an input) is another signal too.
    _, headers = await sign_signal(signer, run_id, {"action": "approve"}, tenant=tenant)
    noted = await outcome_of(nats, run_id, b'{"action": "approve", "note": "by the thief"}', headers)
    refused(noted, "the signal grant is for another body")
    assert await state_and_signals(stack, run_id, tenant) == ("waiting", [])


async def test_an_expired_signal_grant_is_refused(stack: Stack, nats: NATS) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    registry = SigningKey.load_or_create(stack.layout.key_file("registry"))

    def grant(signal_id: str, payload: bytes, expires: int) -> str:
        """What the token service signs, but as old as the test says."""
        bound = SignalBinding.of(run_id, "approve", signal_id, payload)
        claims = token_claims(
            tenant=tenant, scope="runs:approve", token_use="signal_grant", run_id=run_id, signal=bound.claim()
        )
        return registry.sign({**claims, "iat": expires - 300, "exp": expires}, typ="signal-grant+jwt")

    payload, late = b'{"action": "approve"}', uuid.uuid4().hex
    expired = {"Nats-Msg-Id": late, GRANT_HEADER: grant(late, payload, int(time.time()) - 60)}
    refused(await outcome_of(nats, run_id, payload, expired), "token expired")
    assert await state_and_signals(stack, run_id, tenant) == ("waiting", [])
    # The very same grant, in its time, is taken: the expiry alone refused it.
    fresh = uuid.uuid4().hex
    good = {"Nats-Msg-Id": fresh, GRANT_HEADER: grant(fresh, payload, int(time.time()) + 60)}
    assert (await outcome_of(nats, run_id, payload, good))["outcome"] == "applied"


async def test_a_signal_grant_is_refused_as_a_bearer_token_on_the_run_api(
    stack: Stack, signer: TokenClient
) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    _, headers = await sign_signal(signer, run_id, {"action": "approve"}, tenant=tenant)
    grant = headers[GRANT_HEADER]
    listed = await run_api(stack, grant, "/v1/runs")
    assert listed.status_code == 401, listed.text
    assert "signal grant is not an access token" in listed.text
    answered = await run_api(stack, grant, f"/v1/runs/{run_id}/signals", {"action": "approve"})
    assert answered.status_code == 401, answered.text
    assert await state_and_signals(stack, run_id, tenant) == ("waiting", [])


async def test_a_stored_signal_holds_no_bearer_token(stack: Stack, nats: NATS, signer: TokenClient) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    await genuine_extend(nats, signer, run_id, tenant)
    registry = SigningKey.load_or_create(stack.layout.key_file("registry")).private_key.public_key()
    js = nats.jetstream()
    info = await js.stream_info(SIGNALS_STREAM)
    stored = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):  # every message the stream keeps
        try:
            stored.append(await js.get_msg(SIGNALS_STREAM, seq))
        except NotFoundError:
            continue  # erased
    assert any(m.subject == SIGNALS_PREFIX + run_id for m in stored)
    for message in stored:
        values = [*(message.headers or {}).values(), *strings_in(body_of(message.data or b""))]
        for word in (part for value in values for part in value.split()):
            assert not await access_token(word, registry), f"a bearer token in {message.subject}"


def body_of(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


async def access_token(text: str, registry: ec.EllipticCurvePublicKey) -> bool:
    """Whether ``text`` verifies as an access token of the fleet, for the audience it names (so for
    any audience)."""
    try:
        audience = peek(text)[1].get("aud")
    except AuthError:
        return False

    async def key(kid: str) -> ec.EllipticCurvePublicKey:
        return registry

    try:
        await TokenVerifier(key, issuer="fleet-registry", audience=str(audience)).verify(text)
    except AuthError:
        return False
    return True


async def test_a_genuine_nats_signal_approves_a_waiting_run(
    stack: Stack, nats: NATS, signer: TokenClient
) -> None:
    tenant = fresh_tenant()
    run_id = await paused_run(stack, tenant)
    outcomes = await nats.subscribe(OUTCOMES_PREFIX + run_id)
    signal_id, kept = await publish_signal(
        nats, run_id, signer, {"action": "approve", "note": "ok"}, tenant=tenant
    )
    applied = json.loads((await outcomes.next_msg(timeout=30)).data)
    assert kept and (applied["outcome"], applied["signal_id"]) == ("applied", signal_id), applied
    token = stack.token("coordinator", tenant=tenant)
    async with asyncio.timeout(90):
        events = await all_events(stack, run_id, token)  # the run's log, followed to its end
    assert events[-1]["type"] == "run.completed", events[-1]
    state = await state_and_signals(stack, run_id, tenant)
    assert [(s["signer"], s["via"], s["outcome"]) for s in state[1]] == [("operator", "nats", "applied")]
