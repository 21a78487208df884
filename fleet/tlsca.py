"""A certificate authority of the local stack's own, for ``fleet up --tls``.

The CA and one server certificate (for ``127.0.0.1``, ``::1`` and ``localhost``, which every local
service and the NATS server present) are made in the data dir on first use, EC P-256, and kept:
the CA's certificate is what clients trust (``FLEET_TLS_CA_FILE``; ``SSL_CERT_FILE`` for HTTP
clients). A deployment made with ``python -m deploy.keygen secrets`` gets a CA of its own the same way
(:class:`CertificateAuthority`); a site may bring its own certificates instead (cert-manager, a
company CA).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
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
        ca = CertificateAuthority.create(folder, "agent-fleet local CA")
        ca.issue(["localhost", "127.0.0.1", "::1"], files.cert_file, files.key_file)
    write_trust(files.ca_file, files.trust_file)
    return files


def write_trust(ca_file: Path, trust_file: Path) -> None:
    """``trust_file``: the CA of ``ca_file`` followed by the public roots (certifi's)."""
    bundle = ca_file.read_bytes() + b"\n" + Path(certifi.where()).read_bytes()
    _write(trust_file, bundle, 0o644)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A CA's certificate and key (``ca.pem``, ``ca-key.pem`` in its folder), which issues server
    certificates: the local stack's (:func:`local_tls`), a deployment's (``deploy.keygen``)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def load_or_create(cls, folder: Path, common_name: str) -> CertificateAuthority:
        """The CA kept in ``folder``, made on first use."""
        cert_file, key_file = folder / "ca.pem", folder / "ca-key.pem"
        if not (cert_file.exists() and key_file.exists()):
            return cls.create(folder, common_name)
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_file} is not an EC private key")
        return cls(x509.load_pem_x509_certificate(cert_file.read_bytes()), key)

    @classmethod
    def create(cls, folder: Path, common_name: str) -> CertificateAuthority:
        """A new CA written to ``folder`` (its key mode 0600)."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        now = dt.datetime.now(dt.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .sign(key, hashes.SHA256())
        )
        _write(folder / "ca-key.pem", _pem_key(key), 0o600)
        _write(folder / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cls(cert, key)

    def issue(self, names: Sequence[str], cert_file: Path, key_file: Path) -> None:
        """A server certificate for ``names`` (DNS names, wildcards, IP addresses; the first is
        its common name) and its key (mode 0600), signed by this CA."""
        now = dt.datetime.now(dt.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
            .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        key_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write(key_file, _pem_key(key), 0o600)
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)
