package fleet.limits.fetch_test

import data.fleet.limits.fetch

card(host, agent) := {"purpose": "card", "scheme": "https", "host": host, "port": 8080, "local": false, "agent": agent}

test_a_card_on_its_agents_own_host_is_allowed_on_internal_addresses if {
	d := fetch.decision with input as card("researcher.fleet.svc", {"id": "researcher", "external": false})
	d.allow
	d.private_ok
	d.max_bytes == data.config.limits.fetch.purposes.card.max_bytes
}

test_a_card_on_another_host_is_refused if {
	d := fetch.decision with input as card("10.0.0.5", {"id": "researcher", "external": false})
	not d.allow
}

test_a_host_named_like_the_agent_is_not_its_own if {
	d := fetch.decision with input as card("researcher-evil.example", {"id": "researcher", "external": false})
	not d.allow
}

test_an_external_agents_card_is_allowed_on_public_addresses_only if {
	d := fetch.decision with input as card("partner.example", {"id": "partner", "external": true})
	d.allow
	not d.private_ok
}

test_an_allowed_host_and_port_may_be_internal if {
	d := fetch.decision with input as card("10.0.0.5", {"id": "researcher", "external": false})
		with data.config.limits.fetch.default.allowed_hosts as ["10.0.0.5:8080"]
	d.allow
	d.private_ok
}

test_the_local_stack_fetches_cards_on_loopback if {
	d := fetch.decision with input as object.union(card("127.0.0.1", {"id": "researcher", "external": false}), {"local": true})
	d.allow
	d.private_ok
}

test_a_webhook_is_public_only_unless_listed if {
	d := fetch.decision with input as {"purpose": "webhook", "scheme": "https", "host": "127.0.0.1", "port": 8181, "local": false}
	d.allow
	not d.private_ok
	d.max_bytes == data.config.limits.fetch.default.max_bytes
}

test_a_scheme_not_listed_is_refused if {
	d := fetch.decision with input as {"purpose": "token_endpoint", "scheme": "ftp", "host": "a.example", "port": 21, "local": false}
	not d.allow
}

test_an_unknown_purpose_is_refused if {
	d := fetch.decision with input as {"purpose": "anything", "scheme": "https", "host": "a.example", "port": 443, "local": false}
	not d.allow
}

test_a_limit_that_is_not_positive_refuses_every_fetch if {
	d := fetch.decision with input as {"purpose": "webhook", "scheme": "https", "host": "a.example", "port": 443, "local": false}
		with data.config.limits.fetch.purposes.webhook as {"deadline_s": 0}
	not d.allow
}
