"""The teacher-scoring interface: score arbitrary token ids (the student's rollouts) position by position; or answer
with final hidden states and an output head (`HiddenStateSource`), from which `scores_from_hidden` computes the
same scores and `opd.objectives.full_vocab` the exact full-vocabulary objectives."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from opd.scoring import OutputHead, score_hidden
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


# ------------------------------------------------------------------------------------------------ hidden states


@runtime_checkable
class HiddenStateSource(Protocol):
    """A teacher that can answer with its final (normed) hidden states instead of scores (local, offloaded and
    served teachers), and give its output head once: the caller then computes any score, or the exact
    full-vocabulary distribution, itself (`scores_from_hidden`, `opd.objectives.full_vocab`)."""

    def hidden_states(self, rollouts: Rollouts) -> torch.Tensor:
        """[B, T, E] the hidden state that predicts each response token (the one `score` projects), in the model's
        (or the wire's) dtype, zero at masked positions, on the rollouts' device."""
        ...

    def output_head(self) -> OutputHead:
        """The teacher's output head over the shared vocabulary range (weight [V, E], bias, scale, soft-cap)."""
        ...


def head_fingerprint(head: OutputHead) -> str:
    """`sha256:<16 hex>` of a head's weight and bias bytes, shapes, dtype, scale and soft-cap: part of the teacher's
    identity when its answers are hidden states (a checkpoint's teacher manifest records it)."""
    digest = hashlib.sha256()
    digest.update(f"{tuple(head.weight.shape)}|{head.weight.dtype}|{head.logit_scale!r}|{head.softcap!r}".encode())
    for tensor in (head.weight, head.bias):
        if tensor is not None:
            flat = tensor.detach().contiguous().cpu().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return "sha256:" + digest.hexdigest()[:16]


_HEAD_HASHES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def source_head_hash(source: HiddenStateSource) -> str:
    """`head_fingerprint` of a hidden-state source's head, computed once per source (a served teacher's head is
    fetched for it): the teacher manifest's `head`."""
    if source not in _HEAD_HASHES:
        _HEAD_HASHES[source] = head_fingerprint(source.output_head())
    return _HEAD_HASHES[source]


def head_bytes(head: OutputHead) -> int:
    """Bytes of the head's weight and bias: what keeping it resident costs."""
    return sum(t.numel() * t.element_size() for t in (head.weight, head.bias) if t is not None)


def score_bytes_per_position(top_k: int, requested: int, *, with_entropy: bool = True, logprob_bytes: int = 4) -> int:
    """Bytes a served teacher's scores take per scored position on the wire (`opd.teacher.wire` response): the sampled
    log-prob, K int32 ids and K log-probs, Q requested log-probs and the entropy."""
    return logprob_bytes * (1 + top_k + requested + int(with_entropy)) + 4 * top_k


def crossover_k(
    hidden_size: int, hidden_itemsize: int = 2, *, with_entropy: bool = True, logprob_bytes: int = 4
) -> int:
    """The smallest K at which top-K scores (with the student's top-K requested, Q = K, as only_stu asks) cost more
    bytes a position than hidden states of `hidden_size` values: 256 for E = 1,536 in bf16 with float32 log-probs."""
    hidden = hidden_size * hidden_itemsize
    per_k = 2 * logprob_bytes + 4
    fixed = logprob_bytes * (1 + int(with_entropy))
    return max(1, (hidden - fixed) // per_k + 1)


def choose_answer(answer: str, *, needs_full: bool, served: bool, top_k: int, hidden_size: int | None) -> str:
    """ "scores" or "hidden" for a teacher's `answer` setting: hidden when asked or when the objective needs the whole
    distribution; auto otherwise picks hidden only for a served teacher whose top-k is at or past `crossover_k`
    (in process no bytes move, and the teacher's own top-k costs less than projecting here)."""
    if answer != "auto":
        return answer
    if needs_full:
        return "hidden"
    if served and hidden_size is not None and top_k >= crossover_k(hidden_size):
        return "hidden"
    return "scores"


def check_hidden(hidden_BTE: torch.Tensor, shape_BT: tuple[int, ...], width: int, mask_BT: torch.Tensor) -> None:
    """ValueError in one line unless `hidden_BTE` is [B, T, E] with E = `width` and finite at the response positions
    (`mask_BT`): a wrongly shaped, oversized or NaN/inf answer is refused, never trained on."""
    expected = (*shape_BT, width)
    if tuple(hidden_BTE.shape) != expected:
        raise ValueError(
            f"teacher hidden states: shape {tuple(hidden_BTE.shape)}, expected [B, T, E] = {list(expected)} "
            f"(E: the teacher head's hidden size)"
        )
    if not hidden_BTE.is_floating_point():
        raise ValueError(f"teacher hidden states: dtype {hidden_BTE.dtype}, expected a floating dtype")
    bad_BT = ~torch.isfinite(hidden_BTE).all(-1) & mask_BT.bool()
    if bool(bad_BT.any()):
        b, t = (int(i) for i in bad_BT.nonzero()[0])
        raise ValueError(
            f"teacher hidden states: {int(bad_BT.sum())} response positions hold NaN/inf (first: row {b}, "
            f"position {t}); refusing to train on them"
        )


def scores_from_hidden(
    hidden_BTE: torch.Tensor,
    head: OutputHead,
    rollouts: Rollouts,
    *,
    top_k: int = 16,
    requested_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> TokenScores:
    """The `TokenScores` a teacher's `score` would give, computed here from its hidden states [B, T, E] and head
    (`opd.scoring.score_hidden` at the response positions): every objective runs from hidden states as from scores.
    Float32 grids on the rollouts' device, zero at masked positions."""
    mask_BT = rollouts.response_mask.bool()
    check_hidden(hidden_BTE, tuple(mask_BT.shape), head.weight.shape[1], mask_BT)
    device = head.weight.device
    rows_N, cols_N = mask_BT.nonzero(as_tuple=True)
    ids_BT = rollouts.response_ids
    scores = score_hidden(
        hidden_BTE[rows_N, cols_N].to(device, head.weight.dtype),
        head,
        targets_N=ids_BT[rows_N, cols_N].to(device),
        top_k=top_k,
        requested_ids_NQ=None if requested_ids is None else requested_ids[rows_N, cols_N].to(device),
        temperature=temperature,
        vocab_size=vocab_size,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    ).to(ids_BT.device)
    B, T = mask_BT.shape

    def grid(values: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.zeros((B, T, *values.shape[1:]), dtype=dtype, device=ids_BT.device)
        out[rows_N, cols_N] = values.to(dtype)
        return out

    sampled = grid(scores.sampled_logprobs)
    assert sampled is not None
    return TokenScores(
        sampled,
        grid(scores.topk_ids, torch.long),
        grid(scores.topk_logprobs),
        grid(scores.entropy),
        grid(scores.requested_logprobs),
    )


class HiddenStateScorer(InProcessScoring):
    """A `TeacherScorer` whose scores are computed here from another teacher's hidden states and head: the head is
    fetched once (`source.output_head()`, moved to `device`), each `score` asks only for hidden states (E values a
    position on the wire instead of V) and scores them with `scores_from_hidden`. `head_hash`: `head_fingerprint`."""

    serves_requested_ids = True  # the whole distribution is at hand

    def __init__(self, source: HiddenStateSource, *, device: torch.device | str | None = None, chunk_size=None):
        self.source = source
        head = source.output_head()
        where = device or head.weight.device
        bias = None if head.bias is None else head.bias.detach().to(where)
        self.head = OutputHead(head.weight.detach().to(where), bias, head.logit_scale, head.softcap)
        self.head_hash = source_head_hash(source)
        self.chunk_size = chunk_size
        self.info = getattr(source, "info", None)

    def hidden_states(self, rollouts: Rollouts) -> torch.Tensor:
        hidden_BTE = self.source.hidden_states(rollouts)
        mask_BT = rollouts.response_mask.to(hidden_BTE.device)
        check_hidden(hidden_BTE, tuple(mask_BT.shape), self.head.weight.shape[1], mask_BT)
        return hidden_BTE

    def output_head(self) -> OutputHead:
        return self.head

    def score(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> TokenScores:
        with torch.no_grad():
            return scores_from_hidden(
                self.hidden_states(rollouts),
                self.head,
                rollouts,
                top_k=top_k,
                requested_ids=requested_ids,
                temperature=temperature,
                with_entropy=with_entropy,
                chunk_size=self.chunk_size,
            )

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()
