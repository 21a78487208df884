"""The policy a running process enforces, and how a new bundle reaches every process at once.

``fleet policy push DIR`` compiles the bundle and runs its tests, then puts it (sources, data,
revision), signed by its author (:mod:`policy._signing`), in the NATS KV bucket ``fleet-policy``
under ``bundle``. Every process holds a :class:`LivePolicy` that follows that key: a new revision is
swapped in only if its signature verifies with the operator's key (the operator signed it, or an
author the operator certified), it is newer than the push in force, and it compiles in the process;
otherwise the process keeps serving the revision it has and reports the refusal. Anyone who can
write the bucket can write to it, so nothing unsigned there is ever enforced.
Each process reports what it enforces in the bucket ``fleet-policy-status`` (one key per process),
which ``fleet policy status`` lists. The bucket keeps the last ``HISTORY`` pushes: ``fleet policy
rollback`` pushes the one before the current again.

Until the first push, a process enforces the bundle it was started with (``FLEET_POLICY_DIR``, or
the installed one). A process that starts after a push enforces, before it serves, the newest kept
push that verifies and compiles (so a forged last push leaves the last valid one in force), or the
bundle it was started with if none does.

Every decision is also a record on ``fleet.decisions.<process>`` (stream ``FLEET_DECISIONS``),
shaped like OPA's decision log: its id, the query, the bundle revision, a hash of the input (never the
input: it may hold what policy exists to protect), the result, the time it took, who asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
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
from nats.js.errors import KeyNotFoundError

from fleet import telemetry
from fleet.errors import FleetError
from fleet.eventlog import EventLog
from fleet.natsconn import key_value, kv_history, kv_keys
from fleet.settings import ServiceSettings
from policy._bundle import Bundle
from policy._signing import PolicySigner, PushRefused, PushVerifier
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


def rfc3339_now() -> str:
    """Now as the decision log writes its ``timestamp``: RFC 3339 in UTC with microseconds, as OPA's
    decision log does (it writes nanoseconds; Python's clock gives microseconds)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def bundle_message(
    bundle: Bundle,
    pushed_by: str,
    note: str = "",
    *,
    signer: PolicySigner | None = None,
    restores: int | None = None,
) -> bytes:
    """What ``push`` stores: the bundle's sources, data and revision, who pushed it, and (with a
    ``signer``) the author's signature over all of it. Without one, a push every process refuses."""
    facts: dict[str, Any] = {"pushed_by": pushed_by, "pushed_at": time.time(), "note": note}
    if restores is not None:
        facts["restores"] = restores
    if signer is not None:
        facts |= signer.sign(bundle, facts)
    body = {"revision": bundle.revision, "modules": [list(m) for m in bundle.modules], "data": bundle.data}
    return json.dumps(body | facts).encode()


