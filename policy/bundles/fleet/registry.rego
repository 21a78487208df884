# Which skills an identity may offer on its agent card. The registry asks when an agent registers
# and every time it checks the card again (card refresh): a card claiming a skill its identity may
# not offer is refused at registration (skill_not_allowed) and quarantined at a later check, so
# discovery never hands out an agent for a skill it was not given.
#
# data.fleet.registry.skills, input: {identity: {id, kind, external}, enrolled: [the skills the
#   operator's enrollment token named for it], claimed: [the skill ids on its card]}. Adds
#   "refused": the claimed skills it may not offer.
#
# An identity may offer the skills its enrollment names and those data.config.registry.skills
# .identities names for it (how policy governs a partner's skills without a new enrollment). A skill
# in data.config.registry.skills.internal is offered only inside the fleet: an identity enrolled as
# external (another organisation's agent) may never offer it, whatever its enrollment says.
package fleet.registry

cfg := data.config.registry.skills

granted contains skill if some skill in input.enrolled

granted contains skill if some skill in object.get(cfg.identities, input.identity.id, [])

ungranted contains skill if {
	some skill in input.claimed
	not skill in granted
}

internal_claimed contains skill if {
	input.identity.external == true
	some skill in input.claimed
	skill in cfg.internal
}

deny contains msg if {
	some skill in ungranted
	msg := sprintf(
		"%s may not offer skill %s: neither its enrollment nor policy (config.registry.skills.identities) grants it",
		[input.identity.id, skill],
	)
}

deny contains msg if {
	some skill in internal_claimed
	msg := sprintf("skill %s is offered only inside the fleet, and %s is an agent outside it", [skill, input.identity.id])
}

skills := {
	"allow": count(deny) == 0,
	"reasons": sort(deny),
	"refused": sort(ungranted | internal_claimed),
}
