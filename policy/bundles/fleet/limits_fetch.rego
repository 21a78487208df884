# Fetches of URLs from outside the fleet's configuration (see fleet.outbound): agent cards (the
# registry), push webhooks (the coordinator), a partner's token endpoint (the workers).
#
# data.fleet.limits.fetch.decision, input: {purpose: "card" | "webhook" | "token_endpoint", scheme,
#   host, port, local: the stack runs on one machine, agent: {id, external} (a card's)}.
#   allow       the scheme is in schemes; a card is on its agent's own host (its id, or a name under
#               it: "researcher", "researcher.fleet.svc"), or its agent is external (then it must
#               be on public addresses), or the stack is local, or the host is in allowed_hosts
#   private_ok  the host may resolve to private, loopback or link-local addresses: the stack is
#               local, the host (or host:port) is in allowed_hosts, or it is a card on its agent's
#               own host (an agent of the fleet runs on the fleet's network)
#   max_bytes   the most of an answer's body read; more is fetch_too_large
#   deadline_s  the whole exchange, connect to last byte; later is fetch_timeout
# data.config.limits.fetch.default, overridden per purpose by data.config.limits.fetch.purposes.
package fleet.limits.fetch

cfg := data.config.limits.fetch

limits := object.union(cfg.default, object.get(cfg.purposes, input.purpose, {}))

listed if input.host in limits.allowed_hosts

listed if sprintf("%s:%d", [input.host, input.port]) in limits.allowed_hosts

own_host if {
	input.purpose == "card"
	not input.agent.external
	input.host == lower(input.agent.id)
}

own_host if {
	input.purpose == "card"
	not input.agent.external
	startswith(input.host, concat("", [lower(input.agent.id), "."]))
}

card_host_ok if input.local

card_host_ok if listed

card_host_ok if own_host

card_host_ok if input.agent.external == true

deny contains msg if {
	not cfg.purposes[input.purpose]
	msg := sprintf("%v is not a purpose of outbound fetches", [input.purpose])
}

deny contains msg if {
	cfg.purposes[input.purpose]
	not input.scheme in limits.schemes
	msg := sprintf("scheme %v is not allowed (config.limits.fetch schemes)", [input.scheme])
}

deny contains msg if {
	input.purpose == "card"
	not card_host_ok
	msg := "a card must be on its agent's own host, or on a host in config.limits.fetch allowed_hosts"
}

deny contains msg if {
	some key in ["max_bytes", "deadline_s"]
	not limits[key] > 0
	msg := sprintf("%s must be a number > 0 (config.limits.fetch)", [key])
}

default private_ok := false

private_ok if input.local == true

private_ok if listed

private_ok if own_host

decision := {
	"allow": count(deny) == 0,
	"reasons": [msg | some msg in deny],
	"private_ok": private_ok,
	"max_bytes": limits.max_bytes,
	"deadline_s": limits.deadline_s,
}
