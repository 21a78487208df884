"""The MCP client's TLS context is made once per set of trusted CAs, not per client: making one
reads and parses every trusted certificate (10-25 ms of CPU), which a client per tool call paid."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from fleet import mcp_client
from fleet.tlsca import local_tls


async def test_clients_share_one_context_until_the_trusted_cas_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    first = mcp_client.tls_context()
    async with mcp_client.http_client(token="t") as a, mcp_client.http_client(token="u") as b:
        assert a is not b
    assert mcp_client.tls_context() is first and first.verify_mode == ssl.CERT_REQUIRED
    # The CLI trusts a stack's own CA by setting SSL_CERT_FILE at run time: a context for it.
    monkeypatch.setenv("SSL_CERT_FILE", str(local_tls(tmp_path / "tls").ca_file))
    trusting = mcp_client.tls_context()
    assert trusting is not first
    assert len(trusting.get_ca_certs()) == 1  # the stack's CA alone, as the file names
    assert mcp_client.tls_context() is trusting
