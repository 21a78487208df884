# Routing: which plan serves a free-text request (explicit steps from the caller bypass this).
# Input: {text, tenant}. The first rule in data.config.routing whose keywords all occur wins.
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
