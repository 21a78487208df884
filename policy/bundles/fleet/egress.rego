# What may leave the fleet for an agent another organisation runs, and what may be done with its
# answer. The workers ask before every step they send to an external agent (registered with an
# identity enrolled as external), and again when its answer comes back.
#
# data.fleet.egress.decision, input: {tenant, agent: {id, url}, skill, fields: [top-level input
#   keys]}. Adds "withhold": the input fields removed before the step leaves (secrets are redacted
#   from what remains whatever policy says).
# data.fleet.egress.answer, input: {tenant, agent: {id, url}, skill, fields: [answer keys], size}.
#   Adds "act": whether later steps may take input from the answer ("$from"); an answer that may not
#   be acted on is kept for the record and shown to the caller, nothing more.
package fleet.egress

cfg := data.config.egress

tenant_cfg := object.get(cfg.tenants, input.tenant, {})

agent_cfg := object.get(cfg.agents, input.agent.id, {})

deny contains msg if {
	input.tenant in cfg.tenants_kept_inside
	msg := sprintf("tenant %s keeps its data inside the fleet", [input.tenant])
}

deny contains msg if {
	allowed := object.get(agent_cfg, "tenants", null)
	allowed != null
	not input.tenant in allowed
	msg := sprintf("%s is not an agent tenant %s may send to", [input.agent.id, input.tenant])
}

withhold := sort({f |
	some f in input.fields
	f in array.concat(cfg.withhold, object.get(tenant_cfg, "withhold", []))
})

decision := {"allow": count(deny) == 0, "reasons": sort(deny), "withhold": withhold}

answer_deny contains msg if {
	input.size > cfg.max_answer_bytes
	msg := sprintf("the answer of %s is larger than %d bytes", [input.agent.id, cfg.max_answer_bytes])
}

answer := {
	"allow": count(answer_deny) == 0,
	"reasons": sort(answer_deny),
	"act": object.get(agent_cfg, "act_on_answers", cfg.act_on_answers),
}
