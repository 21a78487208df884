"""The fleet's Grafana dashboard over its Prometheus metrics: what each agent's tasks spend on models
(tokens in and out per hour, dollars per hour, completion latency p50 and p95, tool calls longer
than 30 s, 429s, loop stops by reason, compactions) and the fleet around them (runs by state, tool
call latency, policy refusals). The same numbers the console's activity page charts.

``python -m deploy.dashboard`` writes ``deploy/grafana/agent-fleet.json`` (Grafana's classic
dashboard model, schemaVersion 39, a Prometheus data source chosen when it is imported); a test
checks the file is what this module makes, that it type-checks against Grafana's own schema
(``@grafana/schema``), and that every metric it reads is one the fleet exports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PATH = Path(__file__).resolve().parent / "grafana" / "agent-fleet.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH, HEIGHT = 12, 8


def _panel(
    number: int, title: str, unit: str, *queries: tuple[str, str], description: str = ""
) -> dict[str, Any]:
    """A time series panel of ``queries`` (PromQL, legend), two to a row."""
    return {
        "id": number,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": (number - 1) % 2 * WIDTH, "y": (number - 1) // 2 * HEIGHT},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(queries)
        ],
    }


def _latency(quantile: float) -> str:
    return (
        f"histogram_quantile({quantile}, sum by (agent, le)"
        ' (rate(fleet_agent_llm_request_duration_seconds_bucket{agent=~"$agent"}[5m])))'
    )


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, in order."""
    agent = '{agent=~"$agent"}'
    return [
        _panel(
            1,
            "LLM tokens per hour, by agent",
            "short",
            (
                f"sum by (agent, direction) (increase(fleet_agent_llm_tokens_total{agent}[1h]))",
                "{{agent}} {{direction}}",
            ),
            description="Prompt (in) and completion (out) tokens of each agent's tasks, as the agents reported them.",
        ),
        _panel(
            2,
            "Model cost per hour, by agent",
            "currencyUSD",
            (f"sum by (agent) (increase(fleet_agent_llm_cost_usd_total{agent}[1h]))", "{{agent}}"),
            description="Tokens priced by policy (config.models).",
        ),
        _panel(
            3,
            "Model latency, by agent",
            "s",
            (_latency(0.5), "{{agent}} p50"),
            (_latency(0.95), "{{agent}} p95"),
        ),
        _panel(
            4,
            "Tool calls longer than 30 s, per hour",
            "short",
            (f"sum by (agent) (increase(fleet_agent_slow_tool_calls_total{agent}[1h]))", "{{agent}}"),
            (f"sum by (agent) (increase(fleet_agent_tool_calls_total{agent}[1h]))", "{{agent}} all calls"),
        ),
        _panel(
            5,
            "Agent loops stopped, by reason, per hour",
            "short",
            (
                f"sum by (agent, reason) (increase(fleet_agent_loop_stops_total{agent}[1h]))",
                "{{agent}} {{reason}}",
            ),
            (
                f"sum by (agent) (increase(fleet_agent_loop_compactions_total{agent}[1h]))",
                "{{agent}} compacted",
            ),
            (
                f"sum by (agent, verdict) (increase(fleet_agent_loop_reviews_total{agent}[1h]))",
                "{{agent}} reviewed: {{verdict}}",
            ),
            description="A loop stops at a limit of its policy (config.loop): it then stops, summarizes, asks "
            "a person, or (stuck) goes to the reviewer, whose verdicts are counted.",
        ),
        _panel(
            6,
            "Model rate limits (429), per hour",
            "short",
            (f"sum by (agent) (increase(fleet_agent_llm_rate_limited_total{agent}[1h]))", "{{agent}}"),
        ),
        _panel(7, "Runs by state", "short", ("sum by (state) (fleet_runs)", "{{state}}")),
        _panel(
            8,
            "Tool call latency (MCP servers)",
            "s",
            (
                "histogram_quantile(0.95, sum by (le) (rate(fleet_tool_call_duration_seconds_bucket[5m])))",
                "p95",
            ),
            ('sum(rate(fleet_tool_call_duration_seconds_count{outcome!="ok"}[5m]))', "errors/s"),
        ),
        _panel(
            9,
            "Policy decisions refused",
            "short",
            ('sum by (query) (increase(fleet_policy_decisions_total{result!="allow"}[1h]))', "{{query}}"),
        ),
    ]


def dashboard() -> dict[str, Any]:
    """The dashboard, as Grafana's classic JSON model."""
    return {
        "uid": "agent-fleet",
        "title": "agent-fleet: agents and models",
        "description": "What each agent's tasks spend on models, and the fleet around them.",
        "tags": ["agent-fleet"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "timezone": "browser",
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "hide": 0,
                },
                {
                    "name": "agent",
                    "label": "Agent",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": "label_values(fleet_agent_llm_tokens_total, agent)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels(),
    }


def rendered() -> str:
    """The file's text."""
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    """Write the dashboard file (``--check``: exit 1 if it is not what this module makes)."""
    if "--check" in sys.argv[1:]:
        sys.exit(0 if PATH.exists() and PATH.read_text() == rendered() else 1)
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(rendered())


if __name__ == "__main__":
    main()
