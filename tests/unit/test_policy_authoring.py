"""What a policy author uses beside ``fleet policy test``, run as the CLI they type: ``fleet policy
eval`` with a rule path or any Rego query, and ``fleet policy fmt``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl.testing.e2e import clean_env
from policy import DEFAULT_BUNDLE_DIR
from policy.formatting import format_module

CALL = {
    "tenant": "acme",
    "server": "mcp-sql",
    "tool": "query",
    "caller": {"sub": "sql-analyst", "scopes": ["sql:query"], "actors": []},
    "arguments": {"sql_length": 40},
}


def fleet(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=cwd,
        check=False,
    )


@pytest.fixture
def input_file(tmp_path: Path) -> Path:
    path = tmp_path / "input.json"
    path.write_text(json.dumps(CALL))
    return path


def test_eval_gives_a_rule_s_value(input_file: Path) -> None:
    done = fleet("policy", "eval", "data.fleet.tools.decision", "--input", str(input_file))
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert set(answer["result"]) >= {"allow", "reasons"} and answer["revision"]


def test_eval_gives_a_whole_query_s_results_with_their_bindings(input_file: Path) -> None:
    query = "d := data.fleet.tools.decision; n := count(d.reasons); t := input.tenant"
    done = fleet("policy", "eval", query, "--input", str(input_file))
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["query"] == query and len(answer["results"]) == 1
    bindings = answer["results"][0]["bindings"]
    assert bindings["t"] == "acme" and bindings["n"] == len(bindings["d"]["reasons"])
    assert [e["text"] for e in answer["results"][0]["expressions"]] == [s.strip() for s in query.split(";")]


def test_a_query_that_does_not_parse_is_the_askers_mistake_not_the_policy_s(input_file: Path) -> None:
    done = fleet("policy", "eval", "d := := data.fleet", "--input", str(input_file))
    assert done.returncode == 2  # a usage error, not "policy unavailable" (1)
    assert "[policy_query_invalid]" in done.stderr and "<query.rego>:1:" in done.stderr
    assert "policy_unavailable" not in done.stderr


def test_fmt_lays_out_a_bundle_and_check_says_what_would_change(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    messy = bundle / "messy.rego"
    messy.write_text("\n\npackage messy   \n\n\n\nallow if {\n    input.a == 1  \n  \tinput.b == 2\n}\n\n\n")
    checked = fleet("policy", "fmt", str(bundle), "--check", "--json")
    assert checked.returncode == 1, checked.stderr
    assert json.loads(checked.stdout)["changed"] == ["messy.rego"]
    assert messy.read_text().startswith("\n\npackage messy   ")  # --check wrote nothing
    done = fleet("policy", "fmt", str(bundle))
    assert done.returncode == 0, done.stderr
    # two spaces and a tab: six columns, one tab and two spaces
    assert messy.read_text() == "package messy\n\nallow if {\n\tinput.a == 1\n\t  input.b == 2\n}\n"
    assert fleet("policy", "fmt", str(bundle), "--check").returncode == 0


def test_fmt_never_changes_what_a_module_says() -> None:
    """Reindenting a raw string that spans lines would change its value: the module is kept."""
    text = "package x\n\nnote := `a\n    b`  \n"
    kept = format_module("x.rego", text)
    assert kept.kept and kept.text == text
    plain = format_module("y.rego", "package y\n\n\n\nallow if {\n    input.a\n}")
    assert not plain.kept and plain.text == "package y\n\nallow if {\n\tinput.a\n}\n"


def test_the_project_s_own_bundle_is_formatted() -> None:
    done = fleet("policy", "fmt", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
