"""docs/deployment.md says what the base does not protect: NATS is unauthenticated, and that is the
first known gap and part of the enrollment's security argument, with the buckets that are exposed."""

from __future__ import annotations

import inspect
import re

from fleet import natsconn
from fleet.revocations import REVOCATIONS_BUCKET
from policy.live import POLICY_BUCKET
from registry._store import RECORDS_BUCKET
from tests.deploy._files import ROOT

DOCS = (ROOT / "docs" / "deployment.md").read_text()


def _section(title: str) -> str:
    (body,) = re.findall(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOCS, re.MULTILINE | re.DOTALL)
    return body


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_first_known_gap_is_that_the_manifests_do_not_authenticate_the_bus() -> None:
    items = re.split(r"^\d+\. ", _section("Known gaps"), flags=re.MULTILINE)[1:]
    first = _flat(items[0])
    assert first.startswith("**The manifests do not configure the bus's authentication**")
    for bucket in (RECORDS_BUCKET, REVOCATIONS_BUCKET, POLICY_BUCKET):
        assert f"`{bucket}`" in first, bucket
    assert "NetworkPolicies narrow who reaches NATS but do not stop this" in first
    assert sum("bus's authentication" in item for item in items) == 1  # said once, first


def test_the_enrollment_argument_carries_the_bus_caveat() -> None:
    section = _flat(_section("Identities, keys and enrollment"))
    claim = section.index("proves nothing beyond")
    caveat = section.index("**But the manifests do not configure the bus's authentication yet**")
    assert claim < caveat < claim + 600  # right after the claim it qualifies
    assert "can still delete or purge them" in section


def test_the_service_code_has_what_the_gap_asks_for() -> None:
    """The gap says the code is there and the manifests are not: when the manifests configure the
    bus, the gap (and this test) must change."""
    assert "credentials" in inspect.signature(natsconn.connect).parameters
    manifests = (ROOT / "deploy" / "compose.yaml").read_text()
    assert "auth_callout" not in manifests and "FLEET_NATS_KEYS_DIR" not in manifests
