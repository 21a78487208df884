package fleet.tokens_test

import data.fleet.tokens

request(audience, kind, scopes) := {
	"grant": "client_credentials",
	"client": {"id": "worker-1", "kind": "worker", "scopes": ["*"]},
	"subject": "worker-1",
	"actors": [],
	"audience": {"id": audience, "kind": kind},
	"tenant": "acme",
	"scopes": scopes,
}

test_a_specialist_token_carries_invoke if {
	tokens.decision.allow with input as request("sql-analyst", "specialist", ["agent:invoke"])
}

test_a_scope_the_audience_does_not_act_on_is_refused if {
	d := tokens.decision with input as request("sql-analyst", "specialist", ["registry:admin"])
	not d.allow
	d.reasons == ["scope registry:admin is not one that sql-analyst (specialist) acts on"]
}

# A person signs in to the console with the scopes it may use in their name, and no others.
test_a_console_sign_in_carries_the_scopes_the_console_acts_with if {
	tokens.decision.allow with input as request("console", "console", ["agent:invoke", "runs:approve", "registry:read"])
	not tokens.decision.allow with input as request("console", "console", ["registry:write"])
}

test_a_console_sign_in_is_never_a_delegated_token if {
	delegated := object.union(request("console", "console", ["agent:invoke"]), {"grant": "token_exchange", "actors": ["worker-1"]})
	d := tokens.decision with input as delegated
	not d.allow
	d.reasons == ["a console sign-in cannot be delegated"]
}

test_a_tool_server_gets_the_scopes_of_its_own_tools_only if {
	tokens.decision.allow with input as request("mcp-sql", "mcp_server", ["sql:query"])
	not tokens.decision.allow with input as request("mcp-sql", "mcp_server", ["cases:write"])
}

test_registry_changes_are_never_delegated if {
	exchanged := object.union(request("registry", "registry", ["registry:read", "registry:write"]), {
		"grant": "token_exchange",
		"subject": "operator",
		"actors": ["coordinator"],
	})
	d := tokens.decision with input as exchanged
	d.reasons == ["scope registry:write cannot be delegated"]
	tokens.decision.allow with input as request("registry", "registry", ["registry:read", "registry:write"])
}

test_a_tenant_kept_off_a_server_is_refused if {
	d := tokens.decision with input as request("mcp-cases", "mcp_server", ["cases:write"])
		with data.config.tokens.tenant_denied_audiences as {"acme": ["mcp-cases"]}
	d.reasons == ["tenant acme may not use mcp-cases"]
}

test_a_server_registered_at_run_time_gets_the_scopes_its_tools_declare if {
	registered := object.union(request("mcp-warehouse", "mcp_server", ["sql:query"]), {
		"audience": {"id": "mcp-warehouse", "kind": "mcp_server", "scopes": ["sql:query"]},
	})
	tokens.decision.allow with input as registered
	not tokens.decision.allow with input as object.union(registered, {"scopes": ["cases:write"]})
	# a server named in data gets only what data says, whatever it declares
	named := object.union(registered, {"audience": {"id": "mcp-sql", "kind": "mcp_server", "scopes": ["cases:write"]}})
	not tokens.decision.allow with input as object.union(named, {"scopes": ["cases:write"]})
}

signal_request(action, audience, kind, scopes) := object.union(request(audience, kind, scopes), {
	"client": {"id": "operator", "kind": "operator", "scopes": ["*"]},
	"subject": "operator",
	"signal": {"action": action},
})

test_a_signal_grant_to_the_coordinator_carries_the_approve_scope if {
	tokens.decision.allow with input as signal_request("approve", "coordinator", "coordinator", ["runs:approve"])
	tokens.decision.allow with input as signal_request("cancel", "coordinator", "coordinator", ["runs:approve"])
}

test_a_signal_grant_carries_no_other_scope if {
	d := tokens.decision with input as signal_request("approve", "coordinator", "coordinator", ["agent:invoke", "runs:approve"])
	d.reasons == ["scope agent:invoke is not one a signal grant carries"]
}

