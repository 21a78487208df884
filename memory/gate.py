"""Long-term memory behind its gate: every write is scanned, decided by policy, redacted or refused,
committed with its provenance, and audited; every read is decided by policy too.

A write (:meth:`Memory.remember`):

1. the text is checked (size, binary) and scanned for personal data and secrets (:mod:`memory.scan`);
   the scan runs in a thread and must finish within ``scan_timeout_s``, or nothing is written;
2. policy decides (``fleet.memory.decision``) from the tenant, the agent, the tier, the source and its
   trust, the provenance (the run, how many distinct runs support the entry, a person's approval) and
   the findings (types and scores, never the text): ``allow``, ``redact``, ``deny`` or ``hold``;
3. ``redact`` replaces the named finding types with ``<TYPE>`` (``presidio-anonymizer``); ``deny``
   writes nothing; ``hold`` writes the entry as ``held`` (never recalled) until a person approves it
   or enough distinct runs support it (a procedural rule: ``config.memory.procedural``);
4. the entry is embedded and committed with its provenance: run, agent, source, decision id, bundle
   revision, what was redacted; an entry that is already there (the same tier and text, with findings
   masked) gains the new run's support instead of a copy;
5. an audit event records the write, whatever its outcome (never the text).

If policy cannot be evaluated, the scanner fails, or the audit trail cannot keep up, nothing is
written and the caller gets an error with a stable code: the gate fails closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from presidio_anonymizer import AnonymizerEngine
from presidio_anonymizer.entities import RecognizerResult

from fleet import telemetry
from fleet.errors import ErrorCode, FleetError
from memory.consolidate import Extractor, RuleExtractor
from memory.embeddings import Embedder
from memory.scan import DEFAULT_MAX_CHARS, Finding, Scanner
from memory.scan_pool import ScanPool, ScanQuota
from memory.store import TIERS, Entry, VectorStore, Where
from policy.engine import Decision, PolicyEngine

log = logging.getLogger(__name__)

ACTIVE, HELD = "active", "held"
TRUST = ("trusted", "untrusted")
SOURCES = ("agent", "tool", "user", "external", "consolidation", "operator")
_IDENTIFIER = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
MAX_TAGS = 16
MAX_BATCH = 256
SCAN_JOB_CHARS = DEFAULT_MAX_CHARS  # a scan thread's job: texts up to this many characters (at least one)
Audit = Callable[[dict[str, Any]], object]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a text comes from: ``kind`` (agent, tool, user, consolidation, operator), whether the
    fleet trusts it (tool output and outside input are untrusted), and a reference (a tool name)."""

    kind: str = "agent"
    trust: str = "untrusted"
    ref: str = ""
    # Consolidation's only: the source of the episode a candidate came from (policy denies a rule
    # that only tool output supports, however it was consolidated).
    origin: str = ""


@dataclass(frozen=True, slots=True)
class Write:
    tier: str
    text: str
    source: Source = field(default_factory=Source)
    run_id: str = ""
    tags: tuple[str, ...] = ()
    support_runs: tuple[str, ...] = ()  # runs that support the entry, besides ``run_id``
    # The principal the write's support counts as (``fleet.memory.writer``, from the caller's
    # verified token), or "" when it counts for none (a service, an unknown subject).
    principal: str = ""
    writer_decision_id: str = ""  # the decision (fleet.memory.writer) that gave its trust and principal


@dataclass(frozen=True, slots=True)
class Caller:
    """Who reads or writes: from the caller's verified token, never from arguments."""

    tenant: str
    agent: str


@dataclass(slots=True)
class Outcome:
    """What became of one write: ``stored`` (possibly redacted), ``held``, ``denied`` or ``refused``
    (the text could not be read: ``code`` says why)."""

    status: str
    id: str | None = None
    tier: str = ""
    redacted: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    decision_id: str | None = None
    revision: str | None = None
    code: str | None = None
    duplicate: bool = False
    trust: str | None = None  # the trust the entry was given (never the caller's claim as such)

    @classmethod
    def of(
        cls,
        status: str,
        decision: Decision,
        tier: str,
        entry_id: str | None = None,
        redacted: set[str] | None = None,
        *,
        duplicate: bool = False,
    ) -> Outcome:
        return cls(
            status,
            id=entry_id,
            tier=tier,
            redacted=sorted(redacted or ()),
            reasons=list(decision.reasons),
            decision_id=decision.decision_id,
            revision=decision.revision,
            duplicate=duplicate,
        )

    def to_dict(self) -> dict[str, Any]:
        """The outcome without its empty fields."""
        out: dict[str, Any] = {"status": self.status}
        keys = ("id", "tier", "trust", "redacted", "reasons", "decision_id", "revision", "code", "duplicate")
        for key in keys:
            value = getattr(self, key)
            if value not in (None, "", [], False):
                out[key] = value
        return out


