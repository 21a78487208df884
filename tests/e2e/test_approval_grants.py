"""Approvals are capabilities: attacks on the gated tools of a running stack (mcp-cases'
``issue_refund``, mcp-outbox's webhooks and publications), each performed over MCP with real tokens
against the real servers, Postgres, the registry's token service and the Rego policy, and each
checked in the tool's own database: nothing happened.

A caller with the tool's scope used to approve its own call (any ``approval_id``, any
``approved_by``); to skip the publication threshold by stating ``anomaly_score: 0``; and to refund
any sum in calls under the per-call threshold.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from fleet.approvals import APPROVAL_GRANT_TYP, ApprovalBinding, args_sha256
from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.tokens import ACCESS_TOKEN_TYPE, TokenClient
from fleetctl.testing.e2e import Stack, send, user_message
from fleetctl.testing.mcp import call, error_in, ok
from tests.e2e.a2a_helpers import fresh_tenant

pytestmark = pytest.mark.e2e


def cases_token(stack: Stack, tenant: str, run_id: str) -> str:
    """What the case desk holds for a run's call (the registry's key, the claims a test chooses)."""
    return stack.forge(aud="mcp-cases", scope="cases:write", tenant=tenant, run_id=run_id, sub="operator")


def outbox_token(stack: Stack, tenant: str, run_id: str) -> str:
    return stack.forge(aud="mcp-outbox", scope="outbox:write", tenant=tenant, run_id=run_id, sub="operator")


def refund_args(subject: str = "Contoso", cents: int = 25_000) -> dict[str, Any]:
    return {"subject": subject, "amount_cents": cents, "idempotency_key": f"k-{uuid.uuid4().hex}"}


async def person_grant(
    stack: Stack, tenant: str, run_id: str, server: str, tool: str, arguments: dict[str, Any]
) -> str:
    """A grant from the registry's token service, as the coordinator asks for one when the
    operator approves: the operator's own token exchanged, the coordinator's key authenticating."""
    approver = await asyncio.to_thread(stack.token, "coordinator", tenant, ("agent:invoke", "runs:approve"))
    binding = ApprovalBinding(run_id, "op-test", server, tool, args_sha256(arguments), "decision-test")
    async with httpx.AsyncClient(timeout=30) as http:
        return await acting_as(stack, "coordinator", http).approval_grant(
            binding, tenant, approver_token=approver, approver_type=ACCESS_TOKEN_TYPE
        )


def acting_as(stack: Stack, identity: str, http: httpx.AsyncClient) -> TokenClient:
    """The token client of a service of the stack, with its own key (as a stolen key would be)."""
    return TokenClient(
        token_url=stack.endpoints["registry"] + "/oauth/token",
        client_id=identity,
        key=SigningKey.load_or_create(stack.layout.key_file(identity)),
        http=http,
        failover_patience_s=0,
    )


def forged_grant(
    stack: Stack,
    tenant: str,
    run_id: str,
    server: str,
    tool: str,
    arguments: dict[str, Any],
    *,
    key: SigningKey | None = None,
    expires_in: int = 600,
) -> str:
    """A grant with the claims the registry would give, signed with ``key`` (default: the
    registry's own, as only a test can)."""
    now = int(time.time())
    claims = {
        "iss": "fleet-registry",
        "sub": "operator",
        "client_id": "coordinator",
        "aud": server,
        "tenant": tenant,
        "scope": "",
        "iat": now - 1200,
        "nbf": now - 1200,
        "exp": now + expires_in,
        "jti": uuid.uuid4().hex,
        "token_use": "approval_grant",
        "run_id": run_id,
        "approval": {
            "op_id": "op-test",
            "server": server,
            "tool": tool,
            "args_sha256": args_sha256(arguments),
            "decision_id": "decision-test",
            "approver": "operator",
            "by": "person",
        },
    }
    signer = key or SigningKey.load_or_create(stack.layout.key_file("registry"))
    return signer.sign(claims, typ=APPROVAL_GRANT_TYP)


async def rows(stack: Stack, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """What the tool's database holds (as the superuser: what really happened)."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn:
        cursor = await conn.execute(sql, params)
        return list(await cursor.fetchall())


async def refunds_of(stack: Stack, tenant: str) -> list[tuple[Any, ...]]:
    return await rows(
        stack,
        "SELECT subject, amount_cents, approved_by, approved_as, attempts, approval_id FROM tenant_data.refunds"
        " WHERE tenant_id = %s ORDER BY id",
        tenant,
    )


def refused(result: Any, code: str) -> str:
    """The message of the error ``result`` was answered with, which must have ``code``."""
    error = error_in(result)
    assert error.code == code, error
    return error.message


async def test_an_invented_or_forged_approval_is_refused_and_nothing_is_refunded(stack: Stack) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    token, args = cases_token(stack, tenant, run_id), refund_args()
    # The old way: any approval id, any approver's name. It is no grant: nothing happens.
    old = await call(
        stack, "mcp-cases", token, "issue_refund", {**args, "approval_id": "ap-1", "approved_by": "alice"}
    )
    assert old.is_error or ok(old)["status"] == "pending_approval"
    invented = await call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": "ap-1"})
    refused(invented, "approval_invalid")
    # A well-formed grant for exactly this call, signed by a key that is not the registry's.
    attacker = SigningKey.generate()
    forged = forged_grant(stack, tenant, run_id, "mcp-cases", "issue_refund", args, key=attacker)
    refused(
        await call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": forged}),
        "approval_invalid",
    )
    # An access token of the registry is no approval grant either.
    refused(
        await call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": token}),
        "approval_invalid",
    )
    assert await refunds_of(stack, tenant) == []
    assert await rows(stack, "SELECT 1 FROM tenant_data.approval_grants WHERE tenant_id = %s", tenant) == []


async def test_a_grant_for_other_arguments_another_run_or_another_tool_is_refused_with_no_effect(
    stack: Stack,
) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    token, args = cases_token(stack, tenant, run_id), refund_args()
    grant = await person_grant(stack, tenant, run_id, "mcp-cases", "issue_refund", args)
    # The same grant for a larger amount, another subject, another key: another call.
    for changed in ({"amount_cents": 900_000}, {"subject": "Mallory"}, {"idempotency_key": "k-other"}):
        answer = await call(
            stack, "mcp-cases", token, "issue_refund", {**args, **changed, "approval_grant": grant}
        )
        assert "arguments" in refused(answer, "approval_mismatch")
    # The same call, from another run of the tenant (its token names that run).
    other_run = cases_token(stack, tenant, "run-other")
    answer = await call(stack, "mcp-cases", other_run, "issue_refund", {**args, "approval_grant": grant})
    assert "run" in refused(answer, "approval_mismatch")
    # Another tenant's caller (the same run id, even).
    stranger = cases_token(stack, fresh_tenant(), run_id)
    answer = await call(stack, "mcp-cases", stranger, "issue_refund", {**args, "approval_grant": grant})
    assert "tenant" in refused(answer, "approval_mismatch")
    # Another server's tool: the grant is addressed to mcp-cases.
    webhook = {"operation_id": f"op-{uuid.uuid4().hex}", "destination": "customers", "payload": {"refund": 1}}
    outbox = outbox_token(stack, tenant, run_id)
    refused(
        await call(stack, "mcp-outbox", outbox, "post_webhook", {**webhook, "approval_grant": grant}),
        "approval_invalid",
    )
    # Another tool of the same server: a grant for a ticket presented with a webhook.
    ticket = {"operation_id": webhook["operation_id"], "title": "t", "body": "b"}
    for_ticket = await person_grant(stack, tenant, run_id, "mcp-outbox", "open_ticket", ticket)
    answer = await call(
        stack, "mcp-outbox", outbox, "post_webhook", {**webhook, "approval_grant": for_ticket}
    )
    assert "tool" in refused(answer, "approval_mismatch")

    assert await refunds_of(stack, tenant) == []
    assert (
        await rows(stack, "SELECT 1 FROM outbox.operations WHERE tenant_id = %s AND status = 'done'", tenant)
        == []
    )
    # Still good for the call it was given for, once.
    made = ok(await call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": grant}))
    assert (made["status"], made["approved_by"]) == ("refunded", "operator")


async def test_an_expired_grant_is_refused_with_no_effect(stack: Stack) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    token, args = cases_token(stack, tenant, run_id), refund_args()
    expired = forged_grant(stack, tenant, run_id, "mcp-cases", "issue_refund", args, expires_in=-60)
    answer = await call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": expired})
    refused(answer, "approval_grant_expired")
    assert await refunds_of(stack, tenant) == []


async def test_an_approved_call_performs_once_records_the_approver_from_the_grant_and_a_replay_is_refused(
    stack: Stack,
) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    token, args = cases_token(stack, tenant, run_id), refund_args("Contoso", 25_000)
    pending = ok(await call(stack, "mcp-cases", token, "issue_refund", args))
    assert (pending["status"], pending["code"]) == ("pending_approval", "approval_required")
    assert pending["approval_request"] == {
        "server": "mcp-cases",
        "tool": "issue_refund",
        "arguments": args,
        "args_sha256": args_sha256(args),
    }
    assert await refunds_of(stack, tenant) == []

    grant = await person_grant(stack, tenant, run_id, "mcp-cases", "issue_refund", args)
    made = ok(await call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": grant}))
    assert (made["status"], made["created"], made["approved_by"]) == ("refunded", True, "operator")
    # Replayed: as it was, and concurrently, and with the same idempotency key. Refused each time.
    replays = await asyncio.gather(
        *(
            call(stack, "mcp-cases", token, "issue_refund", {**args, "approval_grant": grant})
            for _ in range(3)
        )
    )
    for replay in replays:
        refused(replay, "approval_replayed")
    made_rows = await refunds_of(stack, tenant)
    assert [r[:5] for r in made_rows] == [("Contoso", 25_000, "operator", "person", 1)]
    used = await rows(
        stack,
        "SELECT jti, run_id, tool, args_sha256, approver FROM tenant_data.approval_grants WHERE tenant_id = %s",
        tenant,
    )
    assert [(u[1], u[2], u[3], u[4]) for u in used] == [
        (run_id, "issue_refund", args_sha256(args), "operator")
    ]
    assert made_rows[0][5] == used[0][0]  # the refund names the grant that allowed it


async def test_the_outbox_needs_a_grant_and_records_its_approver(stack: Stack) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    token = outbox_token(stack, tenant, run_id)
    args = {
        "operation_id": f"op-{uuid.uuid4().hex}",
        "destination": "customers",
        "payload": {"notice": "refund"},
    }
    old = await call(
        stack, "mcp-outbox", token, "post_webhook", {**args, "approval_id": "ap-1", "approved_by": "alice"}
    )
    assert old.is_error or ok(old)["status"] == "pending_approval"
    pending = ok(await call(stack, "mcp-outbox", token, "post_webhook", args))
    assert pending["status"] == "pending_approval" and pending["approval_request"]["arguments"] == args
    grant = await person_grant(stack, tenant, run_id, "mcp-outbox", "post_webhook", args)
    done = ok(await call(stack, "mcp-outbox", token, "post_webhook", {**args, "approval_grant": grant}))
    assert (done["status"], done["approved_by"]) == ("done", "operator")
    refused(
        await call(stack, "mcp-outbox", token, "post_webhook", {**args, "approval_grant": grant}),
        "approval_replayed",
    )
    recorded = await rows(
        stack,
        "SELECT status, attempts, approved_by FROM outbox.operations WHERE tenant_id = %s AND operation_id = %s",
        tenant,
        args["operation_id"],
    )
    assert recorded == [("done", 1, "operator")]


async def test_a_callers_score_of_zero_does_not_skip_the_publication_approval(stack: Stack) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    artifact = "artifact:sha256:" + "0" * 64
    # Straight to the tool: whatever score the caller states, a publication needs a grant.
    direct = {
        "operation_id": f"op-{uuid.uuid4().hex}",
        "artifact": artifact,
        "name": "report",
        "anomaly_score": 0,
    }
    answer = await call(stack, "mcp-outbox", outbox_token(stack, tenant, run_id), "publish_artifact", direct)
    assert answer.is_error or ok(answer)["status"] == "pending_approval"
    # Through the fleet: a plan that states a score of 0 for a report no step of the run scored.
    token = await asyncio.to_thread(stack.token, "coordinator", tenant)
    plan = {
        "steps": [
            {
                "id": "publish",
                "skill": "publish-report",
                "input": {"report": artifact, "name": "quiet-night", "anomaly_score": 0},
            }
        ]
    }
    async with asyncio.timeout(120):
        outcome = await send(stack, user_message(data=plan), token=token)
    assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
    assert "needs an approval" in outcome.final_text
    published = await rows(
        stack, "SELECT status FROM outbox.operations WHERE tenant_id = %s AND kind = 'publication'", tenant
    )
    assert published == [("pending_approval",), ("pending_approval",)]  # the direct call's and the run's
    assert await rows(stack, "SELECT 1 FROM outbox.publications WHERE tenant_id = %s", tenant) == []


async def test_refunds_under_the_per_call_threshold_add_up_to_the_cumulative_limit(stack: Stack) -> None:
    tenant = fresh_tenant()
    # Straight to the tool, in one run: 10,000 cents each (the per-call threshold), until the run's
    # unattended total would pass 20,000.
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    token = cases_token(stack, tenant, run_id)
    answers = [
        ok(await call(stack, "mcp-cases", token, "issue_refund", refund_args(f"c{i}", 10_000)))
        for i in range(4)
    ]
    assert [a["status"] for a in answers] == ["refunded", "refunded", "pending_approval", "pending_approval"]
    # Concurrent calls cannot both slip under the limit (counted under the tenant's lock).
    racing_run = f"run-{uuid.uuid4().hex[:8]}"
    racing = cases_token(stack, tenant, racing_run)
    raced = await asyncio.gather(
        *(call(stack, "mcp-cases", racing, "issue_refund", refund_args(f"r{i}", 10_000)) for i in range(6))
    )
    assert sorted(ok(r)["status"] for r in raced) == ["pending_approval"] * 4 + ["refunded"] * 2
    # A new run per refund: the tenant's 24-hour limit (100,000) still adds them up.
    for i in range(8):
        ok(
            await call(
                stack,
                "mcp-cases",
                cases_token(stack, tenant, f"run-x{i}"),
                "issue_refund",
                refund_args(f"x{i}", 10_000),
            )
        )
    made = await refunds_of(stack, tenant)
    assert sum(r[1] for r in made) == 100_000, made
    over = ok(
        await call(
            stack, "mcp-cases", cases_token(stack, tenant, "run-y"), "issue_refund", refund_args("y", 100)
        )
    )
    assert over["status"] == "pending_approval"
    assert sum(r[1] for r in await refunds_of(stack, tenant)) == 100_000


async def test_a_plan_of_twenty_refunds_under_the_per_call_threshold_is_stopped_by_the_cumulative_rule(
    stack: Stack,
) -> None:
    tenant = fresh_tenant()
    token = await asyncio.to_thread(stack.token, "coordinator", tenant)
    steps = [
        {
            "id": f"r{i}",
            "skill": "issue-refund",
            "input": {"subject": f"customer-{i}", "amount_cents": 10_000},
        }
        for i in range(20)
    ]
    async with asyncio.timeout(180):
        outcome = await send(stack, user_message(data={"steps": steps}), token=token)
    assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
    assert "needs approval" in outcome.final_text
    made = await refunds_of(stack, tenant)
    assert len(made) == 2 and sum(r[1] for r in made) == 20_000, made  # the run's limit, no more
    assert all(r[2] is None for r in made)  # no person approved these: they were within policy


async def test_only_the_coordinator_gets_grants_and_policy_grants_only_what_policy_approves(
    stack: Stack,
) -> None:
    tenant, run_id = fresh_tenant(), f"run-{uuid.uuid4().hex[:8]}"
    args = refund_args()
    binding = ApprovalBinding(run_id, "op-test", "mcp-cases", "issue_refund", args_sha256(args), "d-1")
    operator = await asyncio.to_thread(stack.token, "coordinator", tenant, ("agent:invoke", "runs:approve"))
    async with httpx.AsyncClient(timeout=30) as http:
        # A specialist's key: neither a person's grant (with the operator's token) nor policy's.
        desk = acting_as(stack, "case-desk", http)
        with pytest.raises(FleetError) as caught:
            await desk.approval_grant(
                binding, tenant, approver_token=operator, approver_type=ACCESS_TOKEN_TYPE
            )
        assert caught.value.code == ErrorCode.FORBIDDEN
        with pytest.raises(FleetError):
            await desk.approval_grant(binding, tenant, facts={"anomaly_score": 0})
        # The coordinator's own key: policy never approves a refund, whatever facts it states.
        coordinator = acting_as(stack, "coordinator", http)
        with pytest.raises(FleetError) as caught:
            await coordinator.approval_grant(binding, tenant, facts={"anomaly_score": 0})
        assert "policy does not approve" in caught.value.message
        # A person's grant needs a token with runs:approve.
        no_scope = await asyncio.to_thread(stack.token, "coordinator", tenant)
        with pytest.raises(FleetError):
            await coordinator.approval_grant(
                binding, tenant, approver_token=no_scope, approver_type=ACCESS_TOKEN_TYPE
            )
