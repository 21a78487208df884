// An event producer outside the fleet, in Node with nats.js (npm install nats@2): it connects with the
// nkey seed `fleet producers issue` wrote, replies come to its own inbox, and it publishes one event
// on its tenant's and source's subject, as a CloudEvents structured-mode envelope.
//
//   node producer.mjs NATS_URL SEED_FILE PRODUCER_ID SUBJECT EVENT_ID [CA_FILE]
//   node producer.mjs nats://127.0.0.1:4222 billing.nk billing-acme \
//        fleet.events.acme.billing.invoices.closed inv-2031
import { readFileSync } from "node:fs";
import { connect, headers, nkeyAuthenticator } from "nats";

const [url, seedFile, producer, subject, eventId, caFile] = process.argv.slice(2);
const seed = new TextEncoder().encode(readFileSync(seedFile, "utf8").trim());
const nc = await connect({
  servers: url,
  authenticator: nkeyAuthenticator(seed),
  inboxPrefix: `_INBOX.${producer}`, // the only subjects it may subscribe to
  ...(caFile ? { tls: { caFile } } : {}),
});
const envelope = {
  specversion: "1.0",
  id: eventId,
  type: "invoices.closed",
  time: new Date().toISOString(),
  data: { from: "node" },
};
const h = headers();
h.set("Nats-Msg-Id", eventId);
const ack = await nc.jetstream().publish(subject, new TextEncoder().encode(JSON.stringify(envelope)), {
  headers: h,
});
console.log(JSON.stringify({ stream: ack.stream, seq: ack.seq, duplicate: ack.duplicate }));
await nc.close();
