"""Advantages (SPEC §3): token reward (the default), GRPO, their mix, and token-level GRPO on process rewards.

Shapes: B sequences, T response positions, J candidate slots. Everything here is computed without gradient.

`compute_advantages` returns the slots the policy loss scores (`Advantages`: ids, validity, advantage and old log-prob
per slot), so the trainer feeds any mode to `policy_loss` the same way. Groups are compared with a [B, B] same-group
matrix instead of `unique`: no device sync and no Python loop; fine for B up to a few thousand rollouts per step.

Omitted: value baselines, discounting, whitening, advantage clipping (the reference's OPD uses none of them), and
Dr.GRPO's no-std variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

AdvantageMode = Literal["token_reward", "grpo", "token_reward+grpo", "token_grpo"]

GRPO_EPS = 1e-6


@dataclass
class Advantages:
    """What `policy_loss` needs besides the current log-probs. All `[B, T, J]`.

    candidate_ids: long, the token ids whose log-probs enter the loss
    valid:         bool
    advantages:    float, 0 on invalid slots
    old_logprobs:  float, ℓ_old at the slots (the behaviour policy), or None when the caller gave none
    """

    candidate_ids: torch.Tensor
    valid: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None


def token_reward_advantages(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`A = r` on valid slots, 0 elsewhere (the reference's `token_reward_direct`). Any shape (rewards and valid
    alike)."""
    return torch.where(valid.bool(), rewards.detach(), torch.zeros_like(rewards))


