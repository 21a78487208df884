"""Driving a running stack from outside, as its users do: the ``fleet`` CLI in a new process, a stack
started and stopped with it, tokens, the A2A client and the run API's event log. Used by the
project's end-to-end tests and benchmarks alike (and by anyone testing their own agents against a
local stack)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.helpers import get_data_parts, get_text_parts, new_data_part, new_text_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest, TaskState
from google.protobuf.json_format import ParseDict

from fleet.errors import FleetError
from fleet.keys import SigningKey
from fleet.vocabulary import payload_problems
from fleetctl.layout import StackLayout
from policy import DEFAULT_BUNDLE_DIR

STACK_START_TIMEOUT_S = 180

# Short clocks so that failover happens in seconds: the lease expires 3 s after the last heartbeat,
# and JetStream redelivers the work 6 s after the last sign of progress.
FAST_FAILOVER = {"FLEET_LEASE_TTL_S": "3", "FLEET_ACK_WAIT_S": "6"}

# The demo's plan: invoice totals through SQL, then outliers over the totals.
TWO_STEPS: dict[str, Any] = {
    "steps": [
        {"id": "totals", "skill": "invoice-totals"},
        {
            "id": "outliers",
            "skill": "outliers",
            "input": {"records": {"$from": "totals.records"}, "field": "largest", "label": "customer"},
        },
    ]
}


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any ``FLEET_*`` setting of the developer's shell, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(extra)
    return env


def fleet(
    *args: str,
    timeout: float = STACK_START_TIMEOUT_S,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the ``fleet`` CLI as a user would (a new process; in ``cwd``, with ``stdin`` its input)."""
    return subprocess.run(
        [sys.executable, "-m", "fleetctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        cwd=cwd,
        env=env if env is not None else clean_env(),
    )


@dataclass
class Stack:
    """A running stack and what a test may use: its endpoints and the keys in its data dir."""

    layout: StackLayout
    endpoints: dict[str, Any] = field(default_factory=dict)

    @property
    def data_dir(self) -> str:
        return str(self.layout.home)

    def reload(self) -> None:
        self.endpoints = json.loads(self.layout.endpoints_file.read_text())

    def pg_dsn(self, database: str) -> str:
        """A superuser DSN to one of the stack's databases (tests look at what the tools did)."""
        password = (self.layout.keys_dir / "postgres-password.secret").read_text().strip()
        return f"postgresql://postgres:{password}@127.0.0.1:{self.endpoints['postgres_port']}/{database}"

    def token(self, audience: str, tenant: str = "acme", scopes: tuple[str, ...] = ("agent:invoke",)) -> str:
        args = ["token", "--data-dir", self.data_dir, "--audience", audience, "--tenant", tenant]
        for scope in scopes:
            args += ["--scope", scope]
        result = fleet(*args, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    def forge(self, **overrides: Any) -> str:
        """A token signed with the registry's real key but with claims the test chooses."""
        key = SigningKey.load_or_create(self.layout.key_file("registry"))
        return key.sign({**token_claims(), **overrides})


def token_claims(**overrides: Any) -> dict[str, Any]:
    """The claims of a good access token for the coordinator (as the operator, tenant ``acme``),
    with ``overrides``; an override of None leaves the claim out."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": "fleet-registry",
        "sub": "operator",
        "aud": "coordinator",
        "tenant": "acme",
        "scope": "agent:invoke",
        "iat": now,
        "exp": now + 300,
        "jti": uuid.uuid4().hex,
        **overrides,
    }
    return {k: v for k, v in claims.items() if v is not None}


def bundle_with(root: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the shipped policy bundle in ``root/bundle`` with ``edit`` applied to its data (for
    ``FLEET_POLICY_DIR``): what an operator changes for a fleet of another size or a given tenant."""
    bundle = root / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    edit(data)
    (bundle / "data.json").write_text(json.dumps(data, indent=2))
    return bundle


def start_stack(data_dir: Path, env: dict[str, str] | None = None) -> Stack:
    stack = Stack(StackLayout.at(data_dir))
    result = fleet("up", "--data-dir", str(data_dir), "--detach", env=env)
    assert result.returncode == 0, f"fleet up failed:\n{result.stdout}\n{result.stderr}"
    stack.reload()
    return stack


def stop_stack(stack: Stack) -> None:
    result = fleet("down", "--data-dir", stack.data_dir, timeout=90)
    assert result.returncode == 0, result.stderr


# Every process publishes its metrics each second (not 15): the console's charts move within a test.
FAST_METRICS = {"FLEET_METRICS_EVERY_S": "1"}

# Webhook receivers of the tests listen on loopback, which the coordinator refuses unless allowed.
TEST_PUSH_HOSTS = {"FLEET_PUSH_ALLOWED_HOSTS": "127.0.0.1"}


@dataclass
class RunOutcome:
    state: int
    task_id: str
    progress: list[str]
    final_text: str
    result: dict[str, Any]
    error: FleetError | None = None  # the error the task ended with, read from its status (data)

    @property
    def state_name(self) -> str:
        return TaskState.Name(self.state)

    @property
    def codes(self) -> list[str]:
        """The codes of the error the task ended with and of what it wraps, outermost first."""
        return [str(e.code) for e in self.error.chain()] if self.error is not None else []


def user_message(text: str = "", data: dict[str, Any] | None = None) -> Message:
    parts = []
    if text:
        parts.append(new_text_part(text))
    if data is not None:
        parts.append(new_data_part(data))
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=parts)


async def fetch_card(http: httpx.AsyncClient, base_url: str) -> AgentCard:
    response = await http.get(base_url + "/.well-known/agent-card.json")
    response.raise_for_status()
    return ParseDict(response.json(), AgentCard(), ignore_unknown_fields=True)


async def send(
    stack: Stack,
    message: Message,
    *,
    token: str | None,
    agent: str = "coordinator",
    headers: Mapping[str, str] | None = None,
) -> RunOutcome:
    """Send ``message`` with the a2a-sdk streaming client and collect what comes back (``headers``:
    more HTTP headers of the call, e.g. a caller's ``traceparent``)."""
    base = stack.endpoints["coordinator"] if agent == "coordinator" else stack.endpoints["specialists"][agent]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
        card = await fetch_card(http, base)
        client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        sent = {"Authorization": f"Bearer {token}"} if token is not None else {}
        context = ClientCallContext(service_parameters={**sent, **(headers or {})})
        outcome = RunOutcome(TaskState.TASK_STATE_UNSPECIFIED, "", [], "", {})
        try:
            async for event in client.send_message(SendMessageRequest(message=message), context=context):
                _record(outcome, event)
        finally:
            await client.close()
    return outcome


def _record(outcome: RunOutcome, event: Any) -> None:
    kind = event.WhichOneof("payload")
    if kind == "task":
        outcome.task_id = event.task.id
        outcome.state = event.task.status.state
    elif kind == "status_update":
        outcome.state = event.status_update.status.state
        parts = event.status_update.status.message.parts
        text = " ".join(get_text_parts(parts))
        if text:
            outcome.final_text = text
            outcome.progress.append(text)
        for data in get_data_parts(parts):
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                outcome.error = FleetError.from_dict(data["error"])
    elif kind == "artifact_update":
        for data in get_data_parts(event.artifact_update.artifact.parts):
            if isinstance(data, dict):
                outcome.result.update(data)


def event_of(line: str) -> dict[str, Any]:
    """A run event from a ``data:`` line of the run API's stream, its payload checked against the
    type the vocabulary declares for it (:func:`fleet.vocabulary.payload_problems`): every test that
    reads events this way checks the payloads the fleet really writes."""
    event: dict[str, Any] = json.loads(line.removeprefix("data: "))
    problems = payload_problems(event["type"], event["payload"])
    assert not problems, (
        f"a {event['type']} event's payload is not what the vocabulary says: {problems}: {event}"
    )
    return event


async def first_event(
    stack: Stack, run_id: str, token: str, type_: str, step: str | None = None
) -> dict[str, Any]:
    """The run's first event of ``type_`` (of ``step``, if given), as soon as it is in the log."""
    return await first_event_where(
        stack, run_id, token, lambda e: e["type"] == type_ and step in (None, e["payload"].get("step")), type_
    )


async def first_event_where(
    stack: Stack, run_id: str, token: str, wanted: Callable[[dict[str, Any]], bool], what: str = "such"
) -> dict[str, Any]:
    """The run's first event that is ``wanted``, as soon as it is in the log (its stream, followed)."""
    url = f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/events"
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http,
        http.stream("GET", url, headers={"Authorization": f"Bearer {token}"}) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                event = event_of(line)
                if wanted(event):
                    return event
    raise AssertionError(f"the run ended without a {what} event")


async def all_events(stack: Stack, run_id: str, token: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/events",
            headers={"Authorization": f"Bearer {token}"},
        )
    return [event_of(line) for line in response.text.splitlines() if line.startswith("data: ")]


async def run_id_of_first_run(stack: Stack, token: str) -> str:
    async with asyncio.timeout(30), httpx.AsyncClient() as http:
        while True:
            runs = (
                await http.get(
                    f"{stack.endpoints['coordinator']}/v1/runs", headers={"Authorization": f"Bearer {token}"}
                )
            ).json()["runs"]
            if runs:
                return str(runs[0]["run_id"])
            await asyncio.sleep(0.05)
