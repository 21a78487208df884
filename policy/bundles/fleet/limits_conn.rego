# Streams: how many event streams (run API SSE, A2A SubscribeToTask, streaming and follow-up
# SendMessage) may be open at once in one coordinator process, per principal, per tenant and in all.
# Input: {tenant, principal}. data.config.limits.streams holds the defaults (per_principal,
# per_tenant, per_process, retry_after_s); data.config.limits.streams.tenants.<tenant> overrides
# per_principal and per_tenant for one tenant.
package fleet.limits.streams

cfg := data.config.limits.streams

tenant_caps := object.get(object.get(cfg, "tenants", {}), input.tenant, {})

caps := object.union(object.remove(cfg, {"tenants"}), tenant_caps)

deny contains msg if {
	some key in ["per_principal", "per_tenant", "per_process", "retry_after_s"]
	not caps[key] >= 1
	msg := sprintf("limits.streams.%s must be a number >= 1", [key])
}

decision := {
	"allow": count(deny) == 0,
	"reasons": sort(deny),
	"per_principal": caps.per_principal,
	"per_tenant": caps.per_tenant,
	"per_process": cfg.per_process,
	"retry_after_s": caps.retry_after_s,
}
