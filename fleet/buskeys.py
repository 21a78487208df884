"""The keys of a fleet's bus, and the NATS server configuration that trusts them.

NATS is configured with three accounts and an authorization callout served by the registry:

* ``FLEET``: every fleet process and every producer lands here, with the permissions the registry
  computes for its identity (``fleet.bus`` policy); JetStream lives here. Its only static user is
  the bootstrap admin, which creates the streams and buckets and nothing else uses.
* ``AUTH``: where the server asks the registry (``$SYS.REQ.USER.AUTH``) who a new connection is;
  its only user is the registry's callout responder.
* ``SYS``: the server's system account; its only user is the registry's, which finds and closes
  the connections of a revoked identity.

The static users authenticate with nkeys (the server holds only their public keys). Every other
connection is decided by the callout: the registry checks the credential the client presents and
answers with a user JWT signed by the callout issuer key, which the server trusts because its public
key is in this configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleet.natsconn import Credentials
from fleet.natsjwt import PREFIX_ACCOUNT, PREFIX_USER, KeyPair

FLEET_ACCOUNT = "FLEET"
AUTH_ACCOUNT = "AUTH"
SYSTEM_ACCOUNT = "SYS"

_SEEDS = {
    "callout_issuer": PREFIX_ACCOUNT,
    "credentials_issuer": PREFIX_ACCOUNT,
    "responder": PREFIX_USER,
    "system": PREFIX_USER,
    "admin": PREFIX_USER,
}
# The seeds the registry is given (``FLEET_NATS_KEYS_DIR``): it answers the callout and closes
# connections; the admin's seed and the producers' credentials issuer are not among them.
REGISTRY_KEYS: tuple[str, ...] = ("callout_issuer", "responder", "system")


@dataclass(frozen=True, slots=True)
class BusKeys:
    """The nkeys of a bus (see the module's doc):

    * ``callout_issuer`` signs the callout's answers (the server trusts its public key);
    * ``credentials_issuer`` signs producers' credentials (only the registry checks them);
    * ``responder``, ``system``: the registry's two static connections;
    * ``admin``: the bootstrap identity."""

    callout_issuer: KeyPair
    credentials_issuer: KeyPair
    responder: KeyPair
    system: KeyPair
    admin: KeyPair

    @classmethod
    def load_or_create(cls, folder: Path) -> BusKeys:
        """The keys kept in ``folder`` (one seed file each, mode 0600), made on first use."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(**{name: _seed_file(folder / f"{name}.nk", prefix) for name, prefix in _SEEDS.items()})

    @classmethod
    def load(cls, folder: Path, *names: str) -> dict[str, KeyPair]:
        """Only the keys ``names`` from ``folder`` (a service is given the seeds it needs, no more)."""
        return {name: KeyPair.from_seed((folder / f"{name}.nk").read_text()) for name in names}


def _seed_file(path: Path, prefix: int) -> KeyPair:
    if path.exists():
        return KeyPair.from_seed(path.read_text())
    pair = KeyPair.generate(prefix)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(pair.seed + "\n")
    return pair


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A NATS server's certificate and key (PEM files)."""

    cert_file: Path
    key_file: Path


def server_config(
    *,
    callout_issuer: str,
    responder: str,
    system: str,
    admin: str,
    tls: ServerTls | None = None,
    max_connections: int = 4096,
) -> str:
    """The authentication part of a NATS server's configuration (public keys only): accounts,
    static users, the callout, and TLS if given. Listen addresses, JetStream storage and clustering
    come from the caller (command-line flags or more configuration)."""
    lines = [
        "accounts {",
        f'  {AUTH_ACCOUNT}: {{ users: [ {{ nkey: "{responder}" }} ] }}',
        f'  {FLEET_ACCOUNT}: {{ jetstream: enabled, users: [ {{ nkey: "{admin}" }} ] }}',
        f'  {SYSTEM_ACCOUNT}: {{ users: [ {{ nkey: "{system}" }} ] }}',
        "}",
        f"system_account: {SYSTEM_ACCOUNT}",
        f"max_connections: {max_connections}",
        "authorization {",
        "  timeout: 3",
        "  auth_callout {",
        f'    issuer: "{callout_issuer}"',
        f'    auth_users: [ "{responder}", "{admin}", "{system}" ]',
        f"    account: {AUTH_ACCOUNT}",
        "  }",
        "}",
    ]
    if tls is not None:
        lines += [
            "tls {",
            f'  cert_file: "{tls.cert_file}"',
            f'  key_file: "{tls.key_file}"',
            "  timeout: 3",
            "}",
        ]
    return "\n".join(lines) + "\n"


def stack_config(keys: BusKeys, tls: ServerTls | None = None) -> str:
    """:func:`server_config` for ``keys``."""
    return server_config(
        callout_issuer=keys.callout_issuer.public_key,
        responder=keys.responder.public_key,
        system=keys.system.public_key,
        admin=keys.admin.public_key,
        tls=tls,
    )


def admin_credentials(keys_dir: Path, tls_ca: Path | None = None) -> Credentials:
    """The bootstrap admin's credentials (the seed in ``keys_dir``): it creates streams and buckets,
    and reads and writes everything. Nothing in the fleet runs with them; operators' maintenance
    and tests of what a compromised admin could do use them."""
    seed = (keys_dir / "admin.nk").read_text().strip()
    return Credentials("fleet-admin", nkey_seed=seed, tls_ca=tls_ca)
