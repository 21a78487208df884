"""Plans: a request's steps, either given by the caller (an A2A data part ``{"steps": [...]}``) or
chosen by the routing policy from the request's text."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coordinator.record.runs import PlanStep
from fleet.errors import ErrorCode, FleetError
from fleet.events import TOKEN_PATTERN
from policy import PolicyEngine

MAX_STEPS = 20


RESERVED_INPUT = "approval"


class PlanError(FleetError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_REQUEST, message)


MAX_CALL_SIZE = 500
TIMER_SKILL = "fleet.timer"  # reserved: a step that only waits (no specialist offers it)
# A step whose skill is ``workflow:NAME`` runs a registered workflow (coordinator.engine.workflows).
WORKFLOW_SKILL_PREFIX = "workflow:"
MAX_WAIT_S = 366 * 24 * 3600.0
_SOURCE = re.compile(rf"^{TOKEN_PATTERN}$")
_AGENT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Step:
    id: str
    skill: str
    input: dict[str, Any]
    after: tuple[str, ...] = ()  # steps that must finish first, beyond those whose results it takes
    # A batch step: the skill runs over every item of ``for_each`` (a list, or {"$from": ...}), in
    # calls of ``call_size`` items passed as input field ``items_as``, the run's progress
    # checkpointed every ``checkpoint_every`` items (both default to policy, config.batch).
    for_each: Any = None
    items_as: str = "items"
    batch: dict[str, int] | None = None
    # A timer step: the run waits, holding no process, until a time ({"until": RFC 3339}) or for a
    # while ({"for_s": seconds}); its result says when it was due and when it fired.
    wait: dict[str, Any] | None = None
    # The agent the plan names for the step (an agent outside the fleet is used only when the plan
    # or the tenant's routing policy names it; see Delegator.assign). None: routing picks one.
    agent: str | None = None

    def to_dict(self) -> PlanStep:
        step: PlanStep = {"id": self.id, "skill": self.skill, "input": self.input, "after": list(self.after)}
        if self.agent is not None:
            step["agent"] = self.agent
        if self.for_each is not None:
            step["for_each"], step["items_as"], step["batch"] = self.for_each, self.items_as, self.batch or {}
        if self.wait is not None:
            step["wait"] = self.wait
        return step


def dependencies(step: PlanStep) -> set[str]:
    """The steps that ``step`` waits for: those it takes a result from, and those it names in
    ``after``. Steps that do not wait for each other run in parallel."""
    found = set(step.get("after", ()))

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "$from" in value:
                found.add(str(value["$from"]).split(".", 1)[0])
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(step.get("input", {}))
    walk(step.get("for_each"))
    return found


def parse_steps(raw: Any) -> list[Step]:
    """Validate a caller's steps: unique ids, a skill each, object inputs, references backwards."""
    if not isinstance(raw, list) or not raw:
        raise PlanError('"steps" must be a non-empty list')
    if len(raw) > MAX_STEPS:
        raise PlanError(f"a plan has at most {MAX_STEPS} steps")
    steps: list[Step] = []
    for index, item in enumerate(raw):
        if isinstance(item, dict) and "wait" in item:
            if item.get("skill", TIMER_SKILL) != TIMER_SKILL or "for_each" in item:
                raise PlanError(f"step {index}: a wait step has no skill and no for_each")
            item = {**item, "skill": TIMER_SKILL}
        if not isinstance(item, dict) or not isinstance(item.get("skill"), str) or not item["skill"]:
            raise PlanError(f"step {index} needs a skill")
        if item["skill"] == TIMER_SKILL and "wait" not in item:
            raise PlanError(f"step {index}: {TIMER_SKILL} is reserved for wait steps")
        step_id = item.get("id", f"step{index + 1}")
        if not isinstance(step_id, str) or "@" in step_id or any(s.id == step_id for s in steps):
            raise PlanError(f"step {index} needs a unique string id without '@'")
        payload = item.get("input", {})
        if not isinstance(payload, dict):
            raise PlanError(f"step {step_id}: input must be an object")
        if RESERVED_INPUT in payload:
            # Set by the coordinator only, after a person approved the step (see graph.answered):
            # a caller who could set it would approve their own step.
            raise PlanError(
                f"step {step_id}: input.{RESERVED_INPUT} is reserved for approvals the fleet records"
            )
        earlier = {s.id for s in steps}
        _check_references(payload, earlier, step_id)
        after = item.get("after", [])
        if not isinstance(after, list) or not all(isinstance(a, str) and a in earlier for a in after):
            raise PlanError(f"step {step_id}: after must list ids of earlier steps")
        steps.append(
            Step(
                step_id,
                item["skill"],
                payload,
                tuple(after),
                *_batch_of(item, earlier, step_id),
                wait=_wait_of(item, step_id),
                agent=_agent_of(item, step_id),
            )
        )
    return steps


