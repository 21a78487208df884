# Approvals: who may answer what a paused run waits for, and how long a wait may last.
#
# fleet.approvals.decision. Input:
#   {action, tenant, signer: {sub, tenant, scopes}, run: {owner}, wait: {type, skill, step, escalated}}
#   action is approve, reject, input, extend or cancel. The signer is the verified token's subject;
#   it needs the scope runs:approve, must be of the run's tenant, and must match a rule of
#   data.config.approvals.approvers: tenants, skills, subjects (each a list, "*" for any), actions,
#   and optionally escalated_only (only once the wait was escalated) and distinct_from_requester
#   (four eyes: whoever started the run may not answer it). One exception: with
#   data.config.approvals.owner_may_cancel, whoever started a run may cancel it (the run's owner,
#   input.run.owner, is the signer) without runs:approve or an approver rule. Every cancel path
#   (A2A CancelTask, the run API, the console, the CLI, NATS) asks this same decision.
#   Which runs a signer reaches at all is fleet.runs.access's decision (runs.rego), asked first.
#
# fleet.approvals.deadlines. Input: {tenant}. The deadline of a gate's wait, fixed when the run
#   starts: data.config.approvals.deadlines.default, overridden per tenant (tenants) and then per
#   skill (skills, within the tenant's): timeout_s, warn_before_s (a warning event this long before
#   the deadline), on_expired ("expire": the run ends approval_expired; "escalate": the wait is
#   escalated for escalate_for_s more, to the escalation approvers, and expires after that).
#
# fleet.approvals.auto. Input: {tenant, server, tool, arguments, facts}. Whether policy approves a
#   gated tool call (one whose tool answered pending_approval) without a person. facts are what the
#   coordinator computed from its own record of the run, never a caller's or a step's input:
#   anomaly_score, the highest score the run's scoring step recorded for the very artifact the call
#   publishes (absent when no step of the run scored it). A call is approved here only under a
#   threshold rule of data.config.tools (approval_over_score) with a computed score at or under it,
#   and never for a tool that says approval_always; anything else waits for a person.
package fleet.approvals

APPROVE_SCOPE := "runs:approve"

# The actions a signal may ask: generated from the code (fleet.vocabulary.SignalAction) into
# vocabulary/data.json by `python -m policy.vocabulary`.
actions := {action | some action in data.vocabulary.signal_actions}

any_or(list, value) if "*" in list

any_or(list, value) if value in list

rule_matches(rule) if {
	any_or(rule.tenants, input.tenant)
	any_or(rule.skills, object.get(input.wait, "skill", ""))
	any_or(rule.subjects, input.signer.sub)
	input.action in rule.actions
	not escalation_pending(rule)
	not self_answer(rule)
}

escalation_pending(rule) if {
	object.get(rule, "escalated_only", false) == true
	object.get(input.wait, "escalated", false) != true
}

self_answer(rule) if {
	object.get(rule, "distinct_from_requester", false) == true
	input.signer.sub == input.run.owner
}

deny contains msg if {
	not input.action in actions
	msg := sprintf("unknown action %v", [input.action])
}

deny contains "the signer belongs to another tenant" if input.signer.tenant != input.tenant

# The owner's own cancel: a principal may always stop what it started, if the config says so.
owner_cancel if {
	input.action == "cancel"
	object.get(data.config.approvals, "owner_may_cancel", false) == true
	input.signer.sub == input.run.owner
}

deny contains msg if {
	not owner_cancel
	not APPROVE_SCOPE in input.signer.scopes
	msg := sprintf("answering a run needs scope %s", [APPROVE_SCOPE])
}

deny contains msg if {
	input.action in actions
	not owner_cancel
	not any_rule_matches
	msg := sprintf("%s may not %s %v of skill %v", [input.signer.sub, input.action, object.get(input.wait, "type", "a wait"), object.get(input.wait, "skill", "")])
}

any_rule_matches if {
	some rule in data.config.approvals.approvers
	rule_matches(rule)
}

decision := {"allow": count(deny) == 0, "reasons": sort(deny)}

tenant_deadlines := object.get(object.get(data.config.approvals.deadlines, "tenants", {}), input.tenant, {})

base_deadline := object.union(data.config.approvals.deadlines.default, object.remove(tenant_deadlines, {"skills"}))

skill_deadlines := object.union(
	object.get(data.config.approvals.deadlines, "skills", {}),
	object.get(tenant_deadlines, "skills", {}),
)

deadline_problems contains msg if {
	some name, d in object.union({"default": base_deadline}, skill_deadlines)
	some key in ["timeout_s", "warn_before_s", "escalate_for_s"]
	not object.get(object.union(base_deadline, d), key, 0) >= 0
	msg := sprintf("approvals deadline %s: %s must be a number >= 0", [name, key])
}

deadline_problems contains msg if {
	some name, d in object.union({"default": base_deadline}, skill_deadlines)
	not object.get(object.union(base_deadline, d), "on_expired", "") in {"expire", "escalate"}
	msg := sprintf("approvals deadline %s: on_expired must be expire or escalate", [name])
}

deadlines := {
	"allow": count(deadline_problems) == 0,
	"reasons": sort(deadline_problems),
	"default": base_deadline,
	"skills": {name: object.union(base_deadline, d) | some name, d in skill_deadlines},
}

tool_rule := data.config.tools[input.server][input.tool]

auto_approves if {
	threshold := tool_rule.approval_over_score
	is_number(input.facts.anomaly_score)
	input.facts.anomaly_score <= threshold
	not object.get(tool_rule, "approval_always", false) == true
}

auto_reasons contains msg if {
	auto_approves
	msg := sprintf("the computed anomaly score %v is at most %v", [input.facts.anomaly_score, tool_rule.approval_over_score])
}

auto_reasons contains "no step of the run computed a score for it: a person decides" if {
	tool_rule.approval_over_score
	not is_number(object.get(object.get(input, "facts", {}), "anomaly_score", null))
}

auto_reasons contains msg if {
	threshold := tool_rule.approval_over_score
	input.facts.anomaly_score > threshold
	msg := sprintf("the computed anomaly score %v is over %v: a person decides", [input.facts.anomaly_score, threshold])
}

auto := {"allow": auto_approves, "reasons": sort(auto_reasons)}

default auto_approves := false
