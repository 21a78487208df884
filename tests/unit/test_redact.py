"""Secrets never reach an event log: keys that name secrets and strings that carry them."""

from __future__ import annotations

import asyncio

from fleet.redact import MARK, redact, redact_async

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


def test_connection_strings_key_value_pairs_and_well_known_tokens_are_cut_out() -> None:
    cases = {
        "postgresql://fleet:s3cr3t-pw@db:5432/fleet": "postgresql://fleet:[redacted]@db:5432/fleet",
        "retry with password=hunter2, then stop": "retry with password=[redacted], then stop",
        "config api_key: abc123def; region eu": "config api_key: [redacted]; region eu",
        "Authorization: Basic dXNlcjpwYXNzd29yZA==": "Authorization: [redacted]",
        "aws AKIAIOSFODNN7EXAMPLE used": "aws [redacted] used",
        "gh ghp_" + "a" * 36 + " pushed": "gh [redacted] pushed",
        "slack xoxb-1234567890-abcdef posted": "slack [redacted] posted",
        "model key sk-proj-" + "b" * 30: "model key [redacted]",
    }
    for text, expected in cases.items():
        out, count = redact({"text": text})
        assert out["text"] == expected, text
        assert count == 1, text


def test_words_that_only_look_like_secrets_are_kept() -> None:
    text = "the token budget is spent; see https://example.com/a:b; sk-short; password reset page"
    out, count = redact({"text": text})
    assert (out["text"], count) == (text, 0)


def test_a_secret_after_a_megabyte_of_adversarial_text_is_redacted() -> None:
    """The whole text is read, however long: nothing is cut off before the patterns run."""
    for run in ("a" * 1_000_000, "eyJ" * 333_333, "-----BEGIN RSA PRIVATE KEY-----\n" * 30_000):
        out, count = redact(run + " postgresql://app:s3cr3t@db/app password=hunter22")
        assert out.endswith(f" postgresql://app:{MARK}@db/app password={MARK}")
        assert count == 2


async def test_a_large_value_is_redacted_while_the_event_loop_runs_other_tasks() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    out, count = await redact_async({"text": "a" * 4_000_000 + " token=abcdef123456"})
    other.cancel()
    assert out["text"].endswith(f"a token={MARK}")
    assert count == 1
    assert ticks - before > 10  # the loop kept running while the text was read
