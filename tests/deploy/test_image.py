"""The fleet image (deploy/Dockerfile, read: no Docker engine runs here) and the identities that
deploy.keygen makes for a deployment."""

from __future__ import annotations

import json
import re
import shlex
import stat
import tomllib
from pathlib import Path

import jwt
import pytest

from deploy import keygen
from deploy.local_stack import SERVICES, service
from fleet.issuer_certs import IssuerTrust
from fleet.keys import SigningKey, public_key_from_jwk
from fleet.settings import DEFAULT_ISSUER
from tests.deploy._files import DEPLOY, ROOT

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


STEPS = instructions(DOCKERFILE)


def _final_stage() -> list[tuple[str, str]]:
    starts = [i for i, (word, _) in enumerate(STEPS) if word == "FROM"]
    return STEPS[starts[-1] :]


def test_the_image_is_python_311_slim_and_installs_the_project_with_the_pinned_constraints() -> None:
    assert all(args.startswith("python:3.11-slim") for word, args in STEPS if word == "FROM")
    installs = [args for word, args in STEPS if word == "RUN" and "pip install" in args]
    assert len(installs) == 1
    argv = shlex.split(installs[0].split("&&")[0])
    assert argv[argv.index("--constraint") + 1] == "constraints.txt"
    assert argv[-1] == "."
    assert any(word == "COPY" and "constraints.txt" in args for word, args in STEPS)


def test_every_package_the_project_ships_is_copied_into_the_image() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [
        p.rstrip("*").removesuffix(".") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    copied = {args.split()[0].rstrip("/") for word, args in STEPS if word == "COPY" and "--from" not in args}
    assert set(packages) <= copied
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(packages) & {line.rstrip("/") for line in ignored}, "a shipped package is ignored"


def test_the_entrypoint_is_fleet_run_as_a_user_who_is_not_root_with_bubblewrap_installed() -> None:
    final = _final_stage()
    (entrypoint,) = [json.loads(args) for word, args in final if word == "ENTRYPOINT"]
    assert entrypoint == ["fleet"]
    (user,) = [args for word, args in final if word == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    apt = " ".join(args for word, args in final if word == "RUN" and "apt-get install" in args)
    assert re.search(r"\bbubblewrap\b", apt)
    assert "FROM" not in [word for word, _ in final[1:]]


def test_the_dockerfile_reader_sees_a_missing_entrypoint() -> None:
    broken = instructions(DOCKERFILE.replace('ENTRYPOINT ["fleet"]', 'ENTRYPOINT ["python"]'))
    assert [json.loads(a) for w, a in broken if w == "ENTRYPOINT"] == [["python"]]


def test_keygen_makes_every_identity_once_and_keeps_it(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path)
    kids = {spec.id: SigningKey.load_or_create(layout.key(spec.id)).kid for spec in SERVICES}
    assert len(set(kids.values())) == len(SERVICES), "one key per identity"
    again = keygen.make_secrets(tmp_path)
    assert {s.id: SigningKey.load_or_create(again.key(s.id)).kid for s in SERVICES} == kids
    assert stat.S_IMODE(layout.operator_key.stat().st_mode) == 0o600
    for spec in SERVICES:  # the registry verifies enrollments with it; every service, policy pushes
        assert json.loads((layout.identity(spec.id) / "operator.jwk.json").read_text()) == json.loads(
            layout.operator_jwk.read_text()
        )
    for spec in SERVICES:
        pgpass = layout.identity(spec.id) / "pgpass"
        assert pgpass.exists() == bool(spec.database), spec.id
        if spec.database:
            assert stat.S_IMODE(pgpass.stat().st_mode) == 0o600  # libpq ignores a more open one


def test_keygen_certifies_the_registry_key_with_the_operator_key_that_every_service_pins(
    tmp_path: Path,
) -> None:
    layout = keygen.make_secrets(tmp_path)
    operator_jwk = json.loads(layout.operator_jwk.read_text())
    for spec in SERVICES:
        assert json.loads((layout.identity(spec.id) / "operator.jwk.json").read_text()) == operator_jwk
    trust = IssuerTrust(operator_jwk, DEFAULT_ISSUER)
    registry = SigningKey.load_or_create(layout.key("registry"))
    cert = layout.issuer_cert("registry").read_text().strip()
    assert trust.certified(registry.public_jwk(), cert) is not None
    assert trust.certified(SigningKey.generate().public_jwk(), cert) is None  # that key only
    rotated = SigningKey.generate()
    (tmp_path / "new.jwk.json").write_text(json.dumps({"public_jwk": rotated.public_jwk()}))
    printed = keygen.certify(layout.operator_key, tmp_path / "new.jwk.json")
    assert trust.certified(rotated.public_jwk(), printed) is not None


def test_a_minted_token_is_what_the_registry_verifies(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path)
    out = tmp_path / "token"
    keygen.main(["token", "worker-1", "--operator-key", str(layout.operator_key), "--out", str(out)])
    operator = public_key_from_jwk(json.loads(layout.operator_jwk.read_text()))
    claims = jwt.decode(out.read_text().strip(), operator, algorithms=["ES256"], audience="fleet-enrollment")
    spec = service("worker-1")
    assert (claims["sub"], claims["kind"], claims["scopes"]) == (spec.id, spec.kind, list(spec.scopes))
    assert claims["exp"] - claims["iat"] == 600


def test_keygen_refuses_the_registry_an_unknown_service_and_a_missing_operator_key(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path)
    for service_id, key in (
        ("registry", layout.operator_key),
        ("nobody", layout.operator_key),
        ("stats", tmp_path / "x"),
    ):
        with pytest.raises(SystemExit):
            keygen.mint(service_id, key)


def test_keygen_writes_the_public_key_of_every_enrolling_identity_and_follows_a_new_key(
    tmp_path: Path,
) -> None:
    layout = keygen.make_secrets(tmp_path)
    for spec in SERVICES:
        public = layout.public_jwk(spec.id)
        assert public.exists() == (spec.kind != "registry"), spec.id
        if public.exists():
            key = SigningKey.load_or_create(layout.key(spec.id))
            assert json.loads(public.read_text()) == key.public_jwk()
            assert "d" not in json.loads(public.read_text()), "no private member"
    layout.key("stats").unlink()  # rotating: a new key, and its public JWK with it
    again = keygen.make_secrets(tmp_path)
    assert (
        json.loads(again.public_jwk("stats").read_text())["kid"]
        == SigningKey.load_or_create(again.key("stats")).kid
    )


def test_keygen_enroll_refuses_an_unknown_identity_before_calling_the_registry(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path)
    (layout.public / "nobody.jwk.json").write_text(layout.public_jwk("stats").read_text())
    with pytest.raises(SystemExit, match="unknown service 'nobody'"):
        keygen.enroll("http://127.0.0.1:9", layout.operator_key, layout.public, wait_s=0)
    with pytest.raises(SystemExit, match="no public keys"):
        keygen.enroll("http://127.0.0.1:9", layout.operator_key, tmp_path / "empty", wait_s=0)
