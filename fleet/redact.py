"""Redaction of what the platform writes down (event logs, recorded requests): secrets never reach a
log. Applied to every event payload before it is appended; the values a run executes with (its plan)
are kept as given, only their copy in the log is redacted.

Two rules, both conservative:

- a value under a key that names a secret (``password``, ``secret``, ``token``, ``api_key``,
  ``authorization``, ``credential(s)``, ``private_key``, ``cookie``, or a key ending in one of those,
  such as ``access_token``) is replaced whole;
- a string that carries a bearer token, a JWT or a PEM private key has that part replaced.
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
    r"(?i:bearer\s+)[A-Za-z0-9._~+/=-]{8,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----",
    re.DOTALL,
)


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
        return text, found
    return value, 0
