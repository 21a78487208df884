"""The coordinator's durable A2A surface against the real stack: tenant-scoped task listing, resumable
subscriptions, cancel racing the end of a run, signed push notifications, SSRF screening, and the
extended card. Restarts and retention are in ``test_a2a_restart.py``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

import httpx
import pytest
from a2a.helpers import get_text_parts
from a2a.types import (
    AuthenticationInfo,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    A2AError,
    InvalidParamsError,
    TaskNotCancelableError,
    UnsupportedOperationError,
)

from coordinator.a2a_surface.task_events import event_id_of
from fleet.a2a_support import error_of_a2a
from fleetctl.testing.e2e import Stack, fetch_card, send, user_message
from tests.e2e.a2a_helpers import (
    INLINE_OUTLIERS,
    SLOW_STEPS,
    a2a_client,
    as_tenant,
    event_id,
    free_port,
    fresh_tenant,
    only_run,
    receiver,
    run_events,
    start,
    state_of,
    subscribe,
)

pytestmark = pytest.mark.e2e

RESUME = "https://agent-fleet.dev/ext/resume/v1"
COMPLETED = TaskState.TASK_STATE_COMPLETED
CANCELED = TaskState.TASK_STATE_CANCELED


async def test_list_tasks_shows_only_the_callers_tenant_newest_first_in_pages(stack: Stack) -> None:
    token, other = (
        stack.token("coordinator", tenant=fresh_tenant()),
        stack.token("coordinator", tenant=fresh_tenant()),
    )
    mine = [(await send(stack, user_message(data=INLINE_OUTLIERS), token=token)).task_id for _ in range(3)]
    theirs = (await send(stack, user_message(data=INLINE_OUTLIERS), token=other)).task_id
    async with a2a_client(stack, streaming=False) as client:

        async def listing(**fields: Any) -> Any:
            return await client.list_tasks(ListTasksRequest(**fields), context=as_tenant(token))

        first = await listing(page_size=2)
        assert [t.id for t in first.tasks] == [mine[2], mine[1]]
        assert (first.total_size, first.page_size) == (3, 2)
        assert all(t.status.state == COMPLETED and not t.artifacts for t in first.tasks)
        second = await listing(page_size=2, page_token=first.next_page_token)
        assert [t.id for t in second.tasks] == [mine[0]]
        assert second.next_page_token == ""

        with_artifacts = await listing(page_size=1, include_artifacts=True)
        assert with_artifacts.tasks[0].artifacts[0].name == "result"
        assert (await listing(status=TaskState.TASK_STATE_WORKING)).tasks == []
        assert [t.id for t in (await listing(status=COMPLETED)).tasks] == mine[::-1]
        assert [t.id for t in (await listing(context_id=first.tasks[0].context_id)).tasks] == [mine[2]]

        others = await client.list_tasks(ListTasksRequest(), context=as_tenant(other))
        assert [t.id for t in others.tasks] == [theirs]
        with pytest.raises(InvalidParamsError, match="page_token"):
            await listing(page_token="bm90LWEtdG9rZW4")


async def error_of(call: Callable[[], Awaitable[Any]]) -> tuple[str, str]:
    with pytest.raises(A2AError) as caught:
        await call()
    return type(caught.value).__name__, str(caught.value)


async def refusals(stack: Stack, task_id: str, token: str) -> list[tuple[str, str]]:
    """What every task operation answers ``token`` about ``task_id``."""
    context = as_tenant(token)
    hook = TaskPushNotificationConfig(task_id=task_id, url=f"http://127.0.0.1:{free_port()}/hook")
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
        ]
    for cursor in (None, 1):
        answers.append(await error_of(functools.partial(subscribe, stack, task_id, token, cursor)))
    return answers


async def test_another_tenants_task_is_answered_exactly_like_a_missing_one(stack: Stack) -> None:
    owner = stack.token("coordinator")
    task = await start(stack, owner, user_message(data=SLOW_STEPS))
    intruder = stack.token("coordinator", tenant=fresh_tenant())
    answers = await refusals(stack, task.id, intruder)
    assert answers == await refusals(stack, "no-such-task", intruder)
    assert {name for name, _ in answers} == {"TaskNotFoundError"}
    # None of it touched the owner's run.
    final = await subscribe(stack, task.id, owner, last_event_id=0)
    assert state_of(final[-1]) == COMPLETED
    types = [e["type"] for e in await run_events(stack, task.id, owner)]
    assert "run.cancel_requested" not in types


async def test_resubscribing_with_the_last_event_id_gives_exactly_the_missed_updates(stack: Stack) -> None:
    token = stack.token("coordinator")
    task = await start(stack, token, user_message(data=SLOW_STEPS))
    seen = []
    async with a2a_client(stack) as client:
        stream = cast(
            AsyncGenerator[StreamResponse],
            client.subscribe(SubscribeToTaskRequest(id=task.id), context=as_tenant(token)),
        )
        async for response in stream:
            seen.append(response)
            if len(seen) == 4:  # the snapshot and three updates; then the connection drops
                break
        await stream.aclose()
    assert seen[0].WhichOneof("payload") == "task"
    last = event_id(seen[-1])
    assert last is not None

    resumed = await subscribe(stack, task.id, token, last_event_id=last)
    assert resumed[0].WhichOneof("payload") == "task"
    assert event_id(resumed[0]) == last
    assert state_of(resumed[-1]) == COMPLETED

    history = await subscribe(stack, task.id, token, last_event_id=0)
    after_snapshot = [r for r in history[1:] if (event_id(r) or 0) > (event_id(seen[0]) or 0)]
    assert seen[1:] + resumed[1:] == after_snapshot
    ids = [event_id(r) or 0 for r in after_snapshot]
    assert ids == sorted(set(ids))


async def test_closing_a_stream_never_cancels_the_run(stack: Stack) -> None:
    token = stack.token("coordinator")
    async with a2a_client(stack) as client:
        request = SendMessageRequest(message=user_message(data=SLOW_STEPS))
        stream = cast(AsyncGenerator[StreamResponse], client.send_message(request, context=as_tenant(token)))
        first = await anext(stream)
        await stream.aclose()
    task_id = first.task.id
    rest = await subscribe(stack, task_id, token, last_event_id=0)
    assert state_of(rest[-1]) == COMPLETED
    types = [e["type"] for e in await run_events(stack, task_id, token)]
    assert "run.cancel_requested" not in types
    assert types[-1] == "run.completed"


async def test_subscribe_refuses_an_ended_task_without_a_cursor_and_a_bad_cursor(stack: Stack) -> None:
    token = stack.token("coordinator")
    ended = await send(stack, user_message(data=INLINE_OUTLIERS), token=token)
    with pytest.raises(UnsupportedOperationError, match="Last-Event-ID"):
        await subscribe(stack, ended.task_id, token)
    with pytest.raises(InvalidParamsError, match=r"^Last-Event-ID must be") as bad:
        await subscribe(stack, ended.task_id, token, last_event_id=-1)
    with pytest.raises(InvalidParamsError, match=r"^Last-Event-ID 9999 is beyond") as beyond:
        await subscribe(stack, ended.task_id, token, last_event_id=9999)
    assert error_of_a2a(bad.value).code == error_of_a2a(beyond.value).code == "invalid_request"
    # An ended task with a cursor: the updates after it, and the stream ends with the task.
    tail = await subscribe(stack, ended.task_id, token, last_event_id=1)
    assert tail[0].task.id == ended.task_id
    assert state_of(tail[-1]) == COMPLETED


@pytest.mark.parametrize("trigger", ["run.working", "step.started", "artifact"])
async def test_a_cancel_racing_the_run_leaves_the_one_terminal_state_the_run_reached(
    stack: Stack, trigger: str
) -> None:
    token = stack.token("coordinator", tenant=fresh_tenant())
    streaming = asyncio.create_task(send(stack, user_message(data=INLINE_OUTLIERS), token=token))
    run_id = await only_run(stack, token)
    await run_events(stack, run_id, token, until=trigger)
    async with a2a_client(stack, streaming=False) as client:
        try:
            answer: TaskState | None = (
                await client.cancel_task(CancelTaskRequest(id=run_id), context=as_tenant(token))
            ).status.state
        except TaskNotCancelableError:
            answer = None
        task = await client.get_task(GetTaskRequest(id=run_id), context=as_tenant(token))
        outcome = await streaming
        ends = [e["type"] for e in await run_events(stack, run_id, token) if e["type"] in END]
        assert len(ends) == 1
        reached = END[ends[0]]
        assert reached in (COMPLETED, CANCELED)
        assert task.status.state == reached
        assert outcome.state == reached
        assert answer == (CANCELED if reached == CANCELED else None)
        # Canceling again changes nothing: the task, or "not cancelable", once more.
        if reached == CANCELED:
            again = await client.cancel_task(CancelTaskRequest(id=run_id), context=as_tenant(token))
            assert again.status.state == CANCELED
        else:
            with pytest.raises(TaskNotCancelableError, match="already ended COMPLETED"):
                await client.cancel_task(CancelTaskRequest(id=run_id), context=as_tenant(token))


END = {
    "run.completed": COMPLETED,
    "run.canceled": CANCELED,
    "run.failed": TaskState.TASK_STATE_FAILED,
}


async def test_pushes_are_signed_by_the_coordinator_and_carry_every_update(stack: Stack) -> None:
    token = stack.token("coordinator")
    async with receiver(stack) as hook:
        url = hook.url()
        push = TaskPushNotificationConfig(url=url, token="client-check-value")
        task = await start(stack, token, user_message(data=INLINE_OUTLIERS), push=push)
        pushes = await hook.until_final(task.id)
    assert hook.refused == []
    history = await subscribe(stack, task.id, token, last_event_id=0)
    assert [p.response for p in pushes] == history[1:]
    for push_ in pushes:
        assert push_.claims["aud"] == url
        assert push_.claims["taskId"] == task.id
        assert push_.claims["eventId"] == event_id(push_.response)
        assert push_.authorization == f"Bearer {push_.signature}"
        assert push_.token == "client-check-value"


async def test_push_configs_are_kept_per_task_and_never_show_their_credentials(stack: Stack) -> None:
    token = stack.token("coordinator")
    ended = await send(stack, user_message(data=INLINE_OUTLIERS), token=token)
    context = as_tenant(token)
    async with receiver(stack) as hook, a2a_client(stack, streaming=False) as client:
        url = hook.url()
        created = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(
                task_id=ended.task_id,
                id="ops",
                url=url,
                authentication=AuthenticationInfo(scheme="Bearer", credentials="webhook-secret"),
            ),
            context=context,
        )
        assert (created.id, created.url, created.authentication.scheme) == ("ops", url, "Bearer")
        assert created.authentication.credentials == ""
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=ended.task_id), context=context
        )
        assert [(c.id, c.authentication.credentials) for c in listed.configs] == [("ops", "")]
        got = await client.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=ended.task_id, id="ops"), context=context
        )
        assert got.url == url
        # A config set on an ended task replays its updates; its own credentials authenticate them.
        pushes = await hook.until_final(ended.task_id)
        assert {p.authorization for p in pushes} == {"Bearer webhook-secret"}
        assert hook.refused == []
        for _ in range(2):  # deleting is idempotent
            await client.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=ended.task_id, id="ops"), context=context
            )
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=ended.task_id), context=context
        )
        assert list(listed.configs) == []


async def test_a_failing_webhook_is_retried_and_never_holds_up_the_run(stack: Stack) -> None:
    token = stack.token("coordinator")
    async with receiver(stack, fail_first=2) as hook:
        task = await start(
            stack, token, user_message(data=INLINE_OUTLIERS), push=TaskPushNotificationConfig(url=hook.url())
        )
        async with a2a_client(stack, streaming=False) as client:
            nobody = f"http://127.0.0.1:{free_port()}/nobody-listens"
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task.id, id="dead", url=nobody), context=as_tenant(token)
            )
        history = await subscribe(stack, task.id, token, last_event_id=0)
        assert state_of(history[-1]) == COMPLETED
        pushes = await hook.until_final(task.id)
    assert hook.failed == 2
    assert [p.response for p in pushes] == history[1:]


async def test_a_push_url_to_an_internal_address_is_refused_with_a_clear_error(stack: Stack) -> None:
    token = stack.token("coordinator", tenant=fresh_tenant())
    ended = await send(stack, user_message(data=INLINE_OUTLIERS), token=token)
    refused = {
        "http://169.254.169.254/latest/meta-data/": "does not resolve to public addresses",
        "http://10.1.2.3/hook": "does not resolve to public addresses",
        "http://localhost:8080/hook": "does not resolve to public addresses",
        "http://[::1]:8080/hook": "does not resolve to public addresses",
        "file:///etc/passwd": "must be an http or https URL",
        "http://user:pw@127.0.0.1:8080/hook": "must not carry credentials",
    }
    async with a2a_client(stack, streaming=False) as client:
        for url, reason in refused.items():
            with pytest.raises(InvalidParamsError) as caught:
                await client.create_task_push_notification_config(
                    TaskPushNotificationConfig(task_id=ended.task_id, url=url), context=as_tenant(token)
                )
            assert error_of_a2a(caught.value).code == "push_url_refused", caught.value
            assert reason in caught.value.message
        # Set with the message itself, the URL is refused before any run starts.
        with pytest.raises(InvalidParamsError) as refused_url:
            await start(
                stack,
                token,
                user_message(data=INLINE_OUTLIERS),
                push=TaskPushNotificationConfig(url="http://169.254.169.254/"),
            )
        assert error_of_a2a(refused_url.value).code == "push_url_refused"
        listing = await client.list_tasks(ListTasksRequest(), context=as_tenant(token))
        assert [t.id for t in listing.tasks] == [ended.task_id]


async def test_the_extended_card_needs_a_token_and_tells_the_caller_its_tenancy(stack: Stack) -> None:
    base = stack.endpoints["coordinator"]
    async with httpx.AsyncClient() as http:
        card = await fetch_card(http, base)
        assert card.capabilities.streaming and card.capabilities.push_notifications
        assert card.capabilities.extended_agent_card
        uris = [e.uri for e in card.capabilities.extensions]
        assert uris == [RESUME, "https://agent-fleet.dev/ext/push-signature/v1"]
        jwks = (await http.get(base + "/.well-known/jwks.json")).json()
        assert card.signatures[0].protected  # signed, with the key published there
        body = {"jsonrpc": "2.0", "id": 1, "method": "GetExtendedAgentCard", "params": {}}
        anonymous = await http.post(base + "/a2a/jsonrpc", json=body, headers={"A2A-Version": "1.0"})
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert [k["kty"] for k in jwks["keys"]] == ["EC"]
    async with a2a_client(stack, streaming=False) as client:
        extended = await client.get_extended_agent_card(
            GetExtendedAgentCardRequest(), context=as_tenant(stack.token("coordinator", tenant="globex"))
        )
    tenancy = {e.uri: e for e in extended.capabilities.extensions}["https://agent-fleet.dev/ext/tenancy/v1"]
    assert tenancy.params["tenant"] == "globex"
    assert tenancy.params["subject"] == "operator"
    assert len(extended.signatures) == 1


async def test_status_messages_and_the_result_are_the_same_live_and_replayed(stack: Stack) -> None:
    token = stack.token("coordinator")
    outcome = await send(stack, user_message(data=INLINE_OUTLIERS), token=token)
    replayed = await subscribe(stack, outcome.task_id, token, last_event_id=0)
    texts = [
        " ".join(get_text_parts(r.status_update.status.message.parts))
        for r in replayed[1:]
        if r.status_update.status.message.parts
    ]
    assert texts == outcome.progress
    assert outcome.progress[0] == "plan: outliers"
    async with a2a_client(stack, streaming=False) as client:
        task = await client.get_task(GetTaskRequest(id=outcome.task_id), context=as_tenant(token))
    assert event_id_of(task.metadata) == event_id(replayed[-1])
    assert task.artifacts[0].name == "result"
