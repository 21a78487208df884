package fleet.budgets_test

import data.fleet.budgets

test_default_limits if {
	d := budgets.decision with input as {"tenant": "acme"}
	d.allow
	d.limits.max_steps == data.config.budgets.default.max_steps
	d.convergence.repeat_limit == 3
	d.batch.checkpoint_every == 50
}

test_tenant_override_wins if {
	d := budgets.decision with input as {"tenant": "small"}
		with data.config.budgets.tenants as {"small": {"max_steps": 2}}
	d.limits.max_steps == 2
	d.limits.max_operations == data.config.budgets.default.max_operations
}

test_unknown_action_is_refused if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.budgets.tenants as {"acme": {"on_exhausted": "pray"}}
	not d.allow
}
