"""Working memory: an agent loop's message channel, kept to the current turn and to a size bound.

:func:`working_memory` makes a LangGraph reducer for a channel of chat messages (dicts with ``role``
and ``content``, the OpenAI shape)::

    class State(TypedDict):
        messages: Annotated[list[dict[str, Any]], working_memory(max_chars=24_000)]

Each update appends its messages; then the channel is pruned:

- to the current turn: a message with ``role == "user"`` starts a turn, and only the last
  ``turns`` turns are kept (system messages are always kept, the latest of each content once);
- to the size bound: while the messages hold more than ``max_chars`` characters, the oldest message
  of the kept turns that is not a system message nor the turn's opening user message is dropped,
  and a message longer than ``max_message_chars`` is cut with a marker. An assistant message that
  called tools and the tool results answering it are dropped together, so the channel never holds a
  tool result without its call.

What outlives the run goes to long-term memory through the gate, never through this channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Message = dict[str, Any]
CUT = "\n[... cut: working memory keeps at most {n} characters of one message]"


def _size(message: Message) -> int:
    content = message.get("content")
    return len(content) if isinstance(content, str) else len(str(content or ""))


def _cut(message: Message, limit: int) -> Message:
    content = message.get("content")
    if isinstance(content, str) and len(content) > limit:
        return {**message, "content": content[:limit] + CUT.format(n=limit)}
    return message


def prune(
    messages: Sequence[Message], *, turns: int = 1, max_chars: int = 24_000, max_message_chars: int = 8_000
) -> list[Message]:
    """``messages`` kept to the last ``turns`` turns and about ``max_chars`` characters."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    first = starts[-turns] if len(starts) >= turns else 0
    system: list[Message] = []
    for m in messages[:first]:
        if m.get("role") == "system" and m not in system:
            system.append(m)
    kept = system + [_cut(m, max_message_chars) for m in messages[first:]]
    opening = next((i for i, m in enumerate(kept) if m.get("role") == "user"), None)
    while sum(_size(m) for m in kept) > max_chars:
        droppable = [i for i, m in enumerate(kept) if m.get("role") != "system" and i != opening]
        if not droppable:
            break
        i = droppable[0]
        group = [i]
        calls = {c.get("id") for c in kept[i].get("tool_calls") or [] if isinstance(c, dict)}
        if calls:  # the tool results that answer this call go with it
            group += [
                j for j, m in enumerate(kept) if m.get("role") == "tool" and m.get("tool_call_id") in calls
            ]
        for j in sorted(group, reverse=True):
            del kept[j]
            if opening is not None and j < opening:
                opening -= 1
    return kept


def working_memory(
    *, turns: int = 1, max_chars: int = 24_000, max_message_chars: int = 8_000
) -> Callable[[list[Message] | None, list[Message] | Message | None], list[Message]]:
    """A LangGraph reducer: append the update's messages, then :func:`prune`."""

    def reduce(left: list[Message] | None, right: list[Message] | Message | None) -> list[Message]:
        added = [right] if isinstance(right, dict) else list(right or [])
        return prune(
            [*(left or []), *added], turns=turns, max_chars=max_chars, max_message_chars=max_message_chars
        )

    return reduce
