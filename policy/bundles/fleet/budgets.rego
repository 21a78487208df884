# Budgets: the mission budget and convergence limits of a run, fixed when the run starts.
# Input: {tenant}. data.config.budgets.default, overridden per tenant by data.config.budgets.tenants.
#   max_steps       steps a run may complete in one tranche
#   max_operations  operations (delegated calls) a run may send in one tranche
#   max_seconds     wall-clock seconds from the run's creation, per tranche
#   on_exhausted    "summarize" (close with the best result so far) or "tranche" (grant another
#                   tranche, at most max_tranches times, then summarize)
# data.config.batch: call_size (items per call of a batch step) and checkpoint_every (items between
# checkpoints of its progress); a plan's step may set its own.
# data.config.convergence: repeat_limit (the same call this many times is not converging) and
# max_calls_per_turn (more calls than this in one fan-out is not converging).
package fleet.budgets

tenant_limits := object.get(data.config.budgets.tenants, input.tenant, {})

limits := object.union(data.config.budgets.default, tenant_limits)

valid_actions := {"summarize", "tranche"}

deny contains msg if {
	not limits.on_exhausted in valid_actions
	msg := sprintf("on_exhausted must be one of %v", [valid_actions])
}

deny contains msg if {
	some key in ["max_steps", "max_operations", "max_seconds", "max_tranches"]
	not limits[key] >= 0
	msg := sprintf("%s must be a number >= 0", [key])
}

decision := {
	"allow": count(deny) == 0,
	"reasons": sort(deny),
	"limits": limits,
	"convergence": data.config.convergence,
	"batch": data.config.batch,
}
