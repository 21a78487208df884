"""The vector store's contract, on both backends: Qdrant's embedded engine, and ``qdrant-client``
(here in its local mode: the same client calls the fleet makes of a Qdrant server, which cannot run on
this machine). Every call is confined to one tenant."""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleet.errors import ErrorCode, FleetError
from memory.store import EdgeStore, Entry, QdrantServerStore, VectorStore, Where

DIM = 16


def vector(seed: int) -> list[float]:
    rng = random.Random(seed)
    v = [rng.gauss(0, 1) for _ in range(DIM)]
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def entry(n: int, tier: str = "semantic", **payload: object) -> Entry:
    return Entry(str(uuid.UUID(int=n + 1)), tier, f"text {n}", {"status": "active", **payload}, vector(n))


pytestmark = pytest.mark.filterwarnings("ignore:Payload indexes have no effect in the local Qdrant")


@pytest.fixture(params=["edge", "qdrant-client"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[VectorStore]:
    made: VectorStore
    if request.param == "edge":
        made = EdgeStore(tmp_path / "edge")
    else:
        from qdrant_client import AsyncQdrantClient

        made = QdrantServerStore("http://unused", client=AsyncQdrantClient(location=":memory:"))
    await made.open(DIM)
    try:
        yield made
    finally:
        await made.close()


async def test_every_call_sees_only_its_tenant(store: VectorStore) -> None:
    await store.upsert("acme", [entry(n, run_id=f"r{n % 2}") for n in range(10)])
    await store.upsert("globex", [entry(n + 100) for n in range(5)])
    assert await store.count("acme") == 10 and await store.count("globex") == 5
    hits = await store.search("globex", vector(3), limit=20)  # acme's text 3 is the nearest of all
    assert len(hits) == 5 and all(h.text.startswith("text 10") for h in hits)
    assert await store.get("globex", [entry(3).id]) == []
    assert await store.delete("globex", Where(ids=[entry(3).id])) == []
    assert await store.count("acme") == 10
    with pytest.raises(FleetError) as refused:
        await store.count("")
    assert refused.value.code == ErrorCode.FORBIDDEN
    with pytest.raises(FleetError):
        await store.set_payload("globex", entry(3).id, {"status": "held"})
    assert sorted(await store.tenants()) == ["acme", "globex"]


async def test_search_filters_and_paging(store: VectorStore) -> None:
    await store.upsert(
        "acme", [entry(n, "semantic" if n % 3 else "procedural", run_id=f"r{n % 2}") for n in range(30)]
    )
    [best] = await store.search("acme", vector(7), limit=1)
    assert best.id == entry(7).id and best.tier == "semantic" and best.score == pytest.approx(1.0, abs=1e-4)
    procedural = await store.search("acme", vector(7), limit=30, where=Where(tiers=["procedural"]))
    assert len(procedural) == 10 and {h.tier for h in procedural} == {"procedural"}
    assert await store.count("acme", Where(run_id="r1")) == 15
    seen, after = [], None
    while True:
        page, after = await store.scroll("acme", limit=7, after=after)
        seen += [e.id for e in page]
        if after is None:
            break
    assert sorted(seen) == sorted(entry(n).id for n in range(30))


async def test_payload_updates_support_runs_and_deletion(store: VectorStore) -> None:
    await store.upsert("acme", [entry(1, support_runs=["r1"], created_at=10.0), entry(2, created_at=20.0)])
    await store.set_payload("acme", entry(1).id, {"support_runs": ["r1", "r2"], "status": "held"})
    [one] = await store.get("acme", [entry(1).id])
    assert one.payload["support_runs"] == ["r1", "r2"] and one.payload["status"] == "held"
    assert one.text == "text 1" and one.tier == "semantic"  # set_payload cannot touch these
    assert [e.id for e in (await store.scroll("acme", where=Where(support_run="r2")))[0]] == [entry(1).id]
    assert await store.count("acme", Where(status="held")) == 1
    assert await store.delete("acme", Where(created_before=15.0)) == [entry(1).id]
    assert [e.id for e in (await store.scroll("acme"))[0]] == [entry(2).id]
