"""The policy a running process enforces, and how a new bundle reaches every process at once.

``fleet policy push DIR`` compiles the bundle and runs its tests, then puts it (sources, data,
revision) in the NATS KV bucket ``fleet-policy`` under ``bundle``. Every process holds a
:class:`LivePolicy` that follows that key: a new revision is compiled in the process and swapped in
only if it compiles; otherwise the process keeps serving the revision it has and reports the refusal.
Each process reports what it enforces in the bucket ``fleet-policy-status`` (one key per process),
which ``fleet policy status`` lists. The bucket keeps the last ``HISTORY`` pushes: ``fleet policy
rollback`` pushes the one before the current again.

Until the first push, a process enforces the bundle it was started with (``FLEET_POLICY_DIR``, or
the installed one). A process that starts after a push reads the pushed bundle before it serves.

Every decision is also a record on ``fleet.decisions.<process>`` (stream ``FLEET_DECISIONS``),
shaped like OPA's decision log: its id, the query, the bundle revision, a hash of the input (never the
input: it may hold what policy exists to protect), the result, the time it took, who asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, NoKeysError

from fleet import telemetry
from fleet.errors import FleetError
from fleet.eventlog import EventLog
from fleet.natsconn import key_value, kv_history, kv_keys
from fleet.settings import ServiceSettings
from policy._bundle import Bundle
from policy.engine import Decision, PolicyEngine
from policy.errors import PolicyError
from policy.regorus_engine import RegorusEngine

log = logging.getLogger(__name__)

POLICY_BUCKET = "fleet-policy"
BUNDLE_KEY = "bundle"
STATUS_BUCKET = "fleet-policy-status"
HISTORY = 16  # pushes the bucket keeps (rollback goes back through them)
DECISIONS_STREAM = "FLEET_DECISIONS"
DECISIONS_MAX_AGE_S = 30 * 24 * 3600.0
DECISIONS_MAX_PENDING = 50_000
DEFAULT_TIMEOUT_S = 2.0
STATUS_EVERY_S = 15.0
STATUS_TTL_S = 60.0

EngineFactory = Callable[[Bundle], Awaitable[PolicyEngine]]


def bundle_message(bundle: Bundle, pushed_by: str, note: str = "", **facts: Any) -> bytes:
    """What ``push`` stores: the bundle's sources, data and revision, and who pushed it."""
    return json.dumps(
        {
            "revision": bundle.revision,
            "modules": [list(m) for m in bundle.modules],
            "data": bundle.data,
            "pushed_by": pushed_by,
            "pushed_at": time.time(),
            "note": note,
            **facts,
        }
    ).encode()


