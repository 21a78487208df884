"""The work queue that workers share: one JetStream work-queue stream, one message per run to advance.

Each tenant's work has its own subject (``fleet.work.run.<tenant>``) and durable pull consumer, and
each consumer task of a worker takes the tenants that have work in turn (:class:`TenantQueues`): one
tenant's backlog, however long, delays another tenant's run by one turn, not by the backlog. Work
submitted without a tenant (the stranded-run sweep) goes on ``fleet.work.run``, one more turn.

A tenant's runs being advanced at once, over every worker of the fleet, are at most its
``max_in_flight`` (policy: ``fleet.limits.fair.work``). JetStream keeps that count: it is the
``max_ack_pending`` of the tenant's consumer, so a tenant at its cap is not delivered more work
whichever worker asks (a run whose worker died is still redelivered), and a consumer task gives it a
short turn only (the consumer's own counts say it is at its cap). A run parked for a person is acked
and does not count.

A message is published when a run is submitted (de-duplicated by the run id, so a retried submit never
makes a second job) and is acked only once the run has reached a durable stopping point. A worker that
dies leaves its message unacked; JetStream redelivers it after ``ack_wait`` to another worker, which
resumes the run from its checkpoint once the dead worker's lease has expired.

A message's headers also carry the W3C trace context of whatever submitted it (the coordinator's
``invoke_agent`` span for a caller's request; nothing from a background sweep) and the time it was
submitted, so a worker's slice joins the submitter's trace and the queue's lag can be measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from fleet import telemetry
from fleet.natsconn import Credentials, connect, patiently, replicas, subject_token

log = logging.getLogger(__name__)
STREAM = "FLEET_WORK"
RUN_SUBJECT = "fleet.work.run"
CONSUMER = "run-workers"
DUPLICATE_WINDOW_S = 600.0
SUBMITTED_AT_HEADER = "Fleet-Submitted-At"  # epoch seconds, the submitter's clock
TRACE_HEADERS = ("traceparent", "tracestate")
TRACE_KEY = "trace"  # in a run's record: the trace context of the request that created the run
SUBMIT_PATIENCE_S = 20.0  # how long a submit keeps trying while the broker fails over
PUBLISH_TIMEOUT_S = 2.0
TURN_FETCH_S = 0.2  # how long a turn waits on a tenant whose messages may all be in flight
AT_CAP_FETCH_S = 0.05  # how long it waits on a tenant at its cap (for a redelivery only)
IDLE_FETCH_S = 1.0  # how long a consumer task waits for work when no tenant has any (and no bell)
IDLE_WAIT_S = 5.0  # how long it waits for the bell (a ring missed while reconnecting costs this)
CONSUMER_INACTIVE_S = 7 * 24 * 3600.0  # a tenant's consumer nobody pulled from this long is removed
LIMITS_REFRESH_S = 30.0  # how often a pull asks policy again for its tenants' caps
CONTENDING_S = 10.0  # a tenant that had work this recently contends for the fleet with the others


class InFlight(NamedTuple):
    """A tenant's runs in flight over the whole fleet (>= 1 each): ``alone``, while no other tenant
    has work; ``shared``, while another has (its share: one tenant's backlog cannot hold the
    fleet's CPU while another tenant's run waits on it)."""

    alone: int
    shared: int


# A tenant's caps on runs in flight: the tenant token of its work subject -> its caps.
InFlightCap = Callable[[str], Awaitable[InFlight]]


class WorkShares:
    """What a worker process's pulls know together: which tenants had work lately (the stream's
    subjects, as each pull reads them) and the cap each tenant's consumer was last given, so that a
    change of contention updates a consumer once per process, not once per pull."""

    def __init__(self, contending_s: float = CONTENDING_S) -> None:
        self._contending_s = contending_s
        self._seen: dict[str, float] = {}  # a tenant's subject: when it last held work
        self.given: dict[str, int | None] = {}  # a subject: the max_ack_pending of its consumer

    def saw(self, holding: set[str]) -> None:
        now = time.monotonic()
        for subject in holding - {RUN_SUBJECT}:
            self._seen[subject] = now

    def contended(self, subject: str) -> bool:
        """Whether a tenant other than ``subject``'s had work within the last ``contending_s``."""
        now = time.monotonic()
        return any(s != subject and now - at < self._contending_s for s, at in self._seen.items())


