package fleet.egress_test

import data.fleet.egress

grant := {"tenant": "acme", "agent": "partner-check", "skills": ["fraud-score"], "fields": ["invoice_id", "amount_cents", "customer_email", "lines[].amount_cents", "customer"]}

step := {
	"tenant": "acme",
	"agent": {"id": "partner-check", "url": "https://partner.example"},
	"skill": "fraud-score",
	"fields": ["amount_cents", "customer", "customer_email", "invoice_id", "lines", "note"],
	"paths": [
		"amount_cents", "customer.address.city", "customer.email", "customer.segment", "customer_email",
		"invoice_id", "lines[].amount_cents", "lines[].sku", "note",
	],
}

test_nothing_leaves_without_a_grant if {
	d := egress.decision with input as step
	not d.allow
	d.reasons == ["no egress grant lets tenant acme send skill fraud-score to partner-check (config.egress.grants)"]
	d.send == []
}

test_only_named_fields_leave_at_any_depth if {
	d := egress.decision with input as step with data.config.egress.grants as [grant]
	d.allow
	d.send == ["amount_cents", "customer.segment", "invoice_id", "lines[].amount_cents"]
	d.withhold == ["customer.address.city", "customer.email", "customer_email", "lines[].sku", "note"]
}

test_a_grant_names_tenant_agent_and_skill_exactly if {
	other_tenant := egress.decision with input as object.union(step, {"tenant": "globex"}) with data.config.egress.grants as [grant]
	not other_tenant.allow
	other_agent := egress.decision with input as object.union(step, {"agent": {"id": "partner-other", "url": "x"}}) with data.config.egress.grants as [grant]
	not other_agent.allow
	other_skill := egress.decision with input as object.union(step, {"skill": "reconcile-invoices"}) with data.config.egress.grants as [grant]
	not other_skill.allow
}

test_a_named_field_does_not_cover_a_longer_key_with_its_name_as_prefix if {
	narrow := object.union(grant, {"fields": ["customer"]})
	d := egress.decision with input as object.union(step, {"paths": ["customer.segment", "customer_email", "customers.name"]}) with data.config.egress.grants as [narrow]
	d.send == ["customer.segment"]
}

test_a_tenant_kept_inside_sends_nothing if {
	d := egress.decision with input as step with data.config.egress.grants as [grant] with data.config.egress.tenants_kept_inside as ["acme"]
	not d.allow
	d.reasons == ["tenant acme keeps its data inside the fleet"]
}

test_a_tenant_withholds_more_of_its_own if {
	more := {"acme": {"withhold": ["segment"]}}
	d := egress.decision with input as step with data.config.egress.grants as [grant] with data.config.egress.tenants as more
	d.send == ["amount_cents", "invoice_id", "lines[].amount_cents"]
}

test_an_agent_limited_to_some_tenants if {
	limited := {"partner-check": {"tenants": ["globex"]}}
	d := egress.decision with input as step with data.config.egress.grants as [grant] with data.config.egress.agents as limited
	d.reasons == ["partner-check is not an agent tenant acme may send to"]
}

test_answers_are_not_acted_on_unless_the_agent_is_trusted if {
	reply := object.union(step, {"fields": ["score"], "size": 40})
	a := egress.answer with input as reply
	a.allow
	not a.act
	trusted := egress.answer with input as reply with data.config.egress.agents as {"partner-check": {"act_on_answers": true}}
	trusted.act
}

test_an_oversized_answer_is_refused if {
	a := egress.answer with input as object.union(step, {"fields": ["blob"], "size": 10000000})
	not a.allow
}
