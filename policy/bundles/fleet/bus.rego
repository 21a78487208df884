# The bus: what each connection may publish and subscribe to on NATS.
#
# The registry asks this when a connection presents valid credentials (its authorization callout),
# and the server enforces the answer for as long as the connection lives. Deny by default: a
# connection gets exactly the subjects its role needs, its own inbox, and nothing else.
#
# Input: {principal: {type: "identity" | "producer",
#                     id, token,          the id, and the id as one subject token
#                     inbox,              the inbox prefix its client must use (_INBOX.<token>)
#                     kind,               an identity's kind (registry, coordinator, worker,
#                                         specialist, mcp_server, console, operator); "producer"
#                     tenants, tenant_tokens, scopes, external,
#                     sources}}           a producer's sources (subject tokens)
#
# How nats-py reaches JetStream (nats-py 2.16, nats-server 2.x): every JetStream call is a request
# on $JS.API.<...> answered in the caller's inbox; a KV get is $JS.API.STREAM.MSG.GET.KV_<bucket>;
# a put is $KV.<bucket>.<key>; an ordered consumer is created with $JS.API.CONSUMER.CREATE.<stream>
# (after $JS.API.STREAM.NAMES) and acknowledges flow control on $JS.FC.<stream>.>; a durable pull
# consumer is $JS.API.CONSUMER.{INFO,CREATE,MSG.NEXT}.<stream>.<durable>[...] and $JS.ACK.<stream>.<durable>.>.
# Nobody may create, change, purge or delete a stream (the bootstrap identity provisions them).
package fleet.bus

cfg := data.config.bus

p := input.principal

# ------------------------------------------------------------------------------------ fragments
inbox_sub := {sprintf("%s.>", [p.inbox])}

# Following the revocations (every fleet service).
revocations := {
	"$JS.API.STREAM.INFO.KV_fleet-revocations",
	"$JS.API.STREAM.NAMES",
	"$JS.API.CONSUMER.CREATE.KV_fleet-revocations",
	"$JS.FC.KV_fleet-revocations.>",
}

# Enforcing policy: following pushes, reporting status, the decision log and the metrics' history
# (its own subjects only).
enforcing := {
	"$JS.API.STREAM.INFO.FLEET_DECISIONS",
	sprintf("fleet.decisions.%s", [p.token]),
	"$JS.API.STREAM.INFO.FLEET_METRICS",
	sprintf("fleet.metrics.%s", [p.token]),
	"$JS.API.STREAM.INFO.KV_fleet-policy",
	"$JS.API.STREAM.MSG.GET.KV_fleet-policy",
	"$JS.API.STREAM.NAMES",
	"$JS.API.CONSUMER.CREATE.KV_fleet-policy",
	"$JS.FC.KV_fleet-policy.>",
	"$JS.API.STREAM.INFO.KV_fleet-policy-status",
	sprintf("$KV.fleet-policy-status.%s", [p.token]),
}

# Reading a stream with ordered consumers.
reading(stream) := {
	sprintf("$JS.API.STREAM.INFO.%s", [stream]),
	"$JS.API.STREAM.NAMES",
	sprintf("$JS.API.CONSUMER.CREATE.%s", [stream]),
	sprintf("$JS.FC.%s.>", [stream]),
}

# Reading a KV bucket (gets; the key is in the request body, so it is all of the bucket).
kv_reading(bucket) := {
	sprintf("$JS.API.STREAM.INFO.KV_%s", [bucket]),
	sprintf("$JS.API.STREAM.MSG.GET.KV_%s", [bucket]),
}

kv_writing(bucket) := kv_reading(bucket) | {sprintf("$KV.%s.>", [bucket])}

# A durable pull consumer its role owns (created on first use with the role's settings).
pulling(stream, durable) := {
	sprintf("$JS.API.STREAM.INFO.%s", [stream]),
	"$JS.API.STREAM.NAMES",
	sprintf("$JS.API.CONSUMER.INFO.%s.%s", [stream, durable]),
	sprintf("$JS.API.CONSUMER.CREATE.%s.%s.>", [stream, durable]),
	sprintf("$JS.API.CONSUMER.MSG.NEXT.%s.%s", [stream, durable]),
	sprintf("$JS.ACK.%s.%s.>", [stream, durable]),
}

# ------------------------------------------------------------------------------------ roles
coordinator_pub := ((((revocations | enforcing) | pulling("FLEET_EVENTS", "triggers")) | pulling("FLEET_SIGNALS", "signals")) | {
	"$JS.API.STREAM.INFO.FLEET_WORK",
	"$JS.API.CONSUMER.INFO.FLEET_WORK.run-workers",
	"$JS.API.CONSUMER.LIST.FLEET_WORK", # the work queue gauges: every tenant's consumer
	"fleet.work.run",
	"fleet.work.run.*", # a tenant's work (coordinator/record/work.py)
	"$JS.API.STREAM.INFO.FLEET_DEAD_LETTERS",
	"fleet.dead.events",
	"fleet.dead.signals",
	"$JS.API.STREAM.INFO.FLEET_APPROVALS",
	"fleet.signal_outcomes.*",
	# a signal that arrived with a bearer token is erased (no stored message keeps a token)
	"$JS.API.STREAM.MSG.DELETE.FLEET_SIGNALS",
})

# The workers own every consumer of FLEET_WORK: run-workers and one per tenant (run-workers-<tenant>).
worker_pub := ((revocations | enforcing) | pulling("FLEET_WORK", "*")) | {
	"fleet.work.run",
	"fleet.work.run.*",
	"$JS.API.STREAM.INFO.FLEET_APPROVALS",
	"$JS.API.STREAM.INFO.FLEET_SIGNALS",
	"fleet.approvals.>",
}

