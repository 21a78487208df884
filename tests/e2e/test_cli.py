"""The operator CLI against a real stack, run as a user runs it (a new process each time): output,
``--json`` documents, exit codes, and the debug bundle that explains a failed run."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleetctl.progress import CLEAR_LINE
from fleetctl.testing.e2e import TWO_STEPS, Stack, clean_env, first_event, fleet, send, user_message
from tests.e2e.a2a_helpers import SLOW_STEPS, start

pytestmark = pytest.mark.e2e

# A run that fails on purpose: the SQL tool takes only a SELECT, so the second step is refused.
WIPE_STEPS: dict[str, Any] = {
    "steps": [
        {"id": "totals", "skill": "invoice-totals"},
        {
            "id": "wipe",
            "skill": "sql-query",
            "input": {"sql": "DELETE FROM tenant_data.invoices"},
            "after": ["totals"],
        },
    ]
}
# The same failure after a second of work, so that a follower attaches while the run is going.
SLOW_WIPE: dict[str, Any] = {
    "steps": [
        {"id": "slow", "skill": "sql-query", "input": {"sql": "SELECT pg_sleep(1) IS NULL AS slept"}},
        {
            "id": "wipe",
            "skill": "sql-query",
            "input": {"sql": "DELETE FROM tenant_data.invoices"},
            "after": ["slow"],
        },
    ]
}


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return fleet(*args, "--data-dir", stack.data_dir, timeout=120)


async def acli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(cli, stack, *args)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_the_bundle_of_a_failed_run_explains_the_failure_without_re_running_it(
    stack: Stack, tmp_path: Path
) -> None:
    outcome = await send(stack, user_message(data=WIPE_STEPS), token=stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_FAILED"
    out = tmp_path / "bundle"
    result = await acli(stack, "runs", "export", outcome.task_id, str(out), "--tenant", "acme", "--json")
    assert result.returncode == 0, result.stderr
    exported = json.loads(result.stdout)
    assert (exported["run"]["state"], exported["run"]["reason"]) == ("failed", "specialist_failed")
    assert {"EXPLAIN.md", "events.jsonl", "operations.jsonl", "agents.json"} <= set(exported["files"])

    explain = (out / "EXPLAIN.md").read_text()
    assert explain.startswith(f"# Run {outcome.task_id}: failed (specialist_failed)")
    assert "- failed step: `wipe`" in explain
    assert "- skill: `sql-query`" in explain
    assert "- agent: `sql-analyst` (version `0.2.0` as registered now" in explain
    assert "- error code: `specialist_failed`" in explain
    assert "`specialist_failed` -> `tool_failed` -> `invalid_request`" in explain  # the cause, down
    assert "syntax error" in explain  # the database's own words
    assert "policy bundle revision in force at export: `local-1+" in explain
    assert "`run.failed`" in explain.split("## The last")[1]  # the events before the end
    assert "| wipe | sql-analyst | failed | 1 |" in explain  # the ledger, outcome by outcome
    assert "| totals | sql-analyst | succeeded | 1 |" in explain
    assert "## What to do next" in explain

    events = json_lines((out / "events.jsonl").read_text())
    assert events[-1]["type"] == "run.failed"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    operations = json_lines((out / "operations.jsonl").read_text())
    assert [(op["step_id"], op["status"]) for op in operations] == [
        ("totals", "succeeded"),
        ("wipe", "failed"),
    ]
    assert json.loads((out / "agents.json").read_text())["sql-analyst"]["version"] == "0.2.0"


async def test_runs_list_and_show_describe_a_failed_run_in_text_and_json(stack: Stack) -> None:
    outcome = await send(stack, user_message(data=WIPE_STEPS), token=stack.token("coordinator"))
    listing = await acli(stack, "runs", "list", "--tenant", "acme", "--state", "failed", "--json")
    assert listing.returncode == 0, listing.stderr
    runs = json.loads(listing.stdout)["runs"]
    assert outcome.task_id in {r["run_id"] for r in runs}
    assert {r["state"] for r in runs} == {"failed"}
    text = await acli(stack, "runs", "list", "--tenant", "acme", "--limit", "1")
    assert text.stdout.splitlines()[0].split() == ["RUN", "STATE", "REASON", "WAITING", "ON", "UPDATED"]
    assert len(text.stdout.splitlines()) == 2
    bad = await acli(stack, "runs", "list", "--tenant", "acme", "--state", "sleeping")
    assert bad.returncode == 2
    assert "state must be one of" in bad.stderr

    show = await acli(stack, "runs", "show", outcome.task_id, "--tenant", "acme", "--json")
    assert show.returncode == 0, show.stderr
    view = json.loads(show.stdout)
    assert (view["state"], view["reason"]) == ("failed", "specialist_failed")
    assert [(s["step"], s["agent"], s["status"]) for s in view["steps"]] == [
        ("totals", "sql-analyst", "completed"),
        ("wipe", "sql-analyst", "failed"),
    ]
    assert view["last_error"]["step"] == "wipe"
    assert view["last_error"]["code"] == "specialist_failed"
    assert [op["status"] for op in view["operations"]] == ["succeeded", "failed"]
    human = await acli(stack, "runs", "show", outcome.task_id, "--tenant", "acme")
    assert "last error  [specialist_failed]" in human.stdout


async def test_following_the_events_of_a_run_that_fails_ends_with_the_run_failed_exit_code(
    stack: Stack,
) -> None:
    token = stack.token("coordinator")
    task = await start(stack, token, user_message(data=SLOW_WIPE))
    follow = await acli(stack, "runs", "events", task.id, "--tenant", "acme", "--follow", "--json")
    assert follow.returncode == 7, follow.stderr  # the run ended failed
    events = json_lines(follow.stdout)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # JSON Lines, gap-free
    assert events[-1]["type"] == "run.failed"
    assert "step.completed" in [e["type"] for e in events]

    after = await acli(stack, "runs", "events", task.id, "--tenant", "acme", "--after", "3", "--json")
    document = json.loads(after.stdout)
    assert [e["seq"] for e in document["events"]] == [e["seq"] for e in events[3:]]
    assert (after.returncode, document["state"]) == (7, "failed")


async def test_following_a_run_that_completes_exits_0(stack: Stack) -> None:
    task = await start(stack, stack.token("coordinator"), user_message(data=TWO_STEPS))
    follow = await acli(stack, "runs", "events", task.id, "--tenant", "acme", "--follow")
    assert follow.returncode == 0, follow.stderr
    assert "run.completed" in follow.stdout.splitlines()[-1]


async def test_cancel_is_idempotent_and_the_canceled_run_ends_with_its_exit_code(stack: Stack) -> None:
    task = await start(stack, stack.token("coordinator"), user_message(data=SLOW_STEPS))
    first = await acli(stack, "runs", "cancel", task.id, "--tenant", "acme", "--reason", "test", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["applied"] is True
    watch = await acli(stack, "runs", "show", task.id, "--tenant", "acme", "--watch", "--json")
    assert watch.returncode == 8, watch.stderr  # the run ended canceled
    assert json.loads(watch.stdout)["state"] == "canceled"
    again = await acli(stack, "runs", "cancel", task.id, "--tenant", "acme", "--json")
    assert again.returncode == 0, again.stderr  # nothing new, and that is what was asked
    assert json.loads(again.stdout)["state"] == "canceled"
    follow = await acli(stack, "runs", "events", task.id, "--tenant", "acme", "--follow")
    assert follow.returncode == 8


async def test_cancelling_a_run_that_completed_is_a_no_op(stack: Stack) -> None:
    outcome = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator"))
    result = await acli(stack, "runs", "cancel", outcome.task_id, "--tenant", "acme")
    assert result.returncode == 4, result.stderr
    assert "nothing to cancel" in result.stdout


def test_unknown_run_and_agent_exit_with_the_not_found_code(stack: Stack) -> None:
    for args in (("agents", "show", "no-such-agent"), ("runs", "show", "no-such-run", "--tenant", "acme")):
        result = cli(stack, *args)
        assert result.returncode == 5, result.stderr
        assert result.stderr.startswith("fleet: ") and result.stderr.strip().endswith(
            "[not_found]"
        )  # for a person
        as_json = cli(stack, *args, "--json")
        assert as_json.returncode == 5
        assert as_json.stdout == ""
        error = json.loads(as_json.stderr)["error"]
        assert (error["code"], error["exit_code"]) == ("not_found", 5)


def test_agents_and_mcp_servers_are_listed_with_versions_skills_tools_and_health(stack: Stack) -> None:
    agents = cli(stack, "agents", "list", "--json")
    assert agents.returncode == 0, agents.stderr
    by_id = {a["id"]: a for a in json.loads(agents.stdout)["agents"]}
    assert by_id["sql-analyst"]["version"] == "0.2.0"
    assert "sql-query" in by_id["sql-analyst"]["skills"]
    assert by_id["sql-analyst"]["status"] == "healthy"
    assert by_id["sql-analyst"]["url"].startswith("http://127.0.0.1:")
    shown = json.loads(cli(stack, "agents", "show", "sql-analyst", "--json").stdout)
    assert shown["card"]["name"]
    servers = cli(stack, "mcp", "list", "--json")
    assert servers.returncode == 0, servers.stderr
    by_server = {s["id"]: s for s in json.loads(servers.stdout)["mcp_servers"]}
    assert "query" in by_server["mcp-sql"]["tools"]
    ours = {name: by_server[name]["health"] for name in stack.endpoints["mcp_servers"]}
    assert set(ours.values()) == {"up"}, ours
    # A server registered by hand while the stack runs (tests of other modules register some on this
    # shared stack) is listed too, with a health the stack cannot know.
    assert {s["health"] for name, s in by_server.items() if name not in ours} <= {"unknown"}
    text = cli(stack, "mcp", "list")
    assert text.stdout.splitlines()[0].split() == ["SERVER", "HEALTH", "ENDPOINT", "TOOLS"]


def test_a_command_without_a_running_stack_exits_3(tmp_path: Path) -> None:
    for args in (("runs", "list"), ("agents", "list"), ("mcp", "list"), ("runs", "cancel", "r")):
        result = fleet(*args, "--data-dir", str(tmp_path), "--json", timeout=60)
        assert result.returncode == 3, result.stderr
        assert json.loads(result.stderr)["error"]["code"] == "stack_not_running"


def test_bad_usage_exits_2(stack: Stack) -> None:
    assert cli(stack, "runs", "events").returncode == 2  # no run id
    bad_input = cli(stack, "approve", "some-run", "--input", "{not json")
    assert bad_input.returncode == 2
    assert bad_input.stderr.strip() == "fleet: --input must be JSON [invalid_request]"


def batch_plan(n: int) -> dict[str, Any]:
    """A batch step over ``n`` items, ten to a call, its progress recorded after every call."""
    return {
        "steps": [
            {
                "id": "review",
                "skill": "open-review-cases",
                "for_each": [{"label": f"cli-{i:04d}"} for i in range(n)],
                "items_as": "records",
                "input": {"label": "label", "reason": "cli progress"},
                "batch": {"call_size": 10, "checkpoint_every": 50},
            }
        ]
    }


def on_a_terminal(*args: str) -> tuple[int, str]:
    """Run the CLI with its stdout on a pseudo-terminal: its exit code and what it drew."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetctl", *args], stdout=secondary, stderr=subprocess.PIPE, env=clean_env()
    )
    os.close(secondary)
    drawn = bytearray()
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(primary)
    _, errors = process.communicate(timeout=120)
    return process.returncode, drawn.decode() + errors.decode()


