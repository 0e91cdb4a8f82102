"""`opd.check.scoring`: the scoring rows of `opd check` on the lab teacher (determinism, dropout left on,
self-distillation at zero, the prompt log-probs rule, NLL of texts against a plain forward)."""

from __future__ import annotations

import pytest
import torch

from helpers_check import MESSAGES
from opd import check as C
from opd import lab


@pytest.fixture(scope="module")
def teacher_rollouts(lab_teacher):
    model, tokenizer = lab_teacher
    ids = [
        C.render_ids(tokenizer, MESSAGES, None),
        C.render_ids(tokenizer, [{"role": "user", "content": "Compute 7-9. Put the final answer in \\boxed{}."}], None),
    ]
    return C.teacher_samples(model, tokenizer, ids, temperature=1.0, max_new_tokens=48, vocab_size=34, seed=0)


class NoisyScorer:
    """A real `LocalScorer` whose log-probs get Gaussian noise on every call: a nondeterministic teacher."""

    def __init__(self, scorer, scale: float, seed: int = 0):
        self.scorer, self.scale = scorer, scale
        self.generator = torch.Generator().manual_seed(seed)

    def score(self, rollouts, **kwargs):
        scores = self.scorer.score(rollouts, **kwargs)
        noise = lambda x: None if x is None else x + self.scale * torch.randn(x.shape, generator=self.generator)  # noqa: E731
        scores.sampled_logprobs = noise(scores.sampled_logprobs)
        scores.topk_logprobs = noise(scores.topk_logprobs)
        return scores


def _scorer(model, **kwargs):
    from opd.teacher.local import LocalScorer

    return LocalScorer(model, vocab_size=34, **kwargs)


def test_determinism(lab_teacher, teacher_rollouts):
    scorer = _scorer(lab_teacher[0])
    assert C.check_determinism(scorer, teacher_rollouts, top_k=16, temperature=1.0).status == "pass"
    small = C.check_determinism(NoisyScorer(scorer, 1e-5), teacher_rollouts, top_k=16, temperature=1.0)
    assert small.status == "warn" and 0 < small.value <= C.DETERMINISM_TOLERANCE
    noisy = C.check_determinism(NoisyScorer(scorer, 0.05), teacher_rollouts, top_k=16, temperature=1.0)
    assert noisy.status == "fail" and noisy.hard and noisy.value > C.DETERMINISM_TOLERANCE


def test_determinism_catches_dropout_left_on(lab_teacher, teacher_rollouts):
    """A model whose layers drop activations even in eval mode (a scorer that would not turn dropout off)."""
    import copy

    model = copy.deepcopy(lab_teacher[0])
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, i, out: torch.nn.functional.dropout(out, 0.1, training=True))
    # (LocalScorer's own one-off head check would already trip over the random outputs: skip it to reach ours)
    row = C.check_determinism(_scorer(model, check_head=False), teacher_rollouts, top_k=16, temperature=1.0)
    assert row.status == "fail"


def test_self_distillation_zero(lab_teacher, teacher_rollouts):
    scorer = _scorer(lab_teacher[0])
    row = C.check_self_distillation(scorer, teacher_rollouts, temperature=1.0, dtype=torch.float32)
    assert row.status == "pass" and row.value < 1e-4  # fp32: two orders of summation, ~1e-7 measured
    # a scorer at another temperature than the samples were drawn with: the reward of a model against itself ≠ 0
    # (the lab student: the lab teacher is so peaked, entropy ~0.002 nats, that τ barely moves its log-probs)
    from opd.models import load_model

    student, tokenizer = load_model(lab.student_path(), dtype="fp32", device="cpu")
    ids = [C.render_ids(tokenizer, MESSAGES, None)] * 4
    samples = C.teacher_samples(student, tokenizer, ids, temperature=1.0, max_new_tokens=48, vocab_size=34, seed=0)
    assert C.check_self_distillation(_scorer(student), samples, temperature=1.0, dtype=torch.float32).status == "pass"
    wrong = C.check_self_distillation(_scorer(student), samples, temperature=0.5, dtype=torch.float32)
    assert wrong.status == "fail" and wrong.value > C.SELF_ZERO_TOLERANCE[torch.float32]
    noisy = C.check_self_distillation(NoisyScorer(scorer, 0.1), teacher_rollouts, temperature=1.0, dtype=torch.float32)
    assert noisy.status == "fail"


def test_prompt_logprobs_rule():
    big, small = 8_000_000_000, 1_700_000_000
    ok = C.check_prompt_logprobs(2.0, 1.9, student_params=small, teacher_params=big, vocab_size=151_000)
    assert ok.status == "pass" and ok.value["predicted_teacher"] == pytest.approx(2.0 * (small / big) ** 0.076)
    worse = C.check_prompt_logprobs(2.0, 4.0, student_params=small, teacher_params=big, vocab_size=151_000)
    assert worse.status == "warn"
    broken = C.check_prompt_logprobs(2.0, float("nan"), student_params=small, teacher_params=big, vocab_size=151_000)
    assert broken.status == "fail" and broken.hard
    # neither model was trained on the text (the lab's prompt tokens): the comparison says nothing
    untrained = C.check_prompt_logprobs(7.0, 12.0, student_params=small, teacher_params=big, vocab_size=34)
    assert untrained.status == "skip" and "uninformative" in untrained.detail


def test_nll_of_texts_matches_a_plain_forward(lab_teacher):
    model, tokenizer = lab_teacher
    ids = C.render_ids(tokenizer, MESSAGES, None)
    nll = C.nll_of_texts(_scorer(model), [ids], pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert nll == pytest.approx(expected, abs=1e-4)  # fp32: the chunked head vs one matmul