def shown(value: str) -> str:
    """A caller's value as the audit trail may show it: known ones as they are, others not at all."""
    return value if value in (*TIERS, *SOURCES, *TRUST) else "(invalid)"


def content_hash(tenant: str, tier: str, text: str, findings: Sequence[Finding]) -> str:
    """The identity of an entry's content: its text with every finding masked and whitespace
    collapsed (so it carries no personal data), hashed with its tenant and tier."""
    masked = mask(text, findings, {f.type for f in findings})
    normal = " ".join(masked.split()).casefold()
    return hashlib.sha256(f"{tenant}\x00{tier}\x00{normal}".encode()).hexdigest()


def mask(text: str, findings: Sequence[Finding], types: set[str]) -> str:
    """``text`` with every finding of ``types`` replaced by ``<TYPE>`` (presidio-anonymizer)."""
    chosen = [f for f in findings if f.type in types]
    if not chosen:
        return text
    results = [RecognizerResult(f.type, f.start, f.end, f.score) for f in chosen]
    return str(_ANONYMIZER.anonymize(text=text, analyzer_results=results).text)


_ANONYMIZER = AnonymizerEngine()  # type: ignore[no-untyped-call]


class Memory:
    """The three long-term tiers of every tenant, behind the gate. Used by the memory MCP server,
    the store's single writer."""

    def __init__(
        self,
        store: VectorStore,
        embedder: Embedder,
        policy: PolicyEngine,
        scanner: Scanner,
        audit: Audit,
        *,
        server_id: str = "memory",
        scan_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        extractor: Extractor | None = None,
        audit_room: Callable[[], int] | None = None,
        scan_threads: int = 2,
    ) -> None:
        """``audit_room``: how many more events the audit trail takes now (a write that would not
        fit is refused before anything is written). ``scan_threads``: the scan pool's threads,
        shared by the tenants in turn (quotas and weights: ``fleet.limits.fair.memory_scan``)."""
        self.audit_room = audit_room
        # Scans wait for their own threads, not behind the embedding model's in the default pool.
        self._scanning = ScanPool(scan_threads)
        self.extractor: Extractor = extractor or RuleExtractor()
        self.store = store
        self.embedder = embedder
        self.policy = policy
        self.scanner = scanner
        self._audit = audit
        self.server_id = server_id
        self.scan_timeout_s = scan_timeout_s
        self.clock = clock
        self._writes = asyncio.Lock()  # one writer: support counts and duplicates stay consistent

    # ------------------------------------------------------------------------------ writing
    async def remember(self, caller: Caller, writes: Sequence[Write]) -> list[Outcome]:
        """Pass each write through the gate; one outcome per write, in order. A write that cannot
        be read is ``refused`` and the others go on; a failure of policy, scanner or store fails
        the whole call with nothing written."""
        if not writes:
            return []
        if len(writes) > MAX_BATCH:
            raise FleetError(ErrorCode.TOO_LARGE, f"at most {MAX_BATCH} writes per call, not {len(writes)}")
        if self.audit_room is not None and self.audit_room() < len(writes) + 1:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE,
                "the audit trail cannot keep up (is NATS down?); nothing was written",
                retryable=True,
            )
        outcomes: list[Outcome | None] = [None] * len(writes)
        texts: dict[int, str] = {}
        checked: list[Write] = list(writes)
        for i, write in enumerate(writes):
            try:
                self._check(write)
                texts[i] = self.scanner.check(write.text)
                checked[i] = dataclasses.replace(write, text=texts[i])  # the form it is scanned in
            except FleetError as exc:
                outcomes[i] = Outcome(
                    "refused", tier=shown(write.tier), code=str(exc.code), reasons=[exc.message]
                )
        scanned = await self._scan(caller, [texts[i] for i in sorted(texts)])
        found: dict[int, list[Finding]] = {}
        for i, result in zip(sorted(texts), scanned, strict=True):
            if isinstance(result, FleetError):
                outcomes[i] = Outcome(
                    "refused", tier=writes[i].tier, code=str(result.code), reasons=[result.message]
                )
            else:
                found[i] = result
        async with self._writes:
            fresh: dict[str, Entry] = {}  # new entries of this call, by id
            updates: dict[str, dict[str, Any]] = {}  # support for entries already stored, by id
            for i, write in enumerate(checked):
                if outcomes[i] is None:
                    outcomes[i] = await self._gate(caller, write, found[i], fresh, updates)
            # Nothing is written before every write of the call is decided and embedded.
            if fresh:
                entries = list(fresh.values())
                vectors = await self.embedder.embed([e.text for e in entries])
                await self.store.upsert(
                    caller.tenant,
                    [
                        Entry(e.id, e.tier, e.text, e.payload, vector=v)
                        for e, v in zip(entries, vectors, strict=True)
                    ],
                )
            for entry_id, update in updates.items():
                await self.store.set_payload(caller.tenant, entry_id, update)
        done = [o for o in outcomes if o is not None]
        for i, (write, outcome) in enumerate(zip(writes, done, strict=True)):
            telemetry.record_memory_write(write.tier, outcome.status, bool(outcome.redacted))
            self._record(
                "remember",
                caller,
                {
                    "tier": shown(write.tier),
                    "run_id": write.run_id or None,
                    "source": shown(write.source.kind),
                    "trust": shown(write.source.trust),
                    "principal": write.principal or None,
                    "writer_decision_id": write.writer_decision_id or None,
                    "entry_id": outcome.id,
                    "outcome": outcome.status,
                    "redacted": outcome.redacted,
                    "reasons": outcome.reasons,
                    "decision_id": outcome.decision_id,
                    "revision": outcome.revision,
                    "findings": sorted({f.type for f in found.get(i, [])}),
                },
            )
        return done

    def _check(self, write: Write) -> None:
        """Everything of a write but its text is metadata that is stored and audited unscanned: it
        must be one of few known values, or a short identifier (never echoed back if it is not)."""
        if write.tier not in TIERS:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"tier must be one of {', '.join(TIERS)}")
        if write.source.kind not in SOURCES:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"source must be one of {', '.join(SOURCES)}")
        if write.source.trust not in TRUST:
            raise FleetError(ErrorCode.INVALID_REQUEST, "source trust must be trusted or untrusted")
        if write.source.ref and not _IDENTIFIER.fullmatch(write.source.ref):
            raise FleetError(
                ErrorCode.INVALID_REQUEST,
                "a source reference is an identifier of at most 128 characters ([A-Za-z0-9_.:/-])",
            )
        if len(write.tags) > MAX_TAGS or any(
            not isinstance(t, str) or not _IDENTIFIER.fullmatch(t) for t in write.tags
        ):
            raise FleetError(
                ErrorCode.INVALID_REQUEST, f"at most {MAX_TAGS} tags, each an identifier ([A-Za-z0-9_.:/-])"
            )

    async def _scan(self, caller: Caller, texts: list[str]) -> list[list[Finding] | FleetError]:
        """Each text's findings, or why it could not be scanned: a text the scanner does not finish
        within ``scan_timeout_s`` of starting it is refused (its scan goes on in its thread, bounded
        by the size limit, and its answer is dropped; the texts after it go on in another thread).
        A scanner that fails fails the call: nothing is written. The texts go to the tenant's queue
        of the scan pool in jobs of up to ``SCAN_JOB_CHARS`` characters (a job per short text costs
        nearly what its scan does), and wait their turn among the tenants'. A call whose texts do
        not fit the tenant's quota is refused whole (``too_large``, ``quota_exceeded``)."""
        if not texts:
            return []
        quota = await self._decide("fleet.limits.fair.memory_scan", {"tenant": caller.tenant})
        try:
            self._scanning.reserve(caller.tenant, texts, ScanQuota.of(quota.result))
        except FleetError as exc:
            log.warning(
                "memory write of %s/%s refused: %s (decision %s)",
                caller.tenant,
                caller.agent,
                exc.code,
                quota.decision_id,
            )
            raise
        try:
            return await self._scan_jobs(caller.tenant, texts)
        finally:
            self._scanning.release(caller.tenant, texts)

    async def _scan_jobs(self, tenant: str, texts: list[str]) -> list[list[Finding] | FleetError]:
        found: list[list[Finding] | FleetError] = []
        while len(found) < len(texts):
            run = _ScanRun(self.scanner, _job(texts[len(found) :]))
            done = await self._wait_for(tenant, run)
            found += done
            if not run.begun:  # the scan threads are still on texts given up on: refuse the rest
                busy = FleetError(ErrorCode.UNSCANNABLE, "no scan thread is free; try again", retryable=True)
                found += [busy] * (len(texts) - len(found))
            elif len(done) < len(run.texts):  # the text it was on took too long
                found.append(
                    FleetError(
                        ErrorCode.UNSCANNABLE, f"scanning took longer than {self.scan_timeout_s:.1f} s"
                    )
                )
        return found

    async def _wait_for(self, tenant: str, run: _ScanRun) -> list[list[Finding] | FleetError]:
        """What ``run`` scanned: all its texts, or those before the one that took too long."""
        future = self._scanning.submit(tenant, run)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(future), run.left(self.scan_timeout_s))
                    return future.result()
                except TimeoutError:
                    if run.give_up(self.scan_timeout_s):
                        return list(run.results)
        except FleetError:
            raise
        except Exception as exc:
            log.exception("the scanner failed")
            raise FleetError(
                ErrorCode.INTERNAL, f"the scanner failed ({type(exc).__name__}); nothing was written"
            ) from None
        finally:
            run.stop()  # a call cancelled or failed leaves its thread after the text it is on
            future.cancel()  # and a job no thread took yet is dropped

    async def _gate(
        self,
        caller: Caller,
        write: Write,
        findings: list[Finding],
        fresh: dict[str, Entry],
        updates: dict[str, dict[str, Any]],
    ) -> Outcome:
        """Decide one write. A new entry goes in ``fresh``; more support for an entry already stored
        goes in ``updates`` (both are written once the whole call is decided)."""
        digest = content_hash(caller.tenant, write.tier, write.text, findings)
        candidates: list[Entry] = []
        if write.tier != "episodic":  # knowledge is one entry supported by runs; each episode is its own
            candidates = [e for e in fresh.values() if e.payload.get("content_hash") == digest]
            stored, _ = await self.store.scroll(
                caller.tenant, where=Where(content_hash=digest, tiers=[write.tier]), limit=20
            )
            candidates += [e for e in stored if e.id not in fresh]
        # The same content: the same text once the candidate's own redactions are applied to this one
        # (the hash masks every finding, so texts that differ in a number share it).
        before = next(
            (
                e
                for e in candidates
                if e.text == mask(write.text, findings, set(e.payload.get("redacted", [])))
            ),
            None,
        )
        if before is not None and before.id in updates:
            before = dataclasses.replace(before, payload={**before.payload, **updates[before.id]})
        runs = set(before.payload.get("support_runs", [])) if before else set()
        runs.update(r for r in (write.run_id, *write.support_runs) if r)
        supporters = _supporters(before.payload if before else {})
        if write.principal:
            supporters.add((write.run_id, write.principal))
        decision = await self._decide_write(
            caller,
            write,
            findings,
            len(runs),
            _principals(supporters),
            approved=bool(before and before.payload.get("approved_by")),
        )
        action = decision.result.get("action")
        if action == "deny":
            return Outcome.of("denied", decision, write.tier)
        if action not in ("allow", "redact", "hold"):
            raise FleetError(
                ErrorCode.POLICY_UNAVAILABLE, f"fleet.memory.decision answered action {action!r}"
            )
        redact = set(decision.result.get("redact") or ())
        status = HELD if action == "hold" else ACTIVE
        now = self.clock()
        if before is not None and redact == set(before.payload.get("redacted", [])):
            was = before.payload.get("status", ACTIVE)
            update: dict[str, Any] = {
                "support_runs": sorted(runs),
                **_support_payload(supporters),
                "updated_at": now,
                "status": status if was == HELD else was,
            }
            if update["status"] == ACTIVE and was == HELD:
                update.update(decision_id=decision.decision_id, revision=decision.revision, activated_at=now)
            if before.id in fresh:
                fresh[before.id] = dataclasses.replace(before, payload={**before.payload, **update})
            else:
                updates[before.id] = {**updates.get(before.id, {}), **update}
            state = "held" if update["status"] == HELD else "stored"
            outcome = Outcome.of(state, decision, write.tier, before.id, redact, duplicate=True)
            outcome.trust = str(before.payload.get("source_trust") or "untrusted")
            return outcome
        entry = Entry(
            id=str(uuid.uuid4()),
            tier=write.tier,
            text=mask(write.text, findings, redact),
            payload={
                "status": status,
                "agent": caller.agent,
                "run_id": write.run_id or None,
                "source_kind": write.source.kind,
                "source_trust": write.source.trust,
                "source_ref": write.source.ref or None,
                "source_origin": write.source.origin or None,
                "support_runs": sorted(runs),
                **_support_payload(supporters),
                "decision_id": decision.decision_id,
                "revision": decision.revision,
                "redacted": sorted(redact),
                "findings": [f.summary() for f in findings],
                "tags": list(write.tags),
                "content_hash": digest,
                "created_at": now,
                "updated_at": now,
            },
        )
        fresh[entry.id] = entry
        outcome = Outcome.of("held" if status == HELD else "stored", decision, write.tier, entry.id, redact)
        outcome.trust = write.source.trust
        return outcome

    async def _decide_write(
        self,
        caller: Caller,
        write: Write,
        findings: list[Finding],
        support: int,
        principals: int,
        *,
        approved: bool,
    ) -> Decision:
        return await self._decide(
            "fleet.memory.decision",
            {
                "tenant": caller.tenant,
                "agent": caller.agent,
                "tier": write.tier,
                "source": {
                    "kind": write.source.kind,
                    "trust": write.source.trust,
                    "origin": write.source.origin or None,
                },
                "provenance": {
                    "run_id": write.run_id or None,
                    "support_runs": support,
                    "support_principals": principals,
                    "approved": approved,
                },
                "findings": [f.summary() for f in findings],
            },
        )

    async def _decide(self, path: str, document: dict[str, Any]) -> Decision:
        try:
            return await self.policy.decide(path, document)
        except FleetError as exc:
            raise FleetError(
                ErrorCode.POLICY_UNAVAILABLE,
                f"memory policy could not be evaluated ({exc.message}); nothing was done",
                retryable=True,
            ) from None

    # ------------------------------------------------------------------------------ reading
    async def readable_tiers(
        self, caller: Caller, tiers: Sequence[str] | None
    ) -> tuple[list[str], list[str]]:
        """The tiers of ``tiers`` (all if None) that policy lets the caller read, and the reasons
        for those it may not."""
        wanted = list(tiers) if tiers else list(TIERS)
        unknown = [t for t in wanted if t not in TIERS]
        if unknown:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"not memory tiers: {', '.join(unknown)}")
        allowed: list[str] = []
        reasons: list[str] = []
        for tier in wanted:
            decision = await self._decide(
                "fleet.memory.read", {"tenant": caller.tenant, "agent": caller.agent, "tier": tier}
            )
            if decision.allow:
                allowed.append(tier)
            else:
                reasons.extend(decision.reasons)
        return allowed, reasons

    async def recall(
        self, caller: Caller, query: str, *, tiers: Sequence[str] | None = None, limit: int = 5
    ) -> list[Entry]:
        """The caller's tenant's active entries nearest to ``query`` in the tiers it may read."""
        if not isinstance(query, str) or not query.strip():
            raise FleetError(ErrorCode.INVALID_REQUEST, "query must be a non-empty string")
        query = self.scanner.check(query)
        if not 1 <= limit <= 100:
            raise FleetError(ErrorCode.INVALID_REQUEST, "limit must be between 1 and 100")
        allowed, reasons = await self.readable_tiers(caller, tiers)
        if not allowed:
            self._record(
                "recall", caller, {"tiers": list(tiers or TIERS), "outcome": "denied", "reasons": reasons}
            )
            raise FleetError(ErrorCode.POLICY_DENIED, "; ".join(reasons) or "no tier may be read")
        [vector] = await self.embedder.embed([query])
        hits = await self.store.search(
            caller.tenant, vector, limit=limit, where=Where(tiers=allowed, status=ACTIVE)
        )
        self._record(
            "recall",
            caller,
            {
                "tiers": allowed,
                "outcome": "allowed",
                "query_chars": len(query),  # never the query: it may itself be personal data
                "ids": [h.id for h in hits],
            },
        )
        return hits

    async def show(self, caller: Caller, ids: Sequence[str]) -> list[Entry]:
        """Entries by id (held ones too), in the tiers the caller may read."""
        allowed, _ = await self.readable_tiers(caller, None)
        entries = [e for e in await self.store.get(caller.tenant, ids) if e.tier in allowed]
        self._record("show", caller, {"ids": [e.id for e in entries], "outcome": "allowed"})
        return entries

    # --------------------------------------------------------------------------- consolidation
    async def consolidate(self, caller: Caller, run_id: str) -> list[Outcome]:
        """At a run's end: the run's episodic entries yield semantic and procedural candidates
        (:func:`memory.consolidate.extract`), each written through the gate as the run's, with the
        trust of the entry it came from. Outcomes in the order of the candidates."""
        if not run_id:
            raise FleetError(ErrorCode.INVALID_REQUEST, "consolidation needs the run whose memory it reads")
        episodes: list[Entry] = []
        after: str | None = None
        while True:
            page, after = await self.store.scroll(
                caller.tenant,
                where=Where(run_id=run_id, tiers=["episodic"], status=ACTIVE),
                limit=500,
                after=after,
            )
            episodes.extend(page)
            if after is None:
                break
        candidates = await self.extractor.candidates(
            sorted(episodes, key=lambda e: float(e.payload.get("created_at") or 0))
        )
        # A candidate is supported by whoever wrote the episode it came from, as that episode
        # recorded it (the consolidating worker is no principal of its own).
        principal = {e.id: _principals_of(e.payload) for e in episodes}
        origin = {e.id: str(e.payload.get("source_kind") or "") for e in episodes}
        writes = [
            Write(
                c.tier,
                c.text,
                Source("consolidation", c.trust, c.source_id, origin.get(c.source_id, "")),
                run_id=run_id,
                principal=principal.get(c.source_id, ""),
            )
            for c in candidates
        ]
        outcomes: list[Outcome] = []
        for start in range(0, len(writes), MAX_BATCH):
            outcomes += await self.remember(caller, writes[start : start + MAX_BATCH])
        self._record(
            "consolidate",
            caller,
            {
                "run_id": run_id,
                "episodes": len(episodes),
                "candidates": len(candidates),
                "outcome": "done",
                "stored": sum(o.status == "stored" for o in outcomes),
                "held": sum(o.status == "held" for o in outcomes),
                "denied": sum(o.status == "denied" for o in outcomes),
            },
        )
        return outcomes

    # ----------------------------------------------------------------------------- forgetting
    async def forget(self, caller: Caller, where: Where, *, reason: str = "") -> list[str]:
        """Delete what ``where`` selects of the caller's tenant; the ids deleted (audited)."""
        async with self._writes:
            ids = await self.store.delete(caller.tenant, where)
        self._record(
            "forget",
            caller,
            {
                "ids": ids,
                "count": len(ids),
                "reason": reason[:500],
                "outcome": "deleted",
                "selector": _selector(where),
            },
        )
        return ids

    async def forget_run(
        self, caller: Caller, run_id: str, *, reason: str = ""
    ) -> tuple[list[str], list[str]]:
        """Take back what a run wrote: its entries are deleted, except where other runs support the
        same entry, which then loses only this run's support. The ids deleted and the ids kept."""
        if not run_id:
            raise FleetError(ErrorCode.INVALID_REQUEST, "which run?")
        deleted: list[str] = []
        kept: list[str] = []
        async with self._writes:
            entries: dict[str, Entry] = {}
            for where in (Where(run_id=run_id), Where(support_run=run_id)):
                after: str | None = None
                while True:
                    page, after = await self.store.scroll(caller.tenant, where=where, limit=500, after=after)
                    entries.update((e.id, e) for e in page)
                    if after is None:
                        break
            for entry in entries.values():
                others = [r for r in entry.payload.get("support_runs", []) if r != run_id]
                if others:
                    supporters = {s for s in _supporters(entry.payload) if s[0] != run_id}
                    update: dict[str, Any] = {
                        "support_runs": others,
                        **_support_payload(supporters),
                        "updated_at": self.clock(),
                    }
                    if entry.payload.get("run_id") == run_id:
                        update["run_id"] = others[0]
                    if entry.payload.get("status") == ACTIVE and not entry.payload.get("approved_by"):
                        # It may have become memory on this run's support: policy decides again.
                        again = await self._decide_write(
                            Caller(caller.tenant, str(entry.payload.get("agent") or caller.agent)),
                            Write(
                                entry.tier,
                                entry.text,
                                _stored_source(entry),
                            ),
                            _stored_findings(entry),
                            len(others),
                            _principals(supporters),
                            approved=False,
                        )
                        if again.result.get("action") == "hold":
                            update["status"] = HELD
                        elif again.result.get("action") == "deny":
                            deleted.append(entry.id)
                            continue
                    await self.store.set_payload(caller.tenant, entry.id, update)
                    kept.append(entry.id)
                else:
                    deleted.append(entry.id)
            if deleted:
                await self.store.delete(caller.tenant, Where(ids=deleted))
        self._record(
            "forget",
            caller,
            {
                "ids": deleted,
                "count": len(deleted),
                "unsupported": kept,
                "reason": reason[:500],
                "outcome": "deleted",
                "selector": {"run_id": run_id},
            },
        )
        return deleted, kept

    async def approve(self, caller: Caller, entry_id: str) -> Outcome:
        """A person approves a held entry: policy decides again, now with the approval."""
        async with self._writes:
            entries = await self.store.get(caller.tenant, [entry_id])
            if not entries:
                raise FleetError(ErrorCode.NOT_FOUND, f"no memory {entry_id} for this tenant")
            entry = entries[0]
            if entry.payload.get("status") != HELD:
                return Outcome("stored", id=entry.id, tier=entry.tier, reasons=["it was not held"])
            findings = _stored_findings(entry)
            write = Write(
                entry.tier,
                entry.text,
                _stored_source(entry),
                run_id=str(entry.payload.get("run_id") or ""),
            )
            decision = await self._decide_write(
                caller,
                write,
                findings,
                len(entry.payload.get("support_runs", [])),
                _principals(_supporters(entry.payload)),
                approved=True,
            )
            action = decision.result.get("action")
            if action in ("allow", "redact"):
                now = self.clock()
                update = {
                    "status": ACTIVE,
                    "approved_by": caller.agent,
                    "source_trust": "trusted",  # a person vouched for it: recalled as trusted
                    "activated_at": now,
                    "updated_at": now,
                    "decision_id": decision.decision_id,
                    "revision": decision.revision,
                }
                more = set(decision.result.get("redact") or ()) - set(entry.payload.get("redacted", []))
                if more:  # policy now redacts more than when it was held: redact before it is recalled
                    text = mask(entry.text, self.scanner.scan(entry.text), more)
                    [vector] = await self.embedder.embed([text])
                    payload = {
                        **entry.payload,
                        **update,
                        "redacted": sorted(more | set(entry.payload.get("redacted", []))),
                    }
                    await self.store.upsert(
                        caller.tenant, [Entry(entry.id, entry.tier, text, payload, vector)]
                    )
                else:
                    await self.store.set_payload(caller.tenant, entry.id, update)
                outcome = Outcome.of("stored", decision, entry.tier, entry.id, more)
                outcome.trust = "trusted"
            else:
                outcome = Outcome.of("denied" if action == "deny" else "held", decision, entry.tier, entry.id)
        self._record(
            "approve",
            caller,
            {
                "entry_id": entry_id,
                "outcome": outcome.status,
                "decision_id": outcome.decision_id,
                "reasons": outcome.reasons,
            },
        )
        return outcome

    async def sweep(self) -> dict[str, int]:
        """Retention: delete what is older than policy keeps in each tier (``fleet.memory.retention``,
        per tenant). The count deleted per tenant; each deletion is audited."""
        deleted: dict[str, int] = {}
        now = self.clock()
        for tenant in await self.store.tenants():
            for tier in TIERS:
                decision = await self._decide("fleet.memory.retention", {"tenant": tenant, "tier": tier})
                max_age = decision.result.get("max_age_s") if isinstance(decision.result, dict) else None
                if max_age is None:
                    continue
                caller = Caller(tenant, self.server_id)
                ids = await self.forget(
                    caller,
                    Where(tiers=[tier], created_before=now - float(max_age)),
                    reason=f"retention: {tier} kept {max_age} s (decision {decision.decision_id})",
                )
                if ids:
                    deleted[tenant] = deleted.get(tenant, 0) + len(ids)
        return deleted

    # ------------------------------------------------------------------------------ audit
    def _record(self, op: str, caller: Caller, event: dict[str, Any]) -> None:
        # An event's "id" is its own, set by the audit log (and used to drop a re-sent batch): an
        # entry's id goes in "entry_id", or a second event about one entry would be dropped.
        assert "id" not in event
        self._audit(
            {"server": self.server_id, "op": op, "tenant": caller.tenant, "agent": caller.agent, **event}
        )


