"""Runs are owned: inside one tenant, a principal reaches only the runs it started, unless it holds
the tenant-admin scope ``runs:admin`` (policy ``fleet.runs.access``). Attacks by a second principal of
the same tenant over A2A (GetTask, ListTasks, SubscribeToTask and its resubscribe, follow-ups,
CancelTask, push configs), the run API (list, read, SSE events, signals, cancel) and the console;
cancels through the approvals policy on every path; A2A contexts that belong to their principal.
Real processes: the shared stack, with tokens of other subjects signed by the registry's key
(``Stack.forge``) and by the partner IdP the stack trusts (mapped subjects ``partner:<sub>``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import psycopg
import pytest
from a2a.helpers import new_data_part
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import A2AError, InvalidParamsError, TaskNotCancelableError

from fleet.a2a_support import error_of_a2a
from fleetctl.testing.e2e import Stack, fleet, send, user_message
from tests.e2e.a2a_helpers import a2a_client, as_tenant, free_port, fresh_tenant, start, subscribe
from tests.e2e.identities import PartnerIdp

pytestmark = pytest.mark.e2e

WAITS: dict[str, Any] = {"steps": [{"id": "hold", "wait": {"for_s": 3600}}]}  # parks for an hour
CANCELED = TaskState.TASK_STATE_CANCELED


def person(stack: Stack, sub: str, tenant: str, *scopes: str) -> str:
    """A fleet token for ``sub`` in ``tenant``, signed by the registry's own key."""
    return stack.forge(sub=sub, tenant=tenant, scope=" ".join(("agent:invoke", *scopes)))


async def waiting_run(stack: Stack, token: str, reader: str = "", context_id: str = "") -> str:
    """Start a run as ``token``'s principal; return its id once it waits (seen by ``reader``, a
    fleet token of the tenant: an outside issuer's token is good for A2A only)."""
    message = user_message(data=WAITS)
    if context_id:
        message.context_id = context_id
    task = await start(stack, token, message)
    await state_when(stack, task.id, reader or token, "waiting")
    return task.id


async def api(stack: Stack, method: str, path: str, token: str, body: Any = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.request(
            method,
            stack.endpoints["coordinator"] + path,
            headers={"Authorization": f"Bearer {token}"},
            json=body,
        )


async def answer_of(stack: Stack, path: str, token: str) -> tuple[int, str]:
    """The status and, unless it is a stream that goes on (SSE of a waiting run), the body of a GET."""
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream(
            "GET", stack.endpoints["coordinator"] + path, headers={"Authorization": f"Bearer {token}"}
        ) as response,
    ):
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status_code, ""
        return response.status_code, (await response.aread()).decode()


async def state_when(stack: Stack, run_id: str, token: str, *states: str) -> dict[str, Any]:
    async with asyncio.timeout(60):
        while True:
            run: dict[str, Any] = (await api(stack, "GET", f"/v1/runs/{run_id}", token)).json()
            if run.get("state") in states:
                return run
            await asyncio.sleep(0.2)


async def error_of(call: Callable[[], Awaitable[Any]]) -> tuple[str, str]:
    with pytest.raises(A2AError) as caught:
        await call()
    return type(caught.value).__name__, str(caught.value).replace("no-such-task", "<id>")


