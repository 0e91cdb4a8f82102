"""The checks of `opd check`: before any GPU hour is spent, whether OPD of this student from this teacher can work,
and what to do if not. Four groups, one module each (`tokenizers`, `scoring`, `forecast`, `resources`); each row is
pass / warn / fail with the measured value and the fix (`report`). `preflight` is what `opd distill` runs at startup
(tokenizers, scoring, resources); the `opd check` program itself is `opd.recipes.check.run_check`.

Omitted on purpose: served/vLLM teachers (the in-process `LocalScorer`; the checks take any `TeacherScorer`, so one
plugs in).
"""

from opd.check.forecasting import (
    FORECAST_METRICS,
    ForecastThresholds,
    classify,
    forecast,
    forecast_rows,
    recovery_command,
    sample_accuracy,
)
from opd.check.report import (
    CHECKS,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNLIKELY,
    GROUPS,
    PREFLIGHT_GROUPS,
    CheckReport,
    CheckResult,
    Status,
    render_table,
    resolve_skips,
)
from opd.check.resources import check_memory, check_step_time, estimate_memory, free_memory, mini_step
from opd.check.scoring import (
    DETERMINISM_TOLERANCE,
    PROMPT_NLL_SLACK,
    SELF_ZERO_HALF_TOLERANCE,
    SELF_ZERO_TOLERANCE,
    SIZE_EXPONENT,
    check_determinism,
    check_prompt_logprobs,
    check_self_distillation,
    nll_of_texts,
    scoring_rows,
    teacher_samples,
)
from opd.check.startup import preflight
from opd.check.tokenizers import check_tokenizers, first_difference, render_ids

__all__ = [
    "CHECKS",
    "DETERMINISM_TOLERANCE",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_UNLIKELY",
    "FORECAST_METRICS",
    "GROUPS",
    "PREFLIGHT_GROUPS",
    "PROMPT_NLL_SLACK",
    "SELF_ZERO_HALF_TOLERANCE",
    "SELF_ZERO_TOLERANCE",
    "SIZE_EXPONENT",
    "CheckReport",
    "CheckResult",
    "ForecastThresholds",
    "Status",
    "check_determinism",
    "check_memory",
    "check_prompt_logprobs",
    "check_self_distillation",
    "check_step_time",
    "check_tokenizers",
    "classify",
    "estimate_memory",
    "first_difference",
    "forecast",
    "forecast_rows",
    "free_memory",
    "mini_step",
    "nll_of_texts",
    "preflight",
    "recovery_command",
    "render_ids",
    "render_table",
    "resolve_skips",
    "sample_accuracy",
    "scoring_rows",
    "teacher_samples",
]
