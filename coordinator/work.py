"""The work queue that workers share: one JetStream work-queue stream, one message per run to advance.

A message is published when a run is submitted (de-duplicated by the run id, so a retried submit never
makes a second job) and is acked only once the run has reached a durable stopping point. A worker that
dies leaves its message unacked; JetStream redelivers it after ``ack_wait`` to another worker, which
resumes the run from its checkpoint once the dead worker's lease has expired.

A message's headers also carry the W3C trace context of whatever submitted it (the coordinator's
``invoke_agent`` span for a caller's request; nothing from a background sweep) and the time it was
submitted, so a worker's slice joins the submitter's trace and the queue's lag can be measured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from fleet import telemetry
from fleet.natsconn import Credentials, connect, patiently, replicas

STREAM = "FLEET_WORK"
RUN_SUBJECT = "fleet.work.run"
CONSUMER = "run-workers"
DUPLICATE_WINDOW_S = 600.0
SUBMITTED_AT_HEADER = "Fleet-Submitted-At"  # epoch seconds, the submitter's clock
TRACE_HEADERS = ("traceparent", "tracestate")
TRACE_KEY = "trace"  # in a run's record: the trace context of the request that created the run
SUBMIT_PATIENCE_S = 20.0  # how long a submit keeps trying while the broker fails over
PUBLISH_TIMEOUT_S = 2.0


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


async def submit_run(client: NATS, run_id: str, attempt: str = "") -> None:
    """Ask a worker to advance ``run_id`` (idempotent within the de-duplication window for the same
    ``attempt``; a re-submission of a stranded run names a new attempt)."""
    js = client.jetstream()
    msg_id = f"run-{run_id}" + (f"-{attempt}" if attempt else "")
    headers = {"Nats-Msg-Id": msg_id, SUBMITTED_AT_HEADER: f"{time.time():.6f}"}

    async def publish() -> None:
        await ensure_stream(js)
        await js.publish(
            RUN_SUBJECT, run_id.encode(), headers=dict(telemetry.inject(headers)), timeout=PUBLISH_TIMEOUT_S
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
        if self._client is not None:
            await self._client.drain()

    @property
    def client(self) -> NATS:
        if self._client is None:
            raise RuntimeError("RunSubmitter used outside its context")
        return self._client

    async def submit(self, run_id: str, attempt: str = "") -> None:
        """Queue ``run_id``; a run that is submitted again (resumed after a wait) names a new
        ``attempt``, or de-duplication would drop it."""
        if self._client is None:
            raise RuntimeError("RunSubmitter used outside its context")
        await submit_run(self._client, run_id, attempt)


async def subscribe(client: NATS, ack_wait_s: float) -> JetStreamContext.PullSubscription:
    js = client.jetstream()
    config = ConsumerConfig(
        durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s, max_deliver=-1
    )

    async def pull_subscribe() -> JetStreamContext.PullSubscription:
        await ensure_stream(js)
        return await js.pull_subscribe(RUN_SUBJECT, durable=CONSUMER, config=config)

    # Every worker creates-or-binds the one durable consumer when it starts; on a loaded cluster
    # the replicated consumer's creation can answer late.
    return await patiently("subscribing to the work queue", pull_subscribe)
