# Tool authorization: may this caller run this tool, on this server, for this tenant?
# Input: {server, tool, tenant, subject, actors: [..], scopes: [..], declared_scopes: [..],
#         arguments: {sql_length: n, amount_cents: n, ...}}
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

default approval_required := false

decision := {"allow": count(deny) == 0, "reasons": sort(deny), "approval_required": approval_required}
