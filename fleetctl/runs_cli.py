"""``fleet runs list|show|events|cancel``: a tenant's runs through the coordinator's run API, as the
operator.

``runs events RUN`` replays the event log over SSE (``GET /v1/runs/{id}/events``); with ``--follow``
it keeps streaming until the run ends, reconnecting with ``Last-Event-ID`` (the last seq it printed)
when the connection drops (or the coordinator is restarting), so no event is lost or printed twice;
every request and reconnect carries an operator token valid then, so a follow outlasts any token. A
command that saw the run end exits with the code of its end state (see
:data:`fleetctl.cli_common.EXIT_BY_END_STATE`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.helpers import new_data_part, new_text_part
from a2a.types import AgentCard, Message, Role, SendMessageConfiguration, SendMessageRequest, TaskState
from a2a.utils.errors import A2AError
from google.protobuf.json_format import ParseDict

from fleet.a2a_support import error_of_a2a
from fleet.errors import ErrorCode, FleetError
from fleet.retry import backoff_s
from fleet.vocabulary import EventType
from fleetctl.cli_common import (
    EXIT_BY_END_STATE,
    EXIT_NO_OP,
    EXIT_OK,
    ServiceClient,
    emit,
    emit_line,
    error_of,
    operator_client,
)
from fleetctl.layout import StackLayout
from fleetctl.progress import ProgressBar

# The operator reaches every run of the tenant (runs:admin), not only those it started.
READ_SCOPES = ("agent:invoke", "runs:admin")
SIGNAL_SCOPES = ("agent:invoke", "runs:approve", "runs:admin")
TERMINAL_STATES = frozenset(EXIT_BY_END_STATE)
RECONNECTS = 8  # in a row without a new event; then the coordinator is taken to be gone


def waiting_on(run: dict[str, Any]) -> str:
    """What a waiting run waits for, in a few words (``approval approval:wipe:1``)."""
    wait = run.get("wait") or {}
    return " ".join(str(wait[k]) for k in ("type", "awaited") if wait.get(k))


async def list_runs(layout: StackLayout, tenant: str, state: str | None, limit: int, *, as_json: bool) -> int:
    """``fleet runs list``: the tenant's runs, newest first."""
    params = {"limit": limit, **({"state": state} if state else {})}
    async with operator_client(layout, "coordinator", tenant, READ_SCOPES) as api:
        runs = (await api.get("/v1/runs", params=params))["runs"]
    lines = [f"{'RUN':<34} {'STATE':<15} {'REASON':<20} {'WAITING ON':<30} UPDATED"]
    lines += [
        f"{r['run_id']:<34} {r['state']:<15} {r['reason'] or '':<20} {waiting_on(r):<30} {r['updated_at']}"
        for r in runs
    ]
    emit({"runs": runs}, as_json=as_json, text="\n".join(lines))
    return EXIT_OK


# --- reading the event log -------------------------------------------------------------------


async def _sse(api: ServiceClient, run_id: str, after: int) -> AsyncGenerator[dict[str, Any], None]:
    """The events the server streams after seq ``after``, parsed (with a token valid now: a
    reconnect long after the first connection gets a fresh one)."""
    headers = {**await api.headers(), "Last-Event-ID": str(after)}
    url = f"{api.base_url}/v1/runs/{run_id}/events"
    async with api.http.stream("GET", url, headers=headers) as response:
        if response.status_code >= 400:
            await response.aread()
            raise error_of(response)
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                event: dict[str, Any] = json.loads(line.removeprefix("data: "))
                yield event


