"""Generate the independent labelled PII / secret corpus ``pii_independent.jsonl``.

The corpus is a set of realistic notes that an AI agent working in a business might want to keep
in long-term memory: ticket notes, chat logs, CRM notes, log lines, config snippets, e-mails,
meeting minutes and runbooks, in US, UK, EU and Indian business styles. Some carry personal data
or secrets, many are "hard clean" notes full of look-alikes (order numbers, hashes, UUIDs,
versions, placeholders, the words password / token / key / secret without a value).

Line format (one JSON object per line)::

    {"id": "i-<category>-NNN", "category": "...", "text": "...", "sensitive": ["..."], "expect": "..."}

* ``category``: email, phone, card_valid, card_invalid_luhn, iban, ssn, ip, api_key, jwt,
  private_key, password, connection_string or clean.
* ``sensitive``: the exact substrings of ``text`` that must not reach the store. Empty for clean
  and card_invalid_luhn. A phone extension and an IP's port are not part of the item; a
  connection string is the whole DSN; a private key is the whole PEM block; for a password or an
  API key it is the value itself.
* ``expect``: "pii" (email, phone, card_valid, iban, ssn, ip), "secret" (api_key, jwt,
  private_key, password, connection_string) or "clean" (clean, card_invalid_luhn).

This corpus was written independently of the detector: its author did not read the detector's
code, rules, tests or the other corpora. Its first measure (before any change for it): 15 of its
184 sensitive texts missed (11 phone numbers in national formats, a key after "auth token", three
passwords in command-line flags or German) and 1 of its 89 clean texts flagged (a placeholder
value). The detector was then changed for those, so like the other two corpora it now measures a
detector that has seen it; the next independent measure needs a new corpus.

All values are synthetic. Names, addresses and companies are invented; US phone numbers use the
fictional 555-01xx range, UK ones the Ofcom drama ranges; many IPs come from the documentation
ranges. Card numbers, IBANs and SSNs are generated here with valid (or deliberately broken)
check digits; keys and tokens are random, JWTs are HMAC-signed with a made-up key and PEM blocks
are random bytes in a realistic DER layout, never real credentials.

The output is deterministic (fixed seed, no wall clock, no real key generation). Regenerate with
``python3 tests/memory/make_pii_independent.py`` from the repository root.
"""

import base64
import hashlib
import hmac
import json
import random
import re
import string
import struct
from pathlib import Path

SEED = 20240917
OUT = Path(__file__).resolve().with_name("pii_independent.jsonl")

rng = random.Random(SEED)

EXPECT = {
    "email": "pii",
    "phone": "pii",
    "card_valid": "pii",
    "iban": "pii",
    "ssn": "pii",
    "ip": "pii",
    "api_key": "secret",
    "jwt": "secret",
    "private_key": "secret",
    "password": "secret",
    "connection_string": "secret",
    "card_invalid_luhn": "clean",
    "clean": "clean",
}

MIN_COUNTS = {
    "email": 20,
    "phone": 25,
    "card_valid": 15,
    "card_invalid_luhn": 12,
    "iban": 15,
    "ssn": 12,
    "ip": 15,
    "api_key": 25,
    "jwt": 12,
    "private_key": 10,
    "password": 20,
    "connection_string": 15,
    "clean": 70,
}

RECORDS: list[dict[str, object]] = []
VALUES: dict[str, list[str]] = {}  # id -> substituted values (also for categories without sensitive)
_counts: dict[str, int] = {}


def add(category: str, template: str, *values: str, plain: dict[str, str] | None = None) -> None:
    """Fill ``§0§``, ``§1§`` ... with ``values`` (the labelled items) and ``§name§`` with ``plain``."""
    text = template
    for name, val in (plain or {}).items():
        text = text.replace(f"§{name}§", val)
    for i, val in enumerate(values):
        text = text.replace(f"§{i}§", val)
    if "§" in text:
        raise ValueError(f"unfilled placeholder in {category}: {text!r}")
    _counts[category] = _counts.get(category, 0) + 1
    rid = f"i-{category}-{_counts[category]:03d}"
    sensitive = [] if EXPECT[category] == "clean" else list(dict.fromkeys(values))
    RECORDS.append(
        {"id": rid, "category": category, "text": text, "sensitive": sensitive, "expect": EXPECT[category]}
    )
    VALUES[rid] = list(values)


# --------------------------------------------------------------------------- random helpers

DIGITS = string.digits
HEX = "0123456789abcdef"
ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "-_"


