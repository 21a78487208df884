"""Delegating a step to a specialist: discovery by skill in the registry, a token minted for that
specialist and the run's tenant, and one A2A streaming call."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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
    ) -> dict[str, Any]:
        """Run ``skill`` on ``agent``; return its result data or raise a step failure."""
        try:
            card = ParseDict(agent.card, AgentCard())
        except ParseError as exc:
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} has an unreadable card") from exc
        token = await self._registry.tokens.token(agent.id, tenant, [INVOKE_SCOPE])
        request = SendMessageRequest(
            message=Message(
                role=Role.ROLE_USER,
                message_id=uuid.uuid4().hex,
                parts=[new_data_part({"skill": skill, "input": payload})],
            )
        )
        context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
        client = self._factory.create(card)
        try:
            return await _collect(client.send_message(request, context=context), agent.id, progress)
        except A2AClientError as exc:
            if isinstance(exc.__cause__, httpx.TransportError) or isinstance(exc, A2AClientTimeoutError):
                raise FleetError(
                    ErrorCode.SPECIALIST_UNAVAILABLE,
                    f"cannot reach {agent.id} at {agent.url}",
                    retryable=True,
                ) from exc
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} refused the step: {exc}") from exc
        except A2AError as exc:
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} refused the step: {exc}") from exc
        finally:
            await client.close()


async def _collect(stream: Any, agent_id: str, progress: Progress) -> dict[str, Any]:
    result: dict[str, Any] = {}
    state = TaskState.TASK_STATE_UNSPECIFIED
    last_text = ""
    async for event in stream:
        kind = event.WhichOneof("payload")
        if kind == "task":
            state = event.task.status.state
        elif kind == "status_update":
            state = event.status_update.status.state
            text = " ".join(get_text_parts(event.status_update.status.message.parts))
            if text:
                last_text = text
                if state == TaskState.TASK_STATE_WORKING:
                    await progress(f"{agent_id}: {text}")
        elif kind == "artifact_update":
            for data in get_data_parts(event.artifact_update.artifact.parts):
                if isinstance(data, dict):
                    result.update(data)
    if state in FAILED_STATES:
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent_id}: {last_text or 'failed'}")
    if state != TaskState.TASK_STATE_COMPLETED:
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED, f"{agent_id} ended the step in state {TaskState.Name(state)}"
        )
    return result
