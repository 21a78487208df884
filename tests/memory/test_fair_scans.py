"""The scan pool shared fairly between tenants, in process: the real scanner, the real policy engine on
the installed bundle (quotas from ``config.limits.fair.memory_scan``), Qdrant's embedded engine."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import ErrorCode, FleetError
from memory.embeddings import LocalMiniLM
from memory.gate import Caller, Memory, Write
from memory.scan import Scanner
from memory.store import EdgeStore
from policy import Bundle, RegorusEngine

ACME, GLOBEX = Caller("acme", "research"), Caller("globex", "research")


@pytest.fixture(scope="module")
def embedder() -> LocalMiniLM:
    model = LocalMiniLM()
    model.load()
    return model


def engine(**tenants: dict[str, Any]) -> RegorusEngine:
    """The installed bundle, with these tenants' scan quotas."""
    bundle = Bundle.load()
    config = dict(bundle.data["config"])
    scan = config["limits"]["fair"]["memory_scan"]
    config["limits"] = {"fair": {"memory_scan": {**scan, "tenants": tenants}}}
    return RegorusEngine(dataclasses.replace(bundle, data={**bundle.data, "config": config}))


class Gated(Scanner):
    """The real scanner, which waits for ``release`` on texts that say "hold", and records the order
    in which it takes texts."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.order: list[str] = []

    def scan(self, text: str) -> list[Any]:
        self.order.append(text)
        if "hold" in text:
            self.release.wait(30)
        return super().scan(text)


@pytest.fixture
async def store(tmp_path: Path, embedder: LocalMiniLM) -> AsyncIterator[EdgeStore]:
    store = EdgeStore(tmp_path / "vectors")
    await store.open(embedder.dim)
    try:
        yield store
    finally:
        await store.close()


def memory(store: EdgeStore, embedder: LocalMiniLM, policy: RegorusEngine, **kwargs: Any) -> Memory:
    return Memory(store, embedder, policy, kwargs.pop("scanner", Scanner()), lambda _: None, **kwargs)


async def test_a_tenant_over_its_own_scan_quota_is_refused_and_another_tenant_is_not(
    store: EdgeStore, embedder: LocalMiniLM
) -> None:
    scanner = Gated()
    gate = memory(store, embedder, engine(acme={"max_queued_texts": 3}), scanner=scanner, scan_timeout_s=30)
    first = asyncio.create_task(gate.remember(ACME, [Write("episodic", f"hold note {i}") for i in range(3)]))
    await until(lambda: scanner.order)  # its scan thread holds acme's three texts
    with pytest.raises(FleetError) as refused:
        await gate.remember(ACME, [Write("episodic", "one note more")])
    assert refused.value.code == ErrorCode.QUOTA_EXCEEDED and refused.value.retryable
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    [other] = await gate.remember(GLOBEX, [Write("episodic", "a note of another tenant")])
    assert other.status == "stored"
    scanner.release.set()
    assert [o.status for o in await first] == ["stored"] * 3
    [again] = await gate.remember(ACME, [Write("episodic", "one note more")])  # its quota is free again
    assert again.status == "stored"


async def test_a_call_over_its_character_budget_is_refused_whole(
    store: EdgeStore, embedder: LocalMiniLM
) -> None:
    gate = memory(store, embedder, engine(acme={"max_call_chars": 1000}))
    with pytest.raises(FleetError) as refused:
        await gate.remember(ACME, [Write("episodic", "x" * 600), Write("episodic", "y" * 600)])
    assert refused.value.code == ErrorCode.TOO_LARGE
    assert await store.count("acme") == 0
    [fits] = await gate.remember(ACME, [Write("episodic", "a note of " + "z" * 900)])
    assert fits.status == "stored"


@pytest.mark.parametrize(("weight", "expected"), [(1, "agaa"), (2, "aaga")])
async def test_scan_jobs_of_tenants_are_taken_in_turn_by_weight(
    store: EdgeStore, embedder: LocalMiniLM, weight: int, expected: str
) -> None:
    scanner = Gated()
    gate = memory(
        store, embedder, engine(acme={"weight": weight}), scanner=scanner, scan_threads=1, scan_timeout_s=30
    )
    held = asyncio.create_task(gate.remember(Caller("initech", "x"), [Write("episodic", "hold it")]))
    await until(lambda: scanner.order)  # the only scan thread holds initech's text
    calls = [asyncio.create_task(gate.remember(ACME, [Write("episodic", f"a note {i}")])) for i in range(3)]
    await until(lambda: sum(len(q) for q in gate._scanning._queues.values()) == 3)
    calls.append(asyncio.create_task(gate.remember(GLOBEX, [Write("episodic", "g note")])))
    await until(lambda: sum(len(q) for q in gate._scanning._queues.values()) == 4)
    scanner.release.set()
    for call in (held, *calls):
        assert [o.status for o in await call] == ["stored"]
    # First come, first served would be "aaag": globex would wait for every text of acme.
    assert "".join(text[0] for text in scanner.order[1:]) == expected


async def until(check: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)
