"""The debug bundle of a run: everything needed to explain what happened without re-running it.

Files: ``EXPLAIN.md`` (the summary a person reads first, see :mod:`coordinator.control.explain`),
``events.jsonl`` (the event log), ``operations.jsonl`` (the operations ledger), ``checkpoints.jsonl``
and ``last_state.json`` (graph state, redacted), ``tool_calls.csv`` (one row per delegated step),
``agents.json`` (the registry's records now of the agents the run used) and ``env.txt`` (versions and
the policy revision)."""

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
) -> dict[str, Any]:
    """The files of the bundle, by name (JSON-ready); ``agents``: the registry's agent records now,
    by id (empty when the registry cannot be asked)."""
    events = await all_events(store, run)
    found = await checkpoints(saver, run.run_id)
    operations = [op.to_json() for op in await ledger.for_run(run.run_id)]
    used = used_agents(events, agents)
    return {
        "EXPLAIN.md": explain(run, events, operations, policy_revision, {k: v for k, v in used.items() if v}),
        "events.jsonl": "".join(json.dumps(e.to_json()) + "\n" for e in events),
        "operations.jsonl": "".join(json.dumps(redact(op)[0]) + "\n" for op in operations),
        "agents.json": json.dumps(used, indent=2) + "\n",
        "checkpoints.jsonl": "".join(json.dumps(c) + "\n" for c in found),
        "last_state.json": json.dumps(found[0]["values"] if found else {}, indent=2) + "\n",
        "tool_calls.csv": tool_calls(run, events),
        "env.txt": environment(policy_revision),
    }
