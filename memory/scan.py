"""What a text holds that must not reach long-term memory as it is: personal data and secrets.

Detection runs on ``presidio-analyzer``: its pattern recognizers for e-mail addresses, phone numbers,
card numbers (Luhn-checked), IBANs (checksum-checked), US SSNs and IP addresses, plus the fleet's own
recognizers for secrets (API keys of well-known shapes and ``key=value`` assignments, private keys,
JWTs, passwords, connection strings with credentials). Names and places need a spaCy NER model, which
the package registries do not reliably provide: with ``ner_model`` set, the analyzer loads that
installed spaCy model and reports ``PERSON`` and ``LOCATION`` too; without it, no NER runs.

The scanner answers in bounded time or refuses, and never answers "nothing found" for a text it did
not read: a text over ``max_chars`` is refused (``too_large``), a text that is not text (NUL or other
control bytes, unpaired surrogates) is refused (``unscannable``). Presidio's phone matcher is the slow
part (about 11 ms for a 200-character text across its default regions); here it runs only over the
windows of a text that hold at least seven digits, which finds the same numbers in a fraction of the
time (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import os
import re
import threading
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import regex

from fleet.errors import ErrorCode, FleetError

# tldextract, which presidio's e-mail recognizer uses, otherwise tries to fetch the public suffix list.
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")

import phonenumbers
from presidio_analyzer import (
    AnalyzerEngine,
    EntityRecognizer,
    Pattern,
    PatternRecognizer,
    RecognizerRegistry,
    RecognizerResult,
)
from presidio_analyzer.nlp_engine import NlpArtifacts, NlpEngine, NoOpNlpEngine
from presidio_analyzer.predefined_recognizers import (
    CreditCardRecognizer,
    EmailRecognizer,
    IbanRecognizer,
    IpRecognizer,
    PhoneRecognizer,
    UsSsnRecognizer,
)

DEFAULT_MAX_CHARS = 16_000
PHONE_REGIONS = ("US", "GB", "DE", "FR", "IN", "JP", "AU", "NL", "ES")
UNPREFIXED_REGIONS = ("US", "IN", "ES")  # national numbers without a trunk 0 (India: mobiles)
PII_TYPES = ("EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "IBAN_CODE", "US_SSN", "IP_ADDRESS")
SECRET_TYPES = ("API_KEY", "AWS_ACCESS_KEY", "PRIVATE_KEY", "JWT", "PASSWORD", "CONNECTION_STRING")
NER_TYPES = ("PERSON", "LOCATION")
_WORD = re.compile(r"[a-z]{2,}")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
_PRECHECK_TIMEOUT_S = 1.0  # a pattern presidio would run too: bounded the same way (the gate gives up at 5 s)


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing found: its type, where it is in the text, and how sure the recognizer is."""

    type: str
    start: int
    end: int
    score: float

    def summary(self) -> dict[str, Any]:
        """What policy and the audit trail see: the type and score, never the text found."""
        return {"type": self.type, "score": round(self.score, 2)}


# ----------------------------------------------------------------------------------- secrets
def _patterns(name: str, score: float, *regexes: str) -> list[Pattern]:
    return [Pattern(f"{name} {n}", regex, score) for n, regex in enumerate(regexes)]


_KEY_NAMES = (
    r"api[_\s-]?key|x-api-key|apikey|access[_-]?key(?:[_-]?id)?|secret[_-]?access[_-]?key|secret[_-]?key"
    r"|client[_-]?secret|auth[_-]?token|access[_-]?token|refresh[_-]?token|bearer[_-]?token"
    r"|private[_-]?token|app[_-]?secret|webhook[_-]?secret|signing[_-]?key|secret|token"
)


class _SecretValue(PatternRecognizer):
    """A pattern whose match is a secret only if its value is not an ordinary word: it mixes at
    least two of lower case, upper case, digits and symbols, or it is long and unbroken."""

    def __init__(self, entity: str, patterns: list[Pattern], *, min_length: int) -> None:
        super().__init__(supported_entity=entity, patterns=patterns, supported_language="en")
        self.min_length = min_length

    def validate_result(self, pattern_text: str) -> bool | None:
        return any(_looks_secret(token, self.min_length) for token in _TOKEN.findall(pattern_text))


