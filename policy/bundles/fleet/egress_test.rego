package fleet.egress_test

import data.fleet.egress

step := {"tenant": "acme", "agent": {"id": "partner-check", "url": "https://partner.example"}, "skill": "fraud-score", "fields": ["amount_cents", "customer_email", "invoice_id"]}

test_personal_fields_are_withheld if {
	d := egress.decision with input as step
	d.allow
	d.withhold == ["customer_email"]
}

test_a_tenant_kept_inside_sends_nothing if {
	d := egress.decision with input as step with data.config.egress.tenants_kept_inside as ["acme"]
	not d.allow
	d.reasons == ["tenant acme keeps its data inside the fleet"]
}

test_an_agent_limited_to_some_tenants if {
	limited := {"partner-check": {"tenants": ["globex"]}}
	d := egress.decision with input as step with data.config.egress.agents as limited
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