async def test_a_batch_run_draws_one_progress_line_on_a_terminal_and_plain_lines_on_a_pipe(
    stack: Stack,
) -> None:
    task = await start(stack, stack.token("coordinator"), user_message(data=batch_plan(60)))
    args = ("runs", "events", task.id, "--tenant", "acme", "--follow", "--data-dir", stack.data_dir)
    code, drawn = await asyncio.to_thread(on_a_terminal, *args)
    assert code == 0, drawn
    assert CLEAR_LINE in drawn  # redrawn in place
    assert "review [" + "#" * 30 + "] 60/60 100%" in drawn
    assert "batch.progress" not in drawn  # the bar stands for those events
    piped = await acli(stack, "runs", "events", task.id, "--tenant", "acme")
    assert "\x1b[" not in piped.stdout
    assert sum("batch.progress" in line for line in piped.stdout.splitlines()) == 6


def test_a_policy_push_reports_where_it_is_enforced_as_json(stack: Stack) -> None:
    pushed = cli(stack, "policy", "push", "--note", "cli test: the installed bundle again", "--json")
    assert pushed.returncode == 0, pushed.stderr
    outcome = json.loads(pushed.stdout)
    assert (outcome["enforced"], outcome["behind"]) == (True, [])
    assert outcome["processes"] > 0
    status = json.loads(cli(stack, "policy", "status", "--json").stdout)
    assert status["pushed"] == outcome["revision"]


