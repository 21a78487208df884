"""Skills bound to identities, routing that keeps work inside, egress deny by default (review H4).

Attacks against a stack of real processes: a partner organisation's agent (``tests/e2e/partner.py``:
enrolled ``--external``, its own authorization server) or an enrolled internal identity publishes a
signed card claiming a skill that is not its to offer (``reconcile-invoices``, whose steps carry
customers' data). The registry refuses the card at registration, quarantines one changed to claim it
later, and discovery never hands the agent out for it; the step goes to the fleet's own specialist.
A partner the tenant's policy allows gets only the input fields the egress grant names, at any
depth; a tenant whose policy does not name it never sends it anything.

The stack's policy names one partner, ``acme-partner``, for tenant ``acme`` only: it may be routed
``fraud-score`` and ``fraud-review`` steps (``config.outside_agents``), and an egress grant lets a
few of a step's fields leave for it (``config.egress.grants``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.utils.errors import InvalidParamsError

from fleet.a2a_support import error_of_a2a
from fleetctl.testing.e2e import (
    Stack,
    all_events,
    clean_env,
    send,
    start_stack,
    stop_stack,
    user_message,
)
from fleetctl.testing.mcp import logged, logged_in
from policy import DEFAULT_BUNDLE_DIR
from specialists.kit import Skill, SkillContext
from tests.e2e.identities import IMPOSTOR_SKILL, Impostor, card_server
from tests.e2e.kit_agent import kit_agent
from tests.e2e.partner import SKILL as SCORE
from tests.e2e.partner import partner_agent

pytestmark = pytest.mark.e2e

PARTNER = "acme-partner"  # sorts before every specialist of the fleet: the review's squatter's name
SQUATTER = "acme-squatter"
BY_POLICY = "policy-partner"  # enrolled for no skill: policy grants it fraud-score
REVIEW = "fraud-review"
INTERNAL = "reconcile-invoices"
# What the grant lets leave for the partner. customer.email is named, yet stays behind: "email" is a
# key policy withholds wherever it occurs.
GRANTED_FIELDS = [
    "invoice_id",
    "amount_cents",
    "note",
    "customer.segment",
    "customer.email",
    "lines[].amount_cents",
]
INVOICES = [{"invoice": "INV-A-1001", "customer": "Northwind", "amount": 1180.0}]


def partner_policy(root: Path) -> Path:
    bundle = root / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    config = data["config"]
    config["outside_agents"] = {"acme": {SCORE: [PARTNER], REVIEW: [PARTNER]}}
    config["registry"]["skills"]["identities"] = {BY_POLICY: [SCORE]}
    config["egress"]["grants"] = [
        {"tenant": "acme", "agent": PARTNER, "skills": [SCORE, REVIEW], "fields": GRANTED_FIELDS}
    ]
    (bundle / "data.json").write_text(json.dumps(data))
    return bundle


@pytest.fixture(scope="module")
def partner_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    bundle = partner_policy(tmp_path_factory.mktemp("policy"))
    stack = start_stack(tmp_path_factory.mktemp("stack"), env=clean_env(FLEET_POLICY_DIR=str(bundle)))
    yield stack
    stop_stack(stack)


async def offered(stack: Stack, skill: str) -> list[str]:
    """The agents discovery hands out for ``skill``."""
    token = stack.token("registry", scopes=("registry:read",))
    async with httpx.AsyncClient(timeout=30) as http:
        found = await http.get(
            f"{stack.endpoints['registry']}/v1/agents",
            params={"skill": skill},
            headers={"Authorization": f"Bearer {token}"},
        )
    found.raise_for_status()
    return sorted(a["id"] for a in found.json()["agents"])


def agents_of(events: list[dict[str, Any]]) -> dict[str, str]:
    return {e["payload"]["step"]: e["payload"]["agent"] for e in events if e["type"] == "step.started"}


@pytest.mark.parametrize("enrolled_for", [(SCORE,), (SCORE, INTERNAL)], ids=["beyond-enrollment", "enrolled"])
async def test_a_partner_claiming_an_internal_skill_is_refused_at_registration_and_gets_no_step(
    partner_stack: Stack, enrolled_for: tuple[str, ...]
) -> None:
    """The review's exploit: a partner whose id sorts first claims reconcile-invoices and sql-query.
    Refused whether its enrollment left the skill out or (an operator's mistake) named it."""
    claimed = (SCORE, INTERNAL, "sql-query")
    async with partner_agent(
        partner_stack, SQUATTER, skills=claimed, enrolled_for=enrolled_for, must_register=False
    ) as (_, seen):
        status, body = seen.registration
        assert status == 403, body
        assert body["error"]["code"] == "skill_not_allowed"
        assert INTERNAL in body["error"]["message"] and "decision" in body["error"]["message"]
        assert await offered(partner_stack, INTERNAL) == ["sql-analyst"]
        assert SQUATTER not in await offered(partner_stack, SCORE)  # the whole card was refused
        plan = {"steps": [{"id": "reconcile", "skill": INTERNAL, "input": {"invoices": INVOICES}}]}
        token = partner_stack.token("coordinator")
        outcome = await send(partner_stack, user_message(data=plan), token=token)
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        events = await all_events(partner_stack, outcome.task_id, token)
        assert agents_of(events) == {"reconcile": "sql-analyst"}
    assert seen.inputs == [] and seen.assertions == []


async def test_a_card_changed_to_claim_an_internal_skill_is_quarantined_at_its_next_check(
    partner_stack: Stack,
) -> None:
    impostor = Impostor(partner_stack)
    async with httpx.AsyncClient(timeout=30) as http, card_server() as agent:
        enrolled = await impostor.enroll(http, impostor.enrollment_token(external=True))
        assert enrolled.status_code == 201, enrolled.text
        agent.serve(impostor.key)
        registered = await impostor.register(http, agent.base)
        assert registered.status_code == 200, registered.text
        assert impostor.id in await offered(partner_stack, IMPOSTOR_SKILL)
        # The same key signs a card that now claims the fleet's skill too.
        agent.serve(impostor.key, version="2", skills=(IMPOSTOR_SKILL, INTERNAL))
        token = (await impostor.request_token(http)).json()["access_token"]
        checked = await http.post(
            f"{impostor.registry}/v1/agents/{impostor.id}/refresh",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert checked.status_code == 200, checked.text
        record = checked.json()
        assert record["status"] == "quarantined"
        assert f"claims skills it may not offer ({INTERNAL})" in record["status_reason"]
        history = (
            await http.get(
                f"{impostor.registry}/v1/agents/{impostor.id}/history",
                headers={
                    "Authorization": f"Bearer {partner_stack.token('registry', scopes=('registry:read',))}"
                },
            )
        ).json()
        assert history["entries"][-1]["change"] == "refused"
    assert await offered(partner_stack, INTERNAL) == ["sql-analyst"]
    assert impostor.id not in await offered(partner_stack, IMPOSTOR_SKILL)


@pytest.mark.parametrize(
    ("enrolled_for", "claimed", "refused"),
    [
        ((IMPOSTOR_SKILL,), (IMPOSTOR_SKILL, "issue-refund"), "issue-refund"),
        ((), (IMPOSTOR_SKILL,), IMPOSTOR_SKILL),  # an identity enrolled for no skill offers none
    ],
    ids=["another-specialists-skill", "enrolled-for-none"],
)
async def test_an_internal_specialist_claiming_a_skill_not_bound_to_it_is_refused(
    partner_stack: Stack, enrolled_for: tuple[str, ...], claimed: tuple[str, ...], refused: str
) -> None:
    impostor = Impostor(partner_stack)
    async with httpx.AsyncClient(timeout=30) as http, card_server() as agent:
        enrolled = await impostor.enroll(http, impostor.enrollment_token(skills=enrolled_for))
        assert enrolled.status_code == 201, enrolled.text
        agent.serve(impostor.key, skills=claimed)
        response = await impostor.register(http, agent.base)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "skill_not_allowed"
    assert f"{impostor.id} may not offer skill {refused}" in error["message"]
    assert impostor.id not in await offered(partner_stack, refused)
    await logged(partner_stack, "registry", "skill_not_allowed", impostor.id)


async def test_policy_grants_a_partner_a_skill_its_enrollment_does_not_name_and_nothing_more(
    partner_stack: Stack,
) -> None:
    async with partner_agent(partner_stack, BY_POLICY, skills=(SCORE,), enrolled_for=()) as (_, seen):
        assert seen.registration[0] == 200
        assert BY_POLICY in await offered(partner_stack, SCORE)
    async with partner_agent(
        partner_stack, BY_POLICY, skills=(SCORE, REVIEW), enrolled_for=(), must_register=False
    ) as (_, seen):
        status, body = seen.registration
        assert status == 403 and body["error"]["code"] == "skill_not_allowed", body
        assert f"{BY_POLICY} may not offer skill {REVIEW}" in body["error"]["message"]


NESTED_STEP: dict[str, Any] = {
    "invoice_id": "INV-7",
    "amount_cents": 12000,
    "customer_email": "ann@example.com",
    "customer": {
        "name": "Ann Smith",
        "email": "ann@example.com",
        "segment": "smb",
        "iban": "NO9386011117947",
    },
    "lines": [
        {"sku": "A-1", "amount_cents": 9000, "holder": {"name": "Ann Smith", "phone": "+47 22 00 00 00"}},
        {"sku": "B-2", "amount_cents": 3000},
    ],
    "note": "retry with api_key=sk-live-0123456789abcdefghij",
    "internal": {"ledger": "L-3", "owner": "bob"},
}


async def test_an_allowed_partner_receives_no_field_that_egress_policy_does_not_name(
    partner_stack: Stack,
) -> None:
    async with partner_agent(partner_stack, PARTNER, skills=(SCORE, REVIEW)) as (_, seen):
        step = {"id": "score", "skill": SCORE, "agent": PARTNER, "input": NESTED_STEP}
        act_on_it = {
            "id": "use",
            "skill": "sql-query",
            "input": {"sql": {"$from": "score.query"}},
            "after": ["score"],
        }
        token = partner_stack.token("coordinator")
        outcome = await send(partner_stack, user_message(data={"steps": [step, act_on_it]}), token=token)
    # Only what the grant names, at every depth; the secret redacted from what is named.
    assert seen.inputs == [
        {
            "invoice_id": "INV-7",
            "amount_cents": 12000,
            "customer": {"segment": "smb"},
            "lines": [{"amount_cents": 9000}, {"amount_cents": 3000}],
            "note": "retry with api_key=[redacted]",
        }
    ]
    # The worker found the partner's token endpoint in its card, and proved its own identity there
    # with an assertion addressed to that endpoint only; the partner saw the worker, not the caller.
    [assertion] = seen.assertions
    assert assertion["sub"].startswith("worker-") and assertion["aud"].endswith("/partner-as/token")
    assert assertion["form"]["scope"] == "partner:score"
    assert {t["sub"] for t in seen.tokens} == {assertion["sub"]}
    # The partner's answer is kept, but policy does not let the next step act on it.
    assert outcome.state_name == "TASK_STATE_FAILED", outcome
    assert "policy_denied" in outcome.codes and "outside the fleet" in outcome.final_text
    events = await all_events(partner_stack, outcome.task_id, token)
    assert [e["payload"]["step"] for e in events if e["type"] == "step.completed"] == ["score"]
    # The run's own log says what left, by name, with the decision's id (the timeline, the bundle).
    [egress] = [e for e in events if e["type"] == "step.progress" and "egress to" in e["payload"]["text"]]
    assert f"egress to {PARTNER} (outside the fleet): 5 field(s) sent" in egress["payload"]["text"]
    assert "(decision " in egress["payload"]["text"] and "customer.iban" in egress["payload"]["text"]
    # The decision is logged with its id, with what was sent and what stayed behind.
    line = await logged_by_a_worker(partner_stack, f"egress to {PARTNER}", "lines[].holder.phone", "decision")
    assert "customer.iban" in line and "internal.owner" in line


async def test_a_step_naming_no_agent_goes_outside_only_for_a_tenant_whose_policy_names_the_partner(
    partner_stack: Stack,
) -> None:
    plan = {
        "steps": [
            {"id": "score", "skill": SCORE, "input": {"invoice_id": "INV-8", "customer": {"name": "Ann"}}}
        ]
    }
    async with partner_agent(partner_stack, PARTNER, skills=(SCORE, REVIEW)) as (_, seen):
        acme = await send(partner_stack, user_message(data=plan), token=partner_stack.token("coordinator"))
        assert acme.state_name == "TASK_STATE_COMPLETED", acme.final_text
        assert seen.inputs == [{"invoice_id": "INV-8"}]
        with pytest.raises(InvalidParamsError) as caught:
            await send(
                partner_stack,
                user_message(data=plan),
                token=partner_stack.token("coordinator", tenant="globex"),
            )
    assert error_of_a2a(caught.value).code == "no_specialist_for_skill"
    assert "tenant globex's policy names no agent outside the fleet" in caught.value.message
    assert len(seen.inputs) == 1 and len(seen.assertions) == 1  # globex's run never reached it


async def test_an_agent_that_moved_since_it_was_discovered_is_reached_at_its_new_address(
    partner_stack: Stack,
) -> None:
    """The partner stops and starts again on another port (a restart elsewhere) while the workers
    still hold its old record from discovery: the step is not lost to the old address, it goes to
    the same agent at the address the registry has now."""
    plan = {"steps": [{"id": "score", "skill": SCORE, "agent": PARTNER, "input": {"invoice_id": "INV-12"}}]}
    token = partner_stack.token("coordinator")
    for attempt in range(2):
        async with partner_agent(partner_stack, PARTNER, skills=(SCORE, REVIEW)) as (_, seen):
            run = await send(partner_stack, user_message(data=plan), token=token)
            assert run.state_name == "TASK_STATE_COMPLETED", (attempt, run.final_text)
            assert seen.inputs == [{"invoice_id": "INV-12"}]


async def test_a_tenant_whose_policy_does_not_name_the_partner_never_sends_to_it(
    partner_stack: Stack,
) -> None:
    """Even a plan that names the partner: egress is deny by default, and globex has no grant."""
    plan = {"steps": [{"id": "score", "skill": SCORE, "agent": PARTNER, "input": {"invoice_id": "INV-9"}}]}
    globex = partner_stack.token("coordinator", tenant="globex")
    async with partner_agent(partner_stack, PARTNER, skills=(SCORE, REVIEW)) as (_, seen):
        outcome = await send(partner_stack, user_message(data=plan), token=globex)
    assert outcome.state_name == "TASK_STATE_FAILED", outcome.final_text
    assert "policy_denied" in outcome.codes, outcome.codes
    assert "no egress grant lets tenant globex send skill fraud-score to acme-partner" in outcome.final_text
    assert "(decision " in outcome.final_text
    assert seen.inputs == [] and seen.assertions == [] and seen.tokens == []  # not even a token request
    await logged_by_a_worker(partner_stack, f"egress to {PARTNER} refused", "no egress grant", "decision")


async def _review(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    return {"reviewed_by": "the fleet"}


async def test_the_fleets_own_agent_is_preferred_to_a_partner_the_tenant_names(
    partner_stack: Stack, tmp_path: Path
) -> None:
    skill = Skill(REVIEW, "Fraud review", "Reviews an invoice", _review)
    async with (
        partner_agent(partner_stack, PARTNER, skills=(SCORE, REVIEW)) as (_, seen),
        kit_agent(partner_stack, tmp_path, [skill]) as inside,
    ):
        token = partner_stack.token("coordinator")
        for _ in range(3):  # every time, whatever the order of the ids
            plan = {"steps": [{"id": "review", "skill": REVIEW, "input": {"invoice_id": "INV-10"}}]}
            outcome = await send(partner_stack, user_message(data=plan), token=token)
            assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
            assert agents_of(await all_events(partner_stack, outcome.task_id, token)) == {"review": inside}
        assert seen.inputs == []
        # Named by the plan, the partner gets it.
        plan = {
            "steps": [{"id": "review", "skill": REVIEW, "agent": PARTNER, "input": {"invoice_id": "INV-11"}}]
        }
        outcome = await send(partner_stack, user_message(data=plan), token=token)
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        assert seen.inputs == [{"invoice_id": "INV-11"}]


async def logged_by_a_worker(stack: Stack, *needles: str, timeout_s: float = 10.0) -> str:
    """The line of any worker's log that has every one of ``needles`` (waiting for it)."""
    workers = sorted(stack.layout.logs_dir.glob("worker-*.log"))
    return await logged_in(workers, "the workers", *needles, timeout_s=timeout_s)
