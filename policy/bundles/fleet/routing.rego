# Routing: which plan serves a free-text request (explicit steps from the caller bypass this), and
# which agents outside the fleet a step may be routed to.
#
# data.fleet.routing.decision, input: {text, tenant}. The first rule in data.config.routing whose
#   keywords all occur wins.
# data.fleet.routing.outside, input: {tenant, skill, agents: [the ids of the agents outside the
#   fleet (enrolled external) that offer the skill now]}. Adds "agents": those of them the tenant's
#   entry in data.config.outside_agents names for the skill, in that entry's order. A step that
#   names no agent goes to an agent of the fleet's own when one offers the skill; only when none
#   does may it go to one of these, and never to an outside agent this does not name. (A plan may
#   name an agent itself; whatever routing picks, the step leaves the fleet only if fleet.egress
#   grants it.)
package fleet.routing

matches contains i if {
	some i, rule in data.config.routing
	every keyword in rule.keywords {
		contains(lower(input.text), keyword)
	}
}

decision := {"allow": true, "reasons": [], "steps": data.config.routing[min(matches)].steps} if {
	count(matches) > 0
}

decision := {"allow": false, "reasons": ["no routing rule matches the request text"]} if {
	count(matches) == 0
}

outside_named := object.get(object.get(data.config.outside_agents, input.tenant, {}), input.skill, [])

outside_agents := [agent | some agent in outside_named; agent in input.agents]

outside := {"allow": true, "reasons": [], "agents": outside_agents} if count(outside_agents) > 0

outside := {"allow": false, "reasons": [msg], "agents": []} if {
	count(outside_agents) == 0
	msg := sprintf(
		"tenant %s's policy names no agent outside the fleet for skill %s (config.outside_agents)",
		[input.tenant, input.skill],
	)
}
