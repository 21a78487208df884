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

test_the_loop_of_a_task_is_the_default_then_the_agents_then_the_tenants if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.loop.agents as {"researcher": {"max_turns": 80, "on_stuck": "stop"}}
		with data.config.loop.tenants as {"acme": {"max_turns": 10}}
	d.allow
	d.loop.default.max_turns == 10
	d.loop.default.on_stuck == data.config.loop.default.on_stuck
	d.loop.agents.researcher.max_turns == 10 # the tenant's word wins
	d.loop.agents.researcher.on_stuck == "stop"
	d.loop.agents.researcher.repeat_limit == data.config.loop.default.repeat_limit
}

test_another_tenant_keeps_the_agents_own_loop if {
	d := budgets.decision with input as {"tenant": "globex"}
		with data.config.loop.agents as {"researcher": {"max_turns": 80}}
		with data.config.loop.tenants as {"acme": {"max_turns": 10}}
	d.loop.agents.researcher.max_turns == 80
	d.loop.default.max_turns == data.config.loop.default.max_turns
}

test_an_unknown_loop_action_or_a_zero_cap_is_refused_with_where_it_is if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.loop.agents as {"researcher": {"on_spent": "ask forever", "repeat_limit": 0}}
	not d.allow
	"loop agents.researcher: on_spent must be one of {\"ask\", \"stop\", \"summarize\"}" in d.reasons
	"loop agents.researcher: repeat_limit must be a number >= 1" in d.reasons
}

test_a_stuck_loop_may_go_to_the_reviewer_and_a_spent_one_may_not if {
	ok := budgets.decision with input as {"tenant": "acme"}
		with data.config.loop.tenants as {"acme": {"on_stuck": "review", "max_reviews": 1}}
	ok.allow
	ok.loop.default.on_stuck == "review"
	ok.loop.default.max_reviews == 1
	refused := budgets.decision with input as {"tenant": "acme"}
		with data.config.loop.tenants as {"acme": {"on_spent": "review", "max_reviews": -1}}
	not refused.allow
	"loop default: on_spent must be one of {\"ask\", \"stop\", \"summarize\"}" in refused.reasons
	"loop default: max_reviews must be a number >= 0" in refused.reasons
}

test_a_negative_price_is_refused if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.models.prices as {"m": {"input_per_mtok": -1, "output_per_mtok": 1}}
	not d.allow
}

test_the_runs_token_and_money_budget_are_limits_of_a_tranche if {
	d := budgets.decision with input as {"tenant": "acme"}
		with data.config.budgets.tenants as {"acme": {"max_llm_tokens": 1000, "max_cost_usd": 0.5}}
	d.allow
	d.limits.max_llm_tokens == 1000
	d.limits.max_cost_usd == 0.5
}
