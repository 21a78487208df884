"""Secrets never reach an event log: keys that name secrets and strings that carry them."""

from __future__ import annotations

from fleet.redact import MARK, redact

JWT = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXZhbHVl"


def test_values_under_secret_keys_are_replaced_whole() -> None:
    payload = {
        "password": "hunter2",
        "access_token": "abc",
        "DB-Secret": "x",
        "nested": [{"api_key": "k", "keep": 1}],
        "max_tokens": 256,
        "idempotency_key": "op-1/Fabrikam",
    }
    out, count = redact(payload)
    assert out == {
        "password": MARK,
        "access_token": MARK,
        "DB-Secret": MARK,
        "nested": [{"api_key": MARK, "keep": 1}],
        "max_tokens": 256,
        "idempotency_key": "op-1/Fabrikam",
    }
    assert count == 4


def test_tokens_and_keys_inside_text_are_cut_out() -> None:
    pem = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE\n-----END EC PRIVATE KEY-----"
    text = f"called with Authorization: Bearer {JWT}; jwt {JWT}; key {pem}; done"
    out, count = redact({"text": text})
    assert JWT not in out["text"] and "MHcCAQEE" not in out["text"]
    assert out["text"].endswith("; done") and count == 3


def test_payloads_without_secrets_are_unchanged() -> None:
    payload = {"step": "totals", "records": [{"customer": "Contoso", "total": 1.5}], "text": "4 customers"}
    assert redact(payload) == (payload, 0)
