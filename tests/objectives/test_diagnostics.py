"""Diagnostics (SPEC §6) on a hand-built example with known overlap numbers, a set-based random reference, and AUROC
against a brute-force pair count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from opd.objectives import (
    auroc,
    gap_recovery,
    opd_diagnostics,
    opd_diagnostics_from_scores,
    reward_diagnostics,
    seq_rewards,
)
from opd.types import TokenScores

L = math.log


def hand_example():
    """B = 2, T = 3, K = 2.
    (0,0): S = [0, 1], T = [1, 2]: O = [F, T]; s(S) = log[.5, .3], t(S) = log[.2, .6]  → I = {1}
    (0,1): S = [2, 3], T = [3, 2]: O = [T, T]; s(S) = log[.4, .4], t(S) = log[.1, .3]  → I = {2, 3}
    (1,0): S = [0, 1], T = [4, 5]: O = [F, F]; s(S) = log[.6, .2], t(S) = log[.1, .1]  → I = ∅
    everything else masked (garbage values)."""
    s_ids = torch.tensor([[[0, 1], [2, 3], [9, 8]], [[0, 1], [7, 7], [7, 7]]])
    t_ids = torch.tensor([[[1, 2], [3, 2], [9, 8]], [[4, 5], [7, 7], [7, 7]]])
    s_lp = torch.log(torch.tensor([[[0.5, 0.3], [0.4, 0.4], [0.9, 0.9]], [[0.6, 0.2], [0.9, 0.9], [0.9, 0.9]]]))
    t_at_s = torch.log(torch.tensor([[[0.2, 0.6], [0.1, 0.3], [0.9, 0.9]], [[0.1, 0.1], [0.9, 0.9], [0.9, 0.9]]]))
    t_lp = torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.2], [0.9, 0.9]], [[0.7, 0.2], [0.9, 0.9], [0.9, 0.9]]]))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    h_s = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    h_t = torch.tensor([[1.5, 1.0, 99.0], [0.0, 99.0, 99.0]])
    return s_ids, s_lp, t_ids, t_lp, t_at_s, mask, h_s, h_t


def test_hand_built_example():
    s_ids, s_lp, t_ids, t_lp, t_at_s, mask, h_s, h_t = hand_example()
    d = opd_diagnostics(s_ids, s_lp, t_ids, t_lp, t_at_s, mask, student_entropy=h_s, teacher_entropy=h_t, chunk_size=2)
    adv_01 = (0.5 * L(0.25 / 0.5) + 0.5 * L(0.75 / 0.5)) / 2  # p̄ = [.5, .5], q̄ = [.25, .75], |I| = 2
    expected = {
        "overlap_ratio": (0.5 + 1.0 + 0.0) / 3,
        "overlap_mass_student": (0.3 + 0.8 + 0.0) / 3,
        "overlap_mass_teacher": (0.6 + 0.4 + 0.0) / 3,
        "overlap_advantage": (0.0 + adv_01) / 2,  # (1,0) has I = ∅ and is left out
        "topk_mass_student": (0.8 + 0.8 + 0.8) / 3,
        "topk_mass_teacher": (0.9 + 0.7 + 0.9) / 3,
        "entropy_student": (1 + 2 + 3) / 3,
        "entropy_teacher": (1.5 + 1.0 + 0.0) / 3,
        "entropy_gap": (0.5 + 1.0 + 3.0) / 3,
        # chunk_size = 2: chunk 0 = positions {0, 1}, chunk 1 = {2} (all masked → 0)
        "overlap_ratio/chunk_0": (0.5 + 1.0 + 0.0) / 3,
        "overlap_ratio/chunk_1": 0.0,
        "entropy_gap/chunk_1": 0.0,
        "overlap_advantage/chunk_0": (0.0 + adv_01) / 2,
    }
    for key, value in expected.items():
        assert d[key].item() == pytest.approx(value, abs=1e-6), key
    assert adv_01 < 0
    assert all(torch.isfinite(v) for v in d.values()) and all(v.dim() == 0 for v in d.values())

    # chunk_size = 1: one chunk per position.
    d1 = opd_diagnostics(s_ids, s_lp, t_ids, t_lp, t_at_s, mask, chunk_size=1)
    assert d1["overlap_ratio/chunk_0"].item() == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert d1["overlap_ratio/chunk_1"].item() == pytest.approx(1.0)
    assert d1["overlap_advantage/chunk_1"].item() == pytest.approx(adv_01)
    assert "entropy_student" not in d1


def test_empty_mask_gives_zeros_not_nan():
    s_ids, s_lp, t_ids, t_lp, t_at_s, mask, h_s, h_t = hand_example()
    none = torch.zeros_like(mask)
    d = opd_diagnostics(s_ids, s_lp, t_ids, t_lp, t_at_s, none, student_entropy=h_s, teacher_entropy=h_t)
    assert all(v.item() == 0.0 for v in d.values())
    r = reward_diagnostics(torch.full((2, 3, 2), float("nan")), none)
    assert all(v.item() == 0.0 for v in r.values())
    assert torch.equal(seq_rewards(h_t, h_s, none), torch.zeros(2))


def test_random_against_set_reference_and_from_scores():
    g = torch.Generator().manual_seed(0)
    B, T, V, K = 2, 6, 12, 4
    s = F.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    t = F.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    mask = torch.rand(B, T, generator=g) > 0.3
    s_lp, s_ids = s.topk(K, -1)
    t_lp, t_ids = t.topk(K, -1)
    t_at_s = t.gather(-1, s_ids)
    student = TokenScores(torch.zeros(B, T), s_ids, s_lp, entropy=-(s.exp() * s).sum(-1))
    teacher = TokenScores(torch.zeros(B, T), t_ids, t_lp, entropy=-(t.exp() * t).sum(-1), requested_logprobs=t_at_s)
    d = opd_diagnostics_from_scores(student, teacher, mask, chunk_size=4)
    ratios, mass_s, mass_t, gaps = [], [], [], []
    for b, pos in mask.nonzero().tolist():
        S, Tset = s_ids[b, pos].tolist(), set(t_ids[b, pos].tolist())
        inter = [v for v in S if v in Tset]
        ratios.append(len(inter) / K)
        mass_s.append(sum(math.exp(s[b, pos, v]) for v in inter))
        mass_t.append(sum(math.exp(t[b, pos, v]) for v in inter))
        gaps.append(abs(teacher.entropy[b, pos] - student.entropy[b, pos]).item())
    for key, vals in [
        ("overlap_ratio", ratios),
        ("overlap_mass_student", mass_s),
        ("overlap_mass_teacher", mass_t),
        ("entropy_gap", gaps),
    ]:
        assert d[key].item() == pytest.approx(sum(vals) / len(vals), abs=1e-12), key
    assert d["overlap_advantage"].item() <= 0


def test_identical_models_have_full_overlap_and_zero_advantage():
    g = torch.Generator().manual_seed(1)
    lp = F.log_softmax(torch.randn(2, 5, 10, generator=g), -1)
    lp_k, ids = lp.topk(3, -1)
    d = opd_diagnostics(ids, lp_k, ids, lp_k, lp_k, torch.ones(2, 5, dtype=torch.bool))
    assert d["overlap_ratio"].item() == 1.0
    assert d["overlap_advantage"].item() == pytest.approx(0.0, abs=1e-7)
    assert d["overlap_mass_student"].item() == pytest.approx(d["overlap_mass_teacher"].item())


def test_reward_diagnostics_and_seq_rewards():
    r = torch.tensor([[[1.0, -3.0], [2.0, 0.0], [9.0, 9.0]]])  # position rewards: −2, 2, (masked)
    mask = torch.tensor([[True, True, False]])
    d = reward_diagnostics(r, mask, chunk_size=1)
    assert d["reward_mean"].item() == 0.0 and d["reward_abs_mean"].item() == 2.0
    assert d["reward_mean/chunk_0"].item() == -2.0 and d["reward_mean/chunk_2"].item() == 0.0
    t_lp = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, -0.5, -0.5]])
    s_lp = torch.tensor([[-2.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    torch.testing.assert_close(
        seq_rewards(t_lp, s_lp, torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)), torch.tensor([0.5, 0.5])
    )


def brute_force_auroc(scores, labels):
    pos = [s for s, label in zip(scores, labels) if label]
    neg = [s for s, label in zip(scores, labels) if not label]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auroc_against_pair_count(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (40,), generator=g).float()  # many ties
    labels = torch.rand(40, generator=g) > 0.4
    assert auroc(scores, labels).item() == pytest.approx(brute_force_auroc(scores.tolist(), labels.tolist()))
    cont = torch.randn(40, generator=g)
    assert auroc(cont, labels).item() == pytest.approx(brute_force_auroc(cont.tolist(), labels.tolist()))


def test_auroc_edge_cases():
    assert auroc(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 1])).item() == 0.5  # one class absent
    assert auroc(torch.tensor([1.0, 2.0]), torch.tensor([0, 0])).item() == 0.5
    assert auroc(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 1])).item() == 1.0
    assert auroc(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0, 1, 1])).item() == 0.0


def test_gap_recovery():
    assert gap_recovery(0.3, 0.5, 0.7).item() == pytest.approx(0.5)
    assert gap_recovery(0.3, 0.2, 0.7).item() == pytest.approx(-0.25)
    assert gap_recovery(0.4, 0.5, 0.4).item() == 0.0  # no gap: 0, not inf/NaN
    torch.testing.assert_close(
        gap_recovery(torch.tensor([0.1, 0.2]), torch.tensor([0.5, 0.2]), torch.tensor(0.9)),
        torch.tensor([0.5, 0.0], dtype=torch.float64),
    )
