"""An agent loop's progress notes: what a task has done so far, kept where it outlives the process
running it, so that a fresh context, or another process of the same agent after a crash, goes on from
there instead of starting over.

The notes hold the model's own summary (written when its context was compacted) and the ledger of
the tool calls the task made: for each, its key (function and canonical argument hash), the
arguments and the answer the model was shown (both already redacted, the answer cut), and whether it
ended. A call is recorded ``pending`` before it is made and ``done`` with its answer after; the loop
saves the notes (the kit sends them to the caller, which keeps them with the operation) at both
points and after each compaction.

A loop that resumes from notes (they come back with the operation when it is sent again):

- starts its context from the summary and the calls' answers, not from the beginning;
- answers a call with an effect it already made from the notes, without calling the tool again (a
  read is made again: what it reads may have changed);
- makes a call that was ``pending`` (cut by the crash) again only if a repeat is safe: the tool is
  read-only or idempotent in the catalog, or it takes an ``idempotency_key`` (the loop sets that key
  itself, from the operation and the call, so the repeat carries the same key); else the task ends
  ``outcome_unknown`` and a person reconciles it.

The notes leave the agent sealed (:func:`sealed`: a MAC with a key derived from the agent's own
signing key, bound to the tenant, run and skill), and come back only if they open: a caller cannot
hand an agent notes it did not write (claiming effects it never made, or words it never said).

Notes are bounded (:data:`MAX_NOTES_BYTES`): the oldest answers are dropped first, then the oldest
calls (a dropped call is no longer known to have been made, so a keyed tool's key is what keeps its
effect from repeating).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from fleet.operation_ext import args_hash

NOTES_VERSION = 1
MAX_NOTES_BYTES = 64 * 1024
MAX_ANSWER_CHARS = 2_000  # of one call's answer, as the notes keep it
MAX_SUMMARY_CHARS = 8_000
SHOWN_ANSWER_CHARS = 500  # of one call's answer, as a fresh context is shown it
IDEMPOTENCY_ARGUMENT = "idempotency_key"


def sealed(body: dict[str, Any], key: bytes, binding: str) -> dict[str, Any]:
    """``body`` (notes as saved) with a MAC that only this agent can make (``key``), bound to
    ``binding`` (the tenant, run and skill they are for): notes a caller forged, or took from
    another task, do not open."""
    return {**body, "mac": _mac(body, key, binding)}


def opened(body: Any, key: bytes, binding: str) -> dict[str, Any] | None:
    """``body`` without its MAC if this agent sealed it for ``binding``; else None."""
    if not isinstance(body, dict) or not isinstance(body.get("mac"), str):
        return None
    bare = {k: v for k, v in body.items() if k != "mac"}
    return bare if hmac.compare_digest(body["mac"], _mac(bare, key, binding)) else None


def _mac(body: dict[str, Any], key: bytes, binding: str) -> str:
    canonical = json.dumps(
        [binding, _plain(body)], sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def _plain(value: Any) -> Any:
    """``value`` with every whole float as an int: the notes cross A2A metadata (a protobuf Struct,
    where every number is a double) on their way out and back, and must seal the same."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def call_key(function: str, arguments: dict[str, Any]) -> str:
    """What makes two tool calls the same call: the function and the canonical hash of its
    arguments (an ``idempotency_key`` among them left out: the loop sets it)."""
    shown = {k: v for k, v in arguments.items() if k != IDEMPOTENCY_ARGUMENT}
    return f"{function}:{args_hash(shown)}"


def keyed(arguments: dict[str, Any], operation_id: str | None, key: str) -> dict[str, Any]:
    """``arguments`` with the ``idempotency_key`` the tool is given set by the loop, if the call has
    one: derived from the operation and the call, so the same call of the same operation carries
    the same key wherever and however often it is made (a model's own key is not used)."""
    if IDEMPOTENCY_ARGUMENT not in arguments or not operation_id:
        return arguments
    derived = hashlib.sha256(f"{operation_id}\n{key}".encode()).hexdigest()[:40]
    return {**arguments, IDEMPOTENCY_ARGUMENT: f"loop-{derived}"}


@dataclass(slots=True)
class Call:
    """One tool call of the task, as the notes keep it."""

    key: str
    function: str
    arguments: dict[str, Any]
    answer: str | None = None  # None while pending
    done: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "function": self.function, "arguments": self.arguments}
        if self.done:
            out["done"] = True
            if self.answer is not None:
                out["answer"] = self.answer
        return out


