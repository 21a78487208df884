# Long-term memory: what may be written to each tier, and what may be read.
#
# data.fleet.memory.writer, input: {tenant, subject, subject_kind, actors: [..], scopes: [..]} (the
#   caller's verified token: who it is for, the registry kind of that principal, who passes it on,
#   nearest first): what this caller's writes are worth. Answers "assert_trust" (its text may be
#   trusted: a person writing in their own name, never an agent, a model or a partner),
#   "principal" (the key its support counts under for procedural rules, or null: it counts for
#   none), and "approve" (it may approve held entries). The memory server asks it on every write
#   and approval and never takes "source" or "trust" from arguments beyond what it allows.
# data.fleet.memory.decision, input: {tenant, agent, tier, source: {kind, trust: "trusted" |
#   "untrusted", origin (a consolidated entry's: the source of the episode it came from)}, provenance: {run_id, support_runs: n (distinct runs that support the entry),
#   support_principals: n (distinct principals behind them, as fleet.memory.writer keys them),
#   approved: bool (a person approved it)}, findings: [{type, score}] (what the PII and secret
#   scanners found in the text)}. Answers "action":
#   - "deny": nothing is written (a secret, PII where the tenant allows none, an unknown tier,
#     a procedural rule that only untrusted tool or outside-agent output supports);
#   - "hold": nothing is written yet: a procedural rule needs support from more runs and more
#     distinct principals, or a person's approval (the writer pauses for one);
#   - "redact": written with the "redact" finding types replaced;
#   - "allow": written as it is.
#   "allow" is true for "redact" and "allow".
# data.fleet.memory.read, input: {tenant, agent, tier}: may the agent read that tier for the tenant.
#
# data.config.memory: tiers; deny (finding types never stored); redact (finding types replaced);
# min_score (findings below it are ignored; presidio scores a valid phone number 0.4 and an SSN 0.5
# without context words); procedural.min_support_runs, procedural.min_support_principals,
# procedural.denied_sources (untrusted sources that never make a rule), procedural.support_kinds (the
# principal kinds whose support counts); trust.assert_kinds, trust.assert_scope (who may assert
# "trusted": a person's kind and scope, in their own name); retention.<tier> (seconds or null); tenants.<tenant>:
# deny_pii_in (tiers that take no PII at all: a finding to redact there denies instead), retention,
# readers (by agent: the tiers it may read; "*" for any agent).
package fleet.memory

cfg := data.config.memory

tenant_cfg := object.get(cfg.tenants, input.tenant, {})

# A finding that gives no score counts as certain.
found contains f.type if {
	some f in input.findings
	object.get(f, "score", 1) >= cfg.min_score
}

secrets := {t | some t in found; t in cfg.deny}

pii := {t | some t in found; t in cfg.redact}

procedural if input.tier == "procedural"

approved if input.provenance.approved == true

deny contains msg if {
	not input.tier in cfg.tiers
	msg := sprintf("%v is not a memory tier", [input.tier])
}

# Without the scanners' findings nothing is known of the text: nothing is written.
deny contains "the text was not scanned (findings must be a list)" if {
	not is_array(input.findings)
}

deny contains msg if {
	count(secrets) > 0
	msg := sprintf("secrets are never stored (%s)", [concat(", ", sort(secrets))])
}

deny contains msg if {
	count(pii) > 0
	input.tier in object.get(tenant_cfg, "deny_pii_in", [])
	msg := sprintf("tenant %s keeps personal data out of %s memory (%s)", [input.tenant, input.tier, concat(", ", sort(pii))])
}

untrusted if object.get(input.source, "trust", "untrusted") != "trusted"

deny contains msg if {
	procedural
	not approved
	untrusted
	some kind in [object.get(input.source, "kind", ""), object.get(input.source, "origin", "")]
	kind in cfg.procedural.denied_sources
	msg := "a procedural rule never comes from untrusted tool output alone"
}

support_runs := object.get(input.provenance, "support_runs", 0)

support_principals := object.get(input.provenance, "support_principals", 0)

hold contains msg if {
	procedural
	not approved
	support_runs < cfg.procedural.min_support_runs
	msg := sprintf("a procedural rule needs support from %d runs (has %d) or a person's approval", [cfg.procedural.min_support_runs, support_runs])
}

# Runs are cheap: one caller makes as many as it likes. What it says must be said by others too
# (distinct principals, as fleet.memory.writer keys them), unless it is trusted (a person wrote it).
hold contains msg if {
	procedural
	not approved
	untrusted
	support_principals < cfg.procedural.min_support_principals
	msg := sprintf("a procedural rule needs support from %d distinct principals (has %d) or a person's approval", [cfg.procedural.min_support_principals, support_principals])
}

action := "deny" if count(deny) > 0

else := "hold" if count(hold) > 0

else := "redact" if count(pii) > 0

else := "allow"

# A denial gives its own reasons; a hold gives what it waits for.
reasons := sort(deny) if count(deny) > 0

else := sort(hold)

decision := {
	"allow": action in {"allow", "redact"},
	"action": action,
	"redact": sort(pii),
	"reasons": reasons,
}

readers := object.get(tenant_cfg, "readers", cfg.readers)

read_deny contains msg if {
	not input.tier in object.get(readers, input.agent, object.get(readers, "*", []))
	msg := sprintf("%s may not read %s memory of tenant %s", [input.agent, input.tier, input.tenant])
}

read := {"allow": count(read_deny) == 0, "reasons": sort(read_deny)}

# data.fleet.memory.retention, input: {tenant, tier}: how long an entry of that tier is kept
# ({"max_age_s": seconds}, or null: until it is forgotten). The tenant's own setting, else the default.
retention := {"allow": true, "max_age_s": object.get(object.get(tenant_cfg, "retention", {}), input.tier, object.get(cfg.retention, input.tier, null))}

# ------------------------------------------------------------------------------------ writers
# Who the caller is, from its verified token (fleet.memory.writer; see the head of this file).
# Trusted text is what a person asserts in their own name (their kind, their scope, no actor between
# them and the server: an agent acting for a person is an agent, and a model's words are a model's).
writer_direct if count(input.actors) == 0

assert_trust if {
	input.subject_kind in cfg.trust.assert_kinds
	cfg.trust.assert_scope in input.scopes
	writer_direct
}

# An outside issuer names its own users: all of them are one principal (the issuer), so a partner
# cannot make up the support of many. A fleet service (a worker for a trigger's run, an agent in its
# own name) is no principal whose support counts: its words come from events, tools or callers.
principal_key := sprintf("%s:*", [split(input.subject, ":")[0]]) if {
	input.subject_kind == "external"
	contains(input.subject, ":")
} else := input.subject

writer_principal := principal_key if input.subject_kind in cfg.procedural.support_kinds

else := null

writer := {
	"allow": true,
	"assert_trust": assert_trust,
	"approve": assert_trust,
	"principal": writer_principal,
	"reasons": writer_reasons,
}

default assert_trust := false

writer_reasons := [] if assert_trust

else := [sprintf("%s (%s) may not assert trust: only a person in their own name, with %s", [input.subject, input.subject_kind, cfg.trust.assert_scope])]
