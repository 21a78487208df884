"""An OPA-compatible policy decision point over the embedded engine: the part of OPA's REST API (v1)
that clients of a decision point use, so that anything written for OPA (``opa-python-client``, the
fleet's own OPA backend, sidecars) can be pointed at it. ``fleet policy serve`` runs it.

Served: ``POST``/``GET /v1/data/{path}`` (a decision: ``{"result": ..., "decision_id": ...}``, or
``{}`` when the document is undefined, as OPA answers), ``PUT``/``GET``/``DELETE /v1/policies/{id}``
(a module is accepted only if every module compiles with it: 400 ``invalid_parameter`` otherwise, and
nothing changes), ``GET /v1/policies``, ``PUT``/``DELETE /v1/data/{path}`` (204; data may not
overlap a package, as in OPA), ``GET /health``. Errors are OPA's shape: ``{"code": ..., "message":
...}``. With a token (``FLEET_OPA_TOKEN``), every ``/v1`` request must carry it; ``fleet policy serve``
refuses to listen beyond loopback without one.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from policy._bundle import Bundle
from policy.errors import PolicyError
from policy.regorus_engine import RegorusEngine

log = logging.getLogger(__name__)

UNDEFINED = "<undefined>"  # what regorus answers for an undefined rule


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status)


class DecisionPoint:
    """The modules and data pushed so far, and the engine compiled from them."""

    def __init__(self, bundle: Bundle | None = None) -> None:
        self.modules: dict[str, str] = dict(bundle.modules) if bundle else {}
        self.data: dict[str, Any] = json.loads(json.dumps(bundle.data)) if bundle else {}
        self.engine = self._compile(self.modules, self.data)

    @staticmethod
    def _compile(modules: dict[str, str], data: dict[str, Any]) -> RegorusEngine | None:
        if not modules:
            return None
        bundle = Bundle(Path("rest"), tuple(sorted(modules.items())), data, f"rest+{uuid.uuid4().hex[:12]}")
        return RegorusEngine(bundle, with_tests=True)

    def put_policy(self, module_id: str, source: str) -> None:
        modules = {**self.modules, module_id: source}
        package = _package(source)
        if package is not None and _overlaps(self.data, package):
            raise PolicyError(f"package {'.'.join(package)} conflicts with data at the same path")
        self.engine = self._compile(modules, self.data)  # raises PolicyError: nothing changes
        self.modules = modules

    def delete_policy(self, module_id: str) -> bool:
        if module_id not in self.modules:
            return False
        modules = {k: v for k, v in self.modules.items() if k != module_id}
        self.engine = self._compile(modules, self.data)
        self.modules = modules
        return True

    def put_data(self, path: list[str], value: Any) -> None:
        for source in self.modules.values():
            package = _package(source)
            if package is not None and (package[: len(path)] == path or path[: len(package)] == package):
                raise PolicyError(f"data at {'/'.join(path)} conflicts with package {'.'.join(package)}")
        data = json.loads(json.dumps(self.data))
        if not path:
            if not isinstance(value, dict):
                raise PolicyError("the root document must be an object")
            data = value
        else:
            node = data
            for key in path[:-1]:
                child = node.get(key)
                if not isinstance(child, dict):
                    child = node[key] = {}
                node = child
            node[path[-1]] = value
        self.engine = self._compile(self.modules, data)
        self.data = data

    def delete_data(self, path: list[str]) -> bool:
        data = json.loads(json.dumps(self.data))
        node: Any = data
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not path or not isinstance(node, dict) or path[-1] not in node:
            return False
        del node[path[-1]]
        self.engine = self._compile(self.modules, data)
        self.data = data
        return True

    def query(self, path: list[str], input_document: Any) -> tuple[bool, Any]:
        """(defined, value) of ``data.<path>``."""
        if not path:
            return True, self.data
        if self.engine is None:
            return False, None
        try:
            value = self.engine.evaluate(".".join(path), input_document)
        except PolicyError as exc:
            if "not a valid rule path" in exc.message or "not found" in exc.message:
                return self._data_at(path)
            raise
        if value == UNDEFINED:
            return self._data_at(path)
        return True, value

    def _data_at(self, path: list[str]) -> tuple[bool, Any]:
        node: Any = self.data
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False, None
            node = node[key]
        return True, node


# Blanks within the line only: every line start is tried anyway, and "\s*" there rereads all the
# blank lines after it (quadratic on a run of newlines).
_PACKAGE = re.compile(r"^[^\S\n]*package\s+([A-Za-z_][\w.]*)", re.MULTILINE)


def _package(source: str) -> list[str] | None:
    found = _PACKAGE.search(source)
    return found.group(1).split(".") if found else None


def _overlaps(data: dict[str, Any], package: list[str]) -> bool:
    """Whether data holds a value at ``package`` or at a path inside it (rules live there)."""
    node: Any = data
    for key in package:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _path(request: Request) -> list[str]:
    return [segment for segment in str(request.path_params.get("path", "")).split("/") if segment]


class _Api:
    """The OPA REST API's handlers over one decision point."""

    def __init__(self, point: DecisionPoint) -> None:
        self.point = point

    async def health(self, request: Request) -> Response:
        return JSONResponse({})

    async def decide(self, request: Request) -> Response:
        input_document = await _input_of(request)
        if isinstance(input_document, Response):
            return input_document
        try:
            given = input_document if input_document is not None else {}
            defined, value = self.point.query(_path(request), given)
        except PolicyError as exc:
            return _error(500, "internal_error", f"error(s) occurred while evaluating query: {exc.message}")
        answer: dict[str, Any] = {"decision_id": uuid.uuid4().hex}
        if defined:
            answer["result"] = value
        if input_document is None:
            answer["warning"] = {
                "code": "api_usage_warning",
                "message": "'input' key missing from the request",
            }
        return JSONResponse(answer)

    async def put_data(self, request: Request) -> Response:
        try:
            self.point.put_data(_path(request), json.loads(await request.body() or b"null"))
        except ValueError as exc:
            return _error(400, "invalid_parameter", f"malformed document: {exc}")
        except PolicyError as exc:
            return _error(400, "invalid_parameter", exc.message)
        return Response(status_code=204)

    async def delete_data(self, request: Request) -> Response:
        if not self.point.delete_data(_path(request)):
            return _error(404, "resource_not_found", "storage_not_found_error: document missing")
        return Response(status_code=204)

    async def list_policies(self, request: Request) -> Response:
        modules = self.point.modules
        return JSONResponse({"result": [{"id": k, "raw": v, "ast": {}} for k, v in sorted(modules.items())]})

    async def get_policy(self, request: Request) -> Response:
        module_id = request.path_params["id"]
        if module_id not in self.point.modules:
            return _error(404, "resource_not_found", f"storage_policy_not_found_err: {module_id}")
        return JSONResponse({"result": {"id": module_id, "raw": self.point.modules[module_id], "ast": {}}})

    async def put_policy(self, request: Request) -> Response:
        source = (await request.body()).decode("utf-8", errors="replace")
        if not source.strip():
            return _error(400, "invalid_parameter", "empty module")
        try:
            self.point.put_policy(request.path_params["id"], source)
        except PolicyError as exc:
            return _error(
                400, "invalid_parameter", f"error(s) occurred while compiling module(s): {exc.message}"
            )
        return JSONResponse({})

    async def delete_policy(self, request: Request) -> Response:
        if not self.point.delete_policy(request.path_params["id"]):
            return _error(
                404, "resource_not_found", f"storage_policy_not_found_err: {request.path_params['id']}"
            )
        return JSONResponse({})


