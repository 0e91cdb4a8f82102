"""Token rewards of on-policy distillation (SPEC §1–§2): sampled-token and top-k, five candidate strategies, three
weightings.

Shapes: B sequences, T response positions, V vocabulary (V' ≥ V for the teacher), K top-k, J candidate slots per
position (K, or 2K for `union` / `union-intersection`, 1 for the sampled token). One sparse core on what the trainer
has per position (`strategy_spec` → `build_candidates` → `gather_candidate_logprobs` → `candidate_rewards`, composed
by `topk_token_rewards` / `token_rewards_from_scores`) and a dense reference over `[B, T, V]` logits
(`token_rewards`, SPEC §8: tests and small models only) share the math. A teacher's padding rows (V' > V) are left
out of its log-softmax and top-k (docs/design.md, "opd.objectives.rewards"). Rewards and weights come back detached.

Omitted: the reference's `kl_estimator` option (its reward code always uses k1, `s − t`) and its union-id
bookkeeping keys; the slot layout here is fixed per strategy instead (student slots first, then teacher slots).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

from opd.types import TokenScores

Strategy = Literal["only_stu", "only_tch", "intersection", "union", "union-intersection"]
Weight = Literal["student_p", "teacher_p", "none"]


@dataclass
class TokenRewards:
    """Rewards of one batch at its candidate slots (SPEC §2). All `[B, T, J]`.

    candidate_ids:    long, the token ids scored at each slot (J = 1 and the sampled token when top_k = 0)
    rewards:          float, `w · (t(v) − s(v))` on valid slots, exactly 0 on invalid slots and masked positions;
                      detached
    valid:            bool, slot counts (strategy validity AND response mask)
    weights:          float, w (0 on invalid slots; 1 on the sampled token when top_k = 0); detached
    student_logprobs: float, s(v) = full-vocabulary student log-prob at the candidate (as computed: keeps grad if the
                      logits had it); arbitrary but finite on invalid slots
    teacher_logprobs: float, t(v) = full-vocabulary teacher log-prob at the candidate
    sampled_token:    True when the candidates are the sampled tokens (top_k = 0)
    """

    candidate_ids: torch.Tensor
    rewards: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor
    student_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    sampled_token: bool = False


# ---------------------------------------------------------------------------------------------------------------------
# Strategies: one table, one dispatch point.


@dataclass(frozen=True)
class StrategySpec:
    """How a top-k strategy builds its J slots (SPEC §2 table).

    student_slots:     the student's top-k S_t fill K slots (first)
    teacher_slots:     the teacher's top-k T_t fill K slots (after the student's, if any)
    needs_membership:  validity tests S_t against T_t, so both id sets are needed
    renormalise:       weights are renormalised over the valid slots (False: raw probabilities)
    valid:             (S∈T [B,T,K], T∈S [B,T,K], all-True [B,T,K]) → validity blocks, one per K slots; without
                       `needs_membership` the first two are all-True placeholders (the strategy ignores them)
    """

    student_slots: bool
    teacher_slots: bool
    needs_membership: bool
    renormalise: bool
    valid: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[torch.Tensor]]

    @property
    def needs_student_logprobs_at_teacher_topk(self) -> bool:
        """The trainer must gather the student's log-probs at T_t (for the teacher slots)."""
        return self.teacher_slots

    @property
    def needs_teacher_topk(self) -> bool:
        """The teacher scorer must return its own top-k ids (and log-probs)."""
        return self.teacher_slots or self.needs_membership


STRATEGIES: dict[str, StrategySpec] = {
    "only_stu": StrategySpec(True, False, False, True, lambda s_in_t, t_in_s, all_: [all_]),
    "only_tch": StrategySpec(False, True, False, True, lambda s_in_t, t_in_s, all_: [all_]),
    "intersection": StrategySpec(True, False, True, True, lambda s_in_t, t_in_s, all_: [s_in_t]),
    "union": StrategySpec(True, True, True, True, lambda s_in_t, t_in_s, all_: [all_, ~t_in_s]),
    "union-intersection": StrategySpec(True, True, True, False, lambda s_in_t, t_in_s, all_: [~s_in_t, ~t_in_s]),
}

