"""The console's charts over time, from the metrics every fleet process publishes on
``fleet.metrics.<process>`` (see :func:`fleet.telemetry.publishing_metrics`): runs by state, the work
queue (depth, and the lag from a run's submission to a worker starting it), tool call latency and
errors, policy decisions, and per agent what its tasks spent on models (tokens in and out, dollars,
slow tool calls, loop stops by reason, completion latency).

A snapshot holds what its process counted since it started. :class:`MetricsHistory` keeps the
snapshots of the stream's last hours in memory, reading only what arrived since its last read;
:func:`series` turns them into per-interval values: a counter's increase between two snapshots of
one process falls in the interval of the later one (a process that restarted counts from 0 again),
and a gauge's value is its newest snapshot's. The metrics name no tenant (their labels are bounded
sets), so the charts are the fleet's, shown to a sign-in that may read the fleet's records.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from fleet.errors import ErrorCode, FleetError
from fleet.telemetry import METRICS_MAX_AGE_S, METRICS_STREAM, METRICS_SUBJECTS

WINDOWS_S = {"15m": 900.0, "1h": 3600.0, "6h": 6 * 3600.0}
BUCKETS = 60
MAX_SAMPLES = 200_000  # every process's snapshots of the stream's hours, at most (a few tens of MB)
MAX_READ = 50_000  # messages one refresh reads at most (the rest on the next)
READ_WAIT_S = 1.0
GAUGE_HELD_S = 60.0  # a gauge's last value stands this long past its snapshot, then the chart has a gap
QUANTILES = (0.5, 0.95)
RUN_STATES = (
    "submitted",
    "working",
    "waiting",
    "input_required",
    "completed",
    "failed",
    "canceled",
    "rejected",
)


def window_of(name: str | None) -> float:
    """The window ``?window=`` names (default 1h); ``invalid_request`` for any other."""
    if name is None:
        return WINDOWS_S["1h"]
    if name not in WINDOWS_S:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"window must be one of {', '.join(WINDOWS_S)}")
    return WINDOWS_S[name]


class MetricsHistory:
    """The snapshots on the metrics stream, oldest first, read incrementally and kept for the
    stream's own age at most."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._next_seq = 0  # 0: nothing read yet
        self._lock = asyncio.Lock()

    async def refresh(self, client: NATS, now: float | None = None) -> None:
        """Read what arrived since the last refresh (at most ``MAX_READ`` messages), and forget
        snapshots older than the stream keeps."""
        async with self._lock:
            await self._read(client)
            horizon = (now or time.time()) - METRICS_MAX_AGE_S
            while self.samples and float(self.samples[0].get("at", 0)) < horizon:
                self.samples.popleft()

    async def _read(self, client: NATS) -> None:
        js = client.jetstream()
        try:
            info = await js.stream_info(METRICS_STREAM)
        except NotFoundError:
            return
        if info.state.messages == 0 or info.state.last_seq < max(self._next_seq, 1):
            return
        start = max(self._next_seq, info.state.first_seq)
        subscription = await js.subscribe(
            METRICS_SUBJECTS,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        try:
            for _ in range(MAX_READ):
                try:
                    msg = await subscription.next_msg(timeout=READ_WAIT_S)
                except TimeoutError:
                    break
                self._next_seq = msg.metadata.sequence.stream + 1
                self.samples.extend(_snapshots(msg.data))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await subscription.unsubscribe()


def _snapshots(data: bytes) -> Iterable[dict[str, Any]]:
    """The snapshots of one message (JSON lines); a line that is not one is skipped."""
    for line in data.split(b"\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("at"), int | float) and record.get("source"):
            yield record


def series(
    samples: Iterable[Mapping[str, Any]], now: float, window_s: float, buckets: int = BUCKETS
) -> dict[str, Any]:
    """The charts' values over the ``window_s`` before ``now``, in ``buckets`` intervals."""
    step = window_s / buckets
    start = now - window_s

    def slot(at: float) -> int | None:
        i = math.floor((at - start) / step)
        return i if 0 <= i < buckets else None

    runs: dict[str, list[float | None]] = {}
    pending: list[float | None] = [None] * buckets
    gauge_at: list[float] = [-math.inf] * buckets
    lag = _Histograms(buckets)
    tools = _Histograms(buckets)
    agents = _Agents(buckets)
    errors = [0.0] * buckets
    policy: dict[str, list[float]] = {}
    sources: dict[str, list[Mapping[str, Any]]] = {}
    for sample in samples:
        sources.setdefault(str(sample["source"]), []).append(sample)

    for source_samples in sources.values():
        source_samples.sort(key=lambda s: float(s["at"]))
        previous: Mapping[str, Any] | None = None
        for sample in source_samples:
            at = float(sample["at"])
            i = slot(at)
            if i is not None and isinstance(sample.get("runs"), Mapping) and at >= gauge_at[i]:
                gauge_at[i] = at  # the newest coordinator's word in the interval stands
                for state, count in sample["runs"].items():
                    runs.setdefault(str(state), [None] * buckets)[i] = float(count)
                queue = sample.get("queue")
                pending[i] = float(queue.get("pending", 0)) if isinstance(queue, Mapping) else None
            base = _base(previous, sample, start)
            previous = sample
            if i is None or base is None:
                continue
            lag.add(i, base.get("queue_lag"), sample.get("queue_lag"))
            tools.add(i, base.get("tool_calls"), sample.get("tool_calls"))
            errors[i] += _increase(base.get("tool_errors"), sample.get("tool_errors"))
            agents.add(i, _mapping(base.get("agents")), _mapping(sample.get("agents")))
            before, after = _mapping(base.get("policy")), _mapping(sample.get("policy"))
            for result, count in after.items():
                row = policy.setdefault(str(result), [0.0] * buckets)
                row[i] += _increase(before.get(result), count)

    _hold(runs, pending, gauge_at, start, step)
    ordered = {s: runs[s] for s in RUN_STATES if s in runs} | {
        s: v for s, v in runs.items() if s not in RUN_STATES
    }
    return {
        "window_s": window_s,
        "step_s": step,
        "end": now,
        "times": [start + (i + 1) * step for i in range(buckets)],
        "sources": sorted(sources),
        "runs": ordered,
        "queue": {"pending": pending, **lag.summary("started")},
        "tools": {**tools.summary("calls"), "errors": errors},
        "policy": policy,
        "agents": agents.summary(),
    }


_ZERO: Mapping[str, Any] = {}


def _base(
    previous: Mapping[str, Any] | None, sample: Mapping[str, Any], start: float
) -> Mapping[str, Any] | None:
    """What ``sample``'s counters increased from: its process's previous snapshot, or nothing (0)
    when the process (re)started since, within the window; None when that is not known (the first
    snapshot seen of a process that started before the window)."""
    if previous is not None and previous.get("boot") == sample.get("boot"):
        return previous
    boot = sample.get("boot")
    if isinstance(boot, int | float) and boot >= start:
        return _ZERO
    return None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else _ZERO


def _increase(before: Any, after: Any) -> float:
    """A counter's increase (a counter that went down was reset: all of it is new)."""
    b = float(before) if isinstance(before, int | float) else 0.0
    a = float(after) if isinstance(after, int | float) else 0.0
    return a - b if a >= b else a


def _hold(
    runs: dict[str, list[float | None]],
    pending: list[float | None],
    gauge_at: list[float],
    start: float,
    step: float,
) -> None:
    """Carry each gauge into the intervals after its snapshot that have none, for ``GAUGE_HELD_S``
    past that snapshot (snapshots come every few seconds; an interval can be shorter)."""
    for i in range(1, len(gauge_at)):
        last = gauge_at[i - 1]
        if gauge_at[i] > -math.inf or last == -math.inf or start + i * step - last > GAUGE_HELD_S:
            continue
        gauge_at[i] = last
        pending[i] = pending[i - 1]
        for row in runs.values():
            row[i] = row[i - 1]


AGENT_COUNTERS = (
    "tokens_in",
    "tokens_out",
    "cost_usd",
    "tool_calls",
    "slow_tool_calls",
    "rate_limited",
    "compactions",
)


class _Agents:
    """Per agent and interval, the increase of what its tasks spent (tokens in and out, dollars,
    tool calls, slow ones, 429s, compactions, loop stops by reason) and its completions' latency,
    summed over the processes that counted it; and each one's total over the window."""

    def __init__(self, buckets: int) -> None:
        self._buckets = buckets
        self.rows: dict[str, dict[str, list[float]]] = {}
        self.stops: dict[str, dict[str, list[float]]] = {}
        self.latency: dict[str, _Histograms] = {}

    def add(self, i: int, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
        for agent, now in after.items():
            if not isinstance(now, Mapping):
                continue
            was = _mapping(before.get(agent))
            row = self.rows.setdefault(str(agent), {k: [0.0] * self._buckets for k in AGENT_COUNTERS})
            for key in AGENT_COUNTERS:
                row[key][i] += _increase(was.get(key), now.get(key))
            stops = self.stops.setdefault(str(agent), {})
            old = _mapping(was.get("stops"))
            for reason, count in _mapping(now.get("stops")).items():
                stops.setdefault(str(reason), [0.0] * self._buckets)[i] += _increase(old.get(reason), count)
            self.latency.setdefault(str(agent), _Histograms(self._buckets)).add(
                i, was.get("llm_latency"), now.get("llm_latency")
            )

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for agent in sorted(self.rows):
            row: dict[str, Any] = dict(self.rows[agent])
            row["stops"] = self.stops.get(agent, {})
            row["llm_latency"] = self.latency[agent].summary("calls")
            total: dict[str, Any] = {key: round(sum(values), 6) for key, values in self.rows[agent].items()}
            total["stops"] = {reason: sum(v) for reason, v in row["stops"].items()}
            cumulative: dict[str, float] = {}
            for interval in self.latency[agent].counts:
                for le, n in interval.items():
                    cumulative[le] = cumulative.get(le, 0.0) + n
            calls = cumulative.get("+Inf", 0.0)
            total["llm_calls"] = calls
            for q in QUANTILES:
                total[f"llm_p{round(q * 100)}_s"] = quantile(q, cumulative) if calls > 0 else None
            row["total"] = total
            out[agent] = row
        return out


class _Histograms:
    """Per interval, the increase of a histogram summed over processes: its count, and quantiles
    read from its buckets as Prometheus's ``histogram_quantile`` does."""

    def __init__(self, buckets: int) -> None:
        self.counts: list[dict[str, float]] = [{} for _ in range(buckets)]

    def add(self, i: int, before: Any, after: Any) -> None:
        if not isinstance(after, Mapping):
            return
        les, counts = after.get("le"), after.get("counts")
        if not isinstance(les, Sequence) or not isinstance(counts, Sequence) or len(les) != len(counts):
            return
        old: dict[str, float] = {}
        if isinstance(before, Mapping) and isinstance(before.get("le"), Sequence):
            old = dict(zip(before["le"], before.get("counts") or [], strict=False))
        reset = any(float(c) < old.get(le, 0.0) for le, c in zip(les, counts, strict=True))
        into = self.counts[i]
        for le, c in zip(les, counts, strict=True):
            into[le] = into.get(le, 0.0) + (float(c) if reset else float(c) - old.get(le, 0.0))

    def summary(self, count_name: str) -> dict[str, list[float | None]]:
        out: dict[str, list[float | None]] = {count_name: []}
        for q in QUANTILES:
            out[f"p{round(q * 100)}_s"] = []
        for cumulative in self.counts:
            total = cumulative.get("+Inf", 0.0)
            out[count_name].append(total)
            for q in QUANTILES:
                out[f"p{round(q * 100)}_s"].append(quantile(q, cumulative) if total > 0 else None)
        return out


def quantile(q: float, cumulative: Mapping[str, float]) -> float:
    """The ``q`` quantile of a histogram given as cumulative counts by upper bound (``le``): linear
    within the bucket it falls in; in the ``+Inf`` bucket, the largest finite bound."""
    bounds = sorted(((math.inf if le == "+Inf" else float(le)), n) for le, n in cumulative.items())
    total = bounds[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, n in bounds:
        if n >= rank and n > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (n - below)
        lower, below = upper, n
    return lower
