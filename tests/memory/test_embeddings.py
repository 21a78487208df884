"""The embedding backends: the local model (offline, deterministic, normalised, meaningful), and the
OpenAI-compatible client against a real HTTP endpoint that serves the same local model."""

from __future__ import annotations

import asyncio
import math
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet.errors import ErrorCode, FleetError
from memory.embeddings import LocalMiniLM, OpenAIEmbeddings

KEY = "test-key-not-a-secret"


@pytest.fixture(scope="module")
def model() -> LocalMiniLM:
    loaded = LocalMiniLM()
    loaded.load()
    return loaded


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def test_the_local_model_is_deterministic_normalised_and_semantic(model: LocalMiniLM) -> None:
    a, b, c, a_again = await model.embed(
        [
            "Refunds above 500 EUR need the finance lead's sign-off.",
            "Finance must approve any refund larger than five hundred euros.",
            "The weekly KPI digest goes out on Mondays.",
            "Refunds above 500 EUR need the finance lead's sign-off.",
        ]
    )
    assert len(a) == 384 and math.isclose(math.sqrt(sum(x * x for x in a)), 1.0, abs_tol=1e-5)
    assert a == a_again
    assert cosine(a, b) > 0.5 > cosine(a, c) + 0.3
    [long] = await model.embed(["word " * 20_000])  # cut at 256 tokens, not refused
    assert len(long) == 384


@pytest.fixture
async def endpoint(model: LocalMiniLM) -> AsyncIterator[dict[str, Any]]:
    """An OpenAI-compatible /v1/embeddings that answers with the local model's vectors (dims of
    ``dims`` only, to test a wrong answer), refuses a wrong key, and fails while ``fail`` is set."""
    state: dict[str, Any] = {"fail": 0, "dims": 384, "calls": 0}

    async def embeddings(request: Request) -> JSONResponse:
        state["calls"] += 1
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if state["fail"]:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=state["fail"])
        body = await request.json()
        vectors = await model.embed(body["input"])
        data = [
            {"object": "embedding", "index": i, "embedding": v[: state["dims"]]}
            for i, v in enumerate(vectors)
        ]
        return JSONResponse({"object": "list", "data": list(reversed(data)), "model": body["model"]})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until the server runs
    app = Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    state["url"] = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    try:
        yield state
    finally:
        server.should_exit = True
        await serving


async def test_an_openai_compatible_endpoint_gives_the_same_vectors(
    model: LocalMiniLM, endpoint: dict[str, Any]
) -> None:
    remote = OpenAIEmbeddings(endpoint["url"], "all-minilm", 384, api_key=KEY, batch=2)
    texts = ["one note", "another note", "a third note"]
    try:
        vectors = await remote.embed(texts)  # two requests; answers out of order are put back in order
        local = await model.embed(texts)
        assert all(cosine(r, loc) > 0.9999 for r, loc in zip(vectors, local, strict=True))
        assert endpoint["calls"] == 2 and remote.name == "openai:all-minilm"

        endpoint["fail"] = 503
        with pytest.raises(FleetError) as unavailable:
            await remote.embed(["x"])
        assert unavailable.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE and unavailable.value.retryable
        endpoint["fail"], endpoint["dims"] = 0, 100
        with pytest.raises(FleetError, match="not of 384 dimensions"):
            await remote.embed(["x"])
    finally:
        await remote.aclose()
    wrong_key = OpenAIEmbeddings(endpoint["url"], "all-minilm", 384, api_key="wrong")
    with pytest.raises(FleetError) as refused:
        await wrong_key.embed(["x"])
    assert "401" in refused.value.message and KEY not in refused.value.message
    await wrong_key.aclose()
    nowhere = OpenAIEmbeddings("http://127.0.0.1:9/v1", "m", 384, http=httpx.AsyncClient(timeout=2))
    with pytest.raises(FleetError, match="unreachable"):
        await nowhere.embed(["x"])
    await nowhere.aclose()


async def test_the_default_model_is_derived_once_and_close_to_the_exact_one(tmp_path: Path) -> None:
    fast = LocalMiniLM(cache_dir=tmp_path)
    texts = [
        "Refunds above 500 EUR need sign-off.",
        "The KPI digest goes out on Mondays.",
        "Call the vendor.",
    ]
    vectors = await fast.embed(texts)
    derived, weights = sorted(os.listdir(tmp_path))
    assert weights == derived + ".weights"
    made_at = os.stat(tmp_path / derived).st_mtime_ns
    again = LocalMiniLM(cache_dir=tmp_path)
    assert await again.embed(texts[1:2]) == vectors[1:2]  # the same file, and a text alone = in a batch
    assert os.stat(tmp_path / derived).st_mtime_ns == made_at
    assert sorted(os.listdir(tmp_path)) == [derived, weights]
    # the weights are mapped from their file (one copy, shared by the sessions), not read into each
    with open("/proc/self/maps") as maps:  # noqa: ASYNC230 - a file of the kernel, read at once
        assert str(tmp_path / weights) in maps.read()
    exact = await LocalMiniLM(exact=True).embed(texts)
    assert all(cosine(v, e) > 0.97 for v, e in zip(vectors, exact, strict=True))
    assert fast.name.endswith("-per-channel") and fast.dim == 384