def _looks_secret(token: str, min_length: int) -> bool:
    token = token.rstrip(".,;:!?)]}")  # the end of a sentence is not part of a word
    if len(token) < min_length or _KEYWORD.match(token) or _ADDRESS.match(token) or _PLACEHOLDER.match(token):
        return False
    classes = sum(
        (
            any(c.islower() for c in token),
            any(c.isupper() for c in token),
            any(c.isdigit() for c in token),
            any(not c.isalnum() for c in token),
        )
    )
    return classes >= 2 or (len(token) >= 12 and not token.isalpha())


class _StrongToken(_SecretValue):
    """A match is a secret only if it holds a token with upper and lower case, a digit and a symbol
    that is not a URL or a path."""

    def validate_result(self, pattern_text: str) -> bool | None:
        return any(_strong(token, self.min_length) for token in _TOKEN.findall(pattern_text))


def _strong(token: str, min_length: int) -> bool:
    token = token.rstrip(".,;:!?)]}")
    if (
        len(token) < min_length
        or _KEYWORD.match(token)
        or _ADDRESS.match(token)
        or _PLACEHOLDER.match(token)
        or token.count("/") > 1
    ):
        return False
    return (
        any(c.islower() for c in token)
        and any(c.isupper() for c in token)
        and any(c.isdigit() for c in token)
        and any(not c.isalnum() for c in token)
    )


# An e-mail address or a URL is not a password (an address is personal data, found as such).
_ADDRESS = re.compile(
    r"^(?:[^@\s]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\.?|[a-zA-Z][a-zA-Z0-9+.-]*://\S*)$"
)
# A template's blank, not a value: <set-in-vault>, {{ db_password }}, ${DB_PASSWORD} (words only).
_PLACEHOLDER = re.compile(r"^(?:<[A-Za-z _-]+>|\{\{[A-Za-z _.-]+\}\}|\$\{[A-Za-z_][A-Za-z0-9_]*\})$")
_TOKEN = re.compile(r"[^\s\"'`=:,;()]+")
# A name, not a value: letters, "_" and "-" only, holding a word about secrets (DB_PASSWORD, api-key).
_KEYWORD = re.compile(
    r"(?i)^[a-z_-]*(?:pass|pwd|secret|token|key|auth|bearer|login|user|credential)[a-z_-]*$"
)


