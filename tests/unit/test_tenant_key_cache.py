"""What an MCP server keeps of the tenant keys it was given (``mcp_servers._base.TenantKeys``): each is
asked for with the current caller's own token, kept a short while, and the number kept is bounded."""

from __future__ import annotations

from typing import Any, cast

from fleet.tenant_keys import MasterSecret, TenantKey
from fleet.tokens import Claims
from mcp_servers._base import TenantKeys
from registry import RegistryClient

MASTER = MasterSecret("m-test", bytes(range(32)))


class Registry:
    """Stands in for the registry's answer only (the registry itself is tested in tests/e2e)."""

    def __init__(self, expires_in: float = 300.0) -> None:
        self.asked: list[tuple[str, str]] = []
        self.expires_in = expires_in

    async def tenant_key(self, caller_token: str, tenant: str) -> tuple[TenantKey, float]:
        self.asked.append((caller_token, tenant))
        return MASTER.tenant_key(tenant), self.expires_in


def claims(tenant: str, token: str) -> Claims:
    raw: dict[str, Any] = {"tenant": tenant}
    return Claims("caller", tenant, "mcp-sandbox", frozenset(), "j", 0, raw, token)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_key_is_asked_for_with_the_caller_s_token_and_kept_a_short_while() -> None:
    registry, clock = Registry(), Clock()
    keys = TenantKeys(cast(RegistryClient, registry), clock)
    first = await keys.for_caller(claims("acme", "token-1"))
    assert first.tenant == "acme" and registry.asked == [("token-1", "acme")]
    assert await keys.for_caller(claims("acme", "token-2")) == first  # kept: not asked again
    clock.now += TenantKeys.KEEP_S + 1
    await keys.for_caller(claims("acme", "token-3"))
    assert registry.asked[-1] == ("token-3", "acme")  # asked again, with the new caller's token


async def test_a_key_is_kept_no_longer_than_the_registry_says() -> None:
    registry, clock = Registry(expires_in=5.0), Clock()
    keys = TenantKeys(cast(RegistryClient, registry), clock)
    await keys.for_caller(claims("acme", "t"))
    clock.now += 6
    await keys.for_caller(claims("acme", "t"))
    assert len(registry.asked) == 2


async def test_each_tenant_s_key_is_its_own_and_the_number_kept_is_bounded() -> None:
    registry, clock = Registry(), Clock()
    keys = TenantKeys(cast(RegistryClient, registry), clock)
    acme = await keys.for_caller(claims("acme", "a"))
    globex = await keys.for_caller(claims("globex", "g"))
    assert acme.tenant == "acme" and globex.tenant == "globex" and acme.secret != globex.secret
    for n in range(TenantKeys.MAX_TENANTS * 2):
        await keys.for_caller(claims(f"t{n}", "x"))
    assert len(keys._keys) <= TenantKeys.MAX_TENANTS
