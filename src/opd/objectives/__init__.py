"""The math of OPD as pure tensor functions (SPEC §1–§6): no model, no config, no I/O, no `.item()`.

rewards      token rewards (sampled-token and five top-k strategies × three weightings); `token_rewards` is the
             dense reference API of SPEC §8, `topk_token_rewards` / `token_rewards_from_scores` the trainer's path
advantages   token reward, GRPO, their mix, token-level GRPO; `compute_advantages` dispatches on the mode
losses       PPO-clip policy loss over candidate slots, `agg_loss`, KL/entropy terms, IS weights, SFT, extensions
diagnostics  overlap, shared mass, overlap advantage, entropies, rewards per position chunk; AUROC, gap recovery;
             the step's reward, advantage and IS-weight statistics
targets      `build_targets`: one step's `Targets` from the two models' scores; `micro_loss` over the `LOSSES` table
full_vocab   `full_divergence`: exact reverse KL, forward KL and JSD over the whole vocabulary from both models'
             hidden states and heads, chunked (the `full_*` losses)
"""

from opd.objectives.advantages import (
    AdvantageMode,
    Advantages,
    compute_advantages,
    grpo_advantages,
    mix_advantages,
    token_grpo_advantages,
    token_reward_advantages,
)
from opd.objectives.diagnostics import (
    DIAGNOSTIC_TOP_K,
    auroc,
    diagnostic_top_k,
    gap_recovery,
    is_weight_stats,
    opd_diagnostics,
    opd_diagnostics_from_scores,
    reward_diagnostics,
    reward_stats,
    seq_reward_metrics,
    seq_rewards,
    teacher_logprobs_at_student_topk,
)
from opd.objectives.full_vocab import full_divergence
from opd.objectives.losses import (
    KLKind,
    LossAggMode,
    agg_loss,
    entropy_from_logits,
    forward_kl,
    full_reverse_kl,
    jsd,
    kl_penalty,
    policy_loss,
    sft_loss,
    topk_kl,
    truncated_is_weights,
)
from opd.objectives.rewards import (
    STRATEGIES,
    Candidates,
    Strategy,
    StrategySpec,
    TokenRewards,
    Weight,
    build_candidates,
    candidate_rewards,
    gather_candidate_logprobs,
    sampled_token_rewards,
    strategy_spec,
    token_rewards,
    token_rewards_from_scores,
    topk_token_rewards,
)
from opd.objectives.targets import LOSSES, LossFn, ObjectiveSettings, Targets, build_targets, micro_loss

__all__ = [
    "DIAGNOSTIC_TOP_K",
    "LOSSES",
    "STRATEGIES",
    "AdvantageMode",
    "Advantages",
    "Candidates",
    "KLKind",
    "LossAggMode",
    "LossFn",
    "ObjectiveSettings",
    "Strategy",
    "StrategySpec",
    "Targets",
    "TokenRewards",
    "Weight",
    "agg_loss",
    "auroc",
    "build_candidates",
    "build_targets",
    "candidate_rewards",
    "compute_advantages",
    "diagnostic_top_k",
    "entropy_from_logits",
    "forward_kl",
    "full_divergence",
    "full_reverse_kl",
    "gap_recovery",
    "gather_candidate_logprobs",
    "grpo_advantages",
    "is_weight_stats",
    "jsd",
    "kl_penalty",
    "micro_loss",
    "mix_advantages",
    "opd_diagnostics",
    "opd_diagnostics_from_scores",
    "policy_loss",
    "reward_diagnostics",
    "reward_stats",
    "sampled_token_rewards",
    "seq_reward_metrics",
    "seq_rewards",
    "sft_loss",
    "strategy_spec",
    "teacher_logprobs_at_student_topk",
    "token_grpo_advantages",
    "token_reward_advantages",
    "token_rewards",
    "token_rewards_from_scores",
    "topk_kl",
    "topk_token_rewards",
    "truncated_is_weights",
]
