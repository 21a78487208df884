"""``GET /v1/runs/changes``: a tenant's runs pushed as they change (the console's lanes), against the
real stack: the list at once, again when a run moves, nothing of another tenant's, the same
refusals as the run API."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fleetctl.testing.e2e import Stack
from tests.e2e.a2a_helpers import INLINE_OUTLIERS, fresh_tenant

pytestmark = pytest.mark.e2e


async def pushed(response: httpx.Response) -> AsyncIterator[list[dict[str, Any]]]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))["runs"]


async def test_a_tenants_runs_are_pushed_as_they_change_and_no_one_elses(stack: Stack) -> None:
    tenant, other = fresh_tenant(), fresh_tenant()
    token, others = stack.token("coordinator", tenant=tenant), stack.token("coordinator", tenant=other)
    base = stack.endpoints["coordinator"]
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=90.0)) as http,
        http.stream(
            "GET", f"{base}/v1/runs/changes", headers={"Authorization": f"Bearer {token}"}
        ) as response,
    ):
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"
        )
        lists = pushed(response)
        assert await anext(lists) == []  # at once: the tenant has no run yet
        await http.post(
            f"{base}/v1/runs", json=INLINE_OUTLIERS, headers={"Authorization": f"Bearer {others}"}
        )
        started = await http.post(
            f"{base}/v1/runs", json=INLINE_OUTLIERS, headers={"Authorization": f"Bearer {token}"}
        )
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]
        seen: list[tuple[str, int]] = []
        async with asyncio.timeout(60):
            async for runs in lists:
                assert [r["run_id"] for r in runs] == [run_id]  # never the other tenant's run
                seen.append((runs[0]["state"], runs[0]["last_seq"]))
                if seen[-1][0] == "completed":
                    break
        # pushed when the run moved, never the same list twice (a quick run may be seen only ended)
        assert seen[-1][0] == "completed" and all(a != b for a, b in itertools.pairwise(seen)), seen
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.get(f"{base}/v1/runs/changes")
        assert refused.status_code == 401
        bad = await http.get(f"{base}/v1/runs/changes?limit=0", headers={"Authorization": f"Bearer {token}"})
        assert bad.status_code == 400
