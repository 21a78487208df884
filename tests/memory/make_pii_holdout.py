"""Generate ``pii_holdout.jsonl``: a held-out labelled corpus for the memory store's PII/secrets write gate.

This corpus is written independently of ``pii_corpus.jsonl`` (the one the detector was tuned on) and of the
detector itself; use it to measure, not to tune. Each line is one JSON object:

- ``id``: unique, ``h-<category>-NNN``
- ``category``: email, phone, card_valid, card_invalid_luhn, iban, ssn, ip, api_key, jwt, private_key,
  password, connection_string or clean
- ``text``: a realistic note an agent might want to remember (40-600 characters, some multi-line)
- ``sensitive``: the exact substrings of ``text`` that must not reach the store (empty for clean and
  card_invalid_luhn). A phone extension ("ext. 204") and an IP's port are not part of the item; a
  connection string is the whole DSN; a private key is the whole PEM block.
- ``expect``: "pii", "secret" or "clean"

Run ``python tests/memory/make_pii_holdout.py`` from the repository root. Generation uses a fixed seed, so
card numbers, IBANs, SSNs, tokens, passwords, the RSA/EC/Ed25519 key material and the HS256/RS256 JWTs are
reproducible. Some bytes still differ between runs: the ES256 JWT signature (ECDSA is randomised), the
OpenSSH key's check integers and the encrypted PKCS#8 key's salt and IV. The committed jsonl file is the
reference; regenerating it is not needed to use it.

All values are synthetic: US phone numbers use the fictional 555-01xx range, UK numbers the Ofcom drama
ranges, keys and tokens are random and match real providers only in shape. The RSA keys are deliberately
small (512 and 1024 bits) so that a PEM block fits in a 600-character note; never use any key from here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

SEED = 20240611
OUT = Path(__file__).with_name("pii_holdout.jsonl")

EXPECT = {
    "email": "pii",
    "phone": "pii",
    "card_valid": "pii",
    "card_invalid_luhn": "clean",
    "iban": "pii",
    "ssn": "pii",
    "ip": "pii",
    "api_key": "secret",
    "jwt": "secret",
    "private_key": "secret",
    "password": "secret",
    "connection_string": "secret",
    "clean": "clean",
}

MINIMUM = {
    "email": 12,
    "phone": 12,
    "card_valid": 12,
    "card_invalid_luhn": 8,
    "iban": 10,
    "ssn": 10,
    "ip": 10,
    "api_key": 14,
    "jwt": 6,
    "private_key": 5,
    "password": 10,
    "connection_string": 8,
    "clean": 40,
}

rng = random.Random(SEED)

ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "-_"
HEX = "0123456789abcdef"


# --------------------------------------------------------------------------------------------------------
# Small generators
# --------------------------------------------------------------------------------------------------------


def pick(alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def fill(template: str, **values: str) -> str:
    """Substitute ``{name}`` placeholders (plain replace, so JSON braces in templates need no escaping)."""
    for name, value in values.items():
        template = template.replace("{" + name + "}", value)
    assert "{v}" not in template, template
    return template


def luhn_ok(number: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed([c for c in number if c.isdigit()])):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_number(prefix: str, length: int) -> str:
    payload = prefix + pick(string.digits, length - len(prefix) - 1)
    return next(payload + c for c in string.digits if luhn_ok(payload + c))


def luhn_broken(prefix: str, length: int) -> str:
    """A card-shaped number whose last digit is off by 1-9, which always fails the Luhn check."""
    valid = card_number(prefix, length)
    return valid[:-1] + str((int(valid[-1]) + rng.randint(1, 9)) % 10)


def grouped(number: str, sizes: tuple[int, ...], sep: str) -> str:
    parts, start = [], 0
    for size in sizes:
        parts.append(number[start : start + size])
        start += size
    assert start == len(number), (number, sizes)
    return sep.join(parts)


def iban_numeric(text: str) -> int:
    return int("".join(str(int(ch, 36)) for ch in text))


def make_iban(country: str, bank: str, digits: int) -> str:
    bban = bank + pick(string.digits, digits)
    check = 98 - iban_numeric(bban + country + "00") % 97
    return f"{country}{check:02d}{bban}"


def iban_ok(iban: str) -> bool:
    compact = iban.replace(" ", "").upper()
    return iban_numeric(compact[4:] + compact[:4]) % 97 == 1


def make_ssn(sep: str = "-") -> str:
    area = rng.choice([a for a in range(1, 900) if a != 666])
    return f"{area:03d}{sep}{rng.randint(1, 99):02d}{sep}{rng.randint(1, 9999):04d}"


def ssn_ok(ssn: str) -> bool:
    d = re.sub(r"\D", "", ssn)
    area, group, serial = int(d[:3]), int(d[3:5]), int(d[5:])
    return len(d) == 9 and 0 < area < 900 and area != 666 and group > 0 and serial > 0


# fmt: off
WORDS = ["amber", "falcon", "harbor", "copper", "meadow", "quartz", "juniper", "lantern", "orbit", "tundra",
         "velvet", "saffron", "glacier", "cobalt"]
# fmt: on


def password() -> str:
    """A human-ish password: either random characters of every class or word + digits + symbol."""
    if rng.random() < 0.5:
        chars = [rng.choice(string.ascii_uppercase), rng.choice(string.ascii_lowercase)]
        chars += [rng.choice(string.digits), rng.choice("!$*+-=?_~")]
        chars += [rng.choice(ALNUM + "!$*+-=?_~") for _ in range(rng.randint(8, 12))]
        rng.shuffle(chars)
        return "".join(chars)
    return rng.choice(WORDS).capitalize() + pick(string.digits, 4) + rng.choice("!$*?") + pick(ALNUM, 2)


def url_password() -> str:
    return pick(ALNUM, rng.randint(14, 22))


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(header: dict[str, str], claims: dict[str, object], sign: Callable[[bytes], bytes]) -> str:
    head = b64url(json.dumps(header, separators=(",", ":")).encode())
    body = b64url(json.dumps(claims, separators=(",", ":")).encode())
    signing_input = f"{head}.{body}".encode()
    return f"{head}.{body}.{b64url(sign(signing_input))}"


def hs256(secret: bytes) -> Callable[[bytes], bytes]:
    return lambda msg: hmac.new(secret, msg, hashlib.sha256).digest()


def probable_prime(bits: int) -> int:
    """Miller-Rabin with seeded witnesses: reproducible test-only RSA primes (never for real keys)."""
    while True:
        n = rng.getrandbits(bits) | (3 << (bits - 2)) | 1
        if any(n % p == 0 for p in (3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)) or (n - 1) % 65537 == 0:
            continue
        d, r = n - 1, 0
        while d % 2 == 0:
            d, r = d // 2, r + 1
        for _ in range(32):
            x = pow(rng.randrange(2, n - 2), d, n)
            if x in (1, n - 1):
                continue
            for _ in range(r - 1):
                x = pow(x, 2, n)
                if x == n - 1:
                    break
            else:
                break
        else:
            return n


def small_rsa_key(bits: int) -> rsa.RSAPrivateKey:
    """``cryptography`` refuses to generate keys under 1024 bits, so build them from seeded primes."""
    p, q = probable_prime(bits // 2), probable_prime(bits // 2)
    e, n = 65537, p * q
    d = pow(e, -1, (p - 1) * (q - 1))
    public = rsa.RSAPublicNumbers(e, n)
    return rsa.RSAPrivateNumbers(p, q, d, d % (p - 1), d % (q - 1), pow(q, -1, p), public).private_key()


def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey, fmt: str) -> str:
    formats = {
        "traditional": serialization.PrivateFormat.TraditionalOpenSSL,
        "pkcs8": serialization.PrivateFormat.PKCS8,
        "openssh": serialization.PrivateFormat.OpenSSH,
    }
    encryption: serialization.KeySerializationEncryption = serialization.NoEncryption()
    if fmt == "pkcs8-encrypted":
        fmt, encryption = "pkcs8", serialization.BestAvailableEncryption(pick(ALNUM, 24).encode())
    raw = key.private_bytes(serialization.Encoding.PEM, formats[fmt], encryption)
    return raw.decode().strip()


# --------------------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------------------

records: list[dict[str, Any]] = []


def add(category: str, text: str, *sensitive: str) -> None:
    number = sum(1 for r in records if r["category"] == category) + 1
    records.append(
        {
            "id": f"h-{category.replace('_', '-')}-{number:03d}",
            "category": category,
            "text": text,
            "sensitive": list(sensitive),
            "expect": EXPECT[category],
        }
    )


def add_all(category: str, table: list[tuple[str, str]]) -> None:
    for template, value in table:
        add(category, fill(template, v=value), value)


# fmt: off
EMAILS = [
    ("Ticket #58213: customer asked to send all invoices to their AP mailbox, {v}, starting with the March billing cycle. Confirmed on the call, no PO change needed.", "accounts.payable@brightwater-foods.com"),
    ("Lead from the Hannover trade fair: Jonas Weber, head of procurement at Kessler Maschinenbau. Prefers email over calls: {v}. Interested in the 3-year maintenance plan, budget around €40k.", "j.weber@kessler-mb.de"),
    ("2024-05-02T09:14:55Z WARN auth.login failed user={v} reason=mfa_timeout attempts=3 client=web", "priya.raman+staging@northwind.io"),
    ("[10:42] sam: who owns the Q3 vendor review?\n[10:43] lina: Derek does, his address is {v} but he's out until Thursday", "DEREK.OKAFOR@Halcyon-Partners.co.uk"),
    ("Meeting notes 14 Mar - onboarding Fernhill Clinic\n- primary contact: Dr Anaïs Moreau ({v})\n- go-live target: 2 April\n- they need SSO before the rollout", "a.moreau@fernhill-clinique.fr"),
    ("notifications:\n  on_failure:\n    - {v}\n  digest_hour: 7\n  channel: email", "k.lindqvist@tidewater.energy"),
    ("Customer wrote from a personal address ({v}) instead of the one on the account; verify identity before changing the shipping address on order 44-10923.", "marco_bianchi1987@gmail.com"),
    ("Refund approved for order A-77310. Send the confirmation to Yuki Tanaka <{v}>, she asked us to stop using her old work address.", "yuki.tanaka@studio-kanso.jp"),
    ("Footer of the partner newsletter still links to mailto:{v} for escalations; switch it to the shared inbox before the next send.", "r.achterberg@vandermeer-logistiek.nl"),
    ("Heads-up for next week: the new account manager for Oakridge Dental is {v}. Loop him in on the renewal talks.", "tom.h.nguyen@oakridgedental.com"),
    ('{"customer_id": 88213, "name": "Lea Fischer", "contact": "{v}", "tier": "gold", "renewal": "2025-01-31"}', "lea.fischer@posteo.de"),
    ("Bounce report: delivery to {v} failed 4 times (550 mailbox full). Pause the drip campaign for this contact.", "m.oyelaran@mail.lagos-fintech.ng"),
    ("Escalation owner changed from Carla to {v} at her manager's request (ticket SUP-3390).", "anne-marie_dupont@groupe-vireo.fr"),
    ("Send the signed NDA to {v} by Friday.", "olu@adebayo.dev"),
]

PHONES = [
    ("Caller asked for a callback on {v} after 3pm Pacific about the duplicate charge on invoice INV-20931.", "628.555.0147"),
    ("Direct line for the Halvorsen account is {v} ext. 204, ask for the facilities desk rather than the main switchboard.", "(718) 555-0126"),
    ("Vendor support hotline {v} (24/7). Quote our contract number C-55812 when calling.", "1-888-555-0191"),
    ("SMS alerts go to the on-call phone: {v}. Hand it to the secondary on Mondays.", "+1 212 555 0143"),
    ("Left a voicemail at {v}, will try again tomorrow morning.", "312-555-0188"),
    ("twilio.message delivered to={v} status=delivered segments=2 campaign=renewal_reminder", "+13105550162"),
    ('CRM export row: {"account": "Pinecrest Realty", "phone": "{v}", "owner": "jmiller", "stage": "negotiation"}', "(503) 555-0114"),
    ("UK office reception: {v}. They close at 17:30 GMT, so call before 5.", "+44 20 7946 0958"),
    ("Warehouse manager Gareth prefers WhatsApp on {v} rather than email.", "+44 7700 900461"),
    ("Manchester site contact changed, new number {v} (ask for Priya in goods-in).", "+44-161-496-0753"),
    ("Callback requested by Ms Schuster on {v} about the overdue payment reminder.", "+49 (0)30 9018 2736"),
    ("Berlin courier dispatcher, mobile {v}, reachable 7-15 Uhr.", "+49 171 4825903"),
    ("Contact chez Maison Royer : {v}, demander le service comptabilité.", "+33 6 48 21 97 35"),
    ("Driver for the Rotterdam pickup: Pieter, {v}, arrives between 08:00 and 10:00.", "+31 6 2487 1935"),
    ("Escalation contact at the Pune dev partner: Rohan Kulkarni, {v} (IST, mornings only).", "+91 98201 47735"),
    ("Sydney reseller asked us to call the owner directly on {v} for the contract renewal.", "+61 412 837 506"),
]

CARDS_VALID = [  # (template, brand prefix, length, grouping, separator)
    ("Customer read her card out over chat so we could retry the payment: {v} exp 09/27. Second attempt succeeded, ticket closed.", "4", 16, (4, 4, 4, 4), " "),
    ("2024-06-11 08:02:19 ERROR payments.charge declined pan={v} amount=129.00 currency=EUR code=05", "4", 16, (16,), ""),
    ("Web form dump (fields as received):\nname: Helena Varga\ncard_number: {v}\nexpiry: 11/26\nplan: annual", "4", 16, (4, 4, 4, 4), "-"),
    ("Corporate card for travel bookings is {v}, cardholder Marcus Lee, billing address on file.", "5425", 16, (4, 4, 4, 4), " "),
    ('{"payment_method": {"type": "card", "number": "{v}", "exp_month": 4, "exp_year": 2028}}', "MC2", 16, (16,), ""),
    ("[14:03] finance-bot: reconciliation mismatch on card {v}\n[14:05] ana: that's the old one, it was replaced in May", "MC2", 16, (4, 4, 4, 4), " "),
    ("Amex on file for Blackstone Events: {v}. Use it only for the venue deposit.", "37", 15, (4, 6, 5), " "),
    ("Chargeback case CB-8841: disputed transaction on {v}, amount $412.50, descriptor ACME*SUBSCR.", "34", 15, (4, 6, 5), "-"),
    ("Please move the subscription to the Discover card {v} (the old one expired).", "6011", 16, (4, 4, 4, 4), " "),
    ("id,customer,card,amount\n1042,Ortega Plumbing,{v},780.00\n1043,Lakeside Diner,on account,120.00", "65", 16, (16,), ""),
    ("Tokyo office pays with JCB {v}; the gateway needs 3-D Secure for it.", "3566", 16, (4, 4, 4, 4), " "),
    ("> Hi, my card number is {v}, please charge the outstanding balance.\nDrafted a reply asking her to use the payment link instead.", "3530", 16, (4, 4, 4, 4), "-"),
    ("Booking hold for the Lisbon offsite guaranteed with {v} (Mastercard), release by 1 Sept.", "52", 16, (4, 4, 4, 4), "-"),
    ("Customer wants the annual plan charged to card {v} instead of invoice.", "4", 16, (4, 4, 4, 4), " "),
]

CARDS_INVALID = [  # card-shaped numbers that fail the Luhn check: not card data
    ("Customer typed {v} into the payment form; the gateway rejected it as an invalid card number, nothing was stored.", "4", 16, (4, 4, 4, 4), " "),
    ("Gift voucher {v} redeemed for €50 on order 771-2203.", "5", 16, (4, 4, 4, 4), "-"),
    ("Loyalty membership no. {v}, upgrade to silver after the next purchase.", "6011", 16, (4, 4, 4, 4), " "),
    ("Bank transfer reference {v} matches the payment from Lindgren AB.", "4", 16, (16,), ""),
    ("Staging test: payment with {v} failed validation as expected (checksum), so the form shows the right error.", "5", 16, (4, 4, 4, 4), " "),
    ("Consignment {v} shows delivered at the Leeds depot, signed by reception.", "3", 16, (4, 4, 4, 4), " "),
    ("Insurance policy number {v} renewed for another 12 months, premium unchanged.", "37", 15, (4, 6, 5), " "),
    ("Meter ID {v} reported zero consumption for March; schedule a site check.", "35", 16, (16,), ""),
]

IBANS = [  # (template, country, bank code, random digits, format)
    ("Supplier Delvaux & Fils changed bank details, new IBAN {v} (BIC GEBABEBB). Verified by calling the number on file before updating.", "BE", "", 12, "print"),
    ("Payroll for the Kraków contractor goes to {v}, transfer in PLN on the 10th of each month.", "PL", "", 24, "print"),
    ("Refund for the Lisbon customer via SEPA to {v}, reference RMA-3381.", "PT", "", 21, "compact"),
    ("swish doesn't work for business refunds, so use the iban instead: {v}", "SE", "", 20, "lower"),
    ("Invoice footer for Fjordline Charter AS: IBAN {v}, payment terms 14 days.", "NO", "", 11, "print"),
    ("Danish reseller payout account: {v}, payouts monthly above DKK 500.", "DK", "", 14, "compact"),
    ("Vendor master data update (SAPS-2201): IBAN {v}, BIC BKAUATWW.", "AT", "", 16, "print"),
    ("Tenant in Dublin pays the rent by standing order from {v}.", "IE", "AIBK", 14, "print"),
    ("[09:12] claire: le RIB de Bureau Vallée c'est {v}\n[09:13] tom: thanks, adding it to the vendor record", "FR", "", 23, "print"),
    ('{"beneficiary": "Groenveld BV", "iban": "{v}", "amount": 2450.00, "currency": "EUR"}', "NL", "RABO", 10, "compact"),
    ("customer sent: my iban is {v} please refund there", "ES", "", 20, "lower print"),
    ("Conto per i rimborsi / refund account: {v} (intestato a Ferri Srl).", "IT", "X", 22, "print"),
]

SSNS = [  # (template, separator)
    ("Background check request for new hire Daniel Reyes, SSN {v}, start date 2024-07-08.", "-"),
    ("W-9 received from contractor Keisha Brooks: SSN {v}, business type sole proprietor.", "-"),
    ("Caller was asked for the last four digits but read out the full number {v}; flag the recording for scrubbing.", "-"),
    ("employee_id,name,ssn,state\nE1042,Gregory Tan,{v},CA\nE1043,Ana Silva,pending,TX", "-"),
    ('{"applicant": {"name": "Rosa Delgado", "ssn": "{v}", "loan_amount": 18500}}', "-"),
    ("[11:20] hr-ops: benefits enrollment failed for Tyler Moss, his SSN {v} doesn't match the carrier record", "-"),
    ("1099 draft: recipient TIN {v} (individual), nonemployee compensation $14,200.", " "),
    ("2024-04-18 16:22:07 INFO kyc.verify applicant_id=55019 ssn={v} result=match", ""),
    ("Onboarding form, page 2\nSocial Security No.: {v}\nFiling status: single", "-"),
    ("Please update the SSN on file for account 7781 to {v}; the previous one had two digits swapped.", "-"),
]

IPS = [
    ("Blocked {v} at the WAF after 1,200 failed logins in 10 minutes; it's on two abuse lists already.", "91.204.17.133"),
    ("The NAS in the Leeds office is on {v}; reboot it from the admin UI if backups stall.", "192.168.10.25"),
    ("Jenkins agent moved to {v} after the subnet change, update known_hosts on the controller.", "10.42.7.118"),
    ("Docker bridge gateway {v} clashes with the VPN route, switch the bridge to another subnet.", "172.18.0.1"),
    ("Metrics exporter now listens on {v}:9100, Prometheus scrape config updated.", "10.0.3.17"),
    ('nginx: {v} - - [11/Jun/2024:07:31:02 +0000] "POST /api/v1/login HTTP/1.1" 401 53', "84.112.47.9"),
    ("[16:40] dev: the customer says they can't log in from home, their IP is {v}, can you check the geo block?", "73.158.22.190"),
    ("Customer's router WAN address is {v}, add it to the admin panel allow-list.", "2a02:0810:1d40:5e00:9c3a:44ff:fe17:b2c1"),
    ("Partner API gateway egress: {v} (IPv6 only from next month).", "2a01:4f8:c17:3b1::1"),
    ("Suspicious session from {v}, user agent curl/8.4.0, forced logout and opened SEC-118.", "2600:1700:5a3e:8f40::4b"),
    ("Printer on the 3rd floor got a new lease: {v}. Update the print server queue.", "192.168.1.203"),
]
# fmt: on

add_all("email", EMAILS)
add_all("phone", PHONES)

for template, prefix, length, sizes, sep in CARDS_VALID:
    if prefix == "MC2":  # Mastercard 2-series, 2221-2720
        prefix = str(rng.randint(2221, 2720))
    value = grouped(card_number(prefix, length), sizes, sep)
    add("card_valid", fill(template, v=value), value)

for template, prefix, length, sizes, sep in CARDS_INVALID:
    add("card_invalid_luhn", fill(template, v=grouped(luhn_broken(prefix, length), sizes, sep)))

for template, country, bank, ndigits, style in IBANS:
    iban = make_iban(country, bank, ndigits)
    value = " ".join(iban[i : i + 4] for i in range(0, len(iban), 4)) if "print" in style else iban
    value = value.lower() if "lower" in style else value
    add("iban", fill(template, v=value), value)

for template, sep in SSNS:
    value = make_ssn(sep)
    add("ssn", fill(template, v=value), value)

add_all("ip", IPS)


# --- API keys ---------------------------------------------------------------------------------------------

AWS_B32 = string.ascii_uppercase + "234567"
akid, aws_secret = "AKIA" + pick(AWS_B32, 16), pick(ALNUM + "/+", 40)
add(
    "api_key",
    f"~/.aws/credentials on the build box:\n[deploy]\naws_access_key_id = {akid}\n"
    f"aws_secret_access_key = {aws_secret}\nregion = eu-west-1",
    akid,
    aws_secret,
)
akid = "AKIA" + pick(AWS_B32, 16)
add("api_key", f"[13:02] ravi: CI fails with InvalidClientTokenId for {akid}, did someone rotate it?", akid)

key = f"github_pat_{pick(ALNUM, 22)}_{pick(ALNUM, 59)}"
add("api_key", f"Fine-grained token for the release bot (contents: write, expires 2024-12-01): {key}", key)

key = "glpat-" + pick(URLSAFE, 20)
add("api_key", f"GITLAB_TOKEN={key}  # project access token for the mirror sync job", key)

key = f"xoxp-{pick(string.digits, 11)}-{pick(string.digits, 12)}-{pick(string.digits, 13)}-{pick(HEX, 32)}"
add("api_key", f"Slack user token the standup bot posts with: {key}\nScopes: chat:write, users:read", key)

key = "rk_live_51" + pick(ALNUM, 97)
add("api_key", f"Restricted Stripe key for the revenue report job (read-only on charges): {key}", key)

key, secret = "SK" + pick(HEX, 32), pick(ALNUM, 32)
add(
    "api_key",
    f"# .env.production\nTWILIO_API_KEY={key}\nTWILIO_API_SECRET={secret}\nSMS_FROM=Acme",
    key,
    secret,
)

key = "key-" + pick(HEX, 32)
add(
    "api_key", f"Mailgun sending key for mg.acme-shop.com is {key}, same one as in the password manager.", key
)

key = pick(HEX, 32)
add(
    "api_key",
    "AZURE_OPENAI_ENDPOINT=https://contoso-eastus.openai.azure.com/\n"
    f"AZURE_OPENAI_KEY={key}\nAZURE_OPENAI_DEPLOYMENT=gpt-4o-mini",
    key,
)

key = pick(ALNUM, 40)
add(
    "api_key",
    f"Repro for the 403: curl -s 'https://api.partner-rates.com/v2/quotes?lane=RTM-HAM' -H 'X-Api-Key: {key}'",
    key,
)

key = pick(ALNUM, 32)
add(
    "api_key",
    f'config/analytics.json: {{"analytics": {{"provider": "segment", "apiKey": "{key}", "flushInterval": 10000}}}}',
    key,
)

key = pick(ALNUM, 48)
add("api_key", f"monitoring:\n  provider: statuspage\n  api_token: {key}\n  component: checkout-api", key)

key = f"sk-proj-{pick(URLSAFE, 64)}T3BlbkFJ{pick(URLSAFE, 64)}"
add("api_key", f"OPENAI_API_KEY={key}\n(used by the ticket summariser, billing on the ops project)", key)

key = "AIzaSy" + pick(URLSAFE, 33)
add("api_key", f"Store locator map embed uses {key}; restrict it by HTTP referrer before launch.", key)

key = f"SG.{pick(URLSAFE, 22)}.{pick(URLSAFE, 43)}"
add("api_key", f"[15:31] nadia: new SendGrid key for the invoices sender is {key}, old one revoked", key)

key = pick(HEX, 32)
add(
    "api_key",
    f"helm values for the agent:\ndatadog:\n  site: datadoghq.eu\n  apiKey: {key}\n  logs: true",
    key,
)


# --- JWTs -------------------------------------------------------------------------------------------------

ISS = "https://auth.shopline.io"
signer = hs256(pick(ALNUM, 32).encode())
token = jwt(
    {"alg": "HS256", "typ": "JWT"},
    {"sub": "usr_48213", "iss": ISS, "scope": "orders:read", "iat": 1718090000, "exp": 1718093600},
    signer,
)
add(
    "jwt",
    f"Customer pasted the failing request:\nGET /v1/orders?page=2 HTTP/1.1\nHost: api.shopline.io\n"
    f"Authorization: Bearer {token}",
    token,
)
token = jwt(
    {"alg": "HS256", "typ": "JWT"}, {"sid": uuid.UUID(int=rng.getrandbits(128)).hex, "uid": 9127}, signer
)
add("jwt", f"Set-Cookie: session={token}; Path=/; HttpOnly; Secure; SameSite=Lax", token)

token = jwt(
    {"alg": "HS256", "typ": "JWT", "kid": "svc-2024-05"},
    {"sub": "svc:invoice-worker", "aud": "ledger", "iat": 1717400000, "exp": 1717403600},
    hs256(pick(ALNUM, 40).encode()),
)
add(
    "jwt",
    f"2024-06-03 10:21:44 DEBUG http.client POST /ledger/entries auth={token} status=401 latency_ms=38",
    token,
)

rsa_jwt_key = small_rsa_key(1024)
token = jwt(
    {"alg": "RS256", "typ": "JWT", "kid": "idp-key-7"},
    {
        "iss": "https://login.fernhill.example",
        "sub": "00u8k2x4",
        "aud": "crm-web",
        "iat": 1718200000,
        "exp": 1718203600,
    },
    lambda msg: rsa_jwt_key.sign(msg, padding.PKCS1v15(), hashes.SHA256()),
)
add("jwt", f"id_token from the IdP callback, kept for debugging the clock-skew issue:\n{token}", token)

ec_jwt_key = ec.derive_private_key(rng.getrandbits(250), ec.SECP256R1())


def es256(msg: bytes) -> bytes:
    r, s = decode_dss_signature(ec_jwt_key.sign(msg, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


token = jwt({"alg": "ES256", "typ": "JWT"}, {"sub": "device-5521", "role": "kiosk", "exp": 1735689600}, es256)
add("jwt", f"[17:05] marta: this is the token that keeps getting 401 from the kiosk API: {token}", token)

token = jwt(
    {"alg": "HS256", "typ": "JWT"},
    {"sub": "usr_10377", "tenant": "acme-eu", "roles": ["admin"], "iat": 1718300000, "exp": 1718300900},
    signer,
)
add(
    "jwt",
    f'localStorage dump from the user\'s browser: {{"accessToken": "{token}", "expiresIn": 900}}',
    token,
)


# --- Private keys -----------------------------------------------------------------------------------------

key_pem = pem(small_rsa_key(512), "traditional")
add("private_key", f"Old deploy key for the legacy FTP sync (do not reuse):\n{key_pem}", key_pem)

p256 = ec.derive_private_key(rng.getrandbits(250), ec.SECP256R1())
key_pem = pem(p256, "traditional")
add(
    "private_key",
    f"Webhook signing key (P-256), staging only:\n{key_pem}\nPublic half is in the partner portal.",
    key_pem,
)

ed_key = ed25519.Ed25519PrivateKey.from_private_bytes(rng.randbytes(32))
key_pem = pem(ed_key, "openssh")
add(
    "private_key",
    f"Bastion key Nikhil shared in #infra so we could get in during the outage:\n{key_pem}",
    key_pem,
)

key_pem = pem(ec.derive_private_key(rng.getrandbits(250), ec.SECP256R1()), "pkcs8")
add(
    "private_key",
    f"Sign in with Apple key for the iOS app (AuthKey_8QX2M4TZ7B.p8, team 4KJ9WQ2M7L):\n{key_pem}",
    key_pem,
)

key_pem = pem(ed25519.Ed25519PrivateKey.from_private_bytes(rng.randbytes(32)), "pkcs8")
add(
    "private_key",
    f"license-signer.pem\n{key_pem}\nUsed by the activation server to sign offline licences.",
    key_pem,
)

key_pem = pem(ed25519.Ed25519PrivateKey.from_private_bytes(rng.randbytes(32)), "pkcs8-encrypted")
add(
    "private_key", f"Encrypted backup signing key (passphrase is in the vault, not here):\n{key_pem}", key_pem
)


# --- Passwords --------------------------------------------------------------------------------------------

# fmt: off
PASSWORDS = [
    "database:\n  host: db-primary.internal\n  user: billing_svc\n  password: {v}\n  pool_size: 10",
    '{"username": "reporting", "password": "{v}", "timeout": 30}',
    "On the jump host run: set PGPASSWORD={v} before the nightly pg_dump, then clear it.",
    "The wifi passphrase in the Lyon office is {v} (network Vireo-Guest).",
    "Router admin UI at the new site: login with admin and {v}, change it after the visit.",
    "SMTP_HOST=smtp.mailhost.net\nSMTP_USER=notifier\nSMTP_PASSWORD={v}\nSMTP_PORT=587",
    "[08:55] mia: what's the password for the shared Figma account?\n[08:56] jon: {v} - please don't put it in the wiki",
    "Temporary password for the new hire account jdoe is {v} and they must change it at first login.",
    "services:\n  db:\n    image: mysql:8.4\n    environment:\n      - MYSQL_ROOT_PASSWORD={v}\n      - MYSQL_DATABASE=crm",
    "Run the migration with: ./migrate --user app_admin --password '{v}' --env prod",
    "Kiosk laptop in reception: user frontdesk, pass {v}",
]
# fmt: on

for i, template in enumerate(PASSWORDS):
    value = "-".join([*rng.sample(WORDS, 3), pick(string.digits, 2)]) if i == 3 else password()
    add("password", fill(template, v=value), value)


# --- Connection strings -----------------------------------------------------------------------------------

# fmt: off
DSNS = [
    ("DATABASE_URL={v}", "postgresql://billing_rw:{pw}@pg-prod-02.internal.acme-shop.com:5432/billing?sslmode=require"),
    ("Legacy CRM still connects with {v} - migrate it to the secrets store.", "mysql://crm_app:{pw}@mysql-eu.crm.internal:3306/crm_prod"),
    ("Analytics events cluster (Atlas): {v}", "mongodb+srv://analytics:{pw}@cluster0.x7k2p.mongodb.net/events?retryWrites=true&w=majority"),
    ("Session cache moved, new REDIS_URL is {v} (db 2).", "redis://:{pw}@cache-01.internal:6379/2"),
    ("celery:\n  broker_url: {v}\n  worker_concurrency: 8", "amqps://orders_svc:{pw}@rabbit.prod.acme-shop.com:5671/orders"),
    ('appsettings.Production.json:\n"ConnectionStrings": {\n  "Finance": "{v}"\n}', "Server=tcp:sql-fin-prod.database.windows.net,1433;Initial Catalog=finance;User ID=fin_reader;Password={pw};Encrypt=True;Connection Timeout=30;"),
    ("Reporting ETL datasource: {v}", "jdbc:postgresql://pg-reporting.internal:5432/warehouse?user=etl&password={pw}&ssl=true"),
    ("Alert emails go out through {v} until the new relay is ready.", "smtp://mailer:{pw}@smtp.mailhost.net:587"),
    ("SQLALCHEMY_DATABASE_URI = '{v}'", "mysql+pymysql://inventory:{pw}@db-inv.internal:3306/inventory?charset=utf8mb4"),
]
# fmt: on

for template, dsn in DSNS:
    value = fill(dsn, pw=url_password())
    add("connection_string", fill(template, v=value), value)


# --- Clean notes ------------------------------------------------------------------------------------------

# fmt: off
CLEAN = [
    "Invoice INV-2024-00817 for $1,249.00 was paid on 2024-03-14; the remaining $312.50 is due by the end of April.",
    "Deploy of billing-api v2.14.3 finished at 14:32 UTC and took 6m 41s. Error rate back under 0.2% within ten minutes.",
    "Postgres listens on port 5432 on the new host; open it only to the app tier's security group.",
    "Reset the password via the self-service portal; support agents must never ask a customer to read it out.",
    "Card payments failed for 3% of orders between 09:00 and 09:40 CET because the acquirer had an outage. No action needed on our side.",
    "JIRA-4821: CSV export drops the last row when the report has more than 10,000 lines. Repro attached, priority P2.",
    "Bisected the regression to commit 9f2c41a; reverting it brings p95 latency back to about 180 ms.",
    "Customer asked whether we store their IBAN. Answer: no, payouts go through the PSP and we never see the full account details.",
    "Rotate the API key for the shipping integration before 30 June; the vendor deprecates v1 keys after that date.",
    "Q2 numbers: revenue €1.42M (+8.5% QoQ), churn 2.1%, NPS 47. Board deck due Thursday.",
    "Order #58823 shipped in 2 parcels, 14.6 kg total; the carrier estimates delivery in 3-5 business days.",
    "Standup 2024-05-07: Alex is finishing the token refresh bug (AUTH-311), Mei is on the email templates, nobody blocked.",
    "Runbook: if queue depth stays above 50,000 messages for more than 15 minutes, scale the workers from 4 to 12 replicas and page the on-call.",
    "Release checklist for 3.8.0:\n- bump the version in pyproject\n- tag and push\n- update CHANGELOG\n- announce in #releases at 10:00",
    "The phone support line is staffed 08:00-18:00 Monday to Friday; outside those hours tickets are answered by email within 24h.",
    "Warehouse B is at 87% capacity; we ordered 120 extra pallet slots for delivery in week 32.",
    "Refund policy: full refund within 30 days, 50% between day 31 and day 60, store credit after that.",
    "Windows build 10.0.19045.3803 is the minimum for the kiosk app; older builds crash on startup.",
    "2024-06-02T03:15:00Z INFO backup.completed db=orders size=18.4GB duration=00:42:17 files=1284",
    "Meeting notes: SSO cutover moved to 19 Aug. Legal needs the updated DPA (v4) before then.\nAction: Priya sends the draft by Friday.",
    "TLS private key material lives in Vault under secret/tls/edge; never copy it into tickets or chat.",
    "Webhook retries use exponential backoff for up to 3 days; 212 retries yesterday, all eventually delivered.",
    "SLA for P1 incidents: response within 15 minutes, resolution target 4 hours, 10% service credit per missed hour.",
    "Sprint 42 velocity was 38 points against 45 planned; carry-over: PAY-1290, PAY-1302, OPS-77.",
    "Reporting replica tuning: max_connections=200, shared_buffers=4GB, work_mem=16MB, effective_cache_size=12GB.",
    "Image digest prefix sha256:3b7e9d1f matches the signed release, safe to promote to production.",
    "Customer's card was declined twice; suggested they call their bank or use another payment method. Ticket stays open for 48h.",
    "Mobile app 5.2.1 crash-free sessions: 99.6% on iOS, 98.9% on Android. Target is 99.5% on both.",
    "Admin console JWT lifetime is 15 minutes with a 7-day refresh token; security signed off in RFC-19.",
    "Timesheet reminder: submit hours by 17:00 on Friday. Overtime above 8h a week needs manager approval.",
    "Shipping rates from 1 July: domestic +4%, EU +6.5%, rest of world unchanged.",
    "June payroll processed 312 employees, total gross €1,904,220.17, no exceptions.",
    "sku,qty,unit_price\nCHR-0042,12,89.90\nDSK-1180,3,420.00\nLMP-0007,25,19.99",
    "Enforce 2FA on all admin accounts by 15 Sep; password-only login will be switched off afterwards.",
    "Load test: 2,500 rps sustained for 30 min, p99 410 ms, CPU peaked at 72%. The search index is the bottleneck.",
    "SSH is reachable only on port 22 via the bastion; direct access from the office network was removed in CHG-5531.",
    "Customer wants the quote split into two POs: PO-77812 for hardware (€18,400) and PO-77813 for services (€6,250).",
    "Newsletter bounce rate rose to 4.3% after the list import; clean the list before the next campaign.",
    "INC-2291 postmortem: a DNS TTL of 3600s delayed failover by 47 minutes. Lower it to 300s for critical records.",
    "Feature flag new_checkout is at 25% rollout; go to 50% on Monday if the conversion delta stays above +1.2%.",
    "Disk alert on db-replica-3:\n/var/lib/postgresql 91% used (1.8TB of 2TB)\nAction: VACUUM FULL on events_2023 scheduled for 02:00.",
    "Remind customers that we can't see their card number or bank details; payment info is handled entirely by the PSP.",
    "Renewal for Contoso: 36 months at €2,150/month, 5% discount if signed before 31 October.",
    "Session policy: timeout 30 min, idle lock after 5 min, at most 3 concurrent sessions per user.",
    "The key takeaway from the retro: ship smaller PRs. Median review time was 26 hours, target is under 8.",
    "Ask the supplier for a new SSH host key fingerprint after their server migration on 12 Nov; don't accept it blindly.",
]
# fmt: on

for text in CLEAN:
    add("clean", text)
add(
    "clean",
    f"Release 2024.06 includes everything up to commit {pick(HEX, 40)}; later fixes go into 2024.07.",
)
add(
    "clean",
    f"Request id {uuid.UUID(int=rng.getrandbits(128), version=4)} in the gateway logs is the failed checkout; "
    "trace shows 2.3 s spent in the tax service.",
)


# --------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------

CARD_RUN = re.compile(r"(?<![\w-])\d(?:[ -]{0,2}\d){12,18}(?![\w-])")
EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+")


def check(rows: list[dict[str, Any]]) -> None:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    for r in rows:
        rid, category, text, sensitive = r["id"], r["category"], r["text"], r["sensitive"]
        assert r["expect"] == EXPECT[category], rid
        assert 40 <= len(text) <= 600, (rid, len(text))
        assert "{v}" not in text and "{pw}" not in text, rid
        assert bool(sensitive) == (EXPECT[category] != "clean"), rid
        for item in sensitive:
            assert item and item in text, (rid, item)
        if category == "card_valid":
            assert all(luhn_ok(s) and 13 <= len(re.sub(r"\D", "", s)) <= 19 for s in sensitive), rid
        if category == "card_invalid_luhn":
            runs = CARD_RUN.findall(text)
            assert runs and not any(luhn_ok(run) for run in runs), (rid, runs)
        if category == "clean":
            assert not any(luhn_ok(run) for run in CARD_RUN.findall(text)), rid
            assert not EMAIL_RE.search(text), rid
        if category == "iban":
            assert all(iban_ok(s) for s in sensitive), rid
        if category == "ssn":
            assert all(ssn_ok(s) for s in sensitive), rid
        if category == "ip":
            for s in sensitive:
                ipaddress.ip_address(s)
        if category == "private_key":
            for s in sensitive:
                assert s.startswith("-----BEGIN ") and s.endswith(" PRIVATE KEY-----"), rid
        if category == "jwt":
            for s in sensitive:
                head = json.loads(base64.urlsafe_b64decode(s.split(".")[0] + "=="))
                assert s.count(".") == 2 and head["alg"] in ("HS256", "RS256", "ES256"), rid
    counts = Counter(r["category"] for r in rows)
    for category, minimum in MINIMUM.items():
        assert counts[category] >= minimum, (category, counts[category], minimum)
    countries = {s[:2].upper() for r in rows if r["category"] == "iban" for s in r["sensitive"]}
    assert len(countries - {"DE", "GB"}) >= 8, countries


def main() -> None:
    check(records)
    with OUT.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts = Counter(r["category"] for r in records)
    print(f"wrote {len(records)} records to {OUT}")
    for category in EXPECT:
        print(f"  {category:<18} {counts[category]}")


if __name__ == "__main__":
    main()
