"""The publisher specialist: the integrations end of a run. It publishes through the outbox MCP server,
which makes every effect at most once per operation id and asks policy first: under a score
threshold (``approval_over_score``) a publication needs an approval grant, which the coordinator
gets from policy when the score the run computed for the report is under it, or from a person. The
caller's ``anomaly_score`` is shown to the person, and decides nothing."""

from __future__ import annotations

import re
from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, SkillError, serve_specialist

OUTBOX_SERVER = "mcp-outbox"
OUTBOX_SCOPE = "outbox:write"
_ARTIFACT = re.compile(r"^artifact:sha256:[0-9a-f]{64}$")

PUBLISHED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["status", "name"],
    "properties": {
        "status": {"enum": ["published", "pending_approval"]},
        "name": {"type": "string"},
        "operation_id": {"type": "string"},
        "replayed": {"type": "boolean"},
        "approved_by": {"type": "string"},
        "approval_request": {"type": "object"},
    },
}


def _operation_key(ctx: SkillContext, name: str) -> str:
    """One publication per run and name: the same key before and after an approval (a new step
    call), after a crash and on another replica, so the outbox publishes it once."""
    return f"{ctx.run_id}/publish/{name}" if ctx.run_id else ctx.idempotency_key(f"publish/{name}")


async def publish_report(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Publishes a report artifact under a name, once; over the policy's score threshold it asks first."""
    artifact, name, score = payload.get("report"), payload.get("name"), payload.get("anomaly_score")
    if not isinstance(artifact, str) or not _ARTIFACT.match(artifact):
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.report must be an artifact:sha256:... reference")
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.name must be a name of at most 200 characters")
    if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)):
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.anomaly_score must be a number")
    arguments: dict[str, Any] = {
        "operation_id": _operation_key(ctx, name),
        "artifact": artifact,
        "name": name,
    }
    approval = payload.get("approval")
    if isinstance(approval, dict) and isinstance(approval.get("grant"), str):
        arguments["approval_grant"] = approval["grant"]  # the registry's, for exactly this call
    answer = await ctx.tools.call(
        OUTBOX_SERVER, "publish_artifact", arguments, tenant=ctx.tenant, scopes=[OUTBOX_SCOPE]
    )
    if answer["status"] == "pending_approval":
        why = f"publishing {name!r} needs an approval"
        if score is not None:
            why += f" (the caller states an anomaly score of {float(score):g}; policy goes by the run's own)"
        await ctx.progress(why)
        pending = {"status": "pending_approval", "why": why, "name": name, "anomaly_score": score}
        if isinstance(answer.get("approval_request"), dict):  # what the person approves, exactly
            pending["approval_request"] = answer["approval_request"]
        return pending
    if answer["status"] != "done":
        raise SkillError(
            ErrorCode.TOOL_FAILED, f"the outbox could not publish {name!r}: {answer.get('error')}"
        )
    await ctx.progress(
        f"published {name!r}" + (" (already, by an earlier call)" if answer["replayed"] else "")
    )
    published = {
        "status": "published",
        "name": name,
        "operation_id": answer["operation_id"],
        "replayed": answer["replayed"],
    }
    if answer.get("approved_by"):
        published["approved_by"] = answer["approved_by"]
    return published


SKILLS = [
    Skill(
        "publish-report",
        "Publish a report",
        "Publishes a report artifact under a name, exactly once per run; a report whose anomaly score"
        " (as the run computed it) is over the policy's threshold waits for an approval."
        ' Input: {"report": "artifact:sha256:...", "name": NAME, "anomaly_score": N}.',
        publish_report,
        tags=("publish", "integrations"),
        idempotent=True,  # keyed per run and name at the outbox: a repeat publishes nothing twice
        output_schema=PUBLISHED_SCHEMA,
    ),
]


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(
        settings,
        name="Publisher",
        description="Publishes reports and notifications through the outbox, exactly once, asking first when policy says.",
        version="1.0.0",
        skills=SKILLS,
    )
