"""The coordinator's agent cards: the public one and the extended one an authenticated caller gets.

The public card advertises streaming, push notifications and the extended card, and the two fleet
extensions a client needs to know about before it calls: lossless resume of ``SubscribeToTask``, and
how push notifications are signed. The extended card (``GetExtendedAgentCard``, behind the token
check like every A2A call) adds what depends on the deployment and the caller: the retention of the
event log and the caller's own tenancy.
"""

from __future__ import annotations

from typing import Any

from a2a.server.context import ServerCallContext
from a2a.types import AgentCard, AgentExtension
from google.protobuf.struct_pb2 import Struct

from coordinator.a2a_surface.push import SIGNATURE_HEADER
from coordinator.a2a_surface.task_events import RESUME_EXTENSION
from fleet.a2a_support import claims_of, sign_card
from fleet.keys import SigningKey

PUSH_SIGNATURE_EXTENSION = "https://agent-fleet.dev/ext/push-signature/v1"
TENANCY_EXTENSION = "https://agent-fleet.dev/ext/tenancy/v1"
JWKS_PATH = "/.well-known/jwks.json"

RESUME_DESCRIPTION = (
    "Lossless resume of SubscribeToTask. Every Task, status update and artifact update carries "
    f"metadata['{RESUME_EXTENSION}'].eventId: the sequence number of the run event it reflects. To "
    "resume, call SubscribeToTask with the service parameter (HTTP header) 'Last-Event-ID: N', N being "
    "the eventId of the last update you processed: the stream starts with the Task as it stood at "
    "event N, then carries exactly the updates after N (also when the task has ended since). If event "
    "N is older than the agent's retention, the stream starts with the current Task instead, marked "
    "metadata[...].resumed = 'snapshot'. Without the header, SubscribeToTask behaves as A2A specifies."
)


def _params(values: dict[str, Any]) -> Struct:
    params = Struct()
    params.update(values)
    return params


def resume_extension(retention_s: float | None = None) -> AgentExtension:
    values: dict[str, Any] = {"header": "Last-Event-ID", "metadataKey": "eventId"}
    if retention_s is not None:
        values["retentionSeconds"] = retention_s
    return AgentExtension(uri=RESUME_EXTENSION, description=RESUME_DESCRIPTION, params=_params(values))


def push_signature_extension(base_url: str, issuer: str) -> AgentExtension:
    return AgentExtension(
        uri=PUSH_SIGNATURE_EXTENSION,
        description=(
            f"Every push notification carries an ES256 JWT in the '{SIGNATURE_HEADER}' header (and in "
            "'Authorization: Bearer' unless your push config supplies its own credentials). Verify it "
            f"with the key of its 'kid' from {base_url}{JWKS_PATH}, and check iss, aud (your webhook "
            "URL), exp, and request_body_sha256 (the hex SHA-256 of the exact request body). It also "
            "names taskId, configId and eventId."
        ),
        params=_params({"jwksUrl": base_url + JWKS_PATH, "header": SIGNATURE_HEADER, "issuer": issuer}),
    )


def with_fleet_capabilities(card: AgentCard, base_url: str, issuer: str) -> AgentCard:
    """``card`` with push notifications, the extended card and the fleet's extensions advertised."""
    extended = AgentCard()
    extended.CopyFrom(card)
    extended.capabilities.push_notifications = True
    extended.capabilities.extended_agent_card = True
    extended.capabilities.extensions.extend([resume_extension(), push_signature_extension(base_url, issuer)])
    return extended


def extended_card(public: AgentCard, retention_s: float | None) -> AgentCard:
    """The extended card before it is tailored to a caller: the resume extension with retention."""
    card = AgentCard()
    card.CopyFrom(public)
    card.ClearField("signatures")
    for extension in card.capabilities.extensions:
        if extension.uri == RESUME_EXTENSION:
            extension.CopyFrom(resume_extension(retention_s))
    return card


class ExtendedCardForCaller:
    """Tailors the extended card to the caller (its tenant, subject and scopes) and signs it."""

    def __init__(self, key: SigningKey, jku: str) -> None:
        self._key = key
        self._jku = jku

    async def __call__(self, card: AgentCard, context: ServerCallContext) -> AgentCard:
        claims = claims_of(context)
        tailored = AgentCard()
        tailored.CopyFrom(card)
        tailored.capabilities.extensions.append(
            AgentExtension(
                uri=TENANCY_EXTENSION,
                description=(
                    "Your tasks belong to the tenant of your token: ListTasks lists only them, and a "
                    "task of another tenant is answered as not found."
                ),
                params=_params(
                    {"tenant": claims.tenant, "subject": claims.sub, "scopes": sorted(claims.scopes)}
                ),
            )
        )
        return sign_card(tailored, self._key, jku=self._jku)


__all__ = [
    "JWKS_PATH",
    "PUSH_SIGNATURE_EXTENSION",
    "TENANCY_EXTENSION",
    "ExtendedCardForCaller",
    "extended_card",
    "resume_extension",
    "with_fleet_capabilities",
]
