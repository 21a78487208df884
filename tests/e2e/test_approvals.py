"""Durable pauses at a gate: a refund over the policy's threshold pauses the run (the tool does
nothing and answers ``pending_approval``), an approval request goes out on NATS, and signals from the
CLI, the run API, NATS and an A2A follow-up answer it, once. Real processes, NATS, Postgres and policy.

One stack for the module, with the shipped bundle plus approval rules that only these tests use:
``lead`` may answer a refund only once it was escalated, and tenants ``quick-*`` have short deadlines.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from a2a.types import Message, Role, SendMessageRequest, TaskState
from a2a.utils.errors import InvalidParamsError

from fleet.natsconn import connect
from fleet.signal_client import GRANT_HEADER, OUTCOMES_PREFIX, SIGNALS_PREFIX, publish_signal
from fleet.tokens import TokenClient
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import (
    FAST_FAILOVER,
    Stack,
    all_events,
    clean_env,
    fleet,
    send,
    start_stack,
    stop_stack,
    user_message,
)
from policy import DEFAULT_BUNDLE_DIR
from tests.e2e.a2a_helpers import a2a_client, as_tenant, fresh_tenant
from tests.e2e.run_helpers import (
    count_rows,
    events_so_far,
    get_run,
    operations,
    paused_at_gate,
    refund,
    run_when,
    running,
    victim_pid,
)

pytestmark = pytest.mark.e2e

APPROVERS = [
    {
        "tenants": ["*"],
        "skills": ["*"],
        "subjects": ["operator"],
        "actions": ["approve", "reject", "input", "extend", "cancel"],
    },
    {
        "tenants": ["*"],
        "skills": ["issue-refund"],
        "subjects": ["lead"],
        "actions": ["approve", "reject"],
        "escalated_only": True,
    },
]
QUICK = {
    "quick-expire": {"timeout_s": 3, "warn_before_s": 2, "on_expired": "expire"},
    # long enough that the operator's extension, sent at once, lands before it on a loaded machine
    "quick-escalate": {"timeout_s": 8, "warn_before_s": 2, "on_expired": "escalate", "escalate_for_s": 600},
}


def approval_policy(root: Path) -> Path:
    bundle = root / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    data["config"]["approvals"]["approvers"] = APPROVERS
    data["config"]["approvals"]["deadlines"]["tenants"] = QUICK
    (bundle / "data.json").write_text(json.dumps(data))
    return bundle


@pytest.fixture(scope="module")
def gate_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    bundle = approval_policy(tmp_path_factory.mktemp("policy"))
    env = clean_env(FLEET_POLICY_DIR=str(bundle), FLEET_SWEEP_INTERVAL_S="0.5")
    stack = start_stack(tmp_path_factory.mktemp("stack"), env=env)
    yield stack
    stop_stack(stack)


async def post_signal(stack: Stack, run_id: str, token: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/signals",
            headers={"Authorization": f"Bearer {token}"},
            json=body,
        )


async def signals_of(stack: Stack, run_id: str, token: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/signals",
            headers={"Authorization": f"Bearer {token}"},
        )
    response.raise_for_status()
    found: list[dict[str, Any]] = response.json()["signals"]
    return found


def operator_signer(stack: Stack, http: httpx.AsyncClient) -> TokenClient:
    """The operator's credentials, as an automation holding the operator key has them."""
    return operator_token_client(stack.layout, stack.endpoints["registry"] + "/oauth/token", http)


async def refunds(stack: Stack, tenant: str) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn:
        cursor = await conn.execute(
            "SELECT subject, amount_cents, approval_id, approved_by, attempts FROM tenant_data.refunds"
            " WHERE tenant_id = %s",
            (tenant,),
        )
        rows = await cursor.fetchall()
    keys = ("subject", "amount_cents", "approval_id", "approved_by", "attempts")
    return [dict(zip(keys, row, strict=True)) for row in rows]


