"""The console's charts from the processes' metrics snapshots (fleetctl.console._charts.series): a
counter's increase lands in the interval of the snapshot that shows it, a process that restarted
counts from 0 again, a process first seen long after it started adds nothing it counted before the
window, gauges are the newest coordinator's word, and latency quantiles are read from the buckets."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.errors import FleetError
from fleetctl.console._charts import GAUGE_HELD_S, quantile, series, window_of

NOW = 10_000.0
WINDOW = 600.0  # ten intervals of 60 s with buckets=10
START = NOW - WINDOW
LE = ["0.01", "0.1", "1.0", "+Inf"]


def tool_snapshot(
    source: str, at: float, counts: list[float], *, boot: float = 0.0, errors: float = 0
) -> dict[str, Any]:
    return {
        "source": source,
        "boot": boot,
        "at": at,
        "tool_calls": {"le": LE, "counts": counts, "sum": 0.0},
        "tool_errors": errors,
    }


def at(interval: int, offset: float = 30.0) -> float:
    return START + interval * 60 + offset


def test_increases_land_in_the_interval_of_the_later_snapshot_summed_over_processes() -> None:
    samples = [
        tool_snapshot("mcp-a", at(0), [1, 2, 2, 2]),  # before: what the process counted earlier
        tool_snapshot("mcp-a", at(3), [1, 5, 5, 5], errors=1),
        tool_snapshot("mcp-b", at(2), [0, 0, 1, 1]),
        tool_snapshot("mcp-b", at(3), [0, 0, 3, 4]),
    ]
    charts = series(samples, NOW, WINDOW, buckets=10)
    assert charts["tools"]["calls"] == [0, 0, 0, 3 + 3, 0, 0, 0, 0, 0, 0]
    assert charts["tools"]["errors"][3] == 1
    # 6 calls in interval 3: 3 under 100 ms (mcp-a), 2 in 0.1-1 s and 1 above 1 s (mcp-b)
    assert charts["tools"]["p50_s"][3] == pytest.approx(0.01 + (0.1 - 0.01) * (3 - 0) / 3)
    assert charts["tools"]["p95_s"][3] == 1.0  # in the +Inf bucket: the largest finite bound
    assert charts["tools"]["p50_s"][4] is None  # nothing happened: no latency, not 0
    assert charts["sources"] == ["mcp-a", "mcp-b"]


def test_a_restarted_process_counts_from_zero_and_one_first_seen_late_adds_nothing_before_the_window() -> (
    None
):
    samples = [
        tool_snapshot("mcp-a", at(1), [0, 10, 10, 10], boot=START - 999),  # started before the window
        tool_snapshot("mcp-a", at(2), [0, 12, 12, 12], boot=START - 999),
        tool_snapshot("mcp-a", at(5), [0, 1, 1, 1], boot=at(5, 0)),  # restarted: its 1 is new
        tool_snapshot("mcp-new", at(6), [0, 4, 4, 4], boot=at(6, 0)),  # started in the window
    ]
    calls = series(samples, NOW, WINDOW, buckets=10)["tools"]["calls"]
    assert calls == [0, 0, 2, 0, 0, 1, 4, 0, 0, 0]


def test_a_counter_that_went_down_under_the_same_boot_is_taken_as_reset() -> None:
    samples = [
        {"source": "w", "boot": 1.0, "at": at(1), "policy": {"deny": 5, "allow": 9}},
        {"source": "w", "boot": 1.0, "at": at(2), "policy": {"deny": 7, "allow": 9}},
        {"source": "w", "boot": 1.0, "at": at(3), "policy": {"deny": 1, "allow": 2}},
    ]
    policy = series(samples, NOW, WINDOW, buckets=10)["policy"]
    assert policy["deny"][2:4] == [2, 1]
    assert policy["allow"][2:4] == [0, 2]


def test_run_gauges_are_the_newest_snapshot_s_held_briefly_then_a_gap() -> None:
    def coordinator(source: str, when: float, working: int) -> dict[str, Any]:
        runs = {"working": working, "completed": 10}
        return {"source": source, "boot": 1.0, "at": when, "runs": runs, "queue": {"pending": 2}}

    samples = [
        coordinator("coordinator-1", at(1, 10), 3),
        coordinator("coordinator-2", at(1, 20), 4),  # two replicas report the same fleet: the newer word
        coordinator("coordinator-1", at(4, 50), 1),
    ]
    charts = series(samples, NOW, WINDOW, buckets=10)
    working = charts["runs"]["working"]
    assert working[1] == 4
    assert GAUGE_HELD_S == 60  # the interval after a snapshot keeps its value, then nothing is claimed
    assert working[2] == 4 and working[3] is None
    assert working[4] == 1 and working[5] == 1 and working[6] is None
    assert list(charts["runs"]) == ["working", "completed"]  # the states in their lifecycle's order
    assert charts["queue"]["pending"][1] == 2


def test_histogram_quantiles_interpolate_within_the_bucket() -> None:
    assert quantile(0.5, {"0.1": 0, "1.0": 10, "+Inf": 10}) == pytest.approx(0.55)
    assert quantile(0.95, {"0.1": 0, "1.0": 10, "+Inf": 10}) == pytest.approx(0.1 + 0.9 * 0.95)
    assert quantile(0.5, {"0.1": 4, "1.0": 4, "+Inf": 4}) == pytest.approx(0.05)


def test_only_the_offered_windows_are_read() -> None:
    assert window_of(None) == 3600 and window_of("15m") == 900
    with pytest.raises(FleetError) as refused:
        window_of("10y")
    assert refused.value.code == "invalid_request"


def agent_snapshot(
    source: str, when: float, tokens_in: float, cost: float, stops: float, latency: list[float]
) -> dict[str, Any]:
    return {
        "source": source,
        "boot": 0.0,
        "at": when,
        "agents": {
            "researcher": {
                "tokens_in": tokens_in,
                "tokens_out": tokens_in / 2,
                "cost_usd": cost,
                "stops": {"repeated_call": stops},
                "llm_latency": {"le": LE, "counts": latency, "sum": 0.0},
            }
        },
    }


def test_what_an_agent_spent_is_charted_per_interval_and_totalled_over_the_window_across_workers() -> None:
    samples = [
        agent_snapshot("worker-1", at(0), 100, 0.01, 0, [0, 1, 1, 1]),
        agent_snapshot("worker-1", at(2), 400, 0.04, 1, [0, 3, 4, 4]),
        agent_snapshot("worker-2", at(1), 0, 0.0, 0, [0, 0, 0, 0]),
        agent_snapshot("worker-2", at(2), 50, 0.005, 0, [0, 0, 1, 1]),
    ]
    charts = series(samples, NOW, WINDOW, buckets=10)
    researcher = charts["agents"]["researcher"]
    assert researcher["tokens_in"][2] == 300 + 50 and sum(researcher["tokens_in"]) == 350
    assert researcher["stops"]["repeated_call"][2] == 1
    total = researcher["total"]
    assert (total["tokens_in"], total["tokens_out"], total["cost_usd"]) == (350, 175, pytest.approx(0.035))
    assert total["stops"] == {"repeated_call": 1} and total["llm_calls"] == 4
    # Of the 4 completions in the window, 2 under 100 ms and 2 between 0.1 and 1 s.
    assert total["llm_p50_s"] == pytest.approx(0.1) and 0.1 < total["llm_p95_s"] <= 1.0
