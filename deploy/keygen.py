"""Identities and passwords of a deployed fleet (compose or Kubernetes), and their enrollment.

``fleet up`` makes each service's key and mints its one-time enrollment token itself. A deployment
has no supervisor, so this module does the same from the outside::

    python -m deploy.keygen secrets DIR       # keys, certificates and passwords, once (kept if present)
    python -m deploy.keygen provision --nats URL --keys DIR [--tls-ca FILE] [--replicas N]
    python -m deploy.keygen enroll --registry URL --operator-key FILE --public-keys DIR
    python -m deploy.keygen token ID --operator-key FILE --out FILE
    python -m deploy.keygen certify --operator-key FILE --jwk FILE   # a rotated registry key's certificate

``DIR`` holds ``operator/`` (the operator's key: the registry's root of trust, and its public JWK),
``identities/<id>/key.pem`` (one per deployed identity, beside a copy of the operator's public JWK,
which every service pins; the registry's also beside ``issuer-cert.jwt``, the operator's
certificate for the registry's signing key: see ``fleet.issuer_certs``, and ``tenant-key-master.json``,
the secret every tenant's artifact key derives from: see ``fleet.tenant_keys``; made once, kept, never
replaced: losing it loses every artifact), ``public/<id>.jwk.json`` (each one's
public key: what ``enroll`` reads), ``postgres/`` (the superuser's and each database role's
password) and ``postgres/dsn-<database>`` (what ``FLEET_PG_DSN`` is in Kubernetes). Nothing here is
ever committed: ``deploy/k8s/secrets/`` is ignored by git.

The bus (see ``docs/bus.md``): ``bus/`` holds every nkey seed of :class:`fleet.buskeys.BusKeys`
(mounted by nobody); the registry's identity folder gets copies of the seeds it reads
(:data:`fleet.buskeys.REGISTRY_KEYS`: what ``FLEET_NATS_KEYS_DIR`` points at), ``bus-admin/`` the
bootstrap admin's seed alone (mounted only by the bootstrap step, ``provision``); ``nats/`` is what
the NATS servers mount: the auth include (public keys only), their TLS certificate and key, and the
Kubernetes routes' credentials. ``tls/`` is the deployment's CA (its key mounted by nobody),
``tls-ca/`` its certificate (and ``trust.pem``: it with the public roots), which everyone trusts;
each identity's folder has its HTTPS certificate and key (``tls.pem``, ``tls-key.pem``).

``provision`` runs once per deployment start, before the registry (a compose one-shot once NATS is
healthy, a Kubernetes Job): as the bootstrap admin it creates every stream, KV bucket and object
store (:func:`fleet.buscatalog.provision`), which the services may not create on an authenticated
bus. It is safe to run again.

``enroll`` runs once per deployment (a Kubernetes Job, a compose one-shot), after the registry is
up: it mints a one-time token per identity with the operator key and enrolls that identity's
public key. Services start without a token and only check that their key is enrolled, so the
operator key stays out of every service's pod. Run it again for a new identity or key; for one
already enrolled it changes nothing but the enrollment time (and the scopes, if they changed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy._bus import NATS_CERT, NATS_KEY, auth_conf, cluster_conf, nats_cert_names, service_cert_names
from deploy.enrollment import enrollment_token
from deploy.local_stack import DATABASES, OPERATOR_ID, ServiceSpec, service
from deploy.manifest import deployment_roster
from fleet.buscatalog import provision
from fleet.buskeys import REGISTRY_KEYS, BusKeys, admin_credentials
from fleet.errors import FleetError
from fleet.issuer_certs import certify_issuer_key
from fleet.keys import SigningKey
from fleet.natsconn import TRANSIENT, connect
from fleet.settings import DEFAULT_ISSUER, FleetSettings
from fleet.tenant_keys import MasterSecret
from fleet.tlsca import CertificateAuthority, write_trust

WORKER_ID = "worker-1"  # the id every pod of the Kubernetes worker Deployment runs as
PG_HOST = "postgres"


@dataclass(frozen=True, slots=True)
class SecretsDir:
    """The layout of a deployment's secrets folder."""

    root: Path

    @property
    def operator_key(self) -> Path:
        return self.root / "operator" / f"{OPERATOR_ID}.pem"

    @property
    def operator_jwk(self) -> Path:
        return self.root / "operator" / f"{OPERATOR_ID}.jwk.json"

    def identity(self, service_id: str) -> Path:
        return self.root / "identities" / service_id

    def key(self, service_id: str) -> Path:
        return self.identity(service_id) / "key.pem"

    def issuer_cert(self, service_id: str) -> Path:
        """The registry's: the operator's certificate for its signing key."""
        return self.identity(service_id) / "issuer-cert.jwt"

    @property
    def public(self) -> Path:
        """The identities' public keys, ``<id>.jwk.json`` each (not secret: what ``enroll`` reads)."""
        return self.root / "public"

    def public_jwk(self, service_id: str) -> Path:
        return self.public / f"{service_id}.jwk.json"

    def pg_password(self, role: str) -> Path:
        return self.root / "postgres" / f"{role}-password"

    def pg_dsn(self, database: str) -> Path:
        return self.root / "postgres" / f"dsn-{database}"

    @property
    def bus_keys(self) -> Path:
        """Every seed of the bus (:class:`fleet.buskeys.BusKeys`): no container mounts it."""
        return self.root / "bus"

    @property
    def bus_admin(self) -> Path:
        """The bootstrap admin's seed (``admin.nk``) alone: only the bootstrap step mounts it."""
        return self.root / "bus-admin"

    @property
    def nats(self) -> Path:
        """What the NATS servers mount: ``auth.conf``, ``cluster.conf``, their certificate and key."""
        return self.root / "nats"

    @property
    def tls(self) -> Path:
        """The deployment's CA (``ca.pem``, ``ca-key.pem``): no container mounts it."""
        return self.root / "tls"

    @property
    def tls_ca(self) -> Path:
        """What every container trusts: the CA's certificate, and ``trust.pem`` (it and the public roots)."""
        return self.root / "tls-ca"

    def tls_cert(self, service_id: str) -> Path:
        return self.identity(service_id) / "tls.pem"

    def tls_key(self, service_id: str) -> Path:
        return self.identity(service_id) / "tls-key.pem"


