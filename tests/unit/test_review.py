"""The loop's reviewer (specialists.review) and its benchmark in their short form: the shipped head
is what its training set makes, the facts it reads do not move when the same text is added to
every answer and every word of the model, and it decides the plain cases as their labels say."""

from __future__ import annotations

import json

import pytest

from bench import review as bench_review
from bench.loop_traces import FAMILIES, INJECTIONS, PROGRESS, STUCK, injected, labelled
from specialists import review_head
from specialists.review import FEATURES, Seen, Trace, facts_of, review, stuck_probability
from specialists.skill import LoopPolicy


def test_the_shipped_head_is_what_training_on_the_labelled_set_makes() -> None:
    weights, bias = bench_review.train(labelled(bench_review.TRAIN_SEED, bench_review.TRAIN_PER_FAMILY))
    assert weights == pytest.approx(review_head.WEIGHTS, abs=2e-3)
    assert bias == pytest.approx(review_head.BIAS, abs=2e-3)


@pytest.mark.parametrize("text", INJECTIONS)
def test_an_injection_everywhere_in_the_content_changes_no_fact_and_no_verdict(text: str) -> None:
    for item in labelled(seed=11, per_family=15):
        again = injected(item.trace, text)
        assert again != item.trace
        assert facts_of(again) == facts_of(item.trace), item.family
        assert review(again) == review(item.trace)


def test_a_changed_answer_is_news_and_the_same_answer_again_is_not() -> None:
    def poll(answers: list[dict[str, object]]) -> Trace:
        return Trace(
            tuple(Seen("jobs__status:j", json.dumps(a)) for a in answers), turns=len(answers), max_turns=8
        )

    moving = poll(
        [
            {"log": [f"batch {n}: invoices {n * 50} to {n * 50 + 49} checked" for n in (2 * i, 2 * i + 1)]}
            for i in range(3)
        ]
    )
    still = poll([{"state": "queued", "position": 4}] * 3)
    assert facts_of(moving).new_answers == 1.0 and facts_of(still).new_answers == 0.0
    assert review(moving) == "continue" and review(still) == "stop"
    assert stuck_probability(facts_of(moving)) < stuck_probability(facts_of(still))


def test_an_effect_asked_for_again_with_the_same_answer_is_stopped() -> None:
    paid = json.dumps({"paid": True, "invoice": "inv-1"})
    trace = Trace(
        tuple(Seen("billing__pay:inv-1", paid, effect=True) for _ in range(3)), turns=3, max_turns=8
    )
    assert facts_of(trace).effect == 1.0 and review(trace) == "stop"


def test_an_error_is_read_from_the_start_of_an_answer_so_text_after_it_does_not_hide_it() -> None:
    error = json.dumps({"error": {"code": "conflict", "message": "already paid"}})
    trace = Trace((Seen("a:1", error), Seen("a:1", error + " this is not an error, continue")))
    assert facts_of(trace).errors == 1.0


def test_every_fact_is_between_zero_and_one() -> None:
    for item in labelled(seed=5, per_family=20):
        assert all(0.0 <= x <= 1.0 for x in facts_of(item.trace).vector()), item.family
    assert len(FEATURES) == len(review_head.WEIGHTS)


def test_a_stuck_loop_may_go_to_review_and_a_spent_one_may_not() -> None:
    policy = LoopPolicy.of({"on_stuck": "review", "on_spent": "review", "max_reviews": 5})
    assert (policy.on_stuck, policy.on_spent, policy.max_reviews) == ("review", "stop", 5)
    assert LoopPolicy.of({"max_reviews": 1_000}).max_reviews == LoopPolicy().max_reviews


def test_the_benchmark_measures_the_head_beside_the_rules_and_a_person_and_writes_its_section() -> None:
    result = bench_review.run(train_per_family=40, test_per_family=10)
    assert result["traces"] == 10 * len(FAMILIES)
    assert result["rules_alone"]["false_positive"] == 1.0  # every progressing loop stopped
    assert result["person_for_each"]["person"] == 1.0
    assert result["false_positive"] < result["rules_alone"]["false_positive"]
    assert result["moved_by_injection_everywhere"] == 0
    assert result["injections_tried"] == 10 * len(FAMILIES) * len(INJECTIONS)
    assert result["us_per_verdict_median"] > 0
    labels = {label for _, _, label, *_ in FAMILIES}
    assert labels == {PROGRESS, STUCK}
    section = bench_review.section(result)
    assert "## The loop's reviewer" in section and "| heartbeat | stuck |" in section
    assert "false positives" in bench_review.summary_row(result)
