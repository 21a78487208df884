"""Plans by a model: a request's text that no routing rule recognises becomes a plan over the skills
the fleet's specialists offer, checked like a caller's plan (:func:`coordinator.planning.plan.parse_steps`)
and refused if it names a skill nobody offers. Used only with an LLM configured
(``FLEET_LLM_BASE_URL``); without one such a text stays ``no_specialist_for_skill``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from coordinator.planning.plan import MAX_STEPS, PlanError, Planner, Step, parse_steps
from fleet.llm import ChatModel, from_settings, json_object_of
from fleet.settings import ServiceSettings
from registry import AgentRecord, RegistryClient

PLAN_FORMAT = f"""You plan work for a fleet of specialist agents. Answer with one JSON object and nothing else:
{{"steps": [{{"id": "...", "skill": "...", "input": {{...}}}}, ...]}}
- "skill" is the id of one of the skills listed below; use no other.
- "id" names the step (unique, no "@"); "input" is the object the skill is called with.
- An input value {{"$from": "STEP.FIELD"}} takes a field of an earlier step's result (FIELD may be a
  dotted path); a step that takes an earlier result waits for it, others run in parallel.
- "after": ["STEP", ...] makes a step wait for earlier steps whose results it does not take.
- At most {MAX_STEPS} steps; as few as do the job."""


class LlmPlanner:
    """Asks ``model`` for the plan of a request, from the skills on offer."""

    def __init__(self, model: ChatModel) -> None:
        self._model = model

    async def plan(self, text: str, skills: Sequence[dict[str, Any]]) -> list[Step]:
        """The model's plan for ``text`` over ``skills`` (``{"id", "name", "description"}`` each);
        a :class:`PlanError` that names the model's mistake if it is no plan, an invalid one, or
        one that uses a skill not in ``skills``."""
        if not skills:
            raise PlanError("no specialist offers a skill to plan with")
        listing = "\n".join(f"- {s['id']}: {s.get('name', '')}: {s.get('description', '')}" for s in skills)
        messages = [
            {"role": "system", "content": f"{PLAN_FORMAT}\n\nSkills:\n{listing}"},
            {"role": "user", "content": text},
        ]
        reply = await self._model.complete(messages)
        answer = json_object_of(reply.content)
        if answer is None or "steps" not in answer:
            quoted = reply.content.strip()[:200]
            raise PlanError(f'the model\'s plan is not a JSON object with "steps": {quoted!r}')
        try:
            steps = parse_steps(answer["steps"])
        except PlanError as exc:
            raise PlanError(f"the model's plan is invalid: {exc.message}") from exc
        offered = {str(s["id"]) for s in skills}
        for step in steps:
            if step.agent is not None:  # a model's words choose no agent, least of all one outside
                raise PlanError(
                    f"the model's plan names agent {step.agent!r} in step {step.id}: only a caller's"
                    " plan or policy may name an agent"
                )
            if step.skill not in offered:
                raise PlanError(
                    f"the model's plan uses skill {step.skill!r} in step {step.id}, which no specialist"
                    f" offers (offered: {', '.join(sorted(offered))})"
                )
        return steps


def offered_skills(agents: Sequence[AgentRecord]) -> list[dict[str, Any]]:
    """The skills that discovery may hand out: those of the fleet's own specialists it offers, each
    skill once (an outside agent's card is another organisation's text: not shown to the model)."""
    skills: dict[str, dict[str, Any]] = {}
    for agent in agents:
        if agent.kind != "specialist" or not agent.offered or agent.external:
            continue
        for skill in agent.skills:
            skills.setdefault(
                skill.id, {"id": skill.id, "name": skill.name, "description": skill.description}
            )
    return list(skills.values())


def registry_planner(model: ChatModel, registry: RegistryClient) -> Planner:
    """A :data:`~coordinator.planning.plan.Planner` over the skills the registry's specialists offer now."""
    planner = LlmPlanner(model)

    async def plan(text: str) -> list[Step]:
        return await planner.plan(text, offered_skills(await registry.agents()))

    return plan


def llm_planner(
    settings: ServiceSettings, http: httpx.AsyncClient, registry: RegistryClient
) -> Planner | None:
    """The coordinator's planner for the model its settings name; None without an LLM."""
    model = from_settings(settings, http)
    return None if model is None else registry_planner(model, registry)