def bundle_of(message: bytes) -> tuple[Bundle, dict[str, Any]]:
    """The bundle in a pushed ``message`` (its revision computed again from its content: a message
    cannot name another content's revision), and the push's facts (who, when, note...)."""
    try:
        body = json.loads(message)
        modules = tuple((str(name), str(source)) for name, source in body["modules"])
        bundle = Bundle.of(Path(f"nats:{POLICY_BUCKET}"), modules, dict(body["data"]), str(body["revision"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise PolicyError(f"the pushed bundle is unreadable: {exc}") from exc
    facts = {k: v for k, v in body.items() if k not in ("revision", "modules", "data")}
    return bundle, facts


async def _bucket(client: NATS, name: str) -> Any:
    if name == STATUS_BUCKET:
        return await key_value(client, STATUS_BUCKET, history=1, ttl_s=STATUS_TTL_S)
    return await key_value(client, POLICY_BUCKET, history=HISTORY)


async def push(client: NATS, bundle: Bundle, pushed_by: str, note: str = "", **facts: Any) -> int:
    """Make ``bundle`` the fleet's policy (the caller has compiled and tested it); the push's
    sequence (every process reports the sequence it last handled)."""
    bucket = await _bucket(client, POLICY_BUCKET)
    return int(await bucket.put(BUNDLE_KEY, bundle_message(bundle, pushed_by, note, **facts)))


async def pushed(client: NATS) -> list[tuple[int, Bundle, dict[str, Any]]]:
    """The pushes the bucket keeps, oldest first: (sequence, bundle, facts)."""
    bucket = await _bucket(client, POLICY_BUCKET)
    kept = []
    for revision, value in await kv_history(bucket, BUNDLE_KEY):
        if value:
            bundle, facts = bundle_of(value)
            kept.append((revision, bundle, facts))
    return kept


async def rollback(client: NATS, pushed_by: str) -> tuple[int, Bundle]:
    """Push again the revision that was in force before the current one: after a rollback, the one
    before that (the bucket keeps the last ``HISTORY`` pushes). Its sequence and bundle."""
    kept = await pushed(client)
    if not kept:
        raise PolicyError("nothing was pushed: there is nothing to roll back")
    sequences = [seq for seq, _, _ in kept]
    _, current, facts = kept[-1]
    start = sequences.index(facts["restores"]) if facts.get("restores") in sequences else len(kept) - 1
    earlier = [(seq, bundle) for seq, bundle, _ in kept[:start] if bundle.revision != current.revision]
    if not earlier:
        raise PolicyError("no earlier revision is kept to roll back to")
    target_seq, target = earlier[-1]
    seq = await push(client, target, pushed_by, f"rollback from {current.revision}", restores=target_seq)
    return seq, target


async def statuses(client: NATS, *, fresh_within_s: float = 2.5 * STATUS_EVERY_S) -> list[dict[str, Any]]:
    """What every live process last reported it enforces (reports older than ``fresh_within_s``
    are of processes that stopped)."""
    bucket = await _bucket(client, STATUS_BUCKET)
    reports = []
    for key in await kv_keys(bucket):
        try:
            entry = await bucket.get(key)
        except KeyNotFoundError:
            continue
        if entry.value:
            report = json.loads(entry.value)
            if time.time() - float(report.get("reported_at", 0)) <= fresh_within_s:
                reports.append(report)
    return reports


class LivePolicy:
    """A :class:`~policy.engine.PolicyEngine` whose bundle follows the fleet's pushes."""

    def __init__(
        self,
        service_id: str,
        make_engine: EngineFactory,
        engine: PolicyEngine | Bundle,
        *,
        engine_name: str = "embedded",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """``engine``: the engine of the bundle this process starts with, or that bundle (its engine
        is made by :meth:`follow`, unless the fleet has pushed one; until then every decision is
        refused); ``make_engine`` makes the engine of a bundle (:class:`PolicyError` if it does not
        compile)."""
        self.service_id = service_id
        self._make = make_engine
        self._initial = engine if isinstance(engine, Bundle) else None
        self._engine: PolicyEngine | None = None if isinstance(engine, Bundle) else engine
        self._engine_name = engine_name
        self._timeout_s = timeout_s
        self._since = time.time()
        self._received: float | None = None
        self._seq = 0  # the push this process handled last (in force or refused)
        self._refused: dict[str, Any] | None = None
        self._swap = asyncio.Lock()
        self._reporting_lock = asyncio.Lock()
        self._subscription: Any = None
        self._status: Any = None
        self._reporting: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.decisions = EventLog(
            DECISIONS_STREAM,
            "fleet.decisions.>",
            f"fleet.decisions.{service_id}",
            max_age_s=DECISIONS_MAX_AGE_S,
            max_pending=DECISIONS_MAX_PENDING,
        )
        self._dropped = 0

    @property
    def revision(self) -> str:
        return self._engine.revision if self._engine is not None else "none"

    @property
    def engine(self) -> PolicyEngine | None:
        return self._engine

    async def decide(
        self, path: str, input_document: dict[str, Any], *, log_decision: bool = True
    ) -> Decision:
        """The current revision's decision; ``policy_unavailable`` (the caller fails closed) when
        there is none, the engine fails, or a remote engine has not answered within ``timeout_s``
        (the embedded engine evaluates in place, in microseconds: nothing can interrupt it). Every
        decision is recorded in the decision log."""
        started = time.perf_counter()
        try:
            decision = await self._evaluate(path, input_document)
        except FleetError:
            telemetry.record_policy_decision(path, "unavailable")
            raise
        telemetry.record_policy_decision(path, "allow" if decision.allow else "deny")
        self._record(decision, input_document, time.perf_counter() - started)
        if log_decision:
            log.debug(
                "decision %s %s allow=%s revision=%s",
                decision.decision_id,
                path,
                decision.allow,
                decision.revision,
            )
        return decision

    async def _evaluate(self, path: str, input_document: dict[str, Any]) -> Decision:
        engine = self._engine
        if engine is None:
            raise PolicyError("no policy is loaded here yet: every decision is a denial")
        try:
            async with asyncio.timeout(self._timeout_s):
                return await engine.decide(path, input_document, log_decision=False)
        except TimeoutError as exc:
            raise PolicyError(f"{path}: no decision within {self._timeout_s} s") from exc
        except FleetError:
            raise
        except Exception as exc:
            raise PolicyError(f"{path}: the engine failed: {exc!r}") from exc

    def _record(self, decision: Decision, input_document: dict[str, Any], seconds: float) -> None:
        digest = hashlib.sha256(json.dumps(input_document, sort_keys=True, default=str).encode()).hexdigest()
        try:
            self.decisions.record(
                {
                    "id": decision.decision_id,
                    "decision_id": decision.decision_id,
                    "labels": {"id": self.service_id, "engine": self._engine_name},
                    "bundles": {"fleet": {"revision": decision.revision}},
                    "path": decision.query.replace(".", "/"),
                    "input_sha256": digest,
                    "result": decision.result,
                    "timestamp": time.time(),
                    "metrics": {"timer_server_handler_ns": int(seconds * 1e9)},
                    "requested_by": self.service_id,
                }
            )
        except FleetError:
            self._dropped += 1
            if self._dropped % 1000 == 1:
                log.error("the decision log cannot keep up; %d decisions not recorded so far", self._dropped)

    async def follow(self, client: NATS) -> None:
        """Enforce what the fleet pushes from now on; returns once the current push (if any) is in
        force here or refused. The engine of the bundle this process started with is made only if
        the fleet has pushed none, or the pushed one does not compile here."""
        bucket = await _bucket(client, POLICY_BUCKET)  # exists before anyone reads it
        self._status = await _bucket(client, STATUS_BUCKET)
        try:
            entry = await bucket.get(BUNDLE_KEY)
        except (KeyNotFoundError, NoKeysError):
            entry = None
        if entry is not None and entry.value:
            await self._arrived(entry.value, int(entry.revision or 0))
        if self._engine is None and self._initial is not None:
            self._engine = await self._make(self._initial)

        # From the last push on: the one just read comes again and changes nothing.
        async def arrived(msg: Msg) -> None:
            await self._arrived(msg.data, int(msg.metadata.sequence.stream))

        self._subscription = await client.jetstream().subscribe(
            f"$KV.{POLICY_BUCKET}.{BUNDLE_KEY}",
            cb=arrived,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        )
        await self._report()
        self._reporting = asyncio.create_task(self._report_forever(), name="policy-status")

    async def stop(self) -> None:
        """Stop following and reporting (the process's report is withdrawn)."""
        if self._reporting is not None:
            self._reporting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reporting
            self._reporting = None
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None
        if self._status is not None:
            with contextlib.suppress(Exception):
                await self._status.delete(self.service_id)

    async def aclose(self) -> None:
        await self.stop()
        async with self._swap:
            engine, self._engine = self._engine, None
        await asyncio.gather(*self._closing, return_exceptions=True)
        await _close(engine)

    async def _arrived(self, message: bytes, seq: int) -> None:
        if not message:
            return
        received = time.time()
        async with self._swap:
            if seq and seq <= self._seq:
                return  # handled already (read at start, then delivered again)
            self._seq = max(self._seq, seq)
            revision = None
            try:
                bundle, facts = bundle_of(message)
                revision = bundle.revision
                if revision == self.revision:
                    self._refused = None
                    await self._report()
                    return
                engine = await self._make(bundle)
            except Exception as exc:
                error = exc.message if isinstance(exc, FleetError) else repr(exc)
                self._refused = {"revision": revision, "seq": seq, "error": error, "at": time.time()}
                log.error("a pushed policy bundle was refused, still enforcing %s: %s", self.revision, error)
            else:
                replaced, previous = self._engine, self.revision
                self._engine, self._since, self._received, self._refused = engine, time.time(), received, None
                self._retire(replaced)
                log.warning(
                    "policy %s in force (was %s), pushed by %s",
                    engine.revision,
                    previous,
                    facts.get("pushed_by"),
                )
            await self._report()

    def _retire(self, engine: PolicyEngine | None) -> None:
        """Close a replaced engine once decisions begun on it are done (they take at most the timeout)."""
        if engine is None or getattr(engine, "aclose", None) is None:
            return

        async def later() -> None:
            await asyncio.sleep(self._timeout_s)
            await _close(engine)

        task = asyncio.create_task(later())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _report_forever(self) -> None:
        while True:  # a process that stops reporting drops out of the status
            await asyncio.sleep(STATUS_EVERY_S)
            await self._report()

    async def _report(self) -> None:
        if self._status is None:
            return
        async with self._reporting_lock:
            report = {
                "service": self.service_id,
                "pid": os.getpid(),
                "engine": self._engine_name,
                "revision": self.revision,
                "seq": self._seq,  # the last push handled here
                "since": self._since,  # when the revision came into force here
                "received_at": self._received,  # when its push reached this process
                "refused": self._refused,
                "reported_at": time.time(),
            }
            try:
                await self._status.put(self.service_id, json.dumps(report).encode())
            except Exception as exc:
                log.warning("could not report the policy in force: %s", exc)


async def _close(engine: PolicyEngine | None) -> None:
    close = getattr(engine, "aclose", None)
    if close is not None:
        await close()


async def _embedded(bundle: Bundle) -> PolicyEngine:
    return RegorusEngine(bundle)


def live_policy(settings: ServiceSettings) -> LivePolicy:
    """The policy of a service process: the bundle it was started with (``FLEET_POLICY_DIR``, or
    the installed one) until it follows the fleet's pushes (:func:`enforcing`), evaluated by the
    engine the settings name (``FLEET_POLICY_ENGINE``)."""
    bundle = Bundle.load(settings.policy_dir) if settings.policy_dir else Bundle.load()
    timeout_s = settings.policy_timeout_s
    if settings.policy_engine == "opa":
        from policy.opa_rest import OpaRestEngine

        async def on_opa(pushed: Bundle) -> PolicyEngine:
            RegorusEngine(pushed)  # a bundle that does not compile here never reaches OPA
            token = settings.opa_token or None
            return await OpaRestEngine.load(settings.opa_url, pushed, timeout_s=timeout_s, token=token)

        RegorusEngine(bundle)  # a bundle that does not compile fails the start here, not at first use
        return LivePolicy(settings.service_id, on_opa, bundle, engine_name="opa", timeout_s=timeout_s)
    return LivePolicy(settings.service_id, _embedded, RegorusEngine(bundle), timeout_s=timeout_s)


@contextlib.asynccontextmanager
async def enforcing(policy: LivePolicy, client: NATS) -> AsyncIterator[LivePolicy]:
    """Follow the fleet's pushes and keep the decision log while the context is open."""
    async with policy.decisions.publishing(client):
        try:
            await policy.follow(client)
            yield policy
        finally:
            await policy.aclose()