def _agent_of(item: dict[str, Any], step_id: str) -> str | None:
    """The agent a step names, validated: an agent id (a wait step names none)."""
    agent = item.get("agent")
    if agent is None:
        return None
    if "wait" in item:
        raise PlanError(f"step {step_id}: a wait step names no agent")
    if not isinstance(agent, str) or not _AGENT_ID.match(agent):
        raise PlanError(f"step {step_id}: agent must be an agent id (1-64 letters, digits, - and _)")
    return agent


def _wait_of(item: dict[str, Any], step_id: str) -> dict[str, Any] | None:
    """The wait of a wait step, validated: exactly one of ``until`` (RFC 3339, with its offset) and
    ``for_s`` (seconds, up to a year); or an ``event`` (a logical subject under ``fleet.events.``,
    without tenant and source, with an optional ``type``, ``source`` and ``timeout_s``; only an event
    of the run's own tenant answers it)."""
    if "wait" not in item:
        return None
    wait = item["wait"]
    if isinstance(wait, dict) and "event" in wait:
        return _event_wait(wait, step_id)
    if isinstance(wait, dict) and "batch" in wait:
        return _batch_wait(wait, step_id)
    if not isinstance(wait, dict) or len(wait) != 1 or not set(wait) <= {"until", "for_s"}:
        raise PlanError(
            f'step {step_id}: wait takes one of {{"until": TIME}}, {{"for_s": SECONDS}} or {{"event": SUBJECT}}'
        )
    if "until" in wait:
        try:
            until = dt.datetime.fromisoformat(str(wait["until"]))
        except ValueError as exc:
            raise PlanError(f"step {step_id}: wait.until must be an RFC 3339 time") from exc
        if until.tzinfo is None:
            raise PlanError(f"step {step_id}: wait.until needs a UTC offset")
        return {"until": until.isoformat()}
    seconds = wait["for_s"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= MAX_WAIT_S:
        raise PlanError(f"step {step_id}: wait.for_s must be a number of seconds, at most a year")
    return {"for_s": float(seconds)}


def _batch_wait(wait: dict[str, Any], step_id: str) -> dict[str, Any]:
    """A batch collection (made by a batch trigger): gather the run's items until ``until`` (or
    until a closing event), then give them as the step's result."""
    if set(wait) != {"batch", "until"} or not isinstance(wait["batch"], str) or not wait["batch"]:
        raise PlanError(f'step {step_id}: a batch wait is {{"batch": RULE, "until": TIME}}')
    try:
        until = dt.datetime.fromisoformat(str(wait["until"]))
    except ValueError as exc:
        raise PlanError(f"step {step_id}: wait.until must be an RFC 3339 time") from exc
    if until.tzinfo is None:
        raise PlanError(f"step {step_id}: wait.until needs a UTC offset")
    return {"batch": wait["batch"], "until": until.isoformat()}


def _event_wait(wait: dict[str, Any], step_id: str) -> dict[str, Any]:
    subject, type_, timeout = wait.get("event"), wait.get("type"), wait.get("timeout_s")
    source = wait.get("source")
    if not set(wait) <= {"event", "type", "source", "timeout_s"}:
        raise PlanError(f"step {step_id}: an event wait takes event, type, source and timeout_s")
    if (
        not isinstance(subject, str)
        or not subject.startswith("fleet.events.")
        or "*" in subject
        or ">" in subject
    ):
        raise PlanError(f"step {step_id}: wait.event must be one subject under fleet.events. (no wildcards)")
    if type_ is not None and not isinstance(type_, str):
        raise PlanError(f"step {step_id}: wait.type must be a string")
    if source is not None and (not isinstance(source, str) or not _SOURCE.match(source)):
        raise PlanError(f"step {step_id}: wait.source must be a source: 1-64 letters, digits, _ or -")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_WAIT_S
    ):
        raise PlanError(f"step {step_id}: wait.timeout_s must be a number of seconds, at most a year")
    found: dict[str, Any] = {"event": subject}
    if type_ is not None:
        found["type"] = type_
    if source is not None:
        found["source"] = source
    if timeout is not None:
        found["timeout_s"] = float(timeout)
    return found