@dataclass(slots=True)
class Notes:
    """A task's progress notes (see the module's doc)."""

    summary: str = ""
    calls: list[Call] = field(default_factory=list)
    turn: int = 0
    compactions: int = 0
    asked: dict[str, str] | None = None  # the limit the loop asked a person about: reason, why
    reviews: int = 0  # the reviewer's verdicts the task has had (they count across a hand-off)

    def pending(self, key: str, function: str, arguments: dict[str, Any]) -> None:
        """Record that the call ``key`` is about to be made."""
        self.calls.append(Call(key, function, arguments))

    def done(self, key: str, answer: str) -> None:
        """Record the answer of the pending call ``key``."""
        for call in reversed(self.calls):
            if call.key == key and not call.done:
                call.done, call.answer = True, answer[:MAX_ANSWER_CHARS]
                return

    def answer_of(self, key: str) -> str | None:
        """The answer the call ``key`` got when it was made, if it was (and the notes kept it)."""
        for call in reversed(self.calls):
            if call.key == key and call.done:
                return call.answer if call.answer is not None else ""
        return None

    def cut_short(self) -> list[Call]:
        """The calls that were pending when the notes were last saved (their end is not known)."""
        return [call for call in self.calls if not call.done]

    def to_json(self) -> dict[str, Any]:
        """The notes as saved, within :data:`MAX_NOTES_BYTES`."""
        body = {
            "v": NOTES_VERSION,
            "summary": self.summary[:MAX_SUMMARY_CHARS],
            "turn": self.turn,
            "compactions": self.compactions,
            "calls": [call.to_json() for call in self.calls],
        }
        if self.asked is not None:
            body["asked"] = self.asked
        if self.reviews:
            body["reviews"] = self.reviews
        calls = body["calls"]
        assert isinstance(calls, list)
        while len(json.dumps(body)) > MAX_NOTES_BYTES and calls:
            answered = next((c for c in calls if "answer" in c), None)
            if answered is not None:
                del answered["answer"]  # the answer goes first; that the call was made stays
            else:
                del calls[0]
        return body

    @classmethod
    def of(cls, body: Any) -> Notes | None:
        """Notes as they came back with the operation; None if they are not notes this version reads."""
        if not isinstance(body, dict) or body.get("v") != NOTES_VERSION:
            return None
        body = _plain(body)
        calls = []
        for raw in body.get("calls") or []:
            if not isinstance(raw, dict) or not isinstance(raw.get("key"), str):
                continue
            given = raw.get("arguments")
            arguments: dict[str, Any] = given if isinstance(given, dict) else {}
            said = raw.get("answer")
            answer = said if isinstance(said, str) else None
            calls.append(
                Call(raw["key"], str(raw.get("function", "")), arguments, answer, raw.get("done") is True)
            )
        summary, turn, compactions = body.get("summary"), body.get("turn"), body.get("compactions")
        asked, reviews = body.get("asked"), body.get("reviews")
        return cls(
            summary[:MAX_SUMMARY_CHARS] if isinstance(summary, str) else "",
            calls,
            turn if isinstance(turn, int) else 0,
            compactions if isinstance(compactions, int) else 0,
            {k: str(v)[:300] for k, v in asked.items() if k in ("reason", "why")}
            if isinstance(asked, dict)
            else None,
            reviews if isinstance(reviews, int) and reviews > 0 else 0,
        )

    def for_model(self, max_chars: int = 8_000) -> str:
        """What the model of a fresh context is told of the task so far, in about ``max_chars``:
        the summary, then the calls made, latest first, each answer cut to
        :data:`SHOWN_ANSWER_CHARS` (the calls left out are only counted: made again, they are
        answered from the notes all the same)."""
        head = "\n\n".join(
            [
                "You are continuing this task; your earlier context is gone. Your progress notes so far:",
                self.summary or "(no summary was written)",
                "The tool calls made so far, latest first, with their answers (do not make them again: a"
                " repeat of one with an effect is answered from these notes):",
            ]
        )
        shown: list[dict[str, Any]] = []
        room = max_chars - len(head)
        made = [c for c in self.calls if c.done]
        for c in reversed(made):
            answer = c.answer[:SHOWN_ANSWER_CHARS] if c.answer is not None else "(not kept)"
            entry = {"call": c.function, "arguments": c.arguments, "answer": answer}
            room -= len(json.dumps(entry))
            if room < 0:
                break
            shown.append(entry)
        left_out = len(made) - len(shown)
        tail = f"\n({left_out} earlier calls not shown)" if left_out else ""
        return f"{head} {json.dumps(shown)}{tail}"
