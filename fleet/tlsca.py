"""A certificate authority of the local stack's own, for ``fleet up --tls``.

The CA and one server certificate (for ``127.0.0.1``, ``::1`` and ``localhost``, which every local
service and the NATS server present) are made in the data dir on first use, EC P-256, and kept:
the CA's certificate is what clients trust (``FLEET_TLS_CA_FILE``; ``SSL_CERT_FILE`` for HTTP
clients). A deployment brings its own certificates instead (cert-manager, a company CA).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import certifi
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 825


@dataclass(frozen=True, slots=True)
class LocalTls:
    """The files of a local stack's TLS: the CA's certificate, and the servers' certificate and key."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    @property
    def trust_file(self) -> Path:
        """The CA with the public roots (certifi's): what HTTP clients trust, so that the local
        services and the outside world (an LLM endpoint, a partner's agent) both verify."""
        return self.ca_file.with_name("trust.pem")


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def local_tls(folder: Path) -> LocalTls:
    """The stack's CA and server certificate in ``folder``, made if missing."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = LocalTls(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem")
    if not (files.ca_file.exists() and files.cert_file.exists() and files.key_file.exists()):
        _make(folder, files)
    bundle = files.ca_file.read_bytes() + b"\n" + Path(certifi.where()).read_bytes()
    _write(files.trust_file, bundle, 0o644)
    return files


def _make(folder: Path, files: LocalTls) -> None:
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agent-fleet local CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(folder / "ca-key.pem", _pem_key(ca_key), 0o600)
    _write(files.key_file, _pem_key(server_key), 0o600)
    _write(files.cert_file, server.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files.ca_file, ca.public_bytes(serialization.Encoding.PEM), 0o644)
