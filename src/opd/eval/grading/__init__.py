"""Math answer grading: `grade(response, ground_truth)` = `extract_answer` (SPEC §7) + a comparison in three stages,
cheapest first: string (`normalise`), numeric, then symbolic (`compare`; `workers` outside the main thread).

Ground truths: a string, or a list/tuple of strings meaning "any of them" (`grade(r, ["1", "2"])`). `timeout`
(seconds) bounds the symbolic stage of one call from its start: one-time imports, waiting for and starting a
grading worker, parsing and verifying all count, so a call returns within about `timeout`. Answers longer than
`MAX_ANSWER_CHARS` skip stages 2-3 (exact string match only). `grade_responses` decodes a batch of rollouts and
grades each against its row's ground truth.

Omitted here: what each stage leaves out is said in its own module.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# _parse, _verdicts and the workers' names are read by tests here (the same objects: the caches, counters, pool).
from opd.eval.grading.compare import _compare, _parse, _verdicts  # noqa: F401
from opd.eval.grading.extraction import MAX_ANSWER_CHARS, _unwrap_gold, extract_answer
from opd.eval.grading.normalise import answer_key, normalize_answer
from opd.eval.grading.workers import _STATS, _Worker, _WorkerPool  # noqa: F401

DEFAULT_TIMEOUT_S = 5.0
"""Default wall-time budget (seconds) of the symbolic stage of one `grade` call."""

_RETURN_MARGIN_S = 0.3  # left for unwinding an interrupted sympy call, which takes longer under load

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Grade",
    "MAX_ANSWER_CHARS",
    "answer_key",
    "decode_responses",
    "extract_answer",
    "grade",
    "grade_responses",
    "grade_rollouts",
    "is_equivalent",
    "normalize_answer",
]


@dataclass(frozen=True)
class Grade:
    """Outcome of grading one response.

    correct:   True iff the extracted answer is equivalent to the ground truth (to one of them, for a list).
    extracted: the answer found in the response (`extract_answer`), None if there was none.
    reason:    the stage that decided: "string" | "numeric" | "symbolic" | "not_math" (an answer or ground
               truth that does not parse as a whole) | "no_answer" | "empty" | "too_long" | "timeout" |
               "busy" (no grading worker free before the deadline; not cached) | "unavailable" (symbolic
               stage could not run) | "error: …".
    """

    correct: bool
    extracted: str | None
    reason: str


def grade(response: str, ground_truth: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Grade a model response against a ground truth (which may itself be wrapped in `\\boxed{}`).

    ground_truth: a string, or a list/tuple of strings of which any one counts as correct (SPEC §8 names
    `grade(response: str, ground_truth: str)`; the sequence form is an extension, a str behaves as before).
    `timeout` (seconds) bounds the symbolic comparison of the whole call; `<= 0` skips it. Never raises.
    """
    extracted = None
    try:
        extracted = extract_answer(response)
        if extracted is None:
            return Grade(False, None, "no_answer")
        deadline = _deadline(timeout)
        # Any: a caller's non-str ground truth goes on to `_compare`, which answers "error: not a string"
        golds: list[Any] = list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]
        reason = "empty"
        for gold in golds:
            correct, reason = _compare(extracted, _unwrap_gold(gold), deadline)
            if correct:
                return Grade(True, extracted, reason)
        return Grade(False, extracted, reason)
    except Exception as e:  # the contract is "never raises": a grading bug must not kill an eval
        return Grade(False, extracted, f"error: {type(e).__name__}")


def is_equivalent(pred: str, gold: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True iff answer `pred` is equivalent to answer `gold` (string, numeric, then symbolic stage).

    Not symmetric for equations (`2x+3` matches gold `2x+3=y`, as in math-verify). Never raises.
    """
    try:
        return _compare(pred, gold, _deadline(timeout))[0]
    except Exception:
        return False


def _deadline(timeout: float | None) -> tuple[float, float] | None:
    """(monotonic deadline, budget) of a call, None when the symbolic stage is off. The deadline keeps
    `_RETURN_MARGIN_S` for unwinding an interrupted sympy call, so that the call returns within `timeout`."""
    if timeout is None or not timeout > 0:
        return None
    timeout = min(float(timeout), 1e6)
    return time.monotonic() + max(timeout - _RETURN_MARGIN_S, timeout / 2), timeout


# ----------------------------------------------------------------------------------- decoded rollouts, graded


def decode_responses(tokenizer, response_ids, lengths: Sequence[int] | None = None) -> list[str]:
    """The text of each response (special tokens dropped): rows of `response_ids` (a `[B, T]` tensor or lists of
    ids), each cut to its length in `lengths` when given (a padded batch's response-mask sums)."""
    rows = response_ids.tolist() if hasattr(response_ids, "tolist") else [list(ids) for ids in response_ids]
    if lengths is not None:
        rows = [ids[:length] for ids, length in zip(rows, lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def grade_responses(
    tokenizer,
    response_ids,
    answers: Sequence,
    *,
    lengths: Sequence[int] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> tuple[list[str], list[Grade] | None]:
    """Decode every response and grade it against its row's ground truth; the grades are None when any row has
    no answer (prompts without ground truth: nothing to grade)."""
    texts = decode_responses(tokenizer, response_ids, lengths)
    if any(answer is None for answer in answers):
        return texts, None
    return texts, [grade(text, answer, timeout=timeout) for text, answer in zip(texts, answers)]


def grade_rollouts(
    tokenizer, rollouts, answers: Sequence, final_turns: Sequence[Sequence[int]] | None = None
) -> tuple[list[str], list[Grade] | None]:
    """`grade_responses` of a batch of `Rollouts` (each row's response, up to its `response_mask` length) or, for
    episodes (`final_turns` given: `EpisodeOutput.final_turns`), of each episode's final turn."""
    if final_turns is not None:
        return grade_responses(tokenizer, final_turns, answers)
    return grade_responses(tokenizer, rollouts.response_ids, answers, lengths=rollouts.response_mask.sum(-1).tolist())
