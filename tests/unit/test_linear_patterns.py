"""Every regular expression of the fleet's code runs in linear time on adversarial text.

The patterns are enumerated from the code, not listed by hand: every compiled pattern a module of the
fleet's packages holds (in a module global, or a dict, list or tuple of them), every pattern written
inline in a call such as ``re.sub(r"\\D", ...)``, and every pattern of the recognizers the memory
scanner runs (presidio's and the fleet's own, compiled with presidio's engine and flags). Most of them
read caller, tool or model text; holding all of them to linear time means a new pattern is covered
without anyone deciding whether it reads such text.

For each pattern the adversarial input is generated from the pattern itself: runs of each character
and character pair its loops read, and runs of prefixes of texts it matches (``"eyJ"``, ``"a://"``,
``"-----BEGIN RSA PRIVATE KEY-----"``, ``"4111 "``). The shape that costs most on a short text is then
timed on 250 KB, 500 KB, 1 MB and 2 MB, in turns, the least of the runs of each (one, and more while
the growth looks too high: a pause of a loaded machine only ever adds time, so it can make a pattern
look worse and be measured again, never better than it is; one that slows one small size lowers
one doubling and raises the next, and the median still sees a steady quadratic): linear time
costs about twice as much on each doubling, quadratic time four times. The test holds the median of
the three doublings: where a backtracking engine's stack (tens of bytes per character) outgrows one of
the CPU's caches, one doubling of a linear scan can cost 3 to 9 times more, but never two in a row
(the caches are 16 times apart); a single pair of sizes, or 100 KB against 1 MB, reads that step, or
one pause of a loaded machine, as superlinear. A time on 100 KB first fails at once a pattern far too
slow to wait for on 1 MB.
Each measurement runs in a forked child with a deadline, so an exponential pattern fails the test
instead of hanging it.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import multiprocessing
import pkgutil
import re
import re._constants as sre
import re._parser as sre_parse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import regex

# About two minutes of CPU: in the full suite (and CI), not in the fast tier a developer runs on every
# change; run it after changing a pattern (`.venv/bin/pytest tests/unit/test_linear_patterns.py`).
pytestmark = pytest.mark.measure

PACKAGES = ("fleet", "coordinator", "memory", "mcp_servers", "registry", "specialists", "policy")
ROOT = Path(__file__).resolve().parents[2]
SMALL = 100_000
SIZES = (250_000, 500_000, 1_000_000, 2_000_000)
LARGE = 1_000_000  # the size the cost is held to MAX_LARGE_S on
MAX_GROWTH = 2.8  # median cost ratio of a doubling: linear about 2, quadratic about 4 (exponent 1.5)
ROUNDS, MAX_ROUNDS = 1, 4  # turns of the sizes; more when the growth looks too high
MAX_LARGE_S = 20.0  # 1 MB on a loaded 2-core machine; the slowest linear pattern takes about 3 s alone
DEADLINE_S = 240.0  # the whole measurement of one pattern, in its child process
_POOL = " \n\t-./:@=_+,;'\"aA1z0#[]()<>*"


@dataclass(frozen=True, slots=True)
class Case:
    """One pattern of the code, as its module compiles it."""

    where: str
    pattern: str
    flags: int
    engine: str  # "re" or "regex"

    def compiled(self) -> Any:
        return (re if self.engine == "re" else regex).compile(self.pattern, self.flags)


# -------------------------------------------------------------------------------- enumeration
def _modules() -> Iterator[Any]:
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if not info.name.endswith("__main__"):  # runs the CLI when imported
                yield importlib.import_module(info.name)


def _held(value: Any, depth: int = 0) -> Iterator[Any]:
    if isinstance(value, re.Pattern | regex.Pattern):
        yield value
    elif depth < 2 and isinstance(value, dict):
        for item in value.values():
            yield from _held(item, depth + 1)
    elif depth < 2 and isinstance(value, list | tuple | frozenset):
        for item in value:
            yield from _held(item, depth + 1)


def _inline(module: Any) -> Iterator[Case]:
    """Patterns written as a literal in a call of ``re`` or ``regex`` anywhere in the module."""
    source = Path(module.__file__).read_text()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("re", "regex")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            where = f"{module.__name__}:{node.lineno}"
            yield Case(where, node.args[0].value, 0, node.func.value.id)


def _scanner_cases() -> Iterator[Case]:
    from presidio_analyzer import PatternRecognizer

    from memory.scan import Scanner

    for recognizer in Scanner()._analyzer.registry.recognizers:
        if isinstance(recognizer, PatternRecognizer):
            flags = recognizer.global_regex_flags or 0
            for p in recognizer.patterns:
                where = f"scanner:{type(recognizer).__name__}:{p.name}"
                yield Case(where, p.regex, flags, "regex")


def cases() -> list[Case]:
    found: dict[tuple[str, int, str], Case] = {}
    for module in _modules():
        for name, value in vars(module).items():
            for p in _held(value):
                engine = "re" if isinstance(p, re.Pattern) else "regex"
                case = Case(f"{module.__name__}.{name}", p.pattern, p.flags, engine)
                found.setdefault((case.pattern, case.flags, engine), case)
        for case in _inline(module):
            found.setdefault((case.pattern, case.flags, case.engine), case)
    for case in _scanner_cases():
        found.setdefault((case.pattern, case.flags, case.engine), case)
    return sorted(found.values(), key=lambda c: c.where)


# ------------------------------------------------------------------------- adversarial inputs
def _class_chars(items: list[tuple[Any, Any]]) -> list[str]:
    negate, ranges = False, []
    for op, av in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            ranges.append((av, av))
        elif op in (sre.RANGE, sre.RANGE_UNI_IGNORE, sre.CATEGORY):
            ranges.append(av)
    if negate:
        return [c for c in _POOL if not _in_class(c, ranges)][:8]
    out: list[str] = []
    for r in ranges:
        if isinstance(r, tuple):
            out += sorted({chr(r[0]), chr(r[1]), chr((r[0] + r[1]) // 2)})
        else:
            out += [c for c in _POOL if _in_class(c, [r])][:3]
    return out


def _in_class(c: str, ranges: list[Any]) -> bool:
    tests = {
        sre.CATEGORY_DIGIT: str.isdigit,
        sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
        sre.CATEGORY_SPACE: str.isspace,
        sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
        sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
        sre.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
    }
    for r in ranges:
        if isinstance(r, tuple) and r[0] <= ord(c) <= r[1]:
            return True
        if not isinstance(r, tuple) and r in tests and tests[r](c):
            return True
    return False


def _chars(seq: Any, acc: set[str]) -> None:
    """The characters ``seq`` reads anywhere (loops, alternatives and assertions included)."""
    for op, av in seq:
        if op is sre.LITERAL:
            acc.add(chr(av))
        elif op is sre.NOT_LITERAL:
            acc.update(c for c in _POOL[:6] if ord(c) != av)
        elif op is sre.IN:
            acc.update(_class_chars(av))
        elif op is sre.ANY:
            acc.add("a")
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            _chars(av[2], acc)
        elif op is sre.SUBPATTERN:
            _chars(av[3], acc)
        elif op is sre.ATOMIC_GROUP:
            _chars(av, acc)
        elif op is sre.BRANCH:
            for branch in av[1]:
                _chars(branch, acc)
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            _chars(av[1], acc)


def _witnesses(seq: Any, once: bool, limit: int = 24) -> list[str]:
    """Short texts ``seq`` (nearly) matches: each loop taken its least number of times (at least
    once with ``once``), each alternative in turn; assertions are left out."""
    outs = [""]
    for op, av in seq:
        alts: list[str]
        if op is sre.LITERAL:
            alts = [chr(av)]
        elif op is sre.NOT_LITERAL:
            alts = [next(c for c in "a1 -" if ord(c) != av)]
        elif op is sre.IN:
            alts = (_class_chars(av) or ["a"])[:1]
        elif op is sre.ANY:
            alts = ["a"]
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            n = min(max(av[0], 1) if once else av[0], 40)
            alts = [w * n for w in _witnesses(av[2], once, 4)] if n else [""]
        elif op is sre.SUBPATTERN:
            alts = _witnesses(av[3], once, 8)
        elif op is sre.ATOMIC_GROUP:
            alts = _witnesses(av, once, 8)
        elif op is sre.BRANCH:
            alts = [w for branch in av[1] for w in _witnesses(branch, once, 4)]
        else:
            alts = [""]
        outs = [o + a for o, a in itertools.product(outs, alts)][:limit]
    return outs


def units(case: Case) -> list[str]:
    """Strings whose long repetition may make the pattern loop: single characters and pairs it reads,
    and prefixes of texts it matches."""
    tree = sre_parse.parse(case.pattern, case.flags & ~re.VERBOSE)
    acc: set[str] = {" ", "a", "1"}
    _chars(tree, acc)
    chars = sorted(acc)
    found = [*chars, *(a + b for a in chars for b in chars if a != b and not b.isalnum())]
    for once in (False, True):
        for w in _witnesses(tree, once):
            found += [w[:n] for n in range(2, min(len(w), 48) + 1)]
    return list(dict.fromkeys(u for u in found if u))


def _text(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def _cost(compiled: Any, text: str) -> float:
    start = time.perf_counter()
    for _ in compiled.finditer(text):
        pass
    return time.perf_counter() - start


# --------------------------------------------------------------------------------- measurement
def growth(times: list[float]) -> float:
    """The median ratio of the cost of one size to the cost of half of it."""
    ratios = sorted(later / max(earlier, 1e-6) for earlier, later in itertools.pairwise(times))
    return ratios[len(ratios) // 2]


def _measure(case: Case) -> tuple[str, float, list[float]]:
    """The costliest unit of ``case``, and the time its runs take on SMALL characters and on SIZES."""
    compiled = case.compiled()
    # Twice each, the least: one pause of a loaded machine must not hide the costly shape.
    screened = sorted(
        ((min(_cost(compiled, _text(u, 2_000)) for _ in range(2)), u) for u in units(case)), reverse=True
    )
    worst = max((_cost(compiled, _text(u, 20_000)), u) for _, u in screened[:8])[1]
    small = _cost(compiled, _text(worst, SMALL))
    times = [float("inf")] * len(SIZES)
    if small * (LARGE / SMALL) > MAX_LARGE_S * 2:  # already far too slow: do not wait for 1 MB
        return worst, small, times
    small = min(small, *(_cost(compiled, _text(worst, SMALL)) for _ in range(2)))
    for round_ in range(MAX_ROUNDS):
        # In turns, so that a busy stretch of the machine slows all sizes, not one of them.
        for i, size in enumerate(SIZES):
            times[i] = min(times[i], _cost(compiled, _text(worst, size)))
            if times[i] > MAX_LARGE_S:
                return worst, small, times
        if round_ + 1 >= ROUNDS and growth(times) < MAX_GROWTH:
            break
    return worst, small, times


def _child(case: Case, conn: Connection) -> None:
    conn.send(_measure(case))
    conn.close()


def measure(case: Case) -> tuple[str, float, list[float]]:
    """:func:`_measure` in a forked child, which is killed at the deadline (an exponential pattern
    does not return, and ``re`` cannot be interrupted)."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(case, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(DEADLINE_S):
            return "?", float("inf"), [float("inf")] * len(SIZES)
        result: tuple[str, float, list[float]] = receive.recv()
        return result
    finally:
        child.kill()
        child.join(5)
        receive.close()


