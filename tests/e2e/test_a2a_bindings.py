"""The A2A surface on its three bindings, JSON-RPC, HTTP+JSON (REST) and gRPC, against the real
stack: one handler and one task store behind them, the same bearer check on each, and a task made
over one binding read, followed and canceled over the others."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import grpc
import grpc.aio
import httpx
import pytest
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskState,
    a2a_pb2_grpc,
)
from a2a.utils.errors import TaskNotFoundError

from fleet.a2a_grpc import grpc_target
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
        config = ClientConfig(
            streaming=streaming,
            httpx_client=http,
            grpc_channel_factory=lambda url: grpc.aio.insecure_channel(grpc_target(url)),
            supported_protocol_bindings=[binding],
        )
        client = ClientFactory(config).create(card)
        try:
            yield client
        finally:
            await client.close()


@pytest.mark.parametrize("agent", ["coordinator", "stats"])
async def test_every_card_declares_the_three_bindings_in_the_order_of_preference(
    stack: Stack, agent: str
) -> None:
    base = stack.endpoints["coordinator"] if agent == "coordinator" else stack.endpoints["specialists"][agent]
    async with httpx.AsyncClient(timeout=30) as http:
        card = await fetch_card(http, base)
    declared = [(i.protocol_binding, i.url, i.protocol_version) for i in card.supported_interfaces]
    assert declared[:2] == [(binding, base + path, "1.0") for binding, path in BINDINGS.items()]
    assert len(declared) == 3 and declared[2][0] == "GRPC" and declared[2][2] == "1.0"
    address = urlsplit(declared[2][1])  # an absolute URL, as A2A asks; a channel dials its host:port
    assert (address.scheme, address.hostname) == ("http", "127.0.0.1") and address.port
    assert address.netloc != urlsplit(base).netloc


@pytest.mark.parametrize("other", ["HTTP+JSON", "GRPC"])
async def test_a_task_made_over_json_rpc_is_read_followed_and_canceled_over_another_binding(
    stack: Stack, other: str
) -> None:
    token = stack.token("coordinator", tenant=fresh_tenant())
    request = SendMessageRequest(
        message=user_message(data=SLOW_STEPS), configuration=SendMessageConfiguration(return_immediately=True)
    )
    async with client_on(stack, "JSONRPC", streaming=False) as rpc:
        accepted = [r async for r in rpc.send_message(request, context=as_tenant(token))][-1].task
    assert accepted.id
    async with client_on(stack, other) as rest:
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


async def one_tenants_task(stack: Stack, binding: str) -> tuple[Task, str]:
    """A task started over ``binding``, which another tenant cannot see there, canceled by its
    owner; the task and the owner's token."""
    owner = stack.token("coordinator", tenant=fresh_tenant())
    request = SendMessageRequest(
        message=user_message(data=SLOW_STEPS), configuration=SendMessageConfiguration(return_immediately=True)
    )
    async with client_on(stack, binding, streaming=False) as client:
        task = [r async for r in client.send_message(request, context=as_tenant(owner))][-1].task
        assert task.id
        other = stack.token("coordinator", tenant=fresh_tenant())
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=task.id), context=as_tenant(other))
        await client.cancel_task(CancelTaskRequest(id=task.id), context=as_tenant(owner))
    return task, owner


async def test_rest_takes_the_same_tokens_and_keeps_tenants_apart(stack: Stack) -> None:
    task, _ = await one_tenants_task(stack, "HTTP+JSON")
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


async def test_grpc_takes_the_same_tokens_keeps_tenants_apart_and_checks_the_version(stack: Stack) -> None:
    task, owner = await one_tenants_task(stack, "GRPC")
    async with httpx.AsyncClient(timeout=30) as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
    address = next(i.url for i in card.supported_interfaces if i.protocol_binding == "GRPC")
    async with grpc.aio.insecure_channel(grpc_target(address)) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        for metadata, refused in (
            ((("a2a-version", "1.0"),), grpc.StatusCode.UNAUTHENTICATED),  # no token
            (
                (("a2a-version", "1.0"), ("authorization", f"Bearer {stack.forge(aud='x')}")),
                grpc.StatusCode.UNAUTHENTICATED,
            ),
            (
                (("a2a-version", "1.0"), ("authorization", f"Bearer {stack.token('stats')}")),
                grpc.StatusCode.UNAUTHENTICATED,
            ),
            ((("a2a-version", "99.0"), ("authorization", f"Bearer {owner}")), grpc.StatusCode.UNIMPLEMENTED),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetTask(GetTaskRequest(id=task.id), metadata=metadata)
            assert caught.value.code() == refused, (metadata, caught.value.details())
        answered = await stub.GetTask(
            GetTaskRequest(id=task.id),
            metadata=(("a2a-version", "1.0"), ("authorization", f"Bearer {owner}")),
        )
        assert answered.id == task.id
