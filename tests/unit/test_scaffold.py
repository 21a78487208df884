"""``fleet new``: each kind gives a module, its test and its manifest entry, and the tests it wrote
pass as they are (run here in the new project, as its author would run them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploy.manifest import load
from fleet.errors import FleetError
from fleetctl.scaffold import new


def fleet_new(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetctl", "new", *args, "--dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_new_specialist_server_and_workflow_are_a_manifest_and_tests_that_pass(tmp_path: Path) -> None:
    project = tmp_path / "support-desk"
    project.mkdir()
    for kind, name in (("specialist", "triage"), ("mcp-server", "tickets"), ("workflow", "handle-ticket")):
        made = fleet_new(project, kind, name)
        assert made.returncode == 0, made.stderr
    manifest = load(project / "fleet.toml")
    assert [(s.id, s.kind, s.entry) for s in manifest.services] == [
        ("triage", "specialist", "support_desk.triage:main"),
        ("mcp-tickets", "mcp_server", "support_desk.tickets:main"),
    ]
    assert manifest.workflows == (("handle-ticket", "support_desk.handle_ticket:build"),)
    tested = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert tested.returncode == 0 and "6 passed" in tested.stdout, tested.stdout + tested.stderr


def test_it_refuses_a_name_twice_a_bad_name_and_a_kind_it_does_not_make(tmp_path: Path) -> None:
    new("specialist", "triage", tmp_path)
    for kind, name, code in (
        ("specialist", "triage", "conflict"),
        ("specialist", "Triage!", "invalid_request"),
        ("gateway", "front", "invalid_request"),
    ):
        with pytest.raises(FleetError) as refused:
            new(kind, name, tmp_path)
        assert refused.value.code == code, (kind, name)


def test_a_project_folder_named_like_a_platform_package_gets_a_package_that_is_not(tmp_path: Path) -> None:
    project = tmp_path / "memory"
    project.mkdir()
    written = new("mcp-server", "notes", project)
    assert project / "my_memory" / "notes.py" in written
    assert load(project / "fleet.toml").services[0].id == "mcp-notes"
