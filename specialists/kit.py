"""The specialist kit: what it takes to turn a few skill functions into a deployable A2A agent.

A specialist is a module that declares its skills and calls :func:`serve_specialist`. The kit gives it
an identity (its own key, enrolled with the registry), a signed card, bearer-JWT auth on every call,
registration, an MCP client that mints a token per server and tenant, and progress events.

    SKILLS = [Skill("echo", "Echo", "Returns its input", echo)]

    async def main(settings: ServiceSettings) -> None:
        await serve_specialist(settings, name="Echo", description="...", skills=SKILLS)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
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
from a2a.types import AgentSkill, InvalidParamsError, Message, TaskState
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet.a2a_support import (
    RPC_PATH,
    a2a_app,
    build_card,
    claims_of,
    request_claims,
    sign_card,
)
from fleet.errors import ErrorCode, FleetError
from fleet.operation_ext import (
    MAX_WAIT_S,
    OPERATION_METADATA_KEY,
    OPERATIONS_PATH,
    args_hash,
    operations_extension,
)
from fleet.service import Readiness, configure_logging, serve_app, start_in_background
from fleet.settings import ServiceSettings
from fleet.tokens import Claims
from registry import RegistryClient
from specialists.journal import Journal, JournalStatus

log = logging.getLogger(__name__)

INVOKE_SCOPE = "agent:invoke"


class SkillError(FleetError):
    """A skill could not do its work; the task fails with this code and message."""


class OutcomeUnknown(SkillError):
    """A tool call's outcome cannot be known (it timed out and the tool cannot be asked): the
    operation ends ``uncertain`` and a person has to look."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OUTCOME_UNKNOWN, message)


@dataclass(frozen=True, slots=True)
class SkillContext:
    """What a skill function gets besides its input."""

    claims: Claims
    tools: Toolbox
    progress: Callable[[str], Awaitable[None]]
    operation_id: str | None = None

    @property
    def tenant(self) -> str:
        return self.claims.tenant

    def idempotency_key(self, name: str) -> str:
        """A key for one effect of this operation: the same on every execution of the same
        operation, so the tool can refuse to repeat the effect."""
        return f"{self.operation_id or uuid.uuid4().hex}/{name}"


