import numpy as np
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


# prefix credit: row 0's first span has 2 student tokens over 1 teacher token (token 0 ends inside teacher token 0);
# row 1's span has 3 student tokens over 2 teacher tokens (token 0 ends inside teacher token 0, token 1 inside 1)
PREFIX_AT = torch.tensor([[0, -1, -1, -1, -1], [0, 1, -1, -1, -1]])


def _prefix_reference(student_lp, teacher_lp, prefix_lp):
    """Per token, in float64 and plain Python: L_i (the teacher's log-prob of the span's text through token i: its
    span's teacher tokens before PREFIX_AT plus the prefix log-prob there; the span's sum on its last token), then
    L_i − L_prev."""
    out = student_lp.clone()
    for b in range(student_lp.shape[0]):
        for k in {int(x) for x in STUDENT_SPAN[b] if x >= 0}:
            mine = [t for t in range(5) if STUDENT_SPAN[b, t] == k]
            theirs = [j for j in range(5) if TEACHER_SPAN[b, j] == k]
            previous = 0.0
            for t in mine:
                if t == mine[-1]:
                    cumulative = sum(float(teacher_lp[b, j]) for j in theirs)
                else:
                    at = int(PREFIX_AT[b, t])
                    cumulative = sum(float(teacher_lp[b, j]) for j in theirs if j < at) + float(prefix_lp[b, t])
                out[b, t] = cumulative - previous
                previous = cumulative
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prefix_credit_matches_a_float64_reference_and_keeps_every_span_sum(dtype):
    g = torch.Generator().manual_seed(2)
    student_lp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    teacher_lp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    prefix_lp = -torch.rand(2, 5, generator=g, dtype=torch.float64) * 0.5
    got = span_teacher_logprobs(
        student_lp.to(dtype),
        teacher_lp.to(dtype),
        STUDENT_SPAN,
        TEACHER_SPAN,
        credit="prefix",
        prefix_at_BT=PREFIX_AT,
        prefix_lp_BT=prefix_lp.to(dtype),
    )
    want = _prefix_reference(student_lp, teacher_lp, prefix_lp)
    assert torch.allclose(got.double(), want, atol=1e-12 if dtype == torch.float64 else 1e-6, rtol=0)
    rewards = got.double() - student_lp.to(dtype).double()
    assert torch.allclose(
        span_sums(rewards, STUDENT_SPAN, 3),
        span_sums(teacher_lp, TEACHER_SPAN, 3) - span_sums(student_lp, STUDENT_SPAN, 3),
        atol=1e-12 if dtype == torch.float64 else 1e-6,
    )
    # one-to-one spans (row 0, spans 1) and one student token over 3 teacher tokens (span 2): t − s, as every credit
    even = span_teacher_logprobs(student_lp, teacher_lp, STUDENT_SPAN, TEACHER_SPAN, credit="even")
    assert torch.allclose(got.double()[0, 2:4], even[0, 2:4], atol=1e-6, rtol=0)
    assert torch.equal(got[0, 2].double(), teacher_lp.to(dtype)[0, 1].double())  # one-to-one: exactly t(u)
    assert (rewards[STUDENT_SPAN < 0] == 0).all()


def test_prefix_credit_gives_a_right_first_digit_beside_a_wrong_second_one_its_own_reward():
    """The digit-pair case: student "4" "7", teacher "47". The teacher puts 0.9 on numbers that begin with "4" and
    0.01 on "47"; the student 0.9 on "4". `prefix` gives "4" the reward log 0.9 − log 0.9 = 0 and "7" the whole
    penalty log(0.01/0.9) − s("7"); `even` (the old split) pushes the right "4" down with the wrong "7"."""
    span = torch.tensor([[0, 0]])
    teacher = torch.tensor([[0]])
    student_lp = torch.tensor([[0.9, 0.5]]).log()
    teacher_lp = torch.tensor([[0.01]]).log()
    got = span_teacher_logprobs(
        student_lp,
        teacher_lp,
        span,
        teacher,
        credit="prefix",
        prefix_at_BT=torch.tensor([[0, -1]]),
        prefix_lp_BT=torch.tensor([[0.9, 0.0]]).log(),
    )
    reward = got - student_lp
    assert reward[0, 0].abs() < 1e-6
    assert torch.allclose(reward[0, 1], torch.tensor(0.01 / 0.9 / 0.5).log(), atol=1e-6)
    even = span_teacher_logprobs(student_lp, teacher_lp, span, teacher, credit="even") - student_lp
    assert even[0, 0] < -2  # the old split's penalty on the right first digit


def test_a_span_credit_outside_the_three_is_refused_in_one_line():
    with pytest.raises(ValueError, match="span_credit must be one of prefix, even, last, got 'middle'"):
        span_teacher_logprobs(
            torch.zeros(1, 2), torch.zeros(1, 1), torch.tensor([[0, 0]]), torch.tensor([[0]]), credit="middle"
        )  # type: ignore[arg-type]


def _vocab_bytes():
    """A teacher vocabulary's bytes: digits and digit pairs, words sharing stems, bytes 0xff (the end of the byte
    order), and special tokens (no text)."""
    words = [b"4", b"47", b"40", b"4x", b"5", b"55", b"a", b"ab", b"abc", b"abd", b"b", b"\xff", b"\xff\xff", b"\xff1"]
    return [b"", *words, b"", b"\xfe\xff", b" ", b" a", b" ab"]


def test_prefix_log_probs_match_a_dense_float64_reference():
    from opd.data.token_alignment import TokenBytes
    from opd.scoring import OutputHead
    from opd.teacher.cross_vocab import PrefixIndex, prefix_logprobs

    table = _vocab_bytes()
    lengths = np.array([len(b) for b in table], dtype=np.int64)
    special = np.array([not b for b in table])
    index = PrefixIndex.build(TokenBytes(table, lengths, special, "plain"))
    g = torch.Generator().manual_seed(3)
    V, E = len(table) + 3, 8  # 3 head rows past the tokenizer: padding, never a prefix's
    head = OutputHead(torch.randn(V, E, generator=g), torch.randn(V, generator=g), logit_scale=0.7, softcap=5.0)
    prefixes = [b"4", b"a", b"ab", b"\xff", b"\xff\xff", b" ", b" a", b"5", b"abc", b"z", b"\xfe"]
    hidden = torch.randn(len(prefixes), E, generator=g)
    ranges = torch.tensor([index.range(p) for p in prefixes])
    got = prefix_logprobs(hidden, head, ranges, index.rank, temperature=1.3, chunk_size=2)
    z = head.weight.double() @ hidden.double().T + head.bias.double()[:, None]
    z = torch.tanh(z * 0.7 / 5.0) * 5.0 / 1.3
    lp = z.T.log_softmax(-1)  # [Q, V]
    for q, p in enumerate(prefixes):
        ids = [v for v, b in enumerate(table) if b and b.startswith(p)]
        want = lp[q, ids].logsumexp(-1) if ids else torch.tensor(float("-inf"), dtype=torch.float64)
        assert (got[q].double() == want) if not ids else abs(float(got[q]) - float(want)) < 1e-5, (p, got[q], want)
