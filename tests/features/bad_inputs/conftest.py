"""Fixtures of the bad-input matrix: its world of good and broken inputs, built once for the session and shared by
its test modules; and its counts, printed at the end of any pytest run that includes matrix cases.

The counts: every case (a test of this folder run with a `Case`) by its failure class — the `failure_class` marker,
else the Case's `kind` (one-line, damaged, …, in the marker's spelling) — and its outcome: clear (the test passed),
traceback, silent or unclear (what `classify` found, from the failed assertion's first word), or other (any other
failure: a later assertion, an error in setup). Plain lines, no terminal-width wrapping: COLUMNS does not change them.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import pytest

from helpers_bad_inputs import Case, build_world

OUTCOMES = ("clear", "traceback", "silent", "unclear", "other")
CLASSES = ("one_line", "security", "silent_wrong", "data_loss", "traceback", "misleading", "late", "damaged")
_FOUND = re.compile(r"\b(traceback|silent|unclear) \(exit ")
_outcomes: dict[str, tuple[str, str]] = {}  # test id → (failure class, outcome)


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> dict[str, str]:
    return build_world(tmp_path_factory.mktemp("bad-inputs"))


@pytest.fixture(scope="session")
def env_world(world):
    from opd.lab import teacher_path

    return {**world, "lab_teacher": str(teacher_path())}


def failure_class(item: pytest.Item) -> str | None:
    """The case's class: its `failure_class` marker, else its Case's kind; None for a test that runs no case."""
    mark = item.get_closest_marker("failure_class")
    if mark is not None:
        return str(mark.args[0])
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    if isinstance(case, Case):
        return {"late-error": "late"}.get(case.kind, case.kind.replace("-", "_"))
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    kind = failure_class(item)
    if kind is None or (report.when != "call" and report.passed):
        return
    if report.skipped:
        _outcomes.pop(item.nodeid, None)
    elif report.passed:
        _outcomes[item.nodeid] = (kind, "clear")
    else:
        found = _FOUND.search(str(report.longrepr)) if report.when == "call" else None
        _outcomes[item.nodeid] = (kind, found.group(1) if found else "other")


def matrix_counts(outcomes) -> list[str]:
    """The table: one row per failure class seen (the known ones first), a column per outcome, and the totals."""
    rows: dict[str, Counter] = defaultdict(Counter)
    for kind, outcome in outcomes:
        rows[kind][outcome] += 1
    order = [k for k in CLASSES if k in rows] + sorted(k for k in rows if k not in CLASSES)
    width = max(len("class"), len("total"), *map(len, order))
    lines = [f"{'class':<{width}} {'cases':>6} " + " ".join(f"{o:>9}" for o in OUTCOMES)]
    total: Counter = Counter()
    for kind in order:
        total.update(rows[kind])
        cells = " ".join(f"{rows[kind][o]:>9}" for o in OUTCOMES)
        lines.append(f"{kind:<{width}} {sum(rows[kind].values()):>6} {cells}")
    lines.append(f"{'total':<{width}} {sum(total.values()):>6} " + " ".join(f"{total[o]:>9}" for o in OUTCOMES))
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _outcomes:
        return
    terminalreporter.write_sep("-", "bad-input matrix: cases by failure class and outcome")
    for line in matrix_counts(_outcomes.values()):
        terminalreporter.write_line(line)