def _group_mean_std(
    sums_B: torch.Tensor,
    counts_B: torch.Tensor,
    group_ids: torch.Tensor,
    sq_dev: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (mean, unbiased std) of the row's group, from per-row sums and counts of the group's samples.

    sq_dev(mean_B) gives each row's Σ (x − mean)² over its own samples, so the deviation pass sees the group mean.
    A group with ≤ 1 sample gets mean 0, std 1 (verl's GRPO convention).
    """
    same_BB = (group_ids[:, None] == group_ids[None, :]).to(sums_B.dtype)
    n_B = same_BB @ counts_B.to(sums_B.dtype)
    mean_B = same_BB @ sums_B / n_B.clamp_min(1)
    var_B = same_BB @ sq_dev(mean_B) / (n_B - 1).clamp_min(1)
    single = n_B <= 1
    mean_B = torch.where(single, torch.zeros_like(mean_B), mean_B)
    std_B = torch.where(single, torch.ones_like(var_B), var_B.sqrt())
    return mean_B, std_B


def grpo_advantages(
    outcome_rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GRPO outcome advantages broadcast over the response (SPEC §3).

    outcome_rewards: [B] float (1 correct / 0 wrong); group_ids: [B] long (rows of one prompt share an id)
    response_mask:   [B, T] bool
    Returns [B, T]: `(R_i − mean_g) / (std_g + 1e-6)` (unbiased std; a group of one uses mean 0, std 1), 0 where
    masked.
    """
    R_B = outcome_rewards.detach()
    R_B = R_B if R_B.is_floating_point() else R_B.float()
    mean_B, std_B = _group_mean_std(R_B, torch.ones_like(R_B), group_ids, lambda mean_B: (R_B - mean_B) ** 2)
    adv_B = (R_B - mean_B) / (std_B + GRPO_EPS)
    return adv_B[:, None] * response_mask.to(adv_B.dtype)


def token_grpo_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """Token-level GRPO on process rewards (SPEC §3; sampled-token only).

    token_rewards: [B, T] float, the sampled-token rewards; response_mask: [B, T] bool; group_ids: [B] long
    Per group, every valid token reward is normalised by the group's mean and unbiased std over all its valid tokens
    (eps 1e-6; a group with ≤ 1 valid token uses mean 0, std 1), then A_t = Σ_{t' ≥ t} r̃_{t'} (reverse cumulative
    sum along the response). Returns [B, T], 0 where masked.
    """
    mask_BT = response_mask.bool()
    r_BT = torch.where(mask_BT, token_rewards.detach(), torch.zeros_like(token_rewards))
    m_BT = mask_BT.to(r_BT.dtype)
    mean_B, std_B = _group_mean_std(
        r_BT.sum(-1), m_BT.sum(-1), group_ids, lambda mean_B: (((r_BT - mean_B[:, None]) ** 2) * m_BT).sum(-1)
    )
    normed_BT = (r_BT - mean_B[:, None]) / (std_B[:, None] + GRPO_EPS) * m_BT
    return normed_BT.flip(-1).cumsum(-1).flip(-1) * m_BT


def mix_advantages(
    token_adv: torch.Tensor,
    grpo_adv: torch.Tensor,
    outcome_weight: float,
    candidate_ids: torch.Tensor,
    valid: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    sampled_old_logprobs: torch.Tensor | None = None,
) -> Advantages:
    """`A_total = A_token + λ · A_grpo` (SPEC §3, λ = outcome_weight); the outcome term belongs to the *sampled* token.

    token_adv, candidate_ids, valid, old_logprobs: [B, T, J]; grpo_adv, response_ids, response_mask,
    sampled_old_logprobs: [B, T].
    Returns J + 1 slots. Where the sampled token is already a valid candidate (always with sampled-token rewards,
    top_k = 0), λ·A_grpo is added to that slot — so top_k = 0 is exactly the reference's `r + λ·A_grpo` on one ratio —
    and the extra slot is invalid. Elsewhere (top-k: the sampled token need not be a candidate; our extension) the extra
    slot holds the sampled token with advantage λ·A_grpo. Valid candidates hold distinct ids under every strategy, so
    at most one slot matches. Fixed J + 1 keeps shapes static (no device sync to look at the data).
    old_logprobs, when given, is extended with sampled_old_logprobs (required then) at the extra slot.
    """
    mask_BT = response_mask.bool()
    sampled_BT = torch.where(mask_BT, response_ids, torch.zeros_like(response_ids))
    outcome_BT = torch.where(mask_BT, outcome_weight * grpo_adv.detach(), torch.zeros_like(grpo_adv))
    outcome_BT = outcome_BT.to(token_adv.dtype)
    is_sampled_BTJ = valid.bool() & (candidate_ids == sampled_BT[..., None]) & mask_BT[..., None]
    merged_BT = is_sampled_BTJ.any(-1)
    advantages = token_reward_advantages(token_adv, valid) + outcome_BT[..., None] * is_sampled_BTJ
    old = None
    if old_logprobs is not None:
        if sampled_old_logprobs is None:
            raise ValueError("mix_advantages needs sampled_old_logprobs for the extra slot when old_logprobs is given")
        old = torch.cat([old_logprobs, sampled_old_logprobs.to(old_logprobs.dtype)[..., None]], dim=-1)
    return Advantages(
        candidate_ids=torch.cat([candidate_ids, sampled_BT[..., None]], dim=-1),
        valid=torch.cat([valid.bool(), (mask_BT & ~merged_BT)[..., None]], dim=-1),
        advantages=torch.cat([advantages, torch.where(merged_BT, 0.0, outcome_BT)[..., None]], dim=-1),
        old_logprobs=old,
    )


# ---------------------------------------------------------------------------------------------------------------------
# One dispatch point. Every mode takes the same keyword inputs (`_Inputs`) and checks the ones it needs.


@dataclass
class _Inputs:
    response_ids: torch.Tensor
    mask_BT: torch.Tensor
    rewards: torch.Tensor | None
    valid: torch.Tensor | None
    candidate_ids: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    sampled_old_logprobs: torch.Tensor | None
    outcome_rewards: torch.Tensor | None
    group_ids: torch.Tensor | None
    outcome_weight: float

    def require(self, mode: str, *names: str) -> list[torch.Tensor]:
        """The named inputs, in order; ValueError naming every missing one."""
        values = [getattr(self, name) for name in names]
        missing = [name for name, value in zip(names, values) if value is None]
        if missing:
            raise ValueError(f"advantage mode {mode!r} needs {', '.join(missing)}")
        return values

    def sampled_slot(self, adv_BT: torch.Tensor, old_BT: torch.Tensor | None) -> Advantages:
        ids_BT = torch.where(self.mask_BT, self.response_ids, torch.zeros_like(self.response_ids))
        old = None if old_BT is None else old_BT[..., None]
        return Advantages(ids_BT[..., None], self.mask_BT[..., None], adv_BT[..., None], old)


def _mode_token_reward(x: _Inputs) -> Advantages:
    rewards, valid, candidate_ids = x.require("token_reward", "rewards", "valid", "candidate_ids")
    return Advantages(candidate_ids, valid.bool(), token_reward_advantages(rewards, valid), x.old_logprobs)


def _mode_grpo(x: _Inputs) -> Advantages:
    outcome_rewards, group_ids = x.require("grpo", "outcome_rewards", "group_ids")
    return x.sampled_slot(grpo_advantages(outcome_rewards, group_ids, x.mask_BT), x.sampled_old_logprobs)


def _mode_mixed(x: _Inputs) -> Advantages:
    rewards, valid, candidate_ids, outcome_rewards, group_ids = x.require(
        "token_reward+grpo", "rewards", "valid", "candidate_ids", "outcome_rewards", "group_ids"
    )
    grpo_BT = grpo_advantages(outcome_rewards, group_ids, x.mask_BT)
    return mix_advantages(
        rewards,
        grpo_BT,
        x.outcome_weight,
        candidate_ids,
        valid,
        x.response_ids,
        x.mask_BT,
        x.old_logprobs,
        x.sampled_old_logprobs,
    )


def _mode_token_grpo(x: _Inputs) -> Advantages:
    rewards, group_ids = x.require("token_grpo", "rewards", "group_ids")
    if rewards.dim() == 3 and rewards.shape[-1] != 1:
        raise ValueError(
            f"advantage mode 'token_grpo' is sampled-token only (top_k = 0, J = 1), got J={rewards.shape[-1]}"
        )
    rewards_BT = rewards[..., 0] if rewards.dim() == 3 else rewards
    old_BT = x.sampled_old_logprobs
    if old_BT is None and x.old_logprobs is not None:
        old_BT = x.old_logprobs[..., 0]
    return x.sampled_slot(token_grpo_advantages(rewards_BT, x.mask_BT, group_ids), old_BT)


ADVANTAGE_MODES: dict[str, Callable[[_Inputs], Advantages]] = {
    "token_reward": _mode_token_reward,
    "grpo": _mode_grpo,
    "token_reward+grpo": _mode_mixed,
    "token_grpo": _mode_token_grpo,
}
assert set(ADVANTAGE_MODES) == set(get_args(AdvantageMode))


def compute_advantages(
    mode: AdvantageMode,
    *,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sampled_old_logprobs: torch.Tensor | None = None,
    outcome_rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    outcome_weight: float = 1.0,
) -> Advantages:
    """Advantages of one rollout batch for `mode` (SPEC §3), as the slots `policy_loss` scores.

    response_ids, response_mask: [B, T]
    rewards, valid, candidate_ids, old_logprobs: [B, T, J] — the `TokenRewards` fields (old_logprobs = its
        student_logprobs, the behaviour policy); needed by token_reward and token_reward+grpo; token_grpo needs
        sampled-token rewards ([B, T, 1] or [B, T])
    sampled_old_logprobs: [B, T] ℓ_old of the sampled tokens (the slot of grpo, token_grpo and the extra mixed slot)
    outcome_rewards: [B] verifiable rewards; group_ids: [B] (grpo, token_reward+grpo; token_grpo needs group_ids)
    outcome_weight: λ of token_reward+grpo
    Returns `Advantages`: J slots for token_reward, one (the sampled token) for grpo and token_grpo, J + 1 for
    token_reward+grpo (see `mix_advantages`); old_logprobs follows the same layout when the inputs allow it.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage mode must be one of {sorted(ADVANTAGE_MODES)}, got {mode!r}")
    inputs = _Inputs(
        response_ids,
        response_mask.bool(),
        rewards,
        valid,
        candidate_ids,
        old_logprobs,
        sampled_old_logprobs,
        outcome_rewards,
        group_ids,
        outcome_weight,
    )
    return ADVANTAGE_MODES[mode](inputs)
