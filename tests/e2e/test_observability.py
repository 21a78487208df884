"""Observability through the real stack: every service exports its spans over OTLP/HTTP to a
receiver the test runs, and serves Prometheus metrics on ``/metrics``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from prometheus_client.parser import text_string_to_metric_families

from coordinator.record.runs import RunState
from fleetctl.testing.e2e import Stack, clean_env, send, start_stack, stop_stack, user_message
from tests.e2e.otlp import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.e2e

ONE_QUERY: dict[str, Any] = {
    "steps": [{"id": "q", "skill": "sql-query", "input": {"sql": "SELECT 1 AS one"}}]
}
CLIENT, SERVER = SpanProto.SPAN_KIND_CLIENT, SpanProto.SPAN_KIND_SERVER
INTERNAL = SpanProto.SPAN_KIND_INTERNAL


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, OtlpReceiver]]:
    """A stack whose services send their spans to a receiver of this test (through the standard
    OpenTelemetry variable, which ``fleet up`` passes to every service)."""
    with OtlpReceiver() as receiver:
        data_dir: Path = tmp_path_factory.mktemp("traced")
        stack = start_stack(data_dir, env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url))
        try:
            yield stack, receiver
        finally:
            stop_stack(stack)


def _of_run(run_id: str, spans: list[ReceivedSpan], service: str, name: str, kind: int) -> list[ReceivedSpan]:
    return [
        s
        for s in spans
        if s.service == service
        and s.name.startswith(name)
        and s.kind == kind
        and s.attributes.get("fleet.run_id") == run_id
    ]


async def test_one_trace_spans_the_coordinator_the_worker_the_specialist_and_the_mcp_server(
    traced: tuple[Stack, OtlpReceiver],
) -> None:
    stack, receiver = traced
    outcome = await send(stack, user_message(data=ONE_QUERY), token=stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    run_id = outcome.task_id

    def complete(spans: list[ReceivedSpan]) -> bool:
        # Each process exports on its own clock; the worker's run span ends last, after the run.
        wanted = [
            ("coordinator", "invoke_agent coordinator", SERVER),
            ("mcp-sql", "execute_tool", SERVER),
            ("sql-analyst", "execute_tool", CLIENT),
            ("sql-analyst", "invoke_agent", SERVER),
        ]
        ours = [s for s in spans if s.attributes.get("fleet.run_id") == run_id]
        from_worker = {(s.name, s.kind) for s in ours if s.service.startswith("worker-")}
        return all(_of_run(run_id, spans, *w) for w in wanted) and from_worker >= {
            ("invoke_agent coordinator", INTERNAL),
            ("invoke_agent sql-analyst", CLIENT),
        }

    spans = await receiver.wait_for(complete)
    [delegated] = [
        s
        for s in spans
        if s.kind == CLIENT
        and s.name == "invoke_agent sql-analyst"
        and s.attributes.get("fleet.run_id") == run_id
    ]
    assert delegated.service.startswith("worker-")
    assert delegated.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert delegated.attributes["gen_ai.agent.id"] == "sql-analyst"
    assert delegated.attributes["fleet.tenant"] == "acme"
    assert delegated.attributes["fleet.step"] == "q"
    assert delegated.attributes["fleet.operation_id"]
    [handled] = _of_run(run_id, spans, "sql-analyst", "invoke_agent", SERVER)
    [called] = _of_run(run_id, spans, "sql-analyst", "execute_tool", CLIENT)
    [served] = _of_run(run_id, spans, "mcp-sql", "execute_tool", SERVER)
    [front] = _of_run(run_id, spans, "coordinator", "invoke_agent coordinator", SERVER)
    # One trace, from the coordinator's A2A front door down to the tool.
    hops = (front, delegated, handled, called, served)
    assert {s.trace_id for s in hops} == {front.trace_id}
    # Every hop is of one GenAI conversation: the run.
    assert {s.attributes.get("gen_ai.conversation.id") for s in hops} == {run_id}
    assert not front.parent_span_id  # the caller sent no traceparent: the trace starts here
    assert front.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert front.attributes["fleet.tenant"] == "acme"
    [root] = [s for s in spans if s.span_id == delegated.parent_span_id]
    assert root.name == "invoke_agent coordinator" and root.attributes["fleet.run_id"] == run_id
    assert root.service.startswith("worker-") and root.kind == INTERNAL
    # The work message carried the request's context over NATS: the worker's slice is its child.
    assert root.parent_span_id == front.span_id
    for span in (root, delegated, handled, called, served):
        assert front.span_id in _ancestors(span, spans), (span.service, span.name)
    assert handled.parent_span_id == delegated.span_id
    assert called.parent_span_id == handled.span_id
    # The MCP SDK's own spans of the request (tools/call) sit between the client's and the server's.
    assert called.span_id in _ancestors(served, spans), [(s.service, s.name) for s in spans]
    assert served.attributes["gen_ai.tool.name"] == called.attributes["gen_ai.tool.name"]
    assert not [s for s in spans if s.scope == "a2a-python-sdk"]  # its spans are dropped (telemetry.py)
    # No argument, result or token rides on a span.
    for span in hops:
        text = repr(span.attributes)
        assert "SELECT" not in text and "Bearer" not in text


async def test_the_coordinator_continues_a_callers_traceparent_into_the_worker(
    traced: tuple[Stack, OtlpReceiver],
) -> None:
    stack, receiver = traced
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    traceparent = f"00-{caller_trace}-{caller_span}-01"
    outcome = await send(
        stack,
        user_message(data=ONE_QUERY),
        token=stack.token("coordinator"),
        headers={"traceparent": traceparent},
    )
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    run_id = outcome.task_id

    def complete(spans: list[ReceivedSpan]) -> bool:
        fronts = _of_run(run_id, spans, "coordinator", "invoke_agent coordinator", SERVER)
        slices = [s for s in spans if s.kind == INTERNAL and s.attributes.get("fleet.run_id") == run_id]
        return bool(fronts) and any(s.service.startswith("worker-") for s in slices)

    spans = await receiver.wait_for(complete)
    [front] = _of_run(run_id, spans, "coordinator", "invoke_agent coordinator", SERVER)
    assert (front.trace_id, front.parent_span_id) == (caller_trace, caller_span)
    [worked] = [
        s
        for s in spans
        if s.service.startswith("worker-")
        and s.kind == INTERNAL
        and s.attributes.get("fleet.run_id") == run_id
    ]
    assert (worked.trace_id, worked.parent_span_id) == (caller_trace, front.span_id)


def _ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[str]:
    by_id = {s.span_id: s for s in spans}
    found: list[str] = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        found.append(span.span_id)
    return found


def _samples(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def _label_values(text: str, name: str, label: str) -> set[str]:
    """The values ``label`` takes in ``name``'s samples."""
    return {
        sample.labels[label]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and label in sample.labels
    }


