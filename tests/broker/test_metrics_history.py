"""The metrics' history on the bus: a process publishes its snapshot on fleet.metrics.<process> every
interval while it runs, and the console's history reads what arrived since its last read, never the
whole stream again."""

from __future__ import annotations

import asyncio
import uuid

from fleet import telemetry
from fleet.natsconn import connect
from fleetctl.console._charts import MetricsHistory


async def test_snapshots_are_published_every_interval_and_read_incrementally(nats_url: str) -> None:
    client = await connect(nats_url, "metrics-history")
    source = f"mcp-{uuid.uuid4().hex[:8]}"  # this test's own subject on the session's broker
    history = MetricsHistory()
    try:
        telemetry.TOOL_CALL_SECONDS.labels(source, "query", "ok").observe(0.02)
        async with telemetry.publishing_metrics(client, source, every_s=0.5):
            await asyncio.sleep(1.3)  # a snapshot at once, then every 0.5 s
        await history.refresh(client)
        mine = [s for s in history.samples if s["source"] == source]
        assert len(mine) >= 3
        assert all(s["tool_calls"]["counts"][-1] >= 1 for s in mine)  # what this process counted
        assert [s["at"] for s in mine] == sorted(s["at"] for s in mine)
        read = len(history.samples)  # of every process on this broker

        telemetry.TOOL_CALL_SECONDS.labels(source, "query", "error").observe(0.2)
        async with telemetry.publishing_metrics(client, source, every_s=60):
            pass  # one more snapshot, published as the context closes
        await history.refresh(client)
        since = list(history.samples)[read:]
        assert [s["source"] for s in since].count(source) == 1  # only what arrived since: none twice
        assert next(s for s in since if s["source"] == source)["tool_errors"] >= 1
    finally:
        await client.close()