def identities() -> tuple[ServiceSpec, ...]:
    """Every identity a deployment runs: each service of the platform's roster, or of the project
    ``$FLEET_MANIFEST`` names (compose runs them as they are; Kubernetes runs the workers as one
    Deployment of ``worker-1``). Read by the commands of this script, its entry point."""
    return deployment_roster(FleetSettings().manifest)


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staged = path.with_name(path.name + ".new")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(staged, mode)
    os.replace(staged, path)


def _keep_or_write(path: Path, text: str, mode: int = 0o600) -> str:
    """The file's content if it exists, else ``text`` written there."""
    if path.exists():
        return path.read_text()
    _write_private(path, text, mode)
    return text


def make_secrets(root: Path) -> SecretsDir:
    """Create what is missing under ``root``: the operator key and JWK, one key per identity (and
    its public JWK), the Postgres passwords and DSNs, each identity's copy of the operator JWK,
    the bus's keys and configuration, the CA and the TLS certificates. Existing files are kept
    (the copies follow what they copy)."""
    layout = SecretsDir(root)
    _make_identities(layout)
    _make_postgres(layout)
    _make_bus(layout)
    _make_tls(layout)
    return layout


def _make_identities(layout: SecretsDir) -> None:
    operator = SigningKey.load_or_create(layout.operator_key)
    jwk = json.dumps(operator.public_jwk())
    _keep_or_write(layout.operator_jwk, jwk, 0o644)
    for spec in identities():
        key = SigningKey.load_or_create(layout.key(spec.id))
        # Every service pins the operator's key (compose mounts its identity folder).
        _write_private(layout.identity(spec.id) / "operator.jwk.json", layout.operator_jwk.read_text(), 0o644)
        if spec.kind == "registry":  # it does not enroll; its signing key needs the operator's certificate
            cert = certify_issuer_key(operator, DEFAULT_ISSUER, key.public_jwk())
            _write_private(layout.issuer_cert(spec.id), cert + "\n", 0o644)  # it follows the key
            MasterSecret.load_or_create(layout.identity(spec.id) / "tenant-key-master.json")  # kept
        else:
            # Written every time: it follows the key (a key deleted and made again, to rotate it).
            _write_private(layout.public_jwk(spec.id), json.dumps(key.public_jwk()), 0o644)