def secret_recognizers() -> list[EntityRecognizer]:
    """The recognizers of secrets: each a presidio recognizer, so one analyzer runs them all."""
    return [
        PatternRecognizer(
            supported_entity="AWS_ACCESS_KEY",
            patterns=_patterns("aws", 0.95, r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b"),
        ),
        PatternRecognizer(
            supported_entity="API_KEY",
            patterns=_patterns(
                "token",
                0.95,
                r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
                r"\bgithub_pat_[A-Za-z0-9_]{40,}\b",
                r"\bglpat-[A-Za-z0-9_-]{20,}",
                r"\bxox[abprse]-[A-Za-z0-9-]{10,}",
                r"\bsk-(?:ant-|proj-|live-)?[A-Za-z0-9_-]{20,}",
                r"\b[rsp]k_(?:live|test)_[A-Za-z0-9]{16,}",
                r"\bAIza[0-9A-Za-z_-]{35}",
                r"\bSG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}",
                r"\bnpm_[A-Za-z0-9]{36}\b",
                r"\bhf_[A-Za-z0-9]{30,}\b",
                r"\bshp(?:at|ss|ca|pa)_[a-fA-F0-9]{32}\b",
                r"\bkey-[0-9a-f]{32}\b",  # Mailgun
            ),
        ),
        _SecretValue(
            "API_KEY",
            _patterns(
                "assignment",
                0.85,
                rf"(?i)\b(?:{_KEY_NAMES})\b[\"']?\s*(?:[:=]|=>|\bis\b)\s*[\"'`]?[A-Za-z0-9_\-./+=~]{{16,256}}",
                # the API key for the vendor portal is VALUE
                rf"(?i)\b(?:{_KEY_NAMES})\b[^\n.;:=]{{0,40}}?\bis\s+[\"'`]?[A-Za-z0-9_\-./+=~]{{16,256}}",
                # SERVICE_API_KEY=..., "apiKey": "...", api_token: ... (a name that holds key, secret,
                # token or auth, then a long value with letters and digits)
                r"(?i)(?<![A-Za-z0-9_.-])[A-Za-z0-9_.-]{0,40}(?:key|secret|token|auth)[A-Za-z0-9_.-]{0,40}"
                r"[\"']?\s{0,4}[:=]\s{0,4}[\"'`]?"
                r"(?=[^\s\"'`,;]{0,128}\d)(?=[^\s\"'`,;]{0,128}[A-Za-z])[A-Za-z0-9_\-./+=~]{16,256}",
                r"(?i)\bauthorization:\s*(?:[A-Za-z-]{2,20}\s+)?[A-Za-z0-9_\-./+=~]{12,}",
                # auth token VALUE: a key's name, then a long value with letters and digits
                r"(?i)\b(?:api[_\s-]?key|auth[_\s-]?token|access[_\s-]?token|secret[_\s-]?key|client[_\s-]?secret)"
                r"\s+[\"'`]?(?=[^\s\"'`,;]{0,128}\d)(?=[^\s\"'`,;]{0,128}[A-Za-z])[A-Za-z0-9_\-./+=~]{20,256}",
                r"(?i)\bbearer\s+[A-Za-z0-9_\-.+/=~]{20,}",
            ),
            min_length=16,
        ),
        PatternRecognizer(
            supported_entity="PRIVATE_KEY",
            patterns=_patterns(
                "pem",
                1.0,
                r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----",
                r"PuTTY-User-Key-File-\d+:",
            ),
        ),
        PatternRecognizer(
            supported_entity="JWT",
            patterns=_patterns("jwt", 0.95, r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        ),
        _SecretValue(
            "PASSWORD",
            _patterns(
                "password",
                0.8,
                # password: VALUE, password is VALUE, DB_PASSWORD=VALUE, the password for X is VALUE
                r"(?i)(?:(?<![a-z])|(?<=[a-z0-9_]{2}))"
                r"(?:password|passwd|passwort|passphrase|pwd|pw|pass|mot de passe|contrase[nñ]a)"
                r"(?![a-z])(?:[^\n.;]|(?<=\d)\.){0,40}?(?:[:=]|=>|\bis\b|\bwas\b|\bto\b)\s*[\"'`]?[^\s\"'`,;]{6,128}",
                # with password VALUE, --password 'VALUE', pass VALUE
                r"(?i)(?<![a-z])(?:password|passphrase|passwd|pwd|pass)\s+[\"'`]?[^\s\"'`,;]{6,128}",
                # VALUE is the (admin) password
                r"(?i)(?<![^\s\"'`,;])[^\s\"'`,;]{6,64}\s+(?:is|was)\s+(?:the|our|my|your|their)\s+(?:[a-z-]+\s+){0,3}?"
                r"(?:password|passphrase)\b",
                r"(?i)\bmysql\b[^\n]{0,200}?\s-p[\"']?[^\s\"'`]{4,128}",
                r"(?i)\bsshpass\s+-p\s*[\"']?[^\s\"'`]{4,128}",
                # user / VALUE
                r"(?i)\b(?:login|user(?:name)?|credentials?)\b[^\n/]{0,40}?\S{1,64}(?<=\S)\s{0,4}/\s{0,4}[^\s\"'`,;/]{6,64}",
            ),
            min_length=6,
        ),
        _StrongToken(
            "PASSWORD",
            _patterns(
                "near",
                0.6,
                # a word that looks like a strong password (upper, lower, digit and symbol) shortly
                # after a word about passwords or logging in, even on the next line
                r"(?i)(?<![a-z])(?:password|passwd|passphrase|pwd|pass|log\s?in|credentials?)(?![a-z])"
                r"[^\n]{0,80}(?:\n[^\n]{0,40})?",
            ),
            min_length=8,
        ),
        PatternRecognizer(
            supported_entity="CONNECTION_STRING",
            patterns=_patterns(
                "dsn",
                0.95,
                r"\b[a-zA-Z][a-zA-Z0-9+.-]{1,20}://[^\s:/@]{0,256}:[^\s@/]{1,256}@[^\s\"'`<>]{1,512}",
                r"(?i)\b(?:server|data source|host|address)\s{0,4}=[^;\n]{1,200};[^\n]{0,400}?\b(?:password|pwd)\s{0,4}=[^;\n]{1,200}",
            ),
        ),
    ]


# -------------------------------------------------------------------------------- personal data
def _shifted(results: list[RecognizerResult], offset: int) -> list[RecognizerResult]:
    """Results found in a window of a text, placed back in the text."""
    for result in results:
        result.start += offset
        result.end += offset
    return results


_PHONE_WINDOW = re.compile(r"\+?\(?\d[\d\s().\-/]{5,22}\d")
_MAX_WINDOWS = 16


class _WindowedPhoneRecognizer(PhoneRecognizer):
    """Presidio's phone recognizer, run only where a phone number can be: windows of the text with at
    least seven digits. Beyond ``_MAX_WINDOWS`` windows it reads the whole text once instead, in
    every region. A window that does not start with a 0 is read only in the regions whose national
    numbers need no trunk prefix (``UNPREFIXED_REGIONS``): in the others a number written without
    its country code starts with 0, and each region read costs as much as the first."""

    def could_find(self, text: str) -> bool:
        return any(sum(c.isdigit() for c in m.group()) >= 7 for m in _PHONE_WINDOW.finditer(text))

    def analyze(
        self,
        text: str,
        entities: list[str],
        nlp_artifacts: NlpArtifacts = None,  # type: ignore[assignment]  # presidio's own default
    ) -> list[RecognizerResult]:
        windows = [m for m in _PHONE_WINDOW.finditer(text) if sum(c.isdigit() for c in m.group()) >= 7]
        if len(windows) > _MAX_WINDOWS:
            return _dialable(text, super().analyze(text, entities, nlp_artifacts))
        found: list[RecognizerResult] = []
        for match in windows:
            start, end = max(0, match.start() - 1), min(len(text), match.end() + 1)
            first = next(c for c in match.group() if c.isdigit())
            regions = self.supported_regions if first == "0" else UNPREFIXED_REGIONS
            found += _shifted(self._read(text[start:end], regions, nlp_artifacts), start)
        return _dialable(text, found)

    def _read(self, text: str, regions: Iterable[str], nlp_artifacts: NlpArtifacts) -> list[RecognizerResult]:
        """Presidio's own reading (``PhoneRecognizer.analyze``), in ``regions``."""
        results = []
        for region in regions:
            for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=self.leniency or 0):
                try:
                    found_in = phonenumbers.region_code_for_number(
                        phonenumbers.parse(text[match.start : match.end])
                    )
                except phonenumbers.NumberParseException:
                    found_in = region
                results.append(self._get_recognizer_result(match, text, found_in, nlp_artifacts))  # type: ignore[no-untyped-call]
        return list(EntityRecognizer.remove_duplicates(results))


def _dialable(text: str, results: list[RecognizerResult]) -> list[RecognizerResult]:
    """Numbers a phone can have: at most 15 digits (E.164) past the prefixes "00" and "0". A
    16-digit run in fours is a card-shaped number, not a German one."""
    return [r for r in results if len(re.sub(r"\D", "", text[r.start : r.end]).lstrip("0")) <= 15]


_ALNUM_WORD = re.compile(r"[A-Za-z0-9]+")
_IBAN_START = re.compile(r"[A-Za-z]{2}[0-9]{2}")


class _AnyCaseIban(IbanRecognizer):
    """Presidio's IBAN recognizer (country format and mod-97 checked), also for IBANs written in
    lower case: it reads the text with its IBAN-like words upper-cased (words with a digit, and a
    four-letter group right after one, as in ``gb82 west 1234 ...``), positions unchanged."""

    def could_find(self, text: str) -> bool:
        # Every IBAN starts with its country's two letters and two check digits; upper-casing ASCII
        # words keeps letters letters and digits digits, in place.
        return _IBAN_START.search(text) is not None

    def analyze(
        self,
        text: str,
        entities: list[str],
        nlp_artifacts: NlpArtifacts | None = None,
        regex_flags: int | None = None,
    ) -> list[RecognizerResult]:
        chars = list(text)
        previous_end, previous_upper = -2, False
        for word in _ALNUM_WORD.finditer(text):
            value = word.group()
            adjacent = word.start() - previous_end <= 1
            upper = any(c.isdigit() for c in value) or (adjacent and previous_upper and len(value) == 4)
            if upper and value.isascii():
                chars[word.start() : word.end()] = value.upper()
            previous_end, previous_upper = word.end(), upper
        return list(super().analyze("".join(chars), entities, nlp_artifacts, regex_flags))  # type: ignore[arg-type]


_EMAIL_WINDOW = re.compile(r"[^\s@<>()\[\],;:\"']{1,64}@[^\s@<>()\[\],;:\"']{1,255}")


# A domain of an address: labels, and a last one of letters (the TLD need not be a public one).
_MAIL_DOMAIN = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}$")


