"""The embedded Rego engine (regorus, a Rust implementation of Rego v1).

A regorus engine must be used from the thread that created it, so this class creates one per thread
on first use. Evaluation is ~25 microseconds, cheap enough to run inline on the event loop.

It must also be dropped by that thread: regorus refuses to drop it elsewhere (it leaks and reports
an error), and the garbage collector may collect a :class:`RegorusEngine` on any thread that
happens to allocate (an embedding or a scanning thread). So a collected engine's per-thread engines
of other threads are handed to those threads, which drop them on their next evaluation; a thread
that ends drops its own, as thread-local values are.

A bundle is a pure function of its input unless it calls a builtin whose answer changes (the time,
randomness, HTTP, the runtime). For a pure bundle the engine remembers the results of the last
``MEMO_SIZE`` distinct inputs: a repeated input gets the same result without evaluating again, as a
new decision (its own id, logged like any other). A bundle that names such a builtin anywhere is
evaluated every time.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from typing import Any

from policy._bundle import Bundle
from policy.engine import Decision
from policy.errors import PolicyError, PolicyQueryError

log = logging.getLogger(__name__)

MEMO_SIZE = 4096
# Builtins whose answer is not a function of the input and the bundle (OPA's non-deterministic ones).
_IMPURE = re.compile(
    r"\b(time\.now_ns|rand\.|uuid\.|http\.send|opa\.runtime|net\.lookup|io\.jwt\.decode_verify|crypto\.x509)"
)


def is_pure(bundle: Bundle) -> bool:
    """Whether every decision of ``bundle`` depends on its input alone (no impure builtin named)."""
    return not any(_IMPURE.search(source) for _, source in bundle.policies)


def _new_engine(bundle: Bundle, with_tests: bool) -> Any:
    import regorus

    engine = regorus.Engine()
    try:
        for name, source in bundle.modules if with_tests else bundle.policies:
            engine.add_policy(name, source)
        engine.add_data(bundle.data)
    except RuntimeError as exc:
        raise PolicyError(f"bundle {bundle.root} does not compile: {_first_line(exc)}") from exc
    return engine


_UNKNOWN = object()


class _ThreadGuard:
    """Kept in a thread's local storage: when the thread ends, it drops that thread's engine there."""

    __slots__ = ("engines", "ident")

    def __init__(self, engines: dict[int, Any], ident: int) -> None:
        self.engines, self.ident = engines, ident

    def __del__(self) -> None:
        if threading.get_ident() == self.ident:  # not when the collector frees it elsewhere
            self.engines.pop(self.ident, None)


# Engines whose RegorusEngine was collected on another thread, by the thread that must drop them.
# Plain dict and list operations (atomic under the GIL): a finaliser may run in the middle of any
# code, a lock could deadlock there.
_ORPHANS: dict[int, list[Any]] = {}


def _drop_orphans() -> None:
    """Drop the engines handed to this thread (it created them)."""
    if _ORPHANS:
        _ORPHANS.pop(threading.get_ident(), None)


QUERY_SOURCE = "--> <query.rego>"  # where regorus places an error in the query's own text


def _first_line(exc: BaseException) -> str:
    text = str(exc).split("\n\nStack backtrace")[0].strip()
    return " ".join(line.strip() for line in text.splitlines()[:4])


class RegorusEngine:
    """An in-process :class:`~policy.engine.PolicyEngine` over one bundle."""

    def __init__(self, bundle: Bundle, *, with_tests: bool = False) -> None:
        """``with_tests`` also loads the ``*_test.rego`` modules (only the test runner wants them)."""
        self._bundle = bundle
        self._with_tests = with_tests
        self._local = threading.local()
        self._engines: dict[int, Any] = {}  # by thread
        self._memo: dict[tuple[str, str], Any] | None = {} if is_pure(bundle) else None
        self._memo_lock = threading.Lock()
        self._engine()  # compile now so a broken bundle fails at start-up, not at first call

    @classmethod
    def from_dir(cls, root: Any = None) -> RegorusEngine:
        return cls(Bundle.load(root) if root else Bundle.load())

    @property
    def revision(self) -> str:
        return self._bundle.revision

    @property
    def bundle(self) -> Bundle:
        return self._bundle

    def ast_json(self) -> str:
        """The parsed modules of the bundle, as regorus reports them (used to discover tests)."""
        result: str = self._engine().get_ast_as_json()
        return result

    def raw_engine(self) -> Any:
        """This thread's regorus engine (e.g. to turn coverage on; only the test runner needs it)."""
        return self._engine()

    def _engine(self) -> Any:
        _drop_orphans()
        ident = threading.get_ident()
        engine = self._engines.get(ident)
        if engine is None:
            engine = self._engines[ident] = _new_engine(self._bundle, self._with_tests)
            self._local.guard = _ThreadGuard(self._engines, ident)
        return engine

    def __del__(self) -> None:
        here = threading.get_ident()
        for ident, engine in list(self._engines.items()):
            if ident != here:
                _ORPHANS.setdefault(ident, []).append(engine)  # kept alive for its own thread

    def evaluate(self, path: str, input_document: dict[str, Any]) -> Any:
        """The raw value of ``data.<path>`` for ``input_document`` (None if undefined)."""
        text = json.dumps(input_document)  # the same caller builds its input in the same key order
        memo = self._memo
        if memo is not None:
            known = memo.get((path, text), _UNKNOWN)
            if known is not _UNKNOWN:
                return json.loads(known)  # a fresh copy: a caller may change what it gets
        engine = self._engine()
        try:
            engine.set_input_json(text)
            result = engine.eval_rule_as_json(f"data.{path}")
        except RuntimeError as exc:
            raise PolicyError(f"cannot evaluate {path}: {_first_line(exc)}") from exc
        if memo is not None:
            with self._memo_lock:
                memo[(path, text)] = result
                if len(memo) > MEMO_SIZE:
                    del memo[next(iter(memo))]  # the oldest
        return json.loads(result)

    def query(self, query: str, input_document: dict[str, Any]) -> list[dict[str, Any]]:
        """The results of a whole Rego query (``x := data.fleet.tools.decision; x.allow``), as
        ``opa eval`` gives them: one per way the query holds, each with its ``expressions`` (their
        values) and ``bindings`` (its variables'); empty if it holds no way. A query that does not
        parse, or goes wrong in its own text, is :class:`PolicyQueryError`; anything else that goes
        wrong (in the bundle) is :class:`PolicyError`."""
        engine = self._engine()
        try:
            engine.set_input_json(json.dumps(input_document))
            answer = json.loads(engine.eval_query_as_json(query))
        except RuntimeError as exc:
            text = str(exc).split("\n\nStack backtrace")[0].strip()
            if text.startswith(QUERY_SOURCE):
                raise PolicyQueryError(f"the query is not valid Rego: {text}") from exc
            raise PolicyError(f"cannot evaluate the query: {_first_line(exc)}") from exc
        results = answer.get("result", [])
        return results if isinstance(results, list) else []

    async def decide(
        self, path: str, input_document: dict[str, Any], *, log_decision: bool = True
    ) -> Decision:
        """See :class:`~policy.engine.PolicyEngine` (evaluated inline: it takes microseconds)."""
        return self.decide_now(path, input_document, log_decision=log_decision)

    def decide_now(self, path: str, input_document: dict[str, Any], *, log_decision: bool = True) -> Decision:
        """:meth:`decide`, from synchronous code."""
        started = time.perf_counter()
        decision = decision_of(
            path, self.evaluate(path, input_document), self.revision, uuid.uuid4().hex, started
        )
        if log_decision:
            log.info(
                "decision %s %s allow=%s reasons=%s revision=%s",
                decision.decision_id,
                path,
                decision.allow,
                list(decision.reasons),
                decision.revision,
            )
        return decision


def decision_of(path: str, result: Any, revision: str, decision_id: str, started: float) -> Decision:
    """The decision a rule's ``result`` is, or :class:`PolicyError` if it is none (undefined, or
    not an object with a boolean ``allow``): whatever the engine, that fails closed."""
    if not isinstance(result, dict) or not isinstance(result.get("allow"), bool):
        raise PolicyError(f"{path} did not return a decision object with a boolean allow")
    reasons = result.get("reasons", [])
    return Decision(
        decision_id=decision_id,
        query=path,
        revision=revision,
        allow=result["allow"],
        reasons=tuple(str(r) for r in reasons) if isinstance(reasons, list) else (),
        result=result,
        latency_us=int((time.perf_counter() - started) * 1e6),
    )
