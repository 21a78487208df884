"""The bus's nkeys and NATS JWTs (``fleet.natsjwt``) against the ``nkeys`` package nats-py signs
with: the same keys, the same signatures; and a JWT that is tampered with, expired or signed by
another key is refused."""

from __future__ import annotations

import time

import nkeys
import pytest

from fleet import natsjwt
from fleet.natsjwt import PREFIX_ACCOUNT, PREFIX_USER, KeyPair, NkeyError


def test_a_seed_made_here_is_the_same_key_to_nkeys_and_back() -> None:
    ours = KeyPair.generate(PREFIX_USER)
    theirs = nkeys.from_seed(ours.seed.encode())
    assert theirs.public_key.decode() == ours.public_key and ours.public_key.startswith("U")
    assert KeyPair.from_seed(theirs.seed.decode()).public_key == ours.public_key
    assert natsjwt.verify(ours.public_key, b"nonce", theirs.sign(b"nonce"))
    assert not natsjwt.verify(ours.public_key, b"other", theirs.sign(b"nonce"))


def test_a_jwt_verifies_with_its_issuer_and_is_refused_tampered_expired_or_foreign() -> None:
    issuer, stranger = KeyPair.generate(PREFIX_ACCOUNT), KeyPair.generate(PREFIX_ACCOUNT)
    token = natsjwt.encode({"sub": "U-someone", "exp": int(time.time()) + 60}, issuer)
    assert natsjwt.decode(token, issuer=issuer.public_key)["sub"] == "U-someone"
    head, _, signature = token.split(".")
    forged = natsjwt.encode({"sub": "U-else", "exp": int(time.time()) + 60}, issuer).split(".")[1]
    with pytest.raises(NkeyError):
        natsjwt.decode(f"{head}.{forged}.{signature}")
    with pytest.raises(NkeyError):
        natsjwt.decode(natsjwt.encode({"sub": "x", "exp": int(time.time()) - 1}, issuer))
    with pytest.raises(NkeyError):
        natsjwt.decode(natsjwt.encode({"sub": "x"}, stranger), issuer=issuer.public_key)
    with pytest.raises(NkeyError):
        KeyPair.from_seed("SUAGARBAGE")
