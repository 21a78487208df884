package fleet.routing_test

import data.fleet.routing

test_invoice_outlier_request_routes_to_totals_then_outliers if {
	d := routing.decision with input as {"text": "Find outliers in this month's Invoices", "tenant": "acme"}
	d.allow
	[s.skill | some s in d.steps] == ["invoice-totals", "outliers"]
}

test_unmatched_request_is_not_routed if {
	d := routing.decision with input as {"text": "write me a poem", "tenant": "acme"}
	not d.allow
}

outside_step := {"tenant": "acme", "skill": "fraud-score", "agents": ["acme-partner", "zeta-partner"]}

test_no_outside_agent_is_routed_to_unless_the_tenant_names_it if {
	d := routing.outside with input as outside_step
	not d.allow
	d.agents == []
	d.reasons == ["tenant acme's policy names no agent outside the fleet for skill fraud-score (config.outside_agents)"]
}

test_the_outside_agents_a_tenant_names_are_routed_to_in_its_order if {
	named := {"acme": {"fraud-score": ["zeta-partner", "gone-partner", "acme-partner"]}}
	d := routing.outside with input as outside_step with data.config.outside_agents as named
	d.allow
	d.agents == ["zeta-partner", "acme-partner"]
}

test_one_tenants_outside_agents_are_not_anothers if {
	named := {"globex": {"fraud-score": ["acme-partner"]}}
	d := routing.outside with input as outside_step with data.config.outside_agents as named
	not d.allow
	by_skill := routing.outside with input as object.union(outside_step, {"skill": "reconcile-invoices"}) with data.config.outside_agents as {"acme": {"fraud-score": ["acme-partner"]}}
	not by_skill.allow
}
