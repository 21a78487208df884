"""``fleet producers``: credentials for event producers outside the fleet.

``issue`` makes an nkey on this machine (its seed is written to a file only you get, and never
leaves it), and has the registry record its public key with one tenant, the sources it may publish
as, and an expiry. Any NATS client uses the seed file as it is (``nats --nkey FILE``, nats.js's
``nkeyAuthenticator``, nats-py's ``nkeys_seed``), with its own inbox prefix ``_INBOX.<producer>``
for replies, and may publish on ``fleet.events.<tenant>.<source>.<name...>``, nothing else.
``revoke`` takes them back: the producer's connections are closed within a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fleet.natsconn import inbox_prefix
from fleet.natsjwt import PREFIX_USER, KeyPair
from fleetctl.cli_common import EXIT_OK, emit, operator_client
from fleetctl.layout import StackLayout

ADMIN = ("registry:admin", "registry:read")


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


async def issue(
    layout: StackLayout,
    producer_id: str,
    tenant: str,
    sources: list[str],
    lifetime_s: float,
    out: Path,
    *,
    as_json: bool = False,
) -> int:
    """Issue a producer's credentials and write its seed to ``out`` (mode 0600)."""
    key = KeyPair.generate(PREFIX_USER)
    body = {
        "id": producer_id,
        "nkey": key.public_key,
        "tenant": tenant,
        "sources": sources,
        "lifetime_s": lifetime_s,
    }
    async with operator_client(layout, "registry", "default", ADMIN) as api:
        answer: dict[str, Any] = await api.post("/v1/producers", body)
    _write_secret(out, key.seed + "\n")
    answer = {**answer, "seed_file": str(out), "inbox_prefix": inbox_prefix(producer_id)}
    subjects = ", ".join(f"fleet.events.{tenant}.{source}.<name...>" for source in sources)
    text = (
        f"producer {producer_id}: seed in {out} (keep it secret); it may publish {subjects}"
        f" until {answer['expires_at']:.0f} (epoch s)\n"
        f"  nats --server NATS_URL --nkey {out} --inbox-prefix {inbox_prefix(producer_id)} pub ..."
    )
    emit(answer, as_json=as_json, text=text)
    return EXIT_OK


async def revoke(layout: StackLayout, producer_id: str, reason: str, *, as_json: bool = False) -> int:
    async with operator_client(layout, "registry", "default", ADMIN) as api:
        answer: dict[str, Any] = await api.post(f"/v1/producers/{producer_id}/revoke", {"reason": reason})
    emit(answer, as_json=as_json, text=f"producer {producer_id}: credentials revoked, its connections closed")
    return EXIT_OK


async def listing(layout: StackLayout, *, as_json: bool = False) -> int:
    async with operator_client(layout, "registry", "default", ADMIN) as api:
        answer: dict[str, Any] = await api.get("/v1/producers")
    lines = [
        f"{p['id']}  {p['tenant']}  {','.join(p['sources'])}  expires {p['expires_at']:.0f}"
        + ("  revoked" if p["revoked"] else "")
        for p in answer["producers"]
    ]
    emit(answer, as_json=as_json, text="\n".join(lines) or "no producers")
    return EXIT_OK
