"""Losses (SPEC §4–§5): PPO-clip policy gradient over candidate slots, loss aggregation, KL-to-reference and entropy
terms, truncated importance weights, SFT cross-entropy, and the extension objectives.

Shapes: B sequences, T response positions, J candidate slots, V vocabulary, N flattened positions. `agg_loss`
follows verl's (global-batch version): each micro-batch's loss is its share of the optimizer batch's, so the trainer
sums gradients over micro-batches, and multiplies each rank's loss by the world size where DDP / FSDP average them
(docs/design.md, "opd.objectives.losses"). Losses return `(loss, metrics)`, metrics detached, no `.item()`.

Omitted: verl's other policy losses (GSPO, CISPO, clip-cov, …), the `token-sum` and `token-mean-unbiased` modes,
value losses, and the `k3+` straight-through KL variants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k3", "low_var_kl"]

Number = torch.Tensor | float | int


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation.


def _divisor(given: Number | None, local: torch.Tensor) -> torch.Tensor:
    """The global divisor if given, else the local one; clamped to ≥ 1 so an empty batch gives 0, not NaN."""
    value = local if given is None else torch.as_tensor(given, dtype=local.dtype, device=local.device)
    return value.clamp_min(1)


def _agg_token_mean(loss_BT, mask_BT, num_tokens, num_seqs, scale):
    return (loss_BT * mask_BT).sum() / _divisor(num_tokens, mask_BT.sum())


def _seq_sums(loss_BT, mask_BT, num_seqs):
    """Per-sequence token sums and the seq-mean divisor (sequences with no valid token are not counted, as verl)."""
    seq_sum_B = (loss_BT * mask_BT).sum(-1)
    n_seqs = _divisor(num_seqs, (mask_BT.sum(-1) > 0).to(loss_BT.dtype).sum())
    return seq_sum_B, n_seqs


def _agg_seq_mean_token_mean(loss_BT, mask_BT, num_tokens, num_seqs, scale):
    seq_sum_B, n_seqs = _seq_sums(loss_BT, mask_BT, num_seqs)
    return (seq_sum_B / mask_BT.sum(-1).clamp_min(1)).sum() / n_seqs


def _agg_seq_mean_token_sum(loss_BT, mask_BT, num_tokens, num_seqs, scale):
    seq_sum_B, n_seqs = _seq_sums(loss_BT, mask_BT, num_seqs)
    return seq_sum_B.sum() / n_seqs


def _agg_seq_mean_token_sum_norm(loss_BT, mask_BT, num_tokens, num_seqs, scale):
    # verl divides by a constant horizon (default: the padded response length T) to remove the length bias.
    horizon = mask_BT.shape[-1] if scale is None else scale
    return _agg_seq_mean_token_sum(loss_BT, mask_BT, num_tokens, num_seqs, scale) / horizon


_AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
    "seq-mean-token-sum-norm": _agg_seq_mean_token_sum_norm,
}
assert set(_AGGREGATORS) == set(get_args(LossAggMode))


def agg_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    loss_agg_mode: LossAggMode = "token-mean",
    *,
    global_num_tokens: Number | None = None,
    global_num_seqs: Number | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-position loss `[B, T]` into a scalar (verl's `agg_loss`).

    token-mean:              Σ_valid ℓ / N, N = global_num_tokens (valid positions of the whole optimizer batch,
                             all micro-batches and ranks) or the local count
    seq-mean-token-mean:     Σ_seq (Σ_t ℓ / n_seq) / S, S = global_num_seqs (non-empty sequences) or local
    seq-mean-token-sum:      Σ_seq Σ_t ℓ / S
    seq-mean-token-sum-norm: Σ_seq Σ_t ℓ / S / loss_scale_factor (default T = loss_BT.shape[-1]; pass a constant,
                             e.g. max response length, when micro-batches are padded to different T)
    Masked positions contribute nothing; an empty mask gives 0.
    """
    if loss_agg_mode not in _AGGREGATORS:
        raise ValueError(f"loss_agg_mode must be one of {sorted(_AGGREGATORS)}, got {loss_agg_mode!r}")
    mask = mask_BT.to(loss_BT.dtype)
    loss_BT = torch.where(mask_BT.bool(), loss_BT, torch.zeros_like(loss_BT))  # NaN/inf at masked positions stay out
    return _AGGREGATORS[loss_agg_mode](loss_BT, mask, global_num_tokens, global_num_seqs, loss_scale_factor)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Policy loss.


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    global_num_tokens: Number | None = None,
    global_num_seqs: Number | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy-gradient loss over candidate slots (SPEC §4).

    logprobs:      [B, T, J] ℓ at the candidate ids under the current parameters (with grad)
    old_logprobs:  [B, T, J] ℓ_old under the policy that generated the batch (no grad)
    advantages:    [B, T, J]; valid: [B, T, J] bool; response_mask: [B, T] bool
    rollout_is_weights: optional [B, T] (per position) or [B, T, J] truncated IS weights (see `truncated_is_weights`)
    Per slot: ratio = exp(clamp(ℓ − ℓ_old, −20, 20)), pg = max(−A·ratio, −A·clip(ratio, 1−ε_low, 1+ε_high)), and for
    A < 0 also min(pg, −A·c). Slots are summed per position, positions aggregated by `agg_loss`.
    Invalid slots and masked positions contribute nothing (and no NaN, whatever their log-probs hold).
    Metrics (local means over valid slots): pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, ratio_mean.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {clip_ratio_c}")
    valid = valid.bool() & response_mask.bool()[..., None]
    advantages = torch.where(valid, advantages.detach(), torch.zeros_like(advantages))
    # Sanitise before clamp/exp: garbage (even -inf) log-probs on invalid slots must not poison forward or backward.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -advantages * clip_ratio_c
    pg_BTJ = torch.where(advantages < 0, torch.minimum(clipped, pg3), clipped)
    pg_BTJ = torch.where(valid, pg_BTJ, torch.zeros_like(pg_BTJ))
    if rollout_is_weights is not None:
        w = rollout_is_weights.detach()
        pg_BTJ = pg_BTJ * (w[..., None] if w.dim() == pg_BTJ.dim() - 1 else w)
    pg_BT = pg_BTJ.sum(-1)
    loss = agg_loss(
        pg_BT,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": _masked_mean((pg2 > pg1).to(pg1.dtype), valid),
            "pg_clipfrac_lower": _masked_mean(((clipped > pg3) & (advantages < 0)).to(pg1.dtype), valid),
            "ppo_kl": _masked_mean(-log_ratio, valid),
            "ratio_mean": _masked_mean(ratio, valid),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------------------
# KL to a reference, entropy, importance weights.


def _kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # Schulman's k3 = exp(ref − ℓ) − (ref − ℓ) − 1 ≥ 0, clamped for stability exactly as verl (which treats k3 and
    # low_var_kl as the same estimator).
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


_KL_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,
}
assert set(_KL_KINDS) == set(get_args(KLKind))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: KLKind = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate to a frozen reference (verl's `kl_penalty`), same shape as the inputs ([B, T]).

    k1: ℓ − ℓ_ref. k3 / low_var_kl: exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1 with the log-ratio clamped to [−20, 20] and the
    result to [−10, 10] (verl uses one estimator for both names). Aggregate with `agg_loss` and add coef × it.
    """
    if kind not in _KL_KINDS:
        raise ValueError(f"kl kind must be one of {sorted(_KL_KINDS)}, got {kind!r}")
    return _KL_KINDS[kind](logprob, ref_logprob.detach())


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / τ) along the last dim, `[..., V] → [...]` (differentiable). For an entropy bonus,
    aggregate with `agg_loss` and subtract coef × it; the trainer calls this per chunk of positions."""
    z = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    lp = F.log_softmax(z / temperature, dim=-1)
    return -(lp.exp() * lp).sum(-1)


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Truncated importance weights `min(exp(ℓ_old − ℓ_rollout), C)` (SPEC §4), detached, for rollouts sampled by
    another engine (e.g. vLLM) than the trainer. [B, T] → [B, T]; 0 at masked positions when `mask` is given."""
    log_w = (old_logprobs.detach() - rollout_logprobs.detach()).clamp(-20.0, 20.0)
    w = log_w.exp().clamp_max(cap)
    return w if mask is None else torch.where(mask.bool(), w, torch.zeros_like(w))


# ---------------------------------------------------------------------------------------------------------------------
# SFT.


def sft_loss(
    target_logprobs: torch.Tensor, mask: torch.Tensor, global_num_tokens: Number | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean cross-entropy on response tokens (SPEC §5).

    target_logprobs: [B, T] log-prob of each target token (with grad); mask: [B, T] bool, True on response tokens only
    global_num_tokens: response tokens of the whole optimizer batch (micro-batches and ranks); local count when None.
    Metrics: nll (local token mean), num_tokens (local).
    """
    loss = agg_loss(-target_logprobs, mask, "token-mean", global_num_tokens=global_num_tokens)
    with torch.no_grad():
        metrics = {"nll": _masked_mean(-target_logprobs.detach(), mask), "num_tokens": mask.sum().detach()}
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------------------
# Extension objectives (ours; SPEC §4). Per position, to be aggregated with `agg_loss`.


def _support_log_probs(lp_J: torch.Tensor, valid_J: torch.Tensor) -> torch.Tensor:
    """log p̄ on the valid slots: lp renormalised over the support, 0 (not -inf) on invalid slots so that no NaN
    reaches forward or backward; a position with no valid slot gets all 0 and contributes 0 below."""
    masked = lp_J.masked_fill(~valid_J, float("-inf"))
    any_valid = valid_J.any(-1, keepdim=True)
    masked = torch.where(any_valid, masked, torch.zeros_like(masked))
    return torch.where(valid_J, F.log_softmax(masked, dim=-1), torch.zeros_like(masked))


def _kl_on_support(log_p: torch.Tensor, log_q: torch.Tensor, valid_J: torch.Tensor) -> torch.Tensor:
    """Σ_valid p (log p − log q), both already log-probs on the support with 0 on invalid slots."""
    return torch.where(valid_J, log_p.exp() * (log_p - log_q), torch.zeros_like(log_p)).sum(-1)


def topk_kl(student_lp: torch.Tensor, teacher_lp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Reverse KL on the top-k support, the paper's Eq. 5 taken literally: KL(p̄ ‖ q̄) with p̄, q̄ the student and
    teacher renormalised over the valid slots, differentiated through p̄ (the teacher is a constant).

    student_lp: [..., J] student log-probs or logits at the support (renormalisation removes the constant; with grad)
    teacher_lp: [..., J]; valid: [..., J] bool (include the response mask). Returns [...], 0 with no valid slot.
    """
    valid = valid.bool()
    return _kl_on_support(_support_log_probs(student_lp, valid), _support_log_probs(teacher_lp.detach(), valid), valid)


def forward_kl(student_lp: torch.Tensor, teacher_lp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Forward KL(q̄ ‖ p̄) on the support (GKD with β = 0; use the teacher's top-k as support), both renormalised over
    the valid slots, gradient through p̄. Shapes as `topk_kl`. Student mass outside the support is not penalised; with
    the support = the whole vocabulary it is the exact forward KL."""
    valid = valid.bool()
    return _kl_on_support(_support_log_probs(teacher_lp.detach(), valid), _support_log_probs(student_lp, valid), valid)


def jsd(student_lp: torch.Tensor, teacher_lp: torch.Tensor, valid: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen–Shannon divergence of GKD (Agarwal et al. 2024, Eq. 1; trl's `generalized_jsd_loss`) on the
    support, both distributions renormalised over the valid slots:
    `β·KL(q̄ ‖ m) + (1−β)·KL(p̄ ‖ m)`, m = β q̄ + (1−β) p̄; β = 0 is forward KL(q̄‖p̄) and β = 1 reverse
    KL(p̄‖q̄), as in trl. Shapes as `topk_kl`; gradient through p̄."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    valid = valid.bool()
    log_p = _support_log_probs(student_lp, valid)
    log_q = _support_log_probs(teacher_lp.detach(), valid)
    if beta == 0.0:
        return _kl_on_support(log_q, log_p, valid)
    if beta == 1.0:
        return _kl_on_support(log_p, log_q, valid)
    log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log1p(-beta))
    log_m = torch.where(valid, log_m, torch.zeros_like(log_m))
    return beta * _kl_on_support(log_q, log_m, valid) + (1.0 - beta) * _kl_on_support(log_p, log_m, valid)


class _ChunkedReverseKL(torch.autograd.Function):
    """Σ_v p(v)(s(v) − t(v)) per position, forward and backward in chunks of positions so that only one chunk's
    [chunk, V] temporaries live at a time (autograd would otherwise keep every chunk's softmax for backward).
    d/dz_S = p ⊙ (s − t − KL) / τ_S; the teacher gets no gradient."""

    @staticmethod
    def _chunk(z_s, z_t, tau_s, tau_t):
        V = z_s.shape[-1]
        s = F.log_softmax(_compute_dtype(z_s) / tau_s, dim=-1)
        t = F.log_softmax(_compute_dtype(z_t[:, :V]).to(s.dtype) / tau_t, dim=-1)
        p = s.exp()
        return s, t, p, (p * (s - t)).sum(-1)

    @staticmethod
    def forward(ctx, z_s, z_t, mask, chunk_size, tau_s, tau_t):
        ctx.save_for_backward(z_s, z_t, mask)
        ctx.chunk_size, ctx.tau_s, ctx.tau_t = chunk_size, tau_s, tau_t
        out = []
        for i in range(0, z_s.shape[0], chunk_size):
            *_, kl = _ChunkedReverseKL._chunk(z_s[i : i + chunk_size], z_t[i : i + chunk_size], tau_s, tau_t)
            out.append(kl)
        kl_N = torch.cat(out) if out else z_s.new_zeros(0, dtype=_compute_dtype(z_s).dtype)
        return torch.where(mask, kl_N, torch.zeros_like(kl_N))

    @staticmethod
    def backward(ctx, grad_N):
        z_s, z_t, mask = ctx.saved_tensors
        grad_N = torch.where(mask, grad_N, torch.zeros_like(grad_N))
        grads = []
        for i in range(0, z_s.shape[0], ctx.chunk_size):
            s, t, p, kl = _ChunkedReverseKL._chunk(
                z_s[i : i + ctx.chunk_size], z_t[i : i + ctx.chunk_size], ctx.tau_s, ctx.tau_t
            )
            g = grad_N[i : i + ctx.chunk_size, None]
            m = mask[i : i + ctx.chunk_size, None]
            grads.append(torch.where(m, g * p * (s - t - kl[:, None]) / ctx.tau_s, 0.0).to(z_s.dtype))
        grad_z = torch.cat(grads) if grads else torch.zeros_like(z_s)
        return grad_z, None, None, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def full_reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int = 1024,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
) -> torch.Tensor:
    """Exact reverse KL over the whole vocabulary, Σ_v p(v)(s(v) − t(v)), per position (SPEC §4 extension).

    student_logits: [N, V] raw (with grad); teacher_logits: [N, V'] with V' ≥ V, padding rows ≥ V ignored (as in
    `token_rewards`); mask: [N] bool. Returns [N] (0 where masked), computed chunk_size positions at a time in
    forward and backward. The teacher is treated as a constant (no gradient flows to it).
    """
    if teacher_logits.shape[-1] < student_logits.shape[-1]:
        raise ValueError(
            f"teacher vocabulary {teacher_logits.shape[-1]} < student vocabulary {student_logits.shape[-1]}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    return _ChunkedReverseKL.apply(
        student_logits, teacher_logits.detach(), mask.bool(), chunk_size, student_temperature, teacher_temperature
    )
