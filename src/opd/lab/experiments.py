"""`opd lab run NAME`: small replications of the paper's findings on the lab pair, each a set of short `opd distill`
runs with the demo's settings (`opd.lab.demo.demo_config`) that differ in one thing.

- `topk`: which candidate ids get a token reward — only_stu / intersection / union-intersection (k = 16) and
  sampled-token OPD (k = 0) against only_stu with k = 1, 4, 16 (the paper: top-k only_stu beats sampled-token, and
  the student's own support is the one to use).
- `teacher`: success vs failure — the real teacher against a "teacher" that adds nothing (the student itself); the
  paper: OPD works when the student's and teacher's top-k overlap grows and the overlap carries an advantage;
  with nothing to learn, overlap is trivially total and the advantage is zero, and accuracy does not move.

Each run writes its own run directory (metrics.jsonl, report.html, eval/); the experiment writes `summary.json`, a
comparison report over all its runs (`opd report` of several dirs) and a markdown table (`summary.md`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

EXPERIMENTS: dict[str, dict[str, list[str]]] = {
    "topk": {
        "only_stu_k16": [],
        "intersection_k16": ["objective.strategy=intersection"],
        "union-intersection_k16": ["objective.strategy=union-intersection"],
        "only_stu_k4": ["objective.top_k=4"],
        "only_stu_k1": ["objective.top_k=1"],
        "sampled_token": ["objective.top_k=0"],
    },
    "teacher": {
        "real_teacher": [],
        "student_as_teacher": ["teacher.path={student}"],
    },
}
"""Experiment name → run name → DistillConfig overrides on top of the demo's settings."""
TRACKED = ("overlap_ratio", "overlap_advantage", "reward_mean", "entropy_student", "rollout_accuracy")


def _window_mean(rows: list[dict], key: str, first: bool, width: int = 10) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    part = values[:width] if first else values[-width:]
    return sum(part) / len(part)


def summarize_run(run_dir: Path, steps: int) -> dict[str, Any]:
    """Final test accuracy (the trainer's end-of-run eval) and first/last-10-step means of the tracked metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    results = json.loads((run_dir / "eval" / f"step_{steps}" / "results.json").read_text())["benchmarks"]
    (summary,) = results.values()
    out: dict[str, Any] = {"test_accuracy": next(v for k, v in summary.items() if k.startswith("avg@"))}
    for key in TRACKED:
        out[f"{key}_first10"] = _window_mean(rows, key, True)
        out[f"{key}_last10"] = _window_mean(rows, key, False)
    return out


def run_experiment(
    name: str,
    *,
    out_dir: str | Path = "runs/lab",
    steps: int = 50,
    overrides: list[str] | None = None,
    only: list[str] | None = None,
    threads: int | None = 1,
    console: Any = None,
) -> dict[str, Any]:
    """Run every variant of experiment `name` for `steps` OPD steps; return (and write) the summary.

    overrides: extra DistillConfig key=value pairs for every run (e.g. `eval.limit=100`)
    only:      run only these variants (names as in EXPERIMENTS[name])
    """
    import torch
    from rich.console import Console

    from opd.lab import student_path, test_set_path
    from opd.lab.build import measure
    from opd.lab.demo import demo_config
    from opd.train.opd import distill

    if name not in EXPERIMENTS:
        raise ValueError(f"unknown lab experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    console = console or Console()
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir) / name
    variants = {k: v for k, v in EXPERIMENTS[name].items() if not only or k in only}
    if not variants:
        raise ValueError(f"no variant of {name} matches {only}; known: {', '.join(EXPERIMENTS[name])}")
    base = [f"run.out_dir={out_dir}", f"run.steps={steps}", "run.eval_every=0", *(overrides or [])]
    results: dict[str, Any] = {}
    run_dirs = []
    for variant, extra in variants.items():
        extra = [e.format(student=student_path()) for e in extra]
        config = demo_config([*base, f"run.name={variant}", *extra])
        start = time.perf_counter()
        run_dir = distill(config, console=console)
        results[variant] = {"overrides": extra, "wall_s": round(time.perf_counter() - start, 1),
                            **summarize_run(run_dir, steps)}
        run_dirs.append(run_dir)
    limit = demo_config(base).eval.limit
    before = measure(student_path(), out_dir / "student_before", limit=limit, console=console)
    summary = {"experiment": name, "steps": steps, "overrides": overrides or [], "test_set": str(test_set_path()),
               "eval_limit": limit, "student_before": before, "runs": results}
    from opd.io import atomic_write_json, atomic_write_text
    from opd.report import write_report

    atomic_write_json(out_dir / "summary.json", summary)
    atomic_write_text(out_dir / "summary.md", markdown(summary))
    if len(run_dirs) > 1:
        summary["report"] = str(write_report(run_dirs, out_dir / "compare"))
    console.print(markdown(summary), markup=False)
    console.print(f"summary: {out_dir / 'summary.json'}")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a markdown table (accuracy and first → last-10-step means of the overlap metrics)."""
    def f(v: Any, pct: bool = False) -> str:
        return "–" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.3f}")

    lines = [f"Experiment `{summary['experiment']}`: {summary['steps']} OPD steps per run, student before "
             f"{f(summary['student_before'], True)}% (greedy avg@1 on the lab test set).", "",
             "| run | test acc % | overlap ratio (first 10 → last 10 steps) | overlap advantage | reward mean | "
             "student entropy | wall s |", "|---|---|---|---|---|---|---|"]
    for name, r in summary["runs"].items():
        cell = lambda key: f"{f(r[key + '_first10'])} → {f(r[key + '_last10'])}"  # noqa: E731
        lines.append(f"| {name} | {f(r['test_accuracy'], True)} | {cell('overlap_ratio')} | {cell('overlap_advantage')} "
                     f"| {cell('reward_mean')} | {cell('entropy_student')} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"
