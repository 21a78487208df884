"""Consolidation at a run's end: its episodic entries yield candidate semantic facts and procedural
rules, each of which passes the gate like any write (see :mod:`memory.gate`).

The default extractor is deterministic: it splits each episodic entry into sentences and keeps
- as procedural candidates, instructions: a sentence that starts with *when*, *whenever*, *if*,
  *always*, *never*, *before* or *after*, or holds *must*, *should*, *need(s) to*, *has/have to*,
  *do not*;
- as semantic candidates, plain statements: a sentence of 4 to 40 words with a verb of being or
  having (*is*, *are*, *has*, *have*, *uses*, *belongs to*, ...), not a question and not about
  the writer (*I*, *we*, *you*).

A candidate keeps the trust of the entry it came from, and the gate sees that entry's source (the
write's ``origin``) and the principal who wrote it: a rule found only in tool output stays untrusted
and policy never lets it into procedural memory; one from a caller's words is held until distinct
principals support it or a person approves it. The same candidate from several runs is one entry
supported by each (the drift guard counts distinct runs and distinct principals).

With an OpenAI-compatible chat model configured (``FLEET_MEMORY_LLM_URL``, ``_MODEL``, ``_API_KEY``),
:class:`LlmExtractor` proposes the candidates instead; they pass the same gate.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from fleet import transport
from memory.store import Entry

log = logging.getLogger(__name__)

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_PROCEDURAL = re.compile(
    r"^(?:when|whenever|if|always|never|before|after)\b"
    r"|\b(?:must|should|needs? to|has to|have to|do not|don't|never)\b",
    re.IGNORECASE,
)
_STATEMENT = re.compile(
    r"\b(?:is|are|was|were|has|have|uses|use|costs|belongs to|belong to|runs|closes|opens|holds)\b",
    re.IGNORECASE,
)
_PERSONAL = re.compile(r"\b(?:i|we|you|me|us|my|our|your)\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Candidate:
    tier: str  # semantic or procedural
    text: str
    trust: str  # the trust of the entry it came from
    source_id: str  # that entry's id


def sentences(text: str) -> list[str]:
    return [s.strip(" -*\t") for s in _SENTENCE.split(text) if s.strip(" -*\t")]


def extract(entries: Iterable[Entry]) -> list[Candidate]:
    """The candidates of the deterministic extractor, in order, without repeats."""
    seen: set[tuple[str, str]] = set()
    found: list[Candidate] = []
    for entry in entries:
        trust = str(entry.payload.get("source_trust") or "untrusted")
        for sentence in sentences(entry.text):
            words = sentence.split()
            if not 4 <= len(words) <= 40 or sentence.endswith("?"):
                continue
            if _PROCEDURAL.search(sentence):
                tier = "procedural"
            elif _STATEMENT.search(sentence) and not _PERSONAL.search(sentence):
                tier = "semantic"
            else:
                continue
            key = (tier, " ".join(words).casefold())
            if key not in seen:
                seen.add(key)
                found.append(Candidate(tier, " ".join(words), trust, entry.id))
    return found


class Extractor(Protocol):
    async def candidates(self, episodes: Sequence[Entry]) -> list[Candidate]: ...


class RuleExtractor:
    """The deterministic extractor (:func:`extract`)."""

    async def candidates(self, episodes: Sequence[Entry]) -> list[Candidate]:
        return extract(episodes)


PROMPT = (
    "You read the episodic memory of one finished run of an agent and propose what is worth keeping."
    ' Answer with JSON only: {"facts": [..], "rules": [..]}. A fact is one short, self-contained'
    " statement that stays true beyond this run. A rule is one short instruction the agent should follow"
    " next time. Propose nothing that is only about this run, and copy no personal data or secret."
    " At most 10 of each."
)


class LlmExtractor:
    """An OpenAI-compatible chat model proposes the candidates. The episodes go to it in groups of
    one trust and one source kind, and each candidate keeps its group's trust and names an episode
    of its group (whose source the gate sees): a model that read injected tool output cannot
    launder it into a trusted rule, nor into one of another source. A model that fails or answers nonsense falls back to
    the deterministic extractor for that group."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str = "",
        timeout_s: float = 60.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), event_hooks=transport.hooks()
        )

    async def candidates(self, episodes: Sequence[Entry]) -> list[Candidate]:
        found: list[Candidate] = []
        groups: dict[tuple[str, str], list[Entry]] = {}
        for e in episodes:  # by trust and by source: a candidate names an episode of its group's kind
            trust = str(e.payload.get("source_trust") or "untrusted")
            groups.setdefault((trust, str(e.payload.get("source_kind") or "")), []).append(e)
        for (trust, _), group in sorted(groups.items()):
            found += await self._group(group, trust)
        return found

    async def _group(self, group: list[Entry], trust: str) -> list[Candidate]:
        episodes = "\n\n".join(f"[{i + 1}] {e.text}" for i, e in enumerate(group))
        try:
            response = await self._http.post(
                f"{self.url}/chat/completions",
                headers=self._headers,
                json={
                    "model": self.model,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": PROMPT},
                        {"role": "user", "content": episodes},
                    ],
                },
            )
            response.raise_for_status()
            content = response.json()["choices"][0]["message"]["content"]
            answer = json.loads(content[content.index("{") : content.rindex("}") + 1])
            proposed = [("semantic", t) for t in answer.get("facts", [])] + [
                ("procedural", t) for t in answer.get("rules", [])
            ]
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as exc:
            log.warning("the consolidation model failed (%s); using the rule extractor", type(exc).__name__)
            return [Candidate(c.tier, c.text, trust, c.source_id) for c in extract(group)]
        source = group[0].id
        return [
            Candidate(tier, " ".join(text.split())[:1000], trust, source)
            for tier, text in proposed[:20]
            if isinstance(text, str) and text.strip()
        ]

    async def aclose(self) -> None:
        await self._http.aclose()
