"""Redaction of what the platform writes down (event logs, recorded requests): secrets never reach a
log. Applied to every event payload before it is appended; the values a run executes with (its plan)
are kept as given, only their copy in the log is redacted.

Two rules, both conservative:

- a value under a key that names a secret (``password``, ``secret``, ``token``, ``api_key``,
  ``authorization``, ``credential(s)``, ``private_key``, ``cookie``, or a key ending in one of those,
  such as ``access_token``) is replaced whole;
- a string that carries a secret has that part replaced: bearer and basic credentials, JWTs, PEM
  private keys, the password of a URL (``postgresql://user:PASSWORD@host``), ``key=value`` pairs
  whose key names a secret (``password=...``, ``api_key: ...``), and tokens with a well-known
  shape (AWS access key ids, GitHub, Slack, OpenAI-style ``sk-`` keys).
"""

from __future__ import annotations

import re
from typing import Any

MARK = "[redacted]"
_SECRET_KEYS = (
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "credential",
    "credentials",
    "private_key",
    "secret_key",
    "access_key",
    "cookie",
)
_SECRET_TEXT = re.compile(
    r"(?i:bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"
    r"|(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----(?:(?!-----BEGIN ).)*?-----END [A-Z ]*PRIVATE KEY-----"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
    r"|\bsk-[A-Za-z0-9_-]{20,}",
    re.DOTALL,
)
# Secrets after a prefix that stays readable: a URL's password, and key=value / key: value pairs.
_SECRET_AFTER = re.compile(
    r"(?P<keep>(?<![a-z0-9+.-])[0-9+.-]*[a-z][a-z0-9+.-]*://[^\s/:@]+:)[^\s@/]+(?=@)"
    r"|(?P<pair>(?i:\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|token|client[_-]secret)"
    r"\s*[=:]\s*))(?![\[\s])[^\s,;&\"']+"
)


def _keep_prefix(match: re.Match[str]) -> str:
    return (match.group("keep") or match.group("pair")) + MARK


def _secret_key(key: str) -> bool:
    normal = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower().replace("-", "_")
    return any(normal == name or normal.endswith("_" + name) for name in _SECRET_KEYS)


def redact(value: Any) -> tuple[Any, int]:
    """``value`` with secrets replaced, and how many were."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        count = 0
        for key, item in value.items():
            if isinstance(key, str) and _secret_key(key) and item not in (None, "", MARK):
                out[key] = MARK
                count += 1
            else:
                out[key], found = redact(item)
                count += found
        return out, count
    if isinstance(value, list):
        items = [redact(item) for item in value]
        return [item for item, _ in items], sum(found for _, found in items)
    if isinstance(value, str):
        text, found = _SECRET_TEXT.subn(MARK, value)
        text, more = _SECRET_AFTER.subn(_keep_prefix, text)
        return text, found + more
    return value, 0
