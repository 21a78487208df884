"""Skills bound to identities, and what may leave for an agent outside the fleet: the local stack's
enrollments against the skills each module serves, the registry's skills decision, a step naming
its agent, and the input cut down to the paths the egress policy names (at any depth)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine.egress import keep_paths, leaf_paths
from coordinator.planning.plan import PlanError, parse_steps
from coordinator.server import SKILLS as COORDINATOR_SKILLS
from deploy.local_stack import SERVICES
from policy import DEFAULT_BUNDLE_DIR, RegorusEngine
from registry._records import IdentityRecord
from registry._skills import SkillBinding
from specialists.case_desk.agent import CaseDeskSettings
from specialists.case_desk.agent import skills as case_desk_skills
from specialists.code_runner.agent import SKILLS as CODE_RUNNER
from specialists.publisher.agent import SKILLS as PUBLISHER
from specialists.researcher.agent import SKILLS as RESEARCHER
from specialists.sql_analyst.agent import SKILLS as SQL_ANALYST
from specialists.stats.agent import SKILLS as STATS

SERVED = {
    "specialists.sql_analyst.agent:main": [s.id for s in SQL_ANALYST],
    "specialists.stats.agent:main": [s.id for s in STATS],
    "specialists.case_desk.agent:main": [
        s.id for s in case_desk_skills(CaseDeskSettings.model_construct(note_timeout_s=10.0))
    ],
    "specialists.code_runner.agent:main": [s.id for s in CODE_RUNNER],
    "specialists.researcher.agent:main": [s.id for s in RESEARCHER],
    "specialists.publisher.agent:main": [s.id for s in PUBLISHER],
    "coordinator.server:main": [s.id for s in COORDINATOR_SKILLS],
}


def test_every_service_of_the_stack_is_enrolled_for_exactly_the_skills_its_module_serves() -> None:
    for spec in SERVICES:
        assert sorted(spec.skills) == sorted(SERVED.get(spec.entry, [])), spec.id


def test_every_skill_the_fleet_serves_is_held_inside_it_by_policy() -> None:
    data = json.loads((DEFAULT_BUNDLE_DIR / "data.json").read_text())
    internal = set(data["config"]["registry"]["skills"]["internal"])
    assert {skill for skills in SERVED.values() for skill in skills} <= internal


def identity(skills: list[str], *, external: bool = False) -> IdentityRecord:
    return IdentityRecord(
        id="acme-partner", kind="specialist", skills=skills, external=external, enrolled_at=0
    )


async def test_the_registry_asks_policy_and_names_the_refused_skills() -> None:
    binding = SkillBinding(RegorusEngine.from_dir())
    allowed = await binding.decide(identity(["fraud-score"], external=True), ["fraud-score"])
    assert allowed.allow
    refused = await binding.decide(
        identity(["fraud-score", "reconcile-invoices"], external=True), ["reconcile-invoices", "fraud-score"]
    )
    assert not refused.allow
    assert refused.result["refused"] == ["reconcile-invoices"]
    assert not await binding.offers(identity(["fraud-score"], external=True), "sql-query")
    assert not await binding.offers(None, "fraud-score")  # an agent whose identity is gone


def test_a_step_may_name_its_agent_and_nothing_else_in_its_place() -> None:
    [step] = parse_steps([{"id": "s", "skill": "fraud-score", "agent": "acme-partner"}])
    assert step.agent == "acme-partner"
    assert step.to_dict()["agent"] == "acme-partner"
    assert "agent" not in parse_steps([{"skill": "x"}])[0].to_dict()


@pytest.mark.parametrize(
    "agent",
    ["", "a.b", "x" * 65, 7, ["acme-partner"], "acme partner", "../registry"],
)
def test_a_step_naming_something_that_is_not_an_agent_id_is_refused(agent: Any) -> None:
    with pytest.raises(PlanError, match="agent must be an agent id"):
        parse_steps([{"skill": "fraud-score", "agent": agent}])


def test_a_wait_step_names_no_agent() -> None:
    with pytest.raises(PlanError, match="a wait step names no agent"):
        parse_steps([{"wait": {"for_s": 5}, "agent": "acme-partner"}])


NESTED: dict[str, Any] = {
    "invoice_id": "INV-7",
    "customer": {"name": "Ann", "email": "ann@example.com", "address": {"city": "Oslo"}, "segment": "smb"},
    "lines": [
        {"sku": "A-1", "amount_cents": 1200, "owner": {"email": "x@example.com"}},
        {"sku": "B-2", "amount_cents": 800},
    ],
    "tags": ["x", "y"],
    "matrix": [[{"v": 1}], [{"v": 2, "w": 3}]],
    "empty": {},
    "a.b": "dotted key",
}


def test_the_paths_of_an_input_describe_its_shape_at_every_depth() -> None:
    paths, unnameable = leaf_paths(NESTED)
    assert paths == {
        "invoice_id",
        "customer.name",
        "customer.email",
        "customer.address.city",
        "customer.segment",
        "lines[].sku",
        "lines[].amount_cents",
        "lines[].owner.email",
        "tags[]",
        "matrix[][].v",
        "matrix[][].w",
    }
    assert unnameable == {"'a.b'"}


def test_only_the_named_paths_are_kept_and_nothing_betrays_what_was_held_back() -> None:
    kept = keep_paths(NESTED, {"invoice_id", "customer.segment", "lines[].amount_cents", "matrix[][].w"})
    assert kept == {
        "invoice_id": "INV-7",
        "customer": {"segment": "smb"},
        "lines": [{"amount_cents": 1200}, {"amount_cents": 800}],
        "matrix": [[{"w": 3}]],
    }
    assert keep_paths(NESTED, set()) == {}
    # A key no path can name is never sent, even if a path looks like it.
    assert keep_paths(NESTED, {"a.b"}) == {}


def bundle_with(root: Path, edit: Callable[[dict[str, Any]], None]) -> RegorusEngine:
    """The installed bundle with ``edit`` applied to its config, as a policy author would."""
    shutil.copytree(DEFAULT_BUNDLE_DIR, root)
    data = json.loads((root / "data.json").read_text())
    edit(data["config"])
    (root / "data.json").write_text(json.dumps(data))
    return RegorusEngine.from_dir(root)


async def test_the_egress_decision_over_an_input_sends_only_what_a_grant_names(tmp_path: Path) -> None:
    grant = {
        "tenant": "acme",
        "agent": "acme-partner",
        "skills": ["fraud-score"],
        "fields": ["invoice_id", "customer", "lines[].amount_cents", "lines[].owner"],
    }
    bundle = RegorusEngine.from_dir()
    paths, _ = leaf_paths(NESTED)
    step = {
        "tenant": "acme",
        "agent": {"id": "acme-partner", "url": "http://x"},
        "skill": "fraud-score",
        "fields": sorted(NESTED),
        "paths": sorted(paths),
    }
    assert not (await bundle.decide("fleet.egress.decision", step)).allow  # no grant: nothing leaves
    engine = bundle_with(tmp_path / "bundle", lambda config: config["egress"].update(grants=[grant]))
    decision = await engine.decide("fleet.egress.decision", step)
    assert decision.allow
    # customer's and the owners' e-mail and address stay behind: the withheld keys, at any depth
    assert keep_paths(NESTED, set(decision.result["send"])) == {
        "invoice_id": "INV-7",
        "customer": {"name": "Ann", "segment": "smb"},
        "lines": [{"amount_cents": 1200}, {"amount_cents": 800}],
    }
