package fleet.registry_test

import data.fleet.registry

specialist := {"id": "sql-analyst", "kind": "specialist", "external": false}

partner := {"id": "acme-partner", "kind": "specialist", "external": true}

test_a_card_with_the_enrolled_skills_is_allowed if {
	d := registry.skills with input as {"identity": specialist, "enrolled": ["sql-query", "invoice-totals"], "claimed": ["sql-query"]}
	d.allow
	d.refused == []
}

test_an_internal_specialist_claiming_a_skill_not_bound_to_it_is_refused if {
	d := registry.skills with input as {"identity": specialist, "enrolled": ["sql-query"], "claimed": ["sql-query", "issue-refund"]}
	not d.allow
	d.refused == ["issue-refund"]
	d.reasons == ["sql-analyst may not offer skill issue-refund: neither its enrollment nor policy (config.registry.skills.identities) grants it"]
}

test_an_identity_enrolled_without_skills_offers_none if {
	d := registry.skills with input as {"identity": specialist, "enrolled": [], "claimed": ["echo"]}
	not d.allow
	d.refused == ["echo"]
}

test_a_partner_claiming_an_internal_skill_is_refused_even_if_enrolled_for_it if {
	d := registry.skills with input as {"identity": partner, "enrolled": ["fraud-score", "reconcile-invoices"], "claimed": ["fraud-score", "reconcile-invoices"]}
	not d.allow
	d.refused == ["reconcile-invoices"]
	d.reasons == ["skill reconcile-invoices is offered only inside the fleet, and acme-partner is an agent outside it"]
}

test_a_partner_squatting_unenrolled_internal_skills_is_refused_for_each if {
	d := registry.skills with input as {"identity": partner, "enrolled": ["fraud-score"], "claimed": ["fraud-score", "reconcile-invoices", "sql-query"]}
	not d.allow
	d.refused == ["reconcile-invoices", "sql-query"]
	count(d.reasons) == 4
}

test_policy_grants_a_partner_a_skill_its_enrollment_does_not_name if {
	claim := {"identity": partner, "enrolled": [], "claimed": ["fraud-score"]}
	not registry.skills.allow with input as claim
	granted := {"acme-partner": ["fraud-score"]}
	registry.skills.allow with input as claim with data.config.registry.skills.identities as granted
}

test_policy_cannot_open_an_internal_skill_to_a_partner if {
	claim := {"identity": partner, "enrolled": [], "claimed": ["issue-refund"]}
	d := registry.skills with input as claim with data.config.registry.skills.identities as {"acme-partner": ["issue-refund"]}
	not d.allow
	d.refused == ["issue-refund"]
}

test_an_internal_specialist_may_offer_an_internal_skill_it_is_enrolled_for if {
	d := registry.skills with input as {"identity": specialist, "enrolled": ["reconcile-invoices"], "claimed": ["reconcile-invoices"]}
	d.allow
}
