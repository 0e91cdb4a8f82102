"""`opd.check.forecasting`: the forecast's classification, its thresholds, thin evidence, and the recovery commands."""

from __future__ import annotations

import shlex

import pytest

from opd import check as C
from opd.config import parse_override

ALIGNED = dict(
    overlap_ratio=0.6,
    overlap_mass_student=0.98,
    overlap_mass_teacher=0.99,
    overlap_advantage=-0.1,
    seq_reward_auroc=0.9,
    student_accuracy=0.4,
    teacher_accuracy=1.0,
)


@pytest.mark.parametrize(
    "change, verdict, recovery",
    [
        ({}, "likely", "none"),
        ({"overlap_ratio": 1.0, "overlap_advantage": 0.0}, "unlikely", "other_teacher"),
        ({"teacher_accuracy": 0.42}, "unlikely", "other_teacher"),
        ({"overlap_advantage": -0.3}, "unlikely", "cold_start"),
        ({"seq_reward_auroc": 0.5}, "unlikely", "cold_start"),
        ({"overlap_advantage": -0.17}, "uncertain", "prompt_selection"),
        ({"overlap_mass_teacher": 0.8}, "uncertain", "prompt_selection"),
        ({"seq_reward_auroc": 0.58}, "uncertain", "prompt_selection"),
        ({"seq_reward_auroc": None, "student_accuracy": None, "teacher_accuracy": None}, "likely", "none"),
    ],
)
def test_classify(change, verdict, recovery):
    out = C.classify({**ALIGNED, **change})
    assert (out["verdict"], out["recovery"]) == (verdict, recovery), out["reasons"]
    assert out["reasons"]


@pytest.mark.parametrize(
    "change, verdict",
    [({}, "likely"), ({"teacher_accuracy": 0.42}, "unlikely"), ({"overlap_advantage": -0.17}, "uncertain")],
)
def test_classify_thin_evidence_is_no_verdict(change, verdict):
    """A handful of rollouts (issue 22 item 15): no confident verdict either way; min_rollouts of them keep it."""
    th = C.ForecastThresholds()
    thin = C.classify({**ALIGNED, **change, "rollouts": th.min_rollouts - 1})
    assert (thin["verdict"], thin["recovery"]) == ("uncertain", "more_rollouts")
    assert thin["reasons"] == [
        f"evidence too thin: 31 student rollouts, fewer than the {th.min_rollouts} a forecast needs"
    ]
    assert C.classify({**ALIGNED, **change, "rollouts": th.min_rollouts})["verdict"] == verdict
    # the teacher being the student is told on any number of tokens
    same = C.classify({**ALIGNED, "overlap_ratio": 1.0, "overlap_advantage": 0.0, "rollouts": 2})
    assert (same["verdict"], same["recovery"]) == ("unlikely", "other_teacher")
    command = C.recovery_command("more_rollouts", student="S", teacher="T", prompts="P", n=2, prompts_sample=3)
    assert command.startswith("opd check --student S --teacher T --prompts P --n 2 --prompts-sample 16 ")
    assert "or --n 11 on 3 prompts" in command


def test_classify_thresholds_are_the_boundaries():
    th = C.ForecastThresholds()
    assert C.classify({**ALIGNED, "overlap_advantage": th.ok_overlap_advantage})["verdict"] == "likely"
    assert C.classify({**ALIGNED, "overlap_advantage": th.fail_overlap_advantage})["verdict"] == "uncertain"
    assert C.classify({**ALIGNED, "overlap_advantage": th.fail_overlap_advantage - 1e-6})["verdict"] == "unlikely"
    strict = C.ForecastThresholds(min_auroc=0.95)
    assert C.classify(ALIGNED, strict)["verdict"] == "uncertain"
    assert C.recovery_command("cold_start", student="S", teacher="T", prompts="P").startswith("opd pipeline run")
    assert "opd prompts select" in C.recovery_command("prompt_selection", student="S", teacher="T", prompts="P")


def test_recovery_commands_name_a_served_teacher_by_every_replica_url():
    """A served teacher is named by the `teacher.url` override with all its replicas (--teacher is a model path),
    quoted for the shell and read back as the list; the cold start, which needs its weights, says so."""
    replicas = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    select = C.recovery_command("prompt_selection", student="S", teacher=replicas, prompts="P", served=True)
    assert select.startswith("opd prompts score --student S 'teacher.url=[http://10.0.0.1:8000,http://10.0.0.2:8000]'")
    assert parse_override(shlex.split(select)[5]) == ("teacher.url", replicas)
    more = C.recovery_command("more_rollouts", student="S", teacher=replicas[0], prompts="P", served=True)
    assert more.startswith("opd check --student S teacher.url=http://10.0.0.1:8000 --prompts P ")
    cold = C.recovery_command("cold_start", student="S", teacher=replicas, prompts="P", served=True)
    assert cold.startswith("# a served teacher cannot") and "http" not in cold