async def events_of(
    api: ServiceClient, run_id: str, after: int, *, follow: bool, last_seq: int
) -> AsyncIterator[dict[str, Any]]:
    """The run's events after ``after``: up to ``last_seq`` (the run's last when asked), or with
    ``follow`` until the run ends, resuming from the last event seen if the connection drops or
    the coordinator (or the registry, for a fresh token) cannot be reached for a while."""
    cursor, failures = after, 0
    while follow or cursor < last_seq:
        try:
            # aclosing: leaving early closes the stream (and its connection) now, not at GC.
            async with contextlib.aclosing(_sse(api, run_id, cursor)) as stream:
                async for event in stream:
                    cursor, failures = event["seq"], 0
                    yield event
                    if not follow and cursor >= last_seq:
                        return
            # The server closes the stream when the run has ended; a close without that is a drop.
            if (await api.get(f"/v1/runs/{run_id}"))["state"] in TERMINAL_STATES:
                return
            why = "the stream ended before the run"
        except httpx.TransportError as exc:
            why = repr(exc)
        except FleetError as exc:
            if exc.code != ErrorCode.DEPENDENCY_UNAVAILABLE:
                raise
            why = exc.message  # restarting: back off as for a dropped stream
        failures = await _backoff(failures, why)


async def _backoff(failures: int, why: str) -> int:
    """Wait before reconnecting (the coordinator may be restarting); give up after RECONNECTS
    drops in a row without an event."""
    failures += 1
    if failures > RECONNECTS:
        raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, f"lost the coordinator's event stream: {why}")
    await asyncio.sleep(backoff_s(failures, base_s=0.5, cap_s=5.0))
    return failures


