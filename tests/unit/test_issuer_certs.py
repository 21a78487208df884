"""The registry's signing keys are trusted only with the operator's certificate for exactly that
key and issuer: a key added to the JWKS by anyone else is left out (and reported once)."""

from __future__ import annotations

import logging

import pytest

from fleet.issuer_certs import CERT_MEMBER, IssuerTrust, certify_issuer_key, with_cert
from fleet.keys import SigningKey

ISSUER = "fleet-registry"


def test_a_key_with_the_operators_certificate_is_trusted() -> None:
    operator, key = SigningKey.generate(), SigningKey.generate()
    trust = IssuerTrust(operator.public_jwk(), ISSUER)
    jwk = with_cert(key.public_jwk(), certify_issuer_key(operator, ISSUER, key.public_jwk()))
    assert trust.certified(jwk) is not None
    assert trust.parse(jwk).public_numbers() == key.private_key.public_key().public_numbers()


def test_a_key_without_a_certificate_or_with_anothers_is_refused_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    operator, key, other = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    trust = IssuerTrust(operator.public_jwk(), ISSUER)
    others_cert = certify_issuer_key(operator, ISSUER, other.public_jwk())
    with caplog.at_level(logging.WARNING, logger="fleet.issuer_certs"):
        assert trust.certified(key.public_jwk()) is None
        assert trust.certified(key.public_jwk()) is None
        assert trust.certified(with_cert(key.public_jwk(), others_cert)) is None  # a copied certificate
        # the certified key's coordinates under another kid: the kid must be the thumbprint
        assert trust.certified({**other.public_jwk(), "kid": key.kid, CERT_MEMBER: others_cert}) is None
    assert sum(key.kid in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError):
        trust.parse(key.public_jwk())


def test_a_certificate_by_another_key_for_another_issuer_or_purpose_is_refused() -> None:
    operator, impostor, key = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    trust = IssuerTrust(operator.public_jwk(), ISSUER)
    assert trust.certified(key.public_jwk(), certify_issuer_key(impostor, ISSUER, key.public_jwk())) is None
    assert trust.certified(key.public_jwk(), certify_issuer_key(operator, "other", key.public_jwk())) is None
    enrollment_like = operator.sign({"iss": "operator", "sub": ISSUER, "iat": 0, "jwk": key.public_jwk()})
    assert trust.certified(key.public_jwk(), enrollment_like) is None  # not typed as a certificate


def test_without_the_operators_key_no_key_is_trusted() -> None:
    operator, key = SigningKey.generate(), SigningKey.generate()
    cert = certify_issuer_key(operator, ISSUER, key.public_jwk())
    assert IssuerTrust(None, ISSUER).certified(with_cert(key.public_jwk(), cert)) is None
