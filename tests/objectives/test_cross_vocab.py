import pytest
import torch

from opd.objectives.cross_vocab import span_sums, span_teacher_logprobs, with_span_fallback
from opd.objectives.rewards import sampled_token_rewards, topk_token_rewards

# two rows; row 0: spans (2 student : 1 teacher), (1 : 1), (1 : 3), one unaligned student token; row 1: (3 : 2)
STUDENT_SPAN = torch.tensor([[0, 0, 1, 2, -1], [0, 0, 0, -1, -1]])
TEACHER_SPAN = torch.tensor([[0, 1, 2, 2, 2], [0, 0, -1, -1, -1]])


def _reference(student_lp, teacher_lp, credit):
    """Per token, in float64 and plain Python: the teacher's log-prob the credit gives it."""
    out = student_lp.clone()
    for b in range(student_lp.shape[0]):
        spans = {int(k) for k in STUDENT_SPAN[b] if k >= 0}
        for k in spans:
            mine = [t for t in range(5) if STUDENT_SPAN[b, t] == k]
            T = sum(float(teacher_lp[b, j]) for j in range(5) if TEACHER_SPAN[b, j] == k)
            S = sum(float(student_lp[b, t]) for t in mine)
            for t in mine:
                if credit == "even":
                    out[b, t] = T / len(mine)
                elif t == mine[-1]:
                    out[b, t] = T - S + float(student_lp[b, t])
    return out


@pytest.mark.parametrize("credit", ["even", "last"])
def test_span_credit_matches_a_float64_reference_and_keeps_every_span_sum(credit):
    g = torch.Generator().manual_seed(0)
    student_lp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    teacher_lp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    got = span_teacher_logprobs(student_lp, teacher_lp, STUDENT_SPAN, TEACHER_SPAN, credit=credit)
    assert torch.allclose(got, _reference(student_lp, teacher_lp, credit), atol=1e-12, rtol=0)
    rewards = got - student_lp
    assert torch.allclose(
        span_sums(rewards, STUDENT_SPAN, 3),
        span_sums(teacher_lp, TEACHER_SPAN, 3) - span_sums(student_lp, STUDENT_SPAN, 3),
        atol=1e-12,
    )
    assert (rewards[STUDENT_SPAN < 0] == 0).all()  # unaligned: no teacher signal


def test_span_fallback_keeps_topk_where_exact_and_the_sampled_span_reward_elsewhere():
    g = torch.Generator().manual_seed(1)
    B, T, K = 2, 5, 3
    ids = torch.randint(0, 9, (B, T, K), generator=g)
    s_lp, t_lp = -torch.rand(B, T, K, generator=g), -torch.rand(B, T, K, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4] = False
    topk = topk_token_rewards(ids, s_lp, None, None, t_lp, None, mask)
    exact = torch.tensor([[True, False, True, False, True], [False] * 5])
    sampled_s, sampled_t = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    response = torch.randint(0, 9, (B, T), generator=g)
    out = with_span_fallback(topk, exact, sampled_s, sampled_t, response, mask)
    assert out.rewards.shape == (B, T, K + 1)
    assert torch.equal(out.rewards[..., :K][exact], topk.rewards[exact])
    assert not out.valid[..., :K][~exact].any()
    span = sampled_token_rewards(sampled_s, sampled_t, response, mask)
    fallback = mask & ~exact
    assert torch.equal(out.rewards[..., K][fallback], span.rewards[..., 0][fallback])
    assert torch.equal(out.valid[..., K], fallback)
