"""`opd demo`: on-policy distillation of the shipped lab student from the shipped lab teacher, on CPU, in minutes.

Through exactly the code path of a real run: `opd eval` of the teacher on the lab test set (the reference line),
`opd distill` with the paper's recipe scaled to the lab (configs/lab_demo.yaml), whose own evals before the first
step and at the end give the "before" and "after" numbers, then a before/after table with the gap recovery
(`<run>/demo.json`); the trainer writes `report.html`, and the last line printed is `report: <path>`.

The settings that differ from the paper's (lr, AdamW betas, weight decay, prompts per step, new tokens, one CPU
thread) and why: docs/design.md, "opd.recipes.demo".
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table

from opd.config import DistillConfig, EvalConfig, ModelSpec, build_config, flatten_dotted, read_yaml
from opd.io import atomic_write_json
from opd.lab import opd_prompts_path, student_path, teacher_path, test_set_path
from opd.objectives import gap_recovery
from opd.recipes.distill import distill
from opd.recipes.eval import evaluate
from opd.report import write_report
from opd.rundir import claimed_run_dir
from opd.train.common import deterministic_workspace

DEMO_CONFIG: dict[str, Any] = {
    "student": {"path": None, "device": "cpu", "dtype": "fp32"},
    "teacher": {"path": None, "device": "cpu", "dtype": "fp32"},
    "data": {"path": None, "max_prompt_length": 64},
    "rollout": {"n": 4, "temperature": 1.0, "max_new_tokens": 64, "batch_size": 256},
    "objective": {
        "top_k": 16,
        "strategy": "only_stu",
        "weight": "student_p",
        "advantage": "token_reward",
        "loss": "pg",
    },
    "optim": {
        "lr": 1e-4,
        "betas": [0.9, 0.98],
        "weight_decay": 0.0,
        "schedule": "constant",
        "warmup_steps": 0,
        "grad_clip": 1.0,
    },
    "run": {
        "out_dir": "runs",
        "seed": 0,
        "steps": 200,
        "save_every": 0,
        "keep_last": 1,
        "eval_every": 50,
        "samples_per_step": 4,
    },
    "eval": {"n": 1, "temperature": 0.0, "max_new_tokens": 64},
    "prompts_per_step": 8,
    "micro_batch_tokens": 8192,
    "score_batch_tokens": 16384,
}
"""The demo's distill settings (also in configs/lab_demo.yaml); paths are filled in with the shipped assets."""


def demo_config(overrides: list[str] | None = None, *, config_file: str | Path | None = None) -> DistillConfig:
    """The demo's `DistillConfig`: DEMO_CONFIG with the shipped assets, then a YAML file, then key=value overrides."""
    data = yaml.safe_load(yaml.safe_dump(DEMO_CONFIG))  # a deep copy
    data["student"]["path"] = str(student_path())
    data["teacher"]["path"] = str(teacher_path())
    data["data"]["path"] = str(opd_prompts_path())
    data["eval"]["benchmarks"] = [str(test_set_path())]
    data["run"]["name"] = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    options = {}
    if config_file:
        options = flatten_dotted(read_yaml(config_file))
    return build_config(DistillConfig, options={**flatten_dotted(data), **options}, overrides=overrides)


def eval_config(config: DistillConfig, model_path: str, out: Path) -> EvalConfig:
    """`opd eval` settings of the demo's before-training evals: the same as the trainer's own eval (`config.eval`)."""
    spec = config.eval
    return EvalConfig(
        model=ModelSpec(path=model_path, device=config.student.device, dtype=config.student.dtype),
        benchmarks=spec.benchmarks,
        n=spec.n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        max_new_tokens=spec.max_new_tokens,
        limit=spec.limit,
        prompt_key=spec.prompt_key,
        answer_key=spec.answer_key,
        on_missing_answer=spec.on_missing_answer,
        template=config.data.template,
        max_prompt_length=config.data.max_prompt_length,
        batch_size=config.rollout.batch_size,
        seed=config.run.seed,
        out=str(out),
    )


def accuracy(results: dict) -> float:
    """avg@n over the (single) benchmark of an `opd eval` results dict."""
    (summary,) = results.values()
    return float(next(v for k, v in summary.items() if k.startswith("avg@")))


