"""The console's memory audit feed costs the same however long the 90-day audit stream grows: it reads
a window of the newest messages, not the whole stream, on every request."""

from __future__ import annotations

import json

from fleet.events import ensure_stream
from fleet.natsconn import connect
from fleetctl.console import _feeds


async def test_memory_audit_reads_a_window_of_the_newest_messages(nats_url: str) -> None:
    client = await connect(nats_url, "console-feeds")
    try:
        js = client.jetstream()
        await ensure_stream(js, _feeds.AUDIT_STREAM, "fleet.audit.>", max_age_s=3600)

        async def audit(tenant: str, n: int) -> None:
            record = {"tenant": tenant, "tool": "remember", "n": n}
            await js.publish("fleet.audit.memory.mcp-memory", json.dumps(record).encode())

        await audit("acme", 0)  # older than the window
        for n in range(_feeds.AUDIT_WINDOW):
            await audit("other", n)
        await audit("acme", 1)
        await js.publish("fleet.audit.tools.mcp-sql", b'{"tenant": "acme", "tool": "query"}')

        events = await _feeds.memory_audit(client, "acme")
        assert [e["n"] for e in events] == [1]
        assert all(e["tenant"] == "acme" for e in await _feeds.memory_audit(client, "acme"))
    finally:
        await client.close()
