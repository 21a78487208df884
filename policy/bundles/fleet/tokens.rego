# What an access token may carry. The registry's token service asks this for every token it issues
# (client credentials and token exchange); it refuses the request unless the decision allows every
# requested scope. Policy narrows within the enrollment: a scope the client was not enrolled for is
# refused before this is asked.
#
# Input: {grant: "client_credentials" | "token_exchange",
#         client: {id, kind, scopes: [..]},   the party asking (for an exchange: the next actor)
#         subject: id,                        who the token is for (the client itself, or the caller)
#         actors: [id, ..],                   who passes it on, nearest first (empty: the client's own)
#         audience: {id, kind, scopes?},      the one service the token is for (an MCP server:
#                                             with the scopes its registered tools declare)
#         tenant, scopes: [..],               what is asked for
#         signal?: {action}}                  a signal grant's: the action of the one signal it is
#                                             for (its run, id and body are bound by the service)
package fleet.tokens

cfg := data.config.tokens

# The scopes each kind of service acts on (the console: those it uses in the signed-in person's name,
# which their sign-in token carries and the console's session grant keeps as a ceiling); an MCP server: the scopes its tools need (fleet.tools),
# or, for a server that data does not name, those its registered tools declare.
fits(scope) if scope in cfg.audience_scopes[input.audience.kind]

fits(scope) if {
	input.audience.kind == "mcp_server"
	some rule in data.config.tools[input.audience.id]
	scope in rule.scopes
}

fits(scope) if {
	input.audience.kind == "mcp_server"
	not data.config.tools[input.audience.id]
	scope in object.get(input.audience, "scopes", [])
}

deny contains msg if {
	some scope in input.scopes
	not fits(scope)
	msg := sprintf("scope %s is not one that %s (%s) acts on", [scope, input.audience.id, input.audience.kind])
}

# What changes the registry, or administers it, is never done in someone else's name.
deny contains msg if {
	count(input.actors) > 0
	some scope in input.scopes
	scope in cfg.never_delegated
	msg := sprintf("scope %s cannot be delegated", [scope])
}

# The console is signed in to by a person with their own token, never with one passed down a chain.
deny contains "a console sign-in cannot be delegated" if {
	input.audience.kind == "console"
	count(input.actors) > 0
}

# Per tenant: services that tenant's tokens may not reach (e.g. a tenant kept off a tool server).
deny contains msg if {
	input.audience.id in object.get(cfg.tenant_denied_audiences, input.tenant, [])
	msg := sprintf("tenant %s may not use %s", [input.tenant, input.audience.id])
}

# A signal grant (one NATS signal, signed by the token service for its signer) goes to a coordinator,
# for an action a signal may take, and carries only the scopes that answer a run.
signal_actions := {"approve", "reject", "input", "extend", "cancel"}

deny contains "a signal grant is addressed to a coordinator" if {
	input.signal
	input.audience.kind != "coordinator"
}

deny contains msg if {
	input.signal
	not input.signal.action in signal_actions
	msg := sprintf("a signal cannot %v", [input.signal.action])
}

deny contains msg if {
	input.signal
	some scope in input.scopes
	not scope in cfg.signal_scopes
	msg := sprintf("scope %s is not one a signal grant carries", [scope])
}

# A token is for one tenant: "*" (an enrollment's "any tenant") is never a token's.
deny contains "a token is for one tenant, never for every tenant (*)" if input.tenant == "*"

# Specialists, MCP servers and the console act for their callers only: with tokens exchanged from
# the caller's (which keep the caller's tenant), never with a token for a tenant of their own
# choosing. Only the registry (which is no tenant's) hears them in their own name. So one stolen
# specialist key is not a key to every tenant's memory, SQL or cases. (An agent another organisation
# runs, enrolled as external, calls into the fleet as a caller: its own tokens, for its tenants.)
deny contains msg if {
	input.grant == "client_credentials"
	input.client.kind in cfg.exchange_only_kinds
	not object.get(input.client, "external", false) # a partner's agent calls in with its own tokens
	input.audience.kind != "registry"
	msg := sprintf("%s acts only for its callers (a token exchanged from theirs), not for a tenant of its own", [input.client.id])
}

decision := {"allow": count(deny) == 0, "reasons": sort(deny)}

# ------------------------------------------------------------------------------------ tenant keys
# Which services the registry gives a tenant's key (POST /v1/tenant-keys), with which artifacts and
# sandbox workspace heads are sealed (fleet.tenant_keys). The registry has already checked that the
# service shows a valid access token of one of that tenant's callers, addressed to itself; this says
# which services may hold such keys at all (data.config.tokens.tenant_key_holders: those that keep
# artifacts), and may narrow it per tenant.
#
# Input: {client: {id, kind},          the service asking (in its own name)
#         tenant,                       the tenant of the caller's token (never "*")
#         caller: {sub, actors: [..]}}  whose token it showed, and who passed that token on
tenant_key_deny contains msg if {
	not input.client.id in object.get(cfg, "tenant_key_holders", [])
	msg := sprintf("%s (%s) does not keep artifacts: it holds no tenant keys", [input.client.id, input.client.kind])
}

tenant_key_deny contains msg if {
	input.client.kind != "mcp_server"
	msg := sprintf("only MCP servers hold tenant keys, not %s (%s)", [input.client.id, input.client.kind])
}

tenant_key_deny contains "a tenant key is for one tenant, never for every tenant (*)" if input.tenant == "*"

tenant_key_deny contains msg if {
	input.client.id in object.get(cfg.tenant_denied_audiences, input.tenant, [])
	msg := sprintf("tenant %s may not use %s", [input.tenant, input.client.id])
}

tenant_key := {"allow": count(tenant_key_deny) == 0, "reasons": sort(tenant_key_deny)}
