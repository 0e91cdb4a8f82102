"""Diagnostics of on-policy distillation on training rollouts (SPEC §6): top-k overlap, shared mass, overlap
advantage, entropies, rewards — each also per chunk of response positions — plus per-rollout sequence rewards, their
AUROC against correctness, and gap recovery.

Shapes: B sequences, T response positions, K top-k, J candidate slots. Everything is computed without gradient and
returned as 0-dim tensors (no `.item()`: the trainer syncs once per step). Only valid positions count; an empty mask
gives 0, never NaN. Per-chunk keys are `name/chunk_c` for positions [c·chunk_size, (c+1)·chunk_size).

All overlap metrics live on the student's top-k slots (I_t = S_t ∩ T_t ⊆ S_t), so they need s and t at S_t and the
teacher's top-k ids only — never the student's log-probs at T_t.
Omitted: `pg_loss`, `grad_norm` and `skipped_steps` (the trainer has them), plots and sinks (`opd.report`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from opd.objectives.losses import topk_kl
from opd.objectives.rewards import rowwise_isin
from opd.types import TokenScores

DIAGNOSTIC_TOP_K = 16  # the support the diagnostics look at when the objective has none (sampled-token OPD)


def diagnostic_top_k(top_k: int) -> int:
    """The top-k a step scores for its diagnostics: the objective's own k, or `DIAGNOSTIC_TOP_K` for top_k = 0."""
    return top_k or DIAGNOSTIC_TOP_K


