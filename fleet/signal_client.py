"""The signer's side of a signal: a signal for a run, signed for exactly its payload with a signal
grant from the token service, published on NATS (``fleet.signals.<run>``) where the coordinator takes
it in (it checks the grant against the payload, the run and the signer's rights), and the subjects
and streams of signals and of the approval requests they answer. Anything that may sign (an
operator's tool, an approver's client, a test) uses this; nothing here decides anything."""

from __future__ import annotations

import json
import uuid
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext

from fleet.events import ensure_stream
from fleet.tokens import SignalBinding, TokenClient

APPROVALS_STREAM = "FLEET_APPROVALS"
APPROVALS_SUBJECTS = "fleet.approvals.>"
SIGNALS_STREAM = "FLEET_SIGNALS"
SIGNALS_SUBJECTS = "fleet.signals.>"
SIGNALS_PREFIX = "fleet.signals."
OUTCOMES_PREFIX = "fleet.signal_outcomes."
GRANT_HEADER = "Fleet-Signal-Grant"

_streams_ready: set[str] = set()


async def ensure_signal_streams(js: JetStreamContext) -> None:
    """The approval requests and signals streams (de-duplicated by ``Nats-Msg-Id``); looked up
    once per process, as every parked run publishes."""
    for name, subjects in ((APPROVALS_STREAM, APPROVALS_SUBJECTS), (SIGNALS_STREAM, SIGNALS_SUBJECTS)):
        if name not in _streams_ready:
            await ensure_stream(js, name, subjects, max_age_s=30 * 24 * 3600.0)
            _streams_ready.add(name)


async def sign_signal(
    tokens: TokenClient,
    run_id: str,
    body: dict[str, Any],
    *,
    tenant: str,
    signal_id: str | None = None,
    audience: str = "coordinator",
) -> tuple[bytes, dict[str, str]]:
    """The payload and headers of a signal for ``run_id``: its id and a signal grant for exactly
    this payload, asked of the token service with ``tokens`` (the signer's own credentials)."""
    signal_id = signal_id or uuid.uuid4().hex
    payload = json.dumps(body).encode()
    binding = SignalBinding.of(run_id, str(body.get("action", "")), signal_id, payload)
    grant = await tokens.signal_grant(audience, tenant, binding)
    return payload, {"Nats-Msg-Id": signal_id, GRANT_HEADER: grant}


async def publish_signal(
    client: NATS,
    run_id: str,
    tokens: TokenClient,
    body: dict[str, Any],
    *,
    tenant: str,
    signal_id: str | None = None,
    audience: str = "coordinator",
) -> tuple[str, bool]:
    """Send a signal for ``run_id`` of ``tenant`` on NATS, signed for the holder of ``tokens``'
    key (see :func:`sign_signal`): (its id, whether the stream kept it; False when that id was
    sent within the de-duplication window, e.g. a retry)."""
    payload, headers = await sign_signal(
        tokens, run_id, body, tenant=tenant, signal_id=signal_id, audience=audience
    )
    js = client.jetstream()
    await ensure_signal_streams(js)
    ack = await js.publish(SIGNALS_PREFIX + run_id, payload, headers=headers)
    return headers["Nats-Msg-Id"], not ack.duplicate
