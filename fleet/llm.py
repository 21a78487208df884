"""A small async client for an OpenAI-compatible chat completions endpoint
(``POST {base_url}/chat/completions``), the one LLM surface of the fleet: vLLM, llama.cpp, Ollama,
LiteLLM and the hosted APIs all speak it.

Every failure is a :class:`~fleet.errors.FleetError`: ``llm_rate_limited`` when the endpoint answered
429 (``retryable``, with the wait its ``Retry-After`` asked for as ``retry_after_s``), else
``llm_unavailable``: the endpoint could not be reached, did not answer in time or answered 5xx
(``retryable``), refused the request (4xx), or answered something that is not a chat completion
(named in the message). The API key is sent as a bearer token and never appears in a message or a
log line.
"""

from __future__ import annotations

import email.utils
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from fleet import telemetry
from fleet.errors import ErrorCode, FleetError
from fleet.redact import redact
from fleet.settings import ServiceSettings

log = logging.getLogger(__name__)

SNIPPET = 200  # how much of a bad answer an error message quotes
MAX_RETRY_AFTER_S = 3600  # a Retry-After longer than this is read as this
MAX_SCANNED = 20_000  # how much of it is scanned for secrets to quote that much


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model asked for: its id (echoed in the tool's answer), the function's
    name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChatReply:
    """One completion: the assistant's text, the tool calls it asked for, the tokens it used
    (``usage``: prompt and completion together; and each, when the server said), the model that
    answered (as it named itself, else as asked) and whether it stopped at the token limit
    (``finish_reason`` ``length``: the answer is cut)."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    usage: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    cut: bool = False

    def as_message(self) -> dict[str, Any]:
        """The reply as the assistant message of the conversation's next request."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


class ChatModel:
    """One model behind an OpenAI-compatible endpoint, called over ``http`` (shared, owned by the
    caller); a completion that takes longer than ``timeout_s`` is ``llm_unavailable``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str,
        http: httpx.AsyncClient,
        timeout_s: float = 60.0,
    ) -> None:
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._model = model
        self._api_key = api_key
        self._http = http
        self._timeout_s = timeout_s
        where, _ = redact(base_url)
        self._where = str(where)  # how messages name the endpoint (without a password in its URL)

    async def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        run_id: str = "",
        max_tokens: int | None = None,
    ) -> ChatReply:
        """The model's next turn of the conversation ``messages``, offered ``tools`` (OpenAI
        function specs) if any, its answer held to ``max_tokens`` completion tokens if given. Each
        call is a ``chat {model}`` span with the tokens it used (and ``run_id``, the run it works
        for, if there is one yet)."""
        with telemetry.chat_span(self._model, run_id=run_id) as span:
            reply = await self._complete(messages, tools, max_tokens)
            if reply.prompt_tokens or reply.completion_tokens:
                telemetry.record_usage(span, reply.prompt_tokens, reply.completion_tokens)
            return reply

    @property
    def model(self) -> str:
        """The model this client asks for."""
        return self._model

    async def _complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, max_tokens: int | None
    ) -> ChatReply:
        body: dict[str, Any] = {"model": self._model, "messages": messages}
        if tools:
            body["tools"] = tools
        if max_tokens is not None:
            body["max_tokens"] = max(1, max_tokens)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            response = await self._http.post(
                self._url, json=body, headers=headers, timeout=httpx.Timeout(self._timeout_s)
            )
        except httpx.TimeoutException as exc:
            raise self._unavailable(f"did not answer within {self._timeout_s:g} s") from exc
        except httpx.HTTPError as exc:
            raise self._unavailable(f"could not be reached ({type(exc).__name__})") from exc
        if response.status_code == 429:
            wait_s = retry_after_s(response.headers.get("retry-after"))
            log.warning("the model at %s is rate limiting (429, Retry-After %s)", self._where, wait_s)
            raise FleetError(
                ErrorCode.LLM_RATE_LIMITED,
                f"the model at {self._where} is rate limiting: {self._snippet(response.text)}",
                retryable=True,
                retry_after_s=wait_s,
            )
        if response.status_code >= 500:
            raise self._unavailable(f"answered HTTP {response.status_code}: {self._snippet(response.text)}")
        if response.status_code == 400 and _CONTEXT_REFUSAL.search(response.text[:MAX_SCANNED]):
            raise FleetError(
                ErrorCode.LLM_CONTEXT_EXCEEDED,
                f"the model at {self._where} refused the request as longer than its context: {self._snippet(response.text)}",
            )
        if response.status_code >= 400:
            raise self._unavailable(
                f"refused the request (HTTP {response.status_code}): {self._snippet(response.text)}",
                retryable=False,
            )
        try:
            answer = response.json()
        except ValueError as exc:
            raise self._malformed(f"the body is not JSON: {self._snippet(response.text)}") from exc
        return self._reply_of(answer)

    def _reply_of(self, answer: Any) -> ChatReply:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._malformed("it has no choices")
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise self._malformed("its first choice has no message")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise self._malformed("the message's content is not a string")
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise self._malformed("the message's tool_calls is not a list")
        calls = tuple(self._tool_call_of(raw, index) for index, raw in enumerate(raw_calls))
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        named = answer.get("model")
        return ChatReply(
            content,
            calls,
            _total_tokens(usage),
            prompt_tokens=_count(usage.get("prompt_tokens")) or 0,
            completion_tokens=_count(usage.get("completion_tokens")) or 0,
            model=named[:200] if isinstance(named, str) and named else self._model,
            cut=choices[0].get("finish_reason") == "length",
        )

    def _tool_call_of(self, raw: Any, index: int) -> ToolCall:
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise self._malformed("a tool call has no function name")
        name = function["name"]
        arguments = function.get("arguments") or "{}"
        try:
            # Most servers send the arguments as a JSON string; a few send the object itself.
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise self._malformed(
                f"the arguments of its call to {name!r} are not a JSON object: {self._snippet(str(arguments))}"
            )
        return ToolCall(str(raw.get("id") or f"call-{index}"), name, parsed)

    def _snippet(self, text: str) -> str:
        """A short quote of what the endpoint said, with this client's key and any other secret out
        (a proxy may echo the request's headers back)."""
        if self._api_key:
            text = text.replace(self._api_key, "[redacted]")
        # Redacted before it is cut, so that a cut never leaves a secret too short to be recognised.
        quoted, _ = redact(text[:MAX_SCANNED])
        return str(quoted)[:SNIPPET]

    def _unavailable(self, what: str, *, retryable: bool = True) -> FleetError:
        log.warning("the model at %s %s", self._where, what)
        return FleetError(
            ErrorCode.LLM_UNAVAILABLE, f"the model at {self._where} {what}", retryable=retryable
        )

    def _malformed(self, what: str) -> FleetError:
        return self._unavailable(f"answered something that is not a chat completion: {what}", retryable=False)


def _total_tokens(usage: Any) -> int:
    """The tokens a completion used; servers that report only the parts are summed, none is 0."""
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool):
        return max(total, 0)
    parts = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    return sum(p for p in parts if isinstance(p, int) and not isinstance(p, bool) and p > 0)


