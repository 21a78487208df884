"""Fixtures of the LLM tests: an HTTP client, and a NATS of their own for the registries they start."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from fleetctl.testing.nats import embedded_nats


@pytest.fixture(scope="package")
def registry_nats() -> Iterator[str]:
    """A NATS for these tests only: each test's registry keeps its records there."""
    with embedded_nats() as url:
        yield url


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client