async def test_a_waiting_run_shows_what_it_waits_on_since_when_and_until_when(stack: Stack) -> None:
    token = stack.token("coordinator")
    task = await start(stack, token, user_message(data={"steps": [{"id": "nap", "wait": {"for_s": 3600}}]}))
    await first_event(stack, task.id, token, "run.waiting")
    listing = await acli(stack, "runs", "list", "--tenant", "acme", "--state", "waiting")
    line = next(line for line in listing.stdout.splitlines() if line.startswith(task.id))
    assert line.split()[1:4] == ["waiting", "timer", "timer:nap"]
    view = json.loads((await acli(stack, "runs", "show", task.id, "--tenant", "acme", "--json")).stdout)
    assert (view["wait"]["type"], view["wait"]["awaited"]) == ("timer", "timer:nap")
    assert view["wait"]["since"] < view["wait"]["deadline"]
    text = (await acli(stack, "runs", "show", task.id, "--tenant", "acme")).stdout
    assert (
        f"waiting  timer timer:nap since {view['wait']['since']} deadline {view['wait']['deadline']}" in text
    )
    # A parked run holds no process: a cancel ends it at once, and a follower sees it end canceled.
    assert (await acli(stack, "runs", "cancel", task.id, "--tenant", "acme")).returncode == 0
    assert (await acli(stack, "runs", "events", task.id, "--tenant", "acme", "--follow")).returncode == 8
