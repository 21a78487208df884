"""Governed memory beside ungoverned writes to the same store.

- Writes, batched and one at a time: the gate (scan for personal data and secrets, a policy decision
  per write, redaction, provenance, audit) then embed and commit, against the baseline of the same
  texts embedded and committed to the same kind of store (Qdrant's embedded engine) with no gate.
  The gate is the memory server's: its decisions through the live policy, whose decision log, like
  the audit trail, is published to a NATS server started for the run.
- Recall at 100,000 vectors in the caller's tenant: the read decision per tier, the query's
  embedding and the tenant-confined search, beside the same embedding and an unfiltered search.
- The scanner on the two labelled corpora: what reached the store, and the clean texts flagged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fleet.eventlog import EventLog
from fleet.natsconn import connect
from fleetctl.testing.nats import embedded_nats
from mcp_servers._base import AUDIT_MAX_AGE_S, AUDIT_MAX_PENDING, AUDIT_STREAM
from memory.embeddings import LocalMiniLM
from memory.gate import Caller, Memory, Write
from memory.scan import SECRET_TYPES, Scanner
from memory.store import EdgeStore, Entry, VectorStore
from policy import Bundle, RegorusEngine
from policy.live import LivePolicy

CORPORA = Path(__file__).resolve().parent.parent / "tests" / "memory"
WRITES_TARGET_PER_S = 300.0
SINGLE_TARGET_MS = 15.0
RECALL_TARGET_MS = 5.0
VECTORS = 100_000
CALLER = Caller("acme", "bench")

SUBJECTS = ["the March invoices", "the Frankfurt warehouse", "refund approvals", "the KPI digest",
            "the vendor portal", "the quarterly close", "ticket JIRA-4821", "the data export",
            "customer onboarding", "the nightly reconciliation"]  # fmt: skip
VERBS = ["was reviewed by finance", "needs a second sign-off", "moved to Thursday", "failed twice",
         "is owned by the ops team", "closes at 18:00 CET", "was escalated", "passed its checks"]  # fmt: skip
PII = ["Contact: dana.whitfield@acme-corp.io", "Call +1 415 555 0134", "IBAN DE89 3704 0044 0532 0130 00",
       "card 4111 1111 1111 1111", "from 203.0.113.45"]  # fmt: skip


def notes(n: int, seed: int) -> list[str]:
    """Realistic notes: 7 in 10 clean, 3 in 10 with personal data to redact."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} (note {seed}-{i})."
        if rng.random() < 0.3:
            text += f" {rng.choice(PII)}."
        out.append(text)
    return out


async def _open(root: Path, embedder: LocalMiniLM) -> EdgeStore:
    store = EdgeStore(root / uuid.uuid4().hex)
    await store.open(embedder.dim)
    return store


@contextlib.asynccontextmanager
async def gated_memory(
    store: VectorStore, embedder: LocalMiniLM, scanner: Scanner, nats_url: str
) -> AsyncIterator[Memory]:
    """Memory as the memory server builds it: the live policy (its decision log) and the audit
    trail, both published to NATS."""

    async def embedded(bundle: Bundle) -> RegorusEngine:
        return RegorusEngine(bundle)

    client = await connect(nats_url, "bench-memory")
    audit = EventLog(
        AUDIT_STREAM, "fleet.audit.>", "fleet.audit.memory.bench", max_age_s=AUDIT_MAX_AGE_S,
        max_pending=AUDIT_MAX_PENDING,
    )  # fmt: skip
    policy = LivePolicy("bench-memory", embedded, RegorusEngine(Bundle.load()))
    try:
        async with audit.publishing(client), policy.decisions.publishing(client):
            yield Memory(store, embedder, policy, scanner, audit.record)
    finally:
        await client.close()


