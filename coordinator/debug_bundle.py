"""The debug bundle of a run: everything needed to explain what happened without re-running it."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
from importlib import metadata
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from coordinator.operations import Ledger
from coordinator.runs import PostgresRunStore, Run, RunEvent
from fleet.redact import redact

PACKAGES = (
    "agent-fleet",
    "a2a-sdk",
    "mcp",
    "langgraph",
    "langgraph-checkpoint-postgres",
    "nats-py",
    "psycopg",
)
TOOL_CALL_COLUMNS = ("ts", "tool", "input_hash", "latency_ms", "status", "error")


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
    how long it took, and how it ended."""
    inputs = {step["id"]: step.get("input", {}) for step in run.plan}
    started: dict[str, RunEvent] = {}
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(TOOL_CALL_COLUMNS)
    for event in events:
        step = str(event.payload.get("step", ""))
        if event.type == "step.started":
            started[step] = event
        elif event.type in ("step.completed", "step.failed") and step in started:
            begin = started.pop(step)
            digest = hashlib.sha256(json.dumps(inputs.get(step, {}), sort_keys=True).encode()).hexdigest()
            writer.writerow(
                (
                    begin.ts.isoformat(),
                    f"{begin.payload.get('agent')}/{begin.payload.get('skill')}",
                    digest[:16],
                    round((event.ts - begin.ts).total_seconds() * 1000, 1),
                    "ok" if event.type == "step.completed" else "failed",
                    event.payload.get("message", "") if event.type == "step.failed" else "",
                )
            )
    for step, begin in started.items():  # started but never finished: the run stopped there
        writer.writerow(
            (begin.ts.isoformat(), f"{begin.payload.get('agent')}/{step}", "", "", "unfinished", "")
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


async def bundle(
    store: PostgresRunStore, ledger: Ledger, saver: BaseCheckpointSaver[Any], run: Run, policy_revision: str
) -> dict[str, Any]:
    """The files of the bundle, by name (JSON-ready)."""
    events = await all_events(store, run)
    found = await checkpoints(saver, run.run_id)
    return {
        "events.jsonl": "".join(json.dumps(e.to_json()) + "\n" for e in events),
        "operations.jsonl": "".join(
            json.dumps(op.to_json()) + "\n" for op in await ledger.for_run(run.run_id)
        ),
        "checkpoints.jsonl": "".join(json.dumps(c) + "\n" for c in found),
        "last_state.json": json.dumps(found[0]["values"] if found else {}, indent=2) + "\n",
        "tool_calls.csv": tool_calls(run, events),
        "env.txt": environment(policy_revision),
    }
