package fleet.triggers_test

import data.fleet.triggers

rules := [
	{"name": "nightly", "subject": "fleet.events.invoices.>", "type": "invoices.closed", "steps": [{"id": "a", "skill": "x"}]},
	{"name": "one-token", "subject": "fleet.events.*.ping", "tenants": ["acme"], "steps": [{"id": "p", "skill": "y"}]},
]

test_a_matching_event_gets_its_rule_template if {
	d := triggers.decision with input as {"subject": "fleet.events.invoices.eu.closed", "type": "invoices.closed", "tenant": "acme", "data": {}}
		with data.config.triggers as rules
	d.rule == "nightly"
	d.run.steps[0].skill == "x"
	d.run.priority == 0
}

test_the_type_must_match_when_a_rule_names_one if {
	d := triggers.decision with input as {"subject": "fleet.events.invoices.closed", "type": "invoices.opened", "tenant": "acme", "data": {}}
		with data.config.triggers as rules
	d.run == null
}

test_star_is_one_token_and_tenants_restrict if {
	one := triggers.decision with input as {"subject": "fleet.events.hr.ping", "type": "t", "tenant": "acme", "data": {}}
		with data.config.triggers as rules
	one.rule == "one-token"
	deeper := triggers.decision with input as {"subject": "fleet.events.hr.x.ping", "type": "t", "tenant": "acme", "data": {}}
		with data.config.triggers as rules
	deeper.run == null
	other := triggers.decision with input as {"subject": "fleet.events.hr.ping", "type": "t", "tenant": "globex", "data": {}}
		with data.config.triggers as rules
	other.run == null
}

test_a_close_subject_names_the_batch_rule_it_closes if {
	batch_rules := [{"name": "nightly", "subject": "fleet.events.invoices.received", "batch": {"window_s": 86400, "close_after_s": 60, "close_subject": "fleet.events.invoices.export_done"}, "steps": []}]
	d := triggers.decision with input as {"subject": "fleet.events.invoices.export_done", "type": "t", "tenant": "acme", "data": {}}
		with data.config.triggers as batch_rules
	d.run == null
	d.closes[0].rule == "nightly"
	item := triggers.decision with input as {"subject": "fleet.events.invoices.received", "type": "t", "tenant": "acme", "data": {}}
		with data.config.triggers as batch_rules
	item.run.batch.window_s == 86400
	item.closes == []
}

test_sources_restrict_like_tenants if {
	src_rules := [{"name": "erp-only", "subject": "fleet.events.invoices.closed", "sources": ["erp"], "tenants": ["acme"], "steps": []}]
	erp := triggers.decision with input as {"subject": "fleet.events.invoices.closed", "type": "t", "source": "erp", "tenant": "acme", "data": {}}
		with data.config.triggers as src_rules
	erp.rule == "erp-only"
	crm := triggers.decision with input as {"subject": "fleet.events.invoices.closed", "type": "t", "source": "crm", "tenant": "acme", "data": {}}
		with data.config.triggers as src_rules
	crm.run == null
	batch_rules := [{"name": "nightly", "subject": "fleet.events.invoices.received", "sources": ["erp"], "batch": {"window_s": 60, "close_subject": "fleet.events.invoices.export_done"}, "steps": []}]
	close_crm := triggers.decision with input as {"subject": "fleet.events.invoices.export_done", "type": "t", "source": "crm", "tenant": "acme", "data": {}}
		with data.config.triggers as batch_rules
	close_crm.closes == []
}