async def writes(
    embedder: LocalMiniLM, scanner: Scanner, root: Path, nats_url: str, rounds: int = 3, per_round: int = 1024
) -> dict[str, Any]:
    batch = 128
    governed_s, baseline_s = [], []
    for r in range(rounds):
        texts = notes(per_round, seed=r)
        store = await _open(root, embedder)
        async with gated_memory(store, embedder, scanner, nats_url) as memory:
            started = time.perf_counter()
            for i in range(0, per_round, batch):
                await memory.remember(CALLER, [Write("episodic", t) for t in texts[i : i + batch]])
            governed_s.append(time.perf_counter() - started)
        await store.close()

        store = await _open(root, embedder)
        started = time.perf_counter()
        for i in range(0, per_round, batch):
            chunk = texts[i : i + batch]
            vectors = await embedder.embed(chunk)
            await store.upsert(
                CALLER.tenant,
                [Entry(str(uuid.uuid4()), "episodic", t, {}, v) for t, v in zip(chunk, vectors, strict=True)],
            )
        baseline_s.append(time.perf_counter() - started)
        await store.close()

    singles_g, singles_b = [], []
    store_g, store_b = await _open(root, embedder), await _open(root, embedder)
    async with gated_memory(store_g, embedder, scanner, nats_url) as memory:
        for i, text in enumerate(notes(min(300, per_round), seed=99)):
            if i % 2:
                started = time.perf_counter()
                await memory.remember(CALLER, [Write("episodic", text)])
                singles_g.append(time.perf_counter() - started)
            else:
                started = time.perf_counter()
                [vector] = await embedder.embed([text])
                await store_b.upsert(CALLER.tenant, [Entry(str(uuid.uuid4()), "episodic", text, {}, vector)])
                singles_b.append(time.perf_counter() - started)
    await store_g.close()
    await store_b.close()
    governed = per_round / statistics.median(governed_s)
    baseline = per_round / statistics.median(baseline_s)
    single_g = statistics.median(singles_g) * 1000
    single_b = statistics.median(singles_b) * 1000
    return {
        "batch": batch,
        "writes_per_round": per_round,
        "governed_per_s": round(governed),
        "ungoverned_per_s": round(baseline),
        "batched_cost_ratio": round(baseline / governed, 2),
        "single_governed_p50_ms": round(single_g, 2),
        "single_ungoverned_p50_ms": round(single_b, 2),
        "single_cost_ratio": round(single_g / single_b, 2),
        "writes_target_per_s": WRITES_TARGET_PER_S,
        "single_target_ms": SINGLE_TARGET_MS,
    }


