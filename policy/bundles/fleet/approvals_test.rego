package fleet.approvals_test

import data.fleet.approvals

config := {
	"approvers": [
		{"tenants": ["*"], "skills": ["*"], "subjects": ["operator"], "actions": ["approve", "reject", "input", "extend", "cancel"]},
		{"tenants": ["acme"], "skills": ["issue-refund"], "subjects": ["lead"], "actions": ["approve", "reject"], "escalated_only": true},
		{"tenants": ["acme"], "skills": ["wire-transfer"], "subjects": ["*"], "actions": ["approve"], "distinct_from_requester": true},
	],
	"deadlines": {
		"default": {"timeout_s": 86400, "warn_before_s": 3600, "on_expired": "expire", "escalate_for_s": 3600},
		"skills": {"issue-refund": {"on_expired": "escalate"}},
		"tenants": {"quick": {"timeout_s": 5, "skills": {"issue-refund": {"timeout_s": 2}}}},
	},
}

signer(sub) := {"sub": sub, "tenant": "acme", "scopes": ["agent:invoke", "runs:approve"]}

ask(action, sub, wait) := {
	"action": action, "tenant": "acme", "signer": signer(sub),
	"run": {"owner": "alice"}, "wait": wait,
}

refund := {"type": "approval", "skill": "issue-refund", "step": "pay", "escalated": false}

test_an_approver_may_answer if {
	approvals.decision.allow with input as ask("approve", "operator", refund) with data.config.approvals as config
}

test_someone_not_named_may_not if {
	d := approvals.decision with input as ask("approve", "mallory", refund) with data.config.approvals as config
	not d.allow
	d.reasons == ["mallory may not approve approval of skill issue-refund"]
}

test_escalation_approvers_only_once_escalated if {
	not approvals.decision.allow with input as ask("approve", "lead", refund) with data.config.approvals as config
	approvals.decision.allow with input as ask("approve", "lead", object.union(refund, {"escalated": true}))
		with data.config.approvals as config
}

test_the_scope_and_the_tenant_are_required if {
	no_scope := object.union(ask("approve", "operator", refund), {"signer": {"sub": "operator", "tenant": "acme", "scopes": ["agent:invoke"]}})
	d := approvals.decision with input as no_scope with data.config.approvals as config
	d.reasons == ["answering a run needs scope runs:approve"]
	other := object.union(ask("approve", "operator", refund), {"signer": {"sub": "operator", "tenant": "globex", "scopes": ["runs:approve"]}})
	not approvals.decision.allow with input as other with data.config.approvals as config
}

test_four_eyes if {
	wire := {"type": "approval", "skill": "wire-transfer", "step": "w"}
	approvals.decision.allow with input as ask("approve", "bob", wire) with data.config.approvals as config
	not approvals.decision.allow with input as ask("approve", "alice", wire) with data.config.approvals as config
}

test_an_unknown_action_is_refused if {
	d := approvals.decision with input as ask("delete", "operator", refund) with data.config.approvals as config
	d.reasons == ["unknown action delete"]
}

test_deadlines_default_then_tenant_then_skill if {
	d := approvals.deadlines with input as {"tenant": "quick"} with data.config.approvals as config
	d.allow
	d.default.timeout_s == 5
	d.skills["issue-refund"].timeout_s == 2
	d.skills["issue-refund"].on_expired == "escalate"
	e := approvals.deadlines with input as {"tenant": "acme"} with data.config.approvals as config
	e.default.timeout_s == 86400
	e.skills["issue-refund"].timeout_s == 86400
}

test_a_bad_deadline_is_reported if {
	bad := {"approvers": [], "deadlines": {"default": {"timeout_s": -1, "warn_before_s": 1, "on_expired": "never", "escalate_for_s": 1}}}
	d := approvals.deadlines with input as {"tenant": "acme"} with data.config.approvals as bad
	not d.allow
	count(d.reasons) == 2
}

test_the_owner_may_cancel_its_own_run_without_the_approver_scope if {
	owner := {"sub": "alice", "tenant": "acme", "scopes": ["agent:invoke"]}
	own := object.union(ask("cancel", "alice", {}), {"signer": owner})
	approvals.decision.allow with input as own with data.config.approvals as object.union(config, {"owner_may_cancel": true})
	not approvals.decision.allow with input as own with data.config.approvals as config
}

test_a_cancel_by_someone_else_needs_the_scope_and_a_rule if {
	cfg := object.union(config, {"owner_may_cancel": true})
	bob := {"sub": "bob", "tenant": "acme", "scopes": ["agent:invoke", "runs:admin"]}
	d := approvals.decision with input as object.union(ask("cancel", "bob", {}), {"signer": bob}) with data.config.approvals as cfg
	d.reasons == ["answering a run needs scope runs:approve", "bob may not cancel a wait of skill "]
	approvals.decision.allow with input as ask("cancel", "operator", {}) with data.config.approvals as cfg
	not approvals.decision.allow with input as ask("cancel", "mallory", {}) with data.config.approvals as cfg
}

test_the_owner_of_another_tenant_may_not_cancel if {
	cfg := object.union(config, {"owner_may_cancel": true})
	stranger := {"sub": "alice", "tenant": "globex", "scopes": ["agent:invoke"]}
	d := approvals.decision with input as object.union(ask("cancel", "alice", {}), {"signer": stranger}) with data.config.approvals as cfg
	d.reasons == ["the signer belongs to another tenant"]
}

publication := {"tenant": "acme", "server": "mcp-outbox", "tool": "publish_artifact", "arguments": {}}

test_policy_approves_a_publication_whose_computed_score_is_under_the_threshold if {
	result := approvals.auto with input as object.union(publication, {"facts": {"anomaly_score": 1.2}})
	result.allow
}

test_a_publication_over_the_threshold_or_without_a_computed_score_waits_for_a_person if {
	high := approvals.auto with input as object.union(publication, {"facts": {"anomaly_score": 9.1}})
	not high.allow
	unscored := approvals.auto with input as object.union(publication, {"facts": {}})
	not unscored.allow
	count(unscored.reasons) == 1
}

test_policy_never_approves_a_refund_or_a_tool_that_always_asks if {
	refund := {"tenant": "acme", "server": "mcp-cases", "tool": "issue_refund", "facts": {"anomaly_score": 0}}
	not approvals.auto.allow with input as refund
	rules := {"mcp-outbox": {"publish_artifact": {"approval_over_score": 3.5, "approval_always": true}}}
	always := object.union(publication, {"facts": {"anomaly_score": 0}})
	not approvals.auto.allow with input as always with data.config.tools as rules
}
