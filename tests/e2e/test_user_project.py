"""A user's own fleet, outside this repository: a specialist and an MCP server, each one file plus
one manifest entry, and policy of the project's own. ``fleet up`` (run in the project's folder, as a
user would) brings them up beside the platform's core, a plan runs through them, and ``fleet deploy
render`` derives compose and Kubernetes files that pass the same offline validation as the
platform's own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetctl.layout import StackLayout
from fleetctl.testing.e2e import STACK_START_TIMEOUT_S, Stack, clean_env, send, user_message
from tests.deploy._files import compose_errors, validate

pytestmark = pytest.mark.e2e

MANIFEST = """\
[fleet]
name = "support-desk"
policy = "policy"

[[specialists]]
id = "triage"
entry = "support_desk.triage:main"
skills = ["triage-ticket"]
scopes = ["tickets:write"]
calls = ["mcp-tickets"]

[[mcp_servers]]
id = "mcp-tickets"
entry = "support_desk.tickets:main"
resources = { memory_limit = "768Mi" }
"""

TICKETS = '''\
"""The support desk's tickets: an MCP server of the fleet, declared tool by tool."""

from typing import Any

from fleet.settings import ServiceSettings
from mcp_servers.kit import KEYED_WRITE, ToolCall, ToolServer

server = ToolServer("tickets", instructions="The support desk's tickets.")
TICKETS: dict[tuple[str, str], dict[str, Any]] = {}


@server.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
async def open_ticket(call: ToolCall, operation_id: str, title: str, priority: str) -> dict[str, Any]:
    """Open a ticket, once per operation id."""
    key = (call.tenant, operation_id)
    created = key not in TICKETS
    if created:
        TICKETS[key] = {"ticket": f"T-{len(TICKETS) + 1}", "title": title, "priority": priority}
    return {**TICKETS[key], "created": created, "tenant": call.tenant}


@server.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
async def close_ticket(call: ToolCall, ticket: str) -> dict[str, Any]:
    """Close a ticket (the project's policy asks for more than this declaration)."""
    return {"closed": ticket}


async def main(settings: ServiceSettings) -> None:
    await server.serve(settings)
'''

TRIAGE = '''\
"""Triage: reads a customer's message, decides its priority, opens a ticket."""

from typing import Any

from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, serve_specialist

URGENT = ("down", "outage", "refund", "urgent")