async def recall(
    embedder: LocalMiniLM, scanner: Scanner, root: Path, nats_url: str, vectors_in_all: int = VECTORS
) -> dict[str, Any]:
    """``vectors_in_all`` (100,000) vectors in one tenant (the worst case of a tenant-confined
    search): one real embedding in 50 (2,000), each with 49 noisy neighbours, so that the index has
    real structure to find."""
    import numpy as np

    rng = np.random.default_rng(7)
    seeds = np.array(
        await embedder.embed(notes(min(2000, vectors_in_all // 50), seed=1234)), dtype=np.float32
    )
    store = await _open(root, embedder)
    started = time.perf_counter()
    tiers = ("episodic", "semantic", "procedural")
    for block in range(0, vectors_in_all, 5000):
        idx = np.arange(block, block + 5000)
        vectors = seeds[idx % len(seeds)] + rng.normal(0, 0.02, (len(idx), seeds.shape[1])).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        await store.upsert(
            CALLER.tenant,
            [
                Entry(str(uuid.UUID(int=int(i) + 1)), tiers[int(i) % 3], f"synthetic entry {i}",
                      {"status": "active", "created_at": 0.0}, v.tolist())
                for i, v in zip(idx, vectors, strict=True)
            ],
        )  # fmt: skip
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    await store.optimize()
    index_s = time.perf_counter() - started
    import qdrant_edge as q

    queries = [f"what happened with {s} when it {v}?" for s in SUBJECTS for v in VERBS] * 3
    gated, baseline, search_only = [], [], []
    async with gated_memory(store, embedder, scanner, nats_url) as memory:
        for query in queries:
            started = time.perf_counter()
            await memory.recall(CALLER, query, limit=5)
            gated.append(time.perf_counter() - started)
            started = time.perf_counter()
            [vector] = await embedder.embed([query])
            mid = time.perf_counter()
            store.shard.query(q.QueryRequest(limit=5, query=q.Query.Nearest(vector), with_payload=True))
            baseline.append(time.perf_counter() - started)
            search_only.append(time.perf_counter() - mid)
    await store.close()
    g, b = statistics.median(gated) * 1000, statistics.median(baseline) * 1000
    return {
        "vectors": vectors_in_all,
        "load_s": round(load_s, 1),
        "index_build_s": round(index_s, 1),
        "recall_p50_ms": round(g, 2),
        "recall_p99_ms": round(sorted(gated)[int(len(gated) * 0.99)] * 1000, 2),
        "ungoverned_p50_ms": round(b, 2),
        "search_only_p50_ms": round(statistics.median(search_only) * 1000, 2),
        "recall_cost_ratio": round(g / b, 2),
        "recall_target_ms": RECALL_TARGET_MS,
    }


async def retrieval(embedder: LocalMiniLM, scanner: Scanner, root: Path, nats_url: str) -> dict[str, Any]:
    """recall@1 and recall@5 of memory's recall on the labelled retrieval set: every document
    written through the gate as a semantic entry, each query asked through the read path."""
    data = json.loads((CORPORA / "retrieval_set.json").read_text())
    docs = [p["relevant"] for p in data["pairs"]] + data["distractors"]
    store = await _open(root, embedder)
    async with gated_memory(store, embedder, scanner, nats_url) as memory:
        outcomes = await memory.remember(CALLER, [Write("semantic", d) for d in docs])
        ids = [o.id or "" for o in outcomes]
        ranks = []
        for n, pair in enumerate(data["pairs"]):
            hits = [h.id for h in await memory.recall(CALLER, pair["query"], limit=5)]
            ranks.append(hits.index(ids[n]) + 1 if ids[n] in hits else None)
    await store.close()
    return {
        "queries": len(ranks),
        "documents": len(docs),
        "stored": sum(o.status == "stored" for o in outcomes),
        "recall_at_1": round(sum(r == 1 for r in ranks) / len(ranks), 3),
        "recall_at_5": round(sum(r is not None for r in ranks) / len(ranks), 3),
    }


def scanner_quality(scanner: Scanner) -> dict[str, Any]:
    """Per corpus: sensitive texts whose every item the scanner covers (a secret anywhere denies the
    write), and clean texts it flags."""
    out: dict[str, Any] = {}
    for name in ("pii_corpus", "pii_holdout", "pii_independent"):
        rows = [json.loads(line) for line in (CORPORA / f"{name}.jsonl").read_text().splitlines()]
        missed, flagged, timings = [], [], []
        for row in rows:
            started = time.perf_counter()
            found = [f for f in scanner.scan(row["text"]) if f.score >= 0.3]
            timings.append(time.perf_counter() - started)
            secret = any(f.type in SECRET_TYPES for f in found)
            if row["expect"] == "clean":
                if found:
                    flagged.append(row["id"])
                continue
            if row["expect"] == "secret" and not secret:
                missed.append(row["id"])
                continue
            for item in row["sensitive"]:
                start = row["text"].index(item)
                if not secret and not all(
                    any(f.start <= c < f.end for f in found) for c in range(start, start + len(item))
                ):
                    missed.append(row["id"])
                    break
        sensitive = sum(r["expect"] != "clean" for r in rows)
        clean = len(rows) - sensitive
        out[name] = {
            "texts": len(rows),
            "sensitive": sensitive,
            "missed": missed,
            "clean": clean,
            "clean_flagged": flagged,
            "false_positive_rate": round(len(flagged) / clean, 4),
            "scan_p50_ms": round(statistics.median(timings) * 1000, 2),
        }
    return out


def run(rounds: int = 3, per_round: int = 1024, vectors_in_all: int = VECTORS) -> dict[str, Any]:
    """The default model (int8 products), then the float one (``FLEET_EMBEDDINGS=local-exact``)."""
    scanner = Scanner()
    result: dict[str, Any] = {"benchmark": "memory"}
    with embedded_nats() as nats_url:
        for variant, embedder in (("default", LocalMiniLM()), ("exact_model", LocalMiniLM(exact=True))):
            embedder.load()
            measured: dict[str, Any] = {"model": embedder.name}
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                measured["writes"] = asyncio.run(writes(embedder, scanner, root, nats_url, rounds, per_round))
                measured["retrieval"] = asyncio.run(retrieval(embedder, scanner, root, nats_url))
                measured["recall"] = asyncio.run(recall(embedder, scanner, root, nats_url, vectors_in_all))
            if variant == "default":
                result.update(measured)
            else:
                result[variant] = measured
    result["scanner"] = scanner_quality(scanner)
    return result


def main() -> dict[str, Any]:
    result = run()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
