# Budgets: the mission budget and convergence limits of a run, fixed when the run starts.
# Input: {tenant}. data.config.budgets.default, overridden per tenant by data.config.budgets.tenants.
#   max_steps       steps a run may complete in one tranche
#   max_operations  operations (delegated calls) a run may send in one tranche
#   max_seconds     wall-clock seconds from the run's creation, per tranche
#   max_llm_tokens  LLM tokens the run's delegated tasks may spend in one tranche (each task reserves
#                   its own cap before it is sent, so a fan-out never passes it)
#   max_cost_usd    what those tokens may cost in one tranche, priced by data.config.models
#   on_exhausted    "summarize" (close with the best result so far), "tranche" (grant another
#                   tranche, at most max_tranches times, then do what after_tranches says:
#                   "summarize" or "ask"), or "ask" (a person decides: another tranche, or close)
#   ask             a person's decision: timeout_s (the wait's deadline), warn_before_s (a warning
#                   event this long before it), on_expired ("expire": the run ends approval_expired;
#                   "summarize": it closes with the best result so far)
#   activity        the activity lease of a delegated call: quiet_after_s (no event from the agent
#                   for this long wakes the supervisor), max_renewals (times the agent may say it is
#                   still running before on_stuck), on_stuck ("escalate": record it and keep waiting;
#                   "ask": a person decides)
# data.config.batch: call_size (items per call of a batch step) and checkpoint_every (items between
# checkpoints of its progress); a plan's step may set its own.
# data.config.convergence: repeat_limit (the same call this many times is not converging) and
# max_calls_per_turn (more calls than this in one fan-out is not converging).
# data.config.loop: the agent loop of each delegated task (a skill a specialist runs with a model),
# default, then per agent (agents.<agent id>), then per tenant (tenants.<tenant>, which wins):
#   max_turns, max_tool_calls, max_tool_calls_per_turn, repeat_limit (the same tool call this many
#   times), output_repeat_limit (the same text from the model this many times), max_llm_tokens and
#   max_cost_usd (per task; also what a task reserves from the run's budget)
#   on_stuck        what a loop that is not converging does: "stop" (the step fails non_converging),
#                   "summarize" (one last turn without tools answers from what it has) or "ask" (a
#                   person decides at the step's gate: continue, summarize or stop) or "review"
#                   (the reviewer, specialists/review.py, decides: continue, stop, or a person)
#   max_reviews     the reviewer's verdicts a task may have; past them a person decides
#   on_spent        stop, summarize or ask, for a loop that spent its turns, tool calls, tokens or money
#   rate_limit_retries, rate_limit_max_wait_s: how often and how long a model answering 429 is
#                   waited out before the task stops llm_rate_limited (retryable)
# data.config.models: prices (per model: input_per_mtok and output_per_mtok, US dollars per million
# tokens) and default_price (a model not listed; null: it costs nothing known).
package fleet.budgets

tenant_limits := object.get(data.config.budgets.tenants, input.tenant, {})

limits := object.union(data.config.budgets.default, tenant_limits)

valid_actions := {"summarize", "tranche", "ask"}

deny contains msg if {
	not limits.on_exhausted in valid_actions
	msg := sprintf("on_exhausted must be one of %v", [valid_actions])
}

deny contains msg if {
	not limits.after_tranches in {"summarize", "ask"}
	msg := "after_tranches must be summarize or ask"
}

deny contains msg if {
	not limits.ask.on_expired in {"expire", "summarize"}
	msg := "ask.on_expired must be expire or summarize"
}

deny contains msg if {
	not limits.activity.on_stuck in {"escalate", "ask"}
	msg := "activity.on_stuck must be escalate or ask"
}

deny contains msg if {
	some key in ["max_steps", "max_operations", "max_seconds", "max_tranches", "max_llm_tokens", "max_cost_usd"]
	not limits[key] >= 0
	msg := sprintf("%s must be a number >= 0", [key])
}

loop_config := object.get(data.config, "loop", {"default": {}})

loop_tenant := object.get(object.get(loop_config, "tenants", {}), input.tenant, {})

loop_default := object.union(loop_config.default, loop_tenant)

loop_agents := {agent: object.union(object.union(loop_config.default, own), loop_tenant) |
	some agent, own in object.get(loop_config, "agents", {})
}

loop_actions := {"stop", "summarize", "ask"}

# A stuck loop may also go to the reviewer (a spent budget is not a thing to review).
stuck_actions := loop_actions | {"review"}

loop_sets contains ["default", loop_default]

loop_sets contains [sprintf("agents.%s", [agent]), set] if some agent, set in loop_agents

deny contains msg if {
	some [name, set] in loop_sets
	not set.on_stuck in stuck_actions
	msg := sprintf("loop %s: on_stuck must be one of %v", [name, stuck_actions])
}

deny contains msg if {
	some [name, set] in loop_sets
	not set.on_spent in loop_actions
	msg := sprintf("loop %s: on_spent must be one of %v", [name, loop_actions])
}

deny contains msg if {
	some [name, set] in loop_sets
	some key in ["max_turns", "max_tool_calls", "max_tool_calls_per_turn", "repeat_limit", "output_repeat_limit", "max_llm_tokens"]
	not set[key] >= 1
	msg := sprintf("loop %s: %s must be a number >= 1", [name, key])
}

deny contains msg if {
	some [name, set] in loop_sets
	some key in ["max_cost_usd", "rate_limit_retries", "rate_limit_max_wait_s", "max_reviews"]
	not set[key] >= 0
	msg := sprintf("loop %s: %s must be a number >= 0", [name, key])
}

models := object.get(data.config, "models", {"prices": {}, "default_price": null})

deny contains msg if {
	some model, price in models.prices
	some key in ["input_per_mtok", "output_per_mtok"]
	not price[key] >= 0
	msg := sprintf("models.prices.%s: %s must be a number >= 0", [model, key])
}

deny contains msg if {
	some key in ["timeout_s", "warn_before_s"]
	not limits.ask[key] >= 0
	msg := sprintf("ask.%s must be a number >= 0", [key])
}

deny contains msg if {
	not limits.activity.quiet_after_s > 0
	msg := "activity.quiet_after_s must be a number > 0"
}

deny contains msg if {
	not limits.activity.max_renewals >= 1
	msg := "activity.max_renewals must be a number >= 1"
}

decision := {
	"allow": count(deny) == 0,
	"reasons": sort(deny),
	"limits": limits,
	"convergence": data.config.convergence,
	"batch": data.config.batch,
	"loop": {"default": loop_default, "agents": loop_agents},
	"models": models,
}
