"""`opd lab run NAME`: small replications of the paper's findings on the lab pair, each a set of short `opd distill`
runs with the demo's settings (`opd.lab.demo.demo_config`) that differ in one thing.

- `topk`: which candidate ids get a token reward — only_stu / intersection / union-intersection (k = 16) and
  sampled-token OPD (k = 0) against only_stu with k = 1, 4, 16 (the paper: top-k only_stu beats sampled-token, and
  the student's own support is the one to use).
- `style`: thinking-pattern mismatch and cold start — the forward-style student distilled from a teacher fine-tuned
  to solve in the other ("rewrite") style (mismatch), from the same teacher after an SFT cold start on that
  teacher's correct answers (cold_start), and from the shipped forward-style teacher (matched); the paper: a teacher
  whose thinking pattern differs from the student's distills worse, and SFT on the teacher's own answers first
  recovers it. The rewrite teacher is cached in `<out>/style/rewrite_teacher` (reused when present).
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
    "style": {
        "mismatch": ["teacher.path={rewrite_teacher}"],
        "cold_start": ["teacher.path={rewrite_teacher}", "student.path={cold_student}"],
        "matched": [],
    },
}
"""Experiment name → run name → DistillConfig overrides on top of the demo's settings (and of EXPERIMENT_BASE)."""
EXPERIMENT_BASE: dict[str, list[str]] = {
    "style": ["rollout.max_new_tokens=128", "eval.max_new_tokens=128"],
}
"""Overrides for every run of an experiment (rewrite-style answers reach ~82 tokens, over the demo's 64)."""
STYLE_SETUP: dict[str, Any] = {
    "teacher_steps": 200, "teacher_examples": 64, "teacher_lr": 1e-3,
    "cold_prompts": 256, "cold_steps": 40, "cold_examples": 32, "cold_lr": 5e-4, "max_new_tokens": 128,
}
"""`style`: the rewrite-style teacher (SFT of the shipped teacher on rewrite solutions of train-split problems) and
the cold start (its correct answers on the first `cold_prompts` OPD prompts, n = 1, temperature 1 → SFT of the
student). Learning rates are for the tiny lab models (trained from scratch at 1e-3)."""
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
    samples = run_dir / "eval" / f"step_{steps}" / "samples.jsonl"
    if samples.is_file():  # which solution style the final student writes (the `style` experiment's question)
        styles = [_answer_style(json.loads(line)["response"]) for line in samples.read_text().splitlines() if line.strip()]
        out["rewrite_share"] = styles.count("rewrite") / max(1, len(styles))
    for key in TRACKED:
        out[f"{key}_first10"] = _window_mean(rows, key, True)
        out[f"{key}_last10"] = _window_mean(rows, key, False)
    return out


def _answer_style(text: str) -> str:
    from opd.lab.task import style_of

    return style_of(text)


