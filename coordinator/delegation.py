"""Delegating a step to a specialist: discovery by skill in the registry, a token minted for that
specialist and the run's tenant, and one A2A streaming call."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from a2a.client import (
    A2AClientError,
    A2AClientTimeoutError,
    ClientCallContext,
    ClientConfig,
    ClientFactory,
)
from a2a.helpers import get_data_parts, get_text_parts, new_data_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest, TaskState
from a2a.utils.errors import A2AError
from google.protobuf.json_format import ParseDict, ParseError

from fleet.errors import ErrorCode, FleetError
from fleet.operation_ext import MAX_WAIT_S, OPERATION_METADATA_KEY, cancel_url, status_url
from registry import AgentRecord, RegistryClient

INVOKE_SCOPE = "agent:invoke"
FAILED_STATES = {
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_REJECTED,
    TaskState.TASK_STATE_CANCELED,
}

Progress = Callable[[str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Assignment:
    agent_id: str
    url: str


class Delegator:
    """Finds specialists and calls them."""

    def __init__(self, registry: RegistryClient, http: httpx.AsyncClient) -> None:
        self._registry = registry
        self._http = http
        self._factory = ClientFactory(ClientConfig(streaming=True, httpx_client=http))
        self._known: dict[str, AgentRecord] = {}

    async def discover(self, skill: str) -> list[AgentRecord]:
        found = [a for a in await self._registry.agents_with_skill(skill) if a.kind == "specialist"]
        self._known.update((a.id, a) for a in found)
        return found

    async def agent(self, agent_id: str) -> AgentRecord:
        """The record of an agent chosen earlier (checkpoints keep only its id)."""
        known = self._known.get(agent_id)
        if known is None:
            known = await self._registry.agent(agent_id)
            self._known[agent_id] = known
        return known

    async def assign(self, skill: str) -> AgentRecord:
        candidates = await self.discover(skill)
        if not candidates:
            raise FleetError(ErrorCode.NO_SPECIALIST, f"no specialist offers skill {skill!r}")
        return candidates[0]

    async def call(
        self,
        agent: AgentRecord,
        skill: str,
        payload: dict[str, Any],
        *,
        tenant: str,
        progress: Progress,
        operation_id: str | None = None,
    ) -> dict[str, Any]:
        """Run ``skill`` on ``agent``; return its result data or raise a step failure.

        With an ``operation_id`` the agent runs the step at most once under that id. A call that
        never reached the agent raises ``specialist_unavailable``; one that was cut off after it
        was sent raises :class:`CallInterrupted` (the agent may still be running it)."""
        card = _card(agent)
        message = Message(
            role=Role.ROLE_USER,
            message_id=uuid.uuid4().hex,
            parts=[new_data_part({"skill": skill, "input": payload})],
        )
        if operation_id is not None:
            message.metadata.update({OPERATION_METADATA_KEY: operation_id})
        client = self._factory.create(card)
        try:
            context = await self._context(agent, tenant)
            stream = client.send_message(SendMessageRequest(message=message), context=context)
            return await _collect(stream, agent.id, progress)
        except A2AClientError as exc:
            if isinstance(exc.__cause__, httpx.ConnectError):
                raise FleetError(
                    ErrorCode.SPECIALIST_UNAVAILABLE,
                    f"cannot reach {agent.id} at {agent.url}",
                    retryable=True,
                ) from exc
            if isinstance(exc.__cause__, httpx.TransportError) or isinstance(exc, A2AClientTimeoutError):
                raise CallInterrupted(agent.id) from exc
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} refused the step: {exc}") from exc
        except A2AError as exc:
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} refused the step: {exc}") from exc
        finally:
            await client.close()

    async def _context(self, agent: AgentRecord, tenant: str) -> ClientCallContext:
        token = await self._registry.tokens.token(agent.id, tenant, [INVOKE_SCOPE])
        return ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})

    async def operation_status(
        self, agent: AgentRecord, operation_id: str, *, tenant: str, wait_s: float
    ) -> dict[str, Any] | None:
        """What ``agent`` knows of an operation (see :mod:`fleet.operation_ext`), or None if the
        agent does not declare the operations extension and so cannot say."""
        template = status_url(_card(agent))
        if template is None:
            return None
        url = template.replace("{operation_id}", quote(operation_id, safe=""))
        if _origin(url) != _origin(agent.url):
            raise FleetError(ErrorCode.CARD_INVALID, f"{agent.id} names a status URL outside its own origin")
        token = await self._registry.tokens.token(agent.id, tenant, [INVOKE_SCOPE])
        try:
            response = await self._http.get(
                url,
                params={"wait": f"{wait_s:g}"},
                headers={"Authorization": f"Bearer {token}"},
                timeout=httpx.Timeout(10.0, read=wait_s + 10.0),
            )
        except httpx.TransportError as exc:
            raise FleetError(
                ErrorCode.SPECIALIST_UNAVAILABLE,
                f"cannot reach {agent.id} to ask about an operation",
                retryable=True,
            ) from exc
        if response.status_code != 200:
            raise FleetError(
                ErrorCode.SPECIALIST_FAILED,
                f"{agent.id} answered the operation query with HTTP {response.status_code}",
            )
        body = response.json()
        if not isinstance(body, dict) or not isinstance(body.get("status"), str):
            raise FleetError(
                ErrorCode.SPECIALIST_FAILED, f"{agent.id} answered the operation query without a status"
            )
        return body

    async def cancel_operation(
        self, agent: AgentRecord, operation_id: str, *, tenant: str
    ) -> dict[str, Any] | None:
        """Cancel an operation at ``agent`` (see :mod:`fleet.operation_ext`) and return what the agent
        then says of it, as :meth:`operation_status` does; None if the agent cannot cancel operations
        (it does not declare the extension, or an earlier version of it without ``cancel_url``)."""
        template = cancel_url(_card(agent))
        if template is None:
            return None
        url = template.replace("{operation_id}", quote(operation_id, safe=""))
        if _origin(url) != _origin(agent.url):
            raise FleetError(ErrorCode.CARD_INVALID, f"{agent.id} names a cancel URL outside its own origin")
        token = await self._registry.tokens.token(agent.id, tenant, [INVOKE_SCOPE])
        try:
            response = await self._http.post(
                url,
                headers={"Authorization": f"Bearer {token}"},
                timeout=httpx.Timeout(10.0, read=MAX_WAIT_S + 10.0),
            )
        except httpx.TransportError as exc:
            raise FleetError(
                ErrorCode.SPECIALIST_UNAVAILABLE,
                f"cannot reach {agent.id} to cancel an operation",
                retryable=True,
            ) from exc
        return _operation_answer(agent, response, "cancel")


def _operation_answer(agent: AgentRecord, response: httpx.Response, what: str) -> dict[str, Any]:
    """The body of an answer of the operations extension, checked."""
    if response.status_code != 200:
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED,
            f"{agent.id} answered the operation {what} with HTTP {response.status_code}",
        )
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("status"), str):
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED, f"{agent.id} answered the operation {what} without a status"
        )
    return body


class CallInterrupted(FleetError):
    """The call reached the agent but its answer was lost: only the agent knows what happened."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(
            ErrorCode.SPECIALIST_UNAVAILABLE,
            f"the call to {agent_id} was cut off before it answered",
            retryable=True,
        )


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _card(agent: AgentRecord) -> AgentCard:
    try:
        return ParseDict(agent.card, AgentCard(), ignore_unknown_fields=True)
    except ParseError as exc:
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} has an unreadable card") from exc


