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


def test_the_first_known_gap_is_that_nats_has_no_authentication() -> None:
    items = re.split(r"^\d+\. ", _section("Known gaps"), flags=re.MULTILINE)[1:]
    first = _flat(items[0])
    assert first.startswith("**NATS has no authentication")
    for bucket in (RECORDS_BUCKET, REVOCATIONS_BUCKET, POLICY_BUCKET):
        assert f"`{bucket}`" in first, bucket
    assert f"`$KV.{RECORDS_BUCKET}.>`" in first
    assert "allow-all policy" in first and "any identity" in first
    assert "NetworkPolicies narrow who reaches NATS but do not stop this" in first
    assert sum("NATS has no authentication" in item for item in items) == 1  # said once, first


def test_the_enrollment_argument_carries_the_nats_caveat() -> None:
    section = _flat(_section("Identities, keys and enrollment"))
    claim = section.index("proves nothing beyond")
    caveat = section.index("**But NATS has no authentication in this base**")
    assert claim < caveat < claim + 600  # right after the claim it qualifies
    assert "can therefore enroll itself as any identity" in section
    assert "allow-all policy" in section


def test_the_docs_are_right_that_connect_takes_no_nats_credentials() -> None:
    """When ``connect`` learns credentials, the gap (and this test) must change."""
    parameters = set(inspect.signature(natsconn.connect).parameters)
    assert parameters == {"url", "name", "replicas"}