async def _input_of(request: Request) -> Any:
    """The input document of a query (None when the request names none), or the 400 answer to a
    request whose input is malformed."""
    if request.method == "POST":
        raw = await request.body()
        if not raw.strip():
            return None
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _error(400, "invalid_parameter", f"body contains malformed input document: {exc}")
        if not isinstance(body, dict):
            return _error(400, "invalid_parameter", "the body must be an object")
        return body.get("input")
    if "input" in request.query_params:
        try:
            return json.loads(request.query_params["input"])
        except ValueError as exc:
            return _error(400, "invalid_parameter", f"malformed input: {exc}")
    return None


class _BearerOnly:
    """With a token, every ``/v1`` request must carry it as a bearer (401 ``unauthorized``)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token and scope["type"] == "http" and scope["path"].startswith("/v1"):
            sent = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(sent, f"Bearer {self.token}"):
                await _error(401, "unauthorized", "a bearer token is required")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(point: DecisionPoint, token: str | None = None) -> Starlette:
    """The decision point's app; with ``token``, every ``/v1`` request must carry it as a bearer
    (401 ``unauthorized`` otherwise): writes change every decision the point makes."""
    api = _Api(point)
    return Starlette(
        middleware=[Middleware(_BearerOnly, token=token)],
        routes=[
            Route("/health", api.health),
            Route("/v1/data", api.decide, methods=["GET", "POST"]),
            Route("/v1/data/{path:path}", api.decide, methods=["GET", "POST"]),
            Route("/v1/data/{path:path}", api.put_data, methods=["PUT"]),
            Route("/v1/data/{path:path}", api.delete_data, methods=["DELETE"]),
            Route("/v1/policies", api.list_policies),
            Route("/v1/policies/", api.list_policies),
            Route("/v1/policies/{id:path}", api.get_policy, methods=["GET"]),
            Route("/v1/policies/{id:path}", api.put_policy, methods=["PUT"]),
            Route("/v1/policies/{id:path}", api.delete_policy, methods=["DELETE"]),
        ],
    )
