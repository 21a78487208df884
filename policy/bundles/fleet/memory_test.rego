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
