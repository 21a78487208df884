package fleet.tools_test

import data.fleet.tools

good := {
	"server": "mcp-sql",
	"tool": "query",
	"tenant": "acme",
	"subject": "sql-analyst",
	"scopes": ["sql:query"],
	"arguments": {"sql_length": 40},
}

test_query_with_scope_is_allowed if {
	tools.decision.allow with input as good
}

test_query_without_scope_is_denied if {
	d := tools.decision with input as object.union(good, {"scopes": []})
	not d.allow
	d.reasons == ["the token lacks scope sql:query"]
}

test_unknown_tool_is_denied if {
	d := tools.decision with input as object.union(good, {"tool": "drop_everything"})
	not d.allow
}

test_missing_tenant_is_denied if {
	d := tools.decision with input as object.remove(good, ["tenant"])
	not d.allow
}

test_overlong_sql_is_denied if {
	d := tools.decision with input as object.union(good, {"arguments": {"sql_length": 5000}})
	not d.allow
}

test_an_amount_over_the_threshold_needs_approval if {
	call := {"server": "mcp-cases", "tool": "issue_refund", "tenant": "acme", "subject": "case-desk", "scopes": ["cases:write"]}
	rules := {"mcp-cases": {"issue_refund": {"scopes": ["cases:write"], "approval_over_cents": 10000}}}
	small := tools.decision with input as object.union(call, {"arguments": {"amount_cents": 10000}}) with data.config.tools as rules
	small.allow
	not small.approval_required
	large := tools.decision with input as object.union(call, {"arguments": {"amount_cents": 10001}}) with data.config.tools as rules
	large.allow
	large.approval_required
}

test_a_server_data_does_not_name_is_governed_by_the_scopes_it_declares if {
	dynamic := object.union(good, {"server": "mcp-warehouse", "tool": "table_stats", "declared_scopes": ["sql:query"]})
	tools.decision.allow with input as dynamic
	d := tools.decision with input as object.union(dynamic, {"scopes": ["cases:write"]})
	d.reasons == ["the token lacks scope sql:query"]
	not tools.decision.allow with input as object.union(dynamic, {"declared_scopes": []})
}

test_a_server_named_in_data_gets_no_tool_by_declaring_it if {
	d := tools.decision with input as object.union(good, {"tool": "drop_everything", "declared_scopes": ["sql:query"]})
	d.reasons == ["tool mcp-sql/drop_everything is not allowed by policy"]
}

test_an_outbox_destination_listed_for_approval_needs_one if {
	rules := {"mcp-outbox": {"post_webhook": {"scopes": ["outbox:write"], "approval_destinations": ["customers"]}}}
	call := {"server": "mcp-outbox", "tool": "post_webhook", "tenant": "acme", "scopes": ["outbox:write"]}
	customers := tools.decision with input as object.union(call, {"arguments": {"destination": "customers"}})
		with data.config.tools as rules
	ops := tools.decision with input as object.union(call, {"arguments": {"destination": "ops"}})
		with data.config.tools as rules
	customers.allow
	customers.approval_required
	ops.allow
	not ops.approval_required
}

test_a_tool_that_always_needs_approval_says_so if {
	rules := {"mcp-outbox": {"publish_artifact": {"scopes": ["outbox:write"], "approval_always": true}}}
	call := {"server": "mcp-outbox", "tool": "publish_artifact", "tenant": "acme", "scopes": ["outbox:write"], "arguments": {}}
	result := tools.decision with input as call with data.config.tools as rules
	result.allow
	result.approval_required
}

test_a_publication_under_a_score_threshold_needs_a_grant_whatever_score_the_caller_states if {
	call := {"server": "mcp-outbox", "tool": "publish_artifact", "tenant": "acme", "scopes": ["outbox:write"]}
	claimed_zero := tools.decision with input as object.union(call, {"arguments": {"anomaly_score": 0}})
	claimed_zero.allow
	claimed_zero.approval_required
	unsaid := tools.decision with input as object.union(call, {"arguments": {}})
	unsaid.approval_required
}

refund_call(arguments) := {
	"server": "mcp-cases", "tool": "issue_refund", "tenant": "acme", "scopes": ["cases:write"],
	"arguments": arguments,
}

