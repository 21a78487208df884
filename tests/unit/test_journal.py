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
