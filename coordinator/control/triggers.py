"""Ambient triggers: events on ``fleet.events.>`` start runs, as the trigger policy says.

For each event (a durable pull consumer on the events stream, see :mod:`fleet.events`):

1. the event is parsed, its tenant and source taken from its subject
   (``fleet.events.<tenant>.<source>.<name>...``); a malformed one, or one whose envelope names
   another tenant or source than its subject, goes to the dead-letter subject with the reason;
2. ``fleet.triggers.decision`` maps (logical subject, type, source, tenant, data) to a run template,
   or to nothing (the event is acked and counted: not every event needs a run);
3. the run is created with an id derived from the tenant, source and event id, so a redelivered or
   republished event finds its run instead of making a second one (the ingest is idempotent by
   (tenant, source, id); the stream's own de-duplication is not relied on), and submitted (the
   runs of a fetch's events are created in one transaction and submitted together: see
   :meth:`TriggerIngest.settle`);
4. only then is the event acked. A failure on the way (the database, the broker) leaves it unacked:
   it is delivered again, up to ``MAX_DELIVER`` times, and then dead-lettered with the reason. A
   dead letter is acked, so it blocks nothing behind it.

In-flight work is bounded: a consumer holds at most ``batch`` events at once (JetStream's
``max_ack_pending`` bounds the whole consumer), and takes more only when those are settled.

Each tenant's events are taken at most as often as ``fleet.limits.fair.event_ingest`` allows (per
second, burst; each coordinator counts its own): an event over its tenant's rate is put back
(delivered again after a backoff with jitter) so that other tenants' events go first, and one put
back ``MAX_DELIVER`` times is dead-lettered with the reason ``[rate_limited]`` (kept, never dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import uuid
from collections import Counter
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.client import JetStreamContext

from coordinator.planning.plan import PlanError, parse_steps
from coordinator.record import work
from coordinator.record.runs import BatchClosed, NewRun, PostgresRunStore, Unstorable
from fleet.errors import ErrorCode, FleetError
from fleet.events import (
    DEAD_LETTER_SUBJECT,
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    Event,
    EventError,
    ensure_event_streams,
    parse_event,
)
from fleet.rates import RateLimits
from fleet.retry import backoff_s, retrying
from fleet.vocabulary import EventType
from policy import Decision, PolicyEngine

log = logging.getLogger(__name__)

CONSUMER = "triggers"
MAX_DELIVER = 5
MAX_ACK_PENDING = 256
RETRY_DELAY_S = 2.0


def fill_template(value: Any, event: Event) -> Any:
    """A template's value with each ``{"$event": "path"}`` replaced by that field of the event's
    envelope (e.g. ``data.invoice``, ``tenant``, ``id``)."""
    if isinstance(value, dict):
        if set(value) == {"$event"} and isinstance(value["$event"], str):
            current: Any = event.envelope()
            for key in value["$event"].split("."):
                if not isinstance(current, dict) or key not in current:
                    raise EventError(
                        f"the trigger's template asks for {value['$event']}, which the event lacks"
                    )
                current = current[key]
            return current
        return {key: fill_template(item, event) for key, item in value.items()}
    if isinstance(value, list):
        return [fill_template(item, event) for item in value]
    return value


COLLECT_STEP = "collect"
_BATCH_NAMESPACE = uuid.UUID("0b6c7f0e-2d4a-4f7e-9b1e-3f5a8c9d2e71")


def window_number(time: Any, window_s: float) -> int:
    """The number of the window of ``window_s`` seconds that ``time`` (RFC 3339) falls in."""
    try:
        at = dt.datetime.fromisoformat(str(time))
    except ValueError as exc:
        raise EventError("time must be an RFC 3339 time") from exc
    if at.tzinfo is None:
        raise EventError("time needs a UTC offset")
    return int(at.timestamp() // window_s)


def batch_item_key(event: Event) -> str:
    """The key of an event's item in its tenant's batch: one item per (source, id) (the batch is the
    tenant's already; a source token has no ``/``, so the key is unambiguous)."""
    return f"{event.source}/{event.id}"


def batch_owner(rule: str) -> str:
    return f"batch:{rule}"


def batch_run_id(tenant: str, rule: str, window: int) -> str:
    """The id of a tenant's batch run for a rule and a window: one run per window, whatever the
    number of events or their deliveries."""
    return str(uuid.uuid5(_BATCH_NAMESPACE, f"{tenant}/{rule}/{window}"))


def _wait_key(event: Event) -> tuple[str, str, str, str]:
    """What the runs waiting for ``event`` are found by (see PostgresRunStore.awaiting_events)."""
    return (event.tenant, event.subject, event.type, event.source)


def _settled(outcome: str | NewRun | Event | BaseException) -> str | BaseException:
    if isinstance(outcome, NewRun | Event):
        raise AssertionError(f"{outcome!r} was left unsettled")
    return outcome


class TriggerIngest:
    """Turns events into runs (see the module's doc)."""

    def __init__(self, client: NATS, runs: PostgresRunStore, engine: PolicyEngine, batch: int = 64) -> None:
        self._client = client
        self._runs = runs
        self._engine = engine
        self._batch = batch
        self._rates = RateLimits()  # events taken per tenant

    async def subscribe(self, ack_wait_s: float = 30.0) -> JetStreamContext.PullSubscription:
        js = self._client.jetstream()
        await ensure_event_streams(js)
        config = ConsumerConfig(
            durable_name=CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=MAX_DELIVER + 1,  # the last delivery only dead-letters it
            max_ack_pending=MAX_ACK_PENDING,
        )
        return await js.pull_subscribe(EVENTS_SUBJECTS, durable=CONSUMER, stream=EVENTS_STREAM, config=config)

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Take events until cancelled; trouble with the broker or one event never ends the loop."""
        if ready is not None:
            await ready.wait()
        # The broker not there yet, or away (failing over): tried again with backoff, for ever.
        subscription = await retrying("subscribing to events", self.subscribe, retry_on=(Exception,))
        failed = 0  # fetches failed in a row
        while True:
            try:
                messages = await subscription.fetch(self._batch, timeout=5)
                failed = 0
            except TimeoutError:  # nats' own, or the bare one its fetch raises when its first answer
                continue  # came at the deadline: no message, not a failure
            except Exception:  # the broker is away: try again shortly
                failed += 1
                log.warning("could not fetch events", exc_info=True)
                await asyncio.sleep(backoff_s(failed, base_s=RETRY_DELAY_S / 4, cap_s=RETRY_DELAY_S * 4))
                continue
            if not messages:
                continue
            outcomes = await self.settle(messages)
            for outcome in outcomes:
                if isinstance(outcome, Exception):  # e.g. a dead letter that could not be published:
                    # the event stays unacked and comes back after ack_wait
                    log.warning("an event could not be settled", exc_info=outcome)
            counts = Counter(o for o in outcomes if isinstance(o, str))
            log.info("%d events settled: %s", len(messages), ", ".join(f"{n} {o}" for o, n in counts.items()))

    async def settle(self, messages: list[Msg]) -> list[str | BaseException]:
        """Settle a fetch of events; what became of each: ``started``, ``batched``, ``ignored``,
        ``dead``, ``retry`` or ``deferred`` (over its tenant's rate), or the error that left it
        unsettled (it is delivered again).

        Each event is decided on its own; the runs they start are then created together, in one
        transaction, and their work messages published together, so that a burst of events becomes
        runs at the broker's pace rather than at a transaction per event. An event is acked only
        once its run is durable and queued; a failure of the transaction leaves every event of it
        to be created one at a time, so that an event whose run cannot be stored fails alone (a run
        id is derived from its event: a second delivery finds the run)."""
        limits: dict[str, asyncio.Future[Decision]] = {}  # each tenant's ingest rate, decided once a fetch
        taken = await asyncio.gather(*(self._take(m, limits) for m in messages), return_exceptions=True)
        events = [(m, e) for m, e in zip(messages, taken, strict=True) if isinstance(e, Event)]
        try:  # the runs waiting for these events, in one statement
            waiting = await self._runs.awaiting_events([_wait_key(e) for _, e in events])
            deciding = [self._decide(m, e, waiting[_wait_key(e)]) for m, e in events]
        except Exception as exc:
            deciding = [self._failed(m, exc) for m, _ in events]
        outcomes = dict(
            zip(
                (id(m) for m, _ in events),
                await asyncio.gather(*deciding, return_exceptions=True),
                strict=True,
            )
        )
        decided = [outcomes.get(id(m), t) for m, t in zip(messages, taken, strict=True)]
        starting = [(m, run) for m, run in zip(messages, decided, strict=True) if isinstance(run, NewRun)]
        if starting:
            try:
                await self._runs.create_runs([run for _, run in starting])
                settling = [self._submit(m, run) for m, run in starting]
            except Exception:  # one event's run may be what failed it: each alone, so that one fails alone
                log.warning("creating %d runs together failed: one at a time", len(starting), exc_info=True)
                settling = [self._start_alone(m, run) for m, run in starting]
            settled = await asyncio.gather(*settling, return_exceptions=True)
            started = dict(zip((id(m) for m, _ in starting), settled, strict=True))
            decided = [started.get(id(m), d) for m, d in zip(messages, decided, strict=True)]
        return [_settled(d) for d in decided]

    async def _take(self, message: Msg, limits: dict[str, asyncio.Future[Decision]]) -> Event | str:
        """The event, if it is well formed and within its tenant's rate (``limits``: the rates
        decided for this fetch, by tenant); else what became of it."""
        try:
            event = parse_event(message.subject, message.data, message.headers)
            wait_s = await self._over_rate(event.tenant, limits)
            if wait_s:
                return await self._put_back(message, event.tenant, wait_s)
        except EventError as exc:
            await self._dead_letter(message, exc)
            return "dead"
        except Exception as exc:  # infrastructure trouble: the event is kept
            return await self._failed(message, exc)
        return event

    async def _decide(self, message: Msg, event: Event, waiting: list[tuple[str, str]]) -> str | NewRun:
        """What an event is to do (``waiting``: the runs that wait for it): the run it starts (not
        created yet), or what became of it."""
        try:
            outcome = await self._start(event, waiting)
        except EventError as exc:
            await self._dead_letter(message, exc)
            return "dead"
        except Exception as exc:  # infrastructure trouble: the event is kept
            return await self._failed(message, exc)
        if not isinstance(outcome, NewRun):
            await message.ack()
        return outcome

    async def _start_alone(self, message: Msg, run: NewRun) -> str:
        """Create one event's run in a transaction of its own, then queue it: a run that cannot be
        stored as it is (:class:`Unstorable`, e.g. a NUL character in the event's text) is
        dead-lettered with the reason at once; other trouble leaves the event to come back."""
        try:
            await self._runs.create_runs([run])
        except Unstorable as exc:
            await self._dead_letter(message, exc)
            return "dead"
        except Exception as exc:
            return await self._failed(message, exc)
        return await self._submit(message, run)

    async def _submit(self, message: Msg, run: NewRun) -> str:
        """Queue the created run for the workers, then ack its event."""
        try:
            await work.submit_run(self._client, run.run_id, tenant=run.tenant)
        except Exception as exc:  # the run is durable; its event comes back and submits it again
            return await self._failed(message, exc)
        await message.ack()
        log.debug("event on %s started run %s", message.subject, run.run_id)
        return "started"

    async def _failed(self, message: Msg, exc: Exception) -> str:
        """An event whose settling failed for infrastructure trouble: delivered again (after a
        delay), or dead-lettered with the reason once delivered ``MAX_DELIVER`` times."""
        delivered = message.metadata.num_delivered
        if delivered >= MAX_DELIVER:
            why = FleetError.from_dict(exc.to_dict()) if isinstance(exc, FleetError) else None
            failed = f"failed {delivered} times; last: {exc if why is None else why.message}"
            await self._dead_letter(message, FleetError(ErrorCode.INTERNAL, failed, cause=why))
            return "dead"
        log.warning(
            "event on %s failed (delivery %d); retrying",
            message.subject,
            delivered,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        with contextlib.suppress(Exception):
            await message.nak(delay=RETRY_DELAY_S * delivered)
        return "retry"

    async def _over_rate(self, tenant: str, limits: dict[str, asyncio.Future[Decision]]) -> float:
        """0 if an event of ``tenant`` may be taken now (and counted), else the seconds until one may.
        The tenant's rate is decided once for a fetch (``limits``), each event counted against it."""
        if tenant not in limits:
            limits[tenant] = asyncio.ensure_future(
                self._engine.decide("fleet.limits.fair.event_ingest", {"tenant": tenant})
            )
        decision = await limits[tenant]
        if not decision.allow:  # the policy cannot be evaluated: retried, then dead-lettered
            raise FleetError(ErrorCode.POLICY_UNAVAILABLE, "; ".join(decision.reasons))
        return self._rates.take((tenant,), decision.result)

    async def _put_back(self, message: Msg, tenant: str, wait_s: float) -> str:
        """An event over its tenant's rate: delivered again later, or dead-lettered (``rate_limited``)
        once it has been put back ``MAX_DELIVER`` times."""
        delivered = message.metadata.num_delivered
        if delivered >= MAX_DELIVER:
            retry_s = max(1, math.ceil(wait_s))
            too_often = (
                f"tenant {tenant} sent events faster than policy allows (fleet.limits.fair.event_ingest);"
                f" retry in {retry_s} s"
            )
            error = FleetError(ErrorCode.RATE_LIMITED, too_often, retryable=True, retry_after_s=retry_s)
            await self._dead_letter(message, error)
            return "dead"
        delay_s = max(wait_s, backoff_s(delivered, base_s=RETRY_DELAY_S, cap_s=60.0))
        log.info("event of tenant %s over its rate: delivered again in %.1f s", tenant, delay_s)
        await message.nak(delay=delay_s)
        return "deferred"

    async def _start(self, event: Event, waiting: list[tuple[str, str]]) -> str | NewRun:
        await self._deliver_to_waiting(event, waiting)
        decision = await self._engine.decide(
            "fleet.triggers.decision",
            {
                "subject": event.subject,
                "type": event.type,
                "source": event.source,
                "tenant": event.tenant,
                "data": event.data,
            },
        )
        if not decision.allow:  # the policy cannot be evaluated: retried, then dead-lettered
            raise FleetError(ErrorCode.POLICY_UNAVAILABLE, "; ".join(decision.reasons))
        for closing in decision.result.get("closes") or []:
            await self._close_batch(event, str(closing["rule"]), closing["batch"])
        template = decision.result.get("run")
        if template and template.get("batch"):
            return await self._add_to_batch(event, str(decision.result.get("rule")), template)
        if not template:
            log.debug("event %s on %s: no trigger", event.id, event.subject)
            return "ignored"
        try:
            steps = parse_steps(fill_template(template.get("steps"), event))
        except PlanError as exc:
            raise EventError(f"trigger {decision.result.get('rule')}: {exc.message}") from exc
        request = {
            "event": event.envelope(),
            "trigger": decision.result.get("rule"),
            "policy_decision": decision.decision_id,
        }
        plan = [s.to_dict() for s in steps]
        return NewRun(event.run_id(), event.tenant, f"event:{event.source}", request, plan)

    async def _add_to_batch(self, event: Event, rule: str, template: dict[str, Any]) -> str:
        """Add the event's data as an item of its tenant's batch run for the rule and the event's
        window (created with the first item); the event is acked once the item is durable. An item
        for a batch that has closed is refused (dead-lettered with the reason), never dropped."""
        batch = template["batch"]
        window_s, close_after_s = float(batch["window_s"]), float(batch.get("close_after_s", 0))
        window = window_number(event.time, window_s)
        closes = dt.datetime.fromtimestamp((window + 1) * window_s + close_after_s, dt.UTC)
        run_id = batch_run_id(event.tenant, rule, window)
        try:
            steps = parse_steps(
                [
                    {"id": COLLECT_STEP, "wait": {"batch": rule, "until": closes.isoformat()}},
                    *[
                        {**s, "after": [*s.get("after", []), COLLECT_STEP]}
                        for s in template.get("steps") or []
                    ],
                ]
            )
        except PlanError as exc:
            raise EventError(f"trigger {rule}: {exc.message}") from exc
        request = {"batch": rule, "window": window, "closes": closes.isoformat()}
        try:
            created, added = await self._runs.add_batch_item(
                run_id,
                event.tenant,
                batch_owner(rule),
                request,
                [s.to_dict() for s in steps],
                batch_item_key(event),
                {**event.data, "event_id": event.id},
            )
        except BatchClosed as exc:
            raise EventError(exc.message) from exc
        if created:
            await work.submit_run(self._client, run_id, tenant=event.tenant)
            log.info("event %s started batch run %s (%s, window %d)", event.id, run_id, rule, window)
        return "batched" if added else "ignored"

    async def _close_batch(self, event: Event, rule: str, batch: dict[str, Any]) -> None:
        """An event on a batch rule's close subject: close the tenant's batch of the window that
        ``data.window_of`` (a time in it) names, by default the window of the event's own time, and
        let its run go on. A run that has not reached its collection yet is retried."""
        window_of = event.data.get("window_of", event.time)
        run_id = batch_run_id(event.tenant, rule, window_number(window_of, float(batch["window_s"])))
        expected = event.data.get("count")
        if isinstance(expected, int | float) and not isinstance(expected, bool):
            # The producer says how many items it sent: events on other subjects may be consumed
            # after this one, so the close waits (comes back) until the batch holds them all.
            held = await self._runs.batch_size(run_id, event.tenant)
            if held < expected:
                raise FleetError(
                    ErrorCode.CONFLICT,
                    f"batch run {run_id} holds {held} of the {int(expected)} items its close names yet",
                    retryable=True,
                )
        if not await self._runs.request_batch_close(run_id, event.tenant):
            log.info("event %s closes no open batch of %s", event.id, rule)
            return
        try:
            seq = await self._runs.answer_wait(
                run_id,
                event.tenant,
                "batch",
                {"decision": "closed", "event": event.id},
                f"event:{event.source}",
                event=EventType.BATCH_CLOSE_REQUESTED,
                text=f"event {event.id} closes the batch of {rule}",
                awaited=f"batch:{COLLECT_STEP}",
            )
        except FleetError as exc:  # not parked at its collection yet: the event comes back
            raise FleetError(
                ErrorCode.CONFLICT, f"batch run {run_id} is not at its collection yet", retryable=True
            ) from exc
        await work.submit_run(self._client, run_id, f"closed-{seq}", event.tenant)

    async def _deliver_to_waiting(self, event: Event, waiting: list[tuple[str, str]]) -> None:
        """Answer the waits of the tenant's runs that wait for this event (``waiting``: those of
        its tenant, its subject's, with an event wait step on its logical subject, and its type and
        source if the wait names them), and hand those runs back to the workers. A wait answered
        already (a redelivery, or another event of the same fetch) is left alone."""
        for run_id, awaited in waiting:
            try:
                seq = await self._runs.answer_wait(
                    run_id,
                    event.tenant,
                    "event",
                    {"decision": "event", "event": event.envelope()},
                    f"event:{event.source}",
                    event=EventType.EVENT_DELIVERED,
                    text=f"event {event.id} on {event.subject} answers {awaited}",
                    awaited=awaited,
                )
            except FleetError:  # answered by an earlier delivery, or no longer waiting
                continue
            await work.submit_run(self._client, run_id, f"event-{seq}", event.tenant)

    async def _dead_letter(self, message: Msg, error: FleetError) -> None:
        """Publish ``message`` to the dead letters with why (``reason``, the message; ``error``, the
        error as data), then ack it."""
        log.warning("event on %s dead-lettered (%s): %s", message.subject, error.code, error.message)
        envelope = {
            "subject": message.subject,
            "reason": error.message,
            "error": error.to_dict(),
            "deliveries": message.metadata.num_delivered,
            "payload": message.data.decode("utf-8", errors="replace"),
            "headers": dict(message.headers or {}),  # a binary-mode event's attributes
        }
        headers = {"Nats-Msg-Id": f"dead-{message.metadata.stream}-{message.metadata.sequence.stream}"}
        await self._client.jetstream().publish(
            DEAD_LETTER_SUBJECT, json.dumps(envelope).encode(), headers=headers
        )
        await message.ack()