async def a2a_answers(stack: Stack, task_id: str, token: str) -> list[tuple[str, str]]:
    """What every A2A task operation answers ``token`` about ``task_id`` (the id masked)."""
    context = as_tenant(token)
    hook = TaskPushNotificationConfig(task_id=task_id, url=f"http://127.0.0.1:{free_port()}/hook")
    follow_up = SendMessageRequest(
        message=Message(
            role=Role.ROLE_USER,
            message_id=uuid.uuid4().hex,
            task_id=task_id,
            parts=[new_data_part({"action": "cancel"})],
        ),
        configuration=SendMessageConfiguration(return_immediately=True, task_push_notification_config=hook),
    )
    async with a2a_client(stack, streaming=False) as client:
        answers = [
            await error_of(lambda: client.get_task(GetTaskRequest(id=task_id), context=context)),
            await error_of(lambda: client.cancel_task(CancelTaskRequest(id=task_id), context=context)),
            await error_of(lambda: client.create_task_push_notification_config(hook, context=context)),
            await error_of(
                lambda: client.list_task_push_notification_configs(
                    ListTaskPushNotificationConfigsRequest(task_id=task_id), context=context
                )
            ),
            await error_of(lambda: _drain(client.send_message(follow_up, context=context))),
        ]
    for cursor in (None, 0):
        answers.append(await error_of(functools.partial(subscribe, stack, task_id, token, cursor)))
    return [(name, text.replace(task_id, "<id>")) for name, text in answers]


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def push_urls(stack: Stack, task_id: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute("SELECT url FROM fleet_runs.push_configs WHERE task_id = %s", (task_id,))
        return [str(row[0]) for row in await cursor.fetchall()]


async def test_a_partner_user_cannot_read_cancel_follow_or_push_another_users_task_but_an_admin_can(
    stack: Stack, partner_idp: PartnerIdp
) -> None:
    alice, bob = partner_idp.token("alice"), partner_idp.token("bob")  # both mapped into globex
    fleet_admin = person(stack, "auditor", "globex", "runs:admin")
    task_id = await waiting_run(stack, alice, fleet_admin)
    answers = await a2a_answers(stack, task_id, bob)
    assert answers == await a2a_answers(stack, "no-such-task", bob)  # exactly as for a missing task
    assert {name for name, _ in answers} == {"TaskNotFoundError"}
    async with a2a_client(stack, streaming=False) as client:
        listed = await client.list_tasks(ListTasksRequest(), context=as_tenant(bob))
        assert task_id not in [t.id for t in listed.tasks]
        mine = await client.list_tasks(ListTasksRequest(), context=as_tenant(alice))
        assert task_id in [t.id for t in mine.tasks]
        # The tenant admin reads it, and may watch it with a push config.
        seen = await client.get_task(GetTaskRequest(id=task_id), context=as_tenant(fleet_admin))
        assert seen.id == task_id
        hook = TaskPushNotificationConfig(task_id=task_id, url=f"http://127.0.0.1:{free_port()}/admin")
        await client.create_task_push_notification_config(hook, context=as_tenant(fleet_admin))
    # Nothing bob tried took hold: no config of his, no cancel; the run still waits.
    assert [url.rsplit("/", 1)[1] for url in await push_urls(stack, task_id)] == ["admin"]
    run = await state_when(stack, task_id, fleet_admin, "waiting")
    assert run["owner"] == "partner:alice"
    assert "run.cancel_requested" not in await event_types(stack, task_id)


async def event_types(stack: Stack, run_id: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT type FROM fleet_runs.events WHERE run_id = %s ORDER BY seq", (run_id,)
        )
        return [str(row[0]) for row in await cursor.fetchall()]


async def test_a_second_principal_gets_not_found_from_every_run_api_route_and_an_admin_does_not(
    stack: Stack,
) -> None:
    tenant = fresh_tenant()
    alice, bob = person(stack, "alice", tenant), person(stack, "bob", tenant, "runs:approve", "runs:resolve")
    admin = person(stack, "auditor", tenant, "runs:admin")
    run_id = await waiting_run(stack, alice)
    reads = ("", "/events", "/signals", "/operations", "/debug-bundle")
    for suffix in reads:
        theirs = await answer_of(stack, f"/v1/runs/{run_id}{suffix}", bob)
        missing = await answer_of(stack, f"/v1/runs/no-such-run{suffix}", bob)
        assert theirs[0] == missing[0] == 404, (suffix, theirs)
        assert json.loads(theirs[1])["error"]["code"] == "not_found"
        assert theirs[1].replace(run_id, "<id>") == missing[1].replace("no-such-run", "<id>")
        assert (await answer_of(stack, f"/v1/runs/{run_id}{suffix}", admin))[0] == 200, suffix
        assert (await answer_of(stack, f"/v1/runs/{run_id}{suffix}", alice))[0] == 200, suffix
    listed = (await api(stack, "GET", "/v1/runs", bob)).json()["runs"]
    assert listed == []  # never even loaded
    assert [r["run_id"] for r in (await api(stack, "GET", "/v1/runs", admin)).json()["runs"]] == [run_id]
    # Neither cancel nor a decision by bob reaches it (his scopes reach runs to answer them, and the
    # approvals policy, which names only the operator, refuses him).
    cancel = await api(stack, "POST", f"/v1/runs/{run_id}/signals", bob, {"action": "cancel"})
    assert cancel.status_code == 403 and "bob may not cancel" in cancel.text, cancel.text
    stranger = person(stack, "carol", tenant)  # no scope at all: not found
    assert (
        await api(stack, "POST", f"/v1/runs/{run_id}/signals", stranger, {"action": "cancel"})
    ).status_code == 404
    decide = await api(stack, "POST", f"/v1/runs/{run_id}/decision", stranger, {"decision": "close"})
    assert decide.status_code == 403  # the resolve scope is checked first, as before
    assert (await state_when(stack, run_id, alice, "waiting"))["owner"] == "alice"


async def test_every_cancel_path_goes_through_the_approvals_policy(stack: Stack) -> None:
    tenant = fresh_tenant()
    alice = person(stack, "alice", tenant)
    admin = person(stack, "auditor", tenant, "runs:admin")  # reaches the run, approves nothing
    first = await waiting_run(stack, alice)
    async with a2a_client(stack, streaming=False) as client:
        with pytest.raises(TaskNotCancelableError) as refused:
            await client.cancel_task(CancelTaskRequest(id=first), context=as_tenant(admin))
    error = error_of_a2a(refused.value)
    assert error.code == "forbidden" and "auditor may not cancel" in error.message
    over_api = await api(stack, "POST", f"/v1/runs/{first}/signals", admin, {"action": "cancel"})
    assert over_api.status_code == 403 and "auditor may not cancel" in over_api.text
    signals = (await api(stack, "GET", f"/v1/runs/{first}/signals", admin)).json()["signals"]
    assert [(s["signer"], s["via"], s["outcome"]) for s in signals] == [
        ("auditor", "a2a", "forbidden"),
        ("auditor", "api", "forbidden"),
    ]
    assert (await state_when(stack, first, alice, "waiting"))["state"] == "waiting"
    # The owner may stop what it started (owner_may_cancel), over A2A, recorded as a signal.
    async with a2a_client(stack, streaming=False) as client:
        done = await client.cancel_task(CancelTaskRequest(id=first), context=as_tenant(alice))
    assert done.status.state == CANCELED
    signals = (await api(stack, "GET", f"/v1/runs/{first}/signals", alice)).json()["signals"]
    assert [(s["signer"], s["via"], s["outcome"]) for s in signals][-1] == ("alice", "a2a", "applied")
    # The operator's CLI (runs:admin, and an approver by policy) cancels another principal's run.
    second = await waiting_run(stack, alice)
    result = await asyncio.to_thread(
        fleet, "runs", "cancel", second, "--tenant", tenant, "--data-dir", stack.data_dir, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (await state_when(stack, second, alice, "canceled"))["state"] == "canceled"


async def test_a_new_task_cannot_join_a_context_another_principal_or_tenant_made(
    stack: Stack, partner_idp: PartnerIdp
) -> None:
    alice, bob = partner_idp.token("alice"), partner_idp.token("bob")
    admin = person(stack, "auditor", "globex", "runs:admin")
    task_id = await waiting_run(stack, alice, admin)
    async with a2a_client(stack, streaming=False) as client:
        context_id = (await client.get_task(GetTaskRequest(id=task_id), context=as_tenant(alice))).context_id
    # Bob, of the same tenant, and the operator of another tenant: refused, with a clear code.
    for intruder in (bob, person(stack, "operator", "acme")):
        message = user_message(data=WAITS)
        message.context_id = context_id
        with pytest.raises(InvalidParamsError) as caught:
            await send(stack, message, token=intruder)
        assert error_of_a2a(caught.value).code == "context_refused", caught.value
    # Alice's own context goes on; a context nobody made yet becomes hers.
    again = await waiting_run(stack, alice, admin, context_id)
    async with a2a_client(stack, streaming=False) as client:
        listed = await client.list_tasks(ListTasksRequest(context_id=context_id), context=as_tenant(alice))
        assert sorted(t.id for t in listed.tasks) == sorted([task_id, again])
        by_bob = await client.list_tasks(ListTasksRequest(context_id=context_id), context=as_tenant(bob))
        assert list(by_bob.tasks) == []


async def test_the_console_shows_a_person_only_their_own_runs_unless_signed_in_as_tenant_admin(
    stack: Stack,
) -> None:
    base, tenant = stack.endpoints["console"], fresh_tenant()
    run_id = await waiting_run(stack, person(stack, "alice", tenant))
    # The operator, signed in without runs:admin: the console acts in their name, and alice's run is
    # not theirs (cancel included: without runs:approve they do not reach it even to ask).
    signin = stack.token("console", tenant=tenant, scopes=("agent:invoke", "registry:read"))
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{base}/session", headers={"authorization": f"Bearer {signin}", "x-fleet-console": "1"}
        )
        assert response.status_code == 200, response.text
        assert (await http.get(f"{base}/api/runs")).json()["runs"] == []
        assert (await http.get(f"{base}/api/runs/{run_id}")).status_code == 404
        assert (await http.get(f"{base}/api/runs/{run_id}/signals")).status_code == 404
        async with http.stream("GET", f"{base}/api/runs/{run_id}/events") as events:
            assert events.status_code == 404
        cancel = await http.post(
            f"{base}/api/runs/{run_id}/signals", json={"action": "cancel"}, headers={"x-fleet-console": "1"}
        )
        assert cancel.status_code == 404, cancel.text
    # The operator's link (fleet console) signs in with runs:admin: every run of the tenant.
    link = await asyncio.to_thread(
        fleet, "console", "--data-dir", stack.data_dir, "--tenant", tenant, "--json", timeout=60
    )
    token = json.loads(link.stdout)["sign_in"].split("#token=", 1)[1]
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{base}/session", headers={"authorization": f"Bearer {token}", "x-fleet-console": "1"}
        )
        assert response.status_code == 200, response.text
        assert [r["run_id"] for r in (await http.get(f"{base}/api/runs")).json()["runs"]] == [run_id]
        assert (await http.get(f"{base}/api/runs/{run_id}")).json()["owner"] == "alice"
    assert (await state_when(stack, run_id, person(stack, "alice", tenant), "waiting"))["state"] == "waiting"