def run_subject(tenant: str) -> str:
    """The subject of ``tenant``'s work (``fleet.work.run`` for work of no tenant)."""
    return f"{RUN_SUBJECT}.{subject_token(tenant)}" if tenant else RUN_SUBJECT


def consumer_of(subject: str) -> str:
    """The durable consumer of a work subject: ``run-workers`` for ``fleet.work.run``, and
    ``run-workers-<tenant token>`` for a tenant's."""
    return CONSUMER if subject == RUN_SUBJECT else f"{CONSUMER}-{subject.rsplit('.', 1)[1]}"


async def ensure_stream(js: JetStreamContext) -> None:
    try:
        await js.stream_info(STREAM)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=STREAM,
                subjects=["fleet.work.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
                num_replicas=replicas(js),
            )
        )


async def submit_run(client: NATS, run_id: str, attempt: str = "", tenant: str = "") -> None:
    """Ask a worker to advance ``run_id`` of ``tenant`` (idempotent within the de-duplication window
    for the same ``attempt``; a re-submission of a stranded run names a new attempt)."""
    js = client.jetstream()
    msg_id = f"run-{run_id}" + (f"-{attempt}" if attempt else "")
    headers = {"Nats-Msg-Id": msg_id, SUBMITTED_AT_HEADER: f"{time.time():.6f}"}

    async def publish() -> None:
        await ensure_stream(js)
        await js.publish(
            run_subject(tenant),
            run_id.encode(),
            headers=dict(telemetry.inject(headers)),
            timeout=PUBLISH_TIMEOUT_S,
        )

    # A cluster node failing over: the stream elects a new leader within seconds. The same message id
    # again cannot make a second job; past the patience, the stranded-run sweep submits it.
    await patiently(f"submitting run {run_id}", publish, patience_s=SUBMIT_PATIENCE_S)


def trace_context(message: Msg) -> dict[str, str]:
    """The W3C trace context a work message carries (empty if its submitter traced nothing)."""
    headers: Mapping[str, str] = message.headers or {}
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def submitted_at(message: Msg) -> float | None:
    """When the message was submitted (epoch seconds), if it says so."""
    raw = (message.headers or {}).get(SUBMITTED_AT_HEADER)
    with contextlib.suppress(TypeError, ValueError):
        return float(raw) if raw is not None else None
    return None  # a malformed stamp: the lag is unknown, the work still runs


class RunSubmitter:
    """The API process's handle on the work queue (an async context manager owning a connection)."""

    def __init__(
        self, nats_url: str, name: str, *, replicas: int = 1, credentials: Credentials | None = None
    ) -> None:
        self._url = nats_url
        self._name = name
        self._replicas = replicas
        self._credentials = credentials
        self._client: NATS | None = None

    async def __aenter__(self) -> RunSubmitter:
        self._client = await connect(
            self._url, self._name, replicas=self._replicas, credentials=self._credentials
        )
        await ensure_stream(self._client.jetstream())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Flushed and closed, not drained: the pull subscriptions the process's background jobs made
        # on this connection (triggers, signals) outlive the jobs, and a drain waits on each of them
        # until its timeout. Everything that used the connection has stopped by now.
        if self._client is not None:
            with contextlib.suppress(NatsError, TimeoutError):
                await self._client.flush(timeout=math.ceil(PUBLISH_TIMEOUT_S))
            await self._client.close()

    @property
    def client(self) -> NATS:
        if self._client is None:
            raise RuntimeError("RunSubmitter used outside its context")
        return self._client

    async def submit(self, run_id: str, attempt: str = "", tenant: str = "") -> None:
        """Queue ``run_id`` of ``tenant``; a run that is submitted again (resumed after a wait) names
        a new ``attempt``, or de-duplication would drop it."""
        if self._client is None:
            raise RuntimeError("RunSubmitter used outside its context")
        await submit_run(self._client, run_id, attempt, tenant)


