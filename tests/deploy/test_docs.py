"""docs/deployment.md says what the manifests do for the bus (authentication, TLS, the bootstrap),
and its known gaps no longer claim the bus is open: if the manifests lost the bus's authentication,
these tests and the text would have to change together."""

from __future__ import annotations

import re

from deploy._bus import NATS_AUTH_INCLUDE
from tests.deploy._files import ROOT, compose

DOCS = (ROOT / "docs" / "deployment.md").read_text()
BUS_DOCS = (ROOT / "docs" / "bus.md").read_text()


def _section(title: str) -> str:
    bodies: list[str] = re.findall(
        rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOCS, re.MULTILINE | re.DOTALL
    )
    (body,) = bodies
    return body


def _flat(text: str) -> str:
    return " ".join(text.split())


def _gaps() -> list[str]:
    return [_flat(item) for item in re.split(r"^\d+\. ", _section("Known gaps"), flags=re.MULTILINE)[1:]]


def test_no_known_gap_says_the_bus_is_unauthenticated_and_the_first_says_what_tls_lacks() -> None:
    gaps = _gaps()
    assert not any("bus's authentication" in gap for gap in gaps)
    assert gaps[0].startswith("**Not every hop is TLS yet**")
    for remaining in ("routes", "8222", "Postgres", "Qdrant", "OPA"):
        assert remaining in gaps[0], remaining


def test_the_enrollment_argument_says_nats_authenticates_every_connection() -> None:
    section = _flat(_section("Identities, keys and enrollment"))
    claim = section.index("proves nothing beyond")
    bus = section.index("**The bus is the registry's door too.**")
    assert claim < bus < claim + 600  # right after the claim it completes
    assert "cannot delete, purge or reconfigure a stream or bucket" in section
    bootstrap = section.index("**The bootstrap.**")
    assert "fails the start" in section[bootstrap:] and "read from the code" in section[bootstrap:]


def test_the_manifests_do_what_the_docs_say() -> None:
    """What the text claims of the compose file: NATS with the auth include, services over TLS,
    the registry as the bus's authority, a bootstrap one-shot before it."""
    services = compose()["services"]
    assert NATS_AUTH_INCLUDE in compose()["configs"]["nats-config"]["content"]
    assert services["registry"]["environment"]["FLEET_NATS_KEYS_DIR"]
    assert services["registry"]["environment"]["FLEET_NATS_URL"].startswith("tls://")
    assert services["registry"]["depends_on"]["bootstrap"]["condition"] == "service_completed_successfully"
    for name in ("`bootstrap`", "`bootstrap.yaml`", "`fleet-bus-admin`", "account `FLEET`"):
        assert name in DOCS, name


def test_bus_md_says_where_deployments_get_their_keys() -> None:
    intro = _flat(BUS_DOCS.split("## ", 1)[0])
    assert "do not configure this yet" not in intro
    assert "python -m deploy.keygen secrets DIR" in intro and "deploy.keygen provision" in intro
