"""A scripted OpenAI-compatible chat model: a real HTTP server (Starlette under uvicorn, on a free
loopback port, in the test's event loop) that answers ``POST /v1/chat/completions`` with the replies
it was given, in order, and records every request it received, so that a test can assert what a
model was shown. When the script runs out it answers 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted answer: a completion with ``content`` and ``tool_calls`` (``(name, arguments)``
    pairs; arguments that are a string are sent as they are, e.g. broken JSON), or, with ``body``,
    that body as it is with ``status``. ``hold`` (or ``block``): answer only once it is set."""

    content: str | None = None
    tool_calls: tuple[tuple[str, Any], ...] = ()
    usage: int = 10
    status: int = 200
    body: Any = None
    hold: asyncio.Event | None = None
    headers: tuple[tuple[str, str], ...] = ()
    block: threading.Event | None = None  # like ``hold``, set from any thread (a model in a thread)

    def completion(self, number: int) -> Any:
        if self.body is not None:
            return self.body
        calls = [
            {
                "id": f"call-{number}-{index}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
            for index, (name, arguments) in enumerate(self.tool_calls)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if calls:
            message["tool_calls"] = calls
        return {
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {
                "prompt_tokens": self.usage // 2,
                "completion_tokens": self.usage - self.usage // 2,
                "total_tokens": self.usage,
            },
        }


def say(content: str, usage: int = 10) -> Reply:
    """A final answer."""
    return Reply(content=content, usage=usage)


def call(name: str, arguments: Any = None, usage: int = 10, content: str | None = None) -> Reply:
    """A turn that calls one tool (saying ``content`` beside it, if given)."""
    return Reply(content=content, tool_calls=((name, {} if arguments is None else arguments),), usage=usage)


def rate_limited(retry_after: str | None = "0") -> Reply:
    """A 429 answer, with a ``Retry-After`` unless it is None."""
    headers = (("Retry-After", retry_after),) if retry_after is not None else ()
    return Reply(status=429, body={"error": {"message": "slow down"}}, headers=headers)


@dataclass
class ScriptedModel:
    """The server's script and what it was asked: each request's JSON body and headers."""

    replies: list[Reply]
    port: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def shown(self, number: int = -1) -> str:
        """Everything request ``number`` showed the model, as one text (to search for a secret)."""
        return json.dumps(self.requests[number])

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            self.requests.append(await request.json())
            self.headers.append(dict(request.headers))
            if not self.replies:
                return JSONResponse({"error": {"message": "the script ran out"}}, status_code=500)
            reply = self.replies.pop(0)
            if reply.hold is not None:
                await reply.hold.wait()
            if reply.block is not None:
                await asyncio.to_thread(reply.block.wait)
            return JSONResponse(
                reply.completion(len(self.requests)), status_code=reply.status, headers=dict(reply.headers)
            )

        return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@contextlib.asynccontextmanager
async def scripted_model(*replies: Reply) -> AsyncIterator[ScriptedModel]:
    """A scripted model serving on a free loopback port for the block. The socket listens before
    the server starts, so a request made at once waits in its backlog: nothing to wait for."""
    model = ScriptedModel(list(replies))
    holds = [reply.hold for reply in replies if reply.hold is not None]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    model.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(model.app(), log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield model
    finally:
        for hold in holds:  # a held answer must not keep the server from stopping
            hold.set()
        server.should_exit = True
        await asyncio.wait_for(serving, STOP_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def scripted_model_thread(*replies: Reply) -> Iterator[ScriptedModel]:
    """A scripted model served from a thread of its own (its own event loop), for a stack that
    outlives one test's loop (a module's fixture). Its ``replies`` and ``requests`` are plain lists
    the test may change between runs; a ``hold`` does not work across threads."""
    ready = threading.Event()
    served: list[ScriptedModel] = []
    loop = asyncio.new_event_loop()
    stopping = asyncio.Event()

    async def serve() -> None:
        async with scripted_model(*replies) as model:
            served.append(model)
            ready.set()
            await stopping.wait()

    thread = threading.Thread(
        target=loop.run_until_complete, args=(serve(),), name="scripted-model", daemon=True
    )
    thread.start()
    if not ready.wait(STOP_TIMEOUT_S):
        raise RuntimeError("the scripted model did not start")
    try:
        yield served[0]
    finally:
        for reply in replies:  # a blocked answer must not keep the server from stopping
            if reply.block is not None:
                reply.block.set()
        for reply in served[0].replies if served else []:
            if reply.block is not None:
                reply.block.set()
        loop.call_soon_threadsafe(stopping.set)
        thread.join(STOP_TIMEOUT_S)
        loop.close()
