"""A run's spending on models: what each delegated task said it spent, priced by the run's policy;
the sums a tranche's budget is held to; what a fan-out reserves before it is sent; and the limits
each task is sent with.

The budget policy (``fleet.budgets``, fixed when the run starts) gives the run ``max_llm_tokens`` and
``max_cost_usd`` per tranche, the agent loop of each task (``loop``: a default and one per agent, the
tenant's word over both) and the models' prices (``models``). Before a fan-out, each task to send
reserves its loop's caps (tokens and money) from what the tranche has left; the tasks that do not
fit wait for the next turn, and a task alone is sent with what is left. Each task is sent its
reservation as its own cap (``fleet.budget``), so the tasks of one fan-out cannot spend more than
the tranche had between them: a task stops at its cap, passing it by no more than the completion
that crossed it. When the tasks end, what they said they spent is counted instead of what they
reserved.

What a task spent is its agent's word (``fleet.usage``): the tokens its model reported, priced here
with the policy's table (the agent's own price is not taken). A hostile agent can understate it; a
model gateway the fleet runs would be where to count it, and is not part of this release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.engine.delegation import TaskLimits
from fleet.telemetry import REVIEW_VERDICTS

# The numeric limits of an agent loop (TaskBudget's keys), and what it does at one (LoopPolicy's).
LOOP_CAPS = (
    "max_turns",
    "max_tool_calls",
    "max_tool_calls_per_turn",
    "repeat_limit",
    "output_repeat_limit",
    "max_llm_tokens",
    "max_cost_usd",
)
LOOP_POLICY = ("on_stuck", "on_spent", "rate_limit_retries", "rate_limit_max_wait_s", "max_reviews")
COUNTED = ("llm_calls", "rate_limited", "llm_retries", "tool_calls", "slow_tool_calls")
MAX_TIMED = 200  # completion latencies one task may report


def _number(value: Any) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0
    )


def price_of(models: Mapping[str, Any], model: str) -> tuple[float, float] | None:
    """Dollars per million tokens in and out for ``model`` by the policy's table, if it says."""
    prices = models.get("prices") or {}
    found = prices.get(model) if isinstance(prices, Mapping) else None
    found = found if isinstance(found, Mapping) else models.get("default_price")
    if not isinstance(found, Mapping):
        return None
    return _number(found.get("input_per_mtok")), _number(found.get("output_per_mtok"))


def priced(said: Mapping[str, Any], models: Mapping[str, Any]) -> dict[str, Any]:
    """What a task spent, from its agent's word (``said``: tokens in and out, the models, counts),
    priced with the policy's table (``models``). A task that used more than one model is priced at
    the dearest of them."""
    tokens_in, tokens_out = int(_number(said.get("tokens_in"))), int(_number(said.get("tokens_out")))
    names = [m for m in said.get("models") or [] if isinstance(m, str)][:8]
    prices = [p for p in (price_of(models, m) for m in names) if p is not None]
    cost = max((tokens_in * i + tokens_out * o) / 1e6 for i, o in prices) if prices else 0.0
    spent: dict[str, Any] = {
        "llm_tokens": max(int(_number(said.get("llm_tokens"))), tokens_in + tokens_out),
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "cost_usd": round(cost, 6),
        "models": names,
    }
    for key in COUNTED:
        spent[key] = int(_number(said.get(key)))
    timed = said.get("llm_seconds")
    if isinstance(timed, list):
        spent["llm_seconds"] = [_number(t) for t in timed[:MAX_TIMED]]
    if isinstance(said.get("resumed"), bool):
        spent["resumed"] = said["resumed"]
        spent["compactions"] = int(_number(said.get("compactions")))
    reviews = said.get("reviews")
    if isinstance(reviews, Mapping):
        spent["reviews"] = {
            v: int(_number(reviews.get(v))) for v in REVIEW_VERDICTS if _number(reviews.get(v))
        }
    if isinstance(said.get("stopped"), str):
        spent["stopped"] = said["stopped"][:40]
        spent["summarized"] = said.get("summarized") is True
    return spent