specialist_pub := revocations

mcp_server_pub := (((revocations | enforcing) | kv_writing("fleet-run-tool-calls")) | {
	"$JS.API.STREAM.INFO.FLEET_AUDIT",
	sprintf("fleet.audit.tools.%s", [p.token]),
})

console_pub := (((((revocations | kv_writing("fleet-console-signouts")) | kv_reading("fleet-policy-status")) | reading("FLEET_DECISIONS")) | reading("FLEET_AUDIT")) | reading("FLEET_METRICS"))

# The operator's CLI: events for any tenant (it is the operator), policy pushes and rollbacks, the
# policy status and decision log, the memory audit, signals and approval requests.
operator_pub := ((((((kv_writing("fleet-policy") | kv_reading("fleet-policy-status")) | reading("FLEET_DECISIONS")) | reading("FLEET_AUDIT")) | reading("FLEET_APPROVALS")) | revocations) | {
	"$JS.API.STREAM.INFO.FLEET_EVENTS",
	"$JS.API.STREAM.INFO.FLEET_DEAD_LETTERS",
	"fleet.events.>",
	"$JS.API.STREAM.INFO.FLEET_SIGNALS",
	"fleet.signals.*",
})

pub := {
	"coordinator": coordinator_pub,
	"worker": worker_pub,
	"specialist": specialist_pub,
	"mcp_server": mcp_server_pub,
	"console": console_pub,
	"operator": operator_pub,
}

# Per MCP server: what its own tools keep on the bus.
server_extra := object.get(cfg.servers, p.id, {"artifacts": "none", "workspaces": false, "memory_audit": false})

# The artifacts bucket holds every tenant's objects: these rights reach all of them (a direct get
# reads any message, chunks included). Each object is sealed with its tenant's key, which the
# registry gives a server only with a caller's token of that tenant (fleet.tokens.tenant_key,
# fleet/tenant_keys.py): with these rights alone a server reads ciphertext and plants nothing.
artifacts_none := set()

artifacts_exists := {
	"$JS.API.STREAM.INFO.OBJ_fleet_artifacts",
	"$JS.API.STREAM.MSG.GET.OBJ_fleet_artifacts",
}

artifacts_read_write := reading("OBJ_fleet_artifacts") | {
	"$JS.API.STREAM.MSG.GET.OBJ_fleet_artifacts",
	"$O.fleet_artifacts.C.*",
	"$O.fleet_artifacts.M.*",
	"$JS.API.STREAM.PURGE.OBJ_fleet_artifacts",
}

artifacts_rights := {"none": artifacts_none, "exists": artifacts_exists, "read_write": artifacts_read_write}

server_rights := ((artifacts_rights[object.get(server_extra, "artifacts", "none")] | workspace_rights) | memory_audit_rights)

workspace_rights := kv_writing("fleet_sandbox_workspaces") if server_extra.workspaces == true

workspace_rights := set() if server_extra.workspaces != true

memory_audit_rights := {sprintf("fleet.audit.memory.%s", [p.token])} if server_extra.memory_audit == true

memory_audit_rights := set() if server_extra.memory_audit != true

# A producer: its tenant's events, as its own sources, nothing else.
producer_pub := {sprintf("fleet.events.%s.%s.>", [tenant, source]) |
	some tenant in p.tenant_tokens
	some source in p.sources
} | {"$JS.API.STREAM.INFO.FLEET_EVENTS", "$JS.API.STREAM.INFO.FLEET_DEAD_LETTERS"}

# ------------------------------------------------------------------------------------ the answer
identity_pub := pub[p.kind] | server_rights if p.kind == "mcp_server"

identity_pub := pub[p.kind] if {
	p.kind != "mcp_server"
	pub[p.kind]
}

publish := identity_pub if p.type == "identity"

publish := producer_pub if p.type == "producer"

# What a role follows besides its inbox: the operator, what its signals became; a worker, the work
# queue's subjects as a doorbell (coordinator/record/work.py WorkBell: an idle worker wakes when a run is
# submitted; it sees run ids, which it pulls anyway, and takes work only through its consumers).
follows := {
	"operator": {"fleet.signal_outcomes.*"},
	"worker": {"fleet.work.run", "fleet.work.run.*"},
}

subscribe := inbox_sub | object.get(follows, p.kind, set()) if p.type == "identity"

subscribe := inbox_sub if p.type != "identity"

deny contains msg if {
	p.type == "identity"
	not pub[p.kind]
	msg := sprintf("no bus role for %s identities", [p.kind])
}

deny contains "a producer has no tenant" if {
	p.type == "producer"
	count(p.tenant_tokens) != 1
}

deny contains "a producer has no source" if {
	p.type == "producer"
	count(p.sources) == 0
}

deny contains msg if {
	not p.type in {"identity", "producer"}
	msg := sprintf("unknown principal type %v", [p.type])
}

limits := object.get(cfg.limits, p.kind, cfg.limits["default"])

decision := {
	"allow": true,
	"reasons": [],
	"pub_allow": sort(publish),
	"pub_deny": [],
	"sub_allow": sort(subscribe),
	"sub_deny": [],
	"subs": limits.subs,
	"payload": limits.payload,
	"connections": limits.connections,
	"ttl_s": cfg.ttl_s,
} if count(deny) == 0

decision := {"allow": false, "reasons": sort(deny)} if count(deny) > 0