def _make_postgres(layout: SecretsDir) -> None:
    # The Postgres image reads its password files as its own user: these few are world-readable
    # in their folder, which only the Postgres container mounts.
    _keep_or_write(layout.pg_password("postgres"), secrets.token_urlsafe(24), 0o644)
    for database in DATABASES:
        password = _keep_or_write(layout.pg_password(database), secrets.token_urlsafe(24), 0o644)
        dsn = f"host={PG_HOST} port=5432 dbname={database} user={database} password={password}"
        _keep_or_write(layout.pg_dsn(database), dsn)
        for spec in identities():
            if spec.database == database:  # compose: libpq's passfile, so no password is in the env
                pgpass = f"{PG_HOST}:5432:{database}:{database}:{password}\n"
                _write_private(layout.identity(spec.id) / "pgpass", pgpass)


def _make_bus(layout: SecretsDir) -> None:
    """The bus's seeds, their copies for the registry and the bootstrap admin, NATS's auth include
    (public keys only) and the Kubernetes routes' credentials."""
    keys = BusKeys.load_or_create(layout.bus_keys)
    for spec in identities():
        if spec.kind == "registry":  # the bus's authority: the seeds it reads, not the admin's
            for name in REGISTRY_KEYS:
                seed = (layout.bus_keys / f"{name}.nk").read_text()
                _write_private(layout.identity(spec.id) / f"{name}.nk", seed)
    _write_private(layout.bus_admin / "admin.nk", keys.admin.seed + "\n")
    _write_private(layout.nats / "auth.conf", auth_conf(keys), 0o644)
    password = _keep_or_write(layout.nats / "routes.secret", secrets.token_hex(24)).strip()
    _write_private(layout.nats / "cluster.conf", cluster_conf(password))


def _make_tls(layout: SecretsDir) -> None:
    """The deployment's CA, NATS's certificate and each identity's (all made again with a new CA)."""
    fresh = not (layout.tls / "ca.pem").exists()
    ca = CertificateAuthority.load_or_create(layout.tls, "agent-fleet deployment CA")
    layout.tls_ca.mkdir(mode=0o755, parents=True, exist_ok=True)
    _write_private(layout.tls_ca / "ca.pem", (layout.tls / "ca.pem").read_text(), 0o644)
    write_trust(layout.tls_ca / "ca.pem", layout.tls_ca / "trust.pem")
    wanted = [(nats_cert_names(), layout.nats / NATS_CERT, layout.nats / NATS_KEY)]
    wanted += [
        (service_cert_names(spec.id), layout.tls_cert(spec.id), layout.tls_key(spec.id))
        for spec in identities()
    ]
    for names, cert, key in wanted:
        if fresh or not (cert.exists() and key.exists()):
            ca.issue(names, cert, key)


def _enrolling(service_id: str, operator_key: Path) -> ServiceSpec:
    """The local stack's entry of ``service_id``, which the operator key may enroll."""
    if not operator_key.is_file():
        raise SystemExit(f"keygen: no operator key at {operator_key} (python -m deploy.keygen secrets DIR)")
    spec = next((spec for spec in identities() if spec.id == service_id), None)
    if spec is None:
        try:
            spec = service(service_id)  # a worker beyond the roster's (workers are numbered)
        except KeyError:
            raise SystemExit(f"keygen: unknown service {service_id!r}") from None
    if spec.kind == "registry":
        raise SystemExit("keygen: the registry does not enroll (it holds the operator's public key)")
    return spec


