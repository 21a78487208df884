"""Helpers for tests that drive the coordinator's A2A surface: clients with a tenant's token, streams
collected with their event ids, and a real webhook receiver that verifies signed pushes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
import uvicorn
from a2a.client import Client, ClientCallContext, ClientConfig, ClientFactory
from a2a.types import (
    Message,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from google.protobuf.json_format import ParseDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from coordinator.a2a_surface.task_events import RESUME_EXTENSION, event_id_of
from fleetctl.testing.e2e import Stack, event_of, fetch_card

TIMEOUT = httpx.Timeout(10.0, read=120.0)
TERMINAL = {
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_REJECTED,
}

# A run that takes a few seconds: each step holds a database statement for a second.
SLOW_STEPS: dict[str, Any] = {
    "steps": [
        {
            "id": f"slow{n}",
            "skill": "sql-query",
            "input": {"sql": f"SELECT pg_sleep(1) IS NULL AS slept{n}"},
            "after": [f"slow{n - 1}"] if n > 1 else [],  # one after another: about 3 s in all
        }
        for n in range(1, 4)
    ]
}
# A run that needs no tenant data: outliers over records given inline.
INLINE_OUTLIERS: dict[str, Any] = {
    "steps": [
        {
            "id": "outliers",
            "skill": "outliers",
            "input": {
                "records": [{"name": n, "x": v} for n, v in (("a", 1), ("b", 2), ("c", 1), ("d", 40))],
                "field": "x",
                "label": "name",
            },
        }
    ]
}


def as_tenant(token: str, **headers: str) -> ClientCallContext:
    return ClientCallContext(service_parameters={"Authorization": f"Bearer {token}", **headers})


@contextlib.asynccontextmanager
async def a2a_client(stack: Stack, *, streaming: bool = True) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
        client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
        try:
            yield client
        finally:
            await client.close()


def state_of(response: StreamResponse) -> TaskState | None:
    kind = response.WhichOneof("payload")
    if kind == "task":
        return response.task.status.state
    if kind == "status_update":
        return response.status_update.status.state
    return None


def event_id(response: StreamResponse) -> int | None:
    kind = response.WhichOneof("payload")
    if kind == "task":
        return event_id_of(response.task.metadata)
    if kind == "status_update":
        return event_id_of(response.status_update.metadata)
    if kind == "artifact_update":
        return event_id_of(response.artifact_update.metadata)
    return None


def resumed_as(task: Task) -> str | None:
    value = task.metadata.fields[RESUME_EXTENSION].struct_value.fields.get("resumed")
    return value.string_value if value is not None else None


async def start(
    stack: Stack, token: str, message: Message, push: TaskPushNotificationConfig | None = None
) -> Task:
    """Send without waiting for the run (``return_immediately``); return the task as accepted."""
    configuration = SendMessageConfiguration(return_immediately=True)
    if push is not None:
        configuration.task_push_notification_config.CopyFrom(push)
    request = SendMessageRequest(message=message, configuration=configuration)
    async with a2a_client(stack, streaming=False) as client:
        responses = [r async for r in client.send_message(request, context=as_tenant(token))]
    assert responses[-1].WhichOneof("payload") == "task", responses
    return responses[-1].task


async def subscribe(
    stack: Stack, task_id: str, token: str, last_event_id: int | None = None
) -> list[StreamResponse]:
    """Everything ``SubscribeToTask`` streams until the server ends the stream."""
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    async with a2a_client(stack) as client:
        request = SubscribeToTaskRequest(id=task_id)
        return [r async for r in client.subscribe(request, context=as_tenant(token, **headers))]


async def only_run(stack: Stack, token: str) -> str:
    """The id of the first run of the token's tenant (tests give each such run a fresh tenant)."""
    async with asyncio.timeout(30), httpx.AsyncClient() as http:
        while True:
            response = await http.get(
                f"{stack.endpoints['coordinator']}/v1/runs", headers={"Authorization": f"Bearer {token}"}
            )
            runs = response.json()["runs"]
            if runs:
                return str(runs[-1]["run_id"])
            await asyncio.sleep(0.05)


async def run_events(stack: Stack, run_id: str, token: str, until: str | None = None) -> list[dict[str, Any]]:
    """The run's event log from the run API (SSE), up to the first event of type ``until`` if given,
    else to the run's end."""
    url = f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/events"
    events: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(timeout=TIMEOUT) as http,
        http.stream("GET", url, headers={"Authorization": f"Bearer {token}"}) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(event_of(line))
                if events[-1]["type"] == until:
                    break
    return events


def fresh_tenant() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Push:
    """One push as the receiver verified it."""

    response: StreamResponse
    claims: dict[str, Any]
    signature: str
    authorization: str
    token: str


@dataclass(kw_only=True)
class Receiver:
    """A real webhook on loopback that verifies every push's JWT against the coordinator's JWKS.

    ``fail_first`` requests are answered 503, to exercise retries."""

    coordinator: str
    fail_first: int = 0
    pushes: list[Push] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    failed: int = 0
    port: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/hook/{name or uuid.uuid4().hex}"

    async def _verify(self, request: Request, body: bytes) -> dict[str, Any]:
        token = request.headers["fleet-push-signature"]
        header = jwt.get_unverified_header(token)
        assert header["alg"] == "ES256"
        assert header["jku"] == self.coordinator + "/.well-known/jwks.json"
        async with httpx.AsyncClient() as http:
            keys = (await http.get(header["jku"])).json()["keys"]
        key = jwt.PyJWK(next(k for k in keys if k["kid"] == header["kid"]))
        claims: dict[str, Any] = jwt.decode(
            token, key, algorithms=["ES256"], audience=str(request.url), issuer="coordinator"
        )
        assert claims["request_body_sha256"] == hashlib.sha256(body).hexdigest()
        return claims

    async def endpoint(self, request: Request) -> Response:
        body = await request.body()
        if self.failed < self.fail_first:
            self.failed += 1
            return Response(status_code=503)
        try:
            claims = await self._verify(request, body)
        except httpx.HTTPError:  # the coordinator's JWKS is out of reach (it is restarting): retry later
            return Response(status_code=503)
        except (AssertionError, KeyError, StopIteration, jwt.PyJWTError) as exc:
            self.refused.append(repr(exc))
            return Response(status_code=401)
        response = ParseDict(json.loads(body), StreamResponse())
        authorization = request.headers.get("authorization", "")
        token = request.headers.get("x-a2a-notification-token", "")
        signature = request.headers["fleet-push-signature"]
        self.pushes.append(Push(response, claims, signature, authorization, token))
        self.arrived.set()
        return Response(status_code=204)

    async def until_final(self, task_id: str, timeout_s: float = 60.0) -> list[Push]:
        """The pushes of ``task_id`` once one of them shows a terminal state."""
        async with asyncio.timeout(timeout_s):
            while True:
                self.arrived.clear()
                mine = [p for p in self.pushes if p.claims["taskId"] == task_id]
                if any(state_of(p.response) in TERMINAL for p in mine):
                    return mine
                await self.arrived.wait()


@contextlib.asynccontextmanager
async def receiver(stack: Stack, fail_first: int = 0) -> AsyncIterator[Receiver]:
    """A ``Receiver`` served by uvicorn on a loopback socket bound (and listening) before it starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    hook = Receiver(
        coordinator=stack.endpoints["coordinator"], fail_first=fail_first, port=int(sock.getsockname()[1])
    )
    app = Starlette(routes=[Route("/hook/{name}", hook.endpoint, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield hook
    finally:
        server.should_exit = True
        await serving
        sock.close()
