"""Generate tests/memory/pii_corpus.jsonl, the labelled corpus for the memory store's PII/secret write gate.

Run: .venv/bin/python tests/memory/make_pii_corpus.py
Each line is {"id", "category", "text", "sensitive", "expect"}: "sensitive" lists the exact substrings of
"text" that must never reach the store unredacted; "expect" is "pii", "secret" or "clean".

All values are synthetic. The script is deterministic (fixed seed) except for the private keys (and the
random salt of the encrypted one), which `cryptography` generates fresh on every run; JWTs are HMAC-signed
with a seeded secret, so they are reproducible. The committed jsonl, not a re-run of this script, is
therefore the source of truth. Luhn, IBAN mod-97 and SSN-range checks are assertions, and the whole corpus
is validated before it is written, so a regenerated corpus is always valid. Standard library + cryptography.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
import re
import string
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

# fmt: off
SEED = 20240917
OUT = Path(__file__).with_name("pii_corpus.jsonl")
rng = random.Random(SEED)
ALNUM = string.ascii_letters + string.digits
EXPECT = {"email": "pii", "phone": "pii", "card_valid": "pii", "iban": "pii", "ssn": "pii", "ip": "pii",
          "api_key": "secret", "jwt": "secret", "private_key": "secret", "password": "secret",
          "connection_string": "secret", "card_invalid_luhn": "clean", "clean": "clean"}
MINIMUM = {"email": 20, "phone": 20, "card_valid": 20, "card_invalid_luhn": 12, "iban": 15, "ssn": 15, "ip": 15,
           "api_key": 20, "jwt": 10, "private_key": 8, "password": 12, "connection_string": 12, "clean": 60}
IBAN_LENGTH = {"DE": 22, "GB": 22, "FR": 27, "NL": 18, "ES": 24, "IT": 27, "CH": 21, "BE": 16, "AT": 20, "PL": 28,
               "IE": 22, "LU": 20}
# fmt: on


def tok(n: int, alphabet: str = ALNUM) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


# --- checksums -----------------------------------------------------------------------------------------------


def luhn_ok(number: str) -> bool:
    digits = [int(c) for c in re.sub(r"\D", "", number)][::-1]
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(digits))
    return total % 10 == 0


def luhn_number(prefix: str, length: int) -> str:
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    return next(body + c for c in string.digits if luhn_ok(body + c))


def fmt_card(number: str, sep: str) -> str:
    groups = (4, 6, 5) if len(number) == 15 else (4,) * (len(number) // 4)
    parts, i = [], 0
    for g in groups:
        parts.append(number[i : i + g])
        i += g
    return sep.join(parts)


def iban_mod97(iban: str) -> int:
    s = iban.replace(" ", "")
    return int("".join(str(int(c, 36)) for c in s[4:] + s[:4])) % 97


def make_iban(cc: str, bban: str) -> str:
    check = 98 - iban_mod97(cc + "00" + bban)
    return f"{cc}{check:02d}{bban}"


def ssn_ok(ssn: str) -> bool:
    m = re.fullmatch(r"(\d{3})[- ](\d{2})[- ](\d{4})", ssn)
    if not m:
        return False
    area, group, serial = (int(x) for x in m.groups())
    known_bad = {
        "123456789",
        "078051120",
        "219099999",
    }  # the textbook example, Woolworth's wallet card, an ad
    return (
        0 < area < 900 and area != 666 and group > 0 and serial > 0 and "".join(m.groups()) not in known_bad
    )


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


JWT_SECRET = rng.randbytes(32)
PASSPHRASE = b"vendor-passphrase-2024"
HASHES = {"HS256": hashlib.sha256, "HS384": hashlib.sha384, "HS512": hashlib.sha512}


def make_jwt(header: dict[str, str], claims: dict[str, object]) -> str:
    head, body = (b64u(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims))
    signing_input = f"{head}.{body}"
    sig = hmac.new(JWT_SECRET, signing_input.encode(), HASHES[header["alg"]]).digest()
    return signing_input + "." + b64u(sig)


def gen_ssn() -> str:
    while True:
        area = rng.choice([a for a in range(1, 900) if a != 666])
        ssn = f"{area:03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}"
        if ssn_ok(ssn):
            return ssn


# --- value pools ---------------------------------------------------------------------------------------------

# fmt: off
EMAILS = ["maria.gonzalez@example.com", "j.smith+invoices@example.org", "ops-alerts@mail.example.com",
          "dana.whitfield@acme-corp.io", "k.okafor@globex-industries.co.uk", "LIAM.CHEN@EXAMPLE.COM",
          "billing_team@example.net", "r.patel1987@example.org", "anna-lena.schmidt@beispiel-firma.de",
          "noreply+ticket-44817@support.example.com", "t.nguyen@initech-solutions.com", "sam_o@example.io",
          "jorge.ramirez@contoso-logistics.mx", "a.kowalski@example.com", "devops@staging.example.org",
          "lucia.rossi@fornitori-example.it", "hr.payroll@umbrella-holdings.biz", "m.tanaka@example.jp",
          "ben.carter42@example.com", "s.ivanova@northwind-traders.eu"]
EXTRA_EMAILS = ["p.moreau@example.fr", "helpdesk@example.org", "e.lindqvist@fabrikam-nordic.se"]
PHONES = ["(415) 555-0132", "415-555-0198", "415.555.0147", "+1 415 555 0163", "+1-212-555-0184",
          "+1 (646) 555-0117", "1-800-555-0199", "4155550123", "+14155550176", "212.555.0102", "(312) 555-0190",
          "+44 20 7946 0958", "+49 30 901820", "+33 1 42 68 53 00", "+44 7700 900123", "+61 2 5550 4321",
          "+31 20 794 6035", "+34 912 345 678", "+81 3-4567-8901", "+353 1 555 0142", "+49 151 23456789",
          "+41 44 555 12 34"]
IPS = ["203.0.113.45", "198.51.100.17", "192.0.2.200", "2001:db8::1", "10.42.7.19", "81.17.24.103",
       "2001:db8:85a3::8a2e:370:7334", "172.16.254.3", "198.51.100.250", "fe80::1ff:fe23:4567:890a",
       "192.168.1.104", "203.0.113.7", "2001:0db8:0000:0042:0000:8a2e:0370:7334", "100.64.12.9",
       "185.40.4.211", "52.94.236.18"]
KNOWN_CARDS = ["4111111111111111", "4242424242424242", "4012888888881881", "5555555555554444",
               "5105105105105100", "2223003122003222", "378282246310005", "371449635398431",
               "6011111111111117", "6011000990139424", "4000056655665556", "5200828282828210"]
GENERATED_CARDS = [luhn_number(p, n) for p, n in [("4", 16), ("4", 16), ("51", 16), ("53", 16), ("2720", 16),
                                                   ("34", 15), ("37", 15), ("6011", 16), ("65", 16), ("644", 16)]]
KNOWN_IBANS = ["DE89370400440532013000", "GB82WEST12345698765432", "FR1420041010050500013M02606",
               "NL91ABNA0417164300", "ES9121000418450200051332", "IT60X0542811101000000123456",
               "CH9300762011623852957", "BE68539007547034", "AT611904300234573201", "PL61109010140000071219812874"]
DIGITS = string.digits
GENERATED_IBANS = [make_iban("DE", tok(18, DIGITS)), make_iban("DE", tok(18, DIGITS)),
                   make_iban("GB", "NWBK" + tok(14, DIGITS)), make_iban("GB", "BARC" + tok(14, DIGITS)),
                   make_iban("IE", "AIBK" + tok(14, DIGITS)), make_iban("CH", tok(17, DIGITS)),
                   make_iban("AT", tok(16, DIGITS)), make_iban("LU", tok(3, DIGITS) + tok(13, DIGITS + "ABCDEFGH"))]
EXTRA = {"email": lambda: rng.choice(EXTRA_EMAILS), "phone": lambda: rng.choice(PHONES[11:]),  # a second item
         "ip": lambda: rng.choice(IPS[:3]), "ssn": gen_ssn, "aws_secret": lambda: tok(40, ALNUM + "/+")}

# --- templates: {v} is the main value, other fields pull an extra sensitive value of another kind ------------

T_EMAIL = ["Customer asked that all future invoices go to {v} instead of the shared inbox.",
           "{v} reported the export job failing since Tuesday; reply once the fix is deployed.",
           "Escalation contact for the Q3 renewal is {v}",
           "Forwarded thread:\nFrom: Accounts Payable <{v}>\nSubject: contract addendum\nThey need the signed PDF by Friday.",
           "Send the weekly KPI digest (Mondays 09:00 CET) to {v} and cc the finance lead.",
           "User changed login email to {v}; the old address bounced twice, update the CRM record.",
           "mailto:{v} is the link embedded in the footer of the onboarding template.",
           "Vendor onboarding: primary contact {v}, backup contact reachable at {phone}.",
           "Note to self: the reseller in Lyon prefers contact via {v} rather than the portal.",
           "Password reset emails for tenant 4471 are going to {v}, which the customer says is wrong.",
           "Unsubscribe request received from {v} (GDPR art. 21), process within 30 days.",
           "Reply-To header was set to {v} in the phishing sample; add it to the block list."]
T_PHONE = ["Call the warehouse manager at {v} before 4pm if the pallet count is off.",
           "{v} is the after-hours line for the on-call DBA; only use it for P1 incidents.",
           "Customer prefers SMS over email; mobile number on the ticket is {v}",
           "Callback requested:\nname: R. Alvarez\nnumber: {v}\nbest time: 10:00-12:00 local",
           "The regional office switchboard is {v}; it forwards to reception after 18:00.",
           "Left a voicemail on {v} about the overdue invoice INV-2024-00917, will retry Thursday.",
           "Shipping label phone field: {v}. The courier needs it to book the delivery slot.",
           "The notary asked us to phone {v} to confirm the appointment, fax no longer works.",
           "Supplier contact: {email}, tel {v}",
           "Per the caller, reach her at {v} or via the portal chat; she does not read email.",
           "Update the escalation matrix: level 2 support now answers at {v} (24/7)."]
T_CARD = ["Customer read out card {v} exp 08/27 over the phone; process the refund, do not keep it.",
          "{v} was charged twice for order 88213, reverse the second capture.",
          "Backup card for the corporate account is {v}, CVV given separately.",
          "Call transcript:\nagent: which card?\ncaller: it's {v}, expiry 11/26\nagent: thanks",
          "Chargeback dispute concerns the card {v}; bank reference CB-2024-5521.",
          "Update billing profile: new card number {v} replaces the expired one.",
          "The customer pasted their full card number in chat: {v}. Ask them to delete the message.",
          "Corporate travel card {v}, cardholder Helena Marsh, limit 5,000 EUR.",
          "Card {v} and billing email {email} both belong to the same disputed account.",
          "If the first charge fails, retry the payment with {v}",
          "Order #55120 was paid with {v}; fraud score 12/100, so it was released."]
T_CARD_BAD = ["Tracking number {v} shows the parcel stuck in customs since Monday.",
              "Loyalty program member number {v} gets the 10% discount tier.",
              "Gift voucher code {v} was already redeemed at the Hamburg store.",
              "The batch identifier {v} appears in the ETL logs for the failed nightly run.",
              "Customer typed {v} but the form rejected it as an invalid card number (checksum failed); nothing was charged.",
              "Internal ticket reference {v}; link it to the change request.",
              "Meter serial {v} from the utility invoice is needed for the energy audit.",
              "Policy number {v}, renewal due on 2025-01-31, premium 412.50 EUR.",
              "{v} is the container seal number recorded at the port of Rotterdam.",
              "Warehouse bin barcode {v} is misprinted; reprint the labels for aisle 14.",
              "Ledger export row 7 has account reference {v}, which does not match the ERP.",
              "The payment demo page shows the placeholder {v}, which fails the checksum on purpose."]
T_IBAN = ["Refund the deposit to IBAN {v} (account holder: K. Brandt).",
          "{v} is the new supplier bank account per their letter dated 2024-05-02; verify by callback before paying.",
          "SEPA mandate signed. Debit account: {v}",
          "Payout details for the freelancer:\nName: Jonas Weber\nIBAN: {v}\nBIC: see contract",
          "Wire the 3,200.00 EUR retainer to {v}, reference PRJ-0091.",
          "Customer changed their payout account to {v}; flag for fraud review, second change this month.",
          "Salary account on file: {v}. HR confirmed it on the phone.",
          "Invoice 2024-118 says pay to {v} but older invoices used a different account."]
T_SSN = ["Applicant SSN {v}, verified against the W-2 on 2024-02-14.",
         "{v} is the social security number the caller gave for identity verification.",
         "Background check form:\nSSN: {v}\nDOB on separate sheet.",
         "Payroll correction for employee #5521: their SSN was mistyped, the correct value is {v}",
         "Form 1099 for the contractor lists social security no. {v}.",
         "Benefits enrollment stalled because SSN {v} does not match the insurer's records.",
         "Customer verified identity with last name, ZIP and SSN {v}; approved the limit increase.",
         "Dependent's SSN {v} must be added before open enrollment closes.",
         "SSN {v} / email {email} - duplicate applicant record, merge the two.",
         "Per the loan officer, the co-signer's Social Security number is {v}."]
T_IP = ["Firewall: allow inbound 443 from {v} for the partner's webhook sender.",
        "{v} hammered the login endpoint with 4,000 requests in 5 minutes; added to the deny list.",
        "Block list update:\n- {v} (credential stuffing)\n- review again on 2024-12-01",
        "The customer's VPN egress address is {v}; allow it on the admin portal.",
        "SSH to the bastion at {v} first, then hop to the database host.",
        "Suspicious login for user 8812 came from {v}, a different country than usual.",
        "Set the NTP server for the lab switches to {v}",
        'Access log: {v} - - [12/Mar/2024:10:14:03 +0000] "GET /admin HTTP/1.1" 403',
        "Rate limit exemption granted for {v} until the migration finishes (ticket OPS-2291).",
        "Health checks come from {v} on port 8080, so don't alert on that traffic."]
API_KEYS = [  # (template, value factory)
    ("AWS creds for the backup bucket: access key id {v}, secret {aws_secret}. Rotate after the migration.", lambda: "AKIA" + tok(16, string.ascii_uppercase + "234567")),
    ("{v} is the access key id the CI job uses to push images (IAM user deploy-bot).", lambda: "AKIA" + tok(16, string.ascii_uppercase + "234567")),
    ("GitHub token for the release bot: {v} (scopes: repo, workflow).", lambda: "ghp_" + tok(36)),
    ("To reproduce locally:\nexport GITHUB_TOKEN={v}", lambda: "ghp_" + tok(36)),
    ("Fine-grained PAT for the docs repo, expires 2025-03-01: {v}", lambda: "github_pat_11" + tok(20, string.ascii_uppercase + DIGITS) + "_" + tok(59)),
    ("Slack bot token for the #alerts integration is {v}; it can post but not read DMs.", lambda: f"xoxb-{tok(12, DIGITS)}-{tok(13, DIGITS)}-{tok(24)}"),
    ("SLACK_BOT_TOKEN={v}\nchannel=C04ABCDEF12", lambda: f"xoxb-{tok(11, DIGITS)}-{tok(13, DIGITS)}-{tok(24)}"),
    ("OpenAI key used by the summarizer service: {v}", lambda: "sk-" + tok(48)),
    ("{v} - this project key has a 200 USD monthly budget cap.", lambda: "sk-proj-" + tok(64, ALNUM + "_-")),
    ("Stripe live secret key (never use in tests!): {v}", lambda: "sk_live_" + tok(24)),
    ("Restricted Stripe key for the reporting job: {v}, read-only on charges.", lambda: "rk_live_" + tok(32)),
    ("Google Maps API key for the store locator widget is {v}, restricted to our referrers.", lambda: "AIza" + tok(35, ALNUM + "_-")),
    ("config.ini line 14 of the legacy importer: api_key={v}", lambda: tok(32, "0123456789abcdef")),
    ('curl -H "X-API-Key: {v}" https://api.example.com/v2/orders returns 200 now.', lambda: tok(40)),
    ("The vendor portal gave us this API key: {v}. Store it in the vault, not in the wiki.", lambda: tok(36)),
    ("GitLab deploy token for the mirror job: {v}", lambda: "glpat-" + tok(20, ALNUM + "_-")),
    ("Hugging Face read token for pulling the embedding model: {v}", lambda: "hf_" + tok(34, string.ascii_letters)),
    ('SENDGRID_API_KEY = "{v}" is still in the old .env of the mailer.',
     lambda: f"SG.{tok(22, ALNUM + '_-')}.{tok(43, ALNUM + '_-')}"),
    ("Anthropic key for the eval harness: {v}, owned by the ML platform team.", lambda: "sk-ant-api03-" + tok(93, ALNUM + "_-") + "AA"),
    ("npm publish token {v} lives in the CI secrets as NPM_TOKEN.", lambda: "npm_" + tok(36)),
    ("Internal metrics API at {ip}:9100 expects the header Authorization: ApiKey {v}", lambda: tok(44, ALNUM + "+/")),
]
T_JWT = ["Repro for the 401 bug, the request header was\nAuthorization: Bearer {v}",
         "{v} is the session token from the failing request; it expired at 14:05 UTC.",
         "Paste for the SSO ticket: id_token={v}",
         "Cookie: auth={v}; Path=/; HttpOnly",
         "The X-Auth-Token header contained {v}, which decodes to the staging issuer.",
         "Service-to-service token for the billing worker (valid 24h): {v}",
         "curl -H 'Authorization: Bearer {v}' https://api.example.com/v1/me",
         "Refresh token issued to the mobile app during testing:\n{v}\nRevoke it once QA is done.",
         "localStorage['access_token'] = '{v}'",
         "JWT from the partner sandbox, decode it to check the aud claim: {v}"]
PASSWORDS = [  # (template, password)
    ("Wi-Fi in the Munich office: SSID GuestNet, password: {v}", "Tr0ub4dor&3"),
    ("pwd={v} for the legacy FTP account ftp_reports, ask Sam before changing it.", "Xk9#mQ2$vL7p"),
    ("The admin password is {v} until IT finishes the SSO rollout.", "Summer2024!Blue"),
    ("router config:\nuser admin\npasswd = {v}\nenable secret is the same", "h7Gq!2zR@pW"),
    ("From the staging .env:\nDB_HOST=db-staging.example.internal\nDB_USER=app\nDB_PASSWORD={v}", "N3bula#Gate77"),
    ("Login for the vendor portal: username ops-team, pass: {v}", "c0rr3ct-h0rse-B4ttery"),
    ("Temporary password for the new hire's laptop is {v}; they must change it at first login.", "Welcome@2024x"),
    ("{v} is the master password for the shared 1Password vault, don't write it anywhere else.", "Fjord#Lantern19"),
    ("Printer admin (Drucker-Admin) Passwort: {v}", "zY8&uT5%kR2!"),
    ("credentials for the backup appliance: svc_backup / {v}", "MoonRiver_88!"),
    ("PASSWORD = '{v}' in settings_local.py must move to the secret manager.", "b4ckup-Vault-2024"),
    ("The audit export zip is protected with password {v} (the file itself was sent separately).", "R3dW1ne!Cellar"),
    ("mysql -u root -p{v} -h db01 worked from the jump host.", "qL9!rT2#wZ"),
]
CONNECTIONS = [  # (template, DSN)
    ("DATABASE_URL={v}", "postgresql://app_user:S3cr3t-Pa55@db.prod.example.com:5432/orders"),
    ("{v} is what the analytics notebook uses; switch it to the read replica.", "postgres://analytics:q8Jv%21x2Lm@pg-replica.example.com:5432/warehouse?sslmode=require"),
    ("Shop DB for the migration script: {v}", "mysql://root:Mx7!kq29Pz@mysql-01.internal.example.net:3306/shop"),
    ("ETL writes events to {v} (Atlas, M10 tier).", "mongodb+srv://etl_user:Gh5tR9wq2Lx@cluster0.ab1cd.mongodb.net/events?retryWrites=true&w=majority"),
    ("Celery broker moved to Redis: {v}", "redis://:Rz4mQ8vT1pLk@cache.example.com:6379/0"),
    ("Session cache (TLS) for the EU cluster:\nREDIS_URL={v}\nTTL 3600", "rediss://default:9fK2pQ7wXz3B@redis-12345.c1.eu-west-1.example.cloud:6380"),
    ("The order service publishes to {v}; queue name orders.created.", "amqp://orders_svc:Ab9xPq22Lm@rabbit.example.org:5672/prod"),
    ("appsettings.json ConnectionStrings.Billing = \"{v}\"", "Server=tcp:sql-billing.example.com,1433;Initial Catalog=billing;User ID=billing_svc;Password=Kd8#vQ2!mZ;Encrypt=True"),
    ("Legacy HR app connects with {v} (yes, as sa).", "Data Source=SQL01\\PROD;Initial Catalog=HR;User Id=sa;Password=Pw_9z!Qe4Rt;"),
    ("Ledger service JDBC URL: {v}", "jdbc:postgresql://pg.example.com:5432/ledger?user=ledger_app&password=Lg7xQ2pW9k"),
    ("SQLAlchemy URL for the reporting job is {v}", "postgresql+psycopg://svc_reports:T4bl3au-Rep0rts@reports-db.example.com/reports"),
    ("{v}\nThat is the replica-set URI from the old runbook; the admin user must be disabled.", "mongodb://admin:M0ng0-Adm1n!@mongo1.example.com:27017,mongo2.example.com:27017/admin?replicaSet=rs0"),
    ("Broker for the IoT ingest: {v}, vhost default.", "amqps://iot_ingest:Zt6vB2nQ8s@b-7f3a.mq.eu-central-1.example.com:5671"),
]
CLEAN = [
    "Invoice INV-2024-00917 for 1,250.00 EUR was paid on 2024-03-15; mark the order as settled.",
    "Escalate refunds over 500 EUR to finance; anything below can be approved by the shift lead.",
    "Rotate the API key every 90 days and record the rotation date in the change log.",
    "The token bucket refills at 10 per second with a burst capacity of 50 requests.",
    "Ask the customer for their email before opening a ticket, but never store it in notes.",
    "Release v2.14.3 fixes the CSV export bug; v2.15.0 is planned for the first week of June.",
    "SKU WX-4471-BLK is out of stock in the Leipzig warehouse until week 27.",
    "Standup notes: the scheduler migration is 80% done; blockers are the cron parser and the retry policy.",
    "Password policy: minimum 12 characters, at least one digit, and no reuse of the last 5 passwords.",
    "The SSN field on the onboarding form is optional for non-US contractors; leave it blank.",
    "Customer wants a callback on their phone tomorrow morning; the number is in the CRM, not here.",
    "Order 88213 shipped in 3 parcels; parcel 2 of 3 was delayed by the carrier.",
    "Conversion rate rose from 2.4% to 3.1% after the checkout redesign went live on 14 May.",
    "Meeting with procurement moved to Thursday 14:30 CET, room Atlas, 45 minutes.",
    "The private key for the TLS certificate is kept in the HSM; never export it to disk.",
    "Use the staging tenant for demos; production data must not be shown to prospects.",
    "Quarterly revenue target is 2.3M EUR; we are at 1.87M with six weeks to go.",
    "Customer id 48213377 requested a copy of their data under GDPR article 15.",
    "Connection pool size was raised from 20 to 50, which fixed the timeouts on the report service.",
    "Support hours are 08:00-18:00 Monday to Friday; weekend tickets are handled on Monday.",
    "The JWT expiry was shortened to 15 minutes; refresh tokens now last 7 days.",
    "Warranty claims older than 24 months are rejected automatically by the rules engine.",
    "Shipment batch 2024-W19 held 1,200 units of SKU KB-220-US and 340 units of KB-220-DE.",
    "Never paste secrets into tickets; link to the vault path instead, e.g. the payments folder.",
    "Latency p95 went from 420 ms to 180 ms after enabling HTTP keep-alive on the gateway.",
    "The onboarding checklist has 14 steps; step 6 (laptop setup) takes the longest.",
    "Discount code SPRING15 gives 15% off orders above 80 EUR until 30 April.",
    "Credit note CN-2024-0042 for 89.90 EUR offsets the duplicate charge on invoice INV-2024-01133.",
    "Replace the IP allow list with the new egress gateway once networking confirms the cutover date.",
    "Support reminder: verify identity with the account PIN, never with the date of birth.",
    "Build 5512 failed on the lint step; the fix is in PR 1874, waiting for review.",
    "VAT rate for Austria is 20%, for Germany 19%; reduced rates apply to books.",
    "Project Falcon kickoff is on 2024-09-02; budget approved at 120k EUR.",
    "The email template for shipping confirmations uses the variable customer_first_name.",
    "Reset the password via the self-service portal; the helpdesk cannot see or set passwords.",
    "Key takeaways from the retro: fewer handoffs, clearer owners, and a weekly demo.",
    "Commit 3f9a2c1 introduced the regression in the tax calculation; the revert is in progress.",
    "Request 7c9e6679-7425-40de-944b-e07fc1f90ae7 timed out after 30 s at the payment provider.",
    "Inventory count for aisle 14: 312 boxes, 18 damaged, 4 missing compared to the system.",
    "Customer satisfaction for March: 4.6 out of 5 from 1,284 responses.",
    "Store the customer's phone number only in the CRM field, never in free-text notes.",
    "The SFTP key pair for the bank integration expires next month; request a new one from treasury.",
    "Payment terms for the supplier are net 30; paying within 10 days earns a 2% discount.",
    "The agent should answer in the customer's language; the fallback is English.",
    "Delivery window for order SO-2024-77812 is 2024-11-04 between 08:00 and 12:00.",
    "Disk usage on the log volume hit 87%; retention lowered from 30 to 14 days.",
    "Annual contract value 48,000 USD, billed quarterly, auto-renews unless cancelled 60 days prior.",
    "The API returns 429 when a client exceeds 100 requests per minute; back off exponentially.",
    "Employee handbook section 4.2 covers remote work; section 4.3 covers travel expenses.",
    "Set the session timeout of the admin console to 30 minutes of inactivity.",
    "Bug 20931: the date picker offers 31 February in leap years; low priority.",
    "Parcel weight 12.5 kg, dimensions 60 x 40 x 35 cm, ships via ground.",
    "The secret santa draw is on 2 December; the budget is 25 EUR per person.",
    "Password manager rollout is 70% complete; the remaining teams migrate in Q1.",
    "Customer asked us to delete the phone number and email we had on file; done on 2024-06-11.",
    "Purchase order PO-884120 for 40 monitors was approved by the CFO on Friday.",
    "The login form has three fields: email, password and a one-time code from the authenticator app.",
    "Bank transfer reference must be the invoice number only, e.g. INV-2024-00917.",
    "Cost center 44712290 covers all marketing travel; charge conference tickets there.",
    "SDK version 3.2.1 drops support for Python 3.8; firmware 1.4.22 is required on scanners.",
    "Agenda for Monday:\n1. Q3 numbers\n2. Hiring plan (3 roles)\n3. Office move on 2024-10-01",
    "The replacement copy of ISBN 978-3-16-148410-0 arrived damaged; ask the publisher for another.",
    "Webshop order number 202409170042 was split into two shipments by the warehouse.",
    "Marketplace order 112-4470098-3321188 is still waiting for the seller's tracking upload.",
    "To rotate a leaked token: revoke it, issue a new one, update the vault, and redeploy.",
]

# fmt: on

# --- assembly ------------------------------------------------------------------------------------------------

rows: list[dict[str, Any]] = []


def add(category: str, template: str, value: str) -> None:
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f and f != "v"]
    extras = {f: EXTRA[f]() for f in fields}
    sensitive = [value, *extras.values()] if EXPECT[category] != "clean" else []
    rows.append(
        {
            "id": f"{category}-{sum(r['category'] == category for r in rows) + 1:03d}",
            "category": category,
            "text": template.format(v=value, **extras),
            "sensitive": sensitive,
            "expect": EXPECT[category],
        }
    )


def cycle(category: str, templates: list[str], values: list[str]) -> None:
    for i, v in enumerate(values):
        add(category, templates[i % len(templates)], v)


def private_keys() -> list[tuple[str, str]]:
    """(template, PEM) pairs: a fresh key per row, so these are the only values that change between runs."""
    fmt = ser.PrivateFormat
    plain: ser.KeySerializationEncryption = ser.NoEncryption()

    def pem(key: Any, form: ser.PrivateFormat, enc: ser.KeySerializationEncryption = plain) -> str:
        return str(key.private_bytes(ser.Encoding.PEM, form, enc).decode()).strip()

    def rsa_key() -> Any:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    p256, p384, ed = ec.SECP256R1(), ec.SECP384R1(), ed25519.Ed25519PrivateKey.generate
    encrypted = ser.BestAvailableEncryption(PASSPHRASE)
    # fmt: off
    return [
        ("Deploy key for the staging box (read-only):\n{v}\nRemove it once the pipeline uses OIDC.", pem(rsa_key(), fmt.TraditionalOpenSSL)),
        ("{v}\n^ EC key of the webhook signer, keep until the partner rotates their side.", pem(ec.generate_private_key(p256), fmt.TraditionalOpenSSL)),
        ("Found in the old laptop's ~/.ssh/id_ed25519, revoke it:\n{v}", pem(ed(), fmt.OpenSSH)),
        ("Bastion jump key (ecdsa-sha2-nistp384), owner infra team:\n{v}\nExpires with the Q4 access review.", pem(ec.generate_private_key(p384), fmt.OpenSSH)),
        ("tls.key for api.example.com, copied from the load balancer:\n{v}", pem(rsa_key(), fmt.PKCS8)),
        ("JWT signing key (ES256) for the auth service:\n{v}\nPublic half is published in the JWKS.", pem(ec.generate_private_key(p256), fmt.PKCS8)),
        ("Ed25519 signing key for release artifacts: {v}", pem(ed(), fmt.PKCS8)),
        ("Encrypted key from the vendor; the passphrase is in a separate message.\n{v}", pem(ec.generate_private_key(p384), fmt.PKCS8, encrypted)),
        ('From the service account JSON, copied into .env: GCP_PRIVATE_KEY="{v}"', pem(rsa_key(), fmt.PKCS8).replace("\n", "\\n")),
    ]
    # fmt: on


def build() -> None:
    cycle("email", T_EMAIL, EMAILS)
    cycle("phone", T_PHONE, PHONES)
    cards = [fmt_card(c, ["", " ", "-"][i % 3]) for i, c in enumerate(KNOWN_CARDS + GENERATED_CARDS)]
    cycle("card_valid", T_CARD, cards)
    bad = []
    for i, prefix in enumerate(["4", "4", "5", "5", "6011", "3", "1", "7", "9", "2", "8", "4"]):
        body = luhn_number(prefix, 16)
        bad.append(fmt_card(body[:-1] + str((int(body[-1]) + rng.randint(1, 9)) % 10), ["", " ", "-"][i % 3]))
    cycle("card_invalid_luhn", T_CARD_BAD, bad)
    ibans = KNOWN_IBANS + GENERATED_IBANS
    cycle(
        "iban",
        T_IBAN,
        [" ".join(b[i : i + 4] for i in range(0, len(b), 4)) if n % 2 else b for n, b in enumerate(ibans)],
    )
    ssns = [gen_ssn() for _ in range(15)]
    cycle("ssn", T_SSN, [s.replace("-", " ") if i in (4, 9, 13) else s for i, s in enumerate(ssns)])
    cycle("ip", T_IP, IPS)
    for template, factory in API_KEYS:
        add("api_key", template, factory())
    for i, tmpl in enumerate(T_JWT):
        alg = ["HS256", "HS384", "HS512"][i % 3]
        header = {"alg": alg, "typ": "JWT"} | ({"kid": f"key-{2024 + i}"} if i % 4 == 1 else {})
        iat = 1717000000 + rng.randint(0, 9_000_000)
        claims = {
            "sub": str(rng.randint(10_000, 99_999)),
            "iss": "https://auth.example.com",
            "aud": "fleet-api",
        }
        claims |= {
            "iat": iat,
            "exp": iat + 3600 * (1 + i % 3),
            "scope": rng.choice(["read", "read write", "admin"]),
        }
        add("jwt", tmpl, make_jwt(header, claims))
    for tmpl, value in private_keys():
        add("private_key", tmpl, value)
    for tmpl, value in PASSWORDS:
        add("password", tmpl, value)
    for tmpl, value in CONNECTIONS:
        add("connection_string", tmpl, value)
    for text in CLEAN:
        add("clean", text.replace("{", "{{").replace("}", "}}"), "")


# --- validation ------------------------------------------------------------------------------------------------

DETECTORS = [  # loose detectors: any hit outside a listed sensitive item means the corpus mislabels a text
    ("email", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")),
    ("ipv4", re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")),
    ("ssn", re.compile(r"(?<![\w-])\d{3}[- ]\d{2}[- ]\d{4}(?![\w-])")),
    ("us-phone", re.compile(r"(?<![\w.])(?:\+?1[ .-]?)?\(?[2-9]\d\d\)?[ .-]?[2-9]\d\d[ .-]?\d{4}(?!\d)")),
    ("card", re.compile(r"(?<![\w-])\d(?:[ -]?\d){12,18}(?!\w)")),
]


def validate() -> None:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    counts = {c: sum(r["category"] == c for r in rows) for c in MINIMUM}
    assert all(counts[c] >= n for c, n in MINIMUM.items()), counts
    assert len(rows) >= 250, len(rows)
    for r in rows:
        text, sens, cat = r["text"], r["sensitive"], r["category"]
        assert r["expect"] == EXPECT[cat], r["id"]
        assert all(isinstance(s, str) and s and s in text for s in sens), r["id"]
        assert (not sens) == (EXPECT[cat] == "clean"), r["id"]
        assert 40 <= len(text) <= 600 or cat == "private_key", (r["id"], len(text))
        spans = [(m.start(), m.end()) for s in sens for m in re.finditer(re.escape(s), text)]
        for name, rx in DETECTORS:
            for m in rx.finditer(text):
                if name == "card" and not luhn_ok(m.group()):
                    continue
                assert any(a <= m.start() and m.end() <= b for a, b in spans), (r["id"], name, m.group())
        main = sens[0] if sens else ""
        if cat == "card_valid":
            assert luhn_ok(main) and re.fullmatch(r"[\d -]{15,19}", main), r["id"]
            assert re.match(r"4|5[1-5]|2[2-7]|3[47]|6(?:011|5|4[4-9])", main), r["id"]
        if cat == "card_invalid_luhn":
            nums = re.findall(r"\d{4}[ -]?\d{4}[ -]?\d{4}[ -]?\d{4}", text)
            assert len(nums) == 1 and not luhn_ok(nums[0]), r["id"]
        if cat == "iban":
            assert iban_mod97(main) == 1 and len(main.replace(" ", "")) == IBAN_LENGTH[main[:2]], r["id"]
        if cat == "ssn":
            assert ssn_ok(main), r["id"]
        if cat == "jwt":
            head, body, sig = main.split(".")
            alg = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))["alg"]
            assert hmac.compare_digest(
                sig, b64u(hmac.new(JWT_SECRET, f"{head}.{body}".encode(), HASHES[alg]).digest())
            )
        if cat == "private_key":
            block = main.replace("\\n", "\n") + "\n"
            assert block.startswith("-----BEGIN") and re.search(r"-----END [A-Z ]*PRIVATE KEY-----\n$", block)
            if "OPENSSH" in block:
                ser.load_ssh_private_key(block.encode(), None)
            else:
                ser.load_pem_private_key(block.encode(), PASSPHRASE if "ENCRYPTED" in block else None)
        if cat == "connection_string":
            assert re.search(r"://[^:/]*:[^@]+@|[Pp]assword=", main), r["id"]


if __name__ == "__main__":
    build()
    validate()
    with OUT.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts = {c: sum(r["category"] == c for r in rows) for c in MINIMUM}
    print(f"wrote {len(rows)} rows to {OUT}: {counts}")
