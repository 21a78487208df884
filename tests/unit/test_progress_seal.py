"""Progress notes leave an agent sealed and come back only if they open: with the agent's own key,
for the same tenant, run and skill, unchanged (numbers may come back as floats: A2A metadata is a
protobuf Struct)."""

from __future__ import annotations

import json
from typing import Any

from fleet.keys import SigningKey
from specialists.progress import opened, sealed

NOTES: dict[str, Any] = {"v": 1, "summary": "half done", "turn": 2, "calls": [{"key": "f:1", "done": True}]}


def test_notes_open_for_the_agent_that_sealed_them_even_after_a_struct_round_trip() -> None:
    key = SigningKey.generate()
    secret = key.derived_secret("progress-notes")
    assert secret == key.derived_secret("progress-notes") and secret != key.derived_secret("other")
    body = sealed(NOTES, secret, "acme\nr1\ntriage")
    as_struct = json.loads(json.dumps(body).replace('"turn": 2', '"turn": 2.0').replace('"v": 1', '"v": 1.0'))
    assert opened(as_struct, secret, "acme\nr1\ntriage") is not None
    assert opened(body, secret, "acme\nr1\ntriage") == NOTES


def test_notes_forged_changed_or_taken_to_another_task_or_agent_do_not_open() -> None:
    secret = SigningKey.generate().derived_secret("progress-notes")
    body = sealed(NOTES, secret, "acme\nr1\ntriage")
    assert opened({**NOTES, "mac": "0" * 64}, secret, "acme\nr1\ntriage") is None  # forged
    assert opened(NOTES, secret, "acme\nr1\ntriage") is None  # no seal at all
    assert opened({**body, "summary": "all done"}, secret, "acme\nr1\ntriage") is None  # changed
    assert opened(body, secret, "globex\nr1\ntriage") is None  # another tenant
    assert opened(body, secret, "acme\nr2\ntriage") is None  # another run
    other = SigningKey.generate().derived_secret("progress-notes")
    assert opened(body, other, "acme\nr1\ntriage") is None  # another agent
    assert opened("junk", secret, "acme\nr1\ntriage") is None
