"""Policy loss, aggregation, KL/IS/SFT helpers and the extension objectives (SPEC §4–§5) against closed forms, hand
numbers and dense float64 references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from opd.objectives import (
    agg_loss,
    compute_advantages,
    entropy_from_logits,
    forward_kl,
    full_reverse_kl,
    jsd,
    kl_penalty,
    policy_loss,
    sft_loss,
    token_rewards,
    topk_kl,
    truncated_is_weights,
)

ALL_STRATEGIES = ["only_stu", "only_tch", "intersection", "union", "union-intersection"]
ALL_WEIGHTS = ["student_p", "teacher_p", "none"]
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_batch(seed: int, B=3, T=4, V=9, V_pad=2, mask_pattern=None):
    g = torch.Generator().manual_seed(seed)
    z_s = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    z_t = torch.randn(B, T, V + V_pad, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool) if mask_pattern is None else mask_pattern
    if mask_pattern is None:
        mask[0, 3:] = False
        mask[2, 1:] = False
    return z_s, z_t, ids, mask


def token_reward_adv(rw, ids, mask):
    return compute_advantages(
        "token_reward",
        rewards=rw.rewards,
        valid=rw.valid,
        candidate_ids=rw.candidate_ids,
        old_logprobs=rw.student_logprobs,
        response_ids=ids,
        response_mask=mask,
    )


def student_logprobs(z, ids, tau):
    return F.log_softmax(z / tau, dim=-1).gather(-1, ids)


# ---------------------------------------------------------------------------------------------------------------------
# Gradient of the policy loss.


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_policy_gradient_closed_form(strategy):
    z_s, z_t, ids, mask = make_batch(seed=len(strategy))
    tau = 0.8
    rw = token_rewards(z_s, z_t, ids, mask, top_k=3, strategy=strategy, student_temperature=tau)
    adv = token_reward_adv(rw, ids, mask)
    z = z_s.clone().requires_grad_(True)
    lp = student_logprobs(z, adv.candidate_ids, tau)
    torch.testing.assert_close(adv.old_logprobs, lp.detach(), rtol=0, atol=1e-12)  # rewards' s = the trainer's ℓ
    loss, metrics = policy_loss(lp, adv.old_logprobs, adv.advantages, adv.valid, mask)
    loss.backward()

    B, T, V = z.shape
    N = int(mask.sum())
    p = F.softmax(z_s / tau, dim=-1)
    closed = torch.zeros_like(z_s)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            for j in range(adv.candidate_ids.shape[-1]):
                if adv.valid[b, t, j]:
                    e_v = F.one_hot(adv.candidate_ids[b, t, j], V).double()
                    closed[b, t] -= adv.advantages[b, t, j] * (e_v - p[b, t]) / tau / N
    torch.testing.assert_close(z.grad, closed, rtol=0, atol=1e-12)

    # Autograd of a dense float64 reference: −(1/N) Σ_valid A · exp(ℓ − ℓ_old) (ratio 1 → no clipping).
    z_ref = z_s.clone().requires_grad_(True)
    lp_full = F.log_softmax(z_ref / tau, dim=-1)
    ref = torch.zeros((), dtype=torch.float64)
    for b, t, j in adv.valid.nonzero().tolist():
        ell = lp_full[b, t, adv.candidate_ids[b, t, j]]
        ref = ref - adv.advantages[b, t, j] * torch.exp(ell - ell.detach()) / N
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(z.grad, z_ref.grad, rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac"] == 0 and metrics["ppo_kl"] == 0 and not metrics["pg_loss"].requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_divisor_sum_to_full_batch(mode):
    z_s, z_t, ids, mask = make_batch(seed=21, B=4)
    rw = token_rewards(z_s, z_t, ids, mask, top_k=3, strategy="union")
    adv = token_reward_adv(rw, ids, mask)
    # Perturb the old log-probs so that ratios ≠ 1 and clipping is exercised too.
    noise = torch.randn(adv.candidate_ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    old = student_logprobs(z_s, adv.candidate_ids, 1.0) + 0.3 * noise
    kwargs = dict(loss_agg_mode=mode, loss_scale_factor=7.0)

    z_full = z_s.clone().requires_grad_(True)
    full, _ = policy_loss(
        student_logprobs(z_full, adv.candidate_ids, 1.0), old, adv.advantages, adv.valid, mask, **kwargs
    )
    full.backward()

    z_micro = z_s.clone().requires_grad_(True)
    n_tokens, n_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    total = 0.0
    for rows in ([0], [1, 2], [3]):
        lp = student_logprobs(z_micro[rows], adv.candidate_ids[rows], 1.0)
        part, _ = policy_loss(
            lp,
            old[rows],
            adv.advantages[rows],
            adv.valid[rows],
            mask[rows],
            global_num_tokens=n_tokens,
            global_num_seqs=n_seqs,
            **kwargs,
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(z_micro.grad, z_full.grad, rtol=0, atol=1e-12)


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # valid: row0 {1, 2}, row1 {4}, row2 none (not counted as a sequence)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "token-mean", global_num_tokens=10).item() == pytest.approx(0.7)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum", global_num_seqs=7).item() == pytest.approx(1.0)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 4) / 2 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.35)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        assert agg_loss(loss[:2] * float("nan"), empty, mode).item() == 0.0  # empty mask: 0, never NaN
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, mask, "token-sum")


def test_ppo_clip_and_dual_clip_by_hand():
    # Four slots at one position: (A, ratio) = (1, 1.5), (1, 0.5), (−1, 0.5), (−1, 5).
    A = torch.tensor([[[1.0, 1.0, -1.0, -1.0]]])
    old = torch.zeros(1, 1, 4)
    lp = torch.log(torch.tensor([[[1.5, 0.5, 0.5, 5.0]]]))
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = policy_loss(lp, old, A, valid, mask)
    # max(−1.5, −1.2) + max(−0.5, −0.8) + max(0.5, 0.8) + min(max(5, 1.2), 3)
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 0.8 + 3.0, abs=1e-6)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 4)  # slots 0 and 2 use the clipped ratio
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)  # slot 3 hits the dual clip
    # IS weights scale the position's summed loss.
    loss_w, _ = policy_loss(lp, old, A, valid, mask, rollout_is_weights=torch.tensor([[0.5]]))
    assert loss_w.item() == pytest.approx(0.5 * loss.item(), abs=1e-6)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("weight", ALL_WEIGHTS)
def test_teacher_equal_student_gives_zero_gradient(strategy, weight):
    z_s, _, ids, mask = make_batch(seed=2, V_pad=0)
    rw = token_rewards(z_s, z_s.clone(), ids, mask, top_k=3, strategy=strategy, weight=weight)
    adv = token_reward_adv(rw, ids, mask)
    z = z_s.clone().requires_grad_(True)
    lp = student_logprobs(z, adv.candidate_ids, 1.0)
    loss, _ = policy_loss(lp, lp.detach(), adv.advantages, adv.valid, mask)
    loss.backward()
    assert loss.item() == 0 and torch.equal(z.grad, torch.zeros_like(z))


def test_position_without_valid_slot_gives_zero_gradient_not_nan():
    # Position 0: disjoint top-2 sets → `intersection` has no valid slot. Position 1: masked.
    z_s = torch.tensor([[[5.0, 4.0, 0.0, 0.0, -5.0, -6.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]], requires_grad=True)
    z_t = torch.tensor([[[-5.0, -6.0, 0.0, 0.0, 5.0, 4.0], [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]]])
    ids = torch.zeros(1, 2, dtype=torch.long)
    mask = torch.tensor([[True, False]])
    rw = token_rewards(z_s.detach(), z_t, ids, mask, top_k=2, strategy="intersection")
    adv = token_reward_adv(rw, ids, mask)
    lp = student_logprobs(z_s, adv.candidate_ids, 1.0)
    lp = torch.where(adv.valid, lp, torch.full_like(lp, float("-inf")))  # garbage on invalid slots must not leak
    loss, metrics = policy_loss(lp, lp.detach(), adv.advantages, adv.valid, mask)
    loss.backward()
    assert loss.item() == 0 and torch.equal(z_s.grad, torch.zeros_like(z_s))
    assert all(torch.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------------------------------------------------
# KL, entropy, IS weights, SFT.


def test_kl_penalty_definitions():
    lp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), lp - ref)
    d = ref - lp
    k3 = torch.exp(d.clamp(-20, 20)) - d.clamp(-20, 20) - 1
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3.clamp(-10, 10))
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), k3.clamp(-10, 10))
    assert kl_penalty(lp, ref, "k3")[-1].item() == 10.0  # exp(20) clamped
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(lp, ref, "k2")


def test_entropy_and_truncated_is_weights():
    z = torch.randn(3, 7, dtype=torch.float64)
    p = F.softmax(z / 0.5, -1)
    torch.testing.assert_close(entropy_from_logits(z, 0.5), -(p * p.log()).sum(-1))
    w = truncated_is_weights(
        torch.tensor([[0.0, -1.0, 0.0]]),
        torch.tensor([[-1.0, 0.0, 0.0]]),
        cap=2.0,
        mask=torch.tensor([[True, True, False]]),
    )
    torch.testing.assert_close(w, torch.tensor([[2.0, math.exp(-1.0), 0.0]]))


def test_sft_loss_global_token_mean():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=g) > 0.3
    full, m = sft_loss(lp, mask)
    assert full.item() == pytest.approx((-lp[mask]).mean().item())
    assert m["num_tokens"].item() == mask.sum().item()
    parts = sum(sft_loss(lp[r], mask[r], global_num_tokens=mask.sum())[0] for r in ([0, 1], [2], [3]))
    assert parts.item() == pytest.approx(full.item())
    assert sft_loss(lp, torch.zeros_like(mask))[0].item() == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Extension objectives vs dense float64 references.


def _support_case(seed: int, N=6, J=5):
    g = torch.Generator().manual_seed(seed)
    s = F.log_softmax(torch.randn(N, 20, generator=g, dtype=torch.float64), -1)[:, :J]
    t = F.log_softmax(torch.randn(N, 20, generator=g, dtype=torch.float64), -1)[:, :J]
    valid = torch.rand(N, J, generator=g) > 0.3
    valid[0] = False  # a position with no valid slot
    valid[1] = True
    return s, t, valid


def _renormalised(lp_row, valid_row):
    """Python-loop renormalisation on the valid slots: {slot: log p̄}."""
    idx = [j for j in range(len(valid_row)) if valid_row[j]]
    lse = torch.logsumexp(lp_row[idx], 0)
    return {j: lp_row[j] - lse for j in idx}


def _reference_divergence(s, t, valid, kind, beta=0.5):
    out = []
    for n in range(s.shape[0]):
        if not valid[n].any():
            out.append(torch.zeros((), dtype=s.dtype))
            continue
        ls, lt = _renormalised(s[n], valid[n]), _renormalised(t[n], valid[n])
        idx = list(ls)
        ps, pt = torch.stack([ls[j] for j in idx]), torch.stack([lt[j] for j in idx])
        if kind == "reverse":
            out.append((ps.exp() * (ps - pt)).sum())
        elif kind == "forward":
            out.append((pt.exp() * (pt - ps)).sum())
        else:  # trl's generalized_jsd_loss on the renormalised support
            if beta == 0:
                out.append(F.kl_div(ps, pt, reduction="sum", log_target=True))
            elif beta == 1:
                out.append(F.kl_div(pt, ps, reduction="sum", log_target=True))
            else:
                b = torch.tensor(beta, dtype=s.dtype)
                mix = torch.logsumexp(torch.stack([ps + torch.log1p(-b), pt + torch.log(b)]), dim=0)
                kl_t = F.kl_div(mix, pt, reduction="sum", log_target=True)
                kl_s = F.kl_div(mix, ps, reduction="sum", log_target=True)
                out.append(beta * kl_t + (1 - beta) * kl_s)
    return torch.stack(out)


@pytest.mark.parametrize(
    "fn,kind,beta",
    [(topk_kl, "reverse", None), (forward_kl, "forward", None)] + [(jsd, "jsd", b) for b in (0.0, 0.3, 0.5, 1.0)],
)
def test_support_divergences_match_dense_reference(fn, kind, beta):
    s, t, valid = _support_case(seed=3)
    s1, s2 = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    got = fn(s1, t, valid) if beta is None else fn(s1, t, valid, beta=beta)
    ref = _reference_divergence(s2, t, valid, kind, beta if beta is not None else 0.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert got[0].item() == 0.0
    weights = torch.arange(1.0, s.shape[0] + 1, dtype=torch.float64)
    (got * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(s1.grad, s2.grad, rtol=0, atol=1e-12)
    assert torch.isfinite(s1.grad).all() and (s1.grad[~valid] == 0).all()


def test_topk_kl_with_full_support_is_the_full_kl_and_logits_work():
    g = torch.Generator().manual_seed(4)
    zs, zt = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(3, 8, generator=g, dtype=torch.float64)
    valid = torch.ones(3, 8, dtype=torch.bool)
    ps, pt = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    full = (ps.exp() * (ps - pt)).sum(-1)
    torch.testing.assert_close(topk_kl(zs, zt, valid), full)  # raw logits: renormalisation removes the constant
    torch.testing.assert_close(forward_kl(ps, pt, valid), (pt.exp() * (pt - ps)).sum(-1))


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_full_reverse_kl_matches_dense(chunk_size):
    g = torch.Generator().manual_seed(5)
    N, V = 10, 7
    zs = torch.randn(N, V, generator=g, dtype=torch.float64)
    zt = torch.randn(N, V + 2, generator=g, dtype=torch.float64)
    zt[:, V:] = 40.0  # padding rows are ignored
    mask = torch.rand(N, generator=g) > 0.3
    z1, z2 = zs.clone().requires_grad_(True), zs.clone().requires_grad_(True)
    got = full_reverse_kl(z1, zt, mask, chunk_size=chunk_size, student_temperature=0.7, teacher_temperature=1.2)
    s, t = F.log_softmax(z2 / 0.7, -1), F.log_softmax(zt[:, :V] / 1.2, -1)
    ref = torch.where(mask, (s.exp() * (s - t)).sum(-1), 0.0)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    w = torch.randn(N, generator=g, dtype=torch.float64)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda z: full_reverse_kl(z, zt, mask, chunk_size=chunk_size), (zs.clone().requires_grad_(True),)
    )
