"""The fleet's operations extension to A2A: how a caller makes a request idempotent, asks, later,
what became of it, and cancels it.

- The caller puts an operation id in the message metadata under ``fleet.operation_id``. An agent that
  declares the extension runs an operation at most once: the same id again gets the recorded outcome
  (or joins the run in progress), never a second execution.
- ``GET {status_url}`` (the card's extension params; bearer auth as for the agent itself, scoped to
  the token's tenant) answers ``{"operation_id", "status", "result", "error"}`` where status is one of
  ``unknown`` (never received), ``running``, ``succeeded``, ``failed``, ``canceled``, ``interrupted``
  (the agent died while running it) or ``uncertain`` (a tool call's outcome could not be confirmed).
  ``?wait=S`` holds the answer up to S seconds while the operation runs. A running operation that
  was asked to cancel adds ``"cancel_requested": true``.
- ``POST {cancel_url}`` (same auth and scoping) cancels the operation and answers like the GET, once
  the cancel took effect (or after at most :data:`MAX_WAIT_S`; the answer may then still be
  ``running``). Cancellation is cooperative: a tool call in flight is never cut (its effect could then
  not be confirmed); the work stops before its next tool call, or at once if none is in flight, and
  ends ``canceled`` with the error ``{"code": "canceled", "message", "tool_calls": N}``, N being the
  tool calls it completed (0: it made no effect). An operation the agent never received is canceled
  in advance: it ends ``canceled`` with ``tool_calls: 0`` and, should the request arrive later, it is
  refused (failed with code ``canceled``) and never runs. An operation that already ended is left as
  it is; the answer is its recorded outcome.

An agent without the extension cannot answer; a caller that needs to know treats it as unable to say.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from a2a.types import AgentCard, AgentExtension

OPERATIONS_EXTENSION = "https://agent-fleet.dev/ext/operations/v1"
OPERATION_METADATA_KEY = "fleet.operation_id"
# A caller's limits for one task (lowered, never raised, by the agent: TaskBudget's keys), what its
# agent loop does at a limit and what tokens cost (LoopPolicy), and, on the task's end, what it spent.
BUDGET_METADATA_KEY = "fleet.budget"
LOOP_METADATA_KEY = "fleet.loop"
USAGE_METADATA_KEY = "fleet.usage"
# An agent loop's progress notes (specialists.progress): sent by the agent as the task goes, kept by
# the caller with the operation, and sent back with the operation if it is sent again.
PROGRESS_METADATA_KEY = "fleet.progress"
# The last request a failed task's agent loop sent its model (redacted), for the run's debug bundle.
LAST_REQUEST_METADATA_KEY = "fleet.last_request"
OPERATIONS_PATH = "/v1/operations"
MAX_WAIT_S = 30.0


def operations_extension(base_url: str) -> AgentExtension:
    extension = AgentExtension(
        uri=OPERATIONS_EXTENSION,
        description=(
            "Idempotent operations: send metadata fleet.operation_id; ask status_url for its outcome;"
            " POST cancel_url to cancel it."
        ),
        required=False,
    )
    operation = f"{base_url}{OPERATIONS_PATH}/{{operation_id}}"
    extension.params.update({"status_url": operation, "cancel_url": f"{operation}/cancel"})
    return extension


SKILLS_EXTENSION = "https://agent-fleet.dev/ext/skills/v1"


class SkillTraits(Protocol):
    """What the skills extension publishes of a skill."""

    @property
    def id(self) -> str: ...
    @property
    def idempotent(self) -> bool: ...
    @property
    def output_schema(self) -> dict[str, Any] | None: ...


def skills_extension(skills: Sequence[SkillTraits]) -> AgentExtension:
    """The card's word on each skill beyond A2A's fields: whether a repeat under one operation id
    is safe (``idempotent``: a caller may then also send the step to another agent offering the
    skill when this one cannot answer) and the JSON Schema its result satisfies (``output``: a
    caller refuses an answer that does not)."""
    extension = AgentExtension(
        uri=SKILLS_EXTENSION,
        description="Per skill: idempotent (safe to repeat or reroute under one operation id) and"
        " the JSON Schema of its result.",
        required=False,
    )
    traits: dict[str, Any] = {}
    for skill in skills:
        entry: dict[str, Any] = {"idempotent": skill.idempotent}
        if skill.output_schema is not None:
            entry["output"] = skill.output_schema
        traits[skill.id] = entry
    extension.params.update({"skills": traits})
    return extension


def skill_traits(card: dict[str, Any], skill: str) -> dict[str, Any]:
    """What an agent's card (as JSON) says of ``skill`` in the skills extension ({} if nothing)."""
    extensions = (card.get("capabilities") or {}).get("extensions") or []
    for extension in extensions:
        if isinstance(extension, dict) and extension.get("uri") == SKILLS_EXTENSION:
            found = ((extension.get("params") or {}).get("skills") or {}).get(skill)
            return found if isinstance(found, dict) else {}
    return {}


def status_url(card: AgentCard) -> str | None:
    """The operation status URL template of an agent that declares the extension, else None."""
    return _url_param(card, "status_url")


def cancel_url(card: AgentCard) -> str | None:
    """The operation cancel URL template of an agent that declares the extension and can cancel, else
    None (an agent of an earlier version of the extension can only be asked)."""
    return _url_param(card, "cancel_url")


def _url_param(card: AgentCard, name: str) -> str | None:
    for extension in card.capabilities.extensions:
        if extension.uri == OPERATIONS_EXTENSION:
            url = extension.params.fields.get(name)
            if url is not None and url.string_value:
                return url.string_value
    return None


def args_hash(args: Mapping[str, Any]) -> str:
    """The hash that binds an operation id to its exact arguments (canonical JSON, SHA-256)."""
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
