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

test_a_tenant_overrides_one_nested_setting_and_keeps_the_rest if {
	d := budgets.decision with input as {"tenant": "slow"}
		with data.config.budgets.tenants as {"slow": {"activity": {"quiet_after_s": 600}, "on_exhausted": "ask"}}
	d.allow
	d.limits.activity.quiet_after_s == 600
	d.limits.activity.on_stuck == data.config.budgets.default.activity.on_stuck
	d.limits.ask.timeout_s == data.config.budgets.default.ask.timeout_s
}

test_an_unknown_expiry_action_is_refused if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.budgets.tenants as {"acme": {"ask": {"on_expired": "approve"}}}
	not d.allow
}

test_a_quiet_period_of_zero_is_refused if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.budgets.tenants as {"acme": {"activity": {"quiet_after_s": 0}}}
	not d.allow
}
