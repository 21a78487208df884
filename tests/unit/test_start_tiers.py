"""The order in which ``fleet up`` starts the stack: tiers one after another, each tier at once."""

from __future__ import annotations

import dataclasses

import pytest

from deploy.local_stack import SERVICES, ServiceSpec, service, stack_services
from fleetctl.supervisor import start_tiers


def test_every_service_starts_in_exactly_one_tier_after_what_it_depends_on() -> None:
    tiers = start_tiers(SERVICES)
    ids = [spec.id for tier in tiers for spec in tier]
    assert sorted(ids) == sorted(spec.id for spec in SERVICES) and len(ids) == len(set(ids))
    assert [spec.id for spec in tiers[0]] == ["registry"]  # everything else enrolls with it
    position = {spec.id: n for n, tier in enumerate(tiers) for spec in tier}
    for spec in SERVICES:
        if spec.kind == "worker":  # the coordinator creates the run tables the workers use
            assert position[spec.id] > position["coordinator"]
        if spec.kind == "console":  # it finds the coordinator through the registry when it starts
            assert position[spec.id] > position["coordinator"]
        if spec.kind == "specialist":
            assert all(position[spec.id] > position[m.id] for m in SERVICES if m.kind == "mcp_server")
    assert {len(tier) for tier in tiers} != {1}  # some tier does start several services at once


def test_a_service_of_an_unknown_kind_is_refused_rather_than_never_started() -> None:
    stray = ServiceSpec("stray", "gateway", "x:main")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stray"):
        start_tiers((*SERVICES, stray))


def test_a_stack_may_have_any_number_of_workers_and_each_is_a_known_service() -> None:
    four = stack_services(workers=4)
    workers = [spec for spec in four if spec.kind == "worker"]
    assert [spec.id for spec in workers] == ["worker-1", "worker-2", "worker-3", "worker-4"]
    assert {spec.id for spec in four if spec.kind != "worker"} == {
        spec.id for spec in SERVICES if spec.kind != "worker"
    }
    # ``fleet serve worker-3`` finds it, with the same grants as the first worker.
    assert service("worker-3") == dataclasses.replace(service("worker-1"), id="worker-3")
    for stray in ("worker-0", "worker-", "worker-01", "worker-1x", "worker-10000"):
        with pytest.raises(KeyError):
            service(stray)
    with pytest.raises(ValueError, match="at least one worker"):
        stack_services(workers=0)