def _summary(event: dict[str, Any]) -> str:
    text = json.dumps(event.get("payload", {}), separators=(",", ":"), default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def _event_line(event: dict[str, Any]) -> str:
    return f"{event['seq']:>5} {event['ts']} {event['type']:<22} {event['actor']:<16} {_summary(event)}"


async def _print_events(
    api: ServiceClient, run_id: str, after: int, follow: bool, last_seq: int, as_json: bool
) -> list[dict[str, Any]]:
    """Print each event as it comes (a line, or a JSON line while following), drawing batch
    progress as a bar on a terminal; return them."""
    bar = ProgressBar.for_stream(sys.stdout, as_json=as_json)
    seen: list[dict[str, Any]] = []
    async for event in events_of(api, run_id, after, follow=follow, last_seq=last_seq):
        seen.append(event)
        if as_json and follow:
            emit_line(event)
        elif event["type"] == EventType.BATCH_PROGRESS and bar.enabled:
            bar.update(str(event["payload"].get("step", "")), *_done_total(event))
        elif not as_json:
            bar.clear()
            print(_event_line(event), flush=True)
    bar.finish()
    return seen


def _done_total(event: dict[str, Any]) -> tuple[int, int]:
    payload = event["payload"]
    return int(payload.get("done", 0)), int(payload.get("total", 0))


async def events(
    layout: StackLayout, run_id: str, tenant: str, after: int, *, follow: bool, as_json: bool
) -> int:
    """``fleet runs events RUN [--follow] [--after SEQ]``; the exit code says how the run ended,
    if it has (0 completed, 7 failed, 8 canceled, 9 rejected), else 0."""
    async with operator_client(layout, "coordinator", tenant, READ_SCOPES) as api:
        run = await api.get(f"/v1/runs/{run_id}")
        seen = await _print_events(api, run_id, after, follow, int(run["last_seq"]), as_json)
        if follow:
            run = await api.get(f"/v1/runs/{run_id}")
    if as_json and not follow:
        emit({"run_id": run_id, "state": run["state"], "events": seen}, as_json=True)
    return EXIT_BY_END_STATE.get(run["state"], EXIT_OK)


# --- one run -------------------------------------------------------------------------------


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step the log names: its skill, the agent it went to (the last, after reroutes), how it
    stands, and batch progress."""
    steps: dict[str, dict[str, Any]] = {}
    for event in events:
        payload = event.get("payload", {})
        kind = event["type"]
        if not kind.startswith(("step.", EventType.BATCH_PROGRESS)) or "step" not in payload:
            continue
        step = steps.setdefault(str(payload["step"]), {"step": payload["step"], "status": "started"})
        _fold_step(step, kind, payload)
    return list(steps.values())


def _fold_step(step: dict[str, Any], kind: str, payload: dict[str, Any]) -> None:
    for key in ("skill", "agent"):
        if payload.get(key):
            step[key] = payload[key]
    if kind == EventType.STEP_REROUTED:
        step["agent"] = payload.get("to", step.get("agent"))
        step["reroutes"] = step.get("reroutes", 0) + 1
    elif kind == EventType.BATCH_PROGRESS:
        step["done"], step["total"] = payload.get("done"), payload.get("total")
    elif kind in (EventType.STEP_COMPLETED, EventType.STEP_FAILED, EventType.STEP_BLOCKED):
        step["status"] = kind.removeprefix("step.")
        if kind == EventType.STEP_FAILED:
            step["error"] = {"code": payload.get("code"), "message": payload.get("message")}


def last_error(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last failure the log records (a failed step, or the run's own failure)."""
    for event in reversed(events):
        payload = event.get("payload", {})
        if event["type"] == EventType.STEP_FAILED or (
            event["type"] == EventType.RUN_FAILED and payload.get("message")
        ):
            return {
                "seq": event["seq"],
                "step": payload.get("step"),
                "code": payload.get("code") or payload.get("reason"),
                "message": payload.get("message", ""),
            }
    return None


async def _run_view(api: ServiceClient, run_id: str) -> dict[str, Any]:
    run = await api.get(f"/v1/runs/{run_id}")
    log = [e async for e in events_of(api, run_id, 0, follow=False, last_seq=int(run["last_seq"]))]
    operations = (await api.get(f"/v1/runs/{run_id}/operations"))["operations"]
    return {
        **run,
        "steps": steps_of(log),
        "operations": operations,
        "artifacts": [e["payload"] for e in log if e["type"] == EventType.ARTIFACT],
        "last_error": last_error(log),
    }


def _view_lines(view: dict[str, Any]) -> list[str]:
    reason = f" ({view['reason']})" if view.get("reason") else ""
    lines = [f"run {view['run_id']}: {view['state']}{reason}", f"  updated  {view['updated_at']}"]
    if wait := view.get("wait"):
        lines.append(
            f"  waiting  {waiting_on(view)} since {wait.get('since', '?')} deadline {wait.get('deadline', '-')}"
        )
    lines.append("  steps")
    for step in view["steps"]:
        extra = f" {step['done']}/{step['total']}" if step.get("total") else ""
        reroutes = f" rerouted x{step['reroutes']}" if step.get("reroutes") else ""
        lines.append(
            f"    {step['step']:<16} {step.get('skill', ''):<18} {step.get('agent', ''):<16} "
            f"{step['status']}{extra}{reroutes}"
        )
    lines.append("  operations")
    lines += [
        f"    {o['op_id']:<20} {o['step_id']:<16} {o['target']:<16} {o['status']}" for o in view["operations"]
    ]
    lines.append(f"  artifacts  {len(view['artifacts'])}")
    if error := view.get("last_error"):
        lines.append(f"  last error  [{error['code']}] {error['message']} (step {error['step']})")
    return lines


async def show(layout: StackLayout, run_id: str, tenant: str, *, watch: bool, as_json: bool) -> int:
    """``fleet runs show RUN [--watch]``: the run's state, wait, steps, operations, artifacts and
    last error; with ``--watch``, follow it to its end (a progress bar for batch steps)."""
    async with operator_client(layout, "coordinator", tenant, READ_SCOPES) as api:
        view = await _run_view(api, run_id)
        if watch and view["state"] not in TERMINAL_STATES:
            if not as_json:
                print("\n".join(_view_lines(view)), flush=True)
            await _watch(api, run_id, int(view["last_seq"]), as_json)
            view = await _run_view(api, run_id)
            emit(view, as_json=as_json, text=f"run {run_id}: {view['state']}")
        else:
            emit(view, as_json=as_json, text="\n".join(_view_lines(view)))
    return EXIT_BY_END_STATE.get(view["state"], EXIT_OK) if watch else EXIT_OK


async def _watch(api: ServiceClient, run_id: str, after: int, as_json: bool) -> None:
    """Until the run ends: a bar for batch progress, a line for each change of the run's state."""
    bar = ProgressBar.for_stream(sys.stdout, as_json=as_json)
    async for event in events_of(api, run_id, after, follow=True, last_seq=after):
        if event["type"] == EventType.BATCH_PROGRESS:
            bar.update(str(event["payload"].get("step", "")), *_done_total(event))
        elif event["type"].startswith("run.") and not as_json:
            bar.clear()
            print(_event_line(event), flush=True)
    bar.finish()


# --- signals -------------------------------------------------------------------------------


async def cancel(layout: StackLayout, run_id: str, tenant: str, reason: str, *, as_json: bool) -> int:
    """``fleet runs cancel RUN``: idempotent; 0 when the run is canceled or will be (a repeat
    included), 4 when it had ended otherwise (nothing to cancel)."""
    async with operator_client(layout, "coordinator", tenant, SIGNAL_SCOPES) as api:
        outcome = await api.post(f"/v1/runs/{run_id}/signals", {"action": "cancel", "note": reason})
        state = (await api.get(f"/v1/runs/{run_id}"))["state"]
    done = outcome["applied"] or state == "canceled"
    text = (
        f"run {run_id}: cancel {'requested' if outcome['applied'] else 'already done'} ({state})"
        if done
        else f"run {run_id}: nothing to cancel, it has {state}"
    )
    emit({**outcome, "state": state}, as_json=as_json, text=text)
    return EXIT_OK if done else EXIT_NO_OP


# --- starting one ------------------------------------------------------------------------------


def plan_message(plan: dict[str, Any] | None, text: str) -> Message:
    """The A2A message that asks the coordinator for a run: ``text`` (planned by the coordinator)
    and/or ``plan`` (steps given as data: ``{"steps": [...]}``)."""
    parts = ([new_text_part(text)] if text else []) + ([new_data_part(plan)] if plan is not None else [])
    if not parts:
        raise FleetError(ErrorCode.INVALID_REQUEST, "say what to run: a plan file (--plan) or text")
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=parts)


