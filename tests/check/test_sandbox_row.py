"""The `sandbox` row of `opd check` (opd.check.sandbox): the probe's result for the python tool under the mode a config
names, and no row for a config without tools."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from opd.check.report import CHECKS, GROUPS, CheckReport, resolve_skips
from opd.check.sandbox import sandbox_row, tool_rows, tool_settings
from opd.config import DistillConfig, EvalConfig
from opd.tools.sandbox import probe


def _namespaces_or_skip() -> None:
    result = probe("namespaces")
    if not result.ok:
        pytest.skip(f"the namespaces sandbox is unavailable here: {result.reason}")


def test_the_row_belongs_to_the_tools_group_and_can_be_skipped():
    assert "tools" in GROUPS and CHECKS["sandbox"] == "tools"
    assert resolve_skips(["tools"]) == {"sandbox"}


def test_namespaces_row_passes_and_names_every_layer_that_holds():
    _namespaces_or_skip()
    row = sandbox_row("namespaces")
    assert row.status == "pass", row
    assert row.value == "namespaces"
    for layer in ("namespaces", "seccomp", "rlimits"):
        assert layer in row.detail
    assert probe("namespaces").holds == ("namespaces", "seccomp", "rlimits")


def test_rlimits_only_is_a_warning_that_names_the_weak_mode():
    row = sandbox_row("rlimits-only")
    assert row.status == "warn" and not row.hard
    assert "rlimits-only" in row.detail and "no file-system, network or process isolation" in row.detail
    assert "namespaces" in row.fix
    # the weak mode isolates nothing: the probe must not report namespaces or seccomp there
    assert "namespaces" not in probe("rlimits-only").holds and "seccomp" not in probe("rlimits-only").holds


def test_an_unknown_mode_is_a_hard_failure_naming_the_accepted_modes():
    row = sandbox_row("chroot")
    assert row.status == "fail" and row.hard
    assert "namespaces, rlimits-only" in row.detail and "'chroot'" in row.detail
    report = CheckReport(results=[row])
    assert report.exit_code() == 1


def test_tool_rows_read_the_config_tool_settings():
    distill = DistillConfig.model_validate({"student": {"path": "s"}, "teacher": {"path": "t"}, "data": {"path": "p"}})
    assert tool_rows(distill) == []  # no tools (yet): no row
    assert tool_settings(EvalConfig(tools="python", sandbox="rlimits-only")) == ("python", "rlimits-only")
    [row] = tool_rows(EvalConfig(tools="python", sandbox="rlimits-only"))
    assert row.name == "sandbox" and row.status == "warn"
    [calc] = tool_rows(EvalConfig(tools="calculator"))
    assert calc.status == "skip" and "calculator" in calc.detail
    assert tool_rows(EvalConfig(tools="python"), {"sandbox"}) == []
    # a distill config's rollout section is read first (its tool settings are the training's episodes')
    distill_like = SimpleNamespace(rollout=SimpleNamespace(tools="python", sandbox="rlimits-only"), tools=None)
    assert tool_settings(distill_like) == ("python", "rlimits-only")
