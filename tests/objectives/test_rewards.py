"""Token rewards (SPEC §2) and advantages (SPEC §3) against the worked example, hand numbers and an independent
dense float64 reference written with loops and Python sets."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from opd.objectives import (
    STRATEGIES,
    build_candidates,
    candidate_rewards,
    compute_advantages,
    grpo_advantages,
    token_grpo_advantages,
    token_rewards,
    token_rewards_from_scores,
    topk_token_rewards,
)
from opd.types import TokenScores

ALL_STRATEGIES = ["only_stu", "only_tch", "intersection", "union", "union-intersection"]
ALL_WEIGHTS = ["student_p", "teacher_p", "none"]


# ---------------------------------------------------------------------------------------------------------------------
# Independent reference: one position at a time, Python lists and sets.


def reference_position(s_row: list[float], t_row: list[float], K: int, strategy: str, weight: str):
    """(ids, valid, weights, rewards) lists for one position, from full-vocabulary log-prob lists."""
    V = len(s_row)
    S = sorted(range(V), key=lambda v: -s_row[v])[:K]
    T = sorted(range(V), key=lambda v: -t_row[v])[:K]
    set_s, set_t = set(S), set(T)
    slots = {
        "only_stu": [(v, True) for v in S],
        "only_tch": [(v, True) for v in T],
        "intersection": [(v, v in set_t) for v in S],
        "union": [(v, True) for v in S] + [(v, v not in set_s) for v in T],
        "union-intersection": [(v, v not in set_t) for v in S] + [(v, v not in set_s) for v in T],
    }[strategy]
    x = {"student_p": lambda v: s_row[v], "teacher_p": lambda v: t_row[v], "none": lambda v: 0.0}[weight]
    raw = [math.exp(x(v)) if ok else 0.0 for v, ok in slots]
    if strategy != "union-intersection":
        total = sum(raw)
        raw = [w / total if total > 0 else 0.0 for w in raw]
    rewards = [w * (t_row[v] - s_row[v]) if ok else 0.0 for (v, ok), w in zip(slots, raw)]
    return [v for v, _ in slots], [ok for _, ok in slots], raw, rewards


def random_case(seed: int, B=2, T=5, V=11, V_pad=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z_s = torch.randn(B, T, V, generator=g, dtype=dtype) * 2
    z_t = torch.randn(B, T, V + V_pad, generator=g, dtype=dtype) * 2
    z_t[..., V:] = 50.0  # padding rows with huge logits: must never be selected nor carry mass
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -2:] = False
    mask[1, 0] = False
    return z_s, z_t, ids, mask


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("weight", ALL_WEIGHTS)
def test_dense_matches_independent_reference(strategy, weight):
    z_s, z_t, ids, mask = random_case(seed=len(strategy) * 7 + len(weight))
    tau_s, tau_t, K = 0.7, 1.3, 4
    out = token_rewards(
        z_s,
        z_t,
        ids,
        mask,
        top_k=K,
        strategy=strategy,
        weight=weight,
        student_temperature=tau_s,
        teacher_temperature=tau_t,
    )
    V = z_s.shape[-1]
    s_full = F.log_softmax(z_s / tau_s, dim=-1)
    t_full = F.log_softmax(z_t[..., :V] / tau_t, dim=-1)
    J = 2 * K if strategy.startswith("union") else K
    assert out.candidate_ids.shape == out.rewards.shape == out.valid.shape == out.weights.shape == (2, 5, J)
    for b in range(2):
        for t in range(5):
            ref_ids, ref_valid, ref_w, ref_r = reference_position(
                s_full[b, t].tolist(), t_full[b, t].tolist(), K, strategy, weight
            )
            assert out.candidate_ids[b, t].tolist() == ref_ids
            assert max(out.candidate_ids[b, t].tolist()) < V  # no padding id ever
            if not mask[b, t]:
                assert not out.valid[b, t].any()
                assert (out.rewards[b, t] == 0).all() and (out.weights[b, t] == 0).all()
                continue
            assert out.valid[b, t].tolist() == ref_valid
            torch.testing.assert_close(out.weights[b, t], torch.tensor(ref_w, dtype=torch.float64), rtol=0, atol=1e-12)
            torch.testing.assert_close(out.rewards[b, t], torch.tensor(ref_r, dtype=torch.float64), rtol=0, atol=1e-12)
    assert not out.rewards.requires_grad


def test_spec_worked_example():
    z_s = torch.tensor([2, 1, 0.5, 0, -1, -2], dtype=torch.float64).view(1, 1, 6)
    z_t = torch.tensor([1, 2, 0, 0.5, -1, -1], dtype=torch.float64).view(1, 1, 6)
    out = token_rewards(z_s, z_t, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), top_k=2)
    assert out.candidate_ids.flatten().tolist() == [0, 1]
    # SPEC prints s and t rounded to ~5 decimals (exact: −0.5846972, −1.6020834), so they get 5e-6; w and r are
    # printed to 6 correct decimals and must match to 1e-6.
    expect = {
        "student_logprobs": ([-0.584700, -1.584700], 5e-6),
        "teacher_logprobs": ([-1.602080, -0.602080], 5e-6),
        "weights": ([0.731059, 0.268941], 1e-6),
        "rewards": ([-0.743769, 0.264266], 1e-6),
    }
    for name, (values, atol) in expect.items():
        torch.testing.assert_close(
            getattr(out, name).flatten(), torch.tensor(values, dtype=torch.float64), rtol=0, atol=atol
        )


def test_sampled_token_mode():
    z_s, z_t, ids, mask = random_case(seed=3)
    ids[~mask] = 10**6  # a pad id out of range at masked positions must not break the gather
    out = token_rewards(z_s, z_t, ids, mask, top_k=0, student_temperature=0.9)
    V = z_s.shape[-1]
    s_full = F.log_softmax(z_s / 0.9, dim=-1)
    t_full = F.log_softmax(z_t[..., :V], dim=-1)
    assert out.rewards.shape == (2, 5, 1) and out.sampled_token
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                y = ids[b, t].item()
                assert out.candidate_ids[b, t, 0].item() == y
                assert abs(out.rewards[b, t, 0].item() - (t_full[b, t, y] - s_full[b, t, y]).item()) < 1e-12
            else:
                assert out.rewards[b, t, 0].item() == 0 and not out.valid[b, t, 0]


def chunked_scores(h, W, temperature, K, requested_ids, chunk):
    """What a chunked scorer returns: per chunk of positions, logits from hidden states, log-softmax, top-k, gathers."""
    B, T, _ = h.shape
    flat_h, flat_req = h.reshape(B * T, -1), requested_ids.reshape(B * T, -1)
    ids, lps, req = [], [], []
    for i in range(0, B * T, chunk):
        lp = F.log_softmax(flat_h[i : i + chunk] @ W.T / temperature, dim=-1)
        topk = lp.topk(K, dim=-1)
        ids.append(topk.indices)
        lps.append(topk.values)
        req.append(lp.gather(-1, flat_req[i : i + chunk]))
    return (torch.cat(ids).view(B, T, K), torch.cat(lps).view(B, T, K), torch.cat(req).view(B, T, -1))


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_sparse_core_from_chunks_equals_dense(strategy):
    g = torch.Generator().manual_seed(11)
    B, T, H, V, V_pad, K = 2, 7, 6, 13, 3, 4
    h_s = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    h_t = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    W_s = torch.randn(V, H, generator=g, dtype=torch.float64)
    W_t = torch.randn(V + V_pad, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    dense = token_rewards(
        h_s @ W_s.T, h_t @ W_t.T, ids, mask, top_k=K, strategy=strategy, weight="teacher_p", student_temperature=0.8
    )
    # Student pass first (its top-k), then the teacher scores the student's top-k, then the student scores T_t.
    s_ids, s_lp, _ = chunked_scores(h_s, W_s, 0.8, K, torch.zeros(B, T, 1, dtype=torch.long), chunk=3)
    t_ids, t_lp, t_at_s = chunked_scores(h_t, W_t[:V], 1.0, K, s_ids, chunk=5)
    _, _, s_at_t = chunked_scores(h_s, W_s, 0.8, K, t_ids, chunk=4)
    sparse = topk_token_rewards(s_ids, s_lp, t_ids, t_lp, t_at_s, s_at_t, mask, strategy=strategy, weight="teacher_p")
    via_scores = token_rewards_from_scores(
        TokenScores(torch.zeros(B, T), s_ids, s_lp, requested_logprobs=s_at_t),
        TokenScores(torch.zeros(B, T), t_ids, t_lp, requested_logprobs=t_at_s),
        ids,
        mask,
        top_k=K,
        strategy=strategy,
        weight="teacher_p",
    )
    for out in (sparse, via_scores):
        assert torch.equal(out.candidate_ids, dense.candidate_ids) and torch.equal(out.valid, dense.valid)
        torch.testing.assert_close(out.rewards, dense.rewards, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.weights, dense.weights, rtol=0, atol=1e-12)


def test_only_stu_needs_no_teacher_topk():
    g = torch.Generator().manual_seed(0)
    lp = F.log_softmax(torch.randn(1, 3, 8, generator=g), -1)
    s_lp, s_ids = lp.topk(3, -1)
    out = topk_token_rewards(s_ids, s_lp, None, None, s_lp - 0.5, None, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(out.rewards.sum(-1), torch.full((1, 3), -0.5))  # Σ_j w_j (t − s) with Σ w = 1
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        build_candidates(s_ids, None, torch.ones(1, 3, dtype=torch.bool), "intersection")


@pytest.mark.parametrize("weight", ALL_WEIGHTS)
def test_position_without_valid_slot_is_zero_not_nan(weight):
    # Disjoint top-k sets: `intersection` has no valid slot; `union-intersection` has all slots valid.
    z_s = torch.tensor([5.0, 4.0, 0.0, 0.0, -5.0, -6.0]).view(1, 1, 6)
    z_t = torch.tensor([-5.0, -6.0, 0.0, 0.0, 5.0, 4.0]).view(1, 1, 6)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = token_rewards(
        z_s, z_t, torch.zeros(1, 1, dtype=torch.long), mask, top_k=2, strategy="intersection", weight=weight
    )
    assert not out.valid.any()
    assert torch.equal(out.rewards, torch.zeros_like(out.rewards))
    assert torch.equal(out.weights, torch.zeros_like(out.weights))
    # The core alone, with -inf log-probs everywhere on a row with no valid slot.
    r, w = candidate_rewards(
        torch.full((1, 1, 3), float("-inf")),
        torch.full((1, 1, 3), float("-inf")),
        torch.zeros(1, 1, 3, dtype=torch.bool),
        strategy="union",
        weight=weight,
    )
    assert torch.isfinite(r).all() and torch.isfinite(w).all() and (r == 0).all() and (w == 0).all()


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("weight", ALL_WEIGHTS)
def test_teacher_equal_student_gives_zero_reward(strategy, weight):
    z, _, ids, mask = random_case(seed=5, V_pad=0)
    out = token_rewards(z, z.clone(), ids, mask, top_k=3, strategy=strategy, weight=weight)
    assert torch.equal(out.rewards, torch.zeros_like(out.rewards))


def test_bad_names_and_sizes_raise():
    z = torch.randn(1, 2, 5)
    ids, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="only_stu"):
        token_rewards(z, z, ids, mask, strategy="onlystu")
    with pytest.raises(ValueError, match="student_p"):
        token_rewards(z, z, ids, mask, weight="student")
    with pytest.raises(ValueError, match="V'=4"):
        token_rewards(z, z[..., :4], ids, mask, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        token_rewards(z, z, ids, mask, top_k=6)
    assert set(STRATEGIES) == set(ALL_STRATEGIES)


def test_bf16_logits_are_upcast():
    z_s, z_t, ids, mask = random_case(seed=9, dtype=torch.float32)
    out = token_rewards(z_s.bfloat16(), z_t.bfloat16(), ids, mask, top_k=3)
    assert out.rewards.dtype == torch.float32 and torch.isfinite(out.rewards).all()


# ---------------------------------------------------------------------------------------------------------------------
# Advantages.


def test_grpo_hand_numbers_including_group_of_one():
    R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([7, 7, 7, 3, 9])  # group 7 of three, groups 3 and 9 of one
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    A = grpo_advantages(R, groups, mask)
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased
    per_row = [(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6), (1 - 2 / 3) / (std + 1e-6), 1 / (1 + 1e-6), 0.0]
    expected = torch.tensor(per_row)[:, None] * mask
    torch.testing.assert_close(A, expected, rtol=0, atol=1e-6)


def fields(rw):
    """The TokenRewards fields compute_advantages takes."""
    return dict(rewards=rw.rewards, valid=rw.valid, candidate_ids=rw.candidate_ids, old_logprobs=rw.student_logprobs)


def test_token_reward_advantages_and_dispatch():
    z_s, z_t, ids, mask = random_case(seed=1)
    rw = token_rewards(z_s, z_t, ids, mask, top_k=3, strategy="union")
    adv = compute_advantages("token_reward", **fields(rw), response_ids=ids, response_mask=mask)
    assert torch.equal(adv.advantages, rw.rewards) and torch.equal(adv.candidate_ids, rw.candidate_ids)
    assert torch.equal(adv.old_logprobs, rw.student_logprobs)
    with pytest.raises(ValueError, match="token_grpo"):
        compute_advantages("ppo", **fields(rw), response_ids=ids, response_mask=mask)
    with pytest.raises(ValueError, match="outcome_rewards"):
        compute_advantages("grpo", response_ids=ids, response_mask=mask, group_ids=torch.zeros(2))
    with pytest.raises(ValueError, match="top_k = 0"):
        compute_advantages("token_grpo", **fields(rw), response_ids=ids, response_mask=mask, group_ids=torch.zeros(2))


def test_grpo_mode_scores_the_sampled_token():
    ids = torch.tensor([[4, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    sampled_old = -torch.rand(2, 3)
    adv = compute_advantages(
        "grpo",
        response_ids=ids,
        response_mask=mask,
        outcome_rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        sampled_old_logprobs=sampled_old,
    )
    assert adv.candidate_ids.shape == (2, 3, 1)
    assert adv.candidate_ids[..., 0].tolist() == [[4, 5, 0], [7, 8, 9]]
    assert torch.equal(adv.old_logprobs[..., 0], sampled_old)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv.advantages[..., 0], torch.tensor([[a, a, 0], [-a, -a, -a]]))


def test_mixing_with_topk_adds_the_sampled_slot():
    z_s, z_t, ids, mask = random_case(seed=2)
    ids[0, 0] = z_s[0, 0].argmax()  # the sampled token is a student top-k candidate here: merged into its slot
    rw = token_rewards(z_s, z_t, ids, mask, top_k=3)
    R, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    sampled_old = F.log_softmax(z_s, -1).gather(-1, torch.where(mask, ids, 0)[..., None])[..., 0]
    adv = compute_advantages(
        "token_reward+grpo",
        **fields(rw),
        response_ids=ids,
        response_mask=mask,
        outcome_rewards=R,
        group_ids=groups,
        outcome_weight=0.5,
        sampled_old_logprobs=sampled_old,
    )
    grpo = 0.5 * grpo_advantages(R, groups, mask).double()
    assert adv.advantages.shape == adv.old_logprobs.shape == (2, 5, 4)
    assert torch.equal(adv.candidate_ids[..., 3], torch.where(mask, ids, 0))
    torch.testing.assert_close(adv.old_logprobs[..., 3], sampled_old)
    for b in range(2):
        for t in range(5):
            in_topk = mask[b, t] and ids[b, t].item() in rw.candidate_ids[b, t].tolist()
            expected = rw.rewards[b, t].clone()
            if in_topk:
                expected[rw.candidate_ids[b, t].tolist().index(ids[b, t].item())] += grpo[b, t]
            torch.testing.assert_close(adv.advantages[b, t, :3], expected)
            assert adv.valid[b, t, 3].item() == (bool(mask[b, t]) and not in_topk)
            assert adv.advantages[b, t, 3].item() == (0.0 if in_topk or not mask[b, t] else grpo[b, t].item())
    assert adv.valid[0, 0, 3].item() is False and adv.valid[..., 3].any()


def test_mixing_with_sampled_token_adds_in_place():
    z_s, z_t, ids, mask = random_case(seed=4)
    rw = token_rewards(z_s, z_t, ids, mask, top_k=0)
    R, groups = torch.tensor([0.0, 1.0]), torch.tensor([3, 3])
    adv = compute_advantages(
        "token_reward+grpo",
        **fields(rw),
        response_ids=ids,
        response_mask=mask,
        outcome_rewards=R,
        group_ids=groups,
        outcome_weight=2.0,
        sampled_old_logprobs=rw.student_logprobs[..., 0],
    )
    expected = rw.rewards[..., 0] + 2.0 * grpo_advantages(R, groups, mask).double()
    torch.testing.assert_close(adv.advantages[..., 0], expected)  # r + λ·A_grpo on the one sampled slot
    assert not adv.valid[..., 1].any() and (adv.advantages[..., 1] == 0).all()  # the extra slot stays unused


def test_token_grpo_hand_numbers():
    r = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    groups = torch.tensor([0, 0, 1])
    A = token_grpo_advantages(r, mask, groups)
    # group 0 valid tokens {1, 2, 3}: mean 2, unbiased std 1. group 1 {5, 6}: mean 5.5, std sqrt(0.5).
    e = 1e-6
    n0 = [(1 - 2) / (1 + e), (2 - 2) / (1 + e)]
    n1 = [(5 - 5.5) / (math.sqrt(0.5) + e), (6 - 5.5) / (math.sqrt(0.5) + e)]
    expected = torch.tensor([[n0[0] + n0[1], n0[1], 0], [(3 - 2) / (1 + e), 0, 0], [n1[0] + n1[1], n1[1], 0]])
    torch.testing.assert_close(A, expected, rtol=0, atol=1e-6)
    # Through the dispatcher, with sampled-token rewards.
    z_s, z_t, ids, m = random_case(seed=6)
    rw = token_rewards(z_s, z_t, ids, m, top_k=0)
    g2 = torch.tensor([0, 0])
    adv = compute_advantages("token_grpo", **fields(rw), response_ids=ids, response_mask=m, group_ids=g2)
    torch.testing.assert_close(adv.advantages[..., 0], token_grpo_advantages(rw.rewards[..., 0], m, g2))
    torch.testing.assert_close(adv.old_logprobs, rw.student_logprobs)
    assert (adv.advantages[..., 0][~m] == 0).all()
