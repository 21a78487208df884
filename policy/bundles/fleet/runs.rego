# Runs are owned: how far a principal reaches among its tenant's runs, for one kind of action.
#
# fleet.runs.access. Input:
#   {action, principal: {sub, tenant, scopes: [..], actors: [..]}}
#   action is one of
#     read     GetTask, ListTasks, SubscribeToTask and its resubscribe, A2A follow-ups, the run API's
#              list, run, events (SSE), signals, operations and debug bundle
#     push     A2A push-notification configs (set, get, list, delete)
#     cancel   CancelTask, a cancel signal (run API, console, CLI, NATS)
#     answer   approve, reject, input, extend: an answer to what a run waits for
#     resolve  a person's verdict on an operation, or a decision on a spent budget
#   principal is the verified token's subject in its tenant: for an exchanged token the original
#   subject (the act chain names who acts for it; it does not make the runs anyone else's), for an
#   outside issuer's token the mapped subject (e.g. partner:alice).
# Result: {allow, reasons, reach, owner}
#   reach "own": only the runs whose owner is principal.sub (owner names it, for the data layer's
#   SQL filter); reach "tenant": every run of the principal's tenant (owner is ""), for holders of
#   a scope that data.config.runs.tenant_reach lists for the action (the tenant-admin scope, and
#   for answer/cancel/resolve the scopes that already gate those actions: fleet.approvals.decision
#   and the resolve scope then decide what such a holder may do to a run it did not start).
#   A run out of reach is not found: the same answer as a run that does not exist.
package fleet.runs

cfg := data.config.runs

actions := {"read", "push", "cancel", "answer", "resolve"}

deny contains msg if {
	not input.action in actions
	msg := sprintf("unknown run action %v", [input.action])
}

deny contains "a run principal needs a subject" if object.get(input.principal, "sub", "") == ""

deny contains msg if {
	tenant := object.get(input.principal, "tenant", "")
	not valid_tenant(tenant)
	msg := sprintf("a run principal needs one tenant, not %v", [tenant])
}

valid_tenant(tenant) if {
	is_string(tenant)
	tenant != ""
	tenant != "*"
}

tenant_wide if {
	some scope in input.principal.scopes
	scope in object.get(cfg.tenant_reach, input.action, [])
}

reach := "tenant" if tenant_wide

else := "own"

owner := "" if reach == "tenant"

else := input.principal.sub

access := {"allow": count(deny) == 0, "reasons": sort(deny), "reach": reach, "owner": owner}
