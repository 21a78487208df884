"""A specialist's operation journal: durable across restarts, per tenant, and honest about runs
that a crash cut short."""

from __future__ import annotations

import asyncio
from pathlib import Path

from specialists.journal import Journal, JournalStatus


def test_an_operation_running_when_the_process_died_is_interrupted_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "operations.sqlite"
    first = Journal(path)
    first.begin("acme", "op-1", "skill", "h1")
    first.begin("acme", "op-2", "skill", "h2")
    first.finish("acme", "op-2", JournalStatus.SUCCEEDED, result={"n": 1})
    assert first.get("acme", "op-1").status == JournalStatus.RUNNING
    first.close()  # the process dies here

    second = Journal(path)
    assert second.get("acme", "op-1").status == JournalStatus.INTERRUPTED
    done = second.get("acme", "op-2")
    assert (done.status, done.result, done.args_hash) == (JournalStatus.SUCCEEDED, {"n": 1}, "h2")
    assert second.get("acme", "op-3").status == JournalStatus.UNKNOWN


def test_one_tenant_never_sees_another_tenants_operation(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "operations.sqlite")
    journal.begin("acme", "op-1", "skill", "h")
    journal.finish("acme", "op-1", JournalStatus.SUCCEEDED, result={})
    assert journal.get("globex", "op-1").status == JournalStatus.UNKNOWN


async def test_a_waiter_wakes_when_the_operation_finishes(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "operations.sqlite")
    journal.begin("acme", "op-1", "skill", "h")
    waiting = asyncio.create_task(journal.wait("acme", "op-1", timeout_s=30))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    journal.finish("acme", "op-1", JournalStatus.FAILED, error={"code": "x", "message": "no"})
    entry = await asyncio.wait_for(waiting, 5)
    assert (entry.status, entry.error) == (JournalStatus.FAILED, {"code": "x", "message": "no"})
    # Nothing runs: a wait answers at once.
    assert (
        await asyncio.wait_for(journal.wait("acme", "op-9", timeout_s=30), 1)
    ).status == JournalStatus.UNKNOWN


def test_pruning_forgets_finished_entries_only(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "operations.sqlite")
    journal.begin("acme", "done", "skill", "h")
    journal.finish("acme", "done", JournalStatus.SUCCEEDED, result={})
    journal.begin("acme", "busy", "skill", "h")
    assert journal.prune(older_than_s=-1) == 1
    assert journal.get("acme", "done").status == JournalStatus.UNKNOWN
    assert journal.get("acme", "busy").status == JournalStatus.RUNNING


def test_an_operation_canceled_before_it_arrived_is_refused_when_it_comes(tmp_path: Path) -> None:
    path = tmp_path / "operations.sqlite"
    first = Journal(path)
    tombstone = first.cancel_unreceived("acme", "op-1")
    assert (tombstone.status, tombstone.received) == (JournalStatus.CANCELED, False)
    assert tombstone.error is not None
    assert (tombstone.error["code"], tombstone.error["tool_calls"]) == ("canceled", 0)
    first.close()  # the refusal is durable: it holds for a request that comes after a restart

    second = Journal(path)
    assert second.begin("acme", "op-1", "skill", "h1") is False
    entry = second.get("acme", "op-1")
    assert (entry.status, entry.args_hash, entry.error) == (JournalStatus.CANCELED, "", tombstone.error)
    # The tombstone is per tenant: another tenant's operation of the same id runs.
    assert second.begin("globex", "op-1", "skill", "h1") is True


def test_canceling_an_operation_the_journal_knows_leaves_its_entry_as_it_is(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "operations.sqlite")
    journal.begin("acme", "done", "skill", "h")
    journal.finish("acme", "done", JournalStatus.SUCCEEDED, result={"n": 1})
    journal.begin("acme", "busy", "skill", "h")

    done = journal.cancel_unreceived("acme", "done")
    assert (done.status, done.result, done.received) == (JournalStatus.SUCCEEDED, {"n": 1}, True)
    assert journal.cancel_unreceived("acme", "busy").status == JournalStatus.RUNNING


def test_an_operation_canceled_while_it_ran_never_runs_again(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "operations.sqlite")
    assert journal.begin("acme", "op-1", "skill", "h") is True
    error = {"code": "canceled", "message": "canceled after 2 tool calls completed", "tool_calls": 2}
    journal.finish("acme", "op-1", JournalStatus.CANCELED, error=error)
    assert journal.begin("acme", "op-1", "skill", "h") is False
    entry = journal.get("acme", "op-1")
    assert (entry.status, entry.error, entry.received) == (JournalStatus.CANCELED, error, True)
