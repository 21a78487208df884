"""A producer outside the fleet, in another language: ``docs/examples/producer.mjs`` (Node, nats.js from
the npm registry) connects with the nkey ``fleet producers issue`` wrote, unchanged, and its event
starts a run in its own tenant; publishing as another tenant is refused by the bus."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from fleet.events import Event
from fleetctl.testing.e2e import Stack, fleet
from fleetctl.testing.node import installed, tool

pytestmark = pytest.mark.e2e

NATS_JS = "nats@2.29.3"
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "producer.mjs"


@pytest.fixture(scope="module")
def producer_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example beside a node_modules with nats.js, installed from the npm registry once."""
    target = installed(f"nats-js/{NATS_JS.rsplit('@', 1)[1]}", NATS_JS, marker="nats")
    script = target / "producer.mjs"  # beside its node_modules, so that `import "nats"` finds it
    shutil.copyfile(EXAMPLE, script)
    return script


def run_node(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("node"), str(script), *args], capture_output=True, text=True, timeout=60)


def issue(stack: Stack, tmp_path: Path, name: str) -> Path:
    seed = tmp_path / f"{name}.nk"
    result = fleet(
        "producers", "issue", name, "--tenant", "acme", "--source", "billing", "--out", str(seed),
        "--data-dir", stack.data_dir, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return seed


async def test_a_node_producer_with_issued_credentials_starts_a_run_in_its_tenant(
    stack: Stack, producer_script: Path, tmp_path: Path
) -> None:
    name = f"node-{uuid.uuid4().hex[:6]}"
    seed = issue(stack, tmp_path, name)
    event_id = f"node-{uuid.uuid4().hex[:8]}"
    subject = "fleet.events.acme.billing.invoices.closed"
    result = run_node(producer_script, stack.endpoints["nats"], str(seed), name, subject, event_id)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stream"] == "FLEET_EVENTS"
    event = Event("fleet.events.invoices.closed", event_id, "billing", "invoices.closed", "acme", "", {})
    token = stack.token("coordinator", "acme", ("agent:invoke", "runs:admin"))  # the trigger's run
    async with httpx.AsyncClient(timeout=10.0) as http, asyncio.timeout(60):
        while True:
            response = await http.get(
                f"{stack.endpoints['coordinator']}/v1/runs/{event.run_id()}",
                headers={"Authorization": f"Bearer {token}"},
            )
            if response.status_code == 200:
                break
            assert response.status_code == 404, response.text
            await asyncio.sleep(0.2)
    assert response.json()["tenant"] == "acme"


def test_a_node_producer_cannot_publish_as_another_tenant(
    stack: Stack, producer_script: Path, tmp_path: Path
) -> None:
    name = f"node-{uuid.uuid4().hex[:6]}"
    seed = issue(stack, tmp_path, name)
    subject = "fleet.events.globex.billing.invoices.closed"
    result = run_node(producer_script, stack.endpoints["nats"], str(seed), name, subject, "forged")
    assert result.returncode != 0
    assert "permissions violation" in (result.stderr + result.stdout).lower()