def of_calls(said: Sequence[Mapping[str, Any] | None], models: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a step spent over its calls (one per gate it passed), priced; None if no call said."""
    each = [priced(one, models) for one in said if one]
    if not each:
        return None
    spent: dict[str, Any] = {
        key: sum(p[key] for p in each) for key in ("llm_tokens", "tokens_in", "tokens_out", *COUNTED)
    }
    spent["cost_usd"] = round(sum(p["cost_usd"] for p in each), 6)
    spent["models"] = sorted({m for p in each for m in p["models"]})
    stopped = [p for p in each if "stopped" in p]
    if stopped:
        spent["stopped"], spent["summarized"] = stopped[-1]["stopped"], stopped[-1]["summarized"]
    return spent


def totals(outcomes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The tokens and dollars the run's settled tasks spent (``usage`` of each outcome)."""
    tokens = sum(int(_number((o.get("usage") or {}).get("llm_tokens"))) for o in outcomes)
    cost = sum(_number((o.get("usage") or {}).get("cost_usd")) for o in outcomes)
    return {"llm_tokens": tokens, "cost_usd": round(cost, 6)}


def loop_of(limits: Mapping[str, Any], agent: str | None) -> dict[str, Any]:
    """The loop policy of a task sent to ``agent`` (its own if the policy has one, else the
    default)."""
    loop = limits.get("loop") or {}
    own = (loop.get("agents") or {}).get(agent) if agent else None
    return dict(own if isinstance(own, Mapping) else loop.get("default") or {})


def _reservation(limits: Mapping[str, Any], agent: str | None) -> tuple[float, float]:
    """What a task reserves (tokens, dollars): its agent's caps if the plan names it, else the
    largest any agent's loop may have (the agent is chosen when it is sent)."""
    loop = limits.get("loop") or {}
    sets = (
        [loop_of(limits, agent)]
        if agent
        else [loop.get("default") or {}, *(loop.get("agents") or {}).values()]
    )
    return (
        max(_number(s.get("max_llm_tokens")) for s in sets),
        max(_number(s.get("max_cost_usd")) for s in sets),
    )


def admit(
    steps: Sequence[Mapping[str, Any]], limits: Mapping[str, Any], left: Mapping[str, float | None]
) -> dict[str, dict[str, float]]:
    """The steps of a fan-out that may be sent now, each with what each of its calls reserves
    (``max_llm_tokens``, ``max_cost_usd``; 0: no cap) and how many calls it may make (``calls``: a
    batch step's round makes ``calls`` of its own, ``_calls`` on the step; any other, one; a
    workflow's calls, ``_whole`` on the step, share one reservation of all that is left), in plan
    order, while the tranche's ``left`` (``operations``, ``llm_tokens``, ``cost_usd``; None: no
    budget) covers them. A task whose loop has no cap of its own reserves all that is left. A batch
    round is cut to the calls that fit. The first step is always sent, one call at least, with at
    most what is left (the caller has checked that something is); the rest wait for the next turn."""
    admitted: dict[str, dict[str, float]] = {}
    room = dict(left)
    for step in steps:
        # A workflow (``_whole``) is a run within the run: its calls share all that is left.
        tokens, cost = (0.0, 0.0) if step.get("_whole") else _reservation(limits, step.get("agent"))
        need = {"operations": 1.0, "llm_tokens": tokens, "cost_usd": cost}
        wanted = max(1, int(step.get("_calls", 1)))
        for key in ("llm_tokens", "cost_usd"):
            have = room[key]
            if have is not None and need[key] <= 0:
                need[key] = max(have, 0.0) / wanted  # no cap of its own: an even share of what is left
        fits = [
            0 if have <= 0 else int(have // need[key]) if need[key] > 0 else wanted
            for key, have in room.items()
            if have is not None
        ]
        calls = min([wanted, *fits])
        if calls < 1:
            if admitted:
                break
            calls = 1  # the first step goes, held to what is left
            for key in ("llm_tokens", "cost_usd"):
                if room[key] is not None:
                    need[key] = min(need[key], max(room[key] or 0.0, 0.0))
        admitted[step["id"]] = {
            "max_llm_tokens": need["llm_tokens"],
            "max_cost_usd": need["cost_usd"],
            "calls": float(calls),
        }
        for key, have in room.items():
            if have is not None:
                room[key] = have - need[key] * calls
    return admitted


def task_limits(limits: Mapping[str, Any], agent: str, reserved: Mapping[str, float] | None) -> TaskLimits:
    """The limits a task sent to ``agent`` carries: its loop's caps, lowered to what it reserved,
    what its loop does at a limit, and the models' prices."""
    loop = loop_of(limits, agent)
    budget = {key: loop[key] for key in LOOP_CAPS if _number(loop.get(key))}
    for key, value in (reserved or {}).items():
        if key in LOOP_CAPS and value > 0:
            budget[key] = min(budget.get(key, value), value)
    if "max_llm_tokens" in budget:
        budget["max_llm_tokens"] = int(budget["max_llm_tokens"])
    models = limits.get("models") or {}
    policy: dict[str, Any] = {key: loop[key] for key in LOOP_POLICY if key in loop}
    policy["prices"] = dict(models.get("prices") or {})
    if isinstance(models.get("default_price"), Mapping):
        policy["default_price"] = dict(models["default_price"])
    return TaskLimits(budget=budget, loop=policy)
