"""The rows of `opd check` and what is done with them: `CheckResult` (one row: pass / warn / fail / skip, the measured
value, the fix), `CheckReport` (all rows, the measured numbers, the exit code), the row and group names that
`--skip-check` takes (`resolve_skips`), the console table and check.json's plain-JSON form.

A failed *hard* row (`CheckResult.hard`) stops `opd distill` unless skipped; forecast rows never stop it. `opd check`
exits with `EXIT_OK`, `EXIT_FAILED`, `EXIT_UNLIKELY`, or 2 for bad input (the CLI's convention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from rich.table import Table

Status = Literal["pass", "warn", "fail", "skip"]

EXIT_OK = 0
"""No hard check failed and the forecast is likely or uncertain (or was not run)."""
EXIT_FAILED = 1
"""A hard check failed: `opd distill` would refuse to start (or run into the problem)."""
EXIT_UNLIKELY = 3
"""No hard check failed, but the forecast says OPD is unlikely to improve the student (follow the recovery)."""

GROUPS: tuple[str, ...] = ("tokenizers", "scoring", "forecast", "resources", "tools")
CHECKS: dict[str, str] = {
    "tokenizer_vocab": "tokenizers",
    "special_tokens": "tokenizers",
    "chat_template": "tokenizers",
    "cross_tokenizer": "tokenizers",
    "determinism": "scoring",
    "self_distillation_zero": "scoring",
    "prompt_logprobs": "scoring",
    "served_scores": "scoring",
    "hidden_scores": "scoring",
    "generation_scoring": "scoring",
    "teacher_view": "scoring",
    "overlap_ratio": "forecast",
    "overlap_mass_student": "forecast",
    "overlap_mass_teacher": "forecast",
    "overlap_advantage": "forecast",
    "entropy_gap": "forecast",
    "seq_reward_auroc": "forecast",
    "student_accuracy": "forecast",
    "teacher_accuracy": "forecast",
    "forecast": "forecast",
    "memory": "resources",
    "step_time": "resources",
    "sandbox": "tools",
}
"""Every row name and its group; `--skip-check` takes a row name, a group name, or `all`."""
PREFLIGHT_GROUPS: tuple[str, ...] = ("tokenizers", "scoring", "resources")
"""What `opd distill` runs at startup (the forecast needs rollouts of a whole prompt sample: `opd check`)."""


def resolve_skips(names: Sequence[str]) -> set[str]:
    """Row names to skip from row / group names and `all`; an unknown name is a one-line ValueError."""
    out: set[str] = set()
    for name in names:
        if name == "all":
            out |= set(CHECKS)
        elif name in GROUPS:
            out |= {row for row, group in CHECKS.items() if group == name}
        elif name in CHECKS:
            out.add(name)
        else:
            raise ValueError(
                f"skip_checks: unknown check {name!r}; use a row ({', '.join(CHECKS)}), a group "
                f"({', '.join(GROUPS)}) or all"
            )
    return out


@dataclass
class CheckResult:
    """One row. value: the measured number (or a short text); detail: what was measured; fix: what to do when it is
    not a pass; hard: whether a fail stops `opd distill` (and makes `opd check` exit EXIT_FAILED)."""

    name: str
    status: Status
    value: Any = None
    detail: str = ""
    fix: str = ""
    hard: bool = False

    @property
    def check(self) -> str:
        """The row's check: its name without the teacher a run of several names it after (`determinism[a]`)."""
        return self.name.partition("[")[0]

    @property
    def group(self) -> str:
        return CHECKS[self.check]


@dataclass
class CheckReport:
    """All rows plus every measured number (`values`, what check.json holds besides the rows)."""

    results: list[CheckResult] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def hard_failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail" and r.hard]

    @property
    def verdict(self) -> str | None:
        return self.values.get("forecast", {}).get("verdict")

    def exit_code(self) -> int:
        if self.hard_failures:
            return EXIT_FAILED
        return EXIT_UNLIKELY if self.verdict == "unlikely" else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code(),
            "results": [{**asdict(r), "group": r.group} for r in self.results],
            **self.values,
        }


def skipped_rows(names: set[str], groups: Sequence[str]) -> list[CheckResult]:
    """A skip row for each row of `groups` named in `names` (what `--skip-check` left out)."""
    return [
        CheckResult(name, "skip", None, "skipped (--skip-check)")
        for name in CHECKS
        if name in names and CHECKS[name] in groups
    ]


def jsonable(value: Any) -> Any:
    """`value` as plain JSON for check.json: keys as strings, non-finite floats as null, other objects as text."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def render_table(report: CheckReport) -> Table:
    """The console table: one row per check (group, name, status, value, fix)."""
    style = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    table = Table(title="opd check", show_lines=False)
    for column in ("group", "check", "status", "value", "detail / fix"):
        table.add_column(column, overflow="fold")
    for r in report.results:
        status = f"[{style[r.status]}]{r.status}{' (hard)' if r.hard and r.status == 'fail' else ''}[/]"
        text = r.detail + (f" → fix: {r.fix}" if r.fix else "")
        table.add_row(r.group, r.name, status, _short(r.value), text)
    return table


def _short(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items() if k != "predicted_teacher")
    return str(value)
