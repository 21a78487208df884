# Triggers: which run an ambient event starts, if any.
# Input: {subject, type, source, tenant, data} of an event on fleet.events.>. The tenant and source
# are those of the event's NATS subject, fleet.events.<tenant>.<source>.<name>... (the broker lets a
# producer publish only under its own), and subject is the logical subject fleet.events.<name>...
# with them taken out, so a rule's subject never names a tenant or a source.
# data.config.triggers: rules, first match wins. A rule has a NATS-style subject pattern ("*" one
# token, ">" the rest) over the logical subject, optionally a type, a tenants list and a sources list,
# and the template of the run: its steps (inputs may take event fields with {"$event": "data.path"})
# and a priority. A rule with "batch" gathers events into one batch run per tenant and window (see
# closes below).
package fleet.triggers

subject_matches(pattern, subject) if {
	p := split(pattern, ".")
	s := split(subject, ".")
	p[count(p) - 1] != ">"
	count(p) == count(s)
	every i, token in p {
		token in {"*", s[i]}
	}
}

subject_matches(pattern, subject) if {
	p := split(pattern, ".")
	s := split(subject, ".")
	p[count(p) - 1] == ">"
	count(s) >= count(p)
	every i, token in array.slice(p, 0, count(p) - 1) {
		token in {"*", s[i]}
	}
}

applies(rule) if {
	subject_matches(rule.subject, input.subject)
	object.get(rule, "type", input.type) == input.type
	admits(rule)
}

# The rule's tenants and sources lists, when it has them, name the event's.
admits(rule) if {
	input.tenant in object.get(rule, "tenants", [input.tenant])
	admits_source(rule)
}

admits_source(rule) if not "sources" in object.keys(rule)

admits_source(rule) if input.source in rule.sources

matches contains i if {
	some i, rule in data.config.triggers
	applies(rule)
}

# A batch rule (with "batch": {window_s, close_after_s, close_subject?}) gathers the events of one
# tenant and window into one run; an event on its close_subject closes the tenant's current batch.
closes contains {"rule": rule.name, "batch": rule.batch} if {
	some rule in data.config.triggers
	subject_matches(object.get(object.get(rule, "batch", {}), "close_subject", ""), input.subject)
	admits(rule)
}

decision := {
	"allow": true,
	"reasons": [],
	"rule": rule.name,
	"run": {"steps": rule.steps, "priority": object.get(rule, "priority", 0), "batch": object.get(rule, "batch", null)},
	"closes": sort(closes),
} if {
	count(matches) > 0
	rule := data.config.triggers[min(matches)]
}

decision := {"allow": true, "reasons": ["no trigger rule matches the event"], "rule": null, "run": null, "closes": sort(closes)} if {
	count(matches) == 0
}
