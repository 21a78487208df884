"""The specialist kit's machinery: the A2A server a specialist's skills run in (the executor, the
operation journal, the tool client acting for the caller, the card and registration). Authors use
the names :mod:`specialists.kit` exports, not this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx2
from a2a.helpers import get_data_parts, new_data_part, new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import TaskUpdater
from a2a.types import InvalidParamsError, Message, TaskState
from google.protobuf.json_format import MessageToDict
from mcp import MCPError
from mcp.types import CONNECTION_CLOSED, INTERNAL_ERROR, CallToolResult
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet import mcp_client, telemetry, transport
from fleet.a2a_grpc import GrpcBinding
from fleet.a2a_support import (
    A2A_PATHS,
    a2a_app,
    a2a_body_limit,
    build_card,
    claims_of,
    request_claims,
    sign_card,
)
from fleet.crashpoints import hold_point
from fleet.errors import ErrorCode, FleetError
from fleet.mcp_errors import error_of
from fleet.operation_ext import (
    BUDGET_METADATA_KEY,
    LAST_REQUEST_METADATA_KEY,
    LOOP_METADATA_KEY,
    MAX_WAIT_S,
    OPERATION_METADATA_KEY,
    OPERATIONS_PATH,
    PROGRESS_METADATA_KEY,
    USAGE_METADATA_KEY,
    args_hash,
    operations_extension,
    skills_extension,
)
from fleet.retry import backoff_s
from fleet.service import Readiness, configure_logging, problem_response, serve_app, start_in_background
from fleet.settings import ServiceSettings
from fleet.tokens import Claims
from registry import McpServerRecord, RegistryClient
from specialists.cancellation import ToolCalls
from specialists.journal import Entry, Journal, JournalStatus
from specialists.llm import llm_brain
from specialists.progress import opened, sealed
from specialists.skill import (
    Brain,
    BudgetMeter,
    InputRequired,
    LoopPolicy,
    OutcomeUnknown,
    Skill,
    SkillContext,
    SkillError,
)
from specialists.task_store import BoundedTaskStore

log = logging.getLogger(__name__)

INVOKE_SCOPE = "agent:invoke"


class _Grant:
    """The bearer token of one tool call, renewed at most once when the MCP server refuses it (HTTP
    401: the token expired, its key rotated, or it was revoked; the server ran nothing), and the
    last HTTP status the call saw (the MCP client turns a gateway's 502/503/504 into a bare error)."""

    def __init__(
        self, token: str, fetch: Callable[[], Awaitable[str]], discard: Callable[[str], None]
    ) -> None:
        self.token = token
        self._fetch = fetch  # a fresh token for the same audience, tenant and scopes
        self._discard = discard  # stop reusing a refused token
        self._lock = asyncio.Lock()
        self.renewed = False
        self.rejected = False  # the fresh token was refused too
        self.renew_error: FleetError | None = None
        self.last_status = 0

    async def renew(self, refused: str) -> bool:
        """Replace the ``refused`` token with a fresh one, once per call; False if that cannot help."""
        async with self._lock:
            if self.token != refused:
                return True  # another request of this call renewed it already
            self._discard(refused)
            if self.renewed:
                self.rejected = True
                return False
            self.renewed = True
            try:
                self.token = await self._fetch()
            except FleetError as exc:
                self.renew_error = exc
                return False
            return True


_current_grant: contextvars.ContextVar[_Grant] = contextvars.ContextVar("mcp_grant")


class _ContextBearer(httpx2.Auth):
    """Sends the token of the current tool call; one HTTP client serves every tenant and server.
    A request the server refuses with 401 is sent once more with a fresh token (a 401 means the
    request was not served, so this is safe for every tool)."""

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        request.headers["Authorization"] = f"Bearer {_current_grant.get().token}"
        yield request

    async def async_auth_flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        grant = _current_grant.get()
        if grant.rejected or grant.renew_error is not None:
            raise httpx2.HTTPError("no token this MCP server accepts")  # no request with a refused one
        telemetry.inject(request.headers)  # the tool's span joins the trace of this call
        while True:
            sent = grant.token
            request.headers["Authorization"] = f"Bearer {sent}"
            response = yield request
            grant.last_status = response.status_code
            if response.status_code != 401 or not await grant.renew(sent):
                return


def mcp_http_client() -> httpx2.AsyncClient:
    """The HTTP client a :class:`Toolbox` calls MCP servers with (its bearer is each call's token)."""
    return mcp_client.http_client(auth=_ContextBearer())


CATALOG_TTL_S = 5.0  # how stale an agent's list of MCP servers may be (a new server shows within it)
TOOLS_PATH = "/v1/tools"


class ToolCatalog:
    """The MCP servers this agent may use, as the registry lists them: each with the tools this
    agent's enrollment has the scopes for. Loaded again when older than ``CATALOG_TTL_S``, so a
    server a team registers shows on the agent's next load, with no restart of anything."""

    def __init__(self, registry: RegistryClient) -> None:
        self._registry = registry
        self._loaded_at = -CATALOG_TTL_S
        self._servers: dict[str, McpServerRecord] = {}
        self._lock = asyncio.Lock()

    async def servers(self, max_age_s: float = CATALOG_TTL_S) -> dict[str, McpServerRecord]:
        """The MCP servers this agent may use, by id, reloaded from the registry when older than
        ``max_age_s``."""
        async with self._lock:
            if time.monotonic() - self._loaded_at >= max_age_s:
                self._servers = {m.id: m for m in await self._registry.mcp_servers()}
                self._loaded_at = time.monotonic()
            return self._servers

    async def server(self, server_id: str) -> McpServerRecord:
        """The server, from the catalog (loaded again at once if it is not there: it may be new)."""
        found = (await self.servers()).get(server_id) or (await self.servers(max_age_s=1.0)).get(server_id)
        if found is None:
            raise SkillError(
                ErrorCode.TOOL_FAILED, f"no MCP server {server_id!r} whose tools this agent may use"
            )
        return found


class Toolbox:
    """Calls MCP tools with a token for that server, the caller's tenant and the tool's scopes.

    Bound to a skill's caller (:meth:`for_skill`), it gets that token by exchanging the caller's
    token at the registry (RFC 8693): the tool server sees who the work is for (``sub``) and every
    agent that passed it on (``act``), never this specialist alone. The caller's token is good for
    that while it lives: every hop reuses a token for at most a minute, so a skill has at least
    four minutes from its call (``fleet.tokens.REUSE_FOR_S``). Unbound (outside a skill), it acts
    in this specialist's own name.

    A skill's toolbox reports its calls to the skill's :class:`ToolCalls`, so that a cancel never cuts
    a call in flight and no call starts after a cancel."""

    def __init__(
        self,
        registry: RegistryClient,
        http: httpx2.AsyncClient,
        calls: ToolCalls | None = None,
        caller: Claims | None = None,
        catalog: ToolCatalog | None = None,
        meter: BudgetMeter | None = None,
        sessions: mcp_client.Sessions | None = None,
    ) -> None:
        self._registry = registry
        self._http = http
        self._sessions = sessions or mcp_client.Sessions(http)
        self._calls = calls
        self._caller = caller
        self._meter = meter
        self.catalog = catalog or ToolCatalog(registry)

    def for_skill(
        self, calls: ToolCalls, caller: Claims | None = None, meter: BudgetMeter | None = None
    ) -> Toolbox:
        """The same toolbox, reporting its calls to ``calls`` (one running skill's), acting for
        ``caller`` (the verified claims the skill was called with) and counting its calls against
        ``meter`` (the task's budget)."""
        return Toolbox(self._registry, self._http, calls, caller, self.catalog, meter, self._sessions)

    async def aclose(self) -> None:
        """Close the MCP sessions this toolbox (and every skill's, which share them) keeps open."""
        await self._sessions.aclose()

    @property
    def all_answered(self) -> bool:
        """Whether every tool call of the skill got its tool's answer (none cut in flight)."""
        return self._calls is None or self._calls.all_answered

    async def available(self) -> list[McpServerRecord]:
        """The MCP servers and tools this agent may use now (see :class:`ToolCatalog`)."""
        return list((await self.catalog.servers()).values())

    def _run_id(self) -> str:
        caller = self._caller
        return caller.run_id if caller is not None else ""

    async def _token(self, audience: str, tenant: str, scopes: Sequence[str]) -> str:
        caller = self._caller
        if caller is None or not caller.token:
            return await self._registry.tokens.token(audience, tenant, scopes)
        if tenant != caller.tenant:
            raise SkillError(
                ErrorCode.FORBIDDEN, f"a skill called for {caller.tenant!r} cannot act for {tenant!r}"
            )
        return await self._registry.tokens.exchange(caller.token, audience, scopes)

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
        """Call ``tool``; a call that exceeds ``timeout_s`` (retries included) raises
        :class:`TimeoutError` (its outcome is then unknown to the caller: the tool may still complete
        it). After a cancel of the skill, no call starts (:class:`asyncio.CancelledError`).

        A token the server refuses (401) is replaced by a fresh one once (``UNAUTHENTICATED`` if the
        fresh one is refused too). A call cut in transit (connection refused or lost, a timeout, a
        gateway's 502/503/504) is made again, at most ``CALL_ATTEMPTS`` times in all, when it cannot
        have reached the tool or the tool is ``idempotent`` or ``read_only`` in the catalog; else it
        raises :class:`OutcomeUnknown` (``OUTCOME_UNKNOWN``: reconcile before calling again). A tool's
        error answer raises ``TOOL_FAILED`` with the tool's own error (read from the answer's
        envelope) as its ``cause``; it is repeated first only when the error says a repeat may
        succeed (``retryable``, e.g. the tool's database was restarting) and the tool is idempotent
        or read-only: at most ``CALL_ATTEMPTS`` answers in all, each after the wait the error asks
        for (at most ``MAX_RETRY_AFTER_S``), else at once."""
        if self._meter is not None:
            self._meter.spend_tool_call(f"{server_id}/{tool}")
        server = await self.catalog.server(server_id)
        token = await self._token(server.audience, tenant, scopes)
        grant = _Grant(
            token,
            fetch=lambda: self._token(server.audience, tenant, scopes),
            discard=self._registry.tokens.discard,
        )
        if self._calls is not None:
            self._calls.start()
        answered = False
        started = time.monotonic()
        reset = _current_grant.set(grant)
        span = telemetry.execute_tool_span(
            tool, kind=SpanKind.CLIENT, server=server_id, run_id=self._run_id(), tenant=tenant
        )
        try:
            with span:
                async with asyncio.timeout(timeout_s):
                    result = await self._answered(server, tool, arguments, grant)
                answered = True
        finally:
            _current_grant.reset(reset)
            if self._calls is not None:
                self._calls.end(answered=answered)
            if self._meter is not None:
                self._meter.timed_tool_call(time.monotonic() - started)
        error = error_of(result)
        if error is not None:
            raise SkillError(
                ErrorCode.TOOL_FAILED,
                f"{server_id}/{tool} answered with an error: {error.message}",
                retryable=error.retryable,
                retry_after_s=error.retry_after_s,
                cause=error,
            )
        return dict(result.structured_content or {})

    async def _answered(
        self, server: McpServerRecord, tool: str, arguments: dict[str, Any], grant: _Grant
    ) -> CallToolResult:
        """The tool's answer, asked again while it is a retryable error of a repeatable tool."""
        for attempt in range(1, CALL_ATTEMPTS + 1):
            result = await self._call_with_retries(server, tool, arguments, grant)
            error = error_of(result)
            wait_s = (error.retry_after_s or 0) if error is not None else 0
            stopping = self._calls is not None and self._calls.cancel_requested
            if (
                error is None
                or not error.retryable
                or wait_s > MAX_RETRY_AFTER_S
                or not _repeatable(server, tool)
                or attempt == CALL_ATTEMPTS
                or stopping
            ):
                return result
            log.warning(
                "%s/%s answered %s (retryable), attempt %d: asking again",
                server.id,
                tool,
                error.code,
                attempt,
            )
            await asyncio.sleep(max(wait_s, backoff_s(attempt, base_s=RETRY_BACKOFF_S)))
        raise AssertionError("unreachable")

    async def _call_with_retries(
        self, server: McpServerRecord, tool: str, arguments: dict[str, Any], grant: _Grant
    ) -> CallToolResult:
        repeatable = _repeatable(server, tool)
        reached_once = False  # whether some attempt may have reached the tool
        revision = str(server.registered_at)  # a server registered again gets a session of its own
        for attempt in range(1, CALL_ATTEMPTS + 1):
            sent = False  # whether the tools/call request may have reached the server
            grant.last_status = 0
            try:
                with mcp_client.transit() as record:
                    async with self._sessions.session(server.url, revision=revision) as client:
                        sent = True
                        return await client.call_tool(tool, arguments)
            except Exception as exc:
                # what failed in transit, as the transport saw it (the SDK reports a stand-in)
                failed = exc if record.error is None else record.error
                cut = _transit_failure(failed, grant, server.id)  # raises what no attempt can help
                why = _describe(cut, grant.last_status)
                reached = sent and not isinstance(cut, _NOT_SENT)
                reached_once = reached_once or reached
                if reached and not repeatable:
                    raise OutcomeUnknown(
                        f"the call to {server.id}/{tool} was cut in transit ({why}); {tool} is not"
                        " marked idempotent, so it was not repeated: it may or may not have taken effect."
                        " Reconcile (e.g. look the effect up with a status tool) before calling it again"
                    ) from exc
                stopping = self._calls is not None and self._calls.cancel_requested
                if attempt == CALL_ATTEMPTS or stopping:
                    unrun = "" if reached_once else "; the tool did not run"
                    raise SkillError(
                        ErrorCode.DEPENDENCY_UNAVAILABLE,
                        f"the call to {server.id}/{tool} was cut in transit {attempt} time(s), last: {why}{unrun}",
                        retryable=True,
                    ) from exc
                log.warning(
                    "call to %s/%s cut in transit (%s), attempt %d: trying again",
                    server.id,
                    tool,
                    why,
                    attempt,
                )
                await asyncio.sleep(backoff_s(attempt, base_s=RETRY_BACKOFF_S))
        raise AssertionError("unreachable")


CALL_ATTEMPTS = 3  # a call cut in transit is made at most this often, when that is safe
RETRY_BACKOFF_S = 0.2  # before the second attempt (jittered), doubling after
MAX_RETRY_AFTER_S = 5  # a retryable answer that asks for a longer wait is the caller's to retry
_GATEWAY_STATUSES = frozenset({502, 503, 504})
# Failures of a request that never left this process: the server cannot have served it.
_NOT_SENT: tuple[type[Exception], ...] = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
_TRANSIENT: tuple[type[Exception], ...] = (
    httpx2.TimeoutException,
    httpx2.NetworkError,
    httpx2.RemoteProtocolError,
)


def _repeatable(server: McpServerRecord, tool: str) -> bool:
    """Whether calling ``tool`` twice does no more than once (a tool the catalog does not list: no)."""
    record = next((t for t in server.tools if t.name == tool), None)
    return record is not None and (record.idempotent or record.read_only)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception (group) is made of (the MCP client raises them from task groups)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _transit_failure(exc: Exception, grant: _Grant, server_id: str) -> Exception:
    """The failure in transit that ``exc`` (from one attempt of a call) is, to retry or report;
    raises the call's error if it is anything else (then no attempt can help)."""
    if grant.renew_error is not None:
        error = grant.renew_error
        raise SkillError(
            error.code, f"MCP server {server_id} refused the token, and no fresh one: {error.message}"
        ) from exc
    if grant.rejected:
        raise SkillError(
            ErrorCode.UNAUTHENTICATED,
            f"MCP server {server_id} refused this agent's token, and a fresh one too (401)",
        ) from exc
    known = [leaf for leaf in _leaves(exc) if isinstance(leaf, MCPError | httpx2.HTTPError)]
    if not known:
        raise exc
    for leaf in known:
        if isinstance(leaf, _TRANSIENT):
            return leaf
        if isinstance(leaf, MCPError) and (
            leaf.code == CONNECTION_CLOSED
            or (leaf.code == INTERNAL_ERROR and grant.last_status in _GATEWAY_STATUSES)
        ):
            return leaf
    first = known[0]
    if isinstance(first, MCPError) and first.code == INTERNAL_ERROR and grant.last_status == 403:
        raise SkillError(ErrorCode.FORBIDDEN, f"MCP server {server_id} refused the call (403)") from exc
    raise SkillError(ErrorCode.TOOL_FAILED, f"MCP server {server_id} refused or failed: {first}") from exc


def _describe(cut: Exception, status: int) -> str:
    if isinstance(cut, MCPError):
        return f"HTTP {status}" if status in _GATEWAY_STATUSES else cut.error.message
    return f"{type(cut).__name__}: {cut}" if str(cut) else type(cut).__name__


class SkillExecutor(AgentExecutor):
    """Runs one skill per task. The request is a data part ``{"skill": ID, "input": {...}}``; with an
    operation id in the message metadata, the operation runs at most once (see
    :mod:`fleet.operation_ext`) and its outcome is kept in the journal.

    A cancel (of the operation, or the A2A ``CancelTask`` of its task) is cooperative
    (:mod:`specialists.cancellation`): the skill stops before its next tool call, the task ends
    ``canceled`` and the journal records how many tool calls it completed."""

    def __init__(
        self,
        skills: Sequence[Skill],
        tools: Toolbox,
        journal: Journal,
        heartbeat_s: float = 20.0,
        brain: Brain | None = None,
        agent_id: str = "specialist",
        notes_key: bytes | None = None,
    ) -> None:
        """``agent_id``: the name this agent's spans carry (its service id); ``notes_key``: what
        its agent loops' progress notes are sealed with (derived from its signing key; random if
        not given, so that no notes are taken back from an earlier process)."""
        self._agent_id = agent_id
        self._notes_key = notes_key or secrets.token_bytes(32)
        self._skills = {skill.id: skill for skill in skills}
        self._tools = tools
        self._journal = journal
        self._heartbeat_s = heartbeat_s
        self._brain = brain
        self._by_task: dict[str, _Running] = {}
        self._by_operation: dict[tuple[str, str], ToolCalls] = {}

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
        """Run the skill an A2A message asks for (once per operation id: the journal answers a repeat)."""
        skill, payload = self._parse(context)
        claims = claims_of(context.call_context)
        assert context.message is not None
        op_id = _operation_of(context.message)
        headers = context.call_context.state.get("headers") if context.call_context else None
        span = telemetry.invoke_agent_span(
            self._agent_id,
            kind=SpanKind.SERVER,
            agent_id=self._agent_id,
            skill=skill.id,
            run_id=claims.run_id,
            operation_id=op_id,
            tenant=claims.tenant,
            parent=headers if isinstance(headers, dict) else None,
        )
        with span:
            await self._execute_task(context, event_queue, skill, payload, claims, op_id)

    async def _execute_task(
        self,
        context: RequestContext,
        event_queue: EventQueue,
        skill: Skill,
        payload: dict[str, Any],
        claims: Claims,
        op_id: str | None,
    ) -> None:
        assert context.message is not None
        task = context.current_task or new_task_from_user_message(context.message)
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        # Known by its task id while it runs, so that CancelTask can reach its skill.
        running = _Running(ToolCalls())
        self._by_task[task.id] = running
        try:
            updater = TaskUpdater(event_queue, task.id, task.context_id)
            budget = skill.budget.lowered(_metadata(context.message, BUDGET_METADATA_KEY))
            meter = BudgetMeter(budget, LoopPolicy.of(_metadata(context.message, LOOP_METADATA_KEY)))
            binding = _notes_binding(claims, skill)
            said = _metadata(context.message, PROGRESS_METADATA_KEY)
            resume = opened(said, self._notes_key, binding) if said is not None else None
            if said is not None and resume is None:
                log.warning(
                    "progress notes this agent did not seal for the task were ignored (run %s)", claims.run_id
                )
            outcome = await self._execute(
                updater, skill, claims, op_id, payload, running.calls, meter, resume
            )
            await _publish(
                updater, skill.id, outcome, meter.to_dict() if meter.ran else None, meter.last_request
            )
            running.published = True
        finally:
            if self._by_task.get(task.id) is running:
                del self._by_task[task.id]
            running.ended.set()

    async def _execute(
        self,
        updater: TaskUpdater,
        skill: Skill,
        claims: Claims,
        op_id: str | None,
        payload: dict[str, Any],
        calls: ToolCalls,
        meter: BudgetMeter,
        resume: dict[str, Any] | None = None,
    ) -> Outcome:
        """``resume``: the operation's progress notes, when it comes back after a crash."""
        await updater.start_work()

        async def progress(text: str) -> None:
            await updater.update_status(
                TaskState.TASK_STATE_WORKING, message=updater.new_agent_message([new_text_part(text)])
            )

        async def save(notes: dict[str, Any]) -> None:
            # The caller keeps them with the operation, and sends them back if it sends it again:
            # sealed, so that only notes this agent wrote for this task are taken back.
            mine = sealed(notes, self._notes_key, _notes_binding(claims, skill))
            saved = updater.new_agent_message(
                [new_data_part({"progress": "saved"})], {PROGRESS_METADATA_KEY: mine}
            )
            await updater.update_status(TaskState.TASK_STATE_WORKING, message=saved)

        channel = _Channel(progress, save, resume)

        async def heartbeat() -> None:
            # An empty status update now and then: the caller's activity lease stays alive while
            # the skill works quietly (its absence means this agent is stuck or cut off).
            while True:
                await asyncio.sleep(self._heartbeat_s)
                await updater.update_status(TaskState.TASK_STATE_WORKING)

        beating = (
            asyncio.create_task(heartbeat(), name=f"heartbeat-{updater.task_id}")
            if self._heartbeat_s > 0
            else None
        )
        try:
            if op_id is not None:
                return await self._run_once(skill, claims, op_id, payload, channel, calls, meter)
            ctx = self._context(skill, claims, calls, channel, None, payload, meter)
            return await _run_stoppable(skill, ctx, payload, calls, brain=self._brain)
        finally:
            if beating is not None:
                await _cancelled(beating)

    async def _run_once(
        self,
        skill: Skill,
        claims: Claims,
        op_id: str,
        payload: dict[str, Any],
        channel: _Channel,
        calls: ToolCalls,
        meter: BudgetMeter,
    ) -> Outcome:
        """Run the operation unless the journal knows it: then answer with what it recorded."""
        digest = args_hash({"skill": skill.id, "input": payload})
        entry = self._journal.get(claims.tenant, op_id)
        if entry.status == JournalStatus.RUNNING:  # the same operation, sent again: join it
            entry = await self._journal.wait(claims.tenant, op_id, timeout_s=3600)
        if entry.status == JournalStatus.CANCELED and not entry.received:
            log.info("operation %s was canceled before it arrived: refused", op_id)
            return JournalStatus.FAILED, None, entry.error or _refused(op_id)
        if entry.status != JournalStatus.UNKNOWN and entry.args_hash != digest:
            message = f"operation {op_id} was already used with other arguments"
            return JournalStatus.FAILED, None, FleetError(ErrorCode.CONFLICT, message).to_dict()
        if entry.status in _ENDED:
            log.info("operation %s answered from the journal (%s)", op_id, entry.status)
            return entry.status, entry.result, entry.error
        if entry.status == JournalStatus.INTERRUPTED and not skill.idempotent:
            message = f"{skill.id} was interrupted mid-way and is not safe to repeat"
            unsafe = FleetError(ErrorCode.OUTCOME_UNKNOWN, message).to_dict()
            self._journal.finish(claims.tenant, op_id, JournalStatus.UNCERTAIN, error=unsafe)
            return JournalStatus.UNCERTAIN, None, unsafe
        if not self._journal.begin(claims.tenant, op_id, skill.id, digest):
            return JournalStatus.FAILED, None, _refused(op_id)  # canceled meanwhile

        def record(outcome: Outcome) -> None:
            status, result, error = outcome
            self._journal.finish(
                claims.tenant, op_id, status, result=result, error=error, usage=meter.to_dict()
            )

        key = (claims.tenant, op_id)
        self._by_operation[key] = calls
        try:
            context = self._context(skill, claims, calls, channel, op_id, payload, meter)
            return await _run_stoppable(skill, context, payload, calls, record, self._brain)
        finally:
            del self._by_operation[key]

    def _context(
        self,
        skill: Skill,
        claims: Claims,
        calls: ToolCalls,
        channel: _Channel,
        op_id: str | None,
        payload: dict[str, Any],
        meter: BudgetMeter,
    ) -> SkillContext:
        # A call after a person answered carries the recorded approval and, if they gave one, input.
        answer = payload.get("input") if isinstance(payload.get("approval"), dict) else None
        return SkillContext(
            claims,
            self._tools.for_skill(calls, claims, meter),
            channel.progress,
            op_id,
            budget=meter,
            answer=answer if isinstance(answer, dict) else ({"text": answer} if answer is not None else None),
            resume=channel.resume,
            save_progress=channel.save,
        )

    async def cancel_operation(self, tenant: str, op_id: str) -> Entry:
        """Cancel an operation (see :mod:`fleet.operation_ext`) and return its entry once the cancel
        took effect, or after :data:`MAX_WAIT_S` (a tool call in flight is let finish)."""
        entry = self._journal.get(tenant, op_id)
        if entry.status == JournalStatus.UNKNOWN:
            return self._journal.cancel_unreceived(tenant, op_id)
        calls = self._by_operation.get((tenant, op_id))
        if calls is None:  # it ended, or an earlier process of this agent was running it
            return entry
        calls.cancel()
        return await self._journal.wait(tenant, op_id, MAX_WAIT_S)

    def answer(self, entry: Entry) -> dict[str, Any]:
        """The extension's answer about an entry: a running operation that was asked to cancel (and
        waits for its tool call in flight) says so with ``cancel_requested``."""
        body = entry.to_json()
        calls = self._by_operation.get((entry.tenant, entry.op_id))
        if entry.status == JournalStatus.RUNNING and calls is not None and calls.cancel_requested:
            body["cancel_requested"] = True
        return body

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """A2A ``CancelTask``: the cooperative cancel, then the task's end as the skill reached it
        (``canceled``, or what it completed first). If the skill has not stopped after
        :data:`MAX_WAIT_S` (a long tool call in flight), the task is marked canceled now; the SDK then
        stops the request, which still lets that call end for a while before it cuts it."""
        running = self._by_task.get(context.task_id or "")
        if running is not None:
            running.calls.cancel()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(MAX_WAIT_S):
                    await running.ended.wait()
            if running.published:
                return
        if context.current_task is not None:
            updater = TaskUpdater(event_queue, context.current_task.id, context.current_task.context_id)
            await updater.cancel()


@dataclass(frozen=True, slots=True)
class _Channel:
    """What a running skill tells its caller as it goes: progress text, and its progress notes
    (``save``); and the notes it was sent back (``resume``)."""

    progress: Callable[[str], Awaitable[None]]
    save: Callable[[dict[str, Any]], Awaitable[None]]
    resume: dict[str, Any] | None


@dataclass(eq=False, slots=True)
class _Running:
    """A task this process is running: its skill's tool calls, and whether its end is published."""

    calls: ToolCalls
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    published: bool = False


async def _run(
    skill: Skill, context: SkillContext, payload: dict[str, Any], brain: Brain | None = None
) -> Outcome:
    await hold_point("skill.start", skill.id)  # tests only: hold a skill before its first tool call
    context.budget.ran = True
    limit = context.budget.budget.max_seconds
    try:
        async with asyncio.timeout(limit):
            if brain is not None and skill.instructions:
                result = await brain.run(skill, context, payload)
            else:
                result = await skill.run(context, payload)
    except InputRequired as asked:
        # Not an end: the task goes input-required, and the answer comes in the step's next call.
        return JournalStatus.SUCCEEDED, _asking(asked), None
    except TimeoutError:
        message = f"{skill.id} ran out of its {limit:g} s budget after {context.budget.tool_calls} tool calls"
        log.info("skill %s: %s", skill.id, message)
        cut = isinstance(context.tools, Toolbox) and not context.tools.all_answered
        if cut and not skill.idempotent:
            # Cut in a tool call: its effect may or may not have been made.
            unknown = f"{message}, one of them cut in flight: its effect is unknown"
            return JournalStatus.UNCERTAIN, None, FleetError(ErrorCode.OUTCOME_UNKNOWN, unknown).to_dict()
        return JournalStatus.FAILED, None, FleetError(ErrorCode.BUDGET_EXHAUSTED, message).to_dict()
    except OutcomeUnknown as exc:
        log.warning("skill %s could not confirm an effect: %s", skill.id, exc)
        return JournalStatus.UNCERTAIN, None, exc.to_dict()
    except FleetError as exc:
        log.info("skill %s failed: %r", skill.id, exc)
        return JournalStatus.FAILED, None, exc.to_dict()
    except Exception:
        log.exception("skill %s crashed", skill.id)
        return (
            JournalStatus.FAILED,
            None,
            FleetError(ErrorCode.INTERNAL, f"{skill.id} crashed").to_dict(),
        )
    return JournalStatus.SUCCEEDED, result, None


ASKING = "input_required"  # the status of a result that asks a person (see InputRequired)


def _asking(asked: InputRequired) -> dict[str, Any]:
    """The result of a skill that asked: what the caller's delegation reads from an
    ``input-required`` task (its question, and the data it was sent with)."""
    return {"status": ASKING, "question": asked.question, "details": [{"fields": asked.fields}]}


STOP_TIMEOUT_S = 5.0  # a skill cut by a cancel gets this long to unwind


async def _run_stoppable(
    skill: Skill,
    context: SkillContext,
    payload: dict[str, Any],
    calls: ToolCalls,
    record: Callable[[Outcome], None] = lambda outcome: None,
    brain: Brain | None = None,
) -> Outcome:
    """Run the skill in a task of its own that ``calls`` can cancel, and ``record`` its outcome
    however it ends, including when the request itself is stopped (shutdown, or an A2A cancel
    that gave up waiting): the skill is then cut, after its tool call in flight if a cancel was asked
    for (for a while), at once if not."""
    skill_task = asyncio.create_task(_run(skill, context, payload, brain), name=f"skill {skill.id}")
    calls.attach(skill_task)
    try:
        try:
            await asyncio.wait({skill_task})
        except asyncio.CancelledError:
            if calls.cancel_requested:
                await asyncio.wait({skill_task}, timeout=MAX_WAIT_S)
            skill_task.cancel()
            await asyncio.wait({skill_task}, timeout=STOP_TIMEOUT_S)
            raise
    finally:
        outcome = _outcome_of(skill_task, skill, calls)
        record(outcome)
    return outcome


def _outcome_of(skill_task: asyncio.Task[Outcome], skill: Skill, calls: ToolCalls) -> Outcome:
    if skill_task.done() and not skill_task.cancelled() and skill_task.exception() is None:
        return skill_task.result()
    if skill_task.cancelled() and calls.cancel_requested and calls.all_answered:
        # Stopped between tool calls: what it did is what its completed calls did.
        return JournalStatus.CANCELED, None, calls.canceled_error()
    # Stopped mid-way (shutdown, or a tool call cut or unanswered): its effects may be partial. A
    # skill that is safe to repeat is merely interrupted: sent again, it runs again.
    stopped = FleetError(ErrorCode.OUTCOME_UNKNOWN, f"{skill.id} was stopped mid-way").to_dict()
    return (JournalStatus.INTERRUPTED if skill.idempotent else JournalStatus.UNCERTAIN), None, stopped


async def _publish(
    updater: TaskUpdater,
    skill_id: str,
    outcome: Outcome,
    usage: dict[str, Any] | None = None,
    last_request: dict[str, Any] | None = None,
) -> None:
    """End the task as the skill's outcome says, with what it spent (``usage``, if it ran here) in
    the metadata of its last message or artifact (``fleet.usage``), and, if it failed, the last
    request its agent loop sent the model (``fleet.last_request``, redacted)."""
    status, result, error = outcome
    metadata: dict[str, Any] | None = {USAGE_METADATA_KEY: usage} if usage is not None else None
    if last_request is not None and status != JournalStatus.SUCCEEDED:
        metadata = {**(metadata or {}), LAST_REQUEST_METADATA_KEY: last_request}
    if status == JournalStatus.SUCCEEDED and (result or {}).get("status") == ASKING:
        assert result is not None
        details = [new_data_part(d) for d in result.get("details", []) if isinstance(d, dict)]
        await updater.requires_input(
            updater.new_agent_message([new_text_part(str(result["question"])), *details], metadata)
        )
        return
    if status == JournalStatus.SUCCEEDED:
        await updater.add_artifact(
            [new_data_part(result or {})], name=skill_id, last_chunk=True, metadata=metadata
        )
        await updater.complete()
        return
    assert error is not None
    text = str(error.get("message") or error.get("code"))
    message = updater.new_agent_message([new_text_part(text), new_data_part({"error": error})], metadata)
    if status == JournalStatus.CANCELED:
        await updater.cancel(message)
    else:
        await updater.failed(message)


def _notes_binding(claims: Claims, skill: Skill) -> str:
    """What a task's progress notes are sealed for: its tenant, run and skill."""
    return f"{claims.tenant}\n{claims.run_id}\n{skill.id}"


def _refused(op_id: str) -> dict[str, Any]:
    message = f"operation {op_id} was canceled before it arrived; it will not run"
    return {**FleetError(ErrorCode.CANCELED, message).to_dict(), "tool_calls": 0}


Outcome = tuple[JournalStatus, dict[str, Any] | None, dict[str, Any] | None]
# Outcomes the journal answers a repeat with, as they are.
_ENDED = (JournalStatus.SUCCEEDED, JournalStatus.FAILED, JournalStatus.UNCERTAIN, JournalStatus.CANCELED)


def _metadata(message: Message | None, key: str) -> Any:
    """A message metadata value as plain JSON (None if absent)."""
    if message is None or not message.HasField("metadata") or key not in message.metadata.fields:
        return None
    return MessageToDict(message.metadata).get(key)


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


def operation_routes(journal: Journal, executor: SkillExecutor) -> list[Route]:
    """``GET /v1/operations/{id}[?wait=S]``: what became of an operation; ``POST
    /v1/operations/{id}/cancel``: cancel it, and answer the same once the cancel took effect (for the
    caller's tenant)."""

    async def status(request: Request) -> JSONResponse:
        claims = request_claims(request)
        op_id = request.path_params["op_id"]
        try:
            wait_s = min(float(request.query_params.get("wait", "0")), MAX_WAIT_S)
        except ValueError:
            error = FleetError(ErrorCode.INVALID_REQUEST, "wait must be a number of seconds")
            return problem_response(error)
        entry = await journal.wait(claims.tenant, op_id, max(wait_s, 0.0))
        return JSONResponse(executor.answer(entry))

    async def cancel(request: Request) -> JSONResponse:
        claims = request_claims(request)
        entry = await executor.cancel_operation(claims.tenant, request.path_params["op_id"])
        return JSONResponse(executor.answer(entry))

    return [
        Route(OPERATIONS_PATH + "/{op_id}", status),
        Route(OPERATIONS_PATH + "/{op_id}/cancel", cancel, methods=["POST"]),
    ]


def tools_route(tools: Toolbox) -> Route:
    """``GET /v1/tools``: the MCP servers and tools this agent may use now (as its skills see them)."""

    async def listing(request: Request) -> JSONResponse:
        request_claims(request)  # a verified caller (the middleware checked the token)
        servers = await tools.available()
        return JSONResponse({"mcp_servers": [m.model_dump(mode="json") for m in servers]})

    return Route(TOOLS_PATH, listing)


def build_specialist_app(
    settings: ServiceSettings,
    *,
    name: str,
    description: str,
    version: str,
    skills: Sequence[Skill],
) -> Starlette:
    """The specialist's A2A app: its signed card, bearer-JWT auth on every call, the skills' executor
    over a journal of operations, and the routes the coordinator asks about operations; enrolls
    and registers the agent as it starts (:func:`serve_specialist` serves it)."""
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), event_hooks=transport.hooks())
    mcp_http = mcp_http_client()
    registry = RegistryClient(settings, http)
    verifier = registry.verifier()
    grpc = GrpcBinding.bind(settings, verifier, INVOKE_SCOPE)
    card = build_card(
        name=name,
        description=description,
        version=version,
        base_url=settings.public_url,
        skills=[s.card_skill() for s in skills],
        token_url=registry.token_url,
        required_scope=INVOKE_SCOPE,
        extensions=[operations_extension(settings.public_url), skills_extension(skills)],
        input_modes=["application/json"],  # a data part {"skill": ID, "input": {...}}; no free text
        grpc_url=grpc.url if grpc else None,
    )
    journal = Journal(settings.local_state_dir() / "operations.sqlite")
    card = sign_card(card, registry.key, jku=registry.own_keys_url)
    tools = Toolbox(registry, mcp_http)
    # With an LLM configured, skills that have instructions run as an agent loop over the tools.
    brain = llm_brain(settings, http)
    executor = SkillExecutor(
        skills,
        tools,
        journal,
        heartbeat_s=settings.heartbeat_s,
        brain=brain,
        agent_id=settings.service_id,
        notes_key=registry.key.derived_secret("progress-notes"),
    )
    handler = DefaultRequestHandler(
        agent_executor=executor,
        task_store=BoundedTaskStore(),
        agent_card=card,
    )
    readiness = Readiness(settings.service_id, "specialist")

    async def start() -> None:
        await registry.join_as_agent(settings.public_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            stack.push_async_callback(registry.aclose)
            await stack.enter_async_context(mcp_http)
            stack.push_async_callback(tools.aclose)  # before the HTTP client its sessions use
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
        verifier=verifier,
        required_scope=INVOKE_SCOPE,
        lifespan=lifespan,
        extra_routes=[*operation_routes(journal, executor), tools_route(tools)],
        protected_prefixes=(*A2A_PATHS, OPERATIONS_PATH, TOOLS_PATH),
        grpc=grpc,
    )


async def serve_specialist(
    settings: ServiceSettings, *, name: str, description: str, version: str, skills: Sequence[Skill]
) -> None:
    """Serve a specialist with ``skills`` until the process is stopped (a specialist module's ``main``)."""
    configure_logging(settings.service_id, settings.log_level)
    app = build_specialist_app(settings, name=name, description=description, version=version, skills=skills)
    await serve_app(app, settings, [a2a_body_limit(settings)])


__all__ = [
    "SkillExecutor",
    "ToolCatalog",
    "Toolbox",
    "build_specialist_app",
    "mcp_http_client",
    "serve_specialist",
]