refund_totals := {
	"run_unattended_cents": 0, "run_unattended_refunds": 0,
	"tenant_unattended_cents_24h": 0, "tenant_unattended_refunds_24h": 0,
}

test_a_refund_under_every_limit_needs_no_person if {
	result := tools.decision with input as refund_call(object.union(refund_totals, {"amount_cents": 10000}))
	result.allow
	not result.approval_required
}

test_a_refund_that_takes_the_run_over_its_cumulative_limit_needs_a_person if {
	totals := object.union(refund_totals, {"run_unattended_cents": 20000, "run_unattended_refunds": 2})
	result := tools.decision with input as refund_call(object.union(totals, {"amount_cents": 10000}))
	result.approval_required
}

test_a_refund_that_takes_the_tenant_over_its_24h_limit_needs_a_person if {
	totals := object.union(refund_totals, {"tenant_unattended_cents_24h": 95000, "tenant_unattended_refunds_24h": 12})
	result := tools.decision with input as refund_call(object.union(totals, {"amount_cents": 6000}))
	result.approval_required
}

test_a_count_limit_counts_refunds if {
	rules := {"mcp-cases": {"issue_refund": {"scopes": ["cases:write"], "approval_over_run_count": 3}}}
	third := object.union(refund_totals, {"run_unattended_refunds": 2, "amount_cents": 1})
	not tools.approval_required with input as refund_call(third) with data.config.tools as rules
	fourth := object.union(refund_totals, {"run_unattended_refunds": 3, "amount_cents": 1})
	tools.approval_required with input as refund_call(fourth) with data.config.tools as rules
}

test_a_refund_whose_running_totals_are_unknown_needs_a_person if {
	result := tools.decision with input as refund_call({"amount_cents": 100})
	result.approval_required
}

test_an_agents_own_rate_wins_over_the_tools_which_wins_over_the_default if {
	rates := {"default": {"per_minute": 600, "burst": 60}, "agents": {"sql-analyst": {"per_minute": 30, "burst": 5}}}
	rules := {"mcp-sql": {"query": {"scopes": ["sql:query"], "rate": {"per_minute": 120, "burst": 10}}}}
	own := tools.decision with input as good with data.config.tool_rates as rates with data.config.tools as rules
	own.rate_limit == {"per_minute": 30, "burst": 5}
	other := object.union(good, {"subject": "reporter"})
	tool := tools.decision with input as other with data.config.tool_rates as rates with data.config.tools as rules
	tool.rate_limit == {"per_minute": 120, "burst": 10}
	fleet := tools.decision with input as other with data.config.tool_rates as rates
	fleet.rate_limit == {"per_minute": 600, "burst": 60}
	for_someone := object.union(good, {"subject": "operator", "agent": "sql-analyst"})
	acting := tools.decision with input as for_someone with data.config.tool_rates as rates
	acting.rate_limit == {"per_minute": 30, "burst": 5} # the agent's limit, whoever it acts for
}

test_a_tool_policy_does_not_allow_has_no_rate if {
	d := tools.decision with input as object.union(good, {"tool": "drop_everything"})
	d.rate_limit == null
}

test_a_run_call_limit_is_the_tenants_or_the_default if {
	no_cap := tools.decision with input as good with data.config.run_call_limits as {"default": null, "tenants": {}}
	no_cap.run_call_limit == null
	limits := {"default": 100, "tenants": {"acme": 25}}
	acme := tools.decision with input as good with data.config.run_call_limits as limits
	acme.run_call_limit == 25
	other := tools.decision with input as object.union(good, {"tenant": "globex"}) with data.config.run_call_limits as limits
	other.run_call_limit == 100
}

test_an_unknown_amount_needs_approval_where_a_threshold_is_set if {
	call := {"server": "mcp-outbox", "tool": "post_webhook", "tenant": "acme", "subject": "p", "scopes": ["outbox:write"]}
	rules := {"mcp-outbox": {"post_webhook": {"scopes": ["outbox:write"], "approval_over_cents": 100000}}}
	small := tools.decision with input as object.union(call, {"arguments": {"destination": "ops", "amount_cents": 500}}) with data.config.tools as rules
	not small.approval_required
	unknown := tools.decision with input as object.union(call, {"arguments": {"destination": "ops"}}) with data.config.tools as rules
	unknown.approval_required
}
