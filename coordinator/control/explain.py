"""``EXPLAIN.md``, the first file of a debug bundle: a person reads why a run ended as it did, from
its event log, its operations ledger and the policy in force, without re-running it.

It names the end state and reason, the failed step (its skill, the agent it went to, the agent's
version as registered now, the reroutes), the error code and message, any policy refusal, the last
events before the end, every operation with its outcome, where the model tokens went (by step, and
the share spent repeating calls already made), and what to do next. Everything in it comes
from what is already recorded (the log is redacted when written) and the whole text is redacted
once more, so no secret reaches the bundle through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.record.runs import Run, RunEvent
from fleet.errors import MAX_CAUSE_DEPTH
from fleet.redact import redact
from fleet.vocabulary import EventType

LAST_EVENTS = 12
REFUSAL_CODES = frozenset({"policy_denied", "policy_unavailable", "forbidden", "unauthenticated"})

# What a person can do about each kind of failure; the codes are fleet.errors.ErrorCode values.
NEXT_STEPS: dict[str, str] = {
    "tool_failed": "The tool refused or failed the call: read the message above, fix the step's input "
    "(or the data it reads), then start a new run.",
    "specialist_failed": "The specialist could not do the step: read its error, fix the input or the "
    "specialist, then start a new run.",
    "specialist_unavailable": "No agent offering the skill answered: check `fleet agents list` (status) "
    "and `fleet status`, then start a new run.",
    "specialist_bad_answer": "The agent answered something its card does not allow: check its version "
    "(`fleet agents show AGENT`) and roll back a broken release.",
    "no_specialist_for_skill": "No registered agent offers the skill: check the plan's skill name and "
    "`fleet agents list`.",
    "policy_denied": "Policy refused: see the refusal above and the decision log (`fleet policy log`); "
    "change the bundle (`fleet policy push`) if the refusal is wrong.",
    "forbidden": "Policy or scope refused: see the refusal above and `fleet policy log`.",
    "policy_unavailable": "Policy could not be evaluated (failing closed): check `fleet policy status`.",
    "outcome_unknown": "Nobody could tell whether the effect happened: check the tool, then answer with "
    "`fleet runs resolve RUN OP succeeded|failed|retry`.",
    "needs_human": "An operation waits for a person: `fleet runs resolve RUN OP ...`.",
    "budget_exhausted": "The mission budget was spent: start again with a larger budget, or let a person "
    "decide next time (`fleet runs decide`).",
    "non_converging": "The run repeated itself without progress: change the plan or the skill's "
    "instructions.",
    "approval_rejected": "A person rejected the step: nothing was done; start a new run if that changed.",
    "approval_expired": "Nobody answered in time (an expiry, not a denial): start a new run, or raise "
    "the approval timeout in policy.",
    "canceled": "The run was canceled: start it again if that was a mistake.",
}


@dataclass(frozen=True, slots=True)
class FailedStep:
    """The step a failed run failed on, as its events tell it."""

    step: str
    skill: str
    agent: str
    code: str
    message: str
    reroutes: tuple[str, ...]
    cause: Mapping[str, Any] | None = None  # the error of the layer below, as recorded (an envelope)


def failed_step(events: list[RunEvent]) -> FailedStep | None:
    """The last step that failed (or was blocked), with the agent it went to and its reroutes."""
    agents: dict[str, str] = {}
    reroutes: dict[str, list[str]] = {}
    failed: FailedStep | None = None
    for event in events:
        payload, step = event.payload, str(event.payload.get("step", ""))
        if event.type == EventType.STEP_STARTED and payload.get("agent"):
            agents[step] = str(payload["agent"])
        elif event.type == EventType.STEP_REROUTED:
            agents[step] = str(payload.get("to", ""))
            reroutes.setdefault(step, []).append(
                f"{payload.get('from')} -> {payload.get('to')} ({payload.get('why', '')})"
            )
        elif event.type in (EventType.STEP_FAILED, EventType.STEP_BLOCKED):
            failed = FailedStep(
                step=step,
                skill=str(payload.get("skill", "")),
                agent=str(payload.get("agent") or agents.get(step, "")),
                code=str(payload.get("code", "")),
                message=str(payload.get("message", "")),
                reroutes=tuple(reroutes.get(step, [])),
                cause=payload.get("cause") if isinstance(payload.get("cause"), Mapping) else None,
            )
    return failed


def codes_of(envelope: object) -> list[str]:
    """The codes of an error envelope and of the causes it wraps, outermost first."""
    codes: list[str] = []
    while isinstance(envelope, Mapping) and len(codes) <= MAX_CAUSE_DEPTH:
        codes.append(str(envelope.get("code", "")))
        envelope = envelope.get("cause")
    return codes


def cause_chain(failed: FailedStep) -> list[str]:
    """The step's code, then the codes of the errors it wraps from the layers below (an agent's
    ``tool_failed`` around a tool's ``invalid_request``), without repeats."""
    chain = [failed.code, *codes_of(failed.cause)]
    return list(dict.fromkeys(code for code in chain if code))


