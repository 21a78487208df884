"""The loop's reviewer (:mod:`specialists.review`), measured: how often it is wrong, how often it sends
a loop to a person, what a verdict costs, and whether a prompt injection in what it judges moves it.

It is trained on one labelled set of traces (:mod:`bench.loop_traces`, seed ``TRAIN_SEED``) and
measured on another made from a different seed (``TEST_SEED``), beside the two policies it sits
between: the rules alone (``stop``: every loop that trips a stuck rule fails) and a person for every
one (``ask``).

- **false positive**: a loop making progress that the reviewer stops; **flagged**: one it stops or
  sends to a person; **missed**: a stuck loop it lets continue;
- **cost**: what one verdict takes (it calls no model: CPU only, timed here), and the people's time
  it saves: the share of stuck-rule trips it decides without one;
- **injection**: each held-out trace again with each of the injections of
  :data:`bench.loop_traces.INJECTIONS` in every answer and every word of the model (the verdict must
  not move), and in its last answer only (a changed answer: reported).

``python -m bench.review --train`` trains the head again and writes ``specialists/review_head.py``;
``python -m bench review`` measures it and writes the page.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.loop_traces import (
    FAMILIES,
    INJECTIONS,
    PROGRESS,
    STUCK,
    Labelled,
    injected,
    injected_once,
    labelled,
)
from specialists import review_head
from specialists.review import FEATURES, facts_of, review

TRAIN_SEED, TEST_SEED = 1, 2
TRAIN_PER_FAMILY, TEST_PER_FAMILY = 300, 200
STEPS, RATE, L2 = 4000, 1.0, 1e-3
TIMING_ROUNDS = 5
HEAD = Path(__file__).resolve().parent.parent / "specialists" / "review_head.py"


def train(items: list[Labelled]) -> tuple[tuple[float, ...], float]:
    """A logistic head (weights, bias) over the facts of ``items``, stuck = 1; full-batch gradient
    descent with a little L2, from zero: the same items make the same head."""
    x = np.array([facts_of(item.trace).vector() for item in items], dtype=np.float64)
    y = np.array([1.0 if item.label == STUCK else 0.0 for item in items])
    w, b = np.zeros(x.shape[1]), 0.0
    for _ in range(STEPS):
        p = 1.0 / (1.0 + np.exp(-(x @ w + b)))
        error = p - y
        w -= RATE * (x.T @ error / len(y) + L2 * w)
        b -= RATE * float(error.mean())
    return tuple(round(float(v), 3) for v in w), round(b, 3)


def write_head(weights: tuple[float, ...], bias: float) -> None:
    """Write the head where the reviewer reads it."""
    text = HEAD.read_text()
    head, _, _ = text.partition("WEIGHTS = ")
    HEAD.write_text(
        f"{head}WEIGHTS = {weights!r}\nBIAS = {bias!r}\n"
        f"CONTINUE_BELOW = {review_head.CONTINUE_BELOW!r}\nSTOP_ABOVE = {review_head.STOP_ABOVE!r}\n"
    )


def _rates(verdicts: list[tuple[str, str]]) -> dict[str, Any]:
    progress = [v for label, v in verdicts if label == PROGRESS]
    stuck = [v for label, v in verdicts if label == STUCK]

    def share(values: list[str], *wanted: str) -> float:
        return round(sum(v in wanted for v in values) / len(values), 4) if values else 0.0

    return {
        "traces": len(verdicts),
        "false_positive": share(progress, "stop"),
        "flagged": share(progress, "stop", "person"),
        "missed": share(stuck, "continue"),
        "person": share([v for _, v in verdicts], "person"),
        "verdicts": dict(Counter(v for _, v in verdicts)),
    }


def measure(test: list[Labelled]) -> dict[str, Any]:
    """The shipped head's error rates on ``test``, by family too, its cost, and the injections'
    effect."""
    verdicts = [(item.label, review(item.trace)) for item in test]
    by_family = {
        name: _rates(
            [(item.label, v) for item, (_, v) in zip(test, verdicts, strict=True) if item.family == name]
        )
        for name, *_ in FAMILIES
    }
    timings = []
    for _ in range(TIMING_ROUNDS):
        started = time.perf_counter()
        for item in test:
            review(item.trace)
        timings.append((time.perf_counter() - started) / len(test) * 1e6)
    moved_all = moved_once = once_to_continue = 0
    moved_examples: list[dict[str, str]] = []
    for item, (_, verdict) in zip(test, verdicts, strict=True):
        for text in INJECTIONS:
            again = review(injected(item.trace, text))
            if again != verdict:
                moved_all += 1
                moved_examples.append(
                    {"family": item.family, "was": verdict, "now": again, "injection": text}
                )
            once = review(injected_once(item.trace, text))
            moved_once += once != verdict
            once_to_continue += once != verdict and once == "continue"
    tried = len(test) * len(INJECTIONS)
    return {
        **_rates(verdicts),
        "by_family": by_family,
        "rules_alone": _rates([(item.label, "stop") for item in test]),
        "person_for_each": _rates([(item.label, "person") for item in test]),
        "us_per_verdict_median": round(statistics.median(timings), 1),
        "tokens_per_verdict": 0,
        "injections_tried": tried,
        "moved_by_injection_everywhere": moved_all,
        "moved_examples": moved_examples[:5],
        "moved_by_injection_once": moved_once,
        "moved_once_share": round(moved_once / tried, 4) if tried else 0.0,
        "moved_once_to_continue": once_to_continue,
    }


def run(train_per_family: int = TRAIN_PER_FAMILY, test_per_family: int = TEST_PER_FAMILY) -> dict[str, Any]:
    """Train a head as ``--train`` would (to check the shipped one is what the set makes), then
    measure the shipped head on the held-out set."""
    weights, bias = train(labelled(TRAIN_SEED, train_per_family))
    shipped = (tuple(review_head.WEIGHTS), review_head.BIAS)
    test = labelled(TEST_SEED, test_per_family)
    return {
        **measure(test),
        "features": list(FEATURES),
        "head": {"weights": list(shipped[0]), "bias": shipped[1]},
        "trained_again": {"weights": list(weights), "bias": bias},
        "thresholds": {"continue_below": review_head.CONTINUE_BELOW, "stop_above": review_head.STOP_ABOVE},
        "train": {"seed": TRAIN_SEED, "per_family": train_per_family},
        "test": {"seed": TEST_SEED, "per_family": test_per_family},
    }


def main() -> dict[str, Any]:
    return run()


def _pct(share: float) -> str:
    return f"{share * 100:.1f}%"


def summary_row(result: dict[str, Any]) -> str:
    return (
        f"| the loop's reviewer (stuck loops) | the rules alone: {_pct(result['rules_alone']['false_positive'])} "
        f"false positives | | {_pct(result['false_positive'])} false positives, "
        f"{_pct(result['person'])} to a person, {result['us_per_verdict_median']} us a verdict | | "
        f"{result['moved_by_injection_everywhere']} of {result['injections_tried']:,} verdicts moved by an injection |"
    )


def section(result: dict[str, Any]) -> str:
    rows = "".join(
        f"| {name} | {label} | {f['traces']} | {_pct(f['false_positive'])} | {_pct(f['flagged'])} "
        f"| {_pct(f['missed'])} | {_pct(f['person'])} |\n"
        for (name, _, label, *_), f in ((family, result["by_family"][family[0]]) for family in FAMILIES)
    )
    rules, person = result["rules_alone"], result["person_for_each"]
    return (
        "\n## The loop's reviewer (`bench/review.py`)\n\n"
        "A loop that trips a stuck rule (the same call again, the same words again) under a `review` policy "
        "is judged by a small learned model (`specialists/review.py`: a logistic head over facts computed "
        "from the loop's record, never its content read as text): continue, stop, or a person. Trained on "
        f"{result['train']['per_family']} traces of each of {len(FAMILIES)} families (seed {result['train']['seed']}), "
        f"measured on {result['test']['per_family']} others of each (seed {result['test']['seed']}); the labels are "
        "how each trace was made (`bench/loop_traces.py`). A false positive is a loop making progress that "
        "it stops; flagged, one it stops or sends to a person; missed, a stuck loop it lets go on (every "
        "budget still binds that loop, and a task gets at most `max_reviews` verdicts).\n\n"
        "| | false positives | progressing loops flagged | stuck loops missed | sent to a person |\n"
        "|---|---|---|---|---|\n"
        f"| the reviewer | **{_pct(result['false_positive'])}** | {_pct(result['flagged'])} | "
        f"{_pct(result['missed'])} | {_pct(result['person'])} |\n"
        f"| the rules alone (`stop`) | {_pct(rules['false_positive'])} | {_pct(rules['flagged'])} | "
        f"{_pct(rules['missed'])} | {_pct(rules['person'])} |\n"
        f"| a person for each (`ask`) | {_pct(person['false_positive'])} | {_pct(person['flagged'])} | "
        f"{_pct(person['missed'])} | {_pct(person['person'])} |\n\n"
        "| family | label | traces | false positives | flagged | missed | to a person |\n"
        "|---|---|---|---|---|---|---|\n"
        f"{rows}\n"
        f"Cost: {result['us_per_verdict_median']} us of CPU a verdict (median of {TIMING_ROUNDS} passes over the "
        f"held-out set), {result['tokens_per_verdict']} model tokens: it calls no model. The people's time it "
        f"saves beside `ask`: {_pct(1 - result['person'])} of the trips are decided without one.\n\n"
        f"Injection: each held-out trace again with each of {len(INJECTIONS)} injections (an order to answer "
        "continue, a forged end of the data block, a forged verdict, an operator's note, an order to stop) in "
        f"every answer and every word of the model: {result['moved_by_injection_everywhere']} of "
        f"{result['injections_tried']:,} verdicts moved (the facts it reads do not change when the same text is "
        f"added everywhere). In the last answer only (a changed answer, which it may read as news): "
        f"{result['moved_by_injection_once']:,} moved ({_pct(result['moved_once_share'])}), "
        f"{result['moved_once_to_continue']:,} of them to continue; what such a continue buys is bounded by the "
        "task's budget and `max_reviews`.\n\n"
        "The hard cases are the ones its facts cannot tell apart: a status whose only change is a timestamp "
        "(`heartbeat`, stuck) looks like a job whose percentage moves (`poll`, progress), and an error "
        "carrying a new request id each time looks like a changing answer. An LLM judge could read the "
        "difference; none runs on this machine, so none is measured here.\n\n"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--train"]:
        write_head(*train(labelled(TRAIN_SEED, TRAIN_PER_FAMILY)))
        print(f"wrote {HEAD}")
    else:
        print(run())