class _WindowedEmailRecognizer(EmailRecognizer):
    """Presidio's e-mail recognizer, run only on the words around each "@": its own pattern is
    quadratic on long runs without one (``"a-" * 8000``). An address at a domain outside the
    public suffix list (``corp.internal``, ``example``) is an address too: presidio's check of the
    TLD against that list would let it through."""

    def validate_result(self, pattern_text: str) -> bool | None:
        return _MAIL_DOMAIN.match(pattern_text.rpartition("@")[2]) is not None

    def could_find(self, text: str) -> bool:
        return _EMAIL_WINDOW.search(text) is not None

    def analyze(
        self,
        text: str,
        entities: list[str],
        nlp_artifacts: NlpArtifacts | None = None,
        regex_flags: int | None = None,
    ) -> list[RecognizerResult]:
        found: list[RecognizerResult] = []
        for match in _EMAIL_WINDOW.finditer(text):
            found += _shifted(
                super().analyze(match.group(), entities, nlp_artifacts, regex_flags), match.start()
            )
        return found


class _InternationalPhone(PatternRecognizer):
    """A "+" and digit groups is a phone number only with 8 to 15 digits (E.164), not "+2.25"."""

    def validate_result(self, pattern_text: str) -> bool | None:
        return 8 <= sum(c.isdigit() for c in pattern_text) <= 15


