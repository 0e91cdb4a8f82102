"""The per-teacher metrics of a step (`opd.train.teachers.teacher_metrics`): a teacher with no prompts in the step
leaves its means out instead of logging a 0 that reads as a 0% curve in the report."""

from types import SimpleNamespace

import pytest
import torch

from opd.train.teachers import teacher_metrics


def _step(prompt_teacher: list[int], rows_prompt: list[int], correct: list[bool] | None):
    """The inputs teacher_metrics reads, for rows of 3 tokens whose token rewards are 1.0 on teacher 0's rows."""
    names = ["a", "b"]
    tr = SimpleNamespace(
        data=SimpleNamespace(prompt_teacher=prompt_teacher),
        models=SimpleNamespace(teachers=[SimpleNamespace(name=n) for n in names]),
    )
    batch = SimpleNamespace(indices=list(range(len(prompt_teacher))), rollouts=SimpleNamespace(group_ids=None))
    batch.rollouts.group_ids = torch.tensor(rows_prompt)
    rows = len(rows_prompt)
    rewards = torch.tensor([[1.0 if prompt_teacher[p] == 0 else -1.0] * 3 for p in rows_prompt])[..., None]
    targets = SimpleNamespace(
        mask=torch.ones(rows, 3, dtype=torch.bool), rewards=rewards, reward_valid=torch.ones_like(rewards).bool()
    )
    return tr, batch, SimpleNamespace(correct=correct), targets


def test_a_teacher_with_prompts_in_the_step_logs_its_means():
    metrics = teacher_metrics(*_step([0, 1], [0, 0, 1, 1], [True, True, False, True]))
    assert metrics["teacher/a/reward_mean"] == pytest.approx(1.0)
    assert metrics["teacher/b/reward_mean"] == pytest.approx(-1.0)
    assert (metrics["teacher/a/rollout_accuracy"], metrics["teacher/b/rollout_accuracy"]) == (1.0, 0.5)


@pytest.mark.parametrize("correct", [[True, False], None])
def test_a_teacher_without_prompts_in_the_step_leaves_its_means_out(correct):
    """Both prompts of the step are teacher a's: b's token_frac is 0, and it has no reward or accuracy to log."""
    metrics = teacher_metrics(*_step([0, 0, 1], [0, 1], correct))
    assert float(metrics["teacher/b/token_frac"]) == 0.0
    assert "teacher/b/reward_mean" not in metrics and "teacher/b/rollout_accuracy" not in metrics
    assert float(metrics["teacher/a/token_frac"]) == 1.0 and "teacher/a/reward_mean" in metrics
    assert ("teacher/a/rollout_accuracy" in metrics) == (correct is not None)
