"""The envelope of per-tenant keys (``fleet.tenant_keys``): what one tenant's key seals opens only with
that key, for that purpose and that name, and every change to it is refused."""

from __future__ import annotations

import hashlib
import hmac
import json
import stat
from pathlib import Path

import pytest

from fleet.errors import ErrorCode, FleetError
from fleet.tenant_keys import MAGIC, MasterSecret, TenantKey

MASTER = MasterSecret("m-test", bytes(range(32)))


def hkdf_by_hand(secret: bytes, info: bytes) -> bytes:
    """RFC 5869 HKDF-SHA256 with no salt, one block: written out here, not taken from the library."""
    prk = hmac.new(b"\x00" * 32, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def refused(action: object) -> FleetError:
    assert callable(action)
    with pytest.raises(FleetError) as caught:
        action()
    assert caught.value.code == ErrorCode.INTEGRITY_FAILED
    return caught.value


def test_a_tenant_key_is_hkdf_of_the_master_with_the_tenant_in_its_info() -> None:
    key = MASTER.tenant_key("acme")
    assert key.secret == hkdf_by_hand(MASTER.secret, b"fleet artifacts v1 acme")
    assert key.version == "m-test"
    assert MASTER.tenant_key("globex").secret != key.secret


def test_what_is_sealed_opens_with_the_same_key_purpose_and_name() -> None:
    key = MASTER.tenant_key("acme")
    sealed = key.seal("artifact", "acme/abc", b"the report")
    assert key.open("artifact", "acme/abc", sealed) == b"the report"
    assert sealed.startswith(MAGIC) and b"the report" not in sealed
    assert key.seal("artifact", "acme/abc", b"the report") != sealed  # a new nonce each time


def test_a_changed_byte_anywhere_is_refused() -> None:
    key = MASTER.tenant_key("acme")
    sealed = key.seal("artifact", "acme/abc", b"the report")
    for at in (len(MAGIC) + 3, len(sealed) // 2, len(sealed) - 1):
        tampered = bytearray(sealed)
        tampered[at] ^= 0x01
        refused(lambda changed=bytes(tampered): key.open("artifact", "acme/abc", changed))


def test_another_tenant_s_key_opens_nothing() -> None:
    sealed = MASTER.tenant_key("acme").seal("artifact", "acme/abc", b"the report")
    refused(lambda: MASTER.tenant_key("globex").open("artifact", "acme/abc", sealed))


def test_the_same_key_bytes_under_another_tenant_name_are_refused_by_the_bound_tenant() -> None:
    acme = MASTER.tenant_key("acme")
    sealed = acme.seal("artifact", "x", b"the report")
    refused(lambda: TenantKey("globex", acme.version, acme.secret).open("artifact", "x", sealed))


def test_sealed_bytes_moved_to_another_name_or_purpose_are_refused() -> None:
    key = MASTER.tenant_key("acme")
    sealed = key.seal("workspace-head", "run-1", b'{"sha256": "a"}')
    refused(lambda: key.open("workspace-head", "run-2", sealed))
    refused(lambda: key.open("artifact", "run-1", sealed))


def test_another_key_version_and_plaintext_are_refused() -> None:
    key = MASTER.tenant_key("acme")
    sealed = key.seal("artifact", "n", b"data")
    other = MasterSecret("m-other", MASTER.secret).tenant_key("acme")
    assert "m-test" in refused(lambda: other.open("artifact", "n", sealed)).message
    refused(lambda: key.open("artifact", "n", b"plain old bytes of an old artifact"))
    refused(lambda: key.open("artifact", "n", b""))


def test_a_name_is_keyed_reveals_no_hash_and_differs_between_tenants() -> None:
    digest = hashlib.sha256(b"the report").hexdigest()
    acme, globex = MASTER.tenant_key("acme"), MASTER.tenant_key("globex")
    assert acme.name("artifact", digest) == acme.name("artifact", digest)
    assert acme.name("artifact", digest) not in (digest, globex.name("artifact", digest))
    assert acme.name("artifact", digest) != acme.name("workspace-head", digest)


def test_no_key_is_for_every_tenant_and_its_repr_shows_no_key() -> None:
    with pytest.raises(FleetError) as caught:
        MASTER.tenant_key("*")
    assert caught.value.code == ErrorCode.INVALID_REQUEST
    key = MASTER.tenant_key("acme")
    assert key.secret.hex() not in repr(key) and str(key.secret) not in repr(key)
    assert "secret" not in repr(MASTER)


def test_a_key_goes_through_json_and_back() -> None:
    key = MASTER.tenant_key("acme")
    assert TenantKey.from_json(json.loads(json.dumps(key.to_json()))) == key
    with pytest.raises(FleetError) as caught:
        TenantKey.from_json({"tenant": "acme", "version": "m", "key": "c2hvcnQ"})
    assert caught.value.code == ErrorCode.INVALID_REQUEST


def test_the_master_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / "tenant-key-master.json"
    made = MasterSecret.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert MasterSecret.load_or_create(path) == made
    path.write_text('{"version": "m1", "secret": "short"}')
    with pytest.raises(FleetError):
        MasterSecret.load_or_create(path)
