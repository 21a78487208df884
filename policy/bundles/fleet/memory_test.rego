package fleet.memory_test

import data.fleet.memory

note := {
	"tenant": "acme",
	"agent": "research",
	"tier": "episodic",
	"source": {"kind": "run", "trust": "trusted"},
	"provenance": {"run_id": "r1", "support_runs": 1, "approved": false},
	"findings": [],
}

test_a_clean_episodic_note_is_written if {
	d := memory.decision with input as note
	d.allow
	d.action == "allow"
}

test_pii_is_redacted if {
	d := memory.decision with input as object.union(note, {"findings": [{"type": "EMAIL_ADDRESS", "score": 1}, {"type": "PHONE_NUMBER", "score": 0.75}]})
	d.allow
	d.action == "redact"
	d.redact == ["EMAIL_ADDRESS", "PHONE_NUMBER"]
}

test_a_finding_below_the_score_is_ignored if {
	d := memory.decision with input as object.union(note, {"findings": [{"type": "PERSON", "score": 0.2}]})
	d.action == "allow"
}

test_a_secret_is_never_stored if {
	d := memory.decision with input as object.union(note, {"findings": [{"type": "API_KEY", "score": 1}, {"type": "EMAIL_ADDRESS", "score": 1}]})
	not d.allow
	d.action == "deny"
	d.reasons == ["secrets are never stored (API_KEY)"]
}

test_an_unknown_tier_is_denied if {
	d := memory.decision with input as object.union(note, {"tier": "scratch"})
	d.action == "deny"
}

test_a_tenant_may_keep_pii_out_of_a_tier if {
	call := object.union(note, {"tier": "procedural", "provenance": {"support_runs": 5}, "findings": [{"type": "EMAIL_ADDRESS", "score": 1}]})
	d := memory.decision with input as call with data.config.memory.tenants as {"acme": {"deny_pii_in": ["procedural"]}}
	d.action == "deny"
	d.reasons == ["tenant acme keeps personal data out of procedural memory (EMAIL_ADDRESS)"]
	other := memory.decision with input as object.union(call, {"tenant": "globex"}) with data.config.memory.tenants as {"acme": {"deny_pii_in": ["procedural"]}}
	other.action == "redact"
}

test_a_procedural_rule_from_one_run_is_held if {
	d := memory.decision with input as object.union(note, {"tier": "procedural"})
	not d.allow
	d.action == "hold"
	d.reasons == ["a procedural rule needs support from 3 runs (has 1) or a person's approval"]
}

test_a_procedural_rule_with_enough_support_or_an_approval_is_written if {
	enough := memory.decision with input as object.union(note, {"tier": "procedural", "provenance": {"support_runs": 3}})
	enough.action == "allow"
	approved := memory.decision with input as object.union(note, {"tier": "procedural", "provenance": {"support_runs": 1, "approved": true}})
	approved.action == "allow"
}

test_a_procedural_rule_from_untrusted_output_alone_is_denied if {
	d := memory.decision with input as object.union(note, {"tier": "procedural", "source": {"kind": "tool", "trust": "untrusted"}, "provenance": {"support_runs": 9}})
	d.action == "deny"
	d.reasons == ["a procedural rule never comes from untrusted tool output alone"]
}

test_readers_are_per_tenant_and_agent if {
	memory.read.allow with input as {"tenant": "acme", "agent": "research", "tier": "semantic"}
	readers := {"acme": {"readers": {"research": ["episodic"]}}}
	not memory.read.allow with input as {"tenant": "acme", "agent": "research", "tier": "semantic"} with data.config.memory.tenants as readers
	not memory.read.allow with input as {"tenant": "acme", "agent": "other", "tier": "episodic"} with data.config.memory.tenants as readers
}

test_a_finding_without_a_score_counts_and_unscanned_text_is_denied if {
	secret := memory.decision with input as object.union(note, {"findings": [{"type": "API_KEY"}]})
	secret.action == "deny"
	unscanned := memory.decision with input as object.remove(note, ["findings"])
	unscanned.action == "deny"
	unscanned.reasons == ["the text was not scanned (findings must be a list)"]
}