# Log of the unnormalised weight of a slot from (a = s(v), b = t(v)); "none" is exp(0) = 1 per slot.
_WEIGHT_LOGITS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "student_p": lambda a, b: a,
    "teacher_p": lambda a, b: b,
    "none": lambda a, b: torch.zeros_like(a),
}

assert set(STRATEGIES) == set(get_args(Strategy)) and set(_WEIGHT_LOGITS) == set(get_args(Weight))


def strategy_spec(strategy: str) -> StrategySpec:
    """The `StrategySpec` of a strategy name; ValueError naming the accepted ones otherwise."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    return STRATEGIES[strategy]


def _check_weight(weight: str) -> None:
    if weight not in _WEIGHT_LOGITS:
        raise ValueError(f"weight must be one of {sorted(_WEIGHT_LOGITS)}, got {weight!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Sparse core.


def rowwise_isin(x_BTK: torch.Tensor, y_BTM: torch.Tensor) -> torch.Tensor:
    """[B, T, K] bool: x[b,t,k] ∈ {y[b,t,m]}. Sort + binary search: O(K log M) memory per position, not K·M."""
    y_sorted = y_BTM.sort(dim=-1).values.contiguous()
    idx = torch.searchsorted(y_sorted, x_BTK.contiguous()).clamp_max(y_BTM.shape[-1] - 1)
    return y_sorted.gather(-1, idx) == x_BTK


class Candidates(NamedTuple):
    """ids: [B, T, J] long; valid: [B, T, J] bool. The slot layout is fixed per strategy (`StrategySpec`): K slots of
    S_t if `student_slots`, then K slots of T_t if `teacher_slots`."""

    ids: torch.Tensor
    valid: torch.Tensor


def build_candidates(
    student_topk_ids: torch.Tensor | None,
    teacher_topk_ids: torch.Tensor | None,
    response_mask: torch.Tensor,
    strategy: Strategy,
) -> Candidates:
    """Candidate slots and their validity (SPEC §2 table).

    student_topk_ids: [B, T, K] long, S_t (None allowed for `only_tch`)
    teacher_topk_ids: [B, T, K] long, T_t (None allowed for `only_stu`)
    response_mask:    [B, T] bool; masked positions get no valid slot
    Returns `Candidates(ids [B,T,J], valid [B,T,J])`, unpackable as a pair; slots are S_t then T_t.
    """
    spec = strategy_spec(strategy)
    if (spec.student_slots or spec.needs_membership) and student_topk_ids is None:
        raise ValueError(f"strategy {strategy!r} needs student_topk_ids")
    if spec.needs_teacher_topk and teacher_topk_ids is None:
        raise ValueError(f"strategy {strategy!r} needs teacher_topk_ids")
    ref_ids = student_topk_ids if student_topk_ids is not None else teacher_topk_ids
    assert ref_ids is not None  # every strategy has student or teacher slots, so one was required above
    all_BTK = torch.ones_like(ref_ids, dtype=torch.bool)
    s_in_t = t_in_s = all_BTK
    if spec.needs_membership:
        assert student_topk_ids is not None and teacher_topk_ids is not None  # both required above
        s_in_t = rowwise_isin(student_topk_ids, teacher_topk_ids)
        t_in_s = rowwise_isin(teacher_topk_ids, student_topk_ids)
    blocks = spec.valid(s_in_t, t_in_s, all_BTK)
    ids = []
    if spec.student_slots:
        assert student_topk_ids is not None  # required above
        ids.append(student_topk_ids)
    if spec.teacher_slots:
        assert teacher_topk_ids is not None  # required above (teacher slots need the teacher's top-k)
        ids.append(teacher_topk_ids)
    valid_BTJ = torch.cat(blocks, dim=-1) & response_mask.bool()[..., None]
    return Candidates(torch.cat(ids, dim=-1), valid_BTJ)


def gather_candidate_logprobs(
    strategy: Strategy,
    student_topk_logprobs: torch.Tensor | None,
    teacher_logprobs_at_student_topk: torch.Tensor | None,
    teacher_topk_logprobs: torch.Tensor | None,
    student_logprobs_at_teacher_topk: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(student_lp [B,T,J], teacher_lp [B,T,J]) in the slot layout of `build_candidates`, from the four [B,T,K]
    tensors the scorers produce (s at S_t, t at S_t, t at T_t, s at T_t). Unneeded ones may be None."""
    spec = strategy_spec(strategy)
    student, teacher = [], []
    if spec.student_slots:
        if student_topk_logprobs is None or teacher_logprobs_at_student_topk is None:
            raise ValueError(f"strategy {strategy!r} needs student_topk_logprobs and teacher_logprobs_at_student_topk")
        student.append(student_topk_logprobs)
        teacher.append(teacher_logprobs_at_student_topk)
    if spec.teacher_slots:
        if teacher_topk_logprobs is None or student_logprobs_at_teacher_topk is None:
            raise ValueError(f"strategy {strategy!r} needs teacher_topk_logprobs and student_logprobs_at_teacher_topk")
        student.append(student_logprobs_at_teacher_topk)
        teacher.append(teacher_topk_logprobs)
    return torch.cat(student, dim=-1), torch.cat(teacher, dim=-1)