def pii_recognizers() -> list[EntityRecognizer]:
    return [
        _WindowedEmailRecognizer(),
        # A number written with its country code is read as such whatever the region; the rest in the
        # national formats of these regions. More regions find more numbers but also read dates,
        # versions and card-shaped numbers as phones (Brazil, Italy: measured on the corpora).
        _WindowedPhoneRecognizer(supported_regions=PHONE_REGIONS),
        # Numbers written with their country code that the phone library does not know (new or
        # reserved ranges): a "+" and eight or more digits in groups is a phone number.
        _InternationalPhone(
            supported_entity="PHONE_NUMBER",
            patterns=_patterns(
                "international",
                0.5,
                # each group's digits run to a non-digit, so a number splits one way only
                r"(?<![\w+])\+(?:\d{8,15}|\d{1,3}(?:[\s.-]?(?:\(\d{1,5}\)|\d{1,8})(?!\d)){2,5})(?!\d)",
            ),
        ),
        _AnyCaseIban(),
        CreditCardRecognizer(),
        # Presidio's card patterns predate Mastercard's 2-series (2221-2720); same Luhn check.
        CreditCardRecognizer(
            patterns=[
                Pattern(
                    "mastercard 2-series",
                    r"\b2(?:2[2-9]\d|[3-6]\d\d|7[01]\d|720)[- ]?\d{4}[- ]?\d{4}[- ]?\d{4}\b",
                    0.3,
                )
            ]
        ),
        UsSsnRecognizer(),
        IpRecognizer(),
    ]