def retry_after_s(value: str | None) -> int | None:
    """The seconds an HTTP ``Retry-After`` asks to wait (delta-seconds or an HTTP date), at most
    :data:`MAX_RETRY_AFTER_S`; None if it is absent or unreadable."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return min(int(text), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return min(max(0, round(when.timestamp() - time.time())), MAX_RETRY_AFTER_S)


def _count(value: Any) -> int | None:
    """A token count a server reported, if it is one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# How OpenAI, vLLM, llama.cpp, Ollama and LiteLLM word a request longer than the model's window.
_CONTEXT_REFUSAL = re.compile(
    r"context[_ ]length[_ ]exceeded|maximum context length|context window|exceeds? the context|too many tokens",
    re.IGNORECASE,
)
_FENCED = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n(?P<body>.*?)\n?```$", re.DOTALL)


def json_object_of(text: str) -> dict[str, Any] | None:
    """The JSON object a model answered with, bare or fenced (```json ... ```); None if it is not one."""
    stripped = text.strip()
    fenced = _FENCED.match(stripped)
    if fenced is not None:
        stripped = fenced.group("body").strip()
    try:
        value = json.loads(stripped)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def from_settings(settings: ServiceSettings, http: httpx.AsyncClient) -> ChatModel | None:
    """The model the settings name (``FLEET_LLM_*``), or None when no endpoint is configured."""
    if not settings.llm_base_url:
        return None
    return ChatModel(
        settings.llm_base_url,
        settings.llm_model,
        settings.llm_api_key,
        http,
        timeout_s=settings.llm_timeout_s,
    )
