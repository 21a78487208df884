"""``pytest.raises`` for the fleet's errors: the error's code is read from the error (data), and
its message, if asked, matched apart."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from fleet.errors import ErrorCode, FleetError


@contextlib.contextmanager
def raises_code(
    code: ErrorCode | str, match: str | None = None
) -> Iterator[pytest.ExceptionInfo[FleetError]]:
    """Expect a :class:`FleetError` with ``code`` (and a message ``match`` searches, if given)."""
    with pytest.raises(FleetError, match=match) as caught:
        yield caught
    assert caught.value.code == code, caught.value
