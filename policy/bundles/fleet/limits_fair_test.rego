package fleet.limits.fair_test

import data.fleet.limits.fair

test_a_tenant_gets_the_default_scan_quota if {
	q := fair.memory_scan with input as {"tenant": "acme"}
	q.allow
	q.weight == 1
	q.max_queued_chars == data.config.limits.fair.memory_scan.default.max_queued_chars
}

test_a_tenant_entry_overrides_the_default_field_by_field if {
	tenants := {"globex": {"weight": 3, "max_queued_texts": 10}}
	q := fair.memory_scan with input as {"tenant": "globex"} with data.config.limits.fair.memory_scan.tenants as tenants
	q.weight == 3
	q.max_queued_texts == 10
	q.max_call_chars == data.config.limits.fair.memory_scan.default.max_call_chars
	other := fair.memory_scan with input as {"tenant": "acme"} with data.config.limits.fair.memory_scan.tenants as tenants
	other.weight == 1
}

test_token_and_event_rates_come_per_tenant if {
	tenants := {"globex": {"per_second": 1}}
	t := fair.token_issue with input as {"tenant": "globex"} with data.config.limits.fair.token_issue.tenants as tenants
	t.allow
	t.per_second == 1
	t.burst == data.config.limits.fair.token_issue.default.burst
	e := fair.event_ingest with input as {"tenant": "acme"}
	e.per_second == data.config.limits.fair.event_ingest.default.per_second
}

test_a_tenant_runs_at_most_its_own_runs_in_flight if {
	tenants := {"globex": {"max_in_flight": 1}}
	w := fair.work with input as {"tenant": "globex"} with data.config.limits.fair.work.tenants as tenants
	w.allow
	w.max_in_flight == 1
	other := fair.work with input as {"tenant": "acme"} with data.config.limits.fair.work.tenants as tenants
	other.max_in_flight == data.config.limits.fair.work.default.max_in_flight
}

test_a_tenant_has_a_share_of_runs_in_flight_while_others_have_work if {
	tenants := {"globex": {"shared_in_flight": 2}}
	w := fair.work with input as {"tenant": "globex"} with data.config.limits.fair.work.tenants as tenants
	w.shared_in_flight == 2
	w.max_in_flight == data.config.limits.fair.work.default.max_in_flight
	other := fair.work with input as {"tenant": "acme"} with data.config.limits.fair.work.tenants as tenants
	other.shared_in_flight == data.config.limits.fair.work.default.shared_in_flight
	other.shared_in_flight <= other.max_in_flight
}
