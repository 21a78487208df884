"""The operator console in a real browser (Debian's Chromium, driven by Playwright) against the real
stack: a person signs in with the link ``fleet console`` prints, finds a paused run in *Needs your
input*, approves it on its page, and sees it move to *Completed*. Around that, what the console must
refuse: a sign-in link used twice, a request without a session, a change from another page, and an
approval by a person who signed in without the right to approve.

``FLEET_CONSOLE_SCREENSHOTS=<dir>`` keeps the screenshots the test takes (the docs' come from here).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import Browser, Page, expect

from fleetctl.testing.e2e import TWO_STEPS, Stack, send, user_message
from fleetctl.testing.mcp import call, error_in
from tests.e2e.a2a_helpers import fresh_tenant
from tests.e2e.browser import launched, sign_in_link, signed_in
from tests.e2e.run_helpers import paused_at_gate, run_when

pytestmark = pytest.mark.e2e

SEEN_WITHIN_MS = 60_000


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with launched() as running:
        yield running


def screenshots_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("FLEET_CONSOLE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def screenshot(page: Page, name: str, tmp_path: Path) -> None:
    path = screenshots_dir(tmp_path) / f"console-{name}.png"
    await page.screenshot(path=str(path), full_page=True)


async def test_an_operator_approves_a_paused_run_in_the_browser_and_sees_it_completed(
    stack: Stack, browser: Browser, tmp_path: Path
) -> None:
    tenant = fresh_tenant()
    run_id = await paused_at_gate(stack, tenant, stack.token("coordinator", tenant=tenant))
    link = await asyncio.to_thread(sign_in_link, stack, tenant)

    page = await browser.new_page(viewport={"width": 1400, "height": 900})
    polled: list[str] = []  # the lanes are pushed over a stream, never listed again by a timer
    page.on("request", lambda r: polled.append(r.url) if urlsplit(r.url).path == "/api/runs" else None)
    await page.goto(link)
    await page.wait_for_url(f"{stack.endpoints['console']}/")
    await expect(page.locator("#who")).to_have_text(f"operator @ {tenant}")
    waiting = page.locator(f'[data-lane="input"] [data-run-id="{run_id}"]')
    await expect(waiting).to_be_visible(timeout=SEEN_WITHIN_MS)
    await expect(waiting).to_contain_text("approval")
    await screenshot(page, "lanes-waiting", tmp_path)

    await waiting.click()
    await expect(page.locator('[data-testid="wait"]')).to_contain_text("approval:refund:0")
    await expect(page.locator('[data-testid="timeline"] li').first).to_be_visible()
    # The plan as a graph, its gated step waiting at the gate.
    step = page.locator('[data-testid="plan-graph"] [data-step="refund"]')
    await expect(step).to_have_attribute("data-state", "waiting", timeout=SEEN_WITHIN_MS)
    await screenshot(page, "run-waiting", tmp_path)
    await page.get_by_role("button", name="Approve").click()
    await expect(page.locator('[data-testid="signal-status"]')).to_have_text("approve: applied")
    await expect(page.locator(".run-head [data-testid=run-state]")).to_have_text(
        "completed", timeout=SEEN_WITHIN_MS
    )
    await expect(page.locator('[data-testid="timeline"]')).to_contain_text("run.completed")
    # The graph moved with the run, live: the step is done, with the agent that did it.
    await expect(step).to_have_attribute("data-state", "completed", timeout=SEEN_WITHIN_MS)
    await expect(step).to_contain_text("case-desk")
    await screenshot(page, "run-completed", tmp_path)

    await page.goto(f"{stack.endpoints['console']}/#/")
    done = page.locator(f'[data-lane="completed"] [data-run-id="{run_id}"]')
    await expect(done).to_be_visible(timeout=SEEN_WITHIN_MS)
    await expect(page.locator(f'[data-lane="input"] [data-run-id="{run_id}"]')).to_have_count(0)
    await screenshot(page, "lanes-completed", tmp_path)
    assert polled == [], polled

    # The approval is the person's, made through the console: the coordinator recorded the signer
    # as the operator, acting through the console.
    token = stack.token("coordinator", tenant=tenant)
    run = await run_when(stack, run_id, token, "completed")
    assert run["state"] == "completed"
    async with httpx.AsyncClient(timeout=30) as http:
        signals = (
            await http.get(
                f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/signals",
                headers={"Authorization": f"Bearer {token}"},
            )
        ).json()["signals"]
    applied = [s for s in signals if s["action"] == "approve" and s["outcome"] == "applied"]
    assert len(applied) == 1 and applied[0]["signer"] == "operator", signals


async def test_the_fleet_pages_show_agents_mcp_servers_policy_and_memory(
    stack: Stack, browser: Browser, tmp_path: Path
) -> None:
    page = await signed_in(stack, browser, fresh_tenant())
    base = stack.endpoints["console"]

    await page.goto(f"{base}/#/agents")
    for agent in stack.endpoints["specialists"]:
        await expect(page.locator("main table")).to_contain_text(agent)
    # The fleet as a picture: every specialist with the registry's word on its health, every MCP server.
    picture = page.locator('[data-testid="fleet-graph"]')
    for agent in stack.endpoints["specialists"]:
        await expect(picture.locator(f'[data-agent="{agent}"]')).to_have_attribute("data-status", "healthy")
    for server in stack.endpoints["mcp_servers"]:
        await expect(picture.locator(f'[data-mcp="{server}"]')).to_be_visible()
    await screenshot(page, "agents", tmp_path)
    await page.goto(f"{base}/#/mcp")
    for server in stack.endpoints["mcp_servers"]:
        await expect(page.locator("main table")).to_contain_text(server)
    await page.goto(f"{base}/#/policy")
    await expect(page.locator('[data-testid="policy-revision"]')).to_contain_text("revision")
    await expect(page.locator("main")).to_contain_text("fleet/tokens/decision")
    await screenshot(page, "policy", tmp_path)
    await page.goto(f"{base}/#/memory")
    await expect(page.locator("main h2")).to_have_text("Memory audit")


async def legend_value(page: Page, chart: str, series: str) -> float:
    """What a chart's legend says of ``series`` (its latest value or its window's total), 0 if none."""
    item = page.locator(f'[data-testid="{chart}"] [data-series="{series}"]')
    if await item.count() == 0:
        return 0.0
    return float(await item.get_attribute("data-value") or 0)


async def shows_at_least(page: Page, chart: str, series: str, wanted: float) -> None:
    """Wait until the chart's legend shows at least ``wanted`` for ``series`` (the page redraws
    itself every few seconds)."""
    await page.wait_for_function(
        """([chart, series, wanted]) => {
            const item = document.querySelector(`[data-testid="${chart}"] [data-series="${series}"]`);
            return item !== null && Number(item.dataset.value || 0) >= wanted;
        }""",
        arg=[chart, series, wanted],
        timeout=SEEN_WITHIN_MS,
    )


async def test_the_activity_charts_show_the_runs_the_test_made(
    stack: Stack, browser: Browser, tmp_path: Path
) -> None:
    page = await signed_in(stack, browser, fresh_tenant(), height=1100)
    await page.goto(f"{stack.endpoints['console']}/#/activity/15m")
    await expect(page.locator('[data-testid="chart-runs"] svg.plot')).to_be_visible(timeout=SEEN_WITHIN_MS)
    completed = await legend_value(page, "chart-runs", "completed")
    started = await legend_value(page, "chart-starts", "started")
    calls = await legend_value(page, "chart-tool-calls", "calls")
    denied = await legend_value(page, "chart-policy", "deny")

    made = 3
    token = stack.token("coordinator", tenant="acme")  # a tenant with invoices to total
    for _ in range(made):
        outcome = await send(stack, user_message(data=TWO_STEPS), token=token)
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    # And a tool call that policy refuses: a token without the tool's scope.
    unscoped = stack.token("mcp-sql", tenant="acme", scopes=())
    refused = error_in(await call(stack, "mcp-sql", unscoped, "query", {"sql": "SELECT 1"}))
    assert refused.code == "policy_denied"

    # The charts move by at least what this test did (the shared stack may be doing more meanwhile):
    # the runs it made, now completed and started by a worker, their tool calls (the totals step
    # queries the SQL server) and the refusal.
    await shows_at_least(page, "chart-runs", "completed", completed + made)
    await shows_at_least(page, "chart-starts", "started", started + made)
    await shows_at_least(page, "chart-tool-calls", "calls", calls + made)
    await shows_at_least(page, "chart-policy", "deny", denied + 1)
    latency = page.locator('[data-testid="chart-tools"] [data-series="p95_s"]')
    assert float(await latency.get_attribute("data-value") or 0) > 0
    await expect(page.locator('[data-testid="chart-tools"] path.series')).not_to_have_count(0)
    await screenshot(page, "activity", tmp_path)


async def sign_in(http: httpx.AsyncClient, base: str, token: str) -> httpx.Response:
    return await http.post(
        f"{base}/session", headers={"authorization": f"Bearer {token}", "x-fleet-console": "1"}
    )


async def test_a_sign_in_link_works_once_and_nothing_is_served_without_a_session(stack: Stack) -> None:
    base, tenant = stack.endpoints["console"], fresh_tenant()
    link = await asyncio.to_thread(sign_in_link, stack, tenant)
    token = link.split("#token=", 1)[1]
    async with httpx.AsyncClient(timeout=30) as anonymous:
        refused = await anonymous.get(f"{base}/api/runs")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated"
        page = await anonymous.get(f"{base}/")
        assert "default-src 'self'" in page.headers["content-security-policy"]
    async with httpx.AsyncClient(timeout=30) as http:
        first = await sign_in(http, base, token)
        assert first.status_code == 200, first.text
        cookie = first.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert (await http.get(f"{base}/api/runs")).status_code == 200
        async with httpx.AsyncClient(timeout=30) as other:
            again = await sign_in(other, base, token)
        assert again.status_code == 401 and again.json()["error"]["code"] == "unauthenticated"
        # A change without the console page's header (a form posted from another site) is refused
        # before it reaches the coordinator.
        forged = await http.post(f"{base}/api/runs/any/signals", json={"action": "cancel"})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "forbidden"
        elsewhere = await http.post(
            f"{base}/api/runs/any/signals",
            json={"action": "cancel"},
            headers={"x-fleet-console": "1", "origin": "http://evil.example"},
        )
        assert elsewhere.status_code == 403
        # Nothing but the run API's and the registry's own routes reaches a backend: a dot segment
        # (which an HTTP client would resolve into another route) is refused.
        for sneaky in (
            "/api/agents/%2e%2e/records",
            "/api/runs/%2e%2e/operations",
            "/api/agents/..%2Frecords",
        ):
            answer = await http.get(base + sneaky)
            assert answer.status_code in (400, 404) and "identities" not in answer.text, (sneaky, answer.text)
        # Signing out ends the session everywhere, not only in this browser: a copy of the cookie
        # is refused from then on.
        copied = dict(http.cookies)
        out = await http.post(f"{base}/session/end", headers={"x-fleet-console": "1"})
        assert out.status_code == 200
        async with httpx.AsyncClient(timeout=30, cookies=copied) as replay:
            after = await replay.get(f"{base}/api/runs")
        assert after.status_code == 401 and "signed out" in after.json()["error"]["message"]


async def test_a_person_signed_in_without_the_right_to_approve_cannot_approve_from_the_console(
    stack: Stack,
) -> None:
    base, tenant = stack.endpoints["console"], fresh_tenant()
    run_id = await paused_at_gate(stack, tenant, stack.token("coordinator", tenant=tenant))
    viewer = stack.token("console", tenant=tenant, scopes=("agent:invoke", "registry:read"))
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await sign_in(http, base, viewer)).status_code == 200
        listed = (await http.get(f"{base}/api/runs")).json()["runs"]
        assert [r["run_id"] for r in listed] == [run_id]  # the tenant's runs, and only those
        approve = await http.post(
            f"{base}/api/runs/{run_id}/signals",
            json={"action": "approve"},
            headers={"x-fleet-console": "1"},
        )
        assert approve.status_code == 403, approve.text
        assert "runs:approve" in approve.json()["error"]["message"]
    reader = stack.token("console", tenant=tenant, scopes=("agent:invoke",))
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await sign_in(http, base, reader)).status_code == 200
        assert (await http.get(f"{base}/api/memory/audit")).status_code == 200
        fleet_wide = await http.get(f"{base}/api/policy")  # the fleet's records need registry:read
        assert fleet_wide.status_code == 403 and "registry:read" in fleet_wide.json()["error"]["message"]
    run = await run_when(
        stack, run_id, stack.token("coordinator", tenant=tenant), "waiting", "input-required"
    )
    assert run["wait"]["type"] == "approval"  # still waiting: nothing was answered