class _ScanRun:
    """Texts scanned one after another in a scan thread, watched by the event loop: it knows which
    text the thread is on and since when, and can stop it before the next one."""

    def __init__(self, scanner: Scanner, texts: list[str]) -> None:
        self.scanner, self.texts = scanner, texts
        self.results: list[list[Finding] | FleetError] = []
        self._since: float | None = None  # when the text the thread is on began; None: not begun
        self._created = time.monotonic()
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def begun(self) -> bool:
        with self._lock:
            return self._since is not None

    def __call__(self) -> list[list[Finding] | FleetError]:
        with self._lock:
            if self._stopped:
                return self.results
            self._since = time.monotonic()
        for text in self.texts:
            try:
                result: list[Finding] | FleetError = self.scanner.scan(text)
            except FleetError as exc:
                result = exc
            with self._lock:  # its answer and the next text's start, at once
                if self._stopped:
                    break
                self.results.append(result)
                self._since = time.monotonic()
        return self.results

    def left(self, timeout_s: float) -> float:
        """How long the text the thread is on has left (``timeout_s`` from its start), or the run
        to be taken up by a thread (four times that from its creation)."""
        with self._lock:
            return self._left(timeout_s)

    def _left(self, timeout_s: float) -> float:
        if self._since is None:
            return max(0.0, 4 * timeout_s - (time.monotonic() - self._created))
        return max(0.0, timeout_s - (time.monotonic() - self._since))

    def give_up(self, timeout_s: float) -> bool:
        """Stop the run if its time is out (see :meth:`left`): :attr:`results` are then the texts
        before the one it is on."""
        with self._lock:
            if self._left(timeout_s) > 0:
                return False
            self._stopped = True
            return True

    def stop(self) -> None:
        """No text after the one it is on (if any)."""
        with self._lock:
            self._stopped = True


