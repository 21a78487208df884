package fleet.limits.streams_test

import data.fleet.limits.streams

test_defaults_apply_to_every_tenant if {
	d := streams.decision with input as {"tenant": "acme", "principal": "alice"}
	d.allow
	d.per_principal == data.config.limits.streams.per_principal
	d.per_tenant == data.config.limits.streams.per_tenant
	d.per_process == data.config.limits.streams.per_process
}

test_a_tenant_override_wins_and_keeps_the_rest if {
	d := streams.decision with input as {"tenant": "big", "principal": "alice"}
		with data.config.limits.streams.tenants as {"big": {"per_tenant": 500}}
	d.allow
	d.per_tenant == 500
	d.per_principal == data.config.limits.streams.per_principal
}

test_a_tenant_cannot_raise_the_process_cap if {
	d := streams.decision with input as {"tenant": "big", "principal": "alice"}
		with data.config.limits.streams.tenants as {"big": {"per_process": 1000000}}
	d.per_process == data.config.limits.streams.per_process
}

test_a_cap_below_one_is_refused if {
	d := streams.decision with input as {"tenant": "acme", "principal": "alice"}
		with data.config.limits.streams.tenants as {"acme": {"per_principal": 0}}
	not d.allow
	d.reasons == ["limits.streams.per_principal must be a number >= 1"]
}
