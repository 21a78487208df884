"""The scanner on texts that once fooled it, found outside the labelled corpora."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from memory.scan import Scanner

CORPORA = Path(__file__).parent

CLEAN = [
    "Frequent flyer number for United is stored in the password manager.",
    "Dad's reading glasses prescription is +2.25 in both eyes.",
    "Password reset emails are sent from the support mailbox; rotate the API key every 90 days.",
    "The token bucket refills at 10 per second; sort_key: created_at.",
]
FOUND = [
    ("Mailgun sending key is key-cb983b410e6f58de9b9d56191e28c2f2 for now.", "API_KEY"),
    ("Callback on +44 7700 900123 after 10:00.", "PHONE_NUMBER"),
    ("set PGPASSWORD=Saffron3939!hp before the dump", "PASSWORD"),
    ("refund to es76 6144 1980 1253 8255 1567 please", "IBAN_CODE"),
    ("password: Passw0rd!", "PASSWORD"),
    ("DB_PASSWORD=Monkey123!", "PASSWORD"),  # "key" inside the value does not make it a name
    ("password: Summer@Home.2024", "PASSWORD"),  # not an e-mail address: 2024 is no domain
    ("alice\u200b@example.com wrote in", "EMAIL_ADDRESS"),  # a zero-width space hides nothing
    (
        "ssn \uff14\uff10\uff10\uff11\uff12\uff13\uff14\uff15\uff16 on file",
        "US_SSN",
    ),  # full-width digits neither
]


@pytest.fixture(scope="module")
def scanner() -> Scanner:
    return Scanner()


@pytest.mark.parametrize("text", CLEAN)
def test_clean_text_is_not_flagged(scanner: Scanner, text: str) -> None:
    assert [(text[f.start : f.end], f.type) for f in scanner.scan(text) if f.score >= 0.3] == []


@pytest.mark.parametrize(("text", "kind"), FOUND)
def test_these_are_found(scanner: Scanner, text: str, kind: str) -> None:
    text = scanner.check(text)  # the form memory scans and stores
    assert kind in {f.type for f in scanner.scan(text) if f.score >= 0.3}


@pytest.mark.parametrize(
    "text",
    ["a-" * 8000, ("+" + "1" * 29 + " ") * 516, "user-" * 3200, "." * 15999, "1234 " * 3199, "key=" * 3999],
)
def test_inputs_that_make_regexes_backtrack_are_scanned_in_bounded_time(scanner: Scanner, text: str) -> None:
    started = time.monotonic()
    scanner.scan(text[: scanner.max_chars])
    assert time.monotonic() - started < 3  # about 0.2 s at worst here; a quadratic pattern took seconds


def _mixtures(rows: list[dict[str, object]], count: int) -> list[str]:
    """Texts made of pieces that trip recognizers: the corpora's sensitive items, digit runs with
    separators, words that name secrets, "@" and ":" in odd places, non-ASCII letters."""
    rng = random.Random(20261202)
    items = [str(item) for row in rows for item in row["sensitive"]]  # type: ignore[attr-defined]
    pieces = [
        *items,
        "password", "token=", "api key is", "Bearer ", "user / ", "://", "@", "::", ":", "+", "-", "/", ".",
        "ssn", "IBAN", "card", "DE", "gb82", "Ωmega", "straße", "İstanbul", "ﬁle", "\u212aey", "\n", "  ",
    ]  # fmt: skip
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.35:
                parts.append(rng.choice(pieces))
            elif roll < 0.7:
                digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 20)))
                sep = rng.choice(["", " ", "-", ".", "(", ")"])
                parts.append(sep.join(digits[i : i + rng.randint(2, 5)] for i in range(0, len(digits), 3)))
            else:
                parts.append("".join(rng.choice("abcdefKLMNxyz_=:") for _ in range(rng.randint(1, 24))))
        texts.append(rng.choice([" ", "", "\t"]).join(parts))
    return texts


def test_the_precheck_changes_no_finding(scanner: Scanner) -> None:
    # Presidio is asked only for the types some recognizer could find in a text; over the labelled
    # corpora, the texts above and thousands of made-up mixtures, that finds exactly what asking
    # every recognizer finds.
    rows = [
        json.loads(line)
        for name in ("pii_corpus", "pii_holdout", "pii_independent")
        for line in (CORPORA / f"{name}.jsonl").read_text().splitlines()
    ]
    texts = [str(r["text"]) for r in rows] + CLEAN + [t for t, _ in FOUND] + _mixtures(rows, 3000)
    everything = Scanner(precheck=False)
    for raw in texts:
        text = scanner.check(raw)
        assert scanner.scan(text) == everything.scan(text), text
    # and it does leave presidio out: most of the corpora's clean texts need no recognizer at all
    clean = [scanner.check(str(r["text"])) for r in rows if r["expect"] == "clean"]
    assert sum(not scanner.candidates(t) for t in clean) > len(clean) // 2