def candidate_rewards(
    student_lp: torch.Tensor,
    teacher_lp: torch.Tensor,
    valid: torch.Tensor,
    *,
    strategy: Strategy,
    weight: Weight,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and rewards at the candidate slots (SPEC §2), both detached.

    student_lp, teacher_lp: [B, T, J] full-vocabulary log-probs s(v), t(v) at the candidates (not renormalised)
    valid:                  [B, T, J] bool
    Returns (rewards [B,T,J], weights [B,T,J]): `w = exp(x) / Σ_valid exp(x)` with x = s, t or 0 per `weight`
    (raw `exp(x)` for `union-intersection`), `r = w · (t − s)`; both 0 on invalid slots. A position with no valid
    slot gets all zeros (the 0/0 of its normaliser is guarded, never NaN).
    """
    spec = strategy_spec(strategy)
    _check_weight(weight)
    valid = valid.bool()
    with torch.no_grad():
        a, b = student_lp.detach(), teacher_lp.detach()
        log_w = _WEIGHT_LOGITS[weight](a, b).masked_fill(~valid, float("-inf"))
        if spec.renormalise:
            lse = torch.logsumexp(log_w, dim=-1, keepdim=True)
            # No valid slot: lse = -inf and log_w - lse would be -inf - (-inf) = NaN. Any finite shift keeps w = 0.
            log_w = log_w - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        weights = torch.where(valid, log_w.exp(), torch.zeros_like(a))
        rewards = torch.where(valid, weights * (b - a), torch.zeros_like(a))
    return rewards, weights


def topk_token_rewards(
    student_topk_ids: torch.Tensor | None,
    student_topk_logprobs: torch.Tensor | None,
    teacher_topk_ids: torch.Tensor | None,
    teacher_topk_logprobs: torch.Tensor | None,
    teacher_logprobs_at_student_topk: torch.Tensor | None,
    student_logprobs_at_teacher_topk: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    strategy: Strategy = "only_stu",
    weight: Weight = "student_p",
) -> TokenRewards:
    """Top-k OPD rewards from the per-position tensors the chunked scorers produce (all [B, T, K]; the `StrategySpec`
    says which may be None: `only_stu` needs only S_t, s(S_t), t(S_t)). Equals `token_rewards` on dense logits."""
    ids_BTJ, valid_BTJ = build_candidates(student_topk_ids, teacher_topk_ids, response_mask, strategy)
    student_lp, teacher_lp = gather_candidate_logprobs(
        strategy,
        student_topk_logprobs,
        teacher_logprobs_at_student_topk,
        teacher_topk_logprobs,
        student_logprobs_at_teacher_topk,
    )
    rewards, weights = candidate_rewards(student_lp, teacher_lp, valid_BTJ, strategy=strategy, weight=weight)
    return TokenRewards(ids_BTJ, rewards, valid_BTJ, weights, student_lp, teacher_lp, sampled_token=False)


def sampled_token_rewards(
    student_lp: torch.Tensor, teacher_lp: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> TokenRewards:
    """Sampled-token OPD (top_k = 0): `r_t = t(y_t) − s(y_t)` on valid positions, 0 elsewhere.

    student_lp, teacher_lp: [B, T] log-probs of the sampled tokens; response_ids, response_mask: [B, T].
    Returns `TokenRewards` with J = 1 (candidate = the sampled token; masked positions hold id 0).
    """
    mask_BT = response_mask.bool()
    with torch.no_grad():
        delta = torch.where(mask_BT, teacher_lp.detach() - student_lp.detach(), torch.zeros_like(student_lp))
    ids = torch.where(mask_BT, response_ids, torch.zeros_like(response_ids))
    return TokenRewards(
        candidate_ids=ids[..., None],
        rewards=delta[..., None],
        valid=mask_BT[..., None],
        weights=mask_BT[..., None].to(delta.dtype),
        student_logprobs=student_lp[..., None],
        teacher_logprobs=teacher_lp[..., None],
        sampled_token=True,
    )


def token_rewards_from_scores(
    student: TokenScores,
    teacher: TokenScores,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    top_k: int,
    strategy: Strategy = "only_stu",
    weight: Weight = "student_p",
) -> TokenRewards:
    """Rewards from the two models' `TokenScores` (the trainer's path).

    Convention: `teacher.requested_logprobs` = t at the student's top-k ids; `student.requested_logprobs` = s at the
    teacher's top-k ids (only needed when `strategy_spec(strategy).needs_student_logprobs_at_teacher_topk`).
    top_k = 0 uses the sampled-token log-probs only.
    """
    if top_k == 0:
        return sampled_token_rewards(student.sampled_logprobs, teacher.sampled_logprobs, response_ids, response_mask)
    return topk_token_rewards(
        student.topk_ids,
        student.topk_logprobs,
        teacher.topk_ids,
        teacher.topk_logprobs,
        teacher.requested_logprobs,
        student.requested_logprobs,
        response_mask,
        strategy=strategy,
        weight=weight,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Dense reference API (SPEC §8).


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 → fp32 for log-softmax; fp32 and fp64 are kept (the tests compare in fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def token_rewards(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    top_k: int = 16,
    strategy: Strategy = "only_stu",
    weight: Weight = "student_p",
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
) -> TokenRewards:
    """OPD token rewards from dense logits (SPEC §2, §8).

    student_logits: [B, T, V] raw logits at the response positions (before temperature)
    teacher_logits: [B, T, V'] with V' ≥ V; rows ≥ V are vocabulary padding and are ignored (SPEC §1, docs/design.md)
    response_ids:   [B, T] long, the sampled tokens
    response_mask:  [B, T] bool
    top_k:          K ≥ 0; 0 = sampled-token reward `t(y) − s(y)` (J = 1)
    Returns `TokenRewards` ([B, T, J]); rewards are 0 on invalid slots and masked positions.
    """
    strategy_spec(strategy)
    _check_weight(weight)
    V = student_logits.shape[-1]
    if teacher_logits.shape[-1] < V:
        raise ValueError(
            f"teacher vocabulary must be ≥ the student's (extra rows are padding), got V'={teacher_logits.shape[-1]}"
            f" < V={V}"
        )
    if not 0 <= top_k <= V:
        raise ValueError(f"top_k must be in [0, V={V}], got {top_k}")
    if student_temperature <= 0 or teacher_temperature <= 0:
        raise ValueError(f"temperatures must be > 0, got {student_temperature=}, {teacher_temperature=}")
    student_lp_BTV = F.log_softmax(_upcast(student_logits) / student_temperature, dim=-1)
    teacher_lp_BTV = F.log_softmax(_upcast(teacher_logits[..., :V]) / teacher_temperature, dim=-1)
    mask_BT = response_mask.bool()
    if top_k == 0:
        ids_BT1 = torch.where(mask_BT, response_ids, torch.zeros_like(response_ids))[..., None]
        student_lp_BT = student_lp_BTV.gather(-1, ids_BT1)[..., 0]
        teacher_lp_BT = teacher_lp_BTV.gather(-1, ids_BT1)[..., 0]
        return sampled_token_rewards(student_lp_BT, teacher_lp_BT, response_ids, mask_BT)
    student_topk_logprobs, student_topk_ids = student_lp_BTV.topk(top_k, dim=-1)
    teacher_topk_logprobs, teacher_topk_ids = teacher_lp_BTV.topk(top_k, dim=-1)
    return topk_token_rewards(
        student_topk_ids,
        student_topk_logprobs,
        teacher_topk_ids,
        teacher_topk_logprobs,
        teacher_lp_BTV.gather(-1, student_topk_ids),
        student_lp_BTV.gather(-1, teacher_topk_ids),
        mask_BT,
        strategy=strategy,
        weight=weight,
    )
