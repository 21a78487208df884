# Budgets: the mission budget and convergence limits of a run, fixed when the run starts.
# Input: {tenant}. data.config.budgets.default, overridden per tenant by data.config.budgets.tenants.
#   max_steps       steps a run may complete in one tranche
#   max_operations  operations (delegated calls) a run may send in one tranche
#   max_seconds     wall-clock seconds from the run's creation, per tranche
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
	some key in ["max_steps", "max_operations", "max_seconds", "max_tranches"]
	not limits[key] >= 0
	msg := sprintf("%s must be a number >= 0", [key])
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
}
