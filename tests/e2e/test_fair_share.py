"""Fair share between tenants on the stack's shared paths: one tenant at full tilt does not starve
another (memory scans; see docs/limits.md)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.e2e.conftest import Stack
from tests.e2e.stack_helpers import call, ok

MEMORY = ("memory:read", "memory:write")

# A text the scanner takes long over (the phone-number windows), about 0.5 s here: 64 of them keep a
# scan thread busy past the 20 s after which a text that got no thread used to be refused.
SLOW = "1 " * 2000


async def test_a_tenant_flooding_the_memory_scanner_leaves_another_tenants_write_prompt(stack: Stack) -> None:
    acme = stack.token("mcp-memory", tenant="acme", scopes=MEMORY)
    globex = stack.token("mcp-memory", tenant="globex", scopes=MEMORY)
    started = time.monotonic()
    idle = await call(stack, "mcp-memory", globex, "remember", {"text": "fair-share baseline note of globex"})
    baseline_s = time.monotonic() - started
    assert not idle.is_error and idle.structured_content["status"] == "stored", idle.content

    items: list[dict[str, Any]] = [{"text": f"{SLOW}{i}", "tier": "episodic"} for i in range(64)]
    flood = [
        asyncio.create_task(call(stack, "mcp-memory", acme, "remember_many", {"items": items}, timeout_s=600))
        for _ in range(2)
    ]
    done, _ = await asyncio.wait(flood, timeout=3)  # the flood has both scan threads
    assert not done
    started = time.monotonic()
    write = await call(
        stack, "mcp-memory", globex, "remember", {"text": "fair-share note of globex under a flood"}
    )
    flooded_s = time.monotonic() - started
    assert not write.is_error and write.structured_content["status"] == "stored", write.content
    assert not all(task.done() for task in flood)  # it did not wait for the flood
    assert flooded_s < baseline_s + 15, (flooded_s, baseline_s)
    for task in flood:
        outcomes = ok(await asyncio.wait_for(task, 600))
        assert len(outcomes) == 64 and {o["status"] for o in outcomes} <= {"stored", "refused"}
