"""Identities and passwords of a deployed fleet (compose or Kubernetes), and its enrollment tokens.

``fleet up`` makes each service's key and mints its one-time enrollment token itself. A deployment
has no supervisor, so this module does the same from the outside::

    python -m deploy.keygen secrets DIR       # keys and passwords, once (kept if present)
    python -m deploy.keygen token ID --operator-key FILE --out FILE [--every S]
    python -m deploy.keygen compose-init DIR  # the compose one-shot: secrets, then every token

``DIR`` holds ``operator/`` (the operator's key: the registry's root of trust, and its public JWK),
``identities/<id>/key.pem`` (one per deployed identity), ``postgres/`` (the superuser's and each
database role's password) and ``postgres/dsn-<database>`` (what ``FLEET_PG_DSN`` is in Kubernetes).
Nothing here is ever committed: ``deploy/k8s/secrets/`` is ignored by git.

An enrollment token lives ten minutes and is used once (``registry/_enrollment.py``), and every
service enrolls again at every start, so a token has to be minted right before each start: in
Kubernetes by a sidecar of each pod (``token --every``), in compose by the ``keygen`` one-shot.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.local_stack import DATABASES, OPERATOR_ID, SERVICES, ServiceSpec, service
from fleet.keys import SigningKey
from fleet.supervisor import enrollment_token

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

    def pg_password(self, role: str) -> Path:
        return self.root / "postgres" / f"{role}-password"

    def pg_dsn(self, database: str) -> Path:
        return self.root / "postgres" / f"dsn-{database}"


def identities() -> tuple[ServiceSpec, ...]:
    """Every identity a deployment runs: each service of the local stack (compose runs them as
    they are; Kubernetes runs the workers as one Deployment of ``worker-1``)."""
    return SERVICES


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
    """Create what is missing under ``root``: the operator key and JWK, one key per identity, the
    Postgres passwords and DSNs, the registry's copy of the operator JWK. Existing files are kept."""
    layout = SecretsDir(root)
    operator = SigningKey.load_or_create(layout.operator_key)
    jwk = json.dumps(operator.public_jwk())
    _keep_or_write(layout.operator_jwk, jwk, 0o644)
    for spec in identities():
        SigningKey.load_or_create(layout.key(spec.id))
    _keep_or_write(layout.identity("registry") / "operator.jwk.json", layout.operator_jwk.read_text(), 0o644)
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
    return layout


def mint(service_id: str, operator_key: Path) -> str:
    """A one-time enrollment token for ``service_id``, with the kind, scopes and tenants of its
    entry in the local stack definition (what ``fleet up`` gives it)."""
    if not operator_key.is_file():
        raise SystemExit(f"keygen: no operator key at {operator_key} (python -m deploy.keygen secrets DIR)")
    try:
        spec = service(service_id)
    except KeyError:
        raise SystemExit(f"keygen: unknown service {service_id!r}") from None
    if spec.kind == "registry":
        raise SystemExit("keygen: the registry does not enroll (it holds the operator's public key)")
    return enrollment_token(SigningKey.load_or_create(operator_key), spec)


def write_token(service_id: str, operator_key: Path, out: Path) -> None:
    _write_private(out, mint(service_id, operator_key) + "\n")


def compose_init(root: Path) -> None:
    """The compose one-shot: secrets (once), then a fresh token for every identity."""
    layout = make_secrets(root)
    for spec in identities():
        if spec.kind != "registry":
            write_token(spec.id, layout.operator_key, layout.identity(spec.id) / "enrollment-token")


def _token_loop(service_id: str, operator_key: Path, out: Path, every_s: float) -> None:
    """Keep a fresh token at ``out`` (a pod's sidecar: the service reads it at each start)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        write_token(service_id, operator_key, out)
        time.sleep(every_s)


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
    token.add_argument("--every", type=float, default=0.0, help="write a fresh one every S seconds")
    init = sub.add_parser("compose-init", help="secrets, then a token for every service (compose)")
    init.add_argument("dir", type=Path)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "secrets":
        layout = make_secrets(args.dir)
        print(f"keygen: secrets in {layout.root}")
    elif args.command == "compose-init":
        compose_init(args.dir)
        print(f"keygen: secrets and enrollment tokens in {args.dir}")
    elif args.every > 0:
        _token_loop(args.service_id, args.operator_key, args.out, args.every)
    else:
        write_token(args.service_id, args.operator_key, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
