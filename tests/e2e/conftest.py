"""End-to-end fixtures: the real stack, started as subprocesses by ``fleet up`` in a temporary data dir,
and driven only through its public surfaces (A2A with the a2a-sdk client, MCP over HTTP, the CLI)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleetctl.testing.e2e import FAST_METRICS, TEST_PUSH_HOSTS, Stack, clean_env, start_stack, stop_stack
from tests.e2e.identities import Impostor, PartnerIdp
from tests.e2e.webhooks import WebhookReceiver


@pytest.fixture(scope="session")
def partner_idp() -> Iterator[PartnerIdp]:
    """An identity provider outside the fleet that the shared stack trusts (``identities.py``)."""
    idp = PartnerIdp()
    yield idp
    idp.close()


@pytest.fixture(scope="session")
def webhooks() -> Iterator[WebhookReceiver]:
    """The receiver of the shared stack's outbox destinations (``webhooks.py``)."""
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def stack(
    tmp_path_factory: pytest.TempPathFactory, partner_idp: PartnerIdp, webhooks: WebhookReceiver
) -> Iterator[Stack]:
    """One stack shared by the tests that do not break it."""
    outside = {
        "FLEET_EXTERNAL_ISSUERS": json.dumps([partner_idp.config()]),
        "FLEET_OUTBOX_DESTINATIONS": json.dumps(webhooks.destinations()),
    }
    running = start_stack(
        tmp_path_factory.mktemp("stack"), env=clean_env(**TEST_PUSH_HOSTS, **FAST_METRICS, **outside)
    )
    yield running
    stop_stack(running)


@pytest.fixture
async def impostor(stack: Stack) -> Impostor:
    """An identity enrolled on the shared stack, for probing the registry (``identities.py``)."""
    identity = Impostor(stack)
    async with httpx.AsyncClient() as http:
        response = await identity.enroll(http, identity.enrollment_token())
    assert response.status_code == 201, response.text
    return identity


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of the test's own, for tests that kill or restart parts of it."""
    running = start_stack(tmp_path / "fleet")
    yield running
    stop_stack(running)