SkillFunction = Callable[[SkillContext, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Skill:
    id: str
    name: str
    description: str
    run: SkillFunction
    tags: tuple[str, ...] = ()
    # Safe to run again under the same operation id after an interruption: every effect it has is
    # made with an idempotency key (``SkillContext.idempotency_key``) that the tool honours.
    idempotent: bool = False

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
        self,
        server_id: str,
        tool: str,
        arguments: dict[str, Any],
        *,
        tenant: str,
        scopes: Sequence[str],
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Call ``tool``; a call that exceeds ``timeout_s`` raises :class:`TimeoutError` (its outcome
        is then unknown to the caller: the tool may still complete it)."""
        server = await self._registry.mcp_server(server_id)
        token = await self._registry.tokens.token(server.audience, tenant, scopes)
        reset = _current_token.set(token)
        try:
            async with (
                asyncio.timeout(timeout_s),
                Client(streamable_http_client(server.url, http_client=self._http)) as client,
            ):
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
    """Runs one skill per task. The request is a data part ``{"skill": ID, "input": {...}}``; with an
    operation id in the message metadata, the operation runs at most once (see
    :mod:`fleet.operation_ext`) and its outcome is kept in the journal."""

    def __init__(
        self, skills: Sequence[Skill], tools: Toolbox, journal: Journal, heartbeat_s: float = 20.0
    ) -> None:
        self._skills = {skill.id: skill for skill in skills}
        self._tools = tools
        self._journal = journal
        self._heartbeat_s = heartbeat_s

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
        op_id = _operation_of(context.message)
        task = context.current_task or new_task_from_user_message(context.message)
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()

        async def progress(text: str) -> None:
            await updater.update_status(
                TaskState.TASK_STATE_WORKING, message=updater.new_agent_message([new_text_part(text)])
            )

        async def heartbeat() -> None:
            # An empty status update now and then: the caller's activity lease stays alive while
            # the skill works quietly (its absence means this agent is stuck or cut off).
            while True:
                await asyncio.sleep(self._heartbeat_s)
                await updater.update_status(TaskState.TASK_STATE_WORKING)

        beating = (
            asyncio.create_task(heartbeat(), name=f"heartbeat-{task.id}") if self._heartbeat_s > 0 else None
        )
        try:
            if op_id is None:
                outcome = await self._run(skill, SkillContext(claims, self._tools, progress), payload)
            else:
                outcome = await self._run_once(skill, claims, op_id, payload, progress)
        finally:
            if beating is not None:
                await _cancelled(beating)
        status, result, error = outcome
        if status == JournalStatus.SUCCEEDED:
            await updater.add_artifact([new_data_part(result or {})], name=skill.id, last_chunk=True)
            await updater.complete()
        else:
            assert error is not None
            text = f"[{error['code']}] {error['message']}"
            await updater.failed(
                updater.new_agent_message([new_text_part(text), new_data_part({"error": error})])
            )

    async def _run_once(
        self,
        skill: Skill,
        claims: Claims,
        op_id: str,
        payload: dict[str, Any],
        progress: Callable[[str], Awaitable[None]],
    ) -> Outcome:
        """Run the operation unless the journal knows it: then answer with what it recorded."""
        digest = args_hash({"skill": skill.id, "input": payload})
        entry = self._journal.get(claims.tenant, op_id)
        if entry.status == JournalStatus.RUNNING:  # the same operation, sent again: join it
            entry = await self._journal.wait(claims.tenant, op_id, timeout_s=3600)
        if entry.status != JournalStatus.UNKNOWN and entry.args_hash != digest:
            message = f"operation {op_id} was already used with other arguments"
            return JournalStatus.FAILED, None, {"code": str(ErrorCode.CONFLICT), "message": message}
        if entry.status in (JournalStatus.SUCCEEDED, JournalStatus.FAILED, JournalStatus.UNCERTAIN):
            log.info("operation %s answered from the journal (%s)", op_id, entry.status)
            return entry.status, entry.result, entry.error
        if entry.status == JournalStatus.INTERRUPTED and not skill.idempotent:
            message = f"{skill.id} was interrupted mid-way and is not safe to repeat"
            unsafe = {"code": str(ErrorCode.OUTCOME_UNKNOWN), "message": message}
            self._journal.finish(claims.tenant, op_id, JournalStatus.UNCERTAIN, error=unsafe)
            return JournalStatus.UNCERTAIN, None, unsafe
        self._journal.begin(claims.tenant, op_id, skill.id, digest)
        try:
            outcome = await self._run(skill, SkillContext(claims, self._tools, progress, op_id), payload)
        except BaseException:  # stopped mid-way (shutdown, cancel): its effects may be partial
            stopped = {"code": str(ErrorCode.OUTCOME_UNKNOWN), "message": f"{skill.id} was stopped mid-way"}
            # A skill that is safe to repeat is merely interrupted: sent again, it runs again.
            status = JournalStatus.INTERRUPTED if skill.idempotent else JournalStatus.UNCERTAIN
            self._journal.finish(claims.tenant, op_id, status, error=stopped)
            raise
        status, result, error = outcome
        self._journal.finish(claims.tenant, op_id, status, result=result, error=error)
        return outcome

    @staticmethod
    async def _run(skill: Skill, context: SkillContext, payload: dict[str, Any]) -> Outcome:
        try:
            result = await skill.run(context, payload)
        except OutcomeUnknown as exc:
            log.warning("skill %s could not confirm an effect: %s", skill.id, exc)
            return JournalStatus.UNCERTAIN, None, {"code": str(exc.code), "message": exc.message}
        except FleetError as exc:
            log.info("skill %s failed: %s", skill.id, exc)
            return JournalStatus.FAILED, None, {"code": str(exc.code), "message": exc.message}
        except Exception:
            log.exception("skill %s crashed", skill.id)
            return (
                JournalStatus.FAILED,
                None,
                {"code": str(ErrorCode.INTERNAL), "message": f"{skill.id} crashed"},
            )
        return JournalStatus.SUCCEEDED, result, None

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        if context.current_task is not None:
            updater = TaskUpdater(event_queue, context.current_task.id, context.current_task.context_id)
            await updater.cancel()


Outcome = tuple[JournalStatus, dict[str, Any] | None, dict[str, Any] | None]


def _operation_of(message: Message) -> str | None:
    value = message.metadata.fields.get(OPERATION_METADATA_KEY) if message.HasField("metadata") else None
    if value is None or not value.string_value:
        return None
    op_id = value.string_value
    if len(op_id) > 200 or not op_id.isprintable():
        raise InvalidParamsError(message=f"{OPERATION_METADATA_KEY} must be a short printable string")
    return op_id


JOURNAL_RETENTION_S = 7 * 24 * 3600  # a caller reconciles within minutes; a week is ample
PRUNE_EVERY_S = 3600


async def _prune_journal(journal: Journal) -> None:
    """Keep the journal bounded: forget finished operations after a week."""
    while True:
        try:
            pruned = journal.prune(JOURNAL_RETENTION_S)
            if pruned:
                log.info("pruned %d finished operations from the journal", pruned)
        except Exception:  # housekeeping: try again next time
            log.warning("could not prune the operation journal", exc_info=True)
        await asyncio.sleep(PRUNE_EVERY_S)


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def operation_routes(journal: Journal) -> list[Route]:
    """``GET /v1/operations/{id}[?wait=S]``: what became of an operation (for the caller's tenant)."""

    async def status(request: Request) -> JSONResponse:
        claims = request_claims(request)
        op_id = request.path_params["op_id"]
        try:
            wait_s = min(float(request.query_params.get("wait", "0")), MAX_WAIT_S)
        except ValueError:
            error = FleetError(ErrorCode.INVALID_REQUEST, "wait must be a number of seconds")
            return JSONResponse({"error": error.to_dict()}, status_code=error.http_status)
        entry = await journal.wait(claims.tenant, op_id, max(wait_s, 0.0))
        return JSONResponse(entry.to_json())

    return [Route(OPERATIONS_PATH + "/{op_id}", status)]


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
        extensions=[operations_extension(settings.public_url)],
    )
    journal = Journal(settings.local_state_dir() / "operations.sqlite")
    card = sign_card(card, registry.key, jku=registry.own_keys_url)
    handler = DefaultRequestHandler(
        agent_executor=SkillExecutor(
            skills, Toolbox(registry, mcp_http), journal, heartbeat_s=settings.heartbeat_s
        ),
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
            stack.callback(journal.close)
            pruner = asyncio.create_task(_prune_journal(journal), name="journal-pruner")
            stack.push_async_callback(_cancelled, pruner)
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
        extra_routes=operation_routes(journal),
        protected_prefixes=(RPC_PATH, OPERATIONS_PATH),
    )


async def serve_specialist(
    settings: ServiceSettings, *, name: str, description: str, version: str, skills: Sequence[Skill]
) -> None:
    configure_logging(settings.service_id, settings.log_level)
    app = build_specialist_app(settings, name=name, description=description, version=version, skills=skills)
    await serve_app(app, settings)
