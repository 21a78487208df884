"""Where a local stack keeps its state inside its data dir."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.buskeys import admin_credentials
from fleet.natsconn import Credentials


@dataclass(frozen=True, slots=True)
class StackLayout:
    """The files and folders of one data dir (``.fleet/`` by default)."""

    home: Path

    @classmethod
    def at(cls, home: Path) -> StackLayout:
        return cls(home.expanduser().resolve())

    @property
    def keys_dir(self) -> Path:
        return self.home / "keys"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def nats_dir(self) -> Path:
        return self.home / "nats"

    @property
    def pg_dir(self) -> Path:
        return self.home / "postgres"

    @property
    def endpoints_file(self) -> Path:
        return self.home / "endpoints.json"

    @property
    def lock_file(self) -> Path:
        return self.run_dir / "supervisor.lock"

    @property
    def bus_keys_dir(self) -> Path:
        """The bus's nkeys (see :mod:`fleet.buskeys`)."""
        return self.keys_dir / "nats"

    @property
    def tls_dir(self) -> Path:
        """The local CA and the services' certificate (``fleet up --tls``, :mod:`fleet.tlsca`)."""
        return self.keys_dir / "tls"

    @property
    def nats_config_file(self) -> Path:
        return self.nats_dir / "auth.conf"

    @property
    def operator_jwk_file(self) -> Path:
        return self.keys_dir / "operator.jwk.json"

    @property
    def issuer_cert_file(self) -> Path:
        """The operator's certificate for the registry's signing key (``fleet.issuer_certs``)."""
        return self.keys_dir / "registry.issuer-cert.jwt"

    def prepare(self) -> None:
        for folder in (self.home, self.logs_dir, self.run_dir, self.nats_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def key_file(self, identity: str) -> Path:
        return self.keys_dir / f"{identity}.pem"

    def log_file(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def service_env_file(self, service_id: str) -> Path:
        """The settings a service of the running stack was started with (``FLEET_*``, mode 0600;
        neither its enrollment token nor its listening socket), to start another like it."""
        return self.run_dir / "services" / f"{service_id}.env.json"

    def write_service_env(self, service_id: str, env: Mapping[str, str]) -> None:
        path = self.service_env_file(service_id)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(dict(env), fh, indent=2)
        path.with_suffix(".tmp").replace(path)

    def read_service_env(self, service_id: str) -> dict[str, str]:
        env: dict[str, str] = json.loads(self.service_env_file(service_id).read_text())
        return env

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.log_file(name).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def secret(self, name: str) -> str:
        """A random secret kept in the data dir (created on first use, mode 0600)."""
        path = self.keys_dir / f"{name}.secret"
        if path.exists():
            return path.read_text().strip()
        value = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(value)
        return value

    def read_endpoints(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.endpoints_file.read_text())
        except (OSError, ValueError):
            return None
        return data

    def write_endpoints(self, endpoints: dict[str, Any]) -> None:
        tmp = self.endpoints_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(endpoints, indent=2) + "\n")
        tmp.replace(self.endpoints_file)

    def clear_endpoints(self) -> None:
        """Keep last run's ports as a hint for the next start, but mark the stack as stopped."""
        data = self.read_endpoints()
        if data is None:
            return
        data["stopped"] = True
        self.write_endpoints(data)


def stack_admin(endpoints: Mapping[str, Any]) -> Credentials:
    """:func:`admin_credentials` of a local stack, from its ``endpoints.json``."""
    layout = StackLayout.at(Path(str(endpoints["data_dir"])))
    ca = endpoints.get("tls_ca")
    return admin_credentials(layout.bus_keys_dir, Path(ca) if isinstance(ca, str) else None)
