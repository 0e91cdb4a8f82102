"""The span signal of a cross-vocabulary teacher (SPEC §9): pure tensor functions from aligned spans to what the
objectives read at the student's positions.

A span is a group of consecutive student tokens and teacher tokens covering the same bytes (`opd.data.
token_alignment`). Per span the teacher's log-prob of the span's text is the sum over its teacher tokens; the
student's, the sum over its student tokens; spans sum to the whole response's log-ratio. `span_credit` says how a
span's teacher log-prob reaches its student tokens: "even" (each of its n student tokens gets T/n, and its reward is
T/n − s_i: the student's own log-prob stays exact on its own token) or "last" (the whole span reward T − S on its last
student token, 0 on the others). With one student and one teacher token per span both are the sampled-token reward.

Shapes: B rows, T student positions, N teacher positions, S spans, K top-k, J slots.
"""

from __future__ import annotations

from typing import Literal

import torch

from opd.objectives.rewards import TokenRewards

SpanCredit = Literal["even", "last"]

__all__ = ["SpanCredit", "span_sums", "span_teacher_logprobs", "with_span_fallback"]


def span_sums(values_BN: torch.Tensor, span_BN: torch.Tensor, num_spans: int) -> torch.Tensor:
    """[B, S] the sum of `values_BN` over each span (`span_BN`: the span of every position, -1: none, ignored)."""
    out_BS = values_BN.new_zeros((values_BN.shape[0], num_spans + 1))
    index_BN = torch.where(span_BN >= 0, span_BN, torch.full_like(span_BN, num_spans))
    out_BS.scatter_add_(1, index_BN, torch.where(span_BN >= 0, values_BN, torch.zeros_like(values_BN)))
    return out_BS[:, :num_spans]


def span_teacher_logprobs(
    student_lp_BT: torch.Tensor,
    teacher_lp_BN: torch.Tensor,
    student_span_BT: torch.Tensor,
    teacher_span_BN: torch.Tensor,
    *,
    credit: SpanCredit = "even",
) -> torch.Tensor:
    """[B, T] the teacher's log-prob at every student position such that the sampled-token reward `t − s` there is
    the span signal: with "even" `T_span / n_span`, with "last" `s_i` inside a span and `T_span − S_span + s_last` on
    its last token; `s_i` (reward 0) on an unaligned position. Both credits sum, over a span's tokens, to the span's
    reward `T_span − S_span`, and so over a row to the row's log-ratio."""
    top = [int(x.max()) for x in (student_span_BT, teacher_span_BN) if x.numel()]
    num_spans = max(top, default=-1) + 1
    aligned_BT = student_span_BT >= 0
    index_BT = student_span_BT.clamp(min=0)
    teacher_BS = span_sums(teacher_lp_BN, teacher_span_BN, num_spans)
    counts_BS = span_sums(aligned_BT.to(student_lp_BT.dtype), student_span_BT, num_spans)
    if num_spans == 0:
        return student_lp_BT.clone()
    if credit == "even":
        share_BT = (teacher_BS / counts_BS.clamp(min=1)).gather(1, index_BT)
    elif credit == "last":
        student_BS = span_sums(student_lp_BT, student_span_BT, num_spans)
        t = torch.arange(student_span_BT.shape[1], device=student_span_BT.device)
        last_BS = torch.full_like(teacher_BS, -1, dtype=torch.long).scatter_reduce(
            1, index_BT, torch.where(aligned_BT, t.expand_as(student_span_BT), -1), reduce="amax"
        )
        is_last_BT = aligned_BT & (last_BS.gather(1, index_BT) == t)
        reward_BT = (teacher_BS - student_BS).gather(1, index_BT)
        share_BT = torch.where(is_last_BT, reward_BT + student_lp_BT, student_lp_BT)
    else:
        raise ValueError(f"span_credit must be 'even' or 'last', got {credit!r}")
    return torch.where(aligned_BT, share_BT, student_lp_BT)


def with_span_fallback(
    rewards: TokenRewards,
    exact_BT: torch.Tensor,
    student_lp_BT: torch.Tensor,
    teacher_lp_BT: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
) -> TokenRewards:
    """Top-k rewards where they are exact (`exact_BT`), the span signal elsewhere: the top-k slots stay valid only
    at exact positions, and one more slot, the sampled token with reward `t − s` (`span_teacher_logprobs`), is valid
    at every other response position. Returns `TokenRewards` with J + 1 slots."""
    mask_BT = response_mask_BT.bool()
    span_BT = mask_BT & ~exact_BT.bool()
    keep_BTJ = exact_BT.bool()[..., None]
    with torch.no_grad():
        delta_BT = torch.where(span_BT, teacher_lp_BT - student_lp_BT, torch.zeros_like(student_lp_BT))
    zeros_BTJ = torch.zeros_like(rewards.rewards)
    ids_BT = torch.where(mask_BT, response_ids_BT, torch.zeros_like(response_ids_BT))
    return TokenRewards(
        candidate_ids=torch.cat([rewards.candidate_ids, ids_BT[..., None]], dim=-1),
        rewards=torch.cat([torch.where(keep_BTJ, rewards.rewards, zeros_BTJ), delta_BT[..., None]], dim=-1),
        valid=torch.cat([rewards.valid & keep_BTJ, span_BT[..., None]], dim=-1),
        weights=torch.cat([torch.where(keep_BTJ, rewards.weights, zeros_BTJ), span_BT[..., None].to(zeros_BTJ)], -1),
        student_logprobs=torch.cat([rewards.student_logprobs, student_lp_BT[..., None]], dim=-1),
        teacher_logprobs=torch.cat([rewards.teacher_logprobs, teacher_lp_BT[..., None]], dim=-1),
        sampled_token=False,
    )