def rand(alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def uuid4() -> str:
    b = bytearray(rng.randbytes(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def sha1_hex() -> str:
    return hashlib.sha1(rng.randbytes(32)).hexdigest()


def sha256_hex() -> str:
    return hashlib.sha256(rng.randbytes(32)).hexdigest()


def ean13_check(body12: str) -> str:
    total = sum(int(c) * (1 if i % 2 == 0 else 3) for i, c in enumerate(body12))
    return str((10 - total % 10) % 10)


# --------------------------------------------------------------------------- cards (Luhn)


def luhn_ok(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def luhn_make(prefix: str, length: int) -> str:
    body = prefix + rand(DIGITS, length - len(prefix) - 1)
    for d in DIGITS:
        if luhn_ok(body + d):
            return body + d
    raise AssertionError("unreachable")


def luhn_break(number: str) -> str:
    bad = (int(number[-1]) + rng.randint(1, 9)) % 10
    return number[:-1] + str(bad)


def fmt_card(number: str, sep: str) -> str:
    groups = {15: (4, 6, 5), 14: (4, 6, 4)}.get(len(number), (4, 4, 4, 4))
    parts, pos = [], 0
    for g in groups:
        parts.append(number[pos : pos + g])
        pos += g
    return sep.join(parts)


# --------------------------------------------------------------------------- IBAN (mod 97)


def iban_mod97(s: str) -> int:
    s = s.replace(" ", "").upper()
    rearranged = s[4:] + s[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97


def iban_ok(s: str) -> bool:
    return iban_mod97(s) == 1


def iban_make(country: str, bban: str) -> str:
    check = 98 - int("".join(str(int(ch, 36)) for ch in bban + country + "00")) % 97
    return f"{country}{check:02d}{bban}"


def iban_spaced(iban: str) -> str:
    return " ".join(iban[i : i + 4] for i in range(0, len(iban), 4))


def bban_be() -> str:
    body = rand(DIGITS, 10)
    chk = int(body) % 97 or 97
    return f"{body}{chk:02d}"


def bban_fr() -> str:
    bank, branch, account = "20041", "01005", rand(DIGITS, 11)
    key = 97 - (89 * int(bank) + 15 * int(branch) + 3 * int(account)) % 97
    return f"{bank}{branch}{account}{key:02d}"


def _es_digit(s: str) -> str:
    weights = [1, 2, 4, 8, 5, 10, 9, 7, 3, 6]
    r = 11 - sum(int(c) * w for c, w in zip(s, weights, strict=True)) % 11
    return str({11: 0, 10: 1}.get(r, r))


def bban_es() -> str:
    bank, branch, account = "2100", "0418", rand(DIGITS, 10)
    return bank + branch + _es_digit("00" + bank + branch) + _es_digit(account) + account


def bban_no() -> str:
    weights = [5, 4, 3, 2, 7, 6, 5, 4, 3, 2]
    while True:
        body = "8601" + rand(DIGITS, 6)
        r = 11 - sum(int(c) * w for c, w in zip(body, weights, strict=True)) % 11
        if r == 10:
            continue
        return body + str(0 if r == 11 else r)


# --------------------------------------------------------------------------- JWT (HS256)

JWT_KEY = b"synthetic-corpus-hmac-key-not-a-real-secret"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_jwt(payload: dict[str, object]) -> str:
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = b64url(json.dumps(payload, separators=(",", ":")).encode())
    sig = hmac.new(JWT_KEY, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{b64url(sig)}"


# --------------------------------------------------------------------------- PEM blocks (random DER)

OID_P256 = bytes.fromhex("06082a8648ce3d030107")
OID_EC_PUBLIC_KEY = bytes.fromhex("06072a8648ce3d0201")
OID_ED25519 = bytes.fromhex("06032b6570")
OID_PBES2 = bytes.fromhex("06092a864886f70d01050d")
OID_PBKDF2 = bytes.fromhex("06092a864886f70d01050c")
OID_HMAC_SHA256 = bytes.fromhex("06082a864886f70d0209")
OID_AES256_CBC = bytes.fromhex("060960864801650304012a")


def der(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        length = bytes([n])
    elif n < 0x100:
        length = bytes([0x81, n])
    else:
        length = bytes([0x82, n >> 8, n & 0xFF])
    return bytes([tag]) + length + content


def der_int(raw: bytes) -> bytes:
    raw = raw.lstrip(b"\x00") or b"\x00"
    if raw[0] & 0x80:
        raw = b"\x00" + raw
    return der(0x02, raw)


def der_seq(*parts: bytes) -> bytes:
    return der(0x30, b"".join(parts))


def big_odd(n: int) -> bytes:
    b = bytearray(rng.randbytes(n))
    b[0] |= 0xC0
    b[-1] |= 0x01
    return bytes(b)


def rsa_pkcs1_der(bits: int = 512) -> bytes:
    n = bits // 8
    return der_seq(
        der_int(b"\x00"),
        der_int(big_odd(n)),
        der_int(b"\x01\x00\x01"),
        der_int(rng.randbytes(n)),
        der_int(big_odd(n // 2)),
        der_int(big_odd(n // 2)),
        der_int(rng.randbytes(n // 2)),
        der_int(rng.randbytes(n // 2)),
        der_int(rng.randbytes(n // 2)),
    )


def ec_sec1_der(with_params: bool = True) -> bytes:
    parts = [der_int(b"\x01"), der(0x04, rng.randbytes(32))]
    if with_params:
        parts.append(der(0xA0, OID_P256))
    parts.append(der(0xA1, der(0x03, b"\x00\x04" + rng.randbytes(64))))
    return der_seq(*parts)


def ec_pkcs8_der() -> bytes:
    return der_seq(der_int(b"\x00"), der_seq(OID_EC_PUBLIC_KEY, OID_P256), der(0x04, ec_sec1_der(False)))


def ed25519_pkcs8_der() -> bytes:
    return der_seq(der_int(b"\x00"), der_seq(OID_ED25519), der(0x04, der(0x04, rng.randbytes(32))))


def encrypted_pkcs8_der(plain_len: int) -> bytes:
    padded = plain_len + (16 - plain_len % 16)
    kdf = der_seq(
        OID_PBKDF2,
        der_seq(
            der(0x04, rng.randbytes(16)),
            der_int((2048).to_bytes(2, "big")),
            der_seq(OID_HMAC_SHA256, b"\x05\x00"),
        ),
    )
    scheme = der_seq(OID_AES256_CBC, der(0x04, rng.randbytes(16)))
    return der_seq(der_seq(OID_PBES2, der_seq(kdf, scheme)), der(0x04, rng.randbytes(padded)))


def ssh_str(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def openssh_ed25519_blob(comment: bytes) -> bytes:
    pub = rng.randbytes(32)
    priv = rng.randbytes(32)
    key_type = b"ssh-ed25519"
    check = rng.randbytes(4)
    section = check + check + ssh_str(key_type) + ssh_str(pub) + ssh_str(priv + pub) + ssh_str(comment)
    pad = 1
    while len(section) % 8:
        section += bytes([pad])
        pad += 1
    return (
        b"openssh-key-v1\x00"
        + ssh_str(b"none")
        + ssh_str(b"none")
        + ssh_str(b"")
        + struct.pack(">I", 1)
        + ssh_str(ssh_str(key_type) + ssh_str(pub))
        + ssh_str(section)
    )


def ssh_ed25519_public() -> str:
    return base64.b64encode(ssh_str(b"ssh-ed25519") + ssh_str(rng.randbytes(32))).decode()


def pem(label: str, data: bytes, width: int = 64, headers: list[str] | None = None) -> str:
    b64 = base64.b64encode(data).decode()
    lines = [f"-----BEGIN {label}-----"]
    if headers:
        lines += [*headers, ""]
    lines += [b64[i : i + width] for i in range(0, len(b64), width)]
    lines.append(f"-----END {label}-----")
    return "\n".join(lines)


# =========================================================================== email

EMAILS = [
    (
        "Ticket #48213: customer asked to switch the billing contact to §0§ from the next invoice "
        "cycle. Confirmed on the call, updated in Zuora.",
        "m.delacroix@fabrikam.com",
    ),
    (
        "From: Priya Raman <§0§>\nTo: Accounts Payable\nSubject: Re: INV-2024-0931 overdue\n\n"
        "Hi team, payment was released today via NEFT; the UTR will follow by evening.\nRegards, Priya",
        "priya.raman@example.co.in",
    ),
    (
        "CRM note - lead from the 12 March webinar. Contact: Tomás Herrera (procurement), §0§. "
        "Interested in the 50-seat plan, wants a quote in EUR before the Q3 budget freeze.",
        "tomas.herrera@contoso.es",
    ),
    (
        "2024-05-02T09:14:22Z INFO auth.login success user=§0§ tenant=acme-eu mfa=totp latency_ms=182",
        "j.whitfield@northwindtraders.com",
    ),
    (
        "Minutes - vendor sync 14/06\n- Legal reviewed the MSA, two redlines left\n"
        "- Action: send SOW draft to §0§ and cc §1§ by Friday\n- Next review 28/06",
        "h.schneider@fabrikam.de",
        "anna.berg@contoso.se",
    ),
    (
        "name,email,plan,seats\nJ. Okafor,§0§,enterprise,120\nK. Mensah,§1§,team,15",
        "j.okafor@example.com",
        "kwame.mensah@example.org",
    ),
    (
        "Kundin bittet um Rückruf wegen Rechnung RE-2024-5521. Antwort bitte an §0§ schicken, "
        "nicht mehr an die alte Adresse.",
        "sabine.vogel@example.de",
    ),
    (
        "Note CRM : le contact principal chez Fabrikam France est désormais §0§ (remplace l'ancien "
        "responsable achats depuis le 1er avril).",
        "claire.moreau@fabrikam.fr",
    ),
    (
        'Partner page footer copy: Questions about the reseller programme? <a href="mailto:§0§">Write '
        "to Adam, your partner manager</a>.",
        "adam.kowalski@contoso.pl",
    ),
    (
        "Signup failed twice for §0§ - the plus-address gets rejected by the validator on the legacy "
        "form. Repro on staging with any '+' address.",
        "lena.fischer+trials@example.com",
    ),
    (
        "Customer wrote their email as §0§ on the paper form. Normalise to lower case before the CRM "
        "import or the dedupe will miss it.",
        "RAHUL.MEHTA@EXAMPLE.CO.IN",
    ),
    (
        "[10:42] dana: can someone add §0§ to #billing-escalations?\n[10:43] ops-bot: added\n[10:44] dana: "
        "ty",
        "sam.oconnor@contoso.ie",
    ),
    (
        "Runbook: if the nightly export fails twice in a row, page on-call and email the data owner "
        "(§0§) with the job id and the last error line.",
        "wei.zhang@northwindtraders.com",
    ),
    (
        "Vendor onboarding - GSTIN verification pending. Accounts contact is Mr. Suresh Iyer, §0§; he "
        "prefers email over calls.",
        "suresh.iyer@example.in",
    ),
    (
        "Bounce: delivery to §0§ failed permanently (550 5.1.1 user unknown). Check whether she moved "
        "to the new group domain after the merger.",
        "l.nguyen@mail.corp.northwindtraders.com",
    ),
    (
        "Hi Mark, thanks for reaching out. I've forwarded your refund request to my colleague §0§; she "
        "will reply within two business days.",
        "grace.adeyemi@contoso.co.uk",
    ),
    (
        '{"customer_id": "C-88213", "contact_email": "§0§", "locale": "en-GB", "marketing_opt_in": false}',
        "oliver.brown84@example.co.uk",
    ),
    (
        "Nota para el equipo: el cliente pidió que las facturas se envíen a §0§ a partir de julio.",
        "m.garcia.lopez@example.es",
    ),
    (
        "Reminder to self: Olu's personal address is §0§ - only for the offsite invite, not for work "
        "threads.",
        "olu_adeyemi-87@example.net",
    ),
    (
        "fix(billing): round VAT per line item instead of per invoice\n\nCloses FIN-2291.\n\n"
        "Co-authored-by: Mei Tanaka <§0§>",
        "mei.tanaka@example.jp",
    ),
]
for template, *vals in EMAILS:
    add("email", template, *vals)

# =========================================================================== phone

PHONES = [
    (
        "Customer callback requested on §0§, best after 3pm ET. Re: delayed order A-20931, offer free "
        "expedited shipping.",
        "(212) 555-0147",
    ),
    (
        "Spoke with the facilities manager, direct line §0§ ext. 204. He can sign the lease addendum next "
        "week.",
        "+1 415-555-0199",
    ),
    (
        "Contact card\nName: Denise Carter\nTitle: Controller\nOffice: §0§\nPreferred: email first",
        "312.555.0123",
    ),
    (
        "Escalation path for the Chicago warehouse: night supervisor at §0§, then the regional lead.",
        "1-773-555-0186",
    ),
    ("Caller left a voicemail, wants a quote for 40 licences. Number: §0§ x31.", "+1 (646) 555-0162"),
    (
        "UK office switchboard moved. New number for the Holborn team: §0§ (ask for accounts).",
        "+44 20 7946 0958",
    ),
    (
        "Delivery driver couldn't find the unit; customer's mobile is §0§, ring 10 minutes before arrival.",
        "07700 900461",
    ),
    (
        "Meeting minutes 03/04 - Manchester branch. Actions: Gareth to confirm the stock count and call "
        "the landlord back on §0§ by Thursday.",
        "0161 496 0732",
    ),
    (
        "Supplier in Leeds only answers the landline: §0§. Their email bounces since the IT migration.",
        "0044 113 496 0215",
    ),
    (
        "Rückrufbitte von Herrn Becker (Einkauf), Tel. §0§, bezüglich Lieferverzug Auftrag 4500123.",
        "+49 (0)89 2190 4432",
    ),
    (
        "Ansprechpartnerin Vertrieb Hamburg: Frau Lange, mobil §0§, Festnetz §1§.",
        "0151 2398 7710",
        "040 3344 5566",
    ),
    (
        "Le client souhaite être rappelé au §0§ avant 18h. Sujet : renouvellement du contrat de maintenance.",
        "01 99 00 27 41",
    ),
    ("Contact Lyon : Mme Petit, portable §0§. Préfère WhatsApp pour les urgences.", "06.39.98.44.10"),
    ("Intl format for the Paris reseller in the CRM: §0§ (Julien, sales).", "+33 6 39 98 12 07"),
    (
        "Bengaluru vendor contact: Mr. Karthik, §0§. Follow up on the PO-7781 delivery schedule.",
        "+91 98450 12345",
    ),
    (
        "Escalation matrix (Mumbai ops):\nL1 - helpdesk ticket\nL2 - Neha Kulkarni, §0§\nL3 - vendor TAM",
        "+91-22-4123-5678",
    ),
    (
        "Tenant in Pune gave her number as §0§ on the rental form; please add it to the CRM record.",
        "098450 67812",
    ),
    (
        "Cliente de São Paulo pediu retorno pelo WhatsApp §0§ sobre a nota fiscal pendente.",
        "+55 11 98765-4321",
    ),
    ("Rio office landline: §0§. Reception closes at 18h local time.", "(21) 3456-7890"),
    ("Tokyo distributor contact: Mr. Sato, tel §0§ (office hours JST only).", "+81 3-5550-1234"),
    ("Osaka site lead mobile §0§, use only for after-hours outages.", "090-5550-8812"),
    ("Sydney customer wants a callback on §0§ regarding the failed direct debit.", "0491 570 156"),
    (
        "AU partner contact sheet: §0§ (mobile), §1§ (office, Mon-Fri).",
        "+61 491 570 110",
        "(02) 5550 1234",
    ),
    ("Madrid client: call Lucía at §0§ to confirm the installation slot on Tuesday.", "+34 912 345 678"),
    ("Amsterdam team night contact: §0§, otherwise follow the NOC rota.", "0031 20 555 0134"),
]
for template, *vals in PHONES:
    add("phone", template, *vals)

# =========================================================================== card_valid

CARD_VALID = [
    (
        "Phone payment for INV-2024-1187: customer read out card §0§ exp 08/27. Processed manually on "
        "the virtual terminal, receipt emailed.",
        "4",
        16,
        " ",
    ),
    (
        "Chat transcript\n[14:02] customer: can you just charge my card §0§\n[14:02] agent: I can't take "
        "card details in chat, please use the secure payment link.",
        "4",
        16,
        "-",
    ),
    (
        "Refund ticket #55102: original charge on §0§, amount $129.00, reason: duplicate subscription.",
        "2221",
        16,
        "-",
    ),
    (
        "Corporate card for travel bookings (Finance dept): §0§ - use for flights only, hotels go on the "
        "Amex.",
        "51",
        16,
        " ",
    ),
    (
        "Log excerpt (should have been masked!):\n2024-02-11 10:31:07 WARN payment.gateway retry "
        "card=§0§ amount=49.99 currency=GBP attempt=2",
        "4",
        16,
        "",
    ),
    (
        "Kunde hat seine Kreditkartennummer per E-Mail geschickt: §0§. Bitte löschen und über das "
        "Zahlungsportal neu anfordern.",
        "55",
        16,
        " ",
    ),
    (
        "Amex on file for the London office supplies account: §0§, billing postcode on the vendor form.",
        "34",
        15,
        " ",
    ),
    (
        "Booking note: guest guaranteed the room with §0§ (Amex). Late arrival expected around 23:00.",
        "37",
        15,
        "",
    ),
    (
        "Discover card §0§ declined for insufficient funds; customer will call back with another card.",
        "6011",
        16,
        " ",
    ),
    (
        "Customer's Discover: §0§ - pasted by the customer into the support form, ticket #71234.",
        "65",
        16,
        "-",
    ),
    ("Tokyo reseller pays by JCB: §0§, monthly charge on the 25th.", "3530", 16, " "),
    (
        'Payment failed webhook payload: {"card_number": "§0§", "brand": "jcb", "decline_code": '
        '"do_not_honor"}',
        "3589",
        16,
        "",
    ),
    (
        "Diners Club corporate card §0§ was used for the client dinner on 14/03, expense claim EXP-3391.",
        "36",
        14,
        " ",
    ),
    (
        "Old Diners card §0§ still attached to the legacy billing profile, remove it per the PCI clean-up.",
        "305",
        14,
        "-",
    ),
    (
        "Numéro de carte donné au téléphone par le client : §0§ (Mastercard), pour régler la facture "
        "F-2024-0412.",
        "2410",
        16,
        " ",
    ),
]
for template, prefix, length, sep in CARD_VALID:
    add("card_valid", template, fmt_card(luhn_make(prefix, length), sep))

# =========================================================================== card_invalid_luhn

CARD_INVALID = [
    (
        "Customer read out §0§ but the terminal rejected it as an invalid number - probably a misheard "
        "digit. Asked them to use the payment link instead.",
        "4",
        16,
        " ",
    ),
    ("Card on file per the old spreadsheet: §0§ (Visa). Finance says it matches no account.", "4", 16, "-"),
    (
        "Test data for the checkout form: §0§ must be rejected client-side with 'Invalid card number'.",
        "4",
        16,
        "",
    ),
    (
        "Fraud review: order #88410 used card §0§, which fails the checksum - bot traffic, order cancelled.",
        "53",
        16,
        " ",
    ),
    (
        "Ticket #61220: customer typed §0§ in the card field and got E_CARD_INVALID. Explained the number "
        "has a typo.",
        "2500",
        16,
        "-",
    ),
    (
        "Kunde nannte am Telefon die Nummer §0§, das Terminal meldet 'Kartennummer ungültig'. Rückruf "
        "vereinbart.",
        "52",
        16,
        "",
    ),
    ("Import warning row 214: card_number=§0§ failed validation, row skipped.", "54", 16, ""),
    (
        "Amex number transcribed from the fax: §0§ - does not validate, requested a fresh authorisation "
        "form.",
        "37",
        15,
        " ",
    ),
    (
        "Discover card §0§ bounced at validation on the web form; customer confirmed they swapped two "
        "digits.",
        "6011",
        16,
        "-",
    ),
    (
        "JCB entry §0§ from the Osaka booking fails the Luhn check, hotel asked the guest to re-enter it.",
        "3566",
        16,
        " ",
    ),
    (
        "Diners number §0§ on the legacy profile is malformed; the migration script marked it invalid.",
        "36",
        14,
        "",
    ),
    (
        "Mastercard §0§ rejected by the gateway pre-check (invalid_number) - no charge attempted.",
        "2720",
        16,
        " ",
    ),
]
for template, prefix, length, sep in CARD_INVALID:
    add("card_invalid_luhn", template, fmt_card(luhn_break(luhn_make(prefix, length)), sep))

# =========================================================================== iban

IBANS = [
    (
        "Supplier bank details updated (verified by call-back): Commerzbank, IBAN §0§, BIC COBADEFFXXX. "
        "Effective from the May payment run.",
        "DE",
        lambda: "37040044" + rand(DIGITS, 10),
        "spaced",
    ),
    (
        "Refund to customer by bank transfer - IBAN §0§, account name Mr D Hughes. Approved by the finance "
        "lead.",
        "GB",
        lambda: "NWBK601613" + rand(DIGITS, 8),
        "compact",
    ),
    (
        "Coordonnées bancaires du fournisseur : IBAN §0§ - à saisir dans SAP avant le virement de fin de "
        "mois.",
        "FR",
        bban_fr,
        "spaced",
    ),
    (
        "Datos bancarios del proveedor: IBAN §0§ (CaixaBank). Pago a 60 días fecha factura.",
        "ES",
        bban_es,
        "spaced",
    ),
    (
        "Rimborso cliente approvato: IBAN §0§, intestato a Marco Bianchi.",
        "IT",
        lambda: "X0542811101" + rand(DIGITS, 12),
        "compact",
    ),
    (
        "Payroll change request: new account §0§ for employee E-10482, effective next cycle.",
        "NL",
        lambda: "ABNA" + rand(DIGITS, 10),
        "lower",
    ),
    ("SEPA mandate form received, IBAN §0§, mandate ref MNDT-2024-0081.", "BE", bban_be, "spaced"),
    (
        "Swiss subsidiary account for intercompany transfers: §0§ (UBS, CHF).",
        "CH",
        lambda: "00762" + rand(DIGITS, 12),
        "spaced",
    ),
    (
        "Kontoänderung vom Kunden per Brief: neue IBAN §0§, alte Bankverbindung bitte sperren.",
        "AT",
        lambda: "19043" + rand(DIGITS, 11),
        "spaced",
    ),
    (
        "Customer in Dublin paying by transfer asked us to refund to §0§ instead of the card.",
        "IE",
        lambda: "AIBK931152" + rand(DIGITS, 8),
        "compact",
    ),
    (
        "Faktura FV/2024/03/118 - płatność na rachunek IBAN §0§, termin 14 dni.",
        "PL",
        lambda: "1090" + rand(DIGITS, 20),
        "spaced",
    ),
    (
        "Expense reimbursement: employee entered §0§ in the form (lower case, copied as-is).",
        "SE",
        lambda: "500" + rand(DIGITS, 17),
        "lower_spaced",
    ),
    (
        "Dados para transferência: IBAN §0§, titular Ana Sousa.",
        "PT",
        lambda: "00020123" + rand(DIGITS, 13),
        "spaced",
    ),
    (
        "Luxembourg fund administrator - distribution account §0§ for the Q2 payout.",
        "LU",
        lambda: "001" + rand(DIGITS + string.ascii_uppercase, 13),
        "compact",
    ),
    ("Norwegian contractor invoice: pay to iban §0§ within 14 days.", "NO", bban_no, "lower"),
]
for template, country, make_bban, style in IBANS:
    iban = iban_make(country, make_bban())
    shown = {
        "spaced": iban_spaced(iban),
        "compact": iban,
        "lower": iban.lower(),
        "lower_spaced": iban_spaced(iban).lower(),
    }[style]
    add("iban", template, shown)

# =========================================================================== ssn


def make_ssn() -> tuple[str, str, str]:
    while True:
        area = rng.randint(1, 899)
        if area != 666:
            return f"{area:03d}", f"{rng.randint(1, 99):02d}", f"{rng.randint(1, 9999):04d}"


SSNS = [
    (
        "HR onboarding checklist for the Denver hire: I-9 done, SSN §0§ entered in ADP, direct deposit "
        "pending.",
        "-",
    ),
    ("W-9 received from the contractor; SSN: §0§. File it in the vendor folder, not in the ticket.", "-"),
    (
        "Social security number §0§ appears in the scanned lease application - redact before sending to "
        "the landlord.",
        " ",
    ),
    (
        "Benefits enrollment issue: employee's SSN was keyed as §0§ but the carrier has a different number "
        "on file.",
        "-",
    ),
    ("Payroll import row 18: name=R. Alvarez, SSN#§0§, state=TX, status=active", ""),
    ("Credit check request - applicant social security no. §0§, consent form signed 03/12/2024.", ""),
    ("Background check vendor needs SSN §0§ (spaces as written) for the candidate starting Monday.", " "),
    ("Patient intake note: insurance subscriber SSN §0§, relationship: spouse.", "-"),
    ("1099-NEC correction: payee TIN/SSN §0§, amount $4,850.00, tax year 2023.", ""),
    (
        "[09:15] user: my social is §0§, can you look up my account?\n[09:15] agent: please don't share "
        "that here, I'll verify you another way.",
        " ",
    ),
    ("Tenant screening form: SSN (no dashes) §0§, employer verified by phone.", ""),
    ("Employee record update - Social Security No: §0§; W-4 updated for 2024.", "-"),
]
for template, sep in SSNS:
    add("ssn", template, sep.join(make_ssn()))

# =========================================================================== ip

IPS = [
    ("Firewall change CHG-2211: allow inbound 443 from the partner gateway §0§ only.", "203.0.113.42"),
    (
        "Customer's monitoring probe hits us from §0§:8443; whitelist the address, not the port range.",
        "198.51.100.7",
    ),
    ("Suspicious logins from §0§ on 3 accounts within 5 minutes; blocked at the WAF.", "192.0.2.15"),
    ("Kunde meldet Zugriff von §0§ (Geo: DE); der Login-Versuch wurde blockiert.", "91.64.213.18"),
    ("Our office egress for the Bengaluru VPN is §0§; add it to the SaaS allow-list.", "49.207.55.112"),
    (
        "IPv6 address of the reporting host (full form from the NIC config): §0§",
        "2001:0db8:85a3:0000:0000:8a2e:0370:7334",
    ),
    ("AAAA record for api-eu points to §0§ since the migration on 02/05.", "2001:db8:4006:812::200e"),
    ("Health check to [§0§]:443 failing from the Frankfurt probe, the IPv4 path is fine.", "2001:db8::1f"),
    ("Add §0§/32 to the admin allow-list (this is the CFO's home connection).", "198.51.100.23"),
    (
        '2024-04-09T22:41:07Z WARN auth rate_limited client_ip=§0§ user_agent="okhttp/4.12.0" attempts=31',
        "73.158.44.201",
    ),
    (
        "Request headers captured:\nX-Forwarded-For: §0§, §1§\nX-Request-Id: req_8842f1",
        "203.0.113.195",
        "198.51.100.17",
    ),
    (
        '§0§ - - [12/Mar/2024:10:22:01 +0000] "GET /api/v2/orders HTTP/1.1" 200 512 "-" "Mozilla/5.0"',
        "86.141.22.9",
    ),
    (
        "Customer's home router got §0§ from the ISP; they can't reach the portal over IPv6.",
        "2a02:c7f:8a12:3e00:5d1b:9f2c:1e4:77a0",
    ),
    ("Static IP assigned to the Lisbon branch router: §0§, gateway on the same /29.", "188.81.140.66"),
    (
        "Ticket #60112: user on hotel wifi, public address §0§, can't get past the captive portal with VPN "
        "on.",
        "2001:db8:0:0:1:0:0:1",
    ),
]
for template, *vals in IPS:
    add("ip", template, *vals)

# =========================================================================== api_key

AWS_ID = string.ascii_uppercase + "234567"
AWS_SECRET = ALNUM + "/+"

add(
    "api_key",
    "~/.aws/credentials from the build box (rotate ASAP):\n[default]\naws_access_key_id = §0§\n"
    "aws_secret_access_key = §1§\nregion = eu-west-1",
    "AKIA" + rand(AWS_ID, 16),
    rand(AWS_SECRET, 40),
)
add(
    "api_key",
    "export AWS_ACCESS_KEY_ID=§0§\nexport AWS_SECRET_ACCESS_KEY=§1§\n# used by the nightly backup cron on "
    "reporting-01",
    "AKIA" + rand(AWS_ID, 16),
    rand(AWS_SECRET, 40),
)
add(
    "api_key",
    "Security alert: access key §0§ was committed to a public gist at 02:14 UTC. IAM user ci-deployer, "
    "key deactivated, incident SEC-412.",
    "AKIA" + rand(AWS_ID, 16),
)
add(
    "api_key",
    "GitHub PAT for the release bot: §0§ (repo + workflow scopes, expires in 90 days).",
    "ghp_" + rand(ALNUM, 36),
)
add(
    "api_key",
    "Fine-grained token for the docs repo, read-only, until end of sprint:\n§0§",
    "github_pat_" + rand(string.ascii_uppercase + DIGITS, 22) + "_" + rand(ALNUM, 59),
)
add("api_key", "GITLAB_TOKEN=§0§  # group-level, used by renovate", "glpat-" + rand(URLSAFE, 20))
add(
    "api_key",
    "Slack bot token for the #alerts integration: §0§ - stored here until we move it to Vault.",
    f"xoxb-{rand(DIGITS, 12)}-{rand(DIGITS, 13)}-{rand(ALNUM, 24)}",
)
add(
    "api_key",
    "[11:03] raj: here's my slack token for the export script §0§\n[11:04] lead: please revoke that and "
    "use the app",
    f"xoxp-{rand(DIGITS, 12)}-{rand(DIGITS, 12)}-{rand(DIGITS, 13)}-{rand(HEX, 32)}",
)
add("api_key", "stripe:\n  secret_key: §0§\n  webhook_tolerance: 300", "sk_live_51" + rand(ALNUM, 97))
add(
    "api_key",
    "Restricted Stripe key for the reporting job (read charges only): §0§",
    "rk_live_" + rand(ALNUM, 24),
)
add("api_key", "OPENAI_API_KEY=§0§", "sk-proj-" + rand(URLSAFE, 74) + "T3BlbkFJ" + rand(URLSAFE, 74))
add(
    "api_key",
    "Support bot config moved to the new project; the old key §0§ still works until Friday.",
    "sk-" + rand(ALNUM, 20) + "T3BlbkFJ" + rand(ALNUM, 20),
)
add(
    "api_key",
    'const firebaseConfig = {\n  apiKey: "§0§",\n  authDomain: "acme-shop-prod.firebaseapp.com",\n'
    '  projectId: "acme-shop-prod"\n};',
    "AIza" + rand(URLSAFE, 35),
)
add(
    "api_key",
    "Maps geocoding failing with 403: GET "
    "https://maps.googleapis.com/maps/api/geocode/json?address=Berlin&key=§0§",
    "AIza" + rand(URLSAFE, 35),
)
add(
    "api_key",
    "SENDGRID_API_KEY=§0§  # transactional mail, prod",
    "SG." + rand(URLSAFE, 22) + "." + rand(URLSAFE, 43),
)
add(
    "api_key",
    "Twilio SMS OTP service: account SID §sid§, auth token §0§. Move to the secrets manager.",
    rand(HEX, 32),
    plain={"sid": "AC" + rand(HEX, 32)},
)
add(
    "api_key",
    ".npmrc on the CI runner:\n//registry.npmjs.org/:_authToken=§0§\nalways-auth=true",
    "npm_" + rand(ALNUM, 36),
)
add(
    "api_key",
    "HF token for pulling the private fine-tuned model: §0§ (read scope).",
    "hf_" + rand(string.ascii_letters, 34),
)
add(
    "api_key",
    "curl -s https://api.partner-logistics.example/v2/shipments \\\n  -H 'X-API-Key: §0§' \\\n"
    "  -H 'Accept: application/json'",
    rand(ALNUM, 32),
)
add(
    "api_key",
    '{\n  "service": "geo-enrichment",\n  "apiKey": "§0§",\n  "timeoutMs": 2500\n}',
    rand(HEX, 40),
)
add("api_key", "DD_API_KEY=§0§\nDD_SITE=datadoghq.eu\nDD_ENV=prod", rand(HEX, 32))
add("api_key", "Mailgun sending key (EU region) for the invoice mailer: §0§", "key-" + rand(HEX, 32))
add(
    "api_key",
    "Azure APIM call: Ocp-Apim-Subscription-Key: §0§ - the partner says it is their production subscription.",
    rand(HEX, 32),
)
add("api_key", "Shopify admin API token for the store sync app: §0§", "shpat_" + rand(HEX, 32))
add(
    "api_key",
    "ANTHROPIC_API_KEY=§0§ set in the staging secrets, do not paste it anywhere else.",
    "sk-ant-api03-" + rand(URLSAFE, 93) + "AA",
)

# =========================================================================== jwt

JWTS = [
    (
        "curl -H 'Authorization: Bearer §0§' https://api.internal.example/v1/me  # 401 after 15 min",
        {"sub": "usr_48213", "role": "admin", "iat": 1718000000, "exp": 1718000900},
    ),
    (
        '2024-06-18 08:02:11 DEBUG gateway forwarded path=/orders auth_header="Bearer §0§"',
        {"iss": "https://auth.acme.example", "sub": "svc-gateway", "aud": "orders", "iat": 1718697731},
    ),
    (
        "Set-Cookie: session=§0§; Path=/; HttpOnly; Secure; SameSite=Lax",
        {"sid": "c1f0a9e2", "uid": 88213, "iat": 1712131200, "exp": 1712217600},
    ),
    (
        '{"access_token": "§0§", "token_type": "Bearer", "expires_in": 3600}',
        {"sub": "client_7f21", "scope": "read:invoices write:invoices", "iat": 1709251200, "exp": 1709254800},
    ),
    (
        "[16:20] dev: this is the token I'm testing with, it keeps failing the signature check:\n§0§",
        {"sub": "1029", "tenant": "acme-eu", "roles": ["support"], "iat": 1715600000},
    ),
    (
        "Postman environment 'staging': baseUrl=https://staging.api.example.com, jwt=§0§",
        {"sub": "qa-bot", "env": "staging", "iat": 1716000000, "exp": 1747536000},
    ),
    (
        "Websocket connects fine with wss://rt.example.net/socket?token=§0§ but drops after 60 s.",
        {"uid": "u_5521", "ch": "orders", "iat": 1714000000},
    ),
    (
        "OIDC callback hit with id_token=§0§&state=af0ifjsldkj",
        {
            "iss": "https://login.example.org",
            "aud": "crm-web",
            "sub": "248289761001",
            "nonce": "n-0S6_WzA2Mj",
        },
    ),
    (
        ".env.local\nVITE_API_URL=https://api.example.com\nVITE_DEV_JWT=§0§",
        {"sub": "dev-local", "admin": True, "iat": 1711929600},
    ),
    (
        "HAR export from the customer's browser, request header -> authorization: Bearer §0§",
        {"sub": "cus_33910", "plan": "pro", "iat": 1717200000, "exp": 1717203600},
    ),
    (
        "Ticket #90215: Kunde schickt seinen Token zur Fehleranalyse: §0§ - bitte nicht im Ticket speichern.",
        {"sub": "kd-44120", "locale": "de-DE", "iat": 1713000000},
    ),
    (
        "Service-to-service token billing -> ledger (long-lived, must rotate): §0§",
        {"iss": "billing", "aud": "ledger", "svc": True, "iat": 1704067200},
    ),
]
for template, payload in JWTS:
    add("jwt", template, make_jwt(payload))

# =========================================================================== private_key

add(
    "private_key",
    "Found on the shared drive (old Jenkins signing key) - revoke and delete:\n§0§",
    pem("RSA PRIVATE KEY", rsa_pkcs1_der()),
)
add(
    "private_key",
    "Legacy app server key, passphrase is in the old wiki:\n§0§",
    pem(
        "EC PRIVATE KEY",
        rng.randbytes(128),
        headers=["Proc-Type: 4,ENCRYPTED", "DEK-Info: AES-128-CBC," + rand("0123456789ABCDEF", 32)],
    ),
)
add(
    "private_key",
    "Contents of certs/webhook-signing.key (prod):\n§0§",
    pem("EC PRIVATE KEY", ec_sec1_der()),
)
add(
    "private_key",
    '{"type": "service_account", "project_id": "acme-analytics", "private_key_id": "§kid§", '
    '"private_key": "§0§"}',
    pem("PRIVATE KEY", ec_pkcs8_der()).replace("\n", "\\n") + "\\n",
    plain={"kid": rand(HEX, 40)},
)
add(
    "private_key",
    "[09:12] ops: deploy key for the build box, put it in ~/.ssh/id_ed25519\n§0§",
    pem("OPENSSH PRIVATE KEY", openssh_ed25519_blob(b"deploy@build-01"), width=70),
)
add(
    "private_key",
    "Runbook RB-031 step 4 (bastion access), key as provided by the vendor:\n§0§",
    pem("OPENSSH PRIVATE KEY", openssh_ed25519_blob(b"vendor-support"), width=70),
)
add(
    "private_key",
    "kubectl get secret shop-tls -o yaml, tls.key decoded:\n§0§",
    pem("RSA PRIVATE KEY", rsa_pkcs1_der()),
)
add(
    "private_key",
    "Ed25519 signing key for the licence server (do not commit):\n§0§",
    pem("PRIVATE KEY", ed25519_pkcs8_der()),
)
add(
    "private_key",
    "Encrypted key for the payment HSM bridge; the password is shared separately by phone.\n§0§",
    pem("ENCRYPTED PRIVATE KEY", encrypted_pkcs8_der(138)),
)
add(
    "private_key",
    "APNs auth key AuthKey_7K2M9X4Q1B.p8 for the iOS app:\n§0§",
    pem("PRIVATE KEY", ec_pkcs8_der()),
)

# =========================================================================== password

PASSWORDS = [
    (
        "The admin password for the staging Jenkins is §0§ - change it after Thursday's demo.",
        "Jnk!ns-St4g3-2024",
    ),
    (
        "smtp:\n  host: smtp.mailrelay.example.net\n  port: 587\n  username: notifications\n"
        "  password: §0§\n  starttls: true",
        "xR7#vLq2!pZ9mT4e",
    ),
    (".env\nDB_HOST=orders-db.internal\nDB_USER=orders_app\nDB_PASSWORD=§0§", "h4Vt9wKq2LmZ8sRb"),
    ("mysql -u report -p'§0§' -h reporting-db.internal sales   # from the finance runbook", "R3p0rt!ng#77"),
    ("PGPASSWORD=§0§ pg_dump -h analytics-db.internal -U etl warehouse > /backups/wh.sql", "etl_Pa55_2024"),
    ("Access for the vendor portal (temporary):\nuser: ops-admin / pass: §0§", "Blu3Falcon$88"),
    ("The wifi password is §0§ (network ACME-Guest, 2.4 GHz only).", "sunflower-orbit-42"),
    ("sshpass -p '§0§' ssh deploy@build-01 'sudo systemctl restart app'", "D3ploy#Night"),
    ("docker login registry.acme.io -u ci-bot --password §0§", "t6QpW2zLx9NcV4bKm8Ha"),
    ("[smtp]\nuser = mailer\npass = §0§\nport = 465", "M@iler2023!"),
    (
        "<datasource>\n  <username>crm_ro</username>\n  <password>§0§</password>\n</datasource>",
        "Cr!mson_Tide_19",
    ),
    (
        "WLAN-Passwort für den Besprechungsraum im 3. OG: §0§ - bitte nicht an Besucher weitergeben.",
        "Kaffee&Kuchen2024",
    ),
    ("Mot de passe du compte admin du NAS : §0§ (à changer après l'installation).", "Nas-Admin!Lyon7"),
    (
        "[15:47] tom: pwd for the shared analytics login is §0§ btw\n[15:48] sara: pls don't post that here",
        "Tableau#2024q2",
    ),
    (
        "Onboarding 04/03 - temp password issued to the new joiner in Pune: §0§ (must change at first "
        "login).",
        "Welcome@Pune123",
    ),
    ("Ticket #7731: reset the kiosk admin password to §0§ as requested by the store manager.", "Kiosk!4471"),
    (
        '{"username": "svc-export", "password": "§0§", "endpoint": "https://sftp.partner.example/upload"}',
        "v8#Lk2$Qw9!zR",
    ),
    (
        "spring.datasource.url=jdbc:postgresql://billing-db:5432/billing\n"
        "spring.datasource.username=billing\n"
        "spring.datasource.password=§0§",
        "B1ll!ngS3cure",
    ),
    (
        "Office router admin login is admin / §0§ - note it in the asset register, then delete this message.",
        "Airtel@Blr2024",
    ),
    ("net user backupsvc §0§ /add /domain", "Bkp$vc-2024-Q1"),
]
for template, *vals in PASSWORDS:
    add("password", template, *vals)

# =========================================================================== connection_string

CONNS = [
    ("DATABASE_URL=§0§", "postgres://app_user:Xk9vP2mQ7wLr@orders-db.prod.acme.internal:5432/orders"),
    (
        "Analytics warehouse DSN (from the old runbook, rotate!): §0§",
        "postgresql://analytics:tR4%23nB8zQ1@pg-analytics-02.c9xk2.eu-west-1.rds.amazonaws.com:5432/"
        "warehouse?sslmode=require",
    ),
    (
        "config/database.yml -> production:\n  url: §0§\n  pool: 10",
        "mysql://shop:Sh0pDb-2024!@mysql-primary.shop.internal:3306/storefront",
    ),
    (
        "Atlas connection string for the CRM service: §0§ - pasted into the ticket by mistake, move it "
        "to the secret store.",
        "mongodb+srv://crm_service:Lq7zV3xN9pKe2Tw@cluster0.ab1cd.mongodb.net/crm?retryWrites=true&w=majority",
    ),
    (
        "Reporting replica set URI:\n§0§",
        "mongodb://reporting:m0ng0R3p0rt@mongo-1.internal:27017,mongo-2.internal:27017,"
        "mongo-3.internal:27017/reports?replicaSet=rs0&authSource=admin",
    ),
    ("celery broker: REDIS_URL=§0§", "redis://:c4chePassw0rd77@cache.prod.internal:6379/0"),
    (
        "Redis Cloud endpoint shared by the vendor: §0§ (TLS required).",
        "rediss://default:Rz8Kq2Vn5Lp1Xw@redis-12345.c1.eu-west-1-2.ec2.cloud.redislabs.com:12345",
    ),
    (
        'RabbitMQ URL in the orders service settings.py: BROKER_URL = "§0§"',
        "amqp://orders:Amqp_0rd3rs!@rabbitmq.internal:5672/orders-vhost",
    ),
    (
        "Amazon MQ broker for billing events: §0§",
        "amqps://billing:Qm2Xz8Lw4Nv6@b-1a2b3c4d.mq.eu-central-1.amazonaws.com:5671",
    ),
    (
        '"ConnectionStrings": {\n  "DefaultConnection": "§0§"\n}',
        "Server=sql-prod-01;Database=CRM;User Id=crm_app;Password=Cr#mApp2024!;TrustServerCertificate=True;",
    ),
    (
        "appsettings.Production.json -> ConnectionStrings:Finance = §0§",
        "Server=tcp:acme-sql.database.windows.net,1433;Initial Catalog=finance;User ID=fin_reader;"
        "Password=F1n@nce-Read-77;Encrypt=True;Connection Timeout=30;",
    ),
    (
        "Ledger service JDBC url: §0§",
        "jdbc:postgresql://pg-ledger.internal:5432/ledger?user=ledger_svc&password=L3dg3r!Svc&ssl=true",
    ),
    (
        "HR ETL job (SSIS replacement) connects with §0§",
        "jdbc:sqlserver://mssql-hr.internal:1433;databaseName=HR;user=hr_etl;password=Hr3tl#2024;encrypt=true",
    ),
    (
        "Metabase source config for BI: §0§",
        "jdbc:mysql://mysql-bi.internal:3306/bi?user=bi_ro&password=B1r0-Pass&useSSL=true",
    ),
    (
        'SQLALCHEMY_DATABASE_URI = "§0§"',
        "mssql+pyodbc://etl_user:Etl%21Pass99@sqlsrv-dw.internal/dw?driver=ODBC+Driver+18+for+SQL+Server",
    ),
]
for template, *vals in CONNS:
    add("connection_string", template, *vals)

# =========================================================================== clean (hard negatives)

CLEAN_PLAIN = {
    "sha7": sha1_hex()[:7],
    "sha40": sha1_hex(),
    "sha256": sha256_hex(),
    "sha256b": sha256_hex(),
    "uuid": uuid4(),
    "uuid2": uuid4(),
    "trace": rand(HEX, 32),
    "etag1": rand(HEX, 32),
    "etag2": rand(HEX, 32),
    "pi": "pi_3" + rand(ALNUM, 23),
    "sshpub": ssh_ed25519_public(),
    "fp": base64.b64encode(rng.randbytes(32)).decode().rstrip("="),
    "isbn1": "978-0-13-468599-" + ean13_check("978013468599"),
    "isbn2": "978-1-4920-7800-" + ean13_check("978149207800"),
    "ean": (lambda b: b + ean13_check(b))("871" + rand(DIGITS, 9)),
}

CLEAN = [
    "Order #100234567 shipped on 2024-03-14 via UPS, tracking 1Z999AA10123456784. Customer notified, "
    "ETA 3-5 business days.",
    "Invoice INV-2024-00871 for €3.200,50 (VAT 19% incl.) is due on 30.04.2024. Payment terms net 30, "
    "reminder scheduled.",
    "Deployed api-gateway v2.14.3 (build 20240314.7, commit §sha7§) to prod at 14:30 UTC. Error rate back "
    "to 0.02%.",
    "Release notes draft: upgraded lodash to ^4.17.21, React 18.2.0 -> 18.3.1, dropped Node 16 support.",
    "Request id §uuid§ timed out after 30000 ms on the /reports endpoint; the retry succeeded.",
    "Artifact checksum (sha256): §sha256§ - matches the value published on the release page.",
    "Reminder: everyone must rotate their API keys every 90 days. The policy doc is on the wiki under "
    "Security > Key management.",
    "Password policy update: minimum 12 characters, no reuse of the last 5, lockout after 10 failed "
    "attempts for 15 minutes.",
    "User reported they forgot their password; sent the standard reset link from the admin console. No "
    "credentials were exchanged in the ticket.",
    "The wifi password for visitors is printed on the card at reception; please don't write it in tickets.",
    "Config template:\nDB_HOST=localhost\nDB_PORT=5432\nDB_USER=app\nDB_PASSWORD=<set-in-vault>\n"
    "API_KEY=<your-api-key>",
    "password: ********\ntoken: ********\n(masked in the UI export, the real values live in the secrets "
    "manager)",
    "GitHub Actions step uses token: ${{ secrets.GITHUB_TOKEN }} and DB_PASSWORD: ${{ secrets.DB_PASSWORD "
    "}}; "
    "nothing is hard-coded in the workflow.",
    "Setup guide: see docs.example.com/setup for the SSO configuration and status.example.org for uptime "
    "history.",
    "Q3 numbers: revenue $1,245,300 (+8.4% QoQ), churn 2.1%, NPS 47. Target for Q4 is 10% growth.",
    "Brand refresh: primary #1A73E8, secondary #F4B400, text #202124, background #FFFFFF. Contrast checked "
    "(AA).",
    "SKU WH-1000XM5-BLK is out of stock in the Rotterdam DC; 340 units inbound on PO-2024-1187, ETA 22/05.",
    "Ordered two books for the team library: ISBN §isbn1§ and §isbn2§. Bookshop invoice is INV-88213.",
    "Jira FIN-2291 and INC0012345 are linked; root cause was a timezone bug in the month-end close job "
    "(UTC vs CET).",
    "Service listens on port 8443 internally; the load balancer terminates TLS on 443 and forwards to "
    "8080 for the legacy app.",
    "Windows build 10.0.19045.3803 and Chrome 124.0.6367.91 reproduce the rendering bug; Edge 123 does not.",
    "FedEx tracking 7749 2365 1180 shows 'delivery exception'; the customer in Leeds will be offered a "
    "redelivery slot.",
    "Merge commit §sha40§ reverted the caching change; re-land planned after the load test on Thursday.",
    "Docker image acme/billing-worker@sha256:§sha256b§ pinned in the Helm values for release 3.8.0.",
    "Ticket SUP-44821: customer asks how to generate an API key. Pointed them to Settings > Developer > "
    "API keys; no key was shared.",
    "Secret Santa budget this year is £20; names drawn on Friday 13 December at 16:00 in the kitchen.",
    "Token usage for the summariser: 1.2M input tokens, 310k output tokens in May, cost $38.40. Rate "
    "limit 100 req/min.",
    "OKR review: Key Result 2 (onboarding time under 3 days) is at 70%; KR3 is blocked by the data "
    "migration.",
    "Meeting minutes 12/03: attendees - finance, ops, legal. Decisions: move the close calendar to working "
    "day 3, budget freeze from 1 Oct.",
    "Amount reconciled: ₹1,25,000 received against PO 4500098812, TDS deducted 2%, balance ₹2,500 pending.",
    "Card ending in 4242 was charged $49.00 for the Pro plan renewal on 01/06; receipt RCPT-20240601-0193 "
    "sent.",
    "Stripe payment intent §pi§ succeeded; amount 12900 (minor units), currency gbp.",
    "IAM role arn:aws:iam::123456789012:role/billing-reader is assumed by the reporting Lambda; no "
    "long-lived keys involved.",
    "kubectl get secret payments-db -n prod shows the secret exists; the value is injected by External "
    "Secrets, don't print it.",
    "Vault path secret/data/payments/stripe holds the key; access via the payments-ci role only. Rotation "
    "runbook: RB-017.",
    "Public deploy key added to the repo (this is the PUBLIC half, safe to share):\nssh-ed25519 §sshpub§ "
    "ci-deploy-2024",
    "JWT access tokens now expire after 15 minutes and refresh tokens after 30 days; signing keys rotate "
    "quarterly via JWKS.",
    "Bank detail changes for suppliers must be verified by call-back to the number already on file, never "
    "to a number given in the email.",
    "Lieferung 4711-0815 verzögert sich um zwei Tage; neuer Liefertermin 17.05.2024, Zustellfenster "
    "08:00-12:00 Uhr.",
    "Réunion du 05/06 : budget marketing validé à 45 000 €, lancement de la campagne le 1er juillet, bilan "
    "prévu fin septembre.",
    "Pedido 2024/0457 facturado por 1.250,00 € + IVA 21%. Entrega prevista en la semana 23.",
    "GST invoice GSTINV/24-25/0142 raised for ₹84,960 (incl. 18% GST); e-way bill generated, vehicle "
    "dispatched from Chennai.",
    "UUID for the new tenant: §uuid2§. Region eu-central-1, plan enterprise, 250 seats.",
    "Trace §trace§ shows the slow span in the inventory service (p99 1.8 s).",
    "Cron schedule changed from 0 2 * * * to 30 1 * * 1-5; backup window is now 01:30-02:15 UTC on weekdays.",
    "Feature flag checkout_v2 rolled out to 25% of EU traffic; conversion +1.3 pp, no rise in payment "
    "errors.",
    "Stack trace: NullPointerException at com.acme.billing.InvoiceService.render(InvoiceService.java:214), "
    "address 0x7ffd5c3a9e10.",
    "Postman collection uses {{baseUrl}} and {{apiKey}} variables - fill them in locally, the shared "
    "collection has them empty.",
    "HTTP 429 from the partner API: 'Too many requests, retry after 60 s'. Our limit is 600 requests per "
    "10 minutes.",
    "Customer asked whether we store card numbers. Answer: no, card data goes straight to the processor; "
    "we keep a token reference and the last four digits only.",
    "Sprint 42 retro: good - fewer flaky tests (from 37 to 9); improve - PR review latency (median 26 h).",
    "Shipping label for parcel SSCC 00340434161234567895 printed at 09:12, pallet 3 of 5.",
    "Temperature alarm in cold room 2: 9.4 °C for 12 minutes at 03:40, resolved after the door was closed. "
    "Log ref TMP-2024-118.",
    "Our MFA uses TOTP with 6-digit codes valid for 30 s; SMS fallback is disabled since the March review.",
    "Example request in the docs: GET https://api.example.com/v1/orders?limit=50&cursor=<next_cursor> "
    "with header Authorization: Bearer <token>.",
    "Contract renewal: 3-year term, uplift capped at 7%, auto-renew notice 90 days, governing law England "
    "and Wales.",
    "Office move checklist: badges reprogrammed, printers re-mapped, wifi SSID stays ACME-Corp, the key "
    "safe code is with facilities (not here).",
    "Regex for our internal ticket ids is ^[A-Z]{2,5}-\\d{1,6}$; anything else is rejected by the form.",
    "Data retention: logs 30 days, backups 35 days, audit trail 7 years. DPIA reference DPIA-2024-03 "
    "approved.",
    "EAN §ean§ scanned at goods-in, quantity 48, lot L2405-17, best before 2025-11-30.",
    "Build #4821 failed on the lint stage (ruff E501); build #4822 green after rebase. Pipeline took 11m "
    "42s.",
    "Handover notes: the on-call phone rota is in PagerDuty; numbers are not to be copied into tickets.",
    "Customer wants to rotate their webhook signing secret. Explained Settings > Webhooks > Roll secret; the "
    "old secret stays valid for 24 h.",
    "Warehouse KPIs week 19: pick accuracy 99.6%, dock-to-stock 6.5 h, 1,842 orders shipped, 12 returns.",
    "Schema migration 0042_add_invoice_due_date applied to prod; rollback script 0042_down tested on "
    "staging.",
    "Exchange rates used for the May close: EUR/USD 1.0812, GBP/USD 1.2655, USD/INR 83.42, USD/JPY 156.80.",
    "The SSH host key fingerprint for bastion-eu is SHA256:§fp§ - verify it before the first connection.",
    "Legal hold LH-2024-07 applies to the sales team mailboxes from 2023-01-01; do not purge.",
    "Quote Q-2024-0318: 120 seats at $18/month, 15% discount for annual prepay, total $22,032.00.",
    "Error 'invalid_grant: token expired' from the OAuth server after a clock skew of 5 min on worker-07; "
    "NTP fixed.",
    'ETag for the catalogue export changed from "§etag1§" to "§etag2§" after the nightly rebuild.',
    "Plan for Monday: 09:00 standup, 10:30 vendor demo (room 4.12), 14:00 budget review, 16:30 1:1 with the "
    "new intern.",
    "NACH mandate registration pending with the bank; customer ref CUST-IN-20931, first debit on 05/07 for "
    "₹4,999.",
    "SOC 2 Type II audit window 01/01-30/06; evidence requests tracked in GRC-2291 to GRC-2340.",
    "Replace hard-coded API keys with environment variables; the linter now fails the build if it finds a "
    "string that looks like a secret.",
    "Onboarding doc: the first login uses SSO, there is no separate password; MFA enrolment is mandatory.",
    "Order 4471-220-19 split into two parcels; parcel 2 weighs 3.4 kg and ships from Nagpur on 28/02.",
]
for template in CLEAN:
    add("clean", template, plain=CLEAN_PLAIN)


# =========================================================================== self-check

EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(\.[\w-]+)*\.[A-Za-z]{2,}")
IPV4_RE = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
DIGIT_RUN_RE = re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)")


def self_check() -> None:
    ids = [r["id"] for r in RECORDS]
    assert len(ids) == len(set(ids)), "duplicate ids"
    counts: dict[str, int] = {}
    clean_texts = []
    all_sensitive = []
    for r in RECORDS:
        rid, cat, text, sens, expect = r["id"], r["category"], r["text"], r["sensitive"], r["expect"]
        assert isinstance(text, str) and isinstance(sens, list) and isinstance(cat, str)
        assert re.fullmatch(rf"i-{cat}-\d{{3}}", str(rid)), rid
        assert expect == EXPECT[cat], rid
        assert 40 <= len(text) <= 600, (rid, len(text))
        counts[cat] = counts.get(cat, 0) + 1
        if expect == "clean":
            assert sens == [], rid
            clean_texts.append(text)
        else:
            assert sens, rid
            all_sensitive += sens
        for s in sens:
            assert isinstance(s, str) and s in text, (rid, s)
        if cat == "card_valid":
            assert all(luhn_ok(s) for s in sens), rid
        if cat == "card_invalid_luhn":
            vals = VALUES[str(rid)]
            assert vals and all(v in text and not luhn_ok(v) for v in vals), rid
        if cat == "iban":
            assert all(iban_ok(s) for s in sens), rid
        if cat == "ssn":
            for s in sens:
                d = re.sub(r"\D", "", s)
                assert len(d) == 9 and d[:3] not in ("000", "666") and int(d[:3]) < 900, rid
                assert d[3:5] != "00" and d[5:] != "0000", rid
        if cat == "ip":
            assert all(":" in s or IPV4_RE.fullmatch(s) for s in sens), rid
    for cat, minimum in MIN_COUNTS.items():
        assert counts.get(cat, 0) >= minimum, (cat, counts.get(cat, 0))
    # Hard negatives must really be clean: no e-mail, no IPv4, no Luhn-valid card-length digit run.
    for text in clean_texts:
        assert not EMAIL_RE.search(text), text
        assert not IPV4_RE.search(text), text
        for m in DIGIT_RUN_RE.finditer(text):
            assert not luhn_ok(m.group()), (m.group(), text)
        assert not any(s in text for s in all_sensitive), text


def main() -> None:
    self_check()
    with OUT.open("w", encoding="utf-8", newline="\n") as fh:
        for r in RECORDS:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(RECORDS)} records to {OUT}")


if __name__ == "__main__":
    main()
