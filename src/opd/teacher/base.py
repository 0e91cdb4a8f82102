"""The teacher-scoring interface: score arbitrary token ids (the student's rollouts) position by position."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import torch

from opd.types import Rollouts, TokenScores


@runtime_checkable
class TeacherScorer(Protocol):
    def score(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> TokenScores:
        """For every response position of `rollouts`: log-prob of the sampled token, the top-k ids and log-probs
        (K = top_k; none when 0), log-probs at `requested_ids` ([B, T, R] long, e.g. the student's top-k) and the
        entropy, all at `temperature`. Returns `TokenScores` on the rollouts' device."""
        ...


def start_scoring(scorer: TeacherScorer, rollouts: Rollouts, **kwargs: Any) -> Any:
    """Begin `scorer.score(rollouts, **kwargs)` and return an object whose `result()` gives the `TokenScores`. A
    scorer with `score_async` (a served teacher) sends its requests now, so the caller's next work overlaps them;
    any other scores here, before returning."""
    if hasattr(scorer, "score_async"):
        return scorer.score_async(rollouts, **kwargs)
    done: Future = Future()
    done.set_result(scorer.score(rollouts, **kwargs))
    return done