async def _collect(stream: Any, agent_id: str, progress: Progress) -> dict[str, Any]:
    result: dict[str, Any] = {}
    state = TaskState.TASK_STATE_UNSPECIFIED
    last_text = ""
    error: dict[str, Any] = {}
    async for event in stream:
        kind = event.WhichOneof("payload")
        if kind == "task":
            state = event.task.status.state
        elif kind == "status_update":
            state = event.status_update.status.state
            parts = event.status_update.status.message.parts
            text = " ".join(get_text_parts(parts))
            for data in get_data_parts(parts):
                if isinstance(data, dict) and isinstance(data.get("error"), dict):
                    error = data["error"]
            if text:
                last_text = text
                if state == TaskState.TASK_STATE_WORKING:
                    await progress(f"{agent_id}: {text}")
        elif kind == "artifact_update":
            for data in get_data_parts(event.artifact_update.artifact.parts):
                if isinstance(data, dict):
                    result.update(data)
    if state in FAILED_STATES:
        if error.get("code") == ErrorCode.OUTCOME_UNKNOWN:
            raise FleetError(ErrorCode.OUTCOME_UNKNOWN, f"{agent_id}: {error.get('message', last_text)}")
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent_id}: {last_text or 'failed'}")
    if state != TaskState.TASK_STATE_COMPLETED:
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED, f"{agent_id} ended the step in state {TaskState.Name(state)}"
        )
    return result
