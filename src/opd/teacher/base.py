"""The teacher-scoring interface: score arbitrary token ids (the student's rollouts) position by position."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from opd.types import Rollouts, TokenScores


class PendingScores:
    """A `score` in flight: `result()` waits for it and returns the `TokenScores` (on the rollouts' device)."""

    def __init__(self, finish: Callable[[], TokenScores]) -> None:
        self._finish = finish

    @classmethod
    def done(cls, scores: TokenScores) -> PendingScores:
        """Scores computed already (an in-process scorer: nothing to overlap)."""
        return cls(lambda: scores)

    def result(self) -> TokenScores:
        return self._finish()


@runtime_checkable
class TeacherScorer(Protocol):
    """Every member is implemented by every scorer (local, served, vLLM), so callers use them directly."""

    serves_requested_ids: bool
    """Whether `score` takes `requested_ids` (the vLLM scorer only where its engine can, see
    `opd.teacher.vllm_scorer`)."""

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
        (K = top_k; none when 0), log-probs at `requested_ids` ([B, T, Q] long, e.g. the student's top-k) and the
        entropy, all at `temperature`. Returns `TokenScores` on the rollouts' device."""
        ...

    def score_async(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> PendingScores:
        """`score`, begun now: a served teacher sends its requests and returns at once, so the caller's next work
        overlaps them; an in-process scorer scores here, before returning."""
        ...

    def close(self) -> None:
        """Let go of what the scorer holds beyond the caller's model (connections, an engine); idempotent."""
        ...


class InProcessScoring:
    """`score_async` for a scorer that runs in this process (local model, in-process vLLM): there is nothing to
    overlap, so it scores before returning a done `PendingScores`."""

    def score_async(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> PendingScores:
        scores = self.score(  # type: ignore[attr-defined]
            rollouts, top_k=top_k, requested_ids=requested_ids, temperature=temperature, with_entropy=with_entropy
        )
        return PendingScores.done(scores)


def start_scoring(scorer: TeacherScorer, rollouts: Rollouts, **kwargs: Any) -> PendingScores:
    """Begin `scorer.score(rollouts, **kwargs)` and return an object whose `result()` gives the `TokenScores`
    (`TeacherScorer.score_async`)."""
    return scorer.score_async(rollouts, **kwargs)