def demo(
    overrides: list[str] | None = None,
    *,
    config_file: str | Path | None = None,
    threads: int | None = 1,
    console: Any = None,
) -> Path:
    """Run the demo; return the run directory (holding demo.json, report.html, metrics.jsonl, eval/, checkpoints/).

    overrides:   DistillConfig `key=value` pairs on top of the demo's settings, e.g. `run.steps=20 eval.limit=50`
    config_file: a YAML file of DistillConfig keys applied before the overrides (e.g. configs/lab_demo.yaml)
    threads:     torch CPU threads (None: torch's default); one by default: docs/design.md, "opd.recipes.demo"
    """
    console = console or Console()
    start = time.perf_counter()
    if threads is not None and threads < 0:
        raise ValueError(f"--threads must be ≥ 1 torch CPU threads (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)
    config = demo_config(overrides, config_file=config_file)
    if config.run.name is None:
        raise ValueError("the demo names its run directory: run.name must not be null")
    run_dir = Path(config.run.out_dir) / config.run.name
    if not config.eval.benchmarks:
        raise ValueError("the demo measures the student with the trainer's eval: eval.benchmarks must not be empty")
    if config.teacher is None or config.teacher.path is None:
        raise ValueError("the demo evaluates the teacher in process: teacher.path must be set")
    if config.run.deterministic:
        deterministic_workspace()  # before the evaluations' CUDA work: torch reads it once per process
    # the demo's run directory follows distill's rules (a new run refuses a directory holding another one); the
    # before-training evals go into it first, so distill itself then continues in it (run.resume)
    with claimed_run_dir(run_dir, config.run, "demo", console=console):
        distill_config = config.model_copy(
            update={"run": config.run.model_copy(update={"resume": True, "overwrite": False})}
        )
        return _demo_in(distill_config, run_dir, start, console)


def _demo_in(config: DistillConfig, run_dir: Path, start: float, console: Any) -> Path:
    """The body of `demo`, holding its run directory."""
    timings: dict[str, float] = {}
    assert config.teacher is not None and config.teacher.path is not None  # demo refuses a config without one
    t = time.perf_counter()
    teacher_results = evaluate(eval_config(config, config.teacher.path, run_dir / "eval" / "teacher"), console=console)
    timings["eval_teacher_s"] = time.perf_counter() - t
    t = time.perf_counter()
    # the trainer's own evals: of the student before training → eval/step_0/, of the final one → eval/step_<steps>/
    distill(config.model_copy(update={"run": config.run.model_copy(update={"eval_at_start": True})}), console=console)
    timings["distill_s"] = time.perf_counter() - t
    before_results, after_results = (
        json.loads((run_dir / "eval" / f"step_{step}" / "results.json").read_text())["benchmarks"]
        for step in (0, config.run.steps)
    )

    teacher, before, after = accuracy(teacher_results), accuracy(before_results), accuracy(after_results)
    recovery = float(gap_recovery(before, after, teacher))
    timings["total_s"] = time.perf_counter() - start
    metric = next(k for k in next(iter(after_results.values())) if k.startswith("avg@"))
    summary = {
        "metric": metric,
        "test_set": config.eval.benchmarks[0],
        "problems": next(iter(after_results.values()))["num_problems"],
        "student_before": before,
        "student_after": after,
        "teacher": teacher,
        "gap_recovery": recovery,
        "gain_points": 100 * (after - before),
        "steps": config.run.steps,
        "sequences_per_step": config.prompts_per_step * config.rollout.n,
        "threads": torch.get_num_threads(),
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "run_dir": str(run_dir),
        "report": str(run_dir / "report.html"),
    }
    atomic_write_json(run_dir / "demo.json", summary)

    sampling = "greedy" if config.eval.temperature == 0 else f"temperature {config.eval.temperature}"
    table = Table(title=f"opd demo — lab test set, {summary['problems']} problems, {metric} ({sampling})")
    for column in ("", "accuracy"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row("student before", f"{100 * before:.1f}")
    table.add_row(f"student after {config.run.steps} OPD steps", f"{100 * after:.1f}")
    table.add_row("teacher", f"{100 * teacher:.1f}")
    table.add_row("gap recovery", f"{100 * recovery:.1f}%")
    console.print(table)
    console.print(
        f"wall time {timings['total_s']:.0f} s (OPD {timings['distill_s']:.0f} s); summary: {run_dir / 'demo.json'}"
    )
    report = run_dir / "report.html"
    if not report.is_file():  # run.report=false: the demo still promises a report
        report = write_report([run_dir])
    console.print(f"report: {report}", soft_wrap=True)
    return run_dir