async def start(layout: StackLayout, tenant: str, message: Message, *, follow: bool, as_json: bool) -> int:
    """``fleet runs start``: send the run to the coordinator over A2A as the operator (in
    ``tenant``), print its id, and with ``follow`` its events until it ends (the exit code then
    says how it ended, as ``runs events --follow``)."""
    async with operator_client(layout, "coordinator", tenant, READ_SCOPES) as api:
        card = await api.http.get(api.base_url + "/.well-known/agent-card.json")
        if card.status_code != 200:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, f"the coordinator's card: HTTP {card.status_code}"
            )
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=api.http)).create(
            ParseDict(card.json(), AgentCard(), ignore_unknown_fields=True)
        )
        request = SendMessageRequest(
            message=message, configuration=SendMessageConfiguration(return_immediately=True)
        )
        context = ClientCallContext(service_parameters=await api.headers())
        try:
            answers = [answer async for answer in client.send_message(request, context=context)]
        except A2AError as exc:
            raise error_of_a2a(exc, fallback=ErrorCode.INVALID_REQUEST) from exc
        finally:
            await client.close()
        task = next((a.task for a in reversed(answers) if a.WhichOneof("payload") == "task"), None)
        if task is None:
            raise FleetError(ErrorCode.INTERNAL, "the coordinator answered without a task")
        run_id = task.id
        if as_json and not follow:
            emit({"run_id": run_id, "state": TaskState.Name(task.status.state)}, as_json=True)
        elif not as_json:
            print(
                f"run {run_id} started (tenant {tenant}); fleet runs show {run_id} --tenant {tenant}",
                flush=True,
            )
        if not follow:
            return EXIT_OK
        await _print_events(api, run_id, 0, True, 0, as_json)
        run = await api.get(f"/v1/runs/{run_id}")
    return EXIT_BY_END_STATE.get(run["state"], EXIT_OK)