def refusals(events: list[RunEvent], operations: list[dict[str, Any]]) -> list[str]:
    """Every refusal by policy or scope the log and the ledger record, one line each."""
    found = []
    for event in events:
        if event.type == EventType.RUN_FAILED:
            continue  # it repeats its step's failure
        payload = event.payload
        message = str(payload.get("message") or "; ".join(payload.get("reasons", [])))
        codes = {
            str(payload.get("code", "")),
            *codes_of(payload.get("cause")),
            *codes_of(payload.get("error")),
        }
        if codes & REFUSAL_CODES or payload.get("outcome") == "forbidden":
            code = next(iter(sorted(codes & REFUSAL_CODES)), "forbidden")
            found.append(f"seq {event.seq} `{event.type}` refused by `{code}`: {message}")
    for op in operations:
        codes = set(codes_of(op.get("error")))
        if codes & REFUSAL_CODES:
            code = sorted(codes & REFUSAL_CODES)[0]
            found.append(
                f"operation `{op['op_id']}` refused by `{code}`: {(op.get('error') or {}).get('message', '')}"
            )
    return found


def _payload_text(event: RunEvent) -> str:
    text = json.dumps(event.payload, separators=(",", ":"), default=str)
    return text if len(text) <= 160 else text[:157] + "..."


def _cell(value: Any) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")


def _header(run: Run, policy_revision: str) -> list[str]:
    reason = f" ({run.reason})" if run.reason else ""
    return [
        f"# Run {run.run_id}: {run.state.value}{reason}",
        "",
        f"- tenant: `{run.tenant}`; owner: `{run.owner}`",
        f"- created {run.created_at.isoformat()}; last change {run.updated_at.isoformat()}",
        f"- policy bundle revision in force at export: `{policy_revision}`",
        "",
    ]