def _batch_of(
    item: dict[str, Any], earlier: set[str], step_id: str
) -> tuple[Any, str, dict[str, int] | None]:
    """The batch fields of a step (``for_each``, ``items_as``, ``batch``), validated."""
    if "for_each" not in item:
        return None, "items", None
    for_each = item["for_each"]
    if not isinstance(for_each, list) and not (isinstance(for_each, dict) and "$from" in for_each):
        raise PlanError(f'step {step_id}: for_each must be a list or {{"$from": "step.field"}}')
    _check_references(for_each, earlier, step_id)
    items_as = item.get("items_as", "items")
    if not isinstance(items_as, str) or not items_as:
        raise PlanError(f"step {step_id}: items_as must name an input field")
    raw = item.get("batch", {})
    # Numbers in A2A data parts arrive as floats (protobuf Struct): accept whole ones.
    if not isinstance(raw, dict) or not all(
        key in ("call_size", "checkpoint_every")
        and isinstance(value, int | float)
        and value == int(value) > 0
        for key, value in raw.items()
    ):
        raise PlanError(f"step {step_id}: batch takes call_size and checkpoint_every, positive integers")
    batch = {key: int(value) for key, value in raw.items()}
    if batch.get("call_size", 0) > MAX_CALL_SIZE:
        raise PlanError(f"step {step_id}: call_size is at most {MAX_CALL_SIZE}")
    return for_each, items_as, batch


def _check_references(value: Any, earlier: set[str], step_id: str) -> None:
    if isinstance(value, dict):
        if "$from" in value:
            source = str(value["$from"]).split(".", 1)[0]
            if source not in earlier:
                raise PlanError(f"step {step_id} refers to {source!r}, which is not an earlier step")
            return
        for item in value.values():
            _check_references(item, earlier, step_id)
    elif isinstance(value, list):
        for item in value:
            _check_references(item, earlier, step_id)


# Marks the result of an agent outside the fleet that policy does not let later steps act on (see
# fleet.egress): the value is the agent's id.
UNTRUSTED = "$untrusted"


def resolve_input(value: Any, results: dict[str, Any]) -> Any:
    """Replace every ``{"$from": "step.path.to.field"}`` with that part of an earlier result; a
    result marked :data:`UNTRUSTED` cannot be taken (``policy_denied``)."""
    if isinstance(value, dict):
        if "$from" in value:
            step_id, _, path = str(value["$from"]).partition(".")
            current: Any = results.get(step_id)
            if isinstance(current, dict) and UNTRUSTED in current:
                raise FleetError(
                    ErrorCode.POLICY_DENIED,
                    f"{value['$from']}: step {step_id} was answered by {current[UNTRUSTED]}, outside the"
                    " fleet, and the egress policy does not let its answer be acted on",
                )
            for key in path.split(".") if path else []:
                if not isinstance(current, dict) or key not in current:
                    raise PlanError(f"{value['$from']} is not in the result of step {step_id}")
                current = current[key]
            return current
        return {key: resolve_input(item, results) for key, item in value.items()}
    if isinstance(value, list):
        return [resolve_input(item, results) for item in value]
    return value


def workflow_step(part: dict[str, Any]) -> Step:
    """The one step of a request for a workflow by name: ``{"workflow": NAME, "input": {...}}``."""
    name, given = part.get("workflow"), part.get("input", {})
    if not isinstance(name, str) or not name or len(name) > 64:
        raise PlanError('"workflow" must name a registered workflow')
    if not isinstance(given, dict):
        raise PlanError("a workflow's input must be an object")
    return parse_steps([{"id": name, "skill": WORKFLOW_SKILL_PREFIX + name, "input": given}])[0]


# Plans a request's text when no routing rule does (see coordinator.planning.llm_planner).
Planner = Callable[[str], Awaitable[list[Step]]]


async def plan_request(
    data: list[Any], text: str, engine: PolicyEngine, tenant: str, *, planner: Planner | None = None
) -> list[Step]:
    """The plan for a request: explicit steps win; otherwise the routing policy decides; a text no
    routing rule matches is planned by ``planner`` if there is one (an LLM), else refused."""
    for part in data:
        if isinstance(part, dict) and "steps" in part:
            return parse_steps(part["steps"])
        if isinstance(part, dict) and "workflow" in part:
            return [workflow_step(part)]
    if not text.strip():
        raise PlanError('send text or a data part {"steps": [{"skill": ..., "input": {...}}]}')
    decision = await engine.decide("fleet.routing.decision", {"text": text, "tenant": tenant})
    if decision.allow:
        return parse_steps(decision.result.get("steps"))
    if planner is not None:
        return await planner(text)
    raise FleetError(
        ErrorCode.NO_SPECIALIST,
        f"no routing rule matches this request; send explicit steps ({'; '.join(decision.reasons)})",
    )
