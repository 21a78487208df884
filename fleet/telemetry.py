"""Traces and metrics of one service process: OpenTelemetry spans with the GenAI semantic conventions
(``invoke_agent``, ``execute_tool``, ``chat``), W3C trace context across A2A and MCP calls, and
Prometheus metrics on ``/metrics``.

Tracing is off unless :func:`configure` is given an OTLP endpoint: the API's default provider then
hands out non-recording spans (no allocation of attributes, no export), :func:`extract` reads no
caller's trace context and :func:`inject` adds nothing to requests. Metrics are always kept; they are
process-local counters, read at scrape time.

What a span may carry: ids (run, operation, step, agent, tool, model), the tenant, token counts and an
error's type. Never an argument, a result, a message text, a token or an exception's message: those
can hold secrets or another person's data, and traces leave the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.errors import FleetError
from fleet.eventlog import EventLog
from fleet.natsconn import subject_token

__all__ = [
    "MEMORY_WRITES",
    "METRICS_PATH",
    "METRICS_STREAM",
    "POLICY_DECISIONS",
    "RUNS",
    "RUNS_WAITING",
    "TOOL_CALL_SECONDS",
    "WORK_QUEUE",
    "WORK_QUEUE_LAG",
    "Tracing",
    "chat_span",
    "configure",
    "execute_tool_span",
    "extract",
    "inject",
    "invoke_agent_span",
    "on_scrape",
    "publishing_metrics",
    "record_memory_write",
    "record_policy_decision",
    "record_queue_lag",
    "record_usage",
    "snapshot",
    "with_metrics",
]

log = logging.getLogger(__name__)

TRACER_NAME = "agent-fleet"
METRICS_PATH = "/metrics"
EXPORT_DELAY_MS = 1000  # spans reach the collector within about a second (the SDK's default is 5 s)
SCRAPE_REFRESH_TIMEOUT_S = 2.0  # a slow refresher leaves its gauges as they were, the scrape answers

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate, whatever OTEL_PROPAGATORS says

# Set by configure() once spans are exported. While it is False no trace context is read or written:
# the API's non-recording span would carry a caller's traceparent through unchanged (it wraps its
# parent's context), into the work message, every A2A and MCP request and the run's record.
_tracing_on = False


@dataclass(frozen=True, slots=True)
class Tracing:
    """The tracer provider :func:`configure` installed; :meth:`shutdown` flushes what is queued."""

    provider: Any  # opentelemetry.sdk.trace.TracerProvider (the SDK is imported only when tracing is on)

    def shutdown(self) -> None:
        """Export the spans still queued, then stop (bounded by the exporter's own timeout)."""
        self.provider.shutdown()


def configure(
    service_id: str, otlp_endpoint: str, *, export_delay_ms: int = EXPORT_DELAY_MS
) -> Tracing | None:
    """Send this process's spans to ``otlp_endpoint`` (an OTLP/HTTP base URL, as in
    ``OTEL_EXPORTER_OTLP_ENDPOINT``: traces go to ``{endpoint}/v1/traces``) as ``service.name`` =
    ``service_id``. An empty endpoint leaves tracing off and returns None."""
    if not otlp_endpoint:
        return None
    # Imported here: a process without tracing never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_id}))
    # The endpoint is passed explicitly: the exporter would otherwise read the environment itself.
    exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
    batch = BatchSpanProcessor(exporter, schedule_delay_millis=export_delay_ms)
    provider.add_span_processor(_without_scopes(batch, DROPPED_SCOPES))
    trace.set_tracer_provider(provider)
    global _tracing_on
    _tracing_on = True
    return Tracing(provider)


# a2a-sdk traces every handler, queue and store method when OpenTelemetry is importable: dozens of
# INTERNAL spans per task, with exception texts (which can quote a caller's data) recorded on them.
# Ours cover the same hops (invoke_agent on both sides) with explicit parents, so dropping its spans
# orphans none of ours. The MCP SDK's spans stay: its tools/call hop links our client and server spans
# (through the request's _meta). They hold no arguments or results, but an exception that escapes the
# SDK (a transport failure; tool failures are answers, not exceptions) is recorded with its text.
DROPPED_SCOPES = frozenset({"a2a-python-sdk"})


def _without_scopes(inner: Any, dropped: frozenset[str]) -> Any:
    """``inner`` (a span processor), fed only the spans of instrumentation scopes not in ``dropped``."""
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

    class WithoutScopes(SpanProcessor):
        def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
            inner.on_start(span, parent_context)

        def on_end(self, span: ReadableSpan) -> None:
            scope = span.instrumentation_scope
            if scope is None or scope.name not in dropped:
                inner.on_end(span)

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(inner.force_flush(timeout_millis))

    return WithoutScopes()


# --- trace context across processes -------------------------------------------------------------


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``carrier`` (HTTP headers or
    message metadata); nothing when tracing is off (see :func:`configure`)."""
    if _tracing_on:
        _PROPAGATOR.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The remote parent that ``carrier`` names (header names in any case), or None (also whenever
    tracing is off: a caller's trace context is then not carried on)."""
    if not carrier or not _tracing_on:
        return None
    return _PROPAGATOR.extract({k.lower(): v for k, v in carrier.items() if isinstance(v, str)})


# --- spans (GenAI semantic conventions) ----------------------------------------------------------


def _fleet_attributes(
    *, run_id: str = "", operation_id: str | None = None, tenant: str = "", step: str = ""
) -> dict[str, str]:
    found = {"fleet.run_id": run_id, "fleet.operation_id": operation_id or "", "fleet.tenant": tenant}
    found["fleet.step"] = step
    # OpenTelemetry's GenAI conversation: a run is one, across its steps, agents, models and tools
    # (and across a task handed from one process to another).
    found["gen_ai.conversation.id"] = run_id
    return {k: v for k, v in found.items() if v}


# A proxy until configure() sets the provider, then the provider's tracer (made once, not per span).
_TRACER = trace.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def _span(
    name: str,
    kind: SpanKind,
    attributes: dict[str, Any],
    parent: otel_context.Context | None = None,
    links: list[Link] | None = None,
) -> Iterator[Span]:
    """A current span that records only an error's type: an exception's text can hold data."""
    with _TRACER.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                span.set_attribute("error.type", type(exc).__qualname__)
                span.set_status(Status(StatusCode.ERROR))
            raise


def invoke_agent_span(
    agent: str,
    *,
    kind: SpanKind,
    agent_id: str = "",
    skill: str = "",
    run_id: str = "",
    operation_id: str | None = None,
    tenant: str = "",
    step: str = "",
    parent: Mapping[str, str] | None = None,
    linked: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """``invoke_agent {agent}``: CLIENT where a step is delegated over A2A, SERVER where the
    coordinator takes a caller's request or a specialist handles it (``parent``: the request's
    headers), INTERNAL for a worker's run slice. ``linked``: a carrier (as :func:`inject` fills)
    naming a span this one follows from without being its child (a run's first request, for a slice
    resumed later)."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent,
        **_fleet_attributes(run_id=run_id, operation_id=operation_id, tenant=tenant, step=step),
    }
    if agent_id:
        attributes["gen_ai.agent.id"] = agent_id
    if skill:
        attributes["fleet.skill"] = skill
    return _span(f"invoke_agent {agent}", kind, attributes, extract(parent), _links(linked))


def _links(carrier: Mapping[str, str] | None) -> list[Link] | None:
    context = extract(carrier)
    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return [Link(span_context)] if span_context.is_valid else None


def execute_tool_span(
    tool: str,
    *,
    kind: SpanKind,
    server: str = "",
    run_id: str = "",
    tenant: str = "",
    parent: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """``execute_tool {tool}``: CLIENT in the MCP client, SERVER in the MCP server (``parent``: the
    request's headers). Never the arguments or the result."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": tool,
        **_fleet_attributes(run_id=run_id, tenant=tenant),
    }
    if server:
        attributes["fleet.mcp_server"] = server
    return _span(f"execute_tool {tool}", kind, attributes, extract(parent))


def chat_span(
    model: str, *, system: str = "openai", run_id: str = ""
) -> contextlib.AbstractContextManager[Span]:
    """``chat {model}``: one chat completion (set the usage on it with :func:`record_usage`);
    ``run_id``: the run it works for, when there is one yet (a plan is made before its run)."""
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": model,
        "gen_ai.provider.name": system,
        **_fleet_attributes(run_id=run_id),
    }
    return _span(f"chat {model}", SpanKind.CLIENT, attributes)


def record_usage(span: Span, input_tokens: int | None, output_tokens: int | None) -> None:
    """The token counts a model reported, on its ``chat`` span."""
    if input_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    if output_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)


