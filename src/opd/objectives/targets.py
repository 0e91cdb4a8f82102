"""What one step's update trains toward (SPEC §2–§4): a `Targets` record built from the two models' scores by one
pure function, and the loss of a micro-batch looked up in a table of objectives.

`build_targets` composes the reward path of `token_rewards_from_scores` (sampled-token or top-k rewards), the
advantages (`compute_advantages`), the teacher's top-k support of a GKD-style loss and the truncated importance
weights; `micro_loss` takes the loss from `LOSSES` (name → function) and adds the reference-KL and entropy terms.
Shapes: B sequences, T response positions, K top-k, J candidate slots.

The full-vocabulary losses (`FULL_LOSSES`: full_reverse_kl, full_forward_kl, full_jsd) are not functions of the
candidate log-probs: the caller computes their per-position divergence from both models' hidden states and heads
(`opd.objectives.full_vocab.full_divergence`, the teacher's hidden states in `Targets.teacher_hidden`) and passes it
to `micro_loss`, which aggregates it like every other loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch

from opd.objectives.advantages import AdvantageMode, compute_advantages
from opd.objectives.cross_vocab import with_span_fallback
from opd.objectives.diagnostics import diagnostic_top_k
from opd.objectives.losses import (
    KLKind,
    LossAggMode,
    Number,
    agg_loss,
    forward_kl,
    jsd,
    kl_penalty,
    policy_loss,
    topk_kl,
    truncated_is_weights,
)
from opd.objectives.rewards import Strategy, Weight, token_rewards_from_scores
from opd.types import Rollouts, TokenScores


class ObjectiveSettings(Protocol):
    """The objective settings `build_targets` and `micro_loss` read (`opd.config.ObjectiveSpec` has them all)."""

    top_k: int
    strategy: Strategy
    weight: Weight
    advantage: AdvantageMode
    outcome_weight: float
    loss: str
    tis_cap: float | None
    loss_agg_mode: LossAggMode
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    jsd_beta: float
    kl_type: KLKind
    kl_coef: float
    entropy_coef: float


@dataclass(frozen=True)
class Targets:
    """What the update needs per position of one batch, and the rewards the metrics and samples report.

    candidate_ids:    [B, T, J] long, the ids whose student log-probs the loss recomputes with grad
    old_logprobs:     [B, T, J] ℓ_old at the advantages' slots (the behaviour policy: the student's no-grad scores)
    advantages:       [B, T, J] detached, 0 on invalid slots
    valid:            [B, T, J] bool, the slots the loss counts: the advantages' slots, or for a GKD-style loss
                      (forward_kl, jsd) the teacher's top-k at every response position (J = K there)
    mask:             [B, T] bool, response tokens (EOS included)
    rewards:          [B, T, J'] token rewards (0 for grpo, whose only reward is the outcome), on `reward_valid`
    reward_valid:     [B, T, J'] bool, the reward's slots (before the advantage and the loss re-choose them)
    teacher_logprobs: [B, T, J] the teacher's log-probs at `candidate_ids` for a divergence loss; None for pg
    reference:        [B, T] a frozen reference's log-prob of the sampled token (the KL term); None without one
    tis_weights:      [B, T] truncated importance weights against the engine's log-probs; None when off
    advantage_valid:  [B, T, J''] bool, the advantages' slots where they are not `valid` (a GKD-style loss, whose
                      support is the teacher's top-k while the advantages live on the strategy's, e.g. 2K for union);
                      None = `valid`. Only the metrics read the advantages then
    teacher_hidden:   [B, T, E] the teacher's final hidden states at the response positions, for a full-vocabulary
                      loss (`FULL_LOSSES`); None otherwise
    """

    candidate_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    reward_valid: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    tis_weights: torch.Tensor | None = None
    advantage_valid: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None

    def select(self, rows: torch.Tensor | list[int]) -> Targets:
        """The targets of the given rows (every tensor indexed along dim 0): one micro-batch's."""
        picked = {f.name: getattr(self, f.name)[rows] for f in fields(self) if getattr(self, f.name) is not None}
        return replace(self, **picked)


def _first_k(scores: TokenScores, k: int, requested: torch.Tensor | None) -> TokenScores:
    """`scores` cut to its first k top-k columns, with `requested` as its requested log-probs (also cut)."""

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[..., :k]

    return TokenScores(
        scores.sampled_logprobs, cut(scores.topk_ids), cut(scores.topk_logprobs), requested_logprobs=cut(requested)
    )


def build_targets(
    student: TokenScores,
    teacher: TokenScores | None,
    rollouts: Rollouts,
    objective: ObjectiveSettings,
    *,
    student_at_teacher_topk: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    outcome_rewards: torch.Tensor | None = None,
    exact_kl_BT: torch.Tensor | None = None,
) -> Targets:
    """Token rewards → advantages → the loss's support and weights, for one batch (SPEC §2–§4).

    student:  the behaviour policy's no-grad scores (sampled log-probs; top-k ids and log-probs when top_k > 0)
    teacher:  the teacher's scores of the same tokens, `requested_logprobs` = t at the student's top-k (None for a
              teacher that serves only its own top-k, strategy only_tch); None only for advantage=grpo
    student_at_teacher_topk: [B, T, K] s at the teacher's top-k (strategies with teacher slots), else None
    reference_logprobs: [B, T] a frozen reference's sampled-token log-probs (the KL term), or None
    outcome_rewards: [B] float verifiable rewards (grpo and token_reward+grpo), or None
    exact_kl_BT: [B, T] the exact per-position reverse KL(p‖q) (objective.token_reward full_reverse_kl*, top_k = 0):
              the sampled token's reward becomes −KL at its position, or at the next one (`exact_kl_rewards`)
    """
    o, mask_BT = objective, rollouts.response_mask
    teacher_lp_BTJ = None
    if o.advantage == "grpo":  # no teacher: the sampled token is the only slot, its advantage the outcome's
        candidate_ids_BTJ, valid_BTJ = rollouts.response_ids[..., None], mask_BT[..., None]
        old_lp_BTJ = student.sampled_logprobs[..., None]
        rewards_BTJ = torch.zeros_like(old_lp_BTJ)
    else:
        if teacher is None:
            raise ValueError(f"advantage mode {o.advantage!r} needs the teacher's scores")
        exact_BT = teacher.exact  # a cross-vocabulary teacher's exact positions (SPEC §9); None: all
        if o.top_k:
            student, teacher = (
                _first_k(student, o.top_k, student_at_teacher_topk),
                _first_k(teacher, o.top_k, teacher.requested_logprobs),
            )
        rewards = token_rewards_from_scores(
            student, teacher, rollouts.response_ids, mask_BT, top_k=o.top_k, strategy=o.strategy, weight=o.weight
        )
        if o.top_k and exact_BT is not None:  # the span signal on the sampled token wherever top-k is not exact
            rewards = with_span_fallback(
                rewards, exact_BT, student.sampled_logprobs, teacher.sampled_logprobs, rollouts.response_ids, mask_BT
            )
        candidate_ids_BTJ, valid_BTJ, rewards_BTJ = rewards.candidate_ids, rewards.valid, rewards.rewards
        token_reward = getattr(o, "token_reward", "log_ratio")
        if token_reward != "log_ratio":
            if exact_kl_BT is None or o.top_k:
                raise ValueError(f"token_reward {token_reward!r} needs top_k = 0 and the exact per-position KL")
            exact_BT = exact_kl_rewards(exact_kl_BT, mask_BT, next_position=token_reward == "full_reverse_kl_next")
            rewards_BTJ = torch.where(valid_BTJ, exact_BT[..., None], torch.zeros_like(rewards_BTJ))
        old_lp_BTJ, teacher_lp_BTJ = rewards.student_logprobs, rewards.teacher_logprobs
    adv = compute_advantages(
        o.advantage,
        rewards=rewards_BTJ,
        valid=valid_BTJ,
        response_mask=mask_BT,
        group_ids=rollouts.group_ids,
        outcome_rewards=outcome_rewards,
        outcome_weight=o.outcome_weight,
        candidate_ids=candidate_ids_BTJ,
        response_ids=rollouts.response_ids,
        sampled_old_logprobs=student.sampled_logprobs,
        old_logprobs=old_lp_BTJ,
    )
    candidate_ids_BTJ, loss_valid_BTJ = adv.candidate_ids, adv.valid
    advantage_valid_BTJ = None
    if o.loss in ("forward_kl", "jsd"):  # GKD-style objectives live on the teacher's top-k support
        if teacher is None or teacher.topk_ids is None or teacher.topk_logprobs is None:
            raise ValueError(f"loss {o.loss!r} needs the teacher's top-k")
        k = diagnostic_top_k(o.top_k)
        candidate_ids_BTJ, teacher_lp_BTJ = teacher.topk_ids[..., :k], teacher.topk_logprobs[..., :k]
        advantage_valid_BTJ, loss_valid_BTJ = adv.valid, mask_BT[..., None].expand_as(candidate_ids_BTJ)
    tis_BT = None
    if o.tis_cap is not None and rollouts.rollout_logprobs is not None:
        tis_BT = truncated_is_weights(student.sampled_logprobs, rollouts.rollout_logprobs, o.tis_cap, mask_BT)
    # build_targets always passes old_logprobs and sampled_old_logprobs, so every mode has ℓ_old at its slots.
    assert adv.old_logprobs is not None
    return Targets(
        candidate_ids=candidate_ids_BTJ,
        old_logprobs=adv.old_logprobs,
        advantages=adv.advantages,
        valid=loss_valid_BTJ,
        mask=mask_BT,
        rewards=rewards_BTJ,
        reward_valid=valid_BTJ,
        teacher_logprobs=None if o.loss == "pg" else teacher_lp_BTJ,
        reference=reference_logprobs,
        tis_weights=tis_BT,
        advantage_valid=advantage_valid_BTJ,
    )


def exact_kl_rewards(kl_BT: torch.Tensor, mask_BT: torch.Tensor, *, next_position: bool) -> torch.Tensor:
    """[B, T] the sampled token's reward from the exact per-position reverse KL: −KL_t at its own position t, or
    −KL_{t+1} at the next one (0 for a row's last response token: nothing follows it). KL_t depends only on the
    prefix y_<t, so as y_t's own reward its expected score-function gradient is 0 (a baseline); y_t does choose the
    state of t+1, so −KL_{t+1} is a one-step credit for it (SPEC §4, "Full-vocabulary objectives")."""
    kl_BT = torch.where(mask_BT.bool(), kl_BT.detach(), torch.zeros_like(kl_BT))
    if next_position:
        kl_BT = torch.nn.functional.pad(kl_BT[:, 1:], (0, 1))  # masks are prefixes of the row: t+1 masked ⇒ 0
    return -kl_BT


# ------------------------------------------------------------------------------------------------ the losses

LossFn = Callable[[torch.Tensor, Targets, dict, ObjectiveSettings], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(lp_BTJ: the student's log-probs at `candidate_ids`, with grad; the micro-batch's targets; `agg_loss`'s keyword
arguments; the settings) → (loss, detached metrics)."""


def _pg_loss(lp_BTJ: torch.Tensor, t: Targets, agg: dict, o: ObjectiveSettings) -> tuple[torch.Tensor, dict]:
    return policy_loss(
        lp_BTJ,
        t.old_logprobs,
        t.advantages,
        t.valid,
        t.mask,
        clip_ratio_low=o.clip_ratio_low,
        clip_ratio_high=o.clip_ratio_high,
        clip_ratio_c=o.clip_ratio_c,
        rollout_is_weights=t.tis_weights,
        **agg,
    )


def _divergence_loss(name: str, divergence: Callable[..., torch.Tensor]) -> LossFn:
    """A loss that aggregates a per-position divergence of the student from the teacher on the candidate slots."""

    def loss_fn(lp_BTJ: torch.Tensor, t: Targets, agg: dict, o: ObjectiveSettings) -> tuple[torch.Tensor, dict]:
        loss = agg_loss(divergence(lp_BTJ, t.teacher_logprobs, t.valid, o), t.mask, **agg)
        return loss, {f"{name}_loss": loss.detach()}

    return loss_fn


LOSSES: dict[str, LossFn] = {
    "pg": _pg_loss,
    "topk_kl": _divergence_loss("topk_kl", lambda s, t, v, o: topk_kl(s, t, v)),
    "forward_kl": _divergence_loss("forward_kl", lambda s, t, v, o: forward_kl(s, t, v)),
    "jsd": _divergence_loss("jsd", lambda s, t, v, o: jsd(s, t, v, beta=o.jsd_beta)),
}
"""The training losses by `objective.loss` name: the one dispatch point of `micro_loss`."""

FULL_LOSSES: dict[str, tuple[str, bool]] = {
    "full_reverse_kl": ("reverse_kl", False),
    "full_forward_kl": ("forward_kl", False),
    "full_jsd": ("jsd", True),
}
"""The full-vocabulary losses by `objective.loss` name: (`full_divergence`'s kind, whether it takes jsd_beta). Their
per-position divergence comes to `micro_loss` computed (`full_divergence_BT`)."""


def micro_loss(
    lp_BTJ: torch.Tensor,
    entropy_BT: torch.Tensor,
    targets: Targets,
    objective: ObjectiveSettings,
    *,
    global_num_tokens: Number,
    global_num_seqs: Number,
    full_divergence_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch (`targets` = its rows, `Targets.select`), divided by the *global* token/sequence
    count so that summing micro-batch gradients gives the batch gradient (SPEC §4). `lp_BTJ` holds the candidate
    columns, plus the sampled token's column last when a reference KL is on. For a `FULL_LOSSES` loss,
    `full_divergence_BT` [B, T] is its per-position divergence (with grad). Returns (loss, detached metrics)."""
    if objective.loss in FULL_LOSSES and full_divergence_BT is None:
        raise ValueError(f"objective.loss={objective.loss} needs the per-position divergence (full_divergence_BT)")
    if objective.loss not in LOSSES and objective.loss not in FULL_LOSSES:
        raise ValueError(
            f"objective.loss must be one of {sorted([*LOSSES, *FULL_LOSSES])} to train, got {objective.loss!r}"
        )
    agg: dict[str, Any] = dict(
        loss_agg_mode=objective.loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs
    )
    if targets.reference is not None:
        lp_BTJ, sampled_lp_BT = lp_BTJ[..., :-1], lp_BTJ[..., -1]
    if full_divergence_BT is not None and objective.loss in FULL_LOSSES:
        loss = agg_loss(full_divergence_BT, targets.mask, **agg)
        metrics = {f"{objective.loss}_loss": loss.detach()}
    else:
        loss, metrics = LOSSES[objective.loss](lp_BTJ, targets, agg, objective)
    if targets.reference is not None:
        kl = agg_loss(kl_penalty(sampled_lp_BT, targets.reference, objective.kl_type), targets.mask, **agg)
        loss = loss + objective.kl_coef * kl
        metrics["kl_reference"] = kl.detach()
    if objective.entropy_coef:
        entropy = agg_loss(entropy_BT, targets.mask, **agg)
        loss = loss - objective.entropy_coef * entropy
        metrics["entropy_bonus"] = entropy.detach()
    return loss, metrics