async def _scrape(http: httpx.AsyncClient, stack: Stack, service: str) -> str:
    response = await http.get(stack.endpoints["services"][service] + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


async def test_metrics_of_the_coordinator_and_the_mcp_server_count_a_run(
    traced: tuple[Stack, OtlpReceiver],
) -> None:
    stack, _ = traced
    workers = [name for name in stack.endpoints["services"] if name.startswith("worker-")]
    async with httpx.AsyncClient(timeout=10) as http:
        tools_before = await _scrape(http, stack, "mcp-sql")
        runs_before = await _scrape(http, stack, "coordinator")
        lag_before = [await _scrape(http, stack, worker) for worker in workers]
        outcome = await send(stack, user_message(data=ONE_QUERY), token=stack.token("coordinator"))
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        tools_after = await _scrape(http, stack, "mcp-sql")
        runs_after = await _scrape(http, stack, "coordinator")
        lag_after = [await _scrape(http, stack, worker) for worker in workers]

    def moved(before: str, after: str, name: str, **labels: str) -> float:
        return _samples(after, name, **labels) - _samples(before, name, **labels)

    assert (
        moved(
            tools_before,
            tools_after,
            "fleet_tool_call_duration_seconds_count",
            server="mcp-sql",
            outcome="ok",
        )
        == 1
    )
    assert (
        moved(
            tools_before,
            tools_after,
            "fleet_policy_decisions_total",
            query="fleet.tools.decision",
            result="allow",
        )
        >= 1
    )
    assert moved(runs_before, runs_after, "fleet_runs", state="completed") == 1
    # Every state is reported, a state no run is in as 0 (not left out, nor stale).
    assert _label_values(runs_after, "fleet_runs", "state") == {str(state) for state in RunState}
    assert "fleet_work_queue_messages" in runs_after
    # The worker that took the run measured its wait on the queue (one start, no retries here).
    lag = "fleet_work_queue_lag_seconds_count"
    assert workers and sum(moved(b, a, lag) for b, a in zip(lag_before, lag_after, strict=True)) == 1
    # Aggregate counts only: no tenant, run or caller in any label.
    for scraped in (tools_after, runs_after):
        assert "acme" not in scraped and outcome.task_id not in scraped


async def _remember(stack: Stack, text: str) -> str:
    token = stack.token("mcp-memory", scopes=("memory:read", "memory:write"))
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        url = stack.endpoints["mcp_servers"]["mcp-memory"]
        async with Client(streamable_http_client(url, http_client=http)) as client:
            result = await client.call_tool("remember", {"text": text, "tier": "semantic"})
    assert not result.is_error, result.content
    return str((result.structured_content or {})["status"])


async def test_memory_writes_are_counted_by_tier_and_outcome(traced: tuple[Stack, OtlpReceiver]) -> None:
    stack, _ = traced
    async with httpx.AsyncClient(timeout=10) as http:
        before = await _scrape(http, stack, "mcp-memory")
        clean = await _remember(
            stack, f"Invoices from Northwind are settled monthly ({uuid.uuid4().hex[:6]})."
        )
        redacted = await _remember(stack, "Refunds above 500 EUR go to dana.whitfield@acme-corp.io first.")
        denied = await _remember(stack, "prod db: postgresql://app:Hunter2x9@db:5432/app")
        after = await _scrape(http, stack, "mcp-memory")
    assert (clean, redacted, denied) == ("stored", "stored", "denied")
    for outcome in ("committed", "redacted", "denied"):
        counted = _samples(after, "fleet_memory_writes_total", tier="semantic", outcome=outcome)
        assert counted - _samples(before, "fleet_memory_writes_total", tier="semantic", outcome=outcome) == 1
    assert "dana" not in after and "Hunter2x9" not in after
