"""The bus benchmark in its short form: it runs, every event it publishes is ingested on each of the
three servers, and it reports every measure the benchmarks page shows (the numbers are the
benchmark's business, not this test's)."""

from __future__ import annotations

import gc
import warnings

from bench import bus


def test_the_bus_benchmark_runs_in_its_short_form() -> None:
    with warnings.catch_warnings():  # what earlier tests' nats-py connections left to the collector
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    result = bus.main(quick=True)
    assert set(result["ingest_events_per_s"]) == {"bare", "authenticated", "authenticated + TLS"}
    assert all(rate > 0 for rate in result["ingest_events_per_s"].values())
    assert set(result["connect_ms_p50"]) == {
        "bare: anonymous",
        "authenticated: identity",
        "authenticated: producer nkey",
        "authenticated + TLS: identity",
        "authenticated + TLS: producer nkey",
    }
    assert set(result["publish_to_deliver_ms_p50"]) == {"bare", "authenticated", "authenticated + TLS"}
    assert "ingest on the authenticated bus over TLS" in bus.summary_row(result)
    assert "## The bus's authentication and TLS" in bus.section(result)