CASES = cases()


def test_the_patterns_of_the_code_are_found() -> None:
    """The enumeration reaches redaction, the scanner's recognizers, inline and nested patterns."""
    where = {c.where for c in CASES}
    assert {
        "fleet.redact._SECRET_TEXT",
        "fleet.redact._SECRET_AFTER",
        "mcp_servers.sql.server._FIRST_WORD",
    } <= where
    assert "fleet.approvals.BINDING_FIELDS" in where  # a dict of patterns
    assert any(w.startswith("memory.scan:") for w in where)  # re.sub(r"\D", ...) in _dialable
    assert any(w.startswith("scanner:_SecretValue:password") for w in where)
    assert any(w.startswith("scanner:CreditCardRecognizer") for w in where)
    assert len(CASES) > 60


def test_the_median_doubling_passes_one_cache_step_and_fails_steady_superlinear_growth() -> None:
    assert growth([0.004, 0.0084, 0.062, 0.12]) < MAX_GROWTH  # fleet.events._WIRE_SUBJECT, measured
    assert growth([0.001, 0.0021, 0.0043, 0.03]) < MAX_GROWTH
    assert growth([0.01, 0.04, 0.16, 0.64]) >= MAX_GROWTH  # quadratic
    assert growth([0.01, 0.028, 0.08, 0.23]) >= MAX_GROWTH  # exponent 1.5


def test_the_measure_fails_the_quadratic_pattern_redaction_once_had() -> None:
    """``fleet/redact.py``'s URL scheme, as it was (with ``re``): 5.7 s on 80 K characters of ``"a"``."""
    unit, small, times = measure(Case("old _SECRET_AFTER", r"[a-z][a-z0-9+.-]*://", 0, "re"))
    assert not times[SIZES.index(LARGE)] < MAX_LARGE_S, (unit, small, times)


@pytest.mark.parametrize("case", CASES, ids=[c.where for c in CASES])
def test_pattern_runs_in_linear_time_on_its_adversarial_input(case: Case) -> None:
    unit, small, times = measure(case)
    costs = ", ".join(f"{t:.3f} s on {n // 1000} KB" for n, t in zip(SIZES, times, strict=True))
    shape = f"{case.where} on runs of {unit!r}: {small:.3f} s on {SMALL // 1000} KB, {costs}"
    assert small < float("inf"), f"{case.where}: no answer within {DEADLINE_S:.0f} s"
    assert times[SIZES.index(LARGE)] < MAX_LARGE_S, shape
    assert growth(times) < MAX_GROWTH, shape