def _consumer_config(ack_wait_s: float, subject: str, max_in_flight: int | None) -> ConsumerConfig:
    tenant = subject != RUN_SUBJECT
    return ConsumerConfig(
        name=consumer_of(subject),
        durable_name=consumer_of(subject),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        filter_subject=subject,
        inactive_threshold=CONSUMER_INACTIVE_S if tenant else None,
        max_ack_pending=max_in_flight,
    )


async def subscribe(
    client: NATS, ack_wait_s: float, subject: str = RUN_SUBJECT, *, max_in_flight: int | None = None
) -> JetStreamContext.PullSubscription:
    """A pull subscription to the durable consumer of ``subject``, created or brought to
    ``max_in_flight`` (messages delivered and not yet acked; None: the server's default) first."""
    js = client.jetstream()
    config = _consumer_config(ack_wait_s, subject, max_in_flight)

    async def pull_subscribe() -> JetStreamContext.PullSubscription:
        await ensure_stream(js)
        await js.add_consumer(STREAM, config)  # creates it, or updates what may change
        return await js.pull_subscribe(subject, durable=consumer_of(subject), config=config)

    # Every worker creates-or-binds the durable consumers when it starts; on a loaded cluster
    # the replicated consumer's creation can answer late.
    return await patiently("subscribing to the work queue", pull_subscribe)


class WorkBell:
    """Rings when work is submitted: a core NATS subscription to the work subjects (a publish that
    JetStream stores is delivered to core subscribers too). An idle consumer task waits on it instead
    of polling: a run submitted to an idle fleet is taken at once, not after a poll's timeout (which
    was up to :data:`IDLE_FETCH_S`, a second, on the run's latency). One per process, for all its
    consumer tasks; the ring says only which subject has work, the message is still pulled through the
    tenant's consumer (its cap, its turn)."""

    def __init__(self) -> None:
        self._rung = asyncio.Event()
        self._subject = ""

    async def follow(self, client: NATS) -> None:
        for subject in (RUN_SUBJECT, f"{RUN_SUBJECT}.*"):
            await client.subscribe(subject, cb=self._ring)

    async def _ring(self, message: Msg) -> None:
        self._subject, rung = message.subject, self._rung
        self._rung = asyncio.Event()
        rung.set()

    def ringing(self) -> asyncio.Event:
        """The event the next ring sets: taken before looking for work, so that no ring is missed."""
        return self._rung

    @property
    def subject(self) -> str:
        """The subject of the last ring."""
        return self._subject


