"""An outside check of every specialist's A2A card: a2a-proof, and what a2a-proof does not check.

a2a-proof 0.16.0's card check (a contract's ``card:``) compares the card, as a2a-sdk parses it, with the
contract and nothing else: skill ids it must contain, default input and output modes it must contain,
and the ``streaming`` / ``push_notifications`` / ``extended_agent_card`` capabilities. Before that, it
refuses a card it cannot parse or whose interfaces are on another origin than the URL it was given.
It does not validate the card against the A2A 1.0 definition (the SDK's parser ignores unknown fields
and enforces no required field), does not look at security schemes, and does not verify the card's JWS
signature. So besides running a2a-proof, this module checks each card as served:

- it parses strictly (no unknown field) as A2A 1.0's ``AgentCard`` and has every field the spec marks
  REQUIRED. The definition is the spec's normative protobuf (``lf.a2a.v1``, its ``field_behavior``
  annotations) as a2a-sdk ships it: no installed package ships an A2A JSON Schema;
- it lists skills, a JSON-RPC interface of protocol 1.0, and the fleet's security: an HTTP bearer
  scheme and an OAuth 2 client-credentials flow at the registry's token endpoint for ``agent:invoke``;
- its signature verifies with the specialist's own key, as the registry publishes it (the card's ``jku``).

a2a-proof needs at least one scenario, and cannot expect an error response (a JSON-RPC error ends
the trial as an error). The contract's one scenario sends a text-only message, which a kit specialist
must refuse with InvalidParams: a2a-proof reports that scenario as failed, and the test asserts that
its error is exactly that refusal (so the token was accepted, and nothing crashed or hung). The
statistician gets a second contract, with a skill it computes, which a2a-proof passes outright.

The specialists are whatever the running stack lists in ``endpoints.json``. By hand, against a
running stack (``outliers`` for the statistician's contract; without it, a2a-proof passes the card
and reports the refusal scenario as failed with ``InvalidParamsError``, which is the expected answer):

    python -m tests.e2e.test_specialist_cards [outliers] > /tmp/specialist.a2a-proof.yaml
    A2A_PROOF_AGENT_URL=$(python -c "import json; print(json.load(open('.fleet/endpoints.json'))['specialists']['stats'])") \\
    A2A_PROOF_TOKEN=$(fleet token --audience stats --tenant acme --scope agent:invoke) \\
    a2a-proof run /tmp/specialist.a2a-proof.yaml
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import jwt
import pytest
from a2a.types import AgentCard
from a2a.utils.signing import SignatureVerificationError, create_signature_verifier
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from google.protobuf.message import Message

from fleet.keys import ALGORITHM
from fleetctl.testing.e2e import Stack, clean_env

pytestmark = pytest.mark.e2e

INVOKE_SCOPE = "agent:invoke"
CARD_PATH = "/.well-known/agent-card.json"
PROOF_TIMEOUT_S = 120
HTTP_TIMEOUT = httpx.Timeout(10.0)
# A2A 1.0 marks its required fields with google.api.field_behavior (an option a2a-sdk's protos load).
FIELD_BEHAVIOR = "google.api.field_behavior"
REQUIRED = (
    descriptor_pool.Default().FindEnumTypeByName("google.api.FieldBehavior").values_by_name["REQUIRED"].number
)

REFUSAL: dict[str, Any] = {
    "name": "a message without a skill is refused with InvalidParams (a2a-proof reports an error)",
    "message": "Hello, what can you do?",
}
OUTLIERS: dict[str, Any] = {
    "name": "outliers are computed",
    "data": [
        {
            "skill": "outliers",
            "input": {"records": [{"v": 1}, {"v": 2}, {"v": 3}, {"v": 100}], "field": "v", "label": "v"},
        }
    ],
    "expect": {
        "state": "completed",
        "states": {"contains_in_order": ["working", "completed"]},
        "data": [
            {"path": "/outliers/0/value", "source": "artifact", "artifact_name": "outliers", "equals": 100},
            {"path": "/outliers/1", "source": "artifact", "artifact_name": "outliers", "exists": False},
        ],
    },
}


def contract(*scenarios: dict[str, Any]) -> dict[str, Any]:
    """An a2a-proof contract for any specialist (URL and token from the environment)."""
    return {
        "version": 1,
        "agent": {
            "url": "${A2A_PROOF_AGENT_URL}",
            "transport": "JSONRPC",
            "timeout": 30,
            # the gRPC binding is on a port of its own on the same host: another origin to a2a-proof
            "allow_cross_origin_interfaces": True,
            "headers": {"Authorization": "Bearer ${A2A_PROOF_TOKEN}"},
        },
        "card": {
            "capabilities": {"streaming": True},
            "input_modes": {"contains": ["application/json"]},
            "output_modes": {"contains": ["application/json"]},
        },
        "invariants": {"text": {"not_contains_env": "A2A_PROOF_TOKEN"}},
        "scenarios": list(scenarios),
    }


def specialists(stack: Stack) -> dict[str, str]:
    found: dict[str, str] = stack.endpoints["specialists"]
    assert len(found) >= 3, f"the stack lists too few specialists: {found}"
    return found


def run_a2a_proof(
    stack: Stack, specialist: str, document: dict[str, Any], tmp_path: Path
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run a2a-proof as its own process against ``specialist``; its JSON report and the process."""
    path = tmp_path / f"{specialist}.a2a-proof.yaml"
    path.write_text(json.dumps(document, indent=2))  # JSON is YAML
    report = tmp_path / f"{specialist}.a2a-proof.json"
    env = clean_env(
        A2A_PROOF_AGENT_URL=stack.endpoints["specialists"][specialist],
        A2A_PROOF_TOKEN=stack.token(specialist, tenant="acme"),
    )
    proof = Path(sys.executable).with_name("a2a-proof")
    result = subprocess.run(
        [str(proof), "run", str(path), "--format", "json", "--output", str(report), "--verbose"],
        capture_output=True,
        text=True,
        timeout=PROOF_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert report.exists(), f"a2a-proof wrote no report for {specialist}: {result.stderr}"
    suite: dict[str, Any] = json.loads(report.read_text())
    return suite, result


def refusal_of(suite: dict[str, Any]) -> str:
    """The error a2a-proof saw for the refusal scenario (a description if there was none)."""
    [scenario] = suite["scenarios"]
    [trial] = scenario["trials"]
    return str(trial["error"] or f"not refused: {json.dumps(trial['turns'])}")


def test_every_specialist_passes_a2a_proofs_card_check_and_refuses_a_message_without_a_skill(
    stack: Stack, tmp_path: Path
) -> None:
    failures: dict[str, Any] = {}
    for specialist in specialists(stack):
        suite, _ = run_a2a_proof(stack, specialist, contract(REFUSAL), tmp_path)
        if suite["card"] is None or not suite["card"]["passed"]:
            failures[specialist] = {"card": suite["card"]}  # a2a-proof then runs no scenario
            continue
        refusal = refusal_of(suite)
        if not refusal.startswith("InvalidParamsError: "):
            failures[specialist] = {"refusal": refusal}
    assert not failures, json.dumps(failures, indent=1)


async def served_card(http: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    response = await http.get(base_url + CARD_PATH)
    response.raise_for_status()
    card: dict[str, Any] = response.json()
    return card


def missing_required(message: Message, path: str = "") -> list[str]:
    """The fields ``message`` lacks that its A2A 1.0 definition marks REQUIRED, nested ones too."""
    missing: list[str] = []
    for spec in cast(Descriptor, message.DESCRIPTOR).fields:
        where = f"{path}.{spec.json_name}" if path else spec.json_name
        if _required(spec) and not _is_set(message, spec):
            missing.append(where)
        for at, child in _children(message, spec, where):
            missing.extend(missing_required(child, at))
    return missing


def _required(spec: FieldDescriptor) -> bool:
    options = spec.GetOptions().ListFields()
    return any(option.full_name == FIELD_BEHAVIOR and REQUIRED in value for option, value in options)


def _is_set(message: Message, spec: FieldDescriptor) -> bool:
    value = getattr(message, spec.name)
    if spec.is_repeated:
        return len(value) > 0
    if spec.message_type is not None:
        return message.HasField(spec.name)
    return bool(value != spec.default_value)  # proto3 JSON: a default value is an absent one


def _children(message: Message, spec: FieldDescriptor, where: str) -> list[tuple[str, Message]]:
    """The A2A messages one field holds (skipping protobuf's own types, such as Struct)."""
    kind, value = spec.message_type, getattr(message, spec.name)
    if kind is None or kind.full_name.startswith("google.protobuf."):
        return []
    if kind.GetOptions().map_entry:
        held = kind.fields_by_name["value"].message_type
        if held is None or held.full_name.startswith("google.protobuf."):
            return []
        return [(f"{where}[{key!r}]", item) for key, item in value.items()]
    if spec.is_repeated:
        return [(f"{where}[{index}]", item) for index, item in enumerate(value)]
    return [(where, value)] if message.HasField(spec.name) else []


def spec_problems(raw: dict[str, Any]) -> list[str]:
    """How the served card falls short of A2A 1.0's AgentCard (nothing: it is one)."""
    try:
        card = ParseDict(raw, AgentCard())  # strict: an unknown or mistyped field is an error
    except ParseError as exc:
        return [f"not an A2A 1.0 AgentCard: {exc}"]
    return [f"missing required field {where}" for where in missing_required(card)]


def fleet_problems(card: AgentCard, base_url: str, registry_url: str) -> list[str]:
    """What a caller of a fleet specialist needs from its card and does not find there."""
    problems: list[str] = []
    if not card.skills:
        problems.append("lists no skills")
    rpc = [i for i in card.supported_interfaces if i.protocol_binding == "JSONRPC"]
    if not any(i.protocol_version == "1.0" and i.url.startswith(base_url + "/") for i in rpc):
        problems.append(f"no JSON-RPC interface of protocol 1.0 under {base_url}: {_dicts(rpc)}")
    return problems + security_problems(card, registry_url)


def security_problems(card: AgentCard, registry_url: str) -> list[str]:
    problems: list[str] = []
    schemes = card.security_schemes
    kinds = {name: scheme.WhichOneof("scheme") for name, scheme in schemes.items()}
    bearer = [
        name
        for name, scheme in schemes.items()
        if kinds[name] == "http_auth_security_scheme"
        and scheme.http_auth_security_scheme.scheme.lower() == "bearer"
    ]
    required = {name for requirement in card.security_requirements for name in requirement.schemes}
    if not card.security_requirements:
        problems.append("requires no security (securityRequirements is empty)")
    if required - set(schemes):
        problems.append(f"requires undeclared security schemes {sorted(required - set(schemes))}")
    if not set(bearer) & required:
        problems.append(f"requires no HTTP bearer scheme (declared: {kinds})")
    flows = [
        scheme.oauth2_security_scheme.flows.client_credentials
        for name, scheme in schemes.items()
        if kinds[name] == "oauth2_security_scheme" and name in required
    ]
    if not any(f.token_url.startswith(registry_url + "/") and INVOKE_SCOPE in f.scopes for f in flows):
        problems.append(f"no client-credentials flow at {registry_url} for {INVOKE_SCOPE}: {_dicts(flows)}")
    return problems


def _dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [MessageToDict(message) for message in messages]


async def test_every_specialists_card_is_an_a2a_1_0_card_with_skills_and_the_fleets_security(
    stack: Stack,
) -> None:
    failures: dict[str, list[str]] = {}
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
        for specialist, base_url in specialists(stack).items():
            raw = await served_card(http, base_url)
            problems = spec_problems(raw)
            card = ParseDict(raw, AgentCard(), ignore_unknown_fields=True)
            problems += fleet_problems(card, base_url, stack.endpoints["registry"])
            if problems:
                failures[specialist] = problems
    assert not failures, json.dumps(failures, indent=1)


async def signature_problem(http: httpx.AsyncClient, card: AgentCard, keys_url: str) -> str | None:
    """Why ``card``'s signature does not verify with a key published at ``keys_url`` (None: it does)."""
    response = await http.get(keys_url)
    response.raise_for_status()
    keys = {key["kid"]: key for key in response.json()["keys"]}
    refused: list[str] = []

    def key_provider(kid: str | None, jku: str | None) -> jwt.PyJWK:
        if jku != keys_url or kid not in keys:
            refused.append(f"key {kid!r} at {jku!r}")
            raise jwt.InvalidKeyError("not a key of this specialist")
        return jwt.PyJWK(keys[kid], algorithm=ALGORITHM)

    try:
        create_signature_verifier(key_provider, [ALGORITHM])(card)
    except SignatureVerificationError as exc:
        return f"{exc} (refused: {refused or 'none'}; expected a key at {keys_url})"
    return None


async def test_every_specialists_card_signature_verifies_with_its_own_key_published_by_the_registry(
    stack: Stack,
) -> None:
    failures: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
        for specialist, base_url in specialists(stack).items():
            card = ParseDict(await served_card(http, base_url), AgentCard(), ignore_unknown_fields=True)
            keys_url = f"{stack.endpoints['registry']}/v1/agents/{specialist}/jwks.json"
            problem = await signature_problem(http, card, keys_url)
            if problem is not None:
                failures[specialist] = problem
    assert not failures, json.dumps(failures, indent=1)


def test_the_statistician_passes_a2a_proof_computing_outliers(stack: Stack, tmp_path: Path) -> None:
    assert "stats" in specialists(stack)
    suite, result = run_a2a_proof(stack, "stats", contract(OUTLIERS), tmp_path)
    assert suite["card"]["passed"], suite["card"]
    assert suite["passed"], json.dumps(suite["scenarios"], indent=1)
    assert result.returncode == 0, result.stderr


if __name__ == "__main__":  # print a contract, to run a2a-proof by hand (see the module's docstring)
    print(json.dumps(contract(OUTLIERS if sys.argv[1:] == ["outliers"] else REFUSAL), indent=2))