test_a_signal_grant_goes_to_a_coordinator_only if {
	d := tokens.decision with input as signal_request("approve", "console", "console", ["runs:approve"])
	d.reasons == ["a signal grant is addressed to a coordinator"]
}

test_a_signal_grant_is_for_a_signal_action_only if {
	d := tokens.decision with input as signal_request("delete", "coordinator", "coordinator", ["runs:approve"])
	d.reasons == ["a signal cannot delete"]
}

test_a_specialist_cannot_take_a_token_for_a_tenant_of_its_own_choosing if {
	own := object.union(request("mcp-memory", "mcp_server", ["memory:read"]), {
		"client": {"id": "researcher", "kind": "specialist", "scopes": ["memory:read"]},
		"subject": "researcher",
		"tenant": "globex",
	})
	d := tokens.decision with input as own
	not d.allow
	d.reasons == ["researcher acts only for its callers (a token exchanged from theirs), not for a tenant of its own"]
}

test_a_specialist_acts_for_its_caller_with_an_exchanged_token if {
	exchanged := object.union(request("mcp-memory", "mcp_server", ["memory:read"]), {
		"grant": "token_exchange",
		"client": {"id": "researcher", "kind": "specialist", "scopes": ["memory:read"]},
		"subject": "operator",
		"actors": ["researcher", "worker-1"],
	})
	tokens.decision.allow with input as exchanged
}

test_a_tool_server_and_the_console_still_reach_the_registry_in_their_own_name if {
	for_registry := object.union(request("registry", "registry", ["registry:read"]), {
		"client": {"id": "mcp-sql", "kind": "mcp_server", "scopes": ["registry:read"]},
		"subject": "mcp-sql",
		"tenant": "default",
	})
	tokens.decision.allow with input as for_registry
	console := object.union(for_registry, {"client": {"id": "console", "kind": "console", "scopes": ["registry:read"]}, "subject": "console"})
	tokens.decision.allow with input as console
}

test_no_token_is_for_every_tenant if {
	d := tokens.decision with input as object.union(request("sql-analyst", "specialist", ["agent:invoke"]), {"tenant": "*"})
	not d.allow
	"a token is for one tenant, never for every tenant (*)" in d.reasons
}

test_a_partners_agent_calls_in_with_its_own_tokens if {
	partner := object.union(request("coordinator", "coordinator", ["agent:invoke"]), {
		"client": {"id": "acme-partner", "kind": "specialist", "scopes": ["agent:invoke"], "external": true},
		"subject": "acme-partner",
	})
	tokens.decision.allow with input as partner
}

key_request(id, kind, tenant) := {"client": {"id": id, "kind": kind}, "tenant": tenant, "caller": {"sub": "operator", "actors": []}}

test_the_servers_that_keep_artifacts_get_tenant_keys if {
	tokens.tenant_key.allow with input as key_request("mcp-sandbox", "mcp_server", "acme")
	tokens.tenant_key.allow with input as key_request("mcp-outbox", "mcp_server", "acme")
}

test_a_server_that_keeps_no_artifacts_gets_no_tenant_key if {
	d := tokens.tenant_key with input as key_request("mcp-sql", "mcp_server", "acme")
	not d.allow
	d.reasons == ["mcp-sql (mcp_server) does not keep artifacts: it holds no tenant keys"]
}

test_a_service_that_is_no_mcp_server_gets_no_tenant_key_whatever_its_id if {
	d := tokens.tenant_key with input as key_request("mcp-sandbox", "worker", "acme")
	not d.allow
	d.reasons == ["only MCP servers hold tenant keys, not mcp-sandbox (worker)"]
}

test_no_tenant_key_is_for_every_tenant if {
	not tokens.tenant_key.allow with input as key_request("mcp-sandbox", "mcp_server", "*")
}

test_a_tenant_kept_off_a_server_gives_it_no_key if {
	not tokens.tenant_key.allow with input as key_request("mcp-sandbox", "mcp_server", "acme")
		with data.config.tokens.tenant_denied_audiences as {"acme": ["mcp-sandbox"]}
}
