"""Run reporting: metric sinks (`opd.report.sinks`), plots (`opd.report.plots`) and the HTML report
(`opd.report.report`). `write_report` imports matplotlib only when called, so the trainer's sink import stays light."""

from __future__ import annotations

from pathlib import Path


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write `report.html` + `plots/*.png` for one run dir (into it) or several (into `<first>/compare/`, or `out`);
    return the HTML path. See `opd.report.report.write_report`."""
    from opd.report.report import write_report as _write_report  # matplotlib: only when a report is written

    return _write_report(run_dirs, out)


__all__ = ["write_report"]
