"""The A2A surface on both of its HTTP bindings, JSON-RPC and HTTP+JSON (REST), against the real
stack: one handler and one task store behind both, the same bearer check on each, and a task made
over one binding read, followed and canceled over the other."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import TaskNotFoundError

from fleet.a2a_support import REST_PATH, RPC_PATH
from fleetctl.testing.e2e import Stack, fetch_card, user_message
from tests.e2e.a2a_helpers import SLOW_STEPS, as_tenant, fresh_tenant, state_of

pytestmark = pytest.mark.e2e

BINDINGS = {"JSONRPC": RPC_PATH, "HTTP+JSON": REST_PATH}


@contextlib.asynccontextmanager
async def client_on(stack: Stack, binding: str, *, streaming: bool = True) -> AsyncIterator[Client]:
    """An a2a-sdk client of the coordinator that speaks ``binding`` only."""
    async with httpx.AsyncClient(timeout=60) as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
        config = ClientConfig(streaming=streaming, httpx_client=http, supported_protocol_bindings=[binding])
        client = ClientFactory(config).create(card)
        try:
            yield client
        finally:
            await client.close()


@pytest.mark.parametrize("agent", ["coordinator", "stats"])
async def test_every_card_declares_both_bindings_in_the_order_of_preference(stack: Stack, agent: str) -> None:
    base = stack.endpoints["coordinator"] if agent == "coordinator" else stack.endpoints["specialists"][agent]
    async with httpx.AsyncClient(timeout=30) as http:
        card = await fetch_card(http, base)
    declared = [(i.protocol_binding, i.url, i.protocol_version) for i in card.supported_interfaces]
    assert declared == [(binding, base + path, "1.0") for binding, path in BINDINGS.items()]


async def test_a_task_made_over_json_rpc_is_read_followed_and_canceled_over_rest(stack: Stack) -> None:
    token = stack.token("coordinator", tenant=fresh_tenant())
    request = SendMessageRequest(
        message=user_message(data=SLOW_STEPS), configuration=SendMessageConfiguration(return_immediately=True)
    )
    async with client_on(stack, "JSONRPC", streaming=False) as rpc:
        accepted = [r async for r in rpc.send_message(request, context=as_tenant(token))][-1].task
    assert accepted.id
    async with client_on(stack, "HTTP+JSON") as rest:
        read = await rest.get_task(GetTaskRequest(id=accepted.id), context=as_tenant(token))
        assert read.id == accepted.id and read.context_id == accepted.context_id
        following = rest.subscribe(SubscribeToTaskRequest(id=accepted.id), context=as_tenant(token))
        first = await anext(following)
        assert first.task.id == accepted.id  # a subscription opens with the task as it stands
        canceled = await rest.cancel_task(CancelTaskRequest(id=accepted.id), context=as_tenant(token))
        assert canceled.status.state == TaskState.TASK_STATE_CANCELED
        async with asyncio.timeout(60):
            rest_of_it = [state_of(r) async for r in following]
        assert rest_of_it and rest_of_it[-1] == TaskState.TASK_STATE_CANCELED
    async with client_on(stack, "JSONRPC") as rpc:
        again = await rpc.get_task(GetTaskRequest(id=accepted.id), context=as_tenant(token))
        assert again.status.state == TaskState.TASK_STATE_CANCELED


async def test_rest_takes_the_same_tokens_and_keeps_tenants_apart(stack: Stack) -> None:
    owner = stack.token("coordinator", tenant=fresh_tenant())
    request = SendMessageRequest(
        message=user_message(data=SLOW_STEPS), configuration=SendMessageConfiguration(return_immediately=True)
    )
    async with client_on(stack, "HTTP+JSON", streaming=False) as rest:
        task = [r async for r in rest.send_message(request, context=as_tenant(owner))][-1].task
        assert task.id
        other = stack.token("coordinator", tenant=fresh_tenant())
        with pytest.raises(TaskNotFoundError):
            await rest.get_task(GetTaskRequest(id=task.id), context=as_tenant(other))
        await rest.cancel_task(CancelTaskRequest(id=task.id), context=as_tenant(owner))
    async with httpx.AsyncClient(timeout=30) as http:
        base = stack.endpoints["coordinator"] + REST_PATH
        bare = await http.get(f"{base}/tasks/{task.id}", headers={"A2A-Version": "1.0"})
        assert bare.status_code == 401 and bare.headers["WWW-Authenticate"].startswith("Bearer ")
        forged = await http.get(
            f"{base}/tasks/{task.id}",
            headers={"A2A-Version": "1.0", "Authorization": f"Bearer {stack.forge(aud='x')}"},
        )
        assert forged.status_code == 401
        # and a token for another agent is refused here as on JSON-RPC
        elsewhere = stack.token("stats")
        assert (
            await http.get(
                f"{base}/tasks/{task.id}",
                headers={"A2A-Version": "1.0", "Authorization": f"Bearer {elsewhere}"},
            )
        ).status_code == 401