class TenantQueues:
    """One consumer task's pull on the work queue: the subjects that hold work (the stream says
    which), each through its durable consumer, taken in turn after the one it took last; a tenant
    at its ``cap`` of runs in flight gets a short turn (a redelivery only)."""

    def __init__(
        self,
        client: NATS,
        ack_wait_s: float,
        cap: InFlightCap | None = None,
        bell: WorkBell | None = None,
        idle_wait_s: float = IDLE_WAIT_S,
        shares: WorkShares | None = None,
    ) -> None:
        self._client = client
        self._ack_wait_s = ack_wait_s
        self._cap = cap
        self._bell, self._idle_wait_s = bell, idle_wait_s
        self._shares = shares if shares is not None else WorkShares()
        self._subscriptions: dict[str, JetStreamContext.PullSubscription] = {}
        self._caps: dict[str, InFlight | None] = {}  # subject: its tenant's caps, as policy said
        self._caps_at = time.monotonic()
        self._turns: deque[str] = deque()  # subjects, the one to try next first

    async def next(self) -> Msg | None:
        """The next message, from the next subject in turn that has one; None if none has (after
        waiting for the bell, up to ``idle_wait_s``, or without one up to :data:`IDLE_FETCH_S`)."""
        ringing = self._bell.ringing() if self._bell is not None else None
        await self._refresh()
        for _ in range(len(self._turns)):
            subject = self._turns[0]
            self._turns.rotate(-1)
            message = await self._take(subject)
            if message is not None:
                return message
        if ringing is None or self._bell is None:  # no tenant has work: wait on the untenanted subject
            with contextlib.suppress(TimeoutError):
                [message] = await (await self._subscription(RUN_SUBJECT)).fetch(1, timeout=IDLE_FETCH_S)
                return message
            return None
        with contextlib.suppress(TimeoutError):  # no subject has work: until some is submitted
            async with asyncio.timeout(self._idle_wait_s):
                await ringing.wait()
            # The stream may not show the message yet (the ring can come first): pull from its
            # subject, whose fetch waits for it.
            return await self._take(self._bell.subject)
        return None

    async def _take(self, subject: str) -> Msg | None:
        """A message of ``subject``, through its consumer, waiting up to a turn for one."""
        subscription = await self._subscription(subject)
        wait_s = await self._turn_wait_s(subject)
        with contextlib.suppress(TimeoutError):
            [message] = await subscription.fetch(1, timeout=wait_s)
            return message
        return None

    async def _refresh(self) -> None:
        """Add the subjects that hold messages to the turns; drop those that hold none. Bring the
        consumers of the tenants it pulls from to their share (``shared`` while another tenant has
        had work lately, else ``alone``), asking policy again for the caps every
        :data:`LIMITS_REFRESH_S`."""
        info = await self._client.jetstream().stream_info(STREAM, subjects_filter="fleet.work.>")
        holding = {s for s, n in (info.state.subjects or {}).items() if n > 0}
        self._turns = deque(s for s in self._turns if s in holding)
        self._turns.extend(sorted(holding - set(self._turns)))
        self._shares.saw(holding)
        if self._cap is None:
            return
        if time.monotonic() - self._caps_at >= LIMITS_REFRESH_S:
            self._caps_at = time.monotonic()
            for subject in list(self._caps):
                self._caps[subject] = await self._caps_of(subject)
        for subject in list(self._caps):
            want, given = self._share(subject), self._shares.given.get(subject)
            if want != given:
                log.info("%s: runs in flight at most %s (was %s)", consumer_of(subject), want, given)
                config = _consumer_config(self._ack_wait_s, subject, want)
                await self._client.jetstream().add_consumer(STREAM, config)
                self._shares.given[subject] = want

    def _share(self, subject: str) -> int | None:
        """The runs in flight ``subject``'s tenant may have now (None: no cap)."""
        caps = self._caps.get(subject)
        if caps is None:
            return None
        return caps.shared if self._shares.contended(subject) else caps.alone

    async def _turn_wait_s(self, subject: str) -> float:
        """How long a turn's fetch on ``subject`` waits for a message. A capped tenant with its cap
        of runs in flight (JetStream's own counts) can be given only a redelivery (a run whose
        worker died: JetStream redelivers those first, cap or not), which comes at once: a short
        wait, not a full turn's."""
        if self._caps.get(subject) is None:
            return TURN_FETCH_S
        consumer = await self._client.jetstream().consumer_info(STREAM, consumer_of(subject))
        limit = consumer.config.max_ack_pending or 0
        at_cap = limit > 0 and (consumer.num_ack_pending or 0) >= limit
        return AT_CAP_FETCH_S if at_cap else TURN_FETCH_S

    async def _caps_of(self, subject: str) -> InFlight | None:
        if self._cap is None or subject == RUN_SUBJECT:
            return None
        caps = await self._cap(subject.rsplit(".", 1)[1])
        return InFlight(max(1, caps.alone), max(1, min(caps.shared, caps.alone)))

    async def close(self) -> None:
        """Unsubscribe from every consumer this pull used (before the connection drains, which
        would otherwise wait on each of them)."""
        subscriptions, self._subscriptions = self._subscriptions, {}
        for subscription in subscriptions.values():
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def _subscription(self, subject: str) -> JetStreamContext.PullSubscription:
        if subject not in self._subscriptions:
            self._caps[subject] = await self._caps_of(subject)
            cap = self._share(subject)
            self._subscriptions[subject] = await subscribe(
                self._client, self._ack_wait_s, subject, max_in_flight=cap
            )
            self._shares.given[subject] = cap
        return self._subscriptions[subject]
