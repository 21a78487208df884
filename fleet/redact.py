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

Every pattern runs in time linear in the text (``tests/unit/test_linear_patterns.py`` holds them to
it on adversarial input), so the whole of every string is read, however long: nothing is truncated.
The patterns run on the ``regex`` engine, which releases the GIL while it matches: :func:`redact_async`
redacts a large value in a worker thread without stalling the event loop.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import regex

MARK = "[redacted]"
OFF_LOOP_CHARS = 32_768  # larger values are redacted in a worker thread (about 5 ms of matching)
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
_SECRET_TEXT = regex.compile(
    r"(?i:bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"
    r"|(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----(?:(?!-----BEGIN ).)*?-----END [A-Z ]*PRIVATE KEY-----"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
    r"|\bsk-[A-Za-z0-9_-]{20,}",
    regex.DOTALL,
)
# Secrets after a prefix that stays readable: a URL's password, and key=value / key: value pairs.
_SECRET_AFTER = regex.compile(
    r"(?P<keep>(?<![a-z0-9+.-])[0-9+.-]*[a-z][a-z0-9+.-]*://[^\s/:@]+:)[^\s@/]+(?=@)"
    r"|(?P<pair>(?i:\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|token|client[_-]secret)"
    r"\s*[=:]\s*))(?![\[\s])[^\s,;&\"']+"
)


def _keep_prefix(match: regex.Match[str]) -> str:
    kept: str = match.group("keep") or match.group("pair")
    return kept + MARK


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
        text, found = _SECRET_TEXT.subn(MARK, value, concurrent=True)
        text, more = _SECRET_AFTER.subn(_keep_prefix, text, concurrent=True)
        return text, found + more
    return value, 0


async def redact_async(value: Any) -> tuple[Any, int]:
    """:func:`redact`, in a worker thread when ``value`` holds more than ``OFF_LOOP_CHARS``
    characters of text, so that the event loop keeps serving other requests meanwhile."""
    if _chars(value) <= OFF_LOOP_CHARS:
        return redact(value)
    return await asyncio.to_thread(redact, value)


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_chars(item) for item in value)
    return 0