def _job(texts: list[str]) -> list[str]:
    """The first texts of ``texts`` that one scan job takes: up to ``SCAN_JOB_CHARS`` characters, at
    least one text."""
    total = 0
    for n, text in enumerate(texts):
        total += len(text)
        if n and total > SCAN_JOB_CHARS:
            return texts[:n]
    return texts


def _supporters(payload: dict[str, Any]) -> set[tuple[str, str]]:
    """The (run, principal) pairs that support an entry, as its payload records them."""
    found: set[tuple[str, str]] = set()
    for pair in payload.get("supporters", []):
        if isinstance(pair, dict) and pair.get("principal"):
            found.add((str(pair.get("run") or ""), str(pair["principal"])))
    return found


def _principals(supporters: set[tuple[str, str]]) -> int:
    return len({principal for _, principal in supporters})


def _principals_of(payload: dict[str, Any]) -> str:
    """The one principal behind an entry (an episode has one writer), or "" if none counts."""
    principals = sorted({principal for _, principal in _supporters(payload)})
    return principals[0] if len(principals) == 1 else ""


def _support_payload(supporters: set[tuple[str, str]]) -> dict[str, Any]:
    return {
        "supporters": [{"run": run, "principal": principal} for run, principal in sorted(supporters)],
        "support_principals": sorted({principal for _, principal in supporters}),
    }


def _stored_source(entry: Entry) -> Source:
    p = entry.payload
    return Source(
        str(p.get("source_kind") or "agent"),
        str(p.get("source_trust") or "untrusted"),
        origin=str(p.get("source_origin") or ""),
    )


def _stored_findings(entry: Entry) -> list[Finding]:
    """What the scanner found when the entry was written (types and scores; no positions)."""
    found = []
    for f in entry.payload.get("findings", []):
        if isinstance(f, dict):
            found.append(Finding(str(f.get("type")), 0, 0, float(f.get("score", 1.0))))
        else:
            found.append(Finding(str(f), 0, 0, 1.0))
    return found


def _selector(where: Where) -> dict[str, Any]:
    return {
        k: v
        for k, v in ((k, getattr(where, k)) for k in Where.__dataclass_fields__)
        if v is not None and k != "ids"
    }
