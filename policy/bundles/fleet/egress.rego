# What may leave the fleet for an agent another organisation runs, and what may be done with its
# answer. The workers ask before every step they send to an external agent (registered with an
# identity enrolled as external), and again when its answer comes back.
#
# Deny by default: a step leaves only if a grant in data.config.egress.grants names its tenant, the
# agent and the skill, and then only with the input fields that grant names; every other field, at
# any depth, stays behind.
#
# data.fleet.egress.decision, input: {tenant, agent: {id, url}, skill, fields: [top-level input
#   keys], paths: [the input's leaf paths]}. A path names a leaf of the input: object keys joined by
#   ".", and "[]" after a key whose value is a list (its elements): {"lines": [{"sku": "A"}]} has the
#   path "lines[].sku". Adds "send": the paths that may leave, and "withhold": the others. A field a
#   grant names sends everything under it ("customer" sends "customer.name"), except what
#   config.egress.withhold (or the tenant's own list) names: a key named there is withheld wherever it
#   occurs. Secrets are redacted from what is sent whatever policy says.
# data.fleet.egress.answer, input: {tenant, agent: {id, url}, skill, fields: [answer keys], size}.
#   Adds "act": whether later steps may take input from the answer ("$from"); an answer that may not
#   be acted on is kept for the record and shown to the caller, nothing more.
package fleet.egress

cfg := data.config.egress

tenant_cfg := object.get(cfg.tenants, input.tenant, {})

agent_cfg := object.get(cfg.agents, input.agent.id, {})

# The grants that cover this step: tenant, agent and skill named exactly (no wildcards).
grants contains grant if {
	some grant in cfg.grants
	grant.tenant == input.tenant
	grant.agent == input.agent.id
	input.skill in grant.skills
}

deny contains msg if {
	count(grants) == 0
	msg := sprintf(
		"no egress grant lets tenant %s send skill %s to %s (config.egress.grants)",
		[input.tenant, input.skill, input.agent.id],
	)
}

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

named contains field if {
	some grant in grants
	some field in grant.fields
}

withheld_keys := {key | some key in array.concat(cfg.withhold, object.get(tenant_cfg, "withhold", []))}

# ``field`` names ``path`` itself or something ``path`` lies under.
covers(field, path) if field == path

covers(field, path) if startswith(path, concat("", [field, "."]))

covers(field, path) if startswith(path, concat("", [field, "[]"]))

held_back(path) if {
	some key in split(replace(path, "[]", ""), ".")
	key in withheld_keys
}

sent contains path if {
	some path in object.get(input, "paths", [])
	some field in named
	covers(field, path)
	not held_back(path)
}

send := sort(sent)

withhold := sort({path | some path in object.get(input, "paths", []); not path in sent})

decision := {"allow": count(deny) == 0, "reasons": sort(deny), "send": send, "withhold": withhold}

answer_deny contains msg if {
	input.size > cfg.max_answer_bytes
	msg := sprintf("the answer of %s is larger than %d bytes", [input.agent.id, cfg.max_answer_bytes])
}

answer := {
	"allow": count(answer_deny) == 0,
	"reasons": sort(answer_deny),
	"act": object.get(agent_cfg, "act_on_answers", cfg.act_on_answers),
}
