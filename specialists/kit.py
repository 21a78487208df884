"""The specialist kit: what it takes to turn a few skill functions into a deployable A2A agent.

A specialist is a module that declares its skills and calls :func:`serve_specialist`. The kit gives it
an identity (its own key, enrolled with the registry), a signed card, bearer-JWT auth on every call,
registration, an MCP client that mints a token per server and tenant, and progress events.

    SKILLS = [Skill("echo", "Echo", "Returns its input", echo)]

    async def main(settings: ServiceSettings) -> None:
        await serve_specialist(settings, name="Echo", description="...", skills=SKILLS)
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
from a2a.helpers import get_data_parts, new_data_part, new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentSkill, InvalidParamsError, TaskState
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from starlette.applications import Starlette

from fleet.a2a_support import (
    a2a_app,
    build_card,
    claims_of,
    sign_card,
)
from fleet.errors import ErrorCode, FleetError
from fleet.service import Readiness, configure_logging, serve_app, start_in_background
from fleet.settings import ServiceSettings
from fleet.tokens import Claims
from registry import RegistryClient

log = logging.getLogger(__name__)

INVOKE_SCOPE = "agent:invoke"


class SkillError(FleetError):
    """A skill could not do its work; the task fails with this code and message."""


@dataclass(frozen=True, slots=True)
class SkillContext:
    """What a skill function gets besides its input."""

    claims: Claims
    tools: Toolbox
    progress: Callable[[str], Awaitable[None]]

    @property
    def tenant(self) -> str:
        return self.claims.tenant


SkillFunction = Callable[[SkillContext, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Skill:
    id: str
    name: str
    description: str
    run: SkillFunction
    tags: tuple[str, ...] = ()

    def card_skill(self) -> AgentSkill:
        return AgentSkill(id=self.id, name=self.name, description=self.description, tags=list(self.tags))


_current_token: contextvars.ContextVar[str] = contextvars.ContextVar("mcp_bearer")


class _ContextBearer(httpx2.Auth):
    """Sends the token of the current tool call; one HTTP client serves every tenant and server."""

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        request.headers["Authorization"] = f"Bearer {_current_token.get()}"
        yield request


class Toolbox:
    """Calls MCP tools with a token minted for that server, the caller's tenant and the tool's scope."""

    def __init__(self, registry: RegistryClient, http: httpx2.AsyncClient) -> None:
        self._registry = registry
        self._http = http

    async def call(
        self, server_id: str, tool: str, arguments: dict[str, Any], *, tenant: str, scopes: Sequence[str]
    ) -> dict[str, Any]:
        server = await self._registry.mcp_server(server_id)
        token = await self._registry.tokens.token(server.audience, tenant, scopes)
        reset = _current_token.set(token)
        try:
            async with Client(streamable_http_client(server.url, http_client=self._http)) as client:
                result = await client.call_tool(tool, arguments)
        except* (MCPError, httpx2.HTTPError) as group:
            raise SkillError(
                ErrorCode.TOOL_FAILED, f"MCP server {server_id} refused or failed: {group.exceptions[0]}"
            ) from group
        finally:
            _current_token.reset(reset)
        if result.is_error:
            text = " ".join(getattr(c, "text", "") for c in result.content)
            raise SkillError(ErrorCode.TOOL_FAILED, f"{server_id}/{tool}: {text}")
        return dict(result.structured_content or {})


class SkillExecutor(AgentExecutor):
    """Runs one skill per task. The request is a data part ``{"skill": ID, "input": {...}}``."""

    def __init__(self, skills: Sequence[Skill], tools: Toolbox) -> None:
        self._skills = {skill.id: skill for skill in skills}
        self._tools = tools

    def _parse(self, context: RequestContext) -> tuple[Skill, dict[str, Any]]:
        message = context.message
        data = [d for d in get_data_parts(message.parts) if isinstance(d, dict)] if message else []
        if not data or not isinstance(data[0].get("skill"), str):
            raise InvalidParamsError(message='send a data part {"skill": ID, "input": {...}}')
        skill = self._skills.get(data[0]["skill"])
        if skill is None:
            raise InvalidParamsError(message=f"this agent has no skill {data[0]['skill']!r}")
        payload = data[0].get("input", {})
        if not isinstance(payload, dict):
            raise InvalidParamsError(message="input must be an object")
        return skill, payload

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        skill, payload = self._parse(context)
        claims = claims_of(context.call_context)
        assert context.message is not None
        task = context.current_task or new_task_from_user_message(context.message)
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()

        async def progress(text: str) -> None:
            await updater.update_status(
                TaskState.TASK_STATE_WORKING, message=updater.new_agent_message([new_text_part(text)])
            )

        try:
            result = await skill.run(SkillContext(claims, self._tools, progress), payload)
        except FleetError as exc:
            log.info("skill %s failed: %s", skill.id, exc)
            await updater.failed(updater.new_agent_message([new_text_part(f"[{exc.code}] {exc.message}")]))
            return
        except Exception:
            log.exception("skill %s crashed", skill.id)
            await updater.failed(
                updater.new_agent_message([new_text_part(f"[{ErrorCode.INTERNAL}] {skill.id} crashed")])
            )
            return
        await updater.add_artifact([new_data_part(result)], name=skill.id, last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        if context.current_task is not None:
            updater = TaskUpdater(event_queue, context.current_task.id, context.current_task.context_id)
            await updater.cancel()


def build_specialist_app(
    settings: ServiceSettings,
    *,
    name: str,
    description: str,
    version: str,
    skills: Sequence[Skill],
) -> Starlette:
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
    mcp_http = httpx2.AsyncClient(auth=_ContextBearer(), timeout=httpx2.Timeout(30.0, read=120.0))
    registry = RegistryClient(settings, http)
    card = build_card(
        name=name,
        description=description,
        version=version,
        base_url=settings.public_url,
        skills=[s.card_skill() for s in skills],
        token_url=registry.token_url,
        required_scope=INVOKE_SCOPE,
    )
    card = sign_card(card, registry.key, jku=registry.own_keys_url)
    handler = DefaultRequestHandler(
        agent_executor=SkillExecutor(skills, Toolbox(registry, mcp_http)),
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )
    readiness = Readiness(settings.service_id, "specialist")

    async def start() -> None:
        await registry.join_as_agent(settings.public_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            await stack.enter_async_context(mcp_http)
            stack.push_async_callback(handler.aclose)  # runs before the clients close
            await stack.enter_async_context(start_in_background(readiness, start))
            yield

    return a2a_app(
        card=card,
        handler=handler,
        readiness=readiness,
        verifier=registry.verifier(),
        required_scope=INVOKE_SCOPE,
        lifespan=lifespan,
    )


async def serve_specialist(
    settings: ServiceSettings, *, name: str, description: str, version: str, skills: Sequence[Skill]
) -> None:
    configure_logging(settings.service_id, settings.log_level)
    app = build_specialist_app(settings, name=name, description=description, version=version, skills=skills)
    await serve_app(app, settings)