async def used_grants(stack: Stack, tenant: str) -> list[str]:
    """The approval grants mcp-cases used for ``tenant`` (their ids), oldest first."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn:
        cursor = await conn.execute(
            "SELECT jti FROM tenant_data.approval_grants WHERE tenant_id = %s ORDER BY used_at", (tenant,)
        )
        return [str(row[0]) for row in await cursor.fetchall()]


async def test_a_refund_over_the_threshold_waits_for_one_approval_however_often_it_is_sent(
    gate_stack: Stack,
) -> None:
    stack, tenant = gate_stack, fresh_tenant()
    token = stack.token("coordinator", tenant=tenant)
    nc = await connect(stack.endpoints["nats"], "test-approvals", credentials=stack_admin(stack.endpoints))
    try:
        js = nc.jetstream()
        run_id = await paused_at_gate(stack, tenant, token)
        run = await get_run(stack, run_id, token)
        wait = run["wait"]
        assert (wait["type"], wait["awaited"]) == ("approval", "approval:refund:0")
        assert wait["deadline"] and wait["detail"]["skill"] == "issue-refund"
        assert await refunds(stack, tenant) == []  # the tool did nothing without an approval

        # The approval request is on NATS, for the tenant, with where to send the answer.
        sub = await js.subscribe(f"fleet.approvals.{tenant}.{run_id}", ordered_consumer=True)
        request = json.loads((await sub.next_msg(timeout=10)).data)
        assert request["awaited"] == "approval:refund:0"
        assert request["signal_subject"] == f"fleet.signals.{run_id}"
        assert request["choices"] == ["approve", "reject"]

        # Three approvals of the same wait at once, each with its own id: serialised by the run's
        # row, the first counts and the others are recorded no-ops.
        operator = stack.token("coordinator", tenant=tenant, scopes=("agent:invoke", "runs:approve"))
        body = {"action": "approve", "awaited": "approval:refund:0", "note": "refund ok"}
        answers = await asyncio.gather(
            *(post_signal(stack, run_id, operator, {**body, "id": f"approve-{n}"}) for n in range(3))
        )
        outcomes = sorted(a.json()["outcome"] for a in answers)
        assert outcomes == ["applied", "duplicate", "duplicate"], [a.text for a in answers]
        first = next(a.json() for a in answers if a.json()["applied"])
        # The CLI sends the applied signal's id again (a retry): the first answer, nothing new; and a
        # new approval for the answered wait: a recorded no-op (exit 4).
        args = ("approve", "--data-dir", stack.data_dir, run_id, "--tenant", tenant)
        again = await asyncio.to_thread(fleet, *args, "--id", first["signal_id"], timeout=60)
        assert again.returncode == 0 and "received before" in again.stdout, again.stdout + again.stderr
        late = await asyncio.to_thread(fleet, *args, "--awaited", "approval:refund:0", timeout=60)
        assert late.returncode == 4, late.stdout + late.stderr

        done = await run_when(stack, run_id, token, "completed", "failed", "rejected")
        assert done["state"] == "completed"
        # Counted at the tool: one refund, with the approval that allowed it.
        made = await refunds(stack, tenant)
        grant_ids = await used_grants(stack, tenant)
        assert made == [
            {
                "subject": "Contoso",
                "amount_cents": 25_000,
                "approval_id": grant_ids[0],  # the registry's grant, used up with the refund
                "approved_by": "operator",  # from the grant: the signer the registry verified
                "attempts": 1,
            }
        ]
        # The grant the coordinator got when the approval was applied is not in the run's log.
        logged = json.dumps(await all_events(stack, run_id, token))
        assert "eyJ" not in logged  # no JWT (a JSON header in base64url) in the log
        # One approval applied; the log says who.
        events = await all_events(stack, run_id, token)
        granted = [e for e in events if e["type"] == "approval.granted"]
        assert len(granted) == 1 and granted[0]["actor"] == "operator"
        recorded = [s["outcome"] for s in await signals_of(stack, run_id, token)]
        assert sorted(recorded[:3]) == ["applied", "duplicate", "duplicate"]
        assert recorded[3:] in (["duplicate"], ["finished"])  # the late one: the run may have ended
        # The gated call and the approved one are two operations; each was sent once.
        ops = {op["step_id"]: op for op in await operations(stack, run_id, token)}
        assert set(ops) == {"refund", "refund~1"}
        assert all(op["status"] == "succeeded" and op["attempts"] == 1 for op in ops.values())

        # An approval for the finished run is a clear no-op, over NATS too.
        published = await nc.subscribe(OUTCOMES_PREFIX + run_id)
        async with httpx.AsyncClient() as http:
            signer = operator_signer(stack, http)
            await publish_signal(nc, run_id, signer, {"action": "approve"}, tenant=tenant, signal_id="late-1")
        finished = json.loads((await published.next_msg(timeout=30)).data)
        assert (finished["outcome"], finished["applied"]) == ("finished", False)
        assert len(await refunds(stack, tenant)) == 1
    finally:
        await nc.close()


async def test_a_forbidden_approver_is_refused_and_the_run_waits_for_a_real_one(gate_stack: Stack) -> None:
    stack, tenant = gate_stack, fresh_tenant()
    token = stack.token("coordinator", tenant=tenant)
    run_id = await paused_at_gate(stack, tenant, token)

    # Signed by the real issuer, with the scope, but not an approver of refunds (policy says).
    mallory = stack.forge(sub="mallory", tenant=tenant, scope="agent:invoke runs:approve")
    refused = await post_signal(stack, run_id, mallory, {"action": "approve", "id": "m-1"})
    assert refused.status_code == 403, refused.text
    again = await post_signal(stack, run_id, mallory, {"action": "approve", "id": "m-1"})
    assert again.status_code == 403 and again.json() == refused.json()  # the first answer, again
    assert refused.json()["error"]["code"] == "forbidden"
    assert "mallory may not approve" in refused.json()["error"]["message"]
    # Without the scope, even the operator is refused; and another tenant cannot see the run.
    no_scope = await post_signal(stack, run_id, token, {"action": "approve"})
    assert no_scope.status_code == 403
    other = stack.forge(sub="operator", tenant=fresh_tenant(), scope="agent:invoke runs:approve")
    assert (await post_signal(stack, run_id, other, {"action": "approve"})).status_code == 404
    # "lead" may approve refunds only once the wait was escalated.
    lead = stack.forge(sub="lead", tenant=tenant, scope="agent:invoke runs:approve")
    assert (await post_signal(stack, run_id, lead, {"action": "approve"})).status_code == 403

    assert (await get_run(stack, run_id, token))["state"] == "waiting"
    assert await refunds(stack, tenant) == []
    recorded = await signals_of(stack, run_id, token)
    assert [(s["signer"], s["outcome"]) for s in recorded] == [
        ("mallory", "forbidden"),
        ("operator", "forbidden"),
        ("lead", "forbidden"),
    ]

    # The operator's approval over NATS, with its signal grant verified there, resumes the run.
    nc = await connect(stack.endpoints["nats"], "test-approvals", credentials=stack_admin(stack.endpoints))
    try:
        outcomes = await nc.subscribe(OUTCOMES_PREFIX + run_id)
        headers = {"Nats-Msg-Id": uuid.uuid4().hex, GRANT_HEADER: "not-a-grant"}
        await nc.jetstream().publish(SIGNALS_PREFIX + run_id, b'{"action": "approve"}', headers=headers)
        bad = json.loads((await outcomes.next_msg(timeout=30)).data)
        assert (bad["outcome"], bad["error"]["code"]) == ("refused", "unauthenticated")
        async with httpx.AsyncClient() as http:
            body = {"action": "approve", "note": "checked"}
            await publish_signal(nc, run_id, operator_signer(stack, http), body, tenant=tenant)
        applied = json.loads((await outcomes.next_msg(timeout=30)).data)
        assert applied["outcome"] == "applied", applied
    finally:
        await nc.close()
    assert (await run_when(stack, run_id, token, "completed", "failed"))["state"] == "completed"
    assert [r["approved_by"] for r in await refunds(stack, tenant)] == ["operator"]
    # A caller cannot approve its own step by writing the approval into the plan.
    forged = {"subject": "Self", "amount_cents": 90_000, "approval": {"id": "self", "by": "me"}}
    async with asyncio.timeout(60):
        with pytest.raises(InvalidParamsError) as caught:
            await send(
                stack,
                user_message(data={"steps": [{"id": "r", "skill": "issue-refund", "input": forged}]}),
                token=token,
            )
    assert "reserved" in caught.value.message
    assert [r["subject"] for r in await refunds(stack, tenant)] == ["Contoso"]


async def test_a_rejection_ends_the_run_rejected_with_no_effect(gate_stack: Stack) -> None:
    stack, tenant = gate_stack, fresh_tenant()
    token = stack.token("coordinator", tenant=tenant)
    run_id = await paused_at_gate(stack, tenant, token)
    args = ("reject", "--data-dir", stack.data_dir, run_id, "--tenant", tenant, "--note", "not owed")
    rejected = await asyncio.to_thread(fleet, *args, timeout=60)
    assert rejected.returncode == 0, rejected.stdout + rejected.stderr
    run = await run_when(stack, run_id, token, "completed", "failed", "rejected")
    assert (run["state"], run["reason"]) == ("rejected", "approval_rejected")
    assert await refunds(stack, tenant) == []
    events = await all_events(stack, run_id, token)
    assert "rejected by operator: not owed" in events[-1]["payload"]["text"]


async def test_an_a2a_follow_up_message_answers_the_task_and_the_caller_sees_it_finish(
    gate_stack: Stack,
) -> None:
    stack, tenant = gate_stack, fresh_tenant()
    operator = stack.token("coordinator", tenant=tenant, scopes=("agent:invoke", "runs:approve"))
    run_id = await paused_at_gate(stack, tenant, operator, refund("Fabrikam", 50_000))
    follow_up = Message(
        role=Role.ROLE_USER,
        message_id=uuid.uuid4().hex,
        task_id=run_id,
        parts=user_message(text="approve").parts,
    )
    states = []
    async with a2a_client(stack) as client, asyncio.timeout(120):
        async for response in client.send_message(
            SendMessageRequest(message=follow_up), context=as_tenant(operator)
        ):
            kind = response.WhichOneof("payload")
            if kind == "status_update":
                states.append(response.status_update.status.state)
            elif kind == "task":
                states.append(response.task.status.state)
    assert states[-1] == TaskState.TASK_STATE_COMPLETED, states
    assert [r["subject"] for r in await refunds(stack, tenant)] == ["Fabrikam"]
    signals = await signals_of(stack, run_id, operator)
    assert [(s["via"], s["outcome"]) for s in signals] == [("a2a", "applied")]


async def test_a_deadline_warns_then_expires_and_an_expiry_is_not_a_rejection(gate_stack: Stack) -> None:
    stack, tenant = gate_stack, "quick-expire"
    token = stack.token("coordinator", tenant=tenant)
    run_id = await paused_at_gate(stack, tenant, token)
    run = await run_when(stack, run_id, token, "failed", "completed", "rejected", timeout_s=60)
    assert (run["state"], run["reason"]) == ("failed", "approval_expired")
    types = [e["type"] for e in await all_events(stack, run_id, token)]
    assert types.index("wait.deadline_near") < types.index("wait.expired")
    assert "approval.rejected" not in types
    # Extending a wait that ended changes nothing.
    extend = ("runs", "extend", "--data-dir", stack.data_dir, run_id, "--seconds", "60", "--tenant", tenant)
    assert (await asyncio.to_thread(fleet, *extend, timeout=60)).returncode == 4


async def test_an_escalated_wait_goes_to_the_escalation_approver_and_an_extension_moves_it(
    gate_stack: Stack,
) -> None:
    stack, tenant = gate_stack, "quick-escalate"
    token = stack.token("coordinator", tenant=tenant)
    run_id = await paused_at_gate(stack, tenant, token, refund(f"Northwind-{uuid.uuid4().hex[:6]}"))
    operator = stack.token("coordinator", tenant=tenant, scopes=("agent:invoke", "runs:approve"))
    # The operator moves the deadline once; it still passes, and the wait is escalated.
    first = (await get_run(stack, run_id, token))["wait"]
    moved = await post_signal(stack, run_id, operator, {"action": "extend", "extend_s": 2})
    assert moved.json()["applied"], moved.text
    later = (await get_run(stack, run_id, token))["wait"]
    assert later["deadline"] > first["deadline"]
    async with asyncio.timeout(60):
        while True:
            wait = (await get_run(stack, run_id, token))["wait"] or {}
            if wait.get("awaited") == "approval:refund:0:escalated":
                break
            await asyncio.sleep(0.2)
    types = [e["type"] for e in await events_so_far(stack, run_id, token)]  # it still waits
    assert types.index("wait.extended") < types.index("approval.escalated")
    lead = stack.forge(sub="lead", tenant=tenant, scope="agent:invoke runs:approve")
    answer = await post_signal(stack, run_id, lead, {"action": "approve", "note": "escalated ok"})
    assert answer.json()["applied"], answer.text
    assert (await run_when(stack, run_id, token, "completed", "failed"))["state"] == "completed"


async def test_a_worker_killed_after_the_approved_effect_leaves_one_effect(tmp_path: Path) -> None:
    """The approved call reaches the tool, and the worker that resumed the run dies before it records
    the result: the next worker asks the agent, and the refund is made once."""
    bundle = approval_policy(tmp_path / "policy")
    env = clean_env(
        **FAST_FAILOVER,
        FLEET_POLICY_DIR=str(bundle),
        FLEET_CRASH_POINTS=f"worker.before_result:refund~1@{tmp_path / 'crashed'}",
    )
    with running(tmp_path / "fleet", env) as stack:
        tenant = fresh_tenant()
        token = stack.token("coordinator", tenant=tenant)
        run_id = await paused_at_gate(stack, tenant, token)
        args = ("approve", "--data-dir", stack.data_dir, run_id, "--tenant", tenant)
        assert (await asyncio.to_thread(fleet, *args, timeout=60)).returncode == 0
        run = await run_when(stack, run_id, token, "completed", "failed", timeout_s=120)
        assert run["state"] == "completed"
        assert victim_pid(tmp_path) in stack.endpoints["processes"].values()
        made = await refunds(stack, tenant)
        assert len(made) == 1 and made[0]["attempts"] == 1, made
        assert await count_rows(stack, "refunds", "tenant_id = %s", tenant) == 1
        events = await all_events(stack, run_id, token)
        assert [e["type"] for e in events].count("approval.granted") == 1
        assert any(e["type"] == "run.resumed" for e in events)
