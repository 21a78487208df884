"""What the console reads from NATS: the policy each process enforces, the decision log and the
memory server's audit trail.

The decision log records no input (only its hash) and no tenant, so the console shows each decision
as which policy was asked by which service, whether it allowed, and under which revision; not the
reasons, which may name another tenant. The memory audit is filtered to the signed-in tenant.
"""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from policy.live import DECISIONS_STREAM, statuses

MAX_SHOWN = 50  # the newest; the whole log is `fleet policy log`
AUDIT_STREAM = "FLEET_AUDIT"  # fleet/buscatalog.py
# How far back the console looks for a tenant's memory audit: the last this many messages of the
# audit stream (every service's audit shares it), so that a request costs the same however long the
# stream grows (90 days); older events are read with `fleet memory audit`.
AUDIT_WINDOW = 2000


async def policy_view(client: NATS, last: int = MAX_SHOWN) -> dict[str, Any]:
    """The revision every live process enforces, and the last ``last`` decisions."""
    processes = sorted(await statuses(client), key=lambda r: str(r.get("service", "")))
    decisions = [
        _decision(r) for r in await _last_records(client, DECISIONS_STREAM, "fleet.decisions.>", last)
    ]
    return {"processes": processes, "decisions": decisions[-last:]}


async def memory_audit(client: NATS, tenant: str, last: int = MAX_SHOWN) -> list[dict[str, Any]]:
    """The memory server's audit events of ``tenant`` among the last ``AUDIT_WINDOW`` messages of the
    audit stream, the newest last."""
    events = await _last_records(client, AUDIT_STREAM, "fleet.audit.memory.>", AUDIT_WINDOW)
    return [e for e in events if e.get("tenant") == tenant][-last:]


def _decision(record: dict[str, Any]) -> dict[str, Any]:
    result = record.get("result")
    allow = result.get("allow") if isinstance(result, dict) else result
    return {
        "decision_id": record.get("decision_id"),
        "path": record.get("path"),
        "service": record.get("requested_by"),
        "allow": allow if isinstance(allow, bool) else None,
        "revision": record.get("bundles", {}).get("fleet", {}).get("revision"),
        "timestamp": record.get("timestamp"),
    }


async def _last_records(client: NATS, stream: str, subject: str, last: int) -> list[dict[str, Any]]:
    """The records of the last ``last`` messages of ``stream`` (a message holds one or more)."""
    js = client.jetstream()
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return []
    if info.state.messages == 0:
        return []
    start = max(info.state.first_seq, info.state.last_seq - last + 1)
    subscription = await js.subscribe(
        subject,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
    )
    records: list[dict[str, Any]] = []
    try:
        while True:
            try:
                msg = await subscription.next_msg(timeout=1.0)
            except TimeoutError:
                break
            records += [json.loads(line) for line in msg.data.split(b"\n") if line]
            if msg.metadata.num_pending == 0:
                break
    finally:
        await subscription.unsubscribe()
    return records
