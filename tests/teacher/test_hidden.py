"""A teacher that answers with hidden states (opd.teacher.base.HiddenStateScorer over LocalScorer.hidden_states and
its head) gives the scores the teacher itself gives, and every objective built from them (sampled-token, the five
top-k strategies, topk_kl, forward_kl, jsd) equals the same objective built from the teacher's own scores.

Tolerances: float32 hidden states go through the same `score_hidden` on differently batched rows: 1e-5 absolute on
log-probs (float32 rounding of a V-term log-sum-exp). bf16 hidden states (the wire's dtype) round each value to 8
bits of mantissa: 0.05 absolute on log-probs, checked on the tiny models whose logits span about ±10."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY_VOCAB, make_rollouts, make_tiny_model
from opd.config.sections import ObjectiveSpec
from opd.objectives import build_targets
from opd.teacher.base import HiddenStateScorer, check_hidden, head_fingerprint, scores_from_hidden
from opd.teacher.local import LocalScorer

V = TINY_VOCAB


@pytest.fixture(scope="module")
def pair():
    teacher = LocalScorer(make_tiny_model("qwen3", hidden_size=48, seed=1), vocab_size=V)
    student = LocalScorer(make_tiny_model("llama", seed=2, tie_word_embeddings=True), vocab_size=V)
    rollouts = make_rollouts([3, 5, 2], [6, 0, 9], 10, V, seed=3)
    return teacher, student, rollouts


def _assert_scores_close(a, b, atol):
    torch.testing.assert_close(a.sampled_logprobs, b.sampled_logprobs, atol=atol, rtol=0)
    for x, y in (
        (a.topk_logprobs, b.topk_logprobs),
        (a.entropy, b.entropy),
        (a.requested_logprobs, b.requested_logprobs),
    ):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, atol=atol, rtol=0)


def test_hidden_states_score_as_the_teacher(pair):
    teacher, student, rollouts = pair
    requested = student.score(rollouts, top_k=4).topk_ids
    own = teacher.score(rollouts, top_k=8, requested_ids=requested, temperature=0.7)
    from_hidden = HiddenStateScorer(teacher).score(rollouts, top_k=8, requested_ids=requested, temperature=0.7)
    _assert_scores_close(own, from_hidden, 1e-5)
    assert torch.equal(own.topk_ids, from_hidden.topk_ids)
    hidden = teacher.hidden_states(rollouts)
    assert hidden.shape == (3, 10, 48) and hidden[~rollouts.response_mask].abs().max() == 0


def test_bf16_hidden_states_within_tolerance(pair):
    teacher, _, rollouts = pair
    own = teacher.score(rollouts, top_k=4)
    hidden = teacher.hidden_states(rollouts).to(torch.bfloat16)
    scores = scores_from_hidden(hidden, teacher.output_head(), rollouts, top_k=4)
    _assert_scores_close(own, scores, 0.05)


@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 0},
        *({"top_k": 4, "strategy": s} for s in ("only_stu", "only_tch", "intersection", "union", "union-intersection")),
        {"top_k": 4, "loss": "topk_kl"},
        {"top_k": 4, "loss": "forward_kl"},
        {"top_k": 4, "loss": "jsd"},
    ],
)
def test_every_objective_from_hidden_states_equals_from_scores(pair, settings):
    teacher, student, rollouts = pair
    objective = ObjectiveSpec(**settings)
    k = max(objective.top_k, 1)
    s = student.score(rollouts, top_k=k)
    from_hidden = HiddenStateScorer(teacher)
    built = []
    for scorer in (teacher, from_hidden):
        t = scorer.score(rollouts, top_k=k, requested_ids=s.topk_ids)
        at_teacher = student.score(rollouts, top_k=0, requested_ids=t.topk_ids, with_entropy=False).requested_logprobs
        built.append(build_targets(s, t, rollouts, objective, student_at_teacher_topk=at_teacher))
    a, b = built
    assert torch.equal(a.candidate_ids, b.candidate_ids) and torch.equal(a.valid, b.valid)
    torch.testing.assert_close(a.rewards, b.rewards, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.advantages, b.advantages, atol=1e-5, rtol=0)
    if a.teacher_logprobs is not None:
        torch.testing.assert_close(a.teacher_logprobs, b.teacher_logprobs, atol=1e-5, rtol=0)


def test_head_fingerprint_names_the_head(pair):
    teacher, student, _ = pair
    head = teacher.output_head()
    assert head_fingerprint(head) == head_fingerprint(teacher.output_head())
    assert head_fingerprint(head) != head_fingerprint(student.output_head())
    assert HiddenStateScorer(teacher).head_hash == head_fingerprint(head)


def test_bad_hidden_states_refused(pair):
    teacher, _, rollouts = pair
    hidden = teacher.hidden_states(rollouts)
    mask = rollouts.response_mask
    with pytest.raises(ValueError, match=r"shape \(3, 10, 47\), expected"):
        check_hidden(hidden[..., :47], (3, 10), 48, mask)
    with pytest.raises(ValueError, match=r"shape \(4, 10, 48\)"):
        check_hidden(torch.cat([hidden, hidden[:1]]), (3, 10), 48, mask)
    bad = hidden.clone()
    bad[2, 4, 7] = float("nan")
    with pytest.raises(ValueError, match="1 response positions hold NaN/inf \\(first: row 2, position 4\\)"):
        check_hidden(bad, (3, 10), 48, mask)
    bad[2, 4, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN/inf"):
        scores_from_hidden(bad, teacher.output_head(), rollouts)
    bad[1, 5, 0] = float("nan")  # a masked position (row 1 has no response): ignored
    bad[2, 4, 7] = 0.0
    check_hidden(bad, (3, 10), 48, mask)


def test_manifest_records_the_head_and_a_resume_checks_it(pair, tmp_path):
    from opd.config.sections import TeacherEntry, TeacherRoute
    from opd.teacher.manifest import check_teacher_manifest, teacher_manifest
    from opd.teacher.registry import RoutedTeacher, Teacher

    teacher, student, _ = pair

    def routed(scorer, answer):
        entry = TeacherEntry(name="t", path=str(tmp_path), answer=answer, route=TeacherRoute(default=True))
        return RoutedTeacher(entry, Teacher(scorer, None, None))

    scores = teacher_manifest([routed(teacher, "scores")])
    hidden = teacher_manifest([routed(teacher, "hidden")])
    other = teacher_manifest([routed(student, "hidden")])
    assert "head" not in scores[0] and hidden[0]["head"] == head_fingerprint(teacher.output_head())
    check_teacher_manifest(hidden, teacher_manifest([routed(teacher, "hidden")]), tmp_path)
    with pytest.raises(ValueError, match="teacher t's head changed"):
        check_teacher_manifest(hidden, other, tmp_path)


def test_check_row_compares_hidden_state_scores_with_the_teachers(pair):
    """`opd check`'s hidden_scores row: passes for a teacher whose head is applied as its model applies it, fails
    (hard) for one whose head is not (here: a soft-cap the model does not have)."""
    from opd.check.scoring import check_hidden_scores
    from opd.scoring import OutputHead

    teacher, _, rollouts = pair
    row = check_hidden_scores(teacher, rollouts, top_k=4, temperature=1.0, dtype=torch.float32)
    assert row.status == "pass" and row.value <= 1e-5, row

    class WrongHead:
        serves_requested_ids = True

        def score(self, *args, **kwargs):
            return teacher.score(*args, **kwargs)

        def hidden_states(self, rollouts):
            return teacher.hidden_states(rollouts)

        def output_head(self):
            return OutputHead(teacher.output_head().weight, None, 1.0, 1.0)

    row = check_hidden_scores(WrongHead(), rollouts, top_k=4, temperature=1.0, dtype=torch.float32)
    assert row.status == "fail" and row.hard and "teacher.answer=scores" in row.fix, row


def test_crossover_and_auto_answer():
    from opd.teacher.base import choose_answer, crossover_k, score_bytes_per_position

    assert score_bytes_per_position(16, 16) == 200  # docs/design.md's 200 B down for top-16 + 16 requested
    for e in (256, 1536, 2560):
        k = crossover_k(e)
        assert score_bytes_per_position(k, k) > 2 * e >= score_bytes_per_position(k - 1, k - 1)
    assert (crossover_k(1536), crossover_k(2560)) == (256, 427)
    assert choose_answer("auto", needs_full=True, served=False, top_k=16, hidden_size=None) == "hidden"
    assert choose_answer("auto", needs_full=False, served=False, top_k=512, hidden_size=1536) == "scores"
    assert choose_answer("auto", needs_full=False, served=True, top_k=16, hidden_size=1536) == "scores"
    assert choose_answer("auto", needs_full=False, served=True, top_k=256, hidden_size=1536) == "hidden"
    assert choose_answer("scores", needs_full=False, served=True, top_k=999, hidden_size=1536) == "scores"
