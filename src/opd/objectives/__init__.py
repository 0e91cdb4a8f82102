"""The math of OPD as pure tensor functions (SPEC §1–§6): no model, no config, no I/O, no `.item()`.

rewards      token rewards (sampled-token and five top-k strategies × three weightings); `token_rewards` is the
             dense reference API of SPEC §8, `topk_token_rewards` / `token_rewards_from_scores` the trainer's path
advantages   token reward, GRPO, their mix, token-level GRPO; `compute_advantages` dispatches on the mode
losses       PPO-clip policy loss over candidate slots, `agg_loss`, KL/entropy terms, IS weights, SFT, extensions
diagnostics  overlap, shared mass, overlap advantage, entropies, rewards per position chunk; AUROC, gap recovery
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
    opd_diagnostics,
    opd_diagnostics_from_scores,
    reward_diagnostics,
    seq_rewards,
)
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

__all__ = [
    "AdvantageMode",
    "DIAGNOSTIC_TOP_K",
    "Advantages",
    "Candidates",
    "KLKind",
    "LossAggMode",
    "STRATEGIES",
    "Strategy",
    "StrategySpec",
    "TokenRewards",
    "Weight",
    "agg_loss",
    "auroc",
    "build_candidates",
    "candidate_rewards",
    "compute_advantages",
    "diagnostic_top_k",
    "entropy_from_logits",
    "forward_kl",
    "full_reverse_kl",
    "gap_recovery",
    "gather_candidate_logprobs",
    "grpo_advantages",
    "jsd",
    "kl_penalty",
    "mix_advantages",
    "opd_diagnostics",
    "opd_diagnostics_from_scores",
    "policy_loss",
    "reward_diagnostics",
    "sampled_token_rewards",
    "seq_rewards",
    "sft_loss",
    "strategy_spec",
    "token_grpo_advantages",
    "token_reward_advantages",
    "token_rewards",
    "token_rewards_from_scores",
    "topk_kl",
    "topk_token_rewards",
    "truncated_is_weights",
]