def mint(service_id: str, operator_key: Path) -> str:
    """A one-time enrollment token for ``service_id``, with the kind, scopes, tenants and skills of its
    entry in the local stack definition (what ``fleet up`` gives it)."""
    spec = _enrolling(service_id, operator_key)
    return enrollment_token(SigningKey.load_or_create(operator_key), spec)


def write_token(service_id: str, operator_key: Path, out: Path) -> None:
    _write_private(out, mint(service_id, operator_key) + "\n")


class _Refused(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text}")
        self.status = status


def _enroll_once(
    http: httpx.Client, registry_url: str, service_id: str, jwk: object, operator_key: Path
) -> str:
    """Enroll ``jwk`` as ``service_id``'s key with a fresh one-time token; the key ids enrolled."""
    body = {"id": service_id, "public_jwk": jwk, "enrollment_token": mint(service_id, operator_key)}
    response = http.post(registry_url.rstrip("/") + "/v1/enroll", json=body)
    if response.status_code != 201:
        raise _Refused(response.status_code, response.text[:300])
    return ", ".join(str(kid) for kid in response.json()["kids"])


def _enroll_patiently(
    http: httpx.Client, registry_url: str, service_id: str, jwk: object, operator_key: Path, deadline: float
) -> str:
    """:func:`_enroll_once`, asked again while the registry is not up or its store fails over (a
    new token each time: a refused one may or may not have been used)."""
    while True:
        try:
            return _enroll_once(http, registry_url, service_id, jwk, operator_key)
        except (httpx.TransportError, _Refused) as exc:
            if isinstance(exc, _Refused) and exc.status < 500:
                raise SystemExit(f"keygen: the registry refused to enroll {service_id}: {exc}") from exc
            if time.monotonic() >= deadline:
                raise SystemExit(f"keygen: the registry at {registry_url} did not answer: {exc}") from exc
            time.sleep(2.0)  # a command line waiting for the registry to come up


def enroll(registry_url: str, operator_key: Path, public_keys: Path, wait_s: float = 300.0) -> list[str]:
    """Enroll every identity whose public key is in ``public_keys`` (``<id>.jwk.json``), with the
    kind, scopes, tenants and skills of its entry in the local stack; the ids enrolled. Idempotent: an
    identity enrolled again with the same key keeps it. The registry is waited for up to ``wait_s``."""
    files = sorted(public_keys.glob("*.jwk.json"))
    if not files:
        raise SystemExit(f"keygen: no public keys (<id>.jwk.json) in {public_keys}")
    jwks = {path.name.removesuffix(".jwk.json"): json.loads(path.read_text()) for path in files}
    for service_id in jwks:
        _enrolling(service_id, operator_key)  # an unknown id or a missing operator key: before any call
    deadline = time.monotonic() + wait_s
    with httpx.Client(timeout=10.0) as http:
        for service_id, jwk in jwks.items():
            kids = _enroll_patiently(http, registry_url, service_id, jwk, operator_key, deadline)
            print(f"keygen: enrolled {service_id} ({kids})", flush=True)
    return list(jwks)


def certify(operator_key: Path, jwk_file: Path, issuer: str = DEFAULT_ISSUER) -> str:
    """The operator's certificate for a new signing key of the registry (the second step of
    ``POST /v1/issuer/rotate``: post it to ``/v1/issuer/certificate``)."""
    if not operator_key.is_file():
        raise SystemExit(f"keygen: no operator key at {operator_key}")
    jwk = json.loads(jwk_file.read_text())
    return certify_issuer_key(SigningKey.load_or_create(operator_key), issuer, jwk.get("public_jwk", jwk))


# NATS not up yet (FleetError, retryable), a cluster still electing its JetStream leader (TRANSIENT).
_PROVISION_RETRIES: tuple[type[Exception], ...] = (FleetError, *TRANSIENT)


