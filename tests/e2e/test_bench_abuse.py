"""The abuse benchmark in its short form: on a real stack, the victim is measured idle and under
attack, every attack reports what it got back, and the page's row and section render. Whether the
targets are met is the benchmark's business (docs/benchmarks.md), not this test's: the short form
is too short to be a measure."""

from __future__ import annotations

import pytest

from bench import abuse

pytestmark = pytest.mark.e2e

VICTIM_REQUESTS = {"run", "GET /v1/runs", "GET /v1/runs/{id}", "GET /v1/runs/{id}/events"}
ATTACKS = {
    "event streams",
    "SubscribeToTask streams",
    "10 MB A2A SendMessage",
    "10 MB run API signal",
    "10 MB registry enroll, no token",
    "SQL repeat 200 MB, direct MCP",
    "SQL repeat 200 MB, plan step",
    "events published",
    f"memory writes ({abuse.MEMORY_BATCH} per call)",
}


def test_the_abuse_benchmark_runs_in_its_short_form() -> None:
    result = abuse.main(quick=True)
    assert result["form"] == "short"
    assert result["attacks_made"] == list(abuse.ATTACKS)
    for phase in ("idle", "attacked"):
        assert set(result[phase]) >= VICTIM_REQUESTS, result[phase]
        assert all(result[phase][kind]["requests"] >= 1 for kind in VICTIM_REQUESTS if kind in result[phase])
        assert isinstance(result[phase]["failures"], int)
    assert result["idle"]["failures"] == 0, result["idle"]  # the baseline is of a working stack
    assert result["attacked"]["run"]["requests"] >= 1
    assert set(result["p99_ratio"]) == set(result["p50_ratio"]) == VICTIM_REQUESTS
    assert isinstance(result["worst_p99_ratio"], float)
    assert isinstance(result["postgres_refusals"], int) and result["postgres_probe"]["tries"] >= 1
    # Every attack was made and something came back from it (whatever it was).
    assert set(result["attacks"]) >= ATTACKS, result["attacks"]
    assert all(sum(result["attacks"][name].values()) >= 1 for name in ATTACKS)
    streams = sum(result["attacks"]["event streams"].values()) + sum(
        result["attacks"]["SubscribeToTask streams"].values()
    )
    assert streams >= 2 * abuse.SHORT.streams
    assert sum(result["attacks"]["events published"].values()) == abuse.SHORT.events
    result["measured_on"] = "this test"
    assert "one tenant at full tilt" in abuse.summary_row(result).lower()
    assert "## One tenant at full tilt against another" in abuse.section(result)