async def triage(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    text = str(payload.get("message", ""))
    priority = "high" if any(word in text.lower() for word in URGENT) else "normal"
    await ctx.progress(f"priority {priority}")
    if payload.get("close"):
        return await ctx.tools.call(
            "mcp-tickets", "close_ticket", {"ticket": payload["close"]}, tenant=ctx.tenant, scopes=["tickets:write"]
        )
    ticket = await ctx.tools.call(
        "mcp-tickets",
        "open_ticket",
        {"operation_id": ctx.idempotency_key("ticket"), "title": text[:80], "priority": priority},
        tenant=ctx.tenant,
        scopes=["tickets:write"],
    )
    return {"priority": priority, "ticket": ticket}


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(
        settings,
        name="Triage",
        description="Reads a customer's message and opens a ticket at the right priority.",
        version="0.1.0",
        skills=[Skill("triage-ticket", "Triage", "Input: {message}.", triage, idempotent=True)],
    )
'''

# The project's policy: closing a ticket needs a scope the triage agent does not have.
POLICY = {"config": {"tools": {"mcp-tickets": {
    "open_ticket": {"scopes": ["tickets:write"]},
    "close_ticket": {"scopes": ["tickets:write", "tickets:admin"]},
}}}}  # fmt: skip


def make_project(root: Path) -> Path:
    package = root / "support_desk"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tickets.py").write_text(TICKETS)
    (package / "triage.py").write_text(TRIAGE)
    (root / "policy").mkdir()
    (root / "policy" / "data.json").write_text(json.dumps(POLICY))
    (root / "fleet.toml").write_text(MANIFEST)
    return root


def fleet_in(
    project: Path, *args: str, timeout: float = STACK_START_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """The ``fleet`` CLI run in the project's folder, as its user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "fleetctl", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
        env=clean_env(),
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_project(tmp_path_factory.mktemp("support-desk"))


@pytest.fixture(scope="module")
def project_stack(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("support-stack")
    up = fleet_in(project, "up", "--detach", "--data-dir", str(data_dir))
    assert up.returncode == 0, f"fleet up failed:\n{up.stdout}\n{up.stderr}"
    # a line per tier as it comes up, the project's servers and then its specialists among them
    assert "fleet: mcp-memory, mcp-tickets ready" in up.stderr and "fleet: triage ready" in up.stderr, up.stderr
    stack = Stack(StackLayout.at(data_dir))
    stack.reload()
    try:
        yield stack
    finally:
        down = fleet_in(project, "down", "--data-dir", str(data_dir), timeout=90)
        assert down.returncode == 0, down.stderr


async def test_a_plan_runs_through_the_project_s_specialist_and_tool_server(project_stack: Stack) -> None:
    endpoints = project_stack.endpoints
    assert set(endpoints["specialists"]) == {"triage"}  # the platform's demo agents stay out
    assert set(endpoints["mcp_servers"]) == {"mcp-memory", "mcp-tickets"}
    plan = {"steps": [{"id": "triage", "skill": "triage-ticket", "input": {"message": "Checkout is down!"}}]}
    outcome = await send(project_stack, user_message(data=plan), token=project_stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    answer = outcome.result["steps"]["triage"]
    assert answer["priority"] == "high"
    assert answer["ticket"]["created"] and answer["ticket"]["tenant"] == "acme"
    assert answer["ticket"]["ticket"].startswith("T-")
    assert "triage: priority high" in outcome.progress


async def test_the_project_s_policy_governs_its_tools(project_stack: Stack) -> None:
    plan = {
        "steps": [{"id": "close", "skill": "triage-ticket", "input": {"message": "thanks", "close": "T-1"}}]
    }
    outcome = await send(project_stack, user_message(data=plan), token=project_stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_FAILED", outcome.final_text
    assert "policy_denied" in outcome.codes  # the tool's own declaration alone would have allowed it
    assert outcome.error is not None and "tickets:admin" in str([e.message for e in outcome.error.chain()])


def test_a_broken_manifest_is_refused_before_anything_starts(project: Path, tmp_path: Path) -> None:
    broken = tmp_path / "fleet.toml"
    broken.write_text(MANIFEST.replace("support_desk.triage:main", "support_desk.triage_agent:main"))
    result = fleet_in(project, "up", "--manifest", str(broken), "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2, result.stderr
    assert f"{broken}:7: no module support_desk.triage_agent" in result.stderr
    assert "manifest_invalid" in result.stderr
    assert not (tmp_path / "data").exists()  # nothing started, nothing written


def test_compose_and_kubernetes_for_the_project_pass_the_offline_validation(project: Path) -> None:
    rendered = fleet_in(project, "deploy", "render", timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    deploy = project / "deploy"
    compose: dict[str, Any] = yaml.safe_load((deploy / "compose.yaml").read_text())
    assert compose_errors(compose) == []
    services = compose["services"]
    assert {"triage", "mcp-tickets", "coordinator", "mcp-memory"} <= set(services)
    assert "sql-analyst" not in services
    assert services["triage"]["image"] == "support-desk:dev"
    docs = [
        doc
        for path in sorted((deploy / "k8s").glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    for doc in docs:
        validate(doc)
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    egress = policies["triage"]["spec"]["egress"]
    assert any(peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == "mcp-tickets"
               for rule in egress for peer in rule.get("to", []))  # fmt: skip
    assert not any("ipBlock" in peer for rule in egress for peer in rule.get("to", []))  # no internet
    tickets = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "mcp-tickets")
    assert tickets["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "768Mi"
    dockerfile = (deploy / "Dockerfile").read_text()
    assert "FROM agent-fleet:dev" in dockerfile and "FLEET_MANIFEST=/srv/project/fleet.toml" in dockerfile
    bundle = json.loads((deploy / "policy-bundle" / "data.json").read_text())
    assert bundle["config"]["tools"]["mcp-tickets"]["close_ticket"]["scopes"] == [
        "tickets:write",
        "tickets:admin",
    ]
    assert fleet_in(project, "deploy", "render", "--check", timeout=120).returncode == 0
