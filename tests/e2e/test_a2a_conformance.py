"""An outside check: a2a-proof (black-box A2A 1.0 contract tests) against the real coordinator.

The contract is ``tests/e2e/a2a-proof.yaml``: the card's capabilities, a plan through two
specialists, policy routing, following and reading back an accepted task, cancel, and a push to a
webhook that a2a-proof itself serves. a2a-proof runs as its own process, as an operator would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl.testing.e2e import Stack, clean_env

pytestmark = pytest.mark.e2e

CONTRACT = Path(__file__).with_name("a2a-proof.yaml")


def test_the_coordinator_passes_every_a2a_proof_scenario(stack: Stack, tmp_path: Path) -> None:
    report = tmp_path / "a2a-proof.json"
    env = clean_env(
        A2A_PROOF_AGENT_URL=stack.endpoints["coordinator"],
        A2A_PROOF_TOKEN=stack.token("coordinator", tenant="acme"),
    )
    proof = Path(sys.executable).with_name("a2a-proof")
    result = subprocess.run(
        [str(proof), "run", str(CONTRACT), "--format", "json", "--output", str(report), "--verbose"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert report.exists(), result.stderr
    suite = json.loads(report.read_text())
    outcomes = {s["name"]: (s["passed"], s["trials"]) for s in suite["scenarios"]}
    assert suite["card"]["passed"], suite["card"]
    assert len(outcomes) == 5
    assert all(passed for passed, _ in outcomes.values()), json.dumps(outcomes, indent=1)
    assert suite["passed"]
    assert result.returncode == 0, result.stderr
