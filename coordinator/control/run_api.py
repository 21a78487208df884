"""The run API for people and scripts: list and read runs, and follow a run's events over SSE.

``GET /v1/runs/{id}/events`` replays the event log after the client's cursor (``Last-Event-ID`` or
``?after=``) and then streams new events as they are committed, until the run ends. Every event
carries its sequence number as the SSE id, so a client that reconnects with the last id it saw gets
exactly the events it missed, with no duplicates. Closing the stream never affects the run. A
stream takes a slot (:mod:`coordinator.control.streams`: over a cap it is refused with ``stream_limit``, 429
and ``Retry-After``) and sends a keep-alive comment whenever it has been idle for a while.

Every route reaches only the runs the caller's principal started, unless policy
(``fleet.runs.access``, see :mod:`coordinator.record.access`) gives it the tenant's: any other run is
``not_found``, the same answer as a run that does not exist, and a listing never loads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coordinator.control.debug_bundle import bundle
from coordinator.control.signals import SignalDesk, parse_signal
from coordinator.control.streams import HeldStream, StreamLimitReached, Streams, StreamSlot, with_keepalives
from coordinator.record.access import Reach, RunAccess, RunAction
from coordinator.record.operations import Ledger
from coordinator.record.runs import FOLLOW_POLL_S, PostgresRunStore, Run, RunState, event_json
from fleet.a2a_support import request_claims
from fleet.errors import ErrorCode, FleetError
from fleet.service import problem_response
from fleet.tokens import Claims
from policy import PolicyEngine

RUNS_PREFIX = "/v1/"
RESOLVE_SCOPE = "runs:resolve"
MAX_LISTED = 500
CHANGES_COALESCE_S = 0.25  # a run-changes stream reads the list at most this often
INVOKE_SCOPE = "agent:invoke"
# What starts a run (the A2A surface's admission, given by the composition root): the request's
# body and the caller's claims; the run's id.
StartRun = Callable[[dict[str, Any], Claims, str | None], Awaitable[tuple[str, bool]]]

log = logging.getLogger(__name__)


def _run_json(run: Run) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "tenant": run.tenant,
        "owner": run.owner,
        "state": run.state.value,
        "reason": run.reason,
        "last_seq": run.last_seq,
        "wait": run.wait,
        "created_at": run.created_at.isoformat(),
        "updated_at": run.updated_at.isoformat(),
    }


def _error(exc: FleetError) -> JSONResponse:
    return problem_response(exc)


def _cursor(request: Request) -> int:
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not (raw.isascii() and raw.isdigit()):
        raise FleetError(ErrorCode.INVALID_REQUEST, "Last-Event-ID must be an event sequence number")
    return int(raw)


def _listing(request: Request) -> tuple[int, RunState | None]:
    raw_limit, raw_state = request.query_params.get("limit", "50"), request.query_params.get("state")
    if not (raw_limit.isascii() and raw_limit.isdigit()) or not 0 < int(raw_limit) <= MAX_LISTED:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"limit must be a number from 1 to {MAX_LISTED}")
    try:
        return int(raw_limit), RunState(raw_state) if raw_state else None
    except ValueError as exc:
        states = ", ".join(s.value for s in RunState)
        raise FleetError(ErrorCode.INVALID_REQUEST, f"state must be one of {states}") from exc


class RunApi:
    """The run API's handlers (see :func:`run_routes`)."""

    def __init__(
        self,
        store: PostgresRunStore,
        ledger: Ledger,
        submit: Callable[[str, str, str], Awaitable[None]],
        streams: Streams,
        saver: BaseCheckpointSaver[Any],
        policy: PolicyEngine,
        desk: SignalDesk,
        agent_records: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None,
        start: StartRun | None = None,
        workspace_of: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.start, self.workspace_of = start, workspace_of
        self.store, self.ledger, self.submit, self.streams = store, ledger, submit, streams
        self.saver, self.policy, self.desk, self.agent_records = saver, policy, desk, agent_records
        self.access = RunAccess(policy)

    async def reach(self, request: Request, action: RunAction = RunAction.READ) -> Reach:
        return await self.access.reach(request_claims(request), action)

    async def reached_run(self, request: Request, action: RunAction = RunAction.READ) -> Run:
        """The run of the path, if the caller reaches it for ``action``; ``not_found`` if not."""
        within = await self.reach(request, action)
        return await self.store.get_run(request.path_params["run_id"], within.tenant, owner=within.owner)

    async def agents_now(self) -> dict[str, dict[str, Any]]:
        if self.agent_records is None:
            return {}
        try:
            return {str(a["id"]): a for a in await self.agent_records()}
        except Exception:
            # The bundle explains the run from its own records; the registry only adds versions.
            log.warning("could not list the registry's agents for a debug bundle", exc_info=True)
            return {}

    async def resubmit(self, run_id: str, attempt: str, tenant: str) -> None:
        """Hand an answered run back to the workers; it is durable as submitted, so if the broker
        cannot take it now, the workers' sweep for stranded runs will."""
        try:
            await self.submit(run_id, attempt, tenant)
        except Exception:
            log.warning("could not submit run %s (%s); the sweep will", run_id, attempt, exc_info=True)

    async def start_run(self, request: Request) -> Response:
        """Start a run: ``{"steps": [...]}``, ``{"workflow": NAME, "input": {...}}`` or ``{"text":
        ...}``, admitted as an A2A request is (a task of the caller's, the same plan checks); 202
        with its id. Needs scope ``agent:invoke``, as A2A does. With an ``Idempotency-Key`` header
        the request may be sent again safely: one run is made for the key (of this caller), and a
        repeat answers 200 with that run's id and state (``Idempotent-Replayed: true``)."""
        claims = request_claims(request)
        try:
            if INVOKE_SCOPE not in claims.scopes:
                raise FleetError(ErrorCode.FORBIDDEN, f"starting a run needs scope {INVOKE_SCOPE}")
            if self.start is None:
                raise FleetError(ErrorCode.NOT_FOUND, "this coordinator starts runs over A2A only")
            key = request.headers.get("idempotency-key")
            run_id, made = await self.start(await _json_body(request), claims, key)
            if not made:
                run = await self.store.get_run(run_id, claims.tenant, owner=claims.sub)
                headers = {"Idempotent-Replayed": "true"}
                return JSONResponse({"run_id": run_id, "state": run.state.value}, headers=headers)
        except FleetError as exc:
            return _error(exc)
        return JSONResponse({"run_id": run_id, "state": RunState.SUBMITTED.value}, status_code=202)

    async def list_runs(self, request: Request) -> Response:
        """The tenant's newest runs: ``?limit=`` (50, at most 500), ``?state=`` (one run state)."""
        try:
            limit, state = _listing(request)
            within = await self.reach(request)
        except FleetError as exc:
            return _error(exc)
        runs = await self.store.list_runs(within.tenant, limit, state, owner=within.owner)
        return JSONResponse({"runs": [_run_json(r) for r in runs]})

    async def changes(self, request: Request) -> Response:
        """``GET /v1/runs/changes``: the tenant's newest runs as ``list_runs`` gives them (same
        ``?limit=`` and ``?state=``), as server-sent events: one ``runs`` event at once, and another
        whenever the list changed. The stream is woken by the runs database's notifications (no
        poll), and reads the list again at most every ``CHANGES_COALESCE_S``, so a burst of commits
        costs one read; it takes a stream slot like a run's events."""
        try:
            limit, state = _listing(request)
            within = await self.reach(request)
            slot = await self.streams.slots.take(request_claims(request), "run changes")
        except StreamLimitReached as exc:
            return exc.response()
        except FleetError as exc:
            return _error(exc)

        async def stream() -> AsyncGenerator[str]:
            sent: list[tuple[str, str, int]] | None = None
            with self.streams.notifier.watch() as wakeup:
                while True:
                    wakeup.arm()  # before reading: a commit after the read wakes the wait below
                    runs = await self.store.list_runs(within.tenant, limit, state, owner=within.owner)
                    seen = [(r.run_id, r.state.value, r.last_seq) for r in runs]
                    if seen != sent:
                        sent = seen
                        yield f"event: runs\ndata: {json.dumps({'runs': [_run_json(r) for r in runs]})}\n\n"
                    await wakeup.wait(FOLLOW_POLL_S)
                    await asyncio.sleep(CHANGES_COALESCE_S)

        return self._sse(stream(), slot)

    def _sse(self, stream: AsyncGenerator[str], slot: StreamSlot) -> HeldStream:
        """A server-sent event stream that holds its stream slot until it ends, with keep-alives."""
        return HeldStream(
            with_keepalives(stream, self.streams.keepalive_s),
            slot,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store"},
        )

    async def get_run(self, request: Request) -> Response:
        try:
            run = await self.reached_run(request)
        except FleetError as exc:
            return _error(exc)
        return JSONResponse(_run_json(run))

    async def events(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            after = _cursor(request)
            within = await self.reach(request)
            await self.store.get_run(run_id, within.tenant, owner=within.owner)
            slot = await self.streams.slots.take(request_claims(request), "run events")
        except StreamLimitReached as exc:
            return exc.response()
        except FleetError as exc:
            return _error(exc)

        async def stream() -> AsyncGenerator[str]:
            events = self.store.follow(
                run_id, within.tenant, after, self.streams.notifier, owner=within.owner
            )
            async for event in events:
                yield f"id: {event.seq}\nevent: {event.type}\ndata: {event_json(event)}\n\n"

        return self._sse(stream(), slot)

    async def debug_bundle(self, request: Request) -> Response:
        try:
            run = await self.reached_run(request)
        except FleetError as exc:
            return _error(exc)
        workspace = await self.workspace_of(run.tenant, run.run_id) if self.workspace_of is not None else None
        files = await bundle(
            self.store, self.ledger, self.saver, run, self.policy.revision, await self.agents_now(), workspace
        )
        return JSONResponse({"run": _run_json(run), "files": files})

    async def operations(self, request: Request) -> Response:
        try:
            run = await self.reached_run(request)
        except FleetError as exc:
            return _error(exc)
        return JSONResponse({"operations": [op.to_json() for op in await self.ledger.for_run(run.run_id)]})

    async def resolve(self, request: Request) -> Response:
        """A person's answer for an operation whose outcome nobody could establish; the run
        then goes back to the workers."""
        claims = request_claims(request)
        try:
            if RESOLVE_SCOPE not in claims.scopes:
                raise FleetError(ErrorCode.FORBIDDEN, f"resolving an operation needs scope {RESOLVE_SCOPE}")
            await self.reached_run(request, RunAction.RESOLVE)
            body = await _json_body(request)
            verdict = body.get("verdict")
            if verdict not in ("succeeded", "failed", "retry"):
                raise FleetError(
                    ErrorCode.INVALID_REQUEST, 'verdict must be "succeeded", "failed" or "retry"'
                )
            result = body.get("result", {})
            note = body.get("note", "")
            if not isinstance(result, dict) or not isinstance(note, str):
                raise FleetError(ErrorCode.INVALID_REQUEST, "result must be an object and note a string")
            run_id = request.path_params["run_id"]
            op, seq = await self.ledger.resolve(
                run_id,
                claims.tenant,
                request.path_params["op_id"],
                verdict,
                claims.sub,
                result=result,
                note=note,
            )
        except FleetError as exc:
            return _error(exc)
        await self.resubmit(run_id, f"resume-{seq}", claims.tenant)
        return JSONResponse({"operation": op.to_json()})

    async def decide(self, request: Request) -> Response:
        """A person's decision on what a waiting run asks (today: a spent budget, ``tranche`` or
        ``close``); the run then goes back to the workers. Only the first decision counts."""
        claims = request_claims(request)
        run_id = request.path_params["run_id"]
        try:
            if RESOLVE_SCOPE not in claims.scopes:
                raise FleetError(ErrorCode.FORBIDDEN, f"deciding for a run needs scope {RESOLVE_SCOPE}")
            await self.reached_run(request, RunAction.RESOLVE)
            answer = budget_decision(await _json_body(request))
            seq = await self.store.answer_wait(run_id, claims.tenant, "budget", answer, claims.sub)
        except FleetError as exc:
            return _error(exc)
        await self.resubmit(run_id, f"decided-{seq}", claims.tenant)
        return JSONResponse({"run": _run_json(await self.store.get_run(run_id, claims.tenant)), "seq": seq})

    async def signal(self, request: Request) -> Response:
        """A signal for a run (approve, reject, input, extend, cancel; see
        :mod:`coordinator.control.signals`): what came of it, a no-op included. Policy decides who may."""
        claims = request_claims(request)
        try:
            given = parse_signal(request.path_params["run_id"], await _json_body(request), "api")
            outcome = await self.desk.apply(given, claims)
        except FleetError as exc:
            return _error(exc)
        return JSONResponse(outcome.to_json())

    async def signals(self, request: Request) -> Response:
        try:
            run = await self.reached_run(request)
        except FleetError as exc:
            return _error(exc)
        return JSONResponse({"signals": await self.desk.for_run(run.run_id, run.tenant)})


def run_routes(
    store: PostgresRunStore,
    ledger: Ledger,
    submit: Callable[[str, str, str], Awaitable[None]],
    streams: Streams,
    saver: BaseCheckpointSaver[Any],
    policy: PolicyEngine,
    desk: SignalDesk,
    agent_records: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None,
    start: StartRun | None = None,
    workspace_of: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None,
) -> list[Route]:
    """The run API's routes; ``agent_records`` lists the registry's agents (for the debug bundle:
    the versions of the agents a run used), ``workspace_of`` a run's workspace (tenant, run id)."""
    api = RunApi(store, ledger, submit, streams, saver, policy, desk, agent_records, start, workspace_of)
    return [
        Route("/v1/runs", api.start_run, methods=["POST"]),
        Route("/v1/runs", api.list_runs, methods=["GET"]),
        Route("/v1/runs/changes", api.changes),
        Route("/v1/runs/{run_id}/signals", api.signal, methods=["POST"]),
        Route("/v1/runs/{run_id}/signals", api.signals, methods=["GET"]),
        Route("/v1/runs/{run_id}/decision", api.decide, methods=["POST"]),
        Route("/v1/runs/{run_id}/debug-bundle", api.debug_bundle),
        Route("/v1/runs/{run_id}", api.get_run),
        Route("/v1/runs/{run_id}/events", api.events),
        Route("/v1/runs/{run_id}/operations", api.operations),
        Route("/v1/runs/{run_id}/operations/{op_id}/resolve", api.resolve, methods=["POST"]),
    ]


def budget_decision(body: dict[str, Any]) -> dict[str, Any]:
    """A valid answer to a spent budget: ``{"decision": "tranche"|"close", "note"?, "limits"?}``,
    where ``limits`` may raise ``max_steps``, ``max_operations`` or ``max_seconds`` for the tranche."""
    decision, note, limits = body.get("decision"), body.get("note", ""), body.get("limits", {})
    if decision not in ("tranche", "close"):
        raise FleetError(ErrorCode.INVALID_REQUEST, 'decision must be "tranche" or "close"')
    if not isinstance(note, str) or not isinstance(limits, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "note must be a string and limits an object")
    allowed = {"max_steps", "max_operations", "max_seconds"}
    for key, value in limits.items():
        if key not in allowed or isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise FleetError(
                ErrorCode.INVALID_REQUEST, f"limits may set {sorted(allowed)} to numbers >= 0; not {key!r}"
            )
    if limits and decision != "tranche":
        raise FleetError(ErrorCode.INVALID_REQUEST, "limits go with a tranche")
    return {"decision": decision, "note": note, **({"limits": limits} if limits else {})}


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError) as exc:  # not UTF-8 JSON, or nested deeper than Python parses
        raise FleetError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object") from exc
    if not isinstance(body, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object")
    return body
