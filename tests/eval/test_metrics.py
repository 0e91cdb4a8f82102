"""Tests for `opd.eval.metrics`: pass@k against brute force, maj@k voting, summarize on known numbers."""

import itertools
import math

import pytest

from opd.eval.metrics import ProblemResult, SampleResult, maj_at_k, majority_answer, pass_at_k, summarize


def brute_force_pass_at_k(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(16, 0, 1) == 0.0
    assert pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(16, 1, 16) == 1.0
    assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_pass_at_k_large_n_is_stable():
    # C(1000, 500) overflows a float; the product form does not need it
    exact = 1 - math.comb(1000 - 3, 500) / math.comb(1000, 500)
    assert pass_at_k(1000, 3, 500) == pytest.approx(exact, rel=1e-12)
    assert 0.0 <= pass_at_k(100_000, 1, 7) <= 1.0


@pytest.mark.parametrize(
    "args, name",
    [
        ((5, 2, 6), "k"),
        ((5, 2, 0), "k"),
        ((5, 6, 1), "c"),
        ((5, -1, 1), "c"),
        ((-1, 0, 1), "n"),
        ((0, 0, 1), "n"),
        ((5.0, 2, 1), "n"),
        ((5, 2, True), "k"),
    ],
)
def test_pass_at_k_rejects_bad_arguments_by_name(args, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        pass_at_k(*args)


def test_majority_groups_equivalent_answers_and_ignores_none():
    assert majority_answer(["0.5", "\\frac12", "3", "1/2", "3"]) == "0.5"  # 3 vs 2 votes after grouping
    assert majority_answer([None, None, "7"]) == "7"  # None never wins over a real answer
    assert majority_answer([None, None]) is None
    assert majority_answer([]) is None
    assert majority_answer(["x = 3", "3", "4"]) == "x = 3"


def test_majority_ties_go_to_the_first_seen_answer():
    assert majority_answer(["4", "3", "3", "4"]) == "4"
    assert majority_answer(["3", "4", "4", "3"]) == "3"
    assert majority_answer(["a", "b", "c"]) == "a"
    assert majority_answer(["a", "b"], key=lambda s: "same") == "a"


def test_maj_at_k():
    answers = ["5", "4", "4", None, "5", "5"]
    correct = [True, False, False, False, True, True]
    assert maj_at_k(answers, correct, 1)  # only "5"
    assert not maj_at_k(answers, correct, 3)  # "4" twice
    assert not maj_at_k(answers, correct, 4)
    assert maj_at_k(answers, correct, 6)  # "5" three times
    assert not maj_at_k([None, None], [False, False], 2)
    # the winning group is correct if any member was (equivalent answers, one grade timed out)
    assert maj_at_k(["\\frac12", "0.5", "7"], [False, True, False], 3)
    with pytest.raises(ValueError, match="k must be"):
        maj_at_k(["1"], [True], 2)
    with pytest.raises(ValueError, match="same length"):
        maj_at_k(["1"], [True, False], 1)


def S(correct, answer, tokens=10, truncated=False):
    return SampleResult(correct=correct, extracted=answer, num_tokens=tokens, truncated=truncated)


def test_summarize_on_crafted_results():
    problems = [
        # A/p1: 2 of 4 correct; "1" and "2" tie with 2 votes, "1" is seen first and is wrong
        ProblemResult("A", [S(False, "1", 10), S(True, "2", 20), S(False, "1", 30), S(True, "2", 40, True)], "p1"),
        # A/p2: 0 of 4 correct, one response without an answer
        ProblemResult(
            "A", [S(False, None, 100, True), S(False, "9", 100), S(False, "9", 100), S(False, "8", 100)], "p2"
        ),
        # A/p3: 4 of 4 correct
        ProblemResult("A", [S(True, "0.5"), S(True, "\\frac12"), S(True, "1/2"), S(True, "0.5")], "p3"),
        # B: n = 1
        ProblemResult("B", [S(True, "3", 7)], "q1"),
        ProblemResult("B", [S(False, None, 9, True)], "q2"),
    ]
    out = summarize(problems)
    assert list(out) == ["A", "B"]
    a = out["A"]
    assert a["num_problems"] == 3 and a["num_samples"] == 12 and a["n"] == 4
    assert a["avg@4"] == pytest.approx(6 / 12)
    assert a["pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert a["pass@2"] == pytest.approx(((1 - 1 / 6) + 0 + 1) / 3)  # p1: 1 − C(2,2)/C(4,2)
    assert a["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert set(k for k in a if k.startswith("pass@")) == {"pass@1", "pass@2", "pass@4"}
    assert a["maj@4"] == pytest.approx(1 / 3)  # p1 tie → "1" (wrong); p2 "9" wrong; p3 right
    assert a["mean_response_tokens"] == pytest.approx((100 + 400 + 40) / 12)
    assert a["truncation_rate"] == pytest.approx(2 / 12)
    b = out["B"]
    assert b == {
        "num_problems": 2,
        "num_samples": 2,
        "n": 1,
        "avg@1": 0.5,
        "pass@1": 0.5,
        "maj@1": 0.5,
        "mean_response_tokens": 8.0,
        "truncation_rate": 0.5,
    }


def test_summarize_pass_at_k_ladder_includes_n():
    out = summarize([ProblemResult("X", [S(i == 0, str(i)) for i in range(6)])])["X"]
    assert [k for k in out if k.startswith("pass@")] == ["pass@1", "pass@2", "pass@4", "pass@6"]
    assert out["pass@6"] == 1.0 and out["pass@1"] == pytest.approx(1 / 6)


def test_summarize_rejects_mixed_n_and_empty_problems():
    with pytest.raises(ValueError, match="mixes sample counts"):
        summarize([ProblemResult("X", [S(True, "1")]), ProblemResult("X", [S(True, "1"), S(True, "1")])])
    with pytest.raises(ValueError, match="no samples"):
        summarize([ProblemResult("X", [], "p0")])
    assert summarize([]) == {}
