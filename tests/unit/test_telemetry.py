"""The telemetry module: tracing off by default (nothing injected), on with an endpoint (spans with
the service's name reach a real OTLP receiver, an error's type but never its text), W3C trace
context round trips, and ``/metrics`` in front of an app."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from fleet import telemetry
from tests.e2e.otlp import OtlpReceiver


def test_without_an_endpoint_tracing_is_off_and_nothing_is_injected() -> None:
    assert telemetry.configure("svc", "") is None
    with telemetry.execute_tool_span("query", kind=SpanKind.CLIENT) as span:
        assert not span.is_recording()
        assert telemetry.inject({}) == {}


def test_a_remote_parent_is_read_from_its_traceparent() -> None:
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
    }
    assert tool.attributes["error.type"] == "ValueError"
    assert "hunter2" not in repr(tool.attributes)


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

    telemetry.on_scrape(broken)  # a failing source leaves the scrape answering
    telemetry.on_scrape(refresh)
    before = _sample(generate_latest().decode(), "fleet_memory_writes_total", outcome="redacted")
    telemetry.record_memory_write("semantic", "stored", redacted=True)
    telemetry.record_memory_write("no-such-tier", "denied", redacted=False)
    app = telemetry.with_metrics(Starlette(routes=[Route("/", lambda _: PlainTextResponse("app"))]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.get("/")).text == "app"
        response = await http.get(telemetry.METRICS_PATH)
    assert response.status_code == 200 and refreshed
    text = response.text
    assert _sample(text, "fleet_memory_writes_total", tier="semantic", outcome="redacted") >= 1
    assert _sample(text, "fleet_memory_writes_total", outcome="redacted") == before + 1
    assert _sample(text, "fleet_memory_writes_total", tier="other", outcome="denied") >= 1