# ---------------------------------------------------------------------------------- the scanner
class Scanner:
    """Finds personal data and secrets in texts. Thread-safe: presidio's analyzer keeps no state
    between calls."""

    def __init__(
        self, *, max_chars: int = DEFAULT_MAX_CHARS, ner_model: str = "", precheck: bool = True
    ) -> None:
        """``precheck``: ask presidio only for the types that some recognizer could find in the
        text (see :func:`_could_find`); off, every recognizer reads every text (same findings)."""
        self.max_chars = max_chars
        self.ner_model = ner_model
        registry = RecognizerRegistry(supported_languages=["en"])
        for recognizer in (*pii_recognizers(), *secret_recognizers()):
            registry.add_recognizer(recognizer)
        nlp: NlpEngine
        if ner_model:
            nlp = _spacy_engine(ner_model)
            from presidio_analyzer.predefined_recognizers import SpacyRecognizer

            registry.add_recognizer(SpacyRecognizer(supported_entities=list(NER_TYPES)))
        else:
            nlp = NoOpNlpEngine([{"lang_code": "en", "model_name": "none"}])
        self._analyzer = AnalyzerEngine(registry=registry, nlp_engine=nlp, supported_languages=["en"])
        self._context = {
            w.lower() for r in registry.recognizers for w in (r.context or []) for w in w.split()
        }
        self._lock = threading.Lock() if ner_model else None  # spaCy pipelines are not thread-safe
        self.precheck = precheck
        self._could_find = [
            (entity, _could_find(r))
            for r in registry.recognizers
            for entity in r.supported_entities
            if entity in self.types
        ]

    @property
    def types(self) -> tuple[str, ...]:
        return PII_TYPES + SECRET_TYPES + (NER_TYPES if self.ner_model else ())

    def check(self, text: object) -> str:
        """``text`` if the scanner can read it; else a :class:`FleetError` saying why not."""
        if not isinstance(text, str):
            raise FleetError(ErrorCode.INVALID_REQUEST, f"text must be a string, not {type(text).__name__}")
        if len(text) > self.max_chars:
            raise FleetError(
                ErrorCode.TOO_LARGE,
                f"the text has {len(text)} characters; memory takes at most {self.max_chars}",
            )
        if _CONTROL.search(text):
            raise FleetError(
                ErrorCode.UNSCANNABLE, "the text holds control characters: binary data is not stored"
            )
        try:
            text.encode()
        except UnicodeEncodeError:
            raise FleetError(ErrorCode.UNSCANNABLE, "the text is not valid Unicode") from None
        return normal_form(text)

    def scan(self, text: str) -> list[Finding]:
        """What ``text`` holds, by position; overlapping findings of one type are merged. ``text``
        must be in the form :meth:`check` returns (positions refer to it)."""
        if self.check(text) != text:
            raise FleetError(ErrorCode.INTERNAL, "scan the text check() returns, not the raw text")
        if not text.strip():
            return []
        entities = self.candidates(text) if self.precheck else list(self.types)
        if not entities:
            return []
        # Without an NLP model presidio sees no words near a match; the recognizers' context words
        # found anywhere in the text stand in for them (an "ssn" lifts a bare nine-digit number).
        context = sorted(self._context & set(_WORD.findall(text.lower())))
        if self._lock is not None:
            with self._lock:
                results = self._analyzer.analyze(text, language="en", entities=entities, context=context)
        else:
            results = self._analyzer.analyze(text, language="en", entities=entities, context=context)
        return _merge(Finding(r.entity_type, r.start, r.end, float(r.score)) for r in results)

    def candidates(self, text: str) -> list[str]:
        """The types some recognizer could find in ``text``: for the others, none of their
        recognizers' patterns (or the windows they read) matches anywhere in it."""
        found: list[str] = []
        try:
            for entity, could_find in self._could_find:
                if entity not in found and could_find(text):
                    found.append(entity)
        except TimeoutError:
            raise FleetError(ErrorCode.UNSCANNABLE, "a pattern took too long on this text") from None
        return found


def _could_find(recognizer: EntityRecognizer) -> Callable[[str], bool]:
    """A test that is true of every text in which ``recognizer`` finds anything (and of others):
    the recognizer's own ``could_find``; for a plain pattern recognizer, a search for any of its
    patterns, as presidio compiles them; for any other recognizer (NER), always true."""
    own = getattr(recognizer, "could_find", None)
    if callable(own):
        return cast(Callable[[str], bool], own)
    if isinstance(recognizer, PatternRecognizer) and type(recognizer).analyze is PatternRecognizer.analyze:
        flags = recognizer.global_regex_flags or 0
        patterns: list[Pattern] = list(getattr(recognizer, "patterns", None) or [])
        searches = [regex.compile(p.regex, flags=flags).search for p in patterns]
        return lambda text: any(search(text, timeout=_PRECHECK_TIMEOUT_S) is not None for search in searches)
    return lambda text: True


def normal_form(text: str) -> str:
    """The text memory scans and stores: NFKC (full-width digits and letters become ASCII ones) and
    without format characters (zero-width spaces and joiners, direction marks), which would otherwise
    hide an address or a number from every pattern."""
    if text.isascii():  # ASCII is its own NFKC form and holds no format character
        return text
    text = unicodedata.normalize("NFKC", text)
    if any(unicodedata.category(c) == "Cf" for c in text):
        text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return text


def _merge(findings: Iterable[Finding]) -> list[Finding]:
    merged: list[Finding] = []
    for f in sorted(findings, key=lambda f: (f.type, f.start, -f.end)):
        last = merged[-1] if merged else None
        if last is not None and last.type == f.type and f.start <= last.end:
            merged[-1] = Finding(f.type, last.start, max(last.end, f.end), max(last.score, f.score))
        else:
            merged.append(f)
    return sorted(merged, key=lambda f: (f.start, f.type))


def _spacy_engine(model: str) -> NlpEngine:
    import importlib.util

    if importlib.util.find_spec(model) is None:
        raise FleetError(
            ErrorCode.INVALID_REQUEST,
            f"the NER model {model!r} is not installed (install its package, or leave it unset)",
        )
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    engine = SpacyNlpEngine(models=[{"lang_code": "en", "model_name": model}])
    engine.load()
    return engine
