"""The case desk specialist: acts on findings. Its skills have effects outside the fleet, so they show
the two kinds of effect a platform has to handle:

- ``open-review-cases`` opens one case per flagged record through a tool that takes an idempotency
  key. Running it twice under one operation opens nothing twice, so it is declared ``idempotent``.
- ``post-note`` posts a note through a tool with no key and no status query. If the call times out the
  outcome is unknown, and the skill says so instead of guessing.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import OutcomeUnknown, Skill, SkillContext, SkillError, serve_specialist

CASES_SERVER = "mcp-cases"
CASES_SCOPE = "cases:write"
MAX_CASES = 500


class CaseDeskSettings(ServiceSettings):
    note_timeout_s: float = Field(default=10.0, description="how long a post-note tool call may take")


def _string(payload: dict[str, Any], key: str, default: str | None = None) -> str:
    value = payload.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise SkillError(ErrorCode.INVALID_REQUEST, f"input needs a non-empty string {key!r}")
    return value


async def open_review_cases(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    records = payload.get("records")
    if not isinstance(records, list) or len(records) > MAX_CASES:
        raise SkillError(ErrorCode.INVALID_REQUEST, f"input needs a list 'records' of at most {MAX_CASES}")
    label = _string(payload, "label", "label")
    reason = _string(payload, "reason", "flagged for review")
    subjects = []
    for record in records:
        subject = record.get(label) if isinstance(record, dict) else None
        if not isinstance(subject, str) or not subject:
            raise SkillError(ErrorCode.INVALID_REQUEST, f"every record needs a string {label!r}")
        subjects.append(subject)
    if len(set(subjects)) != len(subjects):
        raise SkillError(ErrorCode.INVALID_REQUEST, f"two records have the same {label!r}")
    if not subjects:
        return {"cases": []}
    opened = await ctx.tools.call(
        CASES_SERVER,
        "open_cases",
        {
            "cases": [
                {"subject": s, "reason": reason, "idempotency_key": ctx.idempotency_key(s)} for s in subjects
            ]
        },
        tenant=ctx.tenant,
        scopes=[CASES_SCOPE],
    )
    cases = [
        {"subject": c["subject"], "case_id": c["case_id"], "created": c["created"]} for c in opened["cases"]
    ]
    await ctx.progress(f"{len(cases)} cases open")
    return {"cases": cases}


async def issue_refund(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Refund through the cases server. A refund that policy says needs approval comes back
    ``pending_approval`` (nothing done, with the call to approve), and the coordinator pauses the run
    until a person answers; the approved call carries the registry's approval grant for exactly that
    call, which the tool checks, uses up and records with the refund."""
    subject = _string(payload, "subject")
    amount = payload.get("amount_cents")
    if isinstance(amount, float) and amount.is_integer():  # JSON numbers arrive as floats over A2A
        amount = int(amount)
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise SkillError(ErrorCode.INVALID_REQUEST, "input needs a positive integer 'amount_cents'")
    given = payload.get("approval")
    approval: dict[str, Any] = given if isinstance(given, dict) else {}
    # The approved call is keyed by the operation that first asked, so that it is the very call
    # the approval grant was given for (same arguments, same hash).
    asked = approval.get("op_id")
    key = (
        f"{asked}/refund:{subject}"
        if isinstance(asked, str) and asked
        else ctx.idempotency_key(f"refund:{subject}")
    )
    arguments: dict[str, Any] = {"subject": subject, "amount_cents": amount, "idempotency_key": key}
    if isinstance(approval.get("grant"), str):
        arguments["approval_grant"] = approval["grant"]
    refunded = await ctx.tools.call(
        CASES_SERVER, "issue_refund", arguments, tenant=ctx.tenant, scopes=[CASES_SCOPE]
    )
    if refunded["status"] == "pending_approval":
        pending = {
            "status": "pending_approval",
            "why": refunded["why"],
            "subject": subject,
            "amount_cents": amount,
        }
        if isinstance(refunded.get("approval_request"), dict):  # what the person approves, exactly
            pending["approval_request"] = refunded["approval_request"]
        return pending
    await ctx.progress(f"refunded {subject}")
    done = {
        "status": "refunded",
        "refund_id": refunded["refund_id"],
        "subject": subject,
        "amount_cents": amount,
    }
    if refunded.get("approved_by"):
        done["approved_by"] = refunded["approved_by"]
    return done


def post_note_skill(timeout_s: float) -> Skill:
    async def post_note(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
        arguments = {"channel": _string(payload, "channel"), "body": _string(payload, "text")}
        try:
            posted = await ctx.tools.call(
                CASES_SERVER,
                "post_note",
                arguments,
                tenant=ctx.tenant,
                scopes=[CASES_SCOPE],
                timeout_s=timeout_s,
            )
        except TimeoutError as exc:
            raise OutcomeUnknown(
                f"post_note did not answer within {timeout_s:g} s; the note may or may not have been posted"
            ) from exc
        return {"note_id": posted["note_id"]}

    return Skill(
        "post-note",
        "Post a note",
        'Posts a note to a channel. Input: {"channel": NAME, "text": TEXT}.',
        post_note,
        tags=("notify",),
    )


def skills(settings: CaseDeskSettings) -> list[Skill]:
    return [
        Skill(
            "open-review-cases",
            "Open review cases",
            'Opens one review case per record. Input: {"records": [...], "label": FIELD, "reason": TEXT}.',
            open_review_cases,
            tags=("cases",),
            idempotent=True,
        ),
        post_note_skill(settings.note_timeout_s),
        Skill(
            "issue-refund",
            "Issue a refund",
            'Refunds an amount once. Input: {"subject": NAME, "amount_cents": N}. Amounts over the '
            "policy's threshold pause the run for an approval.",
            issue_refund,
            tags=("refunds",),
            idempotent=True,
        ),
    ]


async def main(settings: ServiceSettings) -> None:
    desk = CaseDeskSettings.from_env(settings.service_id)
    await serve_specialist(
        desk,
        name="Case desk",
        description="Opens review cases and posts notes for findings of other agents.",
        version="0.1.0",
        skills=skills(desk),
    )
