"""A run parked at a gate, made known: the approval requests a worker publishes when a run starts
waiting for a person (``fleet.approvals.<tenant>.<run>``), and the subjects and streams of the
approvals and of the signals that answer them (:mod:`coordinator.control.signals` takes those in)."""

from __future__ import annotations

import json
import re
from typing import Any

from nats.js.client import JetStreamContext

from coordinator.record.runs import logged, wait_requests
from fleet.signal_client import SIGNALS_PREFIX, ensure_signal_streams
from fleet.vocabulary import SignalAction

GATE_TYPES = ("approval", "input")
GATE_CHOICES = {  # what may answer a gate
    "approval": [SignalAction.APPROVE, SignalAction.REJECT],
    "input": [SignalAction.INPUT, SignalAction.REJECT],
}
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def approvals_subject(tenant: str, run_id: str) -> str:
    token = tenant if _TOKEN.match(tenant) else "_"
    return f"fleet.approvals.{token}.{run_id}"


def approval_requests(run_id: str, tenant: str, wait: dict[str, Any]) -> list[dict[str, Any]]:
    """The approval requests a parked run's wait record stands for: one per gate it waits at."""
    requests = wait_requests(wait)
    return [
        logged(
            {
                "run_id": run_id,
                "tenant": tenant,
                "awaited": request.get("awaited"),
                "type": request.get("type"),
                "step": request.get("step"),
                "skill": request.get("skill"),
                "agent": request.get("agent"),
                "why": request.get("why"),
                "asked": request.get("asked"),
                "choices": GATE_CHOICES.get(str(request.get("type"))),
                "deadline": request.get("deadline"),
                "escalated": request.get("escalated", False),
                "signal_subject": SIGNALS_PREFIX + run_id,
                "since": wait.get("since"),
            }
        )
        for request in requests
        if request.get("type") in GATE_TYPES
    ]


async def announce(js: JetStreamContext, run_id: str, tenant: str, wait: dict[str, Any]) -> int:
    """Publish the approval requests of a parked run (once per awaited id: a repeat, by a worker
    that finds the run parked after a crash, is dropped by the stream). How many there were."""
    requests = approval_requests(run_id, tenant, wait)
    if requests:
        await ensure_signal_streams(js)
    for request in requests:
        await js.publish(
            approvals_subject(tenant, run_id),
            json.dumps(request).encode(),
            headers={"Nats-Msg-Id": f"{run_id}/{request['awaited']}"},
        )
    return len(requests)
