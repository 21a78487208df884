# Fair share between tenants on the fleet's shared paths. Input: {tenant}.
# data.config.limits.fair.<path>.default, overridden per tenant by .tenants.<tenant> (field by field).
#   memory_scan  the memory servers' scan threads: weight (scan jobs taken from the tenant's queue in a
#                row when its turn comes), max_queued_texts and max_queued_chars (texts, and their
#                characters, queued or being scanned for the tenant on one server), max_call_chars
#                (characters of one call's texts), max_threads (its share of the scan threads
#                while another tenant waits)
#   token_issue  tokens the token service issues for the tenant (each registry replica counts its
#                own): per_second, burst
#   event_ingest events of the tenant the trigger ingest takes (each coordinator counts its own):
#                per_second, burst; the rest wait their turn in the stream
#   work         the tenant's runs the workers advance at once, over the whole fleet: max_in_flight
#                while no other tenant has work, shared_in_flight (its share) while another has had
#                some in the last 10 s (its work consumer's max_ack_pending; the rest wait their
#                turn in the queue)
package fleet.limits.fair

limits(path) := object.union(
	data.config.limits.fair[path].default,
	object.get(object.get(data.config.limits.fair[path], "tenants", {}), input.tenant, {}),
)

memory_scan := object.union(limits("memory_scan"), {"allow": true})

token_issue := object.union(limits("token_issue"), {"allow": true})

event_ingest := object.union(limits("event_ingest"), {"allow": true})

work := object.union(limits("work"), {"allow": true})