test_retention_is_the_tenants_own_else_the_default if {
	memory.retention.max_age_s == 7776000 with input as {"tenant": "acme", "tier": "episodic"}
	memory.retention.max_age_s == null with input as {"tenant": "acme", "tier": "semantic"}
	memory.retention.max_age_s == 86400 with input as {"tenant": "brief", "tier": "episodic"}
		with data.config.memory.tenants as {"brief": {"retention": {"episodic": 86400}}}
}

# ------------------------------------------------------------------------------ earned trust
rule := object.union(note, {"tier": "procedural", "source": {"kind": "user", "trust": "untrusted"}})

test_runs_of_one_principal_never_make_an_untrusted_rule if {
	d := memory.decision with input as object.union(rule, {"provenance": {"support_runs": 9, "support_principals": 1}})
	d.action == "hold"
	d.reasons == ["a procedural rule needs support from 2 distinct principals (has 1) or a person's approval"]
}

test_an_untrusted_rule_said_by_distinct_principals_in_enough_runs_is_written if {
	d := memory.decision with input as object.union(rule, {"provenance": {"support_runs": 3, "support_principals": 2}})
	d.action == "allow"
	few_runs := memory.decision with input as object.union(rule, {"provenance": {"support_runs": 2, "support_principals": 2}})
	few_runs.action == "hold"
}

test_a_persons_approval_activates_an_untrusted_rule if {
	d := memory.decision with input as object.union(rule, {"provenance": {"support_runs": 1, "support_principals": 0, "approved": true}})
	d.action == "allow"
}

test_an_untrusted_rule_from_an_agent_or_a_consolidation_is_held_not_denied if {
	some kind in ["agent", "user", "consolidation"]
	d := memory.decision with input as object.union(rule, {"source": {"kind": kind, "trust": "untrusted"}})
	d.action == "hold"
}

test_an_outside_agents_rule_is_denied_whatever_its_support if {
	d := memory.decision with input as object.union(rule, {"source": {"kind": "external", "trust": "untrusted"}, "provenance": {"support_runs": 9, "support_principals": 9}})
	d.action == "deny"
}

test_a_rule_consolidated_from_tool_output_is_denied if {
	d := memory.decision with input as object.union(rule, {"source": {"kind": "consolidation", "trust": "untrusted", "origin": "tool"}, "provenance": {"support_runs": 9, "support_principals": 9}})
	d.action == "deny"
}

test_the_principal_threshold_is_policy if {
	d := memory.decision with input as object.union(rule, {"provenance": {"support_runs": 3, "support_principals": 2}}) with data.config.memory.procedural.min_support_principals as 3
	d.action == "hold"
}

person := {"tenant": "acme", "subject": "operator", "subject_kind": "operator", "actors": [], "scopes": ["memory:approve"]}

test_a_person_in_their_own_name_may_assert_trust_and_approve if {
	w := memory.writer with input as person
	w.assert_trust
	w.approve
	w.principal == "operator"
}

test_a_person_without_the_scope_or_through_an_agent_may_not_assert_trust if {
	not memory.writer.assert_trust with input as object.union(person, {"scopes": ["memory:write"]})
	through := memory.writer with input as object.union(person, {"actors": ["researcher", "worker-1"]})
	not through.assert_trust
	not through.approve
	through.principal == "operator" # the person's support still counts, once
	through.reasons == ["operator (operator) may not assert trust: only a person in their own name, with memory:approve"]
}

test_agents_services_and_partners_never_assert_trust if {
	some kind in ["specialist", "worker", "coordinator", "mcp_server", "external", ""]
	w := memory.writer with input as object.union(person, {"subject": "x", "subject_kind": kind})
	not w.assert_trust
}

test_a_service_subject_counts_for_no_support if {
	w := memory.writer with input as {"tenant": "acme", "subject": "worker-2", "subject_kind": "worker", "actors": ["researcher"], "scopes": []}
	w.principal == null
	unknown := memory.writer with input as {"tenant": "acme", "subject": "someone", "subject_kind": "", "actors": [], "scopes": []}
	unknown.principal == null
}

test_the_users_of_one_outside_issuer_are_one_principal if {
	alice := memory.writer with input as {"tenant": "acme", "subject": "partner:alice", "subject_kind": "external", "actors": ["coordinator"], "scopes": []}
	bob := memory.writer with input as {"tenant": "acme", "subject": "partner:bob", "subject_kind": "external", "actors": ["coordinator"], "scopes": []}
	alice.principal == "partner:*"
	bob.principal == alice.principal
}
