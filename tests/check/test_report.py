"""`opd.check.report`: the exit codes of a check report and the skips it resolves."""

from __future__ import annotations

import pytest

from opd import check as C


def test_exit_codes_and_skips():
    report = C.CheckReport([C.CheckResult("memory", "pass", hard=True)])
    assert report.exit_code() == C.EXIT_OK
    report.values["forecast"] = {"verdict": "unlikely"}
    assert report.exit_code() == C.EXIT_UNLIKELY
    report.results.append(C.CheckResult("determinism", "fail", hard=True))
    assert report.exit_code() == C.EXIT_FAILED
    assert C.CheckReport([C.CheckResult("seq_reward_auroc", "warn")]).exit_code() == C.EXIT_OK
    assert C.resolve_skips(["scoring", "memory"]) == {
        "determinism",
        "self_distillation_zero",
        "prompt_logprobs",
        "served_scores",
        "hidden_scores",
        "generation_scoring",
        "teacher_view",
        "memory",
    }
    assert C.resolve_skips(["all"]) == set(C.CHECKS)
    with pytest.raises(ValueError, match="unknown check 'memroy'"):
        C.resolve_skips(["memroy"])
