# Tool authorization: may this caller run this tool, on this server, for this tenant?
# Input: {server, tool, tenant, subject, scopes: [..], arguments: {sql_length: n, ...}}
package fleet.tools

rule := data.config.tools[input.server][input.tool]

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

decision := {"allow": count(deny) == 0, "reasons": sort(deny)}
