"""The coordinator's share of the fleet's metrics: runs by state and waits by type (read from the
run store at scrape time, so every coordinator replica reports the same fleet-wide counts) and the
run work queue's depth (from the JetStream consumer the workers share)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError
from prometheus_client import Gauge

from coordinator.record import work
from coordinator.record.runs import PostgresRunStore, RunState
from fleet import telemetry

CONSUMERS_PER_PAGE = 256  # JetStream's consumer list page


async def refresh_runs(store: PostgresRunStore) -> None:
    """Set the run gauges from the store; a state or wait type no run is in reads 0."""
    by_state = dict.fromkeys((str(s) for s in RunState), 0)
    waiting: dict[str, int] = dict.fromkeys(_seen_wait_types(), 0)
    for state, wait_type, count in await store.census():
        by_state[state] = by_state.get(state, 0) + count
        if state == RunState.WAITING:
            key = wait_type or "unknown"
            waiting[key] = waiting.get(key, 0) + count
    for state, count in by_state.items():
        telemetry.RUNS.labels(state).set(count)
    for wait_type, count in waiting.items():
        telemetry.RUNS_WAITING.labels(wait_type).set(count)


def _seen_wait_types() -> list[str]:
    """Wait types reported before: one no run waits on any more must drop to 0, not stay stale."""
    return [labels["wait_type"] for labels in _label_sets(telemetry.RUNS_WAITING)]


def _label_sets(gauge: Gauge) -> list[dict[str, str]]:
    return [sample.labels for metric in gauge.collect() for sample in metric.samples]


async def refresh_work_queue(client: NATS) -> None:
    """Set the work queue gauges from the workers' consumers, one per tenant (see
    :mod:`coordinator.record.work`), summed (nothing before a worker created one)."""
    consumers: list[Any] = []
    try:
        while True:
            page = await client.jetstream().consumers_info(work.STREAM, offset=len(consumers))
            consumers += page
            if not page or len(page) < CONSUMERS_PER_PAGE:
                break
    except NotFoundError:
        return
    telemetry.WORK_QUEUE.labels("pending").set(sum(c.num_pending or 0 for c in consumers))
    telemetry.WORK_QUEUE.labels("ack_pending").set(sum(c.num_ack_pending or 0 for c in consumers))


def coordinator_metrics(store: PostgresRunStore, client: Callable[[], NATS]) -> Callable[[], Awaitable[None]]:
    """What the coordinator refreshes before each scrape (``client``: its NATS connection, once open)."""

    async def refresh() -> None:
        await refresh_runs(store)
        await refresh_work_queue(client())

    return refresh