def bundle_of(message: bytes) -> tuple[Bundle, dict[str, Any]]:
    """The bundle in a pushed ``message`` (its revision computed again from its content: a message
    cannot name another content's revision), and the push's facts (who, when, note, signature...),
    not yet verified (:meth:`PushVerifier.verify`)."""
    try:
        body = json.loads(message)
        modules = tuple((str(name), str(source)) for name, source in body["modules"])
        bundle = Bundle.of(Path(f"nats:{POLICY_BUCKET}"), modules, dict(body["data"]), str(body["revision"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PolicyError(f"the pushed bundle is unreadable: {exc}") from exc
    facts = {k: v for k, v in body.items() if k not in ("revision", "modules", "data")}
    return bundle, facts


async def _bucket(client: NATS, name: str) -> Any:
    if name == STATUS_BUCKET:
        return await key_value(client, STATUS_BUCKET, history=1, ttl_s=STATUS_TTL_S)
    return await key_value(client, POLICY_BUCKET, history=HISTORY)


async def push(
    client: NATS,
    bundle: Bundle,
    pushed_by: str,
    note: str = "",
    *,
    signer: PolicySigner,
    restores: int | None = None,
) -> int:
    """Make ``bundle`` the fleet's policy, signed by ``signer`` (the caller has compiled and tested
    it); the push's sequence (every process reports the sequence it last handled)."""
    bucket = await _bucket(client, POLICY_BUCKET)
    message = bundle_message(bundle, pushed_by, note, signer=signer, restores=restores)
    return int(await bucket.put(BUNDLE_KEY, message))


async def pushed(
    client: NATS, verifier: PushVerifier | None = None
) -> list[tuple[int, Bundle, dict[str, Any]]]:
    """The pushes the bucket keeps, oldest first: (sequence, bundle, facts). Unreadable ones are
    left out; with a ``verifier``, so is every push it refuses (what no process enforces)."""
    bucket = await _bucket(client, POLICY_BUCKET)
    kept = []
    for revision, value in await kv_history(bucket, BUNDLE_KEY):
        with contextlib.suppress(PolicyError):
            bundle, facts = bundle_of(value)
            if verifier is not None:
                verifier.verify(bundle, facts)
            kept.append((revision, bundle, facts))
    return kept


async def last_push(client: NATS, verifier: PushVerifier) -> tuple[int, str | None, str | None] | None:
    """The last push in the bucket: its sequence, its revision (None if unreadable), and why no
    process enforces it (None if it verifies); None if nothing was pushed."""
    bucket = await _bucket(client, POLICY_BUCKET)
    history = await kv_history(bucket, BUNDLE_KEY)
    if not history:
        return None
    seq, value = history[-1]
    revision = None
    try:
        bundle, facts = bundle_of(value)
        revision = bundle.revision
        verifier.verify(bundle, facts)
    except PolicyError as exc:
        return seq, revision, exc.message
    return seq, revision, None


async def rollback(
    client: NATS, pushed_by: str, *, signer: PolicySigner, verifier: PushVerifier
) -> tuple[int, Bundle]:
    """Push again, signed by ``signer``, the revision that was in force before the current one:
    after a rollback, the one before that (the bucket keeps the last ``HISTORY`` pushes; pushes
    that do not verify are passed over). Its sequence and bundle."""
    kept = await pushed(client, verifier)
    if not kept:
        raise PolicyError("nothing valid was pushed: there is nothing to roll back")
    sequences = [seq for seq, _, _ in kept]
    _, current, facts = kept[-1]
    start = sequences.index(facts["restores"]) if facts.get("restores") in sequences else len(kept) - 1
    earlier = [(seq, bundle) for seq, bundle, _ in kept[:start] if bundle.revision != current.revision]
    if not earlier:
        raise PolicyError("no earlier revision is kept to roll back to")
    target_seq, target = earlier[-1]
    note = f"rollback from {current.revision}"
    seq = await push(client, target, pushed_by, note, signer=signer, restores=target_seq)
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
        verifier: PushVerifier | None = None,
        metrics_every_s: float = telemetry.METRICS_EVERY_S,
    ) -> None:
        """``engine``: the engine of the bundle this process starts with, or that bundle (its engine
        is made by :meth:`follow`, unless the fleet has pushed one; until then every decision is
        refused); ``make_engine`` makes the engine of a bundle (:class:`PolicyError` if it does not
        compile); ``verifier`` checks each push's signature (without one, every push is refused);
        ``metrics_every_s``: how often :func:`enforcing` publishes the process's metrics."""
        self.service_id = service_id
        self.metrics_every_s = metrics_every_s
        self._verifier = verifier
        self._pushed_at = 0.0  # when the push in force was signed (0: the bundle started with)
        self._author: str | None = None
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

    @property
    def refused(self) -> dict[str, Any] | None:
        """The last push this process refused, if it refused the last one it handled: its ``seq``,
        ``revision``, ``reason`` (``unsigned``, ``bad_signature``, ``unauthorized``, ``stale``,
        ``no_trust_root``, ``unreadable``, ``does_not_compile``) and ``error``."""
        return self._refused

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
                    "timestamp": rfc3339_now(),
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
        if self._verifier is None:
            log.warning("no operator key (FLEET_OPERATOR_JWK_FILE) here: every pushed bundle is refused")
        await self._start_from(await kv_history(bucket, BUNDLE_KEY))
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

    async def _start_from(self, history: list[tuple[int, bytes]]) -> None:
        """Enforce the newest push of ``history`` that verifies and compiles here (by the time it
        was signed: a valid push written again later is no newer), and report why the last push
        is not in force if it is not: a forged last push leaves the last valid one in force."""
        if not history:
            return
        async with self._swap:
            in_force = None
            for seq, message in self._valid_newest_first(history):
                if await self._handle(message, seq, time.time()):
                    in_force = seq
                    break
            last_seq, last = history[-1]
            if in_force != last_seq:
                await self._handle(last, last_seq, time.time())

    def _valid_newest_first(self, history: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        valid = []
        for seq, message in history:
            with contextlib.suppress(PolicyError):
                bundle, facts = bundle_of(message)
                self._verify(bundle, facts)
                valid.append((float(facts["pushed_at"]), seq, message))
        return [(seq, message) for _, seq, message in sorted(valid, reverse=True)]

    async def _arrived(self, message: bytes, seq: int) -> None:
        if not message:
            return
        received = time.time()
        async with self._swap:
            if seq and seq <= self._seq:
                return  # handled already (read at start, then delivered again)
            await self._handle(message, seq, received)
            await self._report()

    async def _handle(self, message: bytes, seq: int, received: float) -> bool:
        """Put push ``seq`` in force if it verifies, is newer than the push in force and compiles
        here; otherwise record why not and keep the revision in force. Whether it is in force."""
        self._seq = max(self._seq, seq)
        revision = None
        try:
            bundle, facts = bundle_of(message)
            revision = bundle.revision
            author = self._verify(bundle, facts)
            pushed_at = float(facts["pushed_at"])
            if revision == self.revision:  # in force already: nothing to swap
                self._refused = None
                if pushed_at > self._pushed_at:
                    self._pushed_at, self._author = pushed_at, author
                return True
            if pushed_at <= self._pushed_at:
                raise PushRefused("stale", "the push is not newer than the one in force (written again?)")
            engine = await self._make(bundle)
        except Exception as exc:
            self._refuse(revision, seq, exc)
            return False
        replaced, previous = self._engine, self.revision
        self._engine, self._since, self._received, self._refused = engine, time.time(), received, None
        self._pushed_at, self._author = pushed_at, author
        self._retire(replaced)
        log.warning(
            "policy %s in force (was %s), pushed by %s, signed by %s",
            engine.revision,
            previous,
            facts.get("pushed_by"),
            author,
        )
        return True

    def _verify(self, bundle: Bundle, facts: dict[str, Any]) -> str:
        if self._verifier is None:
            raise PushRefused("no_trust_root", "this process has no operator key to verify pushes with")
        return self._verifier.verify(bundle, facts)

    def _refuse(self, revision: str | None, seq: int, exc: Exception) -> None:
        error = exc.message if isinstance(exc, FleetError) else repr(exc)
        if isinstance(exc, PushRefused):
            reason = exc.reason
        else:
            reason = "unreadable" if revision is None else "does_not_compile"
        self._refused = {
            "revision": revision,
            "seq": seq,
            "reason": reason,
            "error": error,
            "at": time.time(),
        }
        log.error("a pushed policy bundle was refused, still enforcing %s: %s", self.revision, error)

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
                "author": self._author,  # who signed the push in force (None: the bundle started with)
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
    engine the settings name (``FLEET_POLICY_ENGINE``). Pushes are verified with the operator's
    public key (``FLEET_OPERATOR_JWK_FILE``); a process without one refuses every push."""
    bundle = Bundle.load(settings.policy_dir) if settings.policy_dir else Bundle.load()
    timeout_s = settings.policy_timeout_s
    jwk_file = settings.operator_jwk_file
    verifier = PushVerifier.from_file(jwk_file) if jwk_file is not None else None
    if settings.policy_engine == "opa":
        from policy.opa_rest import OpaRestEngine

        async def on_opa(pushed: Bundle) -> PolicyEngine:
            RegorusEngine(pushed)  # a bundle that does not compile here never reaches OPA
            token = settings.opa_token or None
            return await OpaRestEngine.load(settings.opa_url, pushed, timeout_s=timeout_s, token=token)

        RegorusEngine(bundle)  # a bundle that does not compile fails the start here, not at first use
        return LivePolicy(
            settings.service_id,
            on_opa,
            bundle,
            engine_name="opa",
            timeout_s=timeout_s,
            verifier=verifier,
            metrics_every_s=settings.metrics_every_s,
        )
    return LivePolicy(
        settings.service_id,
        _embedded,
        RegorusEngine(bundle),
        timeout_s=timeout_s,
        verifier=verifier,
        metrics_every_s=settings.metrics_every_s,
    )


@contextlib.asynccontextmanager
async def enforcing(policy: LivePolicy, client: NATS) -> AsyncIterator[LivePolicy]:
    """Follow the fleet's pushes, keep the decision log and publish the process's metrics (see
    :func:`fleet.telemetry.publishing_metrics`) while the context is open: every process that
    enforces policy is a fleet service on the bus."""
    async with (
        policy.decisions.publishing(client),
        telemetry.publishing_metrics(client, policy.service_id, policy.metrics_every_s),
    ):
        try:
            await policy.follow(client)
            yield policy
        finally:
            await policy.aclose()
