# Tool authorization: may this caller run this tool, on this server, for this tenant?
# Input: {server, tool, tenant, subject, agent, actors: [..], scopes: [..], declared_scopes: [..],
#         arguments: {sql_length: n, amount_cents: n, ...}}
# subject: for whom (the token's sub); agent: who makes the call (the nearest actor, or the subject
# for a token in the agent's own name).
package fleet.tools

# The tool's rule in data. The tools of a server that data does not name (one registered at run
# time) are governed by the scopes their server declares for each, if it declares any: a tool
# that declares none is not allowed.
rule := data.config.tools[input.server][input.tool]

rule := {"scopes": input.declared_scopes} if {
	not data.config.tools[input.server]
	count(object.get(input, "declared_scopes", [])) > 0
}

deny contains "the call carries no tenant" if {
	not input.tenant
}

deny contains msg if {
	not rule
	msg := sprintf("tool %s/%s is not allowed by policy", [input.server, input.tool])
}

deny contains msg if {
	some scope in rule.scopes
	not scope in input.scopes
	msg := sprintf("the token lacks scope %s", [scope])
}

deny contains msg if {
	input.arguments.sql_length > rule.max_sql_length
	msg := sprintf("SQL is longer than %d characters", [rule.max_sql_length])
}

# A tool whose rule names approval_over_cents needs an approval for an amount above it: the tool
# then does nothing and answers {"status": "pending_approval"} (the run pauses at a gate).
approval_required if input.arguments.amount_cents > rule.approval_over_cents

# ... and a call whose amount is not known, to a tool that has a threshold (say nothing, ask).
approval_required if {
	rule.approval_over_cents
	not is_number(object.get(input.arguments, "amount_cents", null))
}

# ... and every call of a tool whose rule has an approval_over_score (a publication, over a report's
# highest anomaly score): the tool cannot know the score, and a caller's word for it counts for
# nothing, so the call needs a grant. The coordinator asks for one from policy
# (fleet.approvals.auto) with the score the fleet computed for the report, or from a person.
approval_required if rule.approval_over_score

# Cumulative limits: what the tool itself counted as refunded with no person's approval (in its own
# table, in the transaction of the effect; a caller cannot reset it), plus this amount, over the
# rule's limit: in the caller's run (approval_over_run_cents, approval_over_run_count) and in the
# tenant's last 24 hours (approval_over_tenant_cents_24h, approval_over_tenant_count_24h).
approval_required if {
	input.arguments.run_unattended_cents + input.arguments.amount_cents > rule.approval_over_run_cents
}

approval_required if input.arguments.run_unattended_refunds + 1 > rule.approval_over_run_count

approval_required if {
	total := input.arguments.tenant_unattended_cents_24h + input.arguments.amount_cents
	total > rule.approval_over_tenant_cents_24h
}

approval_required if {
	input.arguments.tenant_unattended_refunds_24h + 1 > rule.approval_over_tenant_count_24h
}

# ... and a call whose running totals are not known, to a tool that has such a limit: ask.
approval_required if {
	some limit in cumulative_limits
	rule[limit]
	some total in cumulative_totals
	not is_number(object.get(input.arguments, total, null))
}

cumulative_limits := [
	"approval_over_run_cents", "approval_over_run_count",
	"approval_over_tenant_cents_24h", "approval_over_tenant_count_24h",
]

cumulative_totals := [
	"run_unattended_cents", "run_unattended_refunds",
	"tenant_unattended_cents_24h", "tenant_unattended_refunds_24h",
]

# ... and every call of a tool whose rule says approval_always, or a call to one of the destinations
# its rule lists in approval_destinations (the outbox's webhooks).
approval_required if rule.approval_always == true

approval_required if input.arguments.destination in rule.approval_destinations

default approval_required := false

# How often one agent (the caller nearest the tool) may call this tool for one tenant: a token bucket that
# holds `burst` calls and refills at `per_minute`. The agent's own entry in
# data.config.tool_rates.agents wins over the tool's rule (`rate`), which wins over the fleet's
# default. Each server replica keeps its own buckets. null: no limit.
default rate_limit := null

rate_limit := r if {
	rule
	r := data.config.tool_rates.agents[object.get(input, "agent", input.subject)]
} else := r if {
	r := rule.rate
} else := r if {
	rule
	r := data.config.tool_rates.default
}

# How many tool calls one run may make over every MCP server, for the tenant (the servers count
# them together); null: no cap. data.config.run_call_limits: default, and tenants.<tenant>.
default run_call_limit := null

run_call_limit := n if {
	n := data.config.run_call_limits.tenants[input.tenant]
} else := n if {
	n := data.config.run_call_limits.default
	n != null
}

decision := {
	"allow": count(deny) == 0,
	"reasons": sort(deny),
	"approval_required": approval_required,
	"rate_limit": rate_limit,
	"run_call_limit": run_call_limit,
}