def _f(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _add_position_metric(
    out: dict[str, torch.Tensor], name: str, value_BT: torch.Tensor, weight_BT: torch.Tensor, chunk_size: int
) -> None:
    """out[name] = mean of value over positions where weight, and out[f"{name}/chunk_c"] per chunk of positions."""
    w = weight_BT.bool()
    v = torch.where(w, _f(value_BT), torch.zeros((), dtype=_f(value_BT).dtype, device=value_BT.device))
    w = w.to(v.dtype)
    out[name] = v.sum() / w.sum().clamp_min(1)
    B, T = v.shape
    n_chunks = max(1, math.ceil(T / chunk_size))
    pad = n_chunks * chunk_size - T
    v_chunks = F.pad(v, (0, pad)).view(B, n_chunks, chunk_size).sum((0, 2))
    w_chunks = F.pad(w, (0, pad)).view(B, n_chunks, chunk_size).sum((0, 2))
    per_chunk = v_chunks / w_chunks.clamp_min(1)
    for c in range(n_chunks):
        out[f"{name}/chunk_{c}"] = per_chunk[c]


@torch.no_grad()
def opd_diagnostics(
    student_topk_ids: torch.Tensor,
    student_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_logprobs_at_student_topk: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    student_entropy: torch.Tensor | None = None,
    teacher_entropy: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> dict[str, torch.Tensor]:
    """Position metrics of SPEC §6, each overall and per chunk of positions.

    student_topk_ids, teacher_topk_ids: [B, T, K] long (S_t, T_t)
    student_topk_logprobs:            [B, T, K] s at S_t (full-vocabulary log-probs)
    teacher_topk_logprobs:            [B, T, K] t at T_t
    teacher_logprobs_at_student_topk: [B, T, K] t at S_t
    response_mask:              [B, T] bool
    student_entropy, teacher_entropy: [B, T] full-vocabulary entropies, optional (entropy metrics only when given)
    Returns, with O_{t,k} = [S_{t,k} ∈ T_t] and I_t = S_t ∩ T_t:
      overlap_ratio         mean over (t, k) of O
      overlap_mass_student  mean_t Σ_{I_t} exp(s);   overlap_mass_teacher  mean_t Σ_{I_t} exp(t)
      overlap_advantage     mean_t (1/|I_t|) Σ_{I_t} p̄ (log q̄ − log p̄), p̄, q̄ renormalised on I_t (≤ 0).
                            Averaged over positions with a non-empty I_t only: it is undefined at the others, and
                            counting them as 0 would read "aligned" exactly where the models disagree most.
      topk_mass_student     mean_t Σ_{S_t} exp(s);   topk_mass_teacher     mean_t Σ_{T_t} exp(t)  (coverage of K)
      entropy_student, entropy_teacher (token means), entropy_gap = mean_t |H_teacher − H_student|
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    mask_BT = response_mask.bool()
    s_BTK, t_at_s_BTK = _f(student_topk_logprobs), _f(teacher_logprobs_at_student_topk)
    overlap_BTK = rowwise_isin(student_topk_ids, teacher_topk_ids)
    n_overlap_BT = overlap_BTK.sum(-1)
    zero = torch.zeros((), dtype=s_BTK.dtype, device=s_BTK.device)
    out: dict[str, torch.Tensor] = {}
    _add_position_metric(out, "overlap_ratio", overlap_BTK.to(s_BTK.dtype).mean(-1), mask_BT, chunk_size)
    _add_position_metric(
        out, "overlap_mass_student", torch.where(overlap_BTK, s_BTK.exp(), zero).sum(-1), mask_BT, chunk_size
    )
    _add_position_metric(
        out, "overlap_mass_teacher", torch.where(overlap_BTK, t_at_s_BTK.exp(), zero).sum(-1), mask_BT, chunk_size
    )
    neg_kl_BT = -topk_kl(s_BTK, t_at_s_BTK, overlap_BTK & mask_BT[..., None])
    _add_position_metric(
        out, "overlap_advantage", neg_kl_BT / n_overlap_BT.clamp_min(1), mask_BT & (n_overlap_BT > 0), chunk_size
    )
    _add_position_metric(out, "topk_mass_student", s_BTK.exp().sum(-1), mask_BT, chunk_size)
    _add_position_metric(out, "topk_mass_teacher", _f(teacher_topk_logprobs).exp().sum(-1), mask_BT, chunk_size)
    if student_entropy is not None:
        _add_position_metric(out, "entropy_student", student_entropy, mask_BT, chunk_size)
    if teacher_entropy is not None:
        _add_position_metric(out, "entropy_teacher", teacher_entropy, mask_BT, chunk_size)
    if student_entropy is not None and teacher_entropy is not None:
        gap_BT = (_f(teacher_entropy) - _f(student_entropy)).abs()
        _add_position_metric(out, "entropy_gap", gap_BT, mask_BT, chunk_size)
    return out


def logprobs_on_overlap(
    ids_BTK: torch.Tensor, topk_ids_BTM: torch.Tensor, topk_logprobs_BTM: torch.Tensor
) -> torch.Tensor:
    """[B, T, K]: the log-prob at ids[b,t,k] where it is one of topk_ids[b,t,:] (taken from topk_logprobs), -inf
    elsewhere. For a teacher that returns only its own top-k: t at S_t is then known on S_t ∩ T_t, which is all that
    `opd_diagnostics` reads of `teacher_logprobs_at_student_topk` (every use is gated by the overlap)."""
    match_BTKM = ids_BTK[..., :, None] == topk_ids_BTM[..., None, :]
    found_BTK = match_BTKM.any(-1)
    value_BTK = (match_BTKM.to(topk_logprobs_BTM.dtype) * topk_logprobs_BTM[..., None, :]).sum(-1)
    return torch.where(found_BTK, value_BTK, torch.full_like(value_BTK, float("-inf")))


def opd_diagnostics_from_scores(
    student: TokenScores, teacher: TokenScores, response_mask: torch.Tensor, *, chunk_size: int = 1024
) -> dict[str, torch.Tensor]:
    """`opd_diagnostics` from the two `TokenScores` (convention of `token_rewards_from_scores`: the teacher's
    `requested_logprobs` are t at the student's top-k). Needs both top-k; entropies are used when present."""
    if (
        student.topk_ids is None
        or student.topk_logprobs is None
        or teacher.topk_ids is None
        or teacher.topk_logprobs is None
        or teacher.requested_logprobs is None
    ):
        raise ValueError("opd_diagnostics needs both models' top-k and the teacher's log-probs at the student's top-k")
    return opd_diagnostics(
        student.topk_ids,
        student.topk_logprobs,
        teacher.topk_ids,
        teacher.topk_logprobs,
        teacher.requested_logprobs,
        response_mask,
        student_entropy=student.entropy,
        teacher_entropy=teacher.entropy,
        chunk_size=chunk_size,
    )


@torch.no_grad()
def reward_diagnostics(
    rewards: torch.Tensor, response_mask: torch.Tensor, *, chunk_size: int = 1024
) -> dict[str, torch.Tensor]:
    """reward_mean and reward_abs_mean (SPEC §6) of the per-position reward Σ_j r_{t,j}, overall and per chunk.
    rewards: [B, T, J] (0 on invalid slots, as `TokenRewards.rewards`) or [B, T]; response_mask: [B, T] bool."""
    r_BT = rewards.sum(-1) if rewards.dim() == 3 else rewards
    out: dict[str, torch.Tensor] = {}
    _add_position_metric(out, "reward_mean", r_BT, response_mask, chunk_size)
    _add_position_metric(out, "reward_abs_mean", r_BT.abs(), response_mask, chunk_size)
    return out


@torch.no_grad()
def seq_rewards(
    sampled_teacher_lp: torch.Tensor, sampled_student_lp: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-rollout sequence reward mean_t (t(y_t) − s(y_t)) over valid positions (SPEC §6). [B, T] → [B]; an empty
    response gives 0."""
    mask_BT = response_mask.bool()
    delta = torch.where(mask_BT, _f(sampled_teacher_lp) - _f(sampled_student_lp), 0.0)
    return delta.sum(-1) / mask_BT.sum(-1).clamp_min(1).to(delta.dtype)


@torch.no_grad()
def auroc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of `scores` [B] separating labels [B] (True/1 = positive, e.g. a correct rollout):
    the Mann–Whitney probability that a random positive scores above a random negative, ties counting 1/2 (average
    ranks). Returns a 0-dim float tensor; 0.5 (chance) when either class is absent, where AUROC is undefined, so logs
    stay NaN-free.
    """
    labels = labels.bool().flatten()
    scores = scores.flatten().double()
    n_pos = labels.sum().double()
    n_neg = (~labels).sum().double()
    sorted_scores, order = scores.sort()
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    # 1-based ranks; a run of tied scores shares the average of its ranks.
    avg_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = avg_rank[inverse]
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2
    both = (n_pos > 0) & (n_neg > 0)
    return torch.where(both, u / (n_pos * n_neg).clamp_min(1), 0.5).float()


def gap_recovery(
    acc_before: torch.Tensor | float, acc_after: torch.Tensor | float, acc_teacher: torch.Tensor | float
) -> torch.Tensor:
    """(acc_after − acc_before) / (acc_teacher − acc_before) (SPEC §6): 1 = the student reached the teacher.
    Returns a float64 tensor; 0 where acc_teacher == acc_before (undefined: there is no gap to recover)."""
    before, after, teacher = (torch.as_tensor(x, dtype=torch.float64) for x in (acc_before, acc_after, acc_teacher))
    den = teacher - before
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(den == 0, torch.zeros_like(den), (after - before) / safe)


# ------------------------------------------------------------------------------------ the step's statistics


def reward_stats(name: str, values_BTJ: torch.Tensor, valid_BTJ: torch.Tensor, mask_BT: torch.Tensor) -> dict:
    """`{name}_mean` and `{name}_abs_mean`: token means of the per-position sum over valid slots, and of its absolute
    value (the step logs rewards and advantages this way). An empty mask gives 0."""
    position_BT = (values_BTJ * valid_BTJ).sum(-1)
    count = mask_BT.sum().clamp(min=1)
    return {
        f"{name}_mean": (position_BT * mask_BT).sum() / count,
        f"{name}_abs_mean": (position_BT.abs() * mask_BT).sum() / count,
    }


def is_weight_stats(old_lp_BT: torch.Tensor, rollout_lp_BT: torch.Tensor, cap: float, mask_BT: torch.Tensor) -> dict:
    """Statistics of the importance weights exp(ℓ_old − ℓ_rollout) over response tokens: the mean of the truncated
    weights the loss uses, the largest untruncated weight, and the fraction of tokens the cap truncates."""
    mask = mask_BT.bool()
    raw_BT = (old_lp_BT.detach() - rollout_lp_BT.detach()).clamp(-20.0, 20.0).exp()
    count = mask.sum().clamp(min=1)
    return {
        "is_weight_mean": (raw_BT.clamp_max(cap) * mask).sum() / count,
        "is_weight_max": torch.where(mask, raw_BT, torch.zeros_like(raw_BT)).max(),
        "is_weight_capped_frac": ((raw_BT > cap) & mask).sum() / count,
    }


def seq_reward_metrics(
    student: TokenScores, teacher: TokenScores, mask_BT: torch.Tensor, correct: list[bool] | None
) -> dict:
    """`seq_reward_mean` (SPEC §6) and, when the rollouts were graded (`correct`, one per row), its AUROC against
    correctness, `seq_reward_auroc`."""
    seq_B = seq_rewards(teacher.sampled_logprobs, student.sampled_logprobs, mask_BT)
    metrics = {"seq_reward_mean": seq_B.mean()}
    if correct is not None:
        metrics["seq_reward_auroc"] = auroc(seq_B, torch.tensor(correct, device=seq_B.device))
    return metrics


def teacher_logprobs_at_student_topk(student: TokenScores, teacher: TokenScores) -> torch.Tensor:
    """[B, T, K] t at the student's top-k for `opd_diagnostics`: the teacher's requested log-probs, or for a teacher
    serving only its own top-k the values on S_t ∩ T_t (`logprobs_on_overlap`: all the diagnostics read)."""
    if teacher.requested_logprobs is not None:
        return teacher.requested_logprobs
    if student.topk_ids is None or teacher.topk_ids is None or teacher.topk_logprobs is None:
        raise ValueError(
            "teacher_logprobs_at_student_topk needs the teacher's requested log-probs or both models' top-k"
        )
    return logprobs_on_overlap(student.topk_ids, teacher.topk_ids, teacher.topk_logprobs)
