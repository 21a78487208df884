"""The OPA REST backend: decisions from an OPA server (a sidecar, or a central one) through
``opa-python-client``, for deployments that run OPA. Selected with ``FLEET_POLICY_ENGINE=opa`` and
``FLEET_OPA_URL``.

Loading a bundle pushes its modules (``PUT /v1/policies/<file>``) and its data (``PUT /v1/data/<key>``)
to the server and removes modules the bundle no longer has; OPA compiles each module against the rest
and refuses one that does not compile, which refuses the revision. Modules are pushed one at a time,
so for the moment of a push a shared server may answer from a mix of revisions; a deployment that
needs an atomic switch serves bundles to OPA instead (its bundle plugin), and keeps this engine's
queries. Every failure (unreachable, an error status, a timeout, an undefined decision) is a
:class:`PolicyError`: the caller fails closed.
"""

from __future__ import annotations

import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from opa_client.errors import RegoParseError
from opa_client.opa_async import AsyncOpaClient

from policy._bundle import Bundle
from policy.engine import Decision
from policy.errors import PolicyError
from policy.regorus_engine import decision_of


class OpaRestEngine:
    """A :class:`~policy.engine.PolicyEngine` over one OPA server and one loaded bundle."""

    def __init__(self, client: AsyncOpaClient, bundle: Bundle) -> None:
        self._client = client
        self._bundle = bundle

    @classmethod
    async def load(
        cls,
        url: str,
        bundle: Bundle,
        *,
        timeout_s: float = 2.0,
        token: str | None = None,
        with_tests: bool = False,
    ) -> OpaRestEngine:
        """Push ``bundle`` to the OPA server at ``url`` and return its engine (``with_tests``: the
        ``*_test.rego`` modules too, for running the bundle's tests on OPA)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PolicyError(f"FLEET_OPA_URL must be http(s)://host:port, not {url!r}")
        client = AsyncOpaClient(
            host=parts.hostname,
            port=parts.port or (443 if parts.scheme == "https" else 8181),
            ssl=parts.scheme == "https",
            token=token,
            retries=0,  # a retried POST would be a second decision; the caller fails closed instead
            timeout=timeout_s,
        )
        await client.__aenter__()
        try:
            modules = dict(bundle.modules if with_tests else bundle.policies)
            for stale in set(await client.get_policies_list()) - set(modules):
                await client.delete_policy(stale)
            # OPA compiles each module against those it has: one that calls what a later one defines
            # is tried again after the others, until a round takes none.
            pending = sorted(modules.items(), key=lambda m: m[0].endswith("_test.rego"))  # tests last
            while pending:
                refused: list[tuple[str, str]] = []
                last_error: RegoParseError | None = None
                for name, source in pending:
                    try:
                        await client.update_policy_from_string(source, name, rego_compat=False)
                    except RegoParseError as exc:
                        refused.append((name, source))
                        last_error = exc
                if len(refused) == len(pending) and last_error is not None:
                    raise last_error
                pending = refused
            for key, value in bundle.data.items():
                if not await client.update_or_create_data(value, key):
                    raise PolicyError(f"OPA at {url} did not take the data under {key!r}")
        except RegoParseError as exc:
            await client.close_connection()
            raise PolicyError(f"bundle {bundle.revision} does not compile on OPA: {exc.message}") from exc
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            await client.close_connection()
            raise PolicyError(f"cannot load the bundle into OPA at {url}: {exc}") from exc
        except BaseException:
            await client.close_connection()
            raise
        return cls(client, bundle)

    @property
    def revision(self) -> str:
        return self._bundle.revision

    @property
    def bundle(self) -> Bundle:
        return self._bundle

    async def evaluate(self, path: str, input_document: dict[str, Any]) -> Any:
        """The value of ``data.<path>`` (None if undefined)."""
        package, _, rule = path.rpartition(".")
        try:
            body = await self._client.query_rule(input_document, package, rule)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise PolicyError(f"OPA could not evaluate {path}: {exc}") from exc
        return body.get("result") if isinstance(body, dict) else None

    async def decide(
        self, path: str, input_document: dict[str, Any], *, log_decision: bool = True
    ) -> Decision:
        started = time.perf_counter()
        result = await self.evaluate(path, input_document)
        return decision_of(path, result, self.revision, uuid.uuid4().hex, started)

    async def healthy(self) -> bool:
        """Whether the server answers ``GET /health`` with 200."""
        return bool(await self._client.check_health())

    async def aclose(self) -> None:
        await self._client.close_connection()