def _what_happened(run: Run, failed: FailedStep | None, agents: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = ["## What happened", ""]
    lines.append(
        f"The run ended `{run.state.value}`" + (f" with reason `{run.reason}`." if run.reason else ".")
    )
    if run.wait:
        lines.append(f"It waits: {json.dumps(run.wait, default=str)}")
    if failed is None:
        lines += ["", "No step failed.", ""]
        return lines
    agent = agents.get(failed.agent, {})
    version = (
        f"version `{agent.get('version')}` as registered now, status `{agent.get('status')}`"
        if agent
        else "not registered now"
    )
    lines += [
        "",
        f"- failed step: `{failed.step}`",
        f"- skill: `{failed.skill}`",
        f"- agent: `{failed.agent or 'none (never sent)'}` ({version})",
        f"- reroutes: {'; '.join(failed.reroutes) if failed.reroutes else 'none'}",
        f"- error code: `{failed.code}`",
        f"- cause, outermost first: {' -> '.join(f'`{c}`' for c in cause_chain(failed))}",
        f"- error message: {failed.message}",
        "",
    ]
    return lines


def _policy(policy_revision: str, refused: list[str]) -> list[str]:
    lines = ["## Policy", "", f"Revision `{policy_revision}`."]
    if not refused:
        return [*lines, "No policy or scope refusal is recorded for this run.", ""]
    return [*lines, "Refusals:", "", *(f"- {line}" for line in refused), ""]


def _last_events(events: list[RunEvent]) -> list[str]:
    lines = [
        f"## The last {min(LAST_EVENTS, len(events))} events",
        "",
        "| seq | time | type | actor | payload |",
    ]
    lines.append("|---|---|---|---|---|")
    for event in events[-LAST_EVENTS:]:
        lines.append(
            f"| {event.seq} | {event.ts.isoformat()} | `{event.type}` | {_cell(event.actor)} | "
            f"{_cell(_payload_text(event))} |"
        )
    return [*lines, "", "Every event is in `events.jsonl`.", ""]


def _operations(operations: list[dict[str, Any]]) -> list[str]:
    lines = ["## Operations", ""]
    if not operations:
        return [*lines, "The run made no operation.", ""]
    lines += [
        "| operation | step | target | status | attempts | error code | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for op in operations:
        error = op.get("error") or {}
        lines.append(
            f"| `{op['op_id']}` | {_cell(op['step_id'])} | {_cell(op['target'])} | {op['status']} | "
            f"{op['attempts']} | {_cell(error.get('code', ''))} | {_cell(error.get('message', ''))} |"
        )
    return [*lines, "", "The full ledger is in `operations.jsonl`.", ""]


def _number(value: Any) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0
    )


def _tokens(operations: list[dict[str, Any]]) -> list[str]:
    """Where the run's model tokens went, as its agents reported them: by step, and the share spent
    on turns that only repeated calls already made (the calls named)."""
    used = [
        op
        for op in operations
        if isinstance(op.get("usage"), dict) and _number(op["usage"].get("llm_tokens"))
    ]
    if not used:
        return []
    total = sum(_number(op["usage"]["llm_tokens"]) for op in used)
    lines = [
        "## Tokens",
        "",
        "| step | agent | tokens in | tokens out | completions | cost (agent's) | loop stopped |",
        "|---|---|---|---|---|---|---|",
    ]
    repeats: dict[str, float] = {}
    on_repeats = 0.0
    for op in sorted(used, key=lambda o: -_number(o["usage"]["llm_tokens"])):
        usage = op["usage"]
        stopped = usage.get("stopped") or ""
        if stopped and usage.get("summarized"):
            stopped += " (summarized)"
        lines.append(
            f"| {_cell(op['step_id'])} | {_cell(op['target'])} | {int(_number(usage.get('tokens_in')))} |"
            f" {int(_number(usage.get('tokens_out')))} | {int(_number(usage.get('llm_calls')))} |"
            f" ${_number(usage.get('cost_usd')):.4f} | {_cell(stopped)} |"
        )
        said = usage.get("repeats")
        said = said if isinstance(said, dict) else {}
        on_repeats += _number(said.get("tokens"))
        calls = said.get("calls")
        for name, times in (calls if isinstance(calls, dict) else {}).items():
            repeats[str(name)] = repeats.get(str(name), 0.0) + _number(times)
    lines += ["", f"{int(total)} tokens in all."]
    if on_repeats:
        share = round(100 * min(on_repeats, total) / total)
        named = ", ".join(
            f"`{name}` x{int(n)}" for name, n in sorted(repeats.items(), key=lambda kv: -kv[1])[:5]
        )
        lines.append(
            f"{share}% of the tokens ({int(on_repeats)} of {int(total)}) went to repeating"
            f" {len(repeats)} call(s) already made: {named}."
        )
    return [*lines, ""]


def _next(run: Run, failed: FailedStep | None) -> list[str]:
    # The innermost code with advice: a tool's refusal says more than the agent's failure around it.
    codes = [*(cause_chain(failed) if failed is not None else []), run.reason or ""]
    known = [NEXT_STEPS[code] for code in reversed(codes[:-1]) if code in NEXT_STEPS]
    if run.state.value == "completed":
        advice = "Nothing: the run completed."
    else:
        advice = (known or [NEXT_STEPS.get(codes[-1], "Read the last events above.")])[0]
    return ["## What to do next", "", advice, ""]


def explain(
    run: Run,
    events: list[RunEvent],
    operations: list[dict[str, Any]],
    policy_revision: str,
    agents: Mapping[str, Mapping[str, Any]],
) -> str:
    """The text of ``EXPLAIN.md`` for ``run`` (``agents``: the registry's records now, by id)."""
    failed = failed_step(events)
    lines = [
        *_header(run, policy_revision),
        *_what_happened(run, failed, agents),
        *_policy(policy_revision, refusals(events, operations)),
        *_last_events(events),
        *_operations(operations),
        *_tokens(operations),
        *_next(run, failed),
    ]
    text, _ = redact("\n".join(lines))
    return str(text)
