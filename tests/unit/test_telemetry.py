"""The telemetry module: tracing off by default (nothing injected, a caller's trace context not
carried on), on with an endpoint (spans with the service's name reach a real OTLP receiver, an
error's type but never its text), W3C trace context round trips, and ``/metrics`` in front of an
app."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
import pytest
from a2a.types import Message, Part, Role
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from coordinator.a2a_surface.executor import _request_of
from coordinator.engine.worker import slice_trace
from coordinator.record import work
from fleet import telemetry
from tests.e2e.otlp import OtlpReceiver


def test_without_an_endpoint_tracing_is_off_and_nothing_is_injected() -> None:
    assert telemetry.configure("svc", "") is None
    with telemetry.execute_tool_span("query", kind=SpanKind.CLIENT) as span:
        assert not span.is_recording()
        assert telemetry.inject({}) == {}


CALLER = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "v=1"}


def test_with_tracing_off_a_callers_trace_context_is_not_carried_on() -> None:
    assert telemetry.configure("svc", "") is None
    assert telemetry.extract(CALLER) is None
    with telemetry.invoke_agent_span("coordinator", kind=SpanKind.SERVER, parent=CALLER) as span:
        assert not span.get_span_context().is_valid
        assert not trace.get_current_span().get_span_context().is_valid
        assert telemetry.inject({}) == {}
        message = Message(message_id="m1", role=Role.ROLE_USER, parts=[Part(text="hi")])
        request = _request_of(message)
        assert work.TRACE_KEY not in request  # the run's record keeps no trace context
    # Nor a remote parent made current by a library that extracts for itself (the MCP SDK does).
    remote = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True, TraceFlags(1))
    with trace.use_span(NonRecordingSpan(remote)):
        assert telemetry.inject({}) == {}


def test_with_tracing_on_a_remote_parent_is_read_from_its_traceparent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "_tracing_on", True)  # what configure() sets (it is once a process)
    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    parent = telemetry.extract({"Traceparent": header})
    assert parent is not None
    context = trace.get_current_span(parent).get_span_context()
    assert (context.trace_id, context.span_id) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    assert telemetry.extract(None) is None


CONFIGURED = """
from opentelemetry.trace import SpanKind
from fleet import telemetry

tracing = telemetry.configure("sql-analyst", "{url}", export_delay_ms=50)
with telemetry.invoke_agent_span("sql-analyst", kind=SpanKind.SERVER, run_id="r1", tenant="acme", step="q"):
    carried = telemetry.inject({{}})
    try:
        with telemetry.execute_tool_span("query", kind=SpanKind.CLIENT, server="mcp-sql", run_id="r1"):
            raise ValueError("password=hunter2")
    except ValueError:
        pass
    with telemetry.chat_span("tiny-1", run_id="r1"):
        pass
assert carried["traceparent"].startswith("00-"), carried
tracing.shutdown()
"""


def test_with_an_endpoint_spans_reach_the_collector_with_ids_and_no_error_text() -> None:
    with OtlpReceiver() as receiver:
        script = textwrap.dedent(CONFIGURED.format(url=receiver.url))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        spans = {s.name: s for s in receiver.spans}  # shutdown() exported them before the exit
    agent, tool = spans["invoke_agent sql-analyst"], spans["execute_tool query"]
    assert agent.service == tool.service == "sql-analyst"
    assert tool.parent_span_id == agent.span_id and tool.trace_id == agent.trace_id
    assert agent.attributes == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "sql-analyst",
        "fleet.run_id": "r1",
        "fleet.tenant": "acme",
        "fleet.step": "q",
        "gen_ai.conversation.id": "r1",
    }
    assert tool.attributes["error.type"] == "ValueError"
    assert spans["chat tiny-1"].attributes["fleet.run_id"] == "r1"
    assert spans["chat tiny-1"].attributes["gen_ai.conversation.id"] == "r1"
    assert tool.attributes["gen_ai.conversation.id"] == "r1"
    assert spans["chat tiny-1"].parent_span_id == agent.span_id
    assert "hunter2" not in repr(tool.attributes)


ORIGIN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
LINKED = """
from opentelemetry.trace import SpanKind
from fleet import telemetry

tracing = telemetry.configure("worker-1", "{url}", export_delay_ms=50)
with telemetry.invoke_agent_span(
    "coordinator", kind=SpanKind.INTERNAL, run_id="r1", linked={{"traceparent": "{origin}"}}
):
    pass
tracing.shutdown()
"""


def test_a_linked_span_starts_its_own_trace_and_links_to_the_span_it_follows_from() -> None:
    with OtlpReceiver() as receiver:
        script = textwrap.dedent(LINKED.format(url=receiver.url, origin=ORIGIN))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        [span] = receiver.spans
    assert span.links == (("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),)
    assert span.trace_id != "0af7651916cd43dd8448eb211c80319c" and not span.parent_span_id


def test_a_first_slice_is_the_child_of_its_request_and_a_resumed_one_links_back_to_it() -> None:
    first = {"traceparent": ORIGIN}
    answer = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    assert slice_trace(first, first) == (first, None)  # the run's first slice (or its redelivery)
    assert slice_trace(answer, first) == (answer, first)  # resumed by a traced follow-up request
    assert slice_trace({}, first) == (None, first)  # resumed by a sweep: a new root, linked
    assert slice_trace({}, None) == (None, None)  # a run no traced request created (a trigger)


def test_queue_lag_is_observed_in_seconds_and_never_negative() -> None:
    def lag() -> tuple[float, float]:
        text = generate_latest().decode()
        return _sample(text, "fleet_work_queue_lag_seconds_count"), _sample(
            text, "fleet_work_queue_lag_seconds_sum"
        )

    count, total = lag()
    telemetry.record_queue_lag(100.0, 102.5)
    telemetry.record_queue_lag(105.0, 104.0)  # the submitter's clock ran ahead: 0, not negative
    telemetry.record_queue_lag(None, 104.0)  # a message without a stamp: unknown, not counted
    assert lag() == (count + 2, total + 2.5)


def _sample(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


async def test_metrics_are_served_in_front_of_the_app_after_the_refreshers_ran() -> None:
    refreshed: list[bool] = []

    async def refresh() -> None:
        refreshed.append(True)

    async def broken() -> None:
        raise RuntimeError("the store is down")

    app = telemetry.with_metrics(Starlette(routes=[Route("/", lambda _: PlainTextResponse("app"))]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        # The refreshers are the process's: both are removed at the end, or they would run (and the
        # broken one log) at every later scrape.
        removals = [telemetry.on_scrape(broken), telemetry.on_scrape(refresh)]  # the scrape still answers
        try:
            before = _sample(generate_latest().decode(), "fleet_memory_writes_total", outcome="redacted")
            telemetry.record_memory_write("semantic", "stored", redacted=True)
            telemetry.record_memory_write("no-such-tier", "denied", redacted=False)
            assert (await http.get("/")).text == "app"
            response = await http.get(telemetry.METRICS_PATH)
        finally:
            for remove in removals:
                remove()
        assert response.status_code == 200 and refreshed
        refreshed.clear()
        assert (await http.get(telemetry.METRICS_PATH)).status_code == 200 and not refreshed
    text = response.text
    assert _sample(text, "fleet_memory_writes_total", tier="semantic", outcome="redacted") >= 1
    assert _sample(text, "fleet_memory_writes_total", outcome="redacted") == before + 1
    assert _sample(text, "fleet_memory_writes_total", tier="other", outcome="denied") >= 1
