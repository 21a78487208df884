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
