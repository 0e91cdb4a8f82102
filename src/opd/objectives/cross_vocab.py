"""The span signal of a cross-vocabulary teacher (SPEC §9): pure tensor functions from aligned spans to what the
objectives read at the student's positions.

A span is a group of consecutive student tokens and teacher tokens covering the same bytes (`opd.data.
token_alignment`). Per span the teacher's log-prob of the span's text is the sum over its teacher tokens; the
student's, the sum over its student tokens; spans sum to the whole response's log-ratio. `span_credit` says how a
span's teacher log-prob reaches its student tokens: "prefix" (the teacher's own probability of each student token's
text, read from its distribution inside the span: SPEC §9), "even" (each of its n student tokens gets T/n, and its
reward is T/n − s_i: the student's own log-prob stays exact on its own token) or "last" (the whole span reward T − S on
its last student token, 0 on the others). With one student and one teacher token per span all three are the
sampled-token reward.

Shapes: B rows, T student positions, N teacher positions, S spans, K top-k, J slots.
"""

from __future__ import annotations

from typing import Literal

import torch

from opd.objectives.rewards import TokenRewards

SpanCredit = Literal["prefix", "even", "last"]
SPAN_CREDITS: tuple[SpanCredit, ...] = ("prefix", "even", "last")

__all__ = ["SPAN_CREDITS", "SpanCredit", "span_sums", "span_teacher_logprobs", "with_span_fallback"]


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
    prefix_at_BT: torch.Tensor | None = None,
    prefix_lp_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] the teacher's log-prob at every student position such that the sampled-token reward `t − s` there is
    the span signal: with "even" `T_span / n_span`, with "last" `s_i` inside a span and `T_span − S_span + s_last` on
    its last token; `s_i` (reward 0) on an unaligned position. With "prefix" `L_i − L_prev`, where `L_i` is the
    teacher's log-prob of the span's text from the span's start through student token i: for a token that is not its
    span's last, the teacher's log-probs of the span's teacher tokens before `prefix_at_BT` (the teacher position
    whose token covers the token's end, [B, T] long) plus `prefix_lp_BT` (the teacher's log-prob there of a token
    that begins with the rest of the text up to that end, [B, T]); `T_span` on the last; `L_prev` is the previous
    student token's of the same span (0 for the first). All credits sum, over a span's tokens, to the span's reward
    `T_span − S_span`, and so over a row to the row's log-ratio."""
    top = [int(x.max()) for x in (student_span_BT, teacher_span_BN) if x.numel()]
    num_spans = max(top, default=-1) + 1
    aligned_BT = student_span_BT >= 0
    index_BT = student_span_BT.clamp(min=0)
    teacher_BS = span_sums(teacher_lp_BN, teacher_span_BN, num_spans)
    counts_BS = span_sums(aligned_BT.to(student_lp_BT.dtype), student_span_BT, num_spans)
    if credit not in SPAN_CREDITS:
        raise ValueError(f"span_credit must be one of {', '.join(SPAN_CREDITS)}, got {credit!r}")
    if num_spans == 0:
        return student_lp_BT.clone()
    if credit == "even":
        share_BT = (teacher_BS / counts_BS.clamp(min=1)).gather(1, index_BT)
        return torch.where(aligned_BT, share_BT, student_lp_BT)
    t = torch.arange(student_span_BT.shape[1], device=student_span_BT.device)
    last_BS = torch.full_like(teacher_BS, -1, dtype=torch.long).scatter_reduce(
        1, index_BT, torch.where(aligned_BT, t.expand_as(student_span_BT), -1), reduce="amax"
    )
    is_last_BT = aligned_BT & (last_BS.gather(1, index_BT) == t)
    if credit == "last":
        student_BS = span_sums(student_lp_BT, student_span_BT, num_spans)
        reward_BT = (teacher_BS - student_BS).gather(1, index_BT)
        share_BT = torch.where(is_last_BT, reward_BT + student_lp_BT, student_lp_BT)
        return torch.where(aligned_BT, share_BT, student_lp_BT)
    if prefix_at_BT is None or prefix_lp_BT is None:
        raise ValueError("span_credit prefix needs prefix_at_BT and prefix_lp_BT (the teacher's prefix log-probs)")
    parts = (teacher_span_BN, index_BT, aligned_BT, is_last_BT, teacher_BS)
    return _prefix_credit(student_lp_BT, teacher_lp_BN, *parts, prefix_at_BT, prefix_lp_BT)


def _prefix_credit(
    student_lp_BT: torch.Tensor,
    teacher_lp_BN: torch.Tensor,
    teacher_span_BN: torch.Tensor,
    index_BT: torch.Tensor,
    aligned_BT: torch.Tensor,
    is_last_BT: torch.Tensor,
    teacher_BS: torch.Tensor,
    prefix_at_BT: torch.Tensor,
    prefix_lp_BT: torch.Tensor,
) -> torch.Tensor:
    """ "prefix" of `span_teacher_logprobs`: the cumulative `L_i` (in float64: differences of running sums), then
    each token's `L_i − L_prev`."""
    wide = torch.float64
    B, N = teacher_lp_BN.shape
    tlp_BN = torch.where(teacher_span_BN >= 0, teacher_lp_BN.to(wide), torch.zeros((), dtype=wide))
    before_BN = torch.cumsum(tlp_BN, dim=1) - tlp_BN  # Σ of the teacher's log-probs before each position
    n = torch.arange(N, device=teacher_span_BN.device).expand(B, N)
    first_BS = torch.full(teacher_BS.shape, N, dtype=torch.long, device=n.device).scatter_reduce(
        1, teacher_span_BN.clamp(min=0), torch.where(teacher_span_BN >= 0, n, N), reduce="amin"
    )
    pad_BN = torch.cat([before_BN, before_BN.new_zeros(B, 1)], dim=1)  # position N: a span with no teacher token
    at_BT = prefix_at_BT.clamp(min=0, max=max(N - 1, 0))
    start_BT = pad_BN.gather(1, first_BS.gather(1, index_BT))
    inside_BT = (pad_BN.gather(1, at_BT) if N else torch.zeros_like(start_BT)) - start_BT
    interior_BT = aligned_BT & ~is_last_BT
    cum_BT = torch.where(
        is_last_BT,
        teacher_BS.to(wide).gather(1, index_BT),
        torch.where(interior_BT, inside_BT + prefix_lp_BT.to(wide), torch.zeros((), dtype=wide)),
    )
    # the previous aligned token's cumulative, where it is of the same span (tokens of a span are consecutive but
    # for unaligned special tokens between them); 0 for a span's first token
    T = aligned_BT.shape[1]
    t = torch.arange(T, device=aligned_BT.device).expand_as(aligned_BT)
    seen_BT = torch.where(aligned_BT, t, -1).cummax(dim=1).values
    prev_BT = torch.cat([seen_BT.new_full((B, 1), -1), seen_BT[:, :-1]], dim=1)
    has_prev_BT = (prev_BT >= 0) & (index_BT.gather(1, prev_BT.clamp(min=0)) == index_BT)
    prev_cum_BT = torch.where(has_prev_BT, cum_BT.gather(1, prev_BT.clamp(min=0)), torch.zeros((), dtype=wide))
    share_BT = (cum_BT - prev_cum_BT).to(student_lp_BT.dtype)
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
