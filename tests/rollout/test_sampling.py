"""`opd.rollout.sampling`: top-k / top-p filtering, and the nucleus mass in integers within its bound of the exact
sums."""

from __future__ import annotations

import torch

from opd.rollout.sampling import filter_logits


def test_filter_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)  # probs ≈ .64 .24 .09 .03
    inf = float("-inf")
    assert filter_logits(logits, top_k=2)[0, 2:].tolist() == [inf, inf]
    assert torch.isfinite(filter_logits(logits, top_p=0.7)[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)[0]).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.95)[0]).tolist() == [True, True, True, False]


def test_nucleus_mass_in_integers_is_within_its_bound_of_the_exact_sums():
    """`nucleus_mass_before(exact=True)` (the top-p sums of `run.deterministic` on CUDA, where torch has no
    deterministic float cumsum) against float64 sums of the same probabilities: within V × 2^-53 (each probability
    rounded to a multiple of 2^-52), at a Qwen vocabulary; the float32 path is further off than that, by its own
    rounding. And `filter_logits` keeps the same nucleus either way, away from ties at the boundary."""
    from opd.rollout.sampling import nucleus_mass_before

    generator = torch.Generator().manual_seed(0)
    vocab = 151_936
    probs_BV = (torch.randn(3, vocab, generator=generator, dtype=torch.float64) * 3).softmax(-1).sort(-1, True).values
    reference_BV = probs_BV.cumsum(-1) - probs_BV
    exact_BV = nucleus_mass_before(probs_BV, exact=True)
    assert exact_BV.dtype == torch.float64
    bound = vocab * 2.0**-53
    assert (exact_BV - reference_BV).abs().max().item() <= bound
    float_BV = nucleus_mass_before(probs_BV.float(), exact=False).double()
    assert (float_BV - reference_BV).abs().max().item() > 100 * bound
    assert nucleus_mass_before(probs_BV.float()).dtype == torch.float32  # None on the CPU: the float path
    assert torch.equal(nucleus_mass_before(probs_BV.float()), nucleus_mass_before(probs_BV.float(), exact=False))
    kept = [(reference_BV < p).sum(-1) for p in (0.5, 0.9, 0.95)]
    for p, count in zip((0.5, 0.9, 0.95), kept):
        assert torch.equal((nucleus_mass_before(probs_BV, exact=True) < p).sum(-1), count)
