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
