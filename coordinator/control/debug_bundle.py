"""The debug bundle of a run: everything needed to explain what happened without re-running it.

Files: ``EXPLAIN.md`` (the summary a person reads first, see :mod:`coordinator.control.explain`),
``events.jsonl`` (the event log), ``operations.jsonl`` (the operations ledger), ``checkpoints.jsonl``
and ``last_state.json`` (graph state, redacted), ``tool_calls.csv`` (one row per delegated step),
``agents.json`` (the registry's records now of the agents the run used), ``trace.json`` (the run as
a trace: its steps, operations and waits as spans, with the trace id of the request that made it),
``model_requests.jsonl`` (the last request the agent loop of each failed step sent its model, as
sent, redacted), ``workspace.json`` (the files of the run's sandbox workspace, as the sandbox lists
them to a token bound to the run: path, size, digest; or why it could not be listed) and
``env.txt`` (versions and the policy revision)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from coordinator.control.explain import codes_of, explain
from coordinator.record.operations import Ledger
from coordinator.record.runs import PostgresRunStore, Run, RunEvent
from coordinator.record.work import TRACE_KEY
from fleet.redact import redact
from fleet.vocabulary import EventType

PACKAGES = (
    "agent-fleet",
    "a2a-sdk",
    "mcp",
    "langgraph",
    "langgraph-checkpoint",
    "nats-py",
    "psycopg",
)
NOT_LISTED = {"error": {"code": "dependency_unavailable", "message": "no sandbox to ask", "retryable": False}}
TOOL_CALL_COLUMNS = ("ts", "tool", "input_hash", "latency_ms", "status", "error_code", "causes", "error")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


async def all_events(store: PostgresRunStore, run: Run) -> list[RunEvent]:
    events: list[RunEvent] = []
    while True:
        page = await store.events_after(run.run_id, run.tenant, events[-1].seq if events else 0)
        if not page:
            return events
        events.extend(page)


async def checkpoints(saver: BaseCheckpointSaver[Any], run_id: str) -> list[dict[str, Any]]:
    found = []
    async for item in saver.alist({"configurable": {"thread_id": run_id}}):
        found.append(
            {
                "checkpoint_id": item.config["configurable"].get("checkpoint_id"),
                "ts": item.checkpoint.get("ts"),
                "metadata": _jsonable(item.metadata),
                # Checkpoints hold what the run computed with; the bundle, like the log, is redacted.
                "values": redact(_jsonable(item.checkpoint.get("channel_values", {})))[0],
            }
        )
    return found


def tool_calls(run: Run, events: list[RunEvent]) -> str:
    """One CSV row per delegated step: when it started, which agent and skill, a hash of its input,
    how long it took, and how it ended (a failure: its code, the codes of what it wraps, outermost
    first and space-separated, and its message)."""
    inputs = {step["id"]: step.get("input", {}) for step in run.plan}
    started: dict[str, RunEvent] = {}
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(TOOL_CALL_COLUMNS)
    for event in events:
        step = str(event.payload.get("step", ""))
        if event.type == EventType.STEP_STARTED:
            started[step] = event
        elif event.type in (EventType.STEP_COMPLETED, EventType.STEP_FAILED) and step in started:
            begin = started.pop(step)
            digest = hashlib.sha256(json.dumps(inputs.get(step, {}), sort_keys=True).encode()).hexdigest()
            failed = event.type == EventType.STEP_FAILED
            writer.writerow(
                (
                    begin.ts.isoformat(),
                    f"{begin.payload.get('agent')}/{begin.payload.get('skill')}",
                    digest[:16],
                    round((event.ts - begin.ts).total_seconds() * 1000, 1),
                    "failed" if failed else "ok",
                    event.payload.get("code", "") if failed else "",
                    " ".join(codes_of(event.payload.get("cause"))) if failed else "",
                    event.payload.get("message", "") if failed else "",
                )
            )
    for step, begin in started.items():  # started but never finished: the run stopped there
        writer.writerow(
            (begin.ts.isoformat(), f"{begin.payload.get('agent')}/{step}", "", "", "unfinished", "", "", "")
        )
    return out.getvalue()


# The run's trace, rebuilt from what the run recorded: one span per interval the log opens and
# closes. (The spans the processes sent to a collector, if one is configured, share its trace id.)
_OPENS: dict[str, tuple[str, str]] = {
    EventType.STEP_STARTED: ("step", "step"),
    EventType.OPERATION_INTENT: ("operation", "op_id"),
    EventType.RUN_WAITING: ("wait", ""),
}
_CLOSES: dict[str, tuple[str, str]] = {
    EventType.STEP_COMPLETED: ("step", "step"),
    EventType.STEP_FAILED: ("step", "step"),
    EventType.OPERATION_SUCCEEDED: ("operation", "op_id"),
    EventType.OPERATION_FAILED: ("operation", "op_id"),
    EventType.OPERATION_NEEDS_HUMAN: ("operation", "op_id"),
    EventType.RUN_RESUMED: ("wait", ""),
}


def trace(run: Run, events: list[RunEvent], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """The run as a trace: the run's span, and within it a span per step, per operation (with the
    agent it went to and what its task said it spent) and per wait, each from the event that opened
    it to the one that closed it (open: no end); with the W3C trace id of the request that created
    the run, if it carried one, and the GenAI conversation id (the run's)."""
    usage = {op["op_id"]: op.get("usage") for op in operations}
    targets = {op["op_id"]: op.get("target") for op in operations}
    parent = run.request.get(TRACE_KEY)
    traceparent = str(parent.get("traceparent", "")) if isinstance(parent, dict) else ""
    trace_id = traceparent.split("-")[1] if traceparent.count("-") == 3 else ""
    spans: list[dict[str, Any]] = []
    open_: dict[tuple[str, str], dict[str, Any]] = {}
    for event in events:
        for table, closing in ((_OPENS, False), (_CLOSES, True)):
            if event.type not in table:
                continue
            kind, key = table[event.type]
            name = str(event.payload.get(key, "")) if key else "wait"
            if not closing:
                span: dict[str, Any] = {
                    "name": f"{kind} {name}",
                    "start": event.ts.isoformat(),
                    "end": None,
                    "attributes": {},
                }
                if kind == "operation":
                    span["attributes"] = {
                        "fleet.operation_id": name,
                        "fleet.step": event.payload.get("step"),
                        "gen_ai.agent.id": targets.get(name),
                        "fleet.usage": usage.get(name),
                    }
                elif kind == "step":
                    span["attributes"] = {
                        "fleet.skill": event.payload.get("skill"),
                        "gen_ai.agent.id": event.payload.get("agent"),
                    }
                spans.append(span)
                open_[(kind, name)] = span
            elif (kind, name) in open_:
                span = open_.pop((kind, name))
                span["end"] = event.ts.isoformat()
                span["status"] = (
                    "error" if event.type in (EventType.STEP_FAILED, EventType.OPERATION_FAILED) else "ok"
                )
    root = {
        "name": f"run {run.run_id}",
        "start": run.created_at.isoformat(),
        "end": run.updated_at.isoformat()
        if run.state.value in ("completed", "failed", "canceled", "rejected")
        else None,
        "attributes": {
            "fleet.run_id": run.run_id,
            "gen_ai.conversation.id": run.run_id,
            "fleet.tenant": run.tenant,
        },
        "status": run.state.value,
    }
    return {"trace_id": trace_id, "conversation_id": run.run_id, "spans": [root, *spans]}


def environment(policy_revision: str) -> str:
    lines = [f"python {platform.python_version()}", f"platform {platform.platform()}"]
    for name in PACKAGES:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    lines.append(f"policy bundle revision {policy_revision}")
    return "\n".join(lines) + "\n"


def used_agents(events: list[RunEvent], agents: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The registry's records (id, version, status, url, skills) of the agents the run's steps went
    to, by id; an agent no longer registered is null."""
    named = {
        str(e.payload.get(key))
        for e in events
        for key in ("agent", "to", "from")
        if e.type.startswith("step.") and e.payload.get(key)
    }
    fields = ("id", "version", "status", "url", "skills")
    return {
        name: ({k: agents[name].get(k) for k in fields} if name in agents else None) for name in sorted(named)
    }


async def bundle(
    store: PostgresRunStore,
    ledger: Ledger,
    saver: BaseCheckpointSaver[Any],
    run: Run,
    policy_revision: str,
    agents: Mapping[str, Mapping[str, Any]],
    workspace: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The files of the bundle, by name (JSON-ready); ``agents``: the registry's agent records now,
    by id (empty when the registry cannot be asked); ``workspace``: the run's workspace listing
    (``files``, or the ``error`` that kept it from being listed)."""
    events = await all_events(store, run)
    found = await checkpoints(saver, run.run_id)
    operations = [op.to_json() for op in await ledger.for_run(run.run_id)]
    requests = await ledger.last_requests(run.run_id)
    used = used_agents(events, agents)
    return {
        "EXPLAIN.md": explain(run, events, operations, policy_revision, {k: v for k, v in used.items() if v}),
        "events.jsonl": "".join(json.dumps(e.to_json()) + "\n" for e in events),
        "operations.jsonl": "".join(json.dumps(redact(op)[0]) + "\n" for op in operations),
        "agents.json": json.dumps(used, indent=2) + "\n",
        "checkpoints.jsonl": "".join(json.dumps(c) + "\n" for c in found),
        "last_state.json": json.dumps(found[0]["values"] if found else {}, indent=2) + "\n",
        "tool_calls.csv": tool_calls(run, events),
        "trace.json": json.dumps(redact(trace(run, events, operations))[0], indent=2, default=str) + "\n",
        "model_requests.jsonl": "".join(json.dumps(redact(r)[0]) + "\n" for r in requests),
        "workspace.json": json.dumps(redact(dict(workspace or NOT_LISTED))[0], indent=2) + "\n",
        "env.txt": environment(policy_revision),
    }