def prepare_style(out_dir: Path, variants: dict[str, list[str]], setup: dict[str, Any], *, limit: int | None,
                  console: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """The `style` experiment's models: the rewrite-style teacher (cached in out_dir/rewrite_teacher) and, when a
    variant needs it, the cold-started student. Returns (placeholders for the overrides, measured setup record)."""
    from opd.config import DataSpec, ModelSpec
    from opd.io import atomic_write_json, read_jsonl
    from opd.lab import opd_prompts_path, student_path, teacher_path
    from opd.lab.build import finetune, measure, write_sft_data
    from opd.rollout.rejection import RolloutConfig, teacher_rollout

    tokens = setup["max_new_tokens"]
    teacher = out_dir / "rewrite_teacher"
    record_path = teacher / "lab_style.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        console.print(f"reusing the rewrite-style teacher {teacher}")
    else:
        n = setup["teacher_steps"] * setup["teacher_examples"]
        data = write_sft_data(out_dir / "data" / "sft_rewrite.jsonl", style="rewrite", n=n)
        start = time.perf_counter()
        _ = finetune(teacher_path(), data, out_dir / "work", "rewrite_teacher_sft", teacher, steps=setup["teacher_steps"],
                 examples_per_step=setup["teacher_examples"], lr=setup["teacher_lr"], console=console)
        seconds = time.perf_counter() - start
        record = {"teacher_sft": {"from": str(teacher_path()), "examples": n, "steps": setup["teacher_steps"],
                                  "examples_per_step": setup["teacher_examples"], "lr": setup["teacher_lr"],
                                  "wall_s": round(seconds, 1)},
                  "teacher_accuracy": measure(teacher, out_dir / "work" / "rewrite_teacher_eval", limit=limit,
                                              max_new_tokens=tokens, console=console)}
        atomic_write_json(record_path, record)  # written last: its presence marks a finished teacher
    out = {"rewrite_teacher": str(teacher)}
    if not any("{cold_student}" in e for extra in variants.values() for e in extra):
        return out, record
    rollout_dir = out_dir / "work" / "cold_rollout"
    start = time.perf_counter()
    teacher_rollout(RolloutConfig(
        model=ModelSpec(path=str(teacher), device="cpu", dtype="fp32"),
        data=DataSpec(path=str(opd_prompts_path()), limit=setup["cold_prompts"], max_prompt_length=64),
        out=str(rollout_dir), n=1, temperature=1.0, top_p=1.0, max_new_tokens=tokens, require_correct=True,
        batch_size=256, seed=0), console=console)
    rollout_s = time.perf_counter() - start
    answers = read_jsonl(rollout_dir / "rollouts.jsonl")
    styles = [_answer_style(r["messages"][-1]["content"]) for r in answers]
    student = out_dir / "cold_student"
    start = time.perf_counter()
    finetune(student_path(), rollout_dir / "rollouts.jsonl", out_dir / "work", "cold_student_sft", student,
             steps=setup["cold_steps"], examples_per_step=setup["cold_examples"], lr=setup["cold_lr"], console=console)
    record = {**record, "cold_start": {
        "prompts": setup["cold_prompts"], "accepted": len(answers), "rewrite_style_share": styles.count("rewrite") / max(1, len(styles)),
        "rollout_s": round(rollout_s, 1), "sft_steps": setup["cold_steps"], "examples_per_step": setup["cold_examples"],
        "lr": setup["cold_lr"], "sft_s": round(time.perf_counter() - start, 1),
        "student_after_sft": measure(student, out_dir / "work" / "cold_student_eval", limit=limit,
                                     max_new_tokens=tokens, console=console)}}
    out["cold_student"] = str(student)
    return out, record


def run_experiment(
    name: str,
    *,
    out_dir: str | Path = "runs/lab",
    steps: int = 50,
    overrides: list[str] | None = None,
    only: list[str] | None = None,
    threads: int | None = 1,
    setup: dict[str, Any] | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Run every variant of experiment `name` for `steps` OPD steps; return (and write) the summary.

    overrides: extra DistillConfig key=value pairs for every run (e.g. `eval.limit=100`)
    only:      run only these variants (names as in EXPERIMENTS[name])
    setup:     `style` only: changes to STYLE_SETUP (budgets of the rewrite teacher and the cold start)
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
    base = [f"run.out_dir={out_dir}", f"run.steps={steps}", "run.eval_every=0", *EXPERIMENT_BASE.get(name, []),
            *(overrides or [])]
    limit = demo_config(base).eval.limit
    tokens = demo_config(base).eval.max_new_tokens
    paths: dict[str, str] = {"student": str(student_path())}
    prepared: dict[str, Any] = {}
    if name == "style" and any("{rewrite_teacher}" in e for extra in variants.values() for e in extra):
        style_setup = {**STYLE_SETUP, **(setup or {})}
        more, prepared = prepare_style(out_dir, variants, style_setup, limit=limit, console=console)
        paths.update(more)
        prepared["setup"] = style_setup
    results: dict[str, Any] = {}
    run_dirs = []
    for variant, extra in variants.items():
        extra = [e.format(**paths) for e in extra]
        config = demo_config([*base, f"run.name={variant}", *extra])
        start = time.perf_counter()
        run_dir = distill(config, console=console)
        results[variant] = {"overrides": extra, "wall_s": round(time.perf_counter() - start, 1),
                            **summarize_run(run_dir, steps)}
        run_dirs.append(run_dir)
    before = measure(student_path(), out_dir / "student_before", limit=limit, max_new_tokens=tokens, console=console)
    summary = {"experiment": name, "steps": steps, "overrides": overrides or [], "test_set": str(test_set_path()),
               "eval_limit": limit, "student_before": before, "runs": results, **prepared}
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
    style = summary["experiment"] == "style"
    if style:
        lines[-2:] = [lines[-2] + " rewrite-style answers % |", lines[-1] + "---|"]
    notes = []
    if "teacher_accuracy" in summary:
        notes.append(f"Rewrite-style teacher: {f(summary['teacher_accuracy'], True)}% after "
                     f"{summary['teacher_sft']['steps']} SFT steps × {summary['teacher_sft']['examples_per_step']} "
                     f"rewrite-style solutions ({summary['teacher_sft']['wall_s']} s).")
    if "cold_start" in summary:
        c = summary["cold_start"]
        notes.append(f"Cold start: {c['accepted']} correct teacher answers from {c['prompts']} prompts "
                     f"({f(c['rewrite_style_share'], True)}% rewrite style, {c['rollout_s']} s), SFT "
                     f"{c['sft_steps']} steps × {c['examples_per_step']} ({c['sft_s']} s): student "
                     f"{f(c['student_after_sft'], True)}% before OPD.")
    lines[1:1] = [x for note in notes for x in ("", note)]
    for name, r in summary["runs"].items():
        cell = lambda key: f"{f(r[key + '_first10'])} → {f(r[key + '_last10'])}"  # noqa: E731
        lines.append(f"| {name} | {f(r['test_accuracy'], True)} | {cell('overlap_ratio')} | {cell('overlap_advantage')} "
                     f"| {cell('reward_mean')} | {cell('entropy_student')} | {r['wall_s']} |"
                     + (f" {f(r.get('rewrite_share'), True)} |" if style else ""))
    return "\n".join(lines) + "\n"