async def _provision_once(
    url: str, keys_dir: Path, tls_ca: Path | None, replicas: int, patience_s: float
) -> list[str]:
    client = await connect(
        url,
        "fleet-bootstrap",
        replicas=replicas,
        credentials=admin_credentials(keys_dir, tls_ca),
        patience_s=patience_s,
    )
    try:
        return await provision(client)
    finally:
        await client.close()


async def provision_bus(
    url: str, keys_dir: Path, tls_ca: Path | None = None, replicas: int = 1, wait_s: float = 300.0
) -> list[str]:
    """As the bootstrap admin (``keys_dir/admin.nk``), create every stream, bucket and object store
    that the bus at ``url`` lacks; the names of those created. NATS is waited for up to ``wait_s``
    (a refusal of the admin's key fails at once: it is no bus of this deployment)."""
    if not (keys_dir / "admin.nk").is_file():
        raise SystemExit(
            f"keygen: no admin seed at {keys_dir / 'admin.nk'} (python -m deploy.keygen secrets DIR)"
        )
    deadline = time.monotonic() + wait_s
    while True:
        try:
            patience = max(1.0, min(30.0, deadline - time.monotonic()))
            return await _provision_once(url, keys_dir, tls_ca, replicas, patience)
        except _PROVISION_RETRIES as exc:
            if isinstance(exc, FleetError) and not exc.retryable:
                raise SystemExit(f"keygen: the bus at {url}: {exc}") from exc
            if time.monotonic() >= deadline:
                raise SystemExit(f"keygen: the bus at {url} did not answer: {exc}") from exc
        await asyncio.sleep(2.0)  # a command line waiting for NATS to come up


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m deploy.keygen`` (the deploy tests parse manifests with it)."""
    top = argparse.ArgumentParser(prog="python -m deploy.keygen", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    made = sub.add_parser("secrets", help="create the keys and passwords that are missing in DIR")
    made.add_argument("dir", type=Path)
    token = sub.add_parser("token", help="write a one-time enrollment token for a service")
    token.add_argument("service_id")
    token.add_argument("--operator-key", type=Path, required=True)
    token.add_argument("--out", type=Path, required=True)
    certifies = sub.add_parser("certify", help="print the operator's certificate for a new registry key")
    certifies.add_argument("--operator-key", type=Path, required=True)
    certifies.add_argument(
        "--jwk", type=Path, required=True, help="the key's public JWK (or the rotate answer)"
    )
    certifies.add_argument("--issuer", default=DEFAULT_ISSUER)
    enrolls = sub.add_parser("enroll", help="enroll every identity whose public key is in a folder")
    enrolls.add_argument("--registry", required=True, help="the registry's base URL")
    enrolls.add_argument("--operator-key", type=Path, required=True)
    enrolls.add_argument("--public-keys", type=Path, required=True, help="a folder of <id>.jwk.json")
    enrolls.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the registry")
    provisions = sub.add_parser(
        "provision", help="create the bus's streams and buckets as the bootstrap admin"
    )
    provisions.add_argument("--nats", required=True, help="NATS's URL (a cluster's, comma-separated)")
    provisions.add_argument("--keys", type=Path, required=True, help="a folder holding admin.nk")
    provisions.add_argument("--tls-ca", type=Path, help="the CA of NATS's certificate")
    provisions.add_argument("--replicas", type=int, default=1, help="of every stream and bucket created")
    provisions.add_argument("--wait", type=float, default=300.0, help="seconds to wait for NATS")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "secrets":
        layout = make_secrets(args.dir)
        print(f"keygen: secrets in {layout.root}")
    elif args.command == "enroll":
        enrolled = enroll(args.registry, args.operator_key, args.public_keys, args.wait)
        print(f"keygen: {len(enrolled)} identities enrolled at {args.registry}")
    elif args.command == "provision":
        made = asyncio.run(provision_bus(args.nats, args.keys, args.tls_ca, args.replicas, args.wait))
        print(f"keygen: the bus at {args.nats} is provisioned ({len(made)} created)", flush=True)
    elif args.command == "certify":
        print(certify(args.operator_key, args.jwk, args.issuer))
    else:
        write_token(args.service_id, args.operator_key, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
