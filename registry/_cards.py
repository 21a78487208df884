"""Fetching and checking A2A agent cards: schema, JWS signature by the agent's enrolled key, and
that the card describes the host it was registered at."""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import jwt
from a2a.types import AgentCard
from a2a.utils.signing import SignatureVerificationError, create_signature_verifier
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError

from fleet import outbound
from fleet.errors import ErrorCode, FleetError
from fleet.keys import ALGORITHM
from registry._records import AgentRecord, IdentityRecord, SkillRecord

log = logging.getLogger(__name__)

CARD_PATH = "/.well-known/agent-card.json"


def _invalid(message: str) -> FleetError:
    return FleetError(ErrorCode.CARD_INVALID, message)


def card_url_of(base_url: str) -> str:
    """The card's URL under ``base_url``, an http(s) URL with a host and no query, fragment or
    credentials (which would move the card's path elsewhere), or ``card_invalid``."""
    try:
        parts = urlsplit(base_url)
        valid = parts.port is None or parts.port > 0
    except ValueError:
        valid = False
    if not valid:
        raise _invalid("the agent's URL is not a valid URL")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _invalid("the agent's URL must be an http or https URL with a host")
    if parts.query or parts.fragment or "?" in base_url or "#" in base_url or "@" in parts.netloc:
        raise _invalid("the agent's URL must have no query, fragment or credentials")
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + CARD_PATH, "", ""))


async def fetch_verified_card(
    http: httpx.AsyncClient, identity: IdentityRecord, base_url: str
) -> AgentRecord:
    """Fetch ``base_url``'s card and return the record to store, or raise ``card_invalid``. ``http``:
    a client of :func:`fleet.outbound.guarded_client` (purpose ``card``). What the agent's server
    answered (its status, its body) never appears in an error: it may not be the agent's."""
    card_url = card_url_of(base_url)
    host = urlsplit(card_url).hostname
    agent = {"id": identity.id, "external": identity.external}
    try:
        response = await http.get(card_url, extensions=outbound.facts(agent=agent))
    except httpx.TransportError as exc:
        # The agent may still be starting: worth another try.
        raise FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE, f"cannot reach the card at {host}", retryable=True
        ) from exc
    if response.status_code != 200:
        log.warning("card of %s at %s: answered %d", identity.id, card_url, response.status_code)
        if response.status_code >= 500:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, f"the card at {host} is not available", retryable=True
            )
        raise _invalid(f"{host} did not serve a card at {CARD_PATH}")
    try:
        document = response.json()
    except ValueError as exc:
        raise _invalid(f"{host} did not serve a card at {CARD_PATH}") from exc
    card = parse_card(document)
    verify_card_signature(card, identity)
    url = _check_interfaces(card, base_url)
    return AgentRecord(
        id=identity.id,
        kind=identity.kind,
        card_url=card_url,
        url=url,
        version=card.version,
        skills=[
            SkillRecord(id=s.id, name=s.name, description=s.description, tags=list(s.tags))
            for s in card.skills
        ],
        card=MessageToDict(card),
        registered_at=time.time(),
        external=identity.external,
    )


def parse_card(document: Any) -> AgentCard:
    if not isinstance(document, dict):
        raise _invalid("card is not a JSON object")
    try:
        card: AgentCard = ParseDict(document, AgentCard())
    except ParseError as exc:
        # The parser's message quotes the document (its unknown keys): logged, not returned.
        log.warning("a card does not match the A2A schema: %s", exc)
        raise _invalid("the card does not match the A2A schema") from exc
    if not card.name or not card.supported_interfaces:
        raise _invalid("card needs a name and at least one interface")
    return card


def verify_card_signature(card: AgentCard, identity: IdentityRecord) -> None:
    """At least one signature must verify with a key enrolled by ``identity``."""

    def key_provider(kid: str | None, jku: str | None) -> jwt.PyJWK:
        jwk = identity.usable_keys(time.time()).get(kid or "")
        if jwk is None:
            raise jwt.InvalidKeyError("card signed by a key that is not enrolled")
        return jwt.PyJWK(jwk, algorithm=ALGORITHM)

    try:
        create_signature_verifier(key_provider, [ALGORITHM])(card)
    except SignatureVerificationError as exc:
        raise _invalid(f"card signature does not verify: {exc}") from exc


def _check_interfaces(card: AgentCard, base_url: str) -> str:
    """Every interface of the card on the host the agent registered: the HTTP bindings at its
    registered scheme and port, a gRPC one on the same scheme and host at a port of its own. The
    first interface is where the agent is called."""
    registered = urlsplit(base_url)
    for interface in card.supported_interfaces:
        url = urlsplit(interface.url)
        if interface.protocol_binding == "GRPC":
            try:
                port = url.port
            except ValueError:
                port = None
            if (url.scheme, url.hostname) != (registered.scheme, registered.hostname) or not port:
                raise _invalid(
                    f"card gRPC interface {interface.url} is not on the registered host "
                    f"{registered.scheme}://{registered.hostname}"
                )
            continue
        if (url.scheme, url.netloc) != (registered.scheme, registered.netloc):
            raise _invalid(
                f"card interface {interface.url} is not on the registered host "
                f"{registered.scheme}://{registered.netloc}"
            )
    if card.supported_interfaces[0].protocol_binding == "GRPC":
        raise _invalid("the card's first interface (where the fleet calls it) must be an HTTP binding")
    return str(card.supported_interfaces[0].url)
