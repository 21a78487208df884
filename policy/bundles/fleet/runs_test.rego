package fleet.runs_test

import data.fleet.runs

config := {
	"tenant_reach": {
		"read": ["runs:admin"],
		"push": ["runs:admin"],
		"cancel": ["runs:admin", "runs:approve"],
		"answer": ["runs:admin", "runs:approve"],
		"resolve": ["runs:admin", "runs:resolve"],
	},
}

ask(action, sub, scopes) := {"action": action, "principal": {"sub": sub, "tenant": "acme", "scopes": scopes, "actors": []}}

test_a_principal_reaches_only_its_own_runs if {
	d := runs.access with input as ask("read", "alice", ["agent:invoke"]) with data.config.runs as config
	d.allow
	d.reach == "own"
	d.owner == "alice"
}

test_the_tenant_admin_reaches_every_run_of_its_tenant if {
	some action in ["read", "push", "cancel", "answer", "resolve"]
	d := runs.access with input as ask(action, "admin", ["agent:invoke", "runs:admin"]) with data.config.runs as config
	d.allow
	d.reach == "tenant"
	d.owner == ""
}

reach_of(action, sub, scopes) := d.reach if {
	d := runs.access with input as ask(action, sub, scopes) with data.config.runs as config
}

test_an_approver_reaches_other_runs_only_to_answer_or_cancel if {
	approver := ["agent:invoke", "runs:approve"]
	reach_of("answer", "lead", approver) == "tenant"
	reach_of("cancel", "lead", approver) == "tenant"
	reach_of("read", "lead", approver) == "own"
	reach_of("push", "lead", approver) == "own"
}

test_the_resolve_scope_reaches_other_runs_only_to_resolve if {
	resolver := ["agent:invoke", "runs:resolve"]
	reach_of("resolve", "ops", resolver) == "tenant"
	reach_of("read", "ops", resolver) == "own"
}

test_an_act_chain_does_not_change_whose_runs_they_are if {
	through_console := object.union(ask("read", "alice", ["agent:invoke"]), {"principal": {"actors": ["console"]}})
	d := runs.access with input as through_console with data.config.runs as config
	d.owner == "alice"
}

test_no_subject_no_tenant_or_an_unknown_action_is_refused if {
	d := runs.access with input as ask("read", "", ["runs:admin"]) with data.config.runs as config
	not d.allow
	d.reasons == ["a run principal needs a subject"]
	star := object.union(ask("read", "alice", ["runs:admin"]), {"principal": {"tenant": "*"}})
	s := runs.access with input as star with data.config.runs as config
	not s.allow
	u := runs.access with input as ask("delete", "alice", []) with data.config.runs as config
	u.reasons == ["unknown run action delete"]
}

test_the_shipped_config_gives_the_admin_scope_tenant_reach if {
	admin := runs.access with input as ask("read", "operator", ["runs:admin"])
	admin.reach == "tenant"
	user := runs.access with input as ask("read", "operator", ["agent:invoke"])
	user.reach == "own"
}
