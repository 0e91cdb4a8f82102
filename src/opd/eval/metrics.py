"""Evaluation metrics over n graded samples per problem (SPEC §7): avg@n, pass@k, maj@k, lengths.

Pure functions, no I/O: `opd.eval.sampling` grades samples and writes files; this module only counts.
`pass_at_k` is the unbiased estimator of Chen et al. 2021 (HumanEval), `1 − C(n−c, k)/C(n, k)`, in its
product form. `maj@k` votes over the *first* k samples (not an estimator averaged over all k-subsets:
the benchmarks report maj@n, where the two coincide). Answers are grouped by `answer_key`
(normalised form, plain numbers canonicalised), not by pairwise symbolic equivalence, which would
cost O(k²) sympy calls per problem.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from opd.eval.grading import answer_key

__all__ = ["ProblemResult", "SampleResult", "maj_at_k", "majority_answer", "pass_at_k", "summarize"]


@dataclass(frozen=True)
class SampleResult:
    """One sampled response to one problem.

    correct:    the grade (`opd.eval.grading.grade(...).correct`).
    extracted:  the extracted answer, None when the response had none (it never wins a vote).
    num_tokens: response length in tokens (EOS included when generated), ≥ 0.
    truncated:  True when generation stopped at the token limit instead of at EOS.
    """

    correct: bool
    extracted: str | None = None
    num_tokens: int = 0
    truncated: bool = False


@dataclass(frozen=True)
class ProblemResult:
    """All n samples of one problem. `benchmark` names the set it belongs to (e.g. "AIME24")."""

    benchmark: str
    samples: Sequence[SampleResult]
    problem_id: str = ""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct.

    `1 − Π_{i=n−c+1}^{n} (1 − k/i)`, which equals `1 − C(n−c, k)/C(n, k)` without big binomials.
    Requires 1 ≤ k ≤ n and 0 ≤ c ≤ n; raises ValueError naming the bad argument otherwise.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _majority_group(answers: Sequence[str | None], key: Callable[[str], str]) -> list[int] | None:
    """Indices of the largest group of equivalent answers (ties: the group seen first); None if no answer."""
    groups: dict[str, list[int]] = {}  # insertion order = first-seen order, so max() breaks ties by it
    for i, answer in enumerate(answers):
        if answer is not None:
            groups.setdefault(key(answer), []).append(i)
    if not groups:
        return None
    return max(groups.values(), key=len)


def majority_answer(answers: Sequence[str | None], *, key: Callable[[str], str] = answer_key) -> str | None:
    """The most frequent answer (its first-seen spelling), grouping by `key`; None only if all are None."""
    group = _majority_group(answers, key)
    return None if group is None else answers[group[0]]


def maj_at_k(
    answers: Sequence[str | None], correct: Sequence[bool], k: int, *, key: Callable[[str], str] = answer_key
) -> bool:
    """Whether the majority answer among the first k samples is correct.

    answers[i] / correct[i] are sample i's extracted answer and grade. The winning group counts as
    correct if any member was graded correct (members are equivalent, so they differ only through a
    grading timeout). No answer at all → False.
    """
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct must have the same length, got {len(answers)} and {len(correct)}")
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must be in [1, {len(answers)}], got k={k}")
    group = _majority_group(answers[:k], key)
    return group is not None and any(correct[i] for i in group)


def _ks(n: int) -> list[int]:
    """1, 2, 4, … up to n, plus n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def summarize(problems: Iterable[ProblemResult]) -> dict[str, dict[str, float | int]]:
    """Per-benchmark metrics, keyed by benchmark name (in first-seen order).

    Each value holds: `num_problems`, `num_samples`, `n` (samples per problem), `avg@n` (mean
    accuracy), `pass@k` for k = 1, 2, 4, … ≤ n and k = n, `maj@n`, `mean_response_tokens` (over
    samples), `truncation_rate` (fraction of samples truncated). Accuracies are in [0, 1].
    Raises ValueError if a problem has no samples or a benchmark mixes different n.
    """
    by_benchmark: dict[str, list[ProblemResult]] = {}
    for p in problems:
        if not p.samples:
            raise ValueError(f"problem {p.problem_id!r} of benchmark {p.benchmark!r} has no samples")
        by_benchmark.setdefault(p.benchmark, []).append(p)

    out: dict[str, dict[str, float | int]] = {}
    for name, probs in by_benchmark.items():
        ns = {len(p.samples) for p in probs}
        if len(ns) != 1:
            raise ValueError(f"benchmark {name!r} mixes sample counts {sorted(ns)}; use the same n for every problem")
        n = ns.pop()
        samples = [s for p in probs for s in p.samples]
        num_correct = [sum(s.correct for s in p.samples) for p in probs]
        row: dict[str, float | int] = {
            "num_problems": len(probs),
            "num_samples": len(samples),
            "n": n,
            f"avg@{n}": sum(num_correct) / len(samples),
        }
        for k in _ks(n):
            row[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in num_correct) / len(probs)
        row[f"maj@{n}"] = sum(
            maj_at_k([s.extracted for s in p.samples], [s.correct for s in p.samples], n) for p in probs
        ) / len(probs)
        row["mean_response_tokens"] = sum(s.num_tokens for s in samples) / len(samples)
        row["truncation_rate"] = sum(s.truncated for s in samples) / len(samples)
        out[name] = row
    return out
