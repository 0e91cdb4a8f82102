"""The decode step's sampling: Gumbel-max over the vocabulary (greedy at temperature 0) with the log-prob before
top-k / top-p filtering, and the two-stage argmax and log-sum-exp it runs over row pieces.

Shapes (docs/design.md, "Shape letters"): R rows of the engine call, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opd.rollout.sampling import filter_logits


def _sample(
    logits_RV: torch.Tensor,
    noise_RV: torch.Tensor | None,
    temperature: float,
    vocab_size: int,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row among ids < vocab_size: Gumbel-max `argmax(filter(z / τ) - log(-log u))`, which draws from
    softmax of the filtered z / τ; greedy `argmax z` at τ = 0 (noise None, top-k/top-p ignored).
    logits [R, V ≥ vocab_size], uniform noise u [R, ≥ vocab_size] → (tokens [R] long, log-probs [R] float32).
    The log-prob is log_softmax(z / τ) over ids < vocab_size at the token, before top-k/top-p filtering."""
    scaled_RV = logits_RV[:, :vocab_size].float()  # a prefix slice: column indices stay token ids
    if temperature == 0:
        tokens_R = scaled_RV.argmax(dim=-1)
    else:
        scaled_RV = scaled_RV / temperature
        filtered_RV = filter_logits(scaled_RV, top_k, top_p) if top_k > 0 or top_p < 1.0 else scaled_RV
        assert noise_RV is not None, "sampling at temperature > 0 needs uniform noise"
        gumbel_RV = -torch.log(-torch.log(noise_RV[:, :vocab_size]))  # u = 0 gives -inf: never chosen, as it should
        tokens_R = _split_argmax(filtered_RV + gumbel_RV)
    logprobs_R = scaled_RV.gather(-1, tokens_R[:, None]).squeeze(-1) - _split_logsumexp(scaled_RV)
    return tokens_R, logprobs_R


_SPLIT = 64  # pieces per row of the vocabulary reductions below


def _split_rows(x_RV: torch.Tensor) -> torch.Tensor:
    """[R, V] → [R, _SPLIT, ⌈V / _SPLIT⌉], padded with -inf. The sampling reductions run over these pieces first, so
    that the argmax and the log-sum-exp fuse into one kernel over R × _SPLIT pieces rather than two over R rows of
    151k entries, which profiled faster (docs/performance.md)."""
    width = -(-x_RV.shape[-1] // _SPLIT)
    return F.pad(x_RV, (0, width * _SPLIT - x_RV.shape[-1]), value=float("-inf")).view(x_RV.shape[0], _SPLIT, width)


def _split_argmax(x_RV: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) in two stages (per piece, then over pieces): [R, V] → [R] long. (Ties may pick another maximum.)"""
    pieces = _split_rows(x_RV)  # [R, _SPLIT, width]
    best, where = pieces.max(dim=-1)  # each piece's maximum and its column in the piece: [R, _SPLIT]
    piece_R1 = best.argmax(dim=-1, keepdim=True)
    return (piece_R1 * pieces.shape[-1] + where.gather(-1, piece_R1)).squeeze(-1)


def _split_logsumexp(x_RV: torch.Tensor) -> torch.Tensor:
    """x.logsumexp(-1) in two stages: [R, V] → [R]."""
    return _split_rows(x_RV).logsumexp(dim=-1).logsumexp(dim=-1)