# --- metrics ---------------------------------------------------------------------------------------

# Labels are bounded sets (states, wait types, tool and server names, policy queries, tiers,
# outcomes): no tenant, run, agent-supplied text or id is ever a label.
TOOL_CALL_SECONDS = Histogram(
    "fleet_tool_call_duration_seconds",
    "Time an MCP server took to run a tool call, gate included.",
    ["server", "tool", "outcome"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
POLICY_DECISIONS = Counter(
    "fleet_policy_decisions",
    "Policy decisions made in this process, by query and result.",
    ["query", "result"],
)
MEMORY_WRITES = Counter(
    "fleet_memory_writes",
    "Long-term memory writes through the gate, by tier and outcome.",
    ["tier", "outcome"],
)
RUNS = Gauge("fleet_runs", "Runs of the fleet by state (read from the run store at scrape time).", ["state"])
RUNS_WAITING = Gauge(
    "fleet_runs_waiting", "Runs waiting, by what they wait for (at scrape time).", ["wait_type"]
)
WORK_QUEUE = Gauge(
    "fleet_work_queue_messages",
    "Run work on the JetStream work queue: pending (not yet delivered) and ack_pending (being worked).",
    ["status"],
)

# From the run's submission (the coordinator's clock, in the work message) to a worker starting it
# (the worker's clock): hosts whose clocks disagree skew it, so a negative lag counts as 0.
WORK_QUEUE_LAG = Histogram(
    "fleet_work_queue_lag_seconds",
    "Time from a run's submission to the work queue to a worker starting to advance it.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)


# What the fleet's agents said their tasks spent (fleet.usage), counted by the worker that recorded
# each operation's outcome, priced by policy: ``agent`` is the registered id of the agent the
# operation went to (the registry bounds them), never a caller's word.
AGENT_TOKENS = Counter(
    "fleet_agent_llm_tokens",
    "LLM tokens the tasks of an agent used, as the agent reported them: in (prompt) and out (completion).",
    ["agent", "direction"],
)
AGENT_COST = Counter(
    "fleet_agent_llm_cost_usd",
    "What an agent's tasks' tokens cost, priced by policy (config.models).",
    ["agent"],
)
AGENT_LLM_SECONDS = Histogram(
    "fleet_agent_llm_request_duration_seconds",
    "How long each completion of an agent's tasks took, as the agent measured it.",
    ["agent"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
)
AGENT_TOOL_CALLS = Counter("fleet_agent_tool_calls", "Tool calls an agent's tasks made.", ["agent"])
AGENT_SLOW_TOOL_CALLS = Counter(
    "fleet_agent_slow_tool_calls", "Tool calls of an agent's tasks that took longer than 30 s.", ["agent"]
)
AGENT_RATE_LIMITED = Counter(
    "fleet_agent_llm_rate_limited", "Answers of 429 the models of an agent's tasks gave.", ["agent"]
)
AGENT_LOOP_STOPS = Counter(
    "fleet_agent_loop_stops",
    "Agent loops stopped at a limit, by agent and reason (specialists.loop_guard's, rate_limited, other).",
    ["agent", "reason"],
)
AGENT_COMPACTIONS = Counter("fleet_agent_loop_compactions", "Agent loop contexts compacted.", ["agent"])
AGENT_REVIEWS = Counter(
    "fleet_agent_loop_reviews",
    "The reviewer's verdicts on stuck agent loops, by agent and verdict (continue, stop, person).",
    ["agent", "verdict"],
)
REVIEW_VERDICTS = frozenset({"continue", "stop", "person"})
STOP_REASONS = frozenset(
    {
        "repeated_call",
        "repeated_output",
        "calls_per_turn",
        "max_turns",
        "tool_calls",
        "tokens",
        "cost",
        "context_limit",
        "rate_limited",
    }
)


def record_agent_usage(agent: str, spent: Mapping[str, Any]) -> None:
    """Count what one operation of ``agent`` spent (``spent``: as :func:`coordinator.engine.spending.priced` reads it)."""
    AGENT_TOKENS.labels(agent, "in").inc(_amount(spent.get("tokens_in")))
    AGENT_TOKENS.labels(agent, "out").inc(_amount(spent.get("tokens_out")))
    AGENT_COST.labels(agent).inc(_amount(spent.get("cost_usd")))
    AGENT_TOOL_CALLS.labels(agent).inc(_amount(spent.get("tool_calls")))
    AGENT_SLOW_TOOL_CALLS.labels(agent).inc(_amount(spent.get("slow_tool_calls")))
    AGENT_RATE_LIMITED.labels(agent).inc(_amount(spent.get("rate_limited")))
    AGENT_COMPACTIONS.labels(agent).inc(_amount(spent.get("compactions")))
    for seconds in spent.get("llm_seconds") or []:
        AGENT_LLM_SECONDS.labels(agent).observe(_amount(seconds))
    reviews = spent.get("reviews")
    for verdict, times in reviews.items() if isinstance(reviews, Mapping) else []:
        if verdict in REVIEW_VERDICTS:
            AGENT_REVIEWS.labels(agent, verdict).inc(_amount(times))
    stopped = spent.get("stopped")
    if isinstance(stopped, str) and stopped:
        AGENT_LOOP_STOPS.labels(agent, stopped if stopped in STOP_REASONS else "other").inc()


def _amount(value: Any) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0
    )


def record_queue_lag(submitted_at: float | None, now: float) -> None:
    """Observe one start of a run queued at ``submitted_at`` (epoch seconds; None: not known)."""
    if submitted_at is not None:
        WORK_QUEUE_LAG.observe(max(0.0, now - submitted_at))


def record_policy_decision(query: str, result: str) -> None:
    """Count one decision at ``query`` (a rule path) with ``result`` (allow, deny, unavailable)."""
    POLICY_DECISIONS.labels(query, result).inc()


MEMORY_TIERS = frozenset({"episodic", "semantic", "procedural"})


def record_memory_write(tier: str, status: str, redacted: bool) -> None:
    """Count one memory write: ``committed``, ``redacted`` (committed with redactions), or the
    gate's other outcomes (``denied``, ``held``, ``refused``)."""
    outcome = ("redacted" if redacted else "committed") if status == "stored" else status
    MEMORY_WRITES.labels(tier if tier in MEMORY_TIERS else "other", outcome).inc()


_refreshers: list[Callable[[], Awaitable[None]]] = []


def on_scrape(refresh: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Run ``refresh`` before each scrape (e.g. read run counts from the store into gauges).
    Returns what stops that again (idempotent), for a component that goes before its process."""
    _refreshers.append(refresh)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _refreshers.remove(refresh)

    return remove


async def _refresh_all() -> None:
    for refresh in list(_refreshers):
        try:
            async with asyncio.timeout(SCRAPE_REFRESH_TIMEOUT_S):
                await refresh()
        except Exception:  # a metric source that is down must not take the others with it
            log.warning("metrics refresh %r failed", refresh, exc_info=True)


def with_metrics(app: ASGIApp) -> ASGIApp:
    """``app`` with ``GET /metrics`` (Prometheus text format, unauthenticated: see
    docs/operations.md) answered in front of it."""

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != METRICS_PATH:
            await app(scope, receive, send)
            return
        await _refresh_all()
        body = generate_latest(REGISTRY)
        headers = [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return serve


# ------------------------------------------------------------------------------ the metrics' history
# What the console charts over time (runs by state, queue lag, tool latency, policy decisions): every
# process that enforces policy publishes a snapshot of its share of these metrics on
# fleet.metrics.<process> every METRICS_EVERY_S. The stream keeps a few hours; Prometheus, scraping
# /metrics, is where the fleet's long history lives (docs/operations.md).
METRICS_STREAM = "FLEET_METRICS"
METRICS_SUBJECTS = "fleet.metrics.>"
METRICS_MAX_AGE_S = 6 * 3600.0
METRICS_EVERY_S = 15.0
METRICS_MAX_PER_SOURCE = int(METRICS_MAX_AGE_S / 0.5)  # at the fastest interval settings allow
METRICS_MAX_PENDING = 8  # snapshots waiting for a broker that is away; older ones are not worth keeping
_BOOT = time.time()  # a counter whose process restarted starts again from 0: the reader sees boot change


def _histogram(metric: Histogram, where: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """``metric``'s cumulative bucket counts and sum, summed over its labels (those of the samples
    whose labels include ``where``; None if nothing was observed): ``{"le": [...], "counts":
    [...], "sum": s}``, ``+Inf`` last."""
    counts: dict[str, float] = {}
    total = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if where and any(sample.labels.get(k) != v for k, v in where.items()):
                continue
            if sample.name.endswith("_bucket"):
                le = sample.labels["le"]
                counts[le] = counts.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    if not counts or not counts.get("+Inf"):
        return None
    order = sorted(counts, key=lambda le: float("inf") if le == "+Inf" else float(le))
    return {"le": order, "counts": [counts[le] for le in order], "sum": total}


_VALUE_SUFFIX = {"counter": "_total", "gauge": "", "histogram": "_count"}


def _by_label(metric: Counter | Gauge | Histogram, label: str) -> dict[str, float]:
    """``metric``'s values (a histogram's: its counts) summed by ``label``."""
    values: dict[str, float] = {}
    for family in metric.collect():
        name = family.name + _VALUE_SUFFIX[family.type]
        for sample in family.samples:
            if sample.name == name and label in sample.labels:
                key = sample.labels[label]
                values[key] = values.get(key, 0.0) + sample.value
    return values


def snapshot() -> dict[str, Any]:
    """This process's share of the charted metrics, as they stand (families it has none of are left
    out): ``runs`` and ``queue`` (gauges, fleet-wide, from a coordinator), ``queue_lag`` and
    ``tool_calls`` (histograms, see :func:`_histogram`), ``tool_errors`` and ``policy`` (counters)."""
    taken: dict[str, Any] = {
        "runs": _by_label(RUNS, "state"),
        "queue": _by_label(WORK_QUEUE, "status"),
        "queue_lag": _histogram(WORK_QUEUE_LAG),
        "tool_calls": _histogram(TOOL_CALL_SECONDS),
        "tool_errors": sum(
            n for outcome, n in _by_label(TOOL_CALL_SECONDS, "outcome").items() if outcome != "ok"
        ),
        "policy": _by_label(POLICY_DECISIONS, "result"),
        "agents": _agents(),
    }
    return {k: v for k, v in taken.items() if v}


def _agents() -> dict[str, dict[str, Any]]:
    """Per agent, what its tasks spent (counters) and how long its completions took (a histogram)."""
    agents: dict[str, dict[str, Any]] = {}
    for family in AGENT_TOKENS.collect():
        for sample in family.samples:
            if sample.name == "fleet_agent_llm_tokens_total":
                agents.setdefault(sample.labels["agent"], {})[f"tokens_{sample.labels['direction']}"] = (
                    sample.value
                )
    columns: tuple[tuple[str, Counter], ...] = (
        ("cost_usd", AGENT_COST),
        ("tool_calls", AGENT_TOOL_CALLS),
        ("slow_tool_calls", AGENT_SLOW_TOOL_CALLS),
        ("rate_limited", AGENT_RATE_LIMITED),
        ("compactions", AGENT_COMPACTIONS),
    )
    for column, metric in columns:
        for agent, value in _by_label(metric, "agent").items():
            agents.setdefault(agent, {})[column] = value
    for family in AGENT_LOOP_STOPS.collect():
        for sample in family.samples:
            if sample.name == "fleet_agent_loop_stops_total":
                stops = agents.setdefault(sample.labels["agent"], {}).setdefault("stops", {})
                stops[sample.labels["reason"]] = sample.value
    for family in AGENT_REVIEWS.collect():
        for sample in family.samples:
            if sample.name == "fleet_agent_loop_reviews_total":
                reviews = agents.setdefault(sample.labels["agent"], {}).setdefault("reviews", {})
                reviews[sample.labels["verdict"]] = sample.value
    for agent, row in agents.items():
        latency = _histogram(AGENT_LLM_SECONDS, {"agent": agent})
        if latency is not None:
            row["llm_latency"] = latency
    return agents


@contextlib.asynccontextmanager
async def publishing_metrics(
    client: Any, service_id: str, every_s: float = METRICS_EVERY_S
) -> AsyncIterator[None]:
    """Publish this process's :func:`snapshot` on ``fleet.metrics.<service_id>`` at once, every
    ``every_s`` while the context is open, and as it closes (``client``: its NATS connection). A
    broker that is away loses snapshots, never blocks the process."""
    history = EventLog(
        METRICS_STREAM,
        METRICS_SUBJECTS,
        f"fleet.metrics.{subject_token(service_id)}",
        max_age_s=METRICS_MAX_AGE_S,
        max_pending=METRICS_MAX_PENDING,
        max_msgs_per_subject=METRICS_MAX_PER_SOURCE,
    )

    def publish() -> None:
        try:
            history.record({"source": service_id, "boot": _BOOT, "at": time.time(), **snapshot()})
        except FleetError:
            log.debug("a metrics snapshot of %s was dropped: the broker is away", service_id)

    async def publish_forever() -> None:
        while True:
            await _refresh_all()
            publish()
            await asyncio.sleep(every_s)

    async with history.publishing(client):
        task = asyncio.create_task(publish_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            publish()  # what it counted since the last one (gauges as they were last refreshed)
