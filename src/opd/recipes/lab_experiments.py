"""`opd lab run NAME`: small replications of the paper's findings on the lab pair (`EXPERIMENTS`: `topk`, `style`,
`teacher`), each a set of short `opd distill` runs with the demo's settings that differ in one thing, optionally
over several seeds and with `opd check`'s forecast of each pair; finished runs are reused, and the experiment
writes `summary.json`, `summary.md` and a comparison report. The steps, the variants and what the paper says of
each: docs/design.md, "opd.recipes.lab"; the results: docs/lab.md.

It builds on `opd.recipes.lab` (`opd lab build`): the lab models' SFT and measurement (`finetune`, `measure`) live
there.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from opd.config import DataSpec, ModelSpec
from opd.io import (
    atomic_write_json,
    atomic_write_text,
    read_json_object,
    read_jsonl,
    read_jsonl_objects,
    read_step_records,
)
from opd.lab import manifest_path, opd_prompts_path, rewrite_teacher_path, student_path, teacher_path, test_set_path
from opd.lab.build import write_sft_data
from opd.lab.task import style_of
from opd.recipes.check import run_check
from opd.recipes.demo import demo_config
from opd.recipes.distill import distill
from opd.recipes.lab import finetune, measure, set_threads
from opd.recipes.rollout import RolloutConfig, teacher_rollout
from opd.report import write_report
from opd.train.common import deterministic_workspace

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
    "teacher_steps": None,
    "teacher_examples": 64,
    "teacher_lr": 1e-3,
    "cold_prompts": 2000,
    "cold_steps": 200,
    "cold_examples": 32,
    "cold_lr": 5e-4,
    "max_new_tokens": 128,
}
"""`style`: the rewrite-style teacher — the shipped one (`opd.lab.rewrite_teacher_path()`), or with `teacher_steps`
an SFT of the shipped forward teacher for that many steps — and the cold start: the teacher's correct answers on the
first `cold_prompts` OPD prompts (n = 1, temperature 1, 3 attempts) → SFT of the student, `cold_steps` ×
`cold_examples` at `cold_lr` (warmup 10 %, cosine). Learning rates are for the tiny lab models (trained from
scratch at 1e-3)."""
CHECK_SETTINGS: dict[str, int] = {"n": 4, "prompts_sample": 64}
"""`opd check` of each pair (`check=True`): rollouts per prompt and prompts sampled, as `opd check`'s defaults."""
TRACKED = ("overlap_ratio", "overlap_advantage", "reward_mean", "entropy_student", "rollout_accuracy")


def _window_mean(rows: list[dict], key: str, first: bool, width: int = 10) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    part = values[:width] if first else values[-width:]
    return sum(part) / len(part)


def summarize_run(run_dir: Path, steps: int) -> dict[str, Any]:
    """Final test accuracy (the trainer's end-of-run eval) and first/last-10-step means of the tracked metrics."""
    # read back as `opd report` reads them (a variant finished by an earlier `opd lab run`): damage is one line
    rows = [record for _, record in read_step_records(run_dir / "metrics.jsonl")]
    path = run_dir / "eval" / f"step_{steps}" / "results.json"
    results = read_json_object(path).get("benchmarks")
    if not isinstance(results, dict) or len(results) != 1 or not isinstance(next(iter(results.values())), dict):
        raise ValueError(f'{path}: not the results of one benchmark ({{metric: value}} under "benchmarks")')
    (summary,) = results.values()
    out: dict[str, Any] = {"test_accuracy": next(v for k, v in summary.items() if k.startswith("avg@"))}
    samples = run_dir / "eval" / f"step_{steps}" / "samples.jsonl"
    if samples.is_file():  # which solution style the final student writes (the `style` experiment's question)
        styles = [style_of(str(record.get("response", ""))) for _, record in read_jsonl_objects(samples)]
        out["rewrite_share"] = styles.count("rewrite") / max(1, len(styles))
    for key in TRACKED:
        out[f"{key}_first10"] = _window_mean(rows, key, True)
        out[f"{key}_last10"] = _window_mean(rows, key, False)
    return out


def rewrite_teacher(out_dir: Path, setup: dict[str, Any], *, limit: int | None, console: Any) -> tuple[Path, dict]:
    """The `style` experiment's rewrite-style teacher and its record: the shipped one, or (setup["teacher_steps"])
    one fine-tuned here from the forward teacher, cached in out_dir/rewrite_teacher (lab_style.json marks it done)."""
    if not setup.get("teacher_steps"):
        path = rewrite_teacher_path()
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"{path}: the shipped rewrite-style teacher is missing; build it with `opd lab "
                f"build OUT --only rewrite_teacher` or pass a setup with teacher_steps"
            )
        shipped = json.loads(manifest_path().read_text())["models"]["rewrite_teacher"]
        return path, {
            "teacher": "shipped",
            "teacher_accuracy": shipped["test_accuracy"],
            "teacher_sft": shipped["training"],
        }
    teacher = out_dir / "rewrite_teacher"
    record_path = teacher / "lab_style.json"
    if record_path.is_file():
        console.print(f"reusing the rewrite-style teacher {teacher}")
        return teacher, json.loads(record_path.read_text())
    n = setup["teacher_steps"] * setup["teacher_examples"]
    data = write_sft_data(out_dir / "data" / "sft_rewrite.jsonl", style="rewrite", n=n)
    start = time.perf_counter()
    finetune(
        teacher_path(),
        data,
        out_dir / "work",
        "rewrite_teacher_sft",
        teacher,
        steps=setup["teacher_steps"],
        examples_per_step=setup["teacher_examples"],
        lr=setup["teacher_lr"],
        console=console,
    )
    record = {
        "teacher": "trained here",
        "teacher_sft": {
            "from": str(teacher_path()),
            "examples": n,
            "steps": setup["teacher_steps"],
            "examples_per_step": setup["teacher_examples"],
            "lr": setup["teacher_lr"],
            "wall_s": round(time.perf_counter() - start, 1),
        },
        "teacher_accuracy": measure(
            teacher,
            out_dir / "work" / "rewrite_teacher_eval",
            limit=limit,
            max_new_tokens=setup["max_new_tokens"],
            console=console,
        ),
    }
    atomic_write_json(record_path, record)  # written last: its presence marks a finished teacher
    return teacher, record


def cold_start(
    out_dir: Path, teacher: Path, setup: dict[str, Any], *, seed: int, limit: int | None, console: Any
) -> tuple[Path, dict[str, Any]]:
    """`opd rollout` of the teacher on the first cold_prompts OPD prompts (correct answers only) → `opd sft` of the
    shipped student on them, with `seed`; cached in out_dir/cold_student_s<seed> (cold_start.json marks it done)."""
    student = out_dir / f"cold_student_s{seed}"
    done = student / "cold_start.json"
    if done.is_file():
        return student, json.loads(done.read_text())
    tokens = setup["max_new_tokens"]
    rollout_dir = out_dir / "work" / f"cold_rollout_s{seed}"
    start = time.perf_counter()
    teacher_rollout(
        RolloutConfig(
            model=ModelSpec(path=str(teacher), device="cpu", dtype="fp32"),
            data=DataSpec(path=str(opd_prompts_path()), limit=setup["cold_prompts"], max_prompt_length=64),
            out=str(rollout_dir),
            n=1,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=tokens,
            require_correct=True,
            batch_size=256,
            seed=seed,
        ),
        console=console,
    )
    rollout_s = time.perf_counter() - start
    answers = read_jsonl(rollout_dir / "rollouts.jsonl")
    styles = [style_of(r["messages"][-1]["content"]) for r in answers]
    start = time.perf_counter()
    finetune(
        student_path(),
        rollout_dir / "rollouts.jsonl",
        out_dir / "work",
        f"cold_student_sft_s{seed}",
        student,
        steps=setup["cold_steps"],
        seed=seed,
        examples_per_step=setup["cold_examples"],
        lr=setup["cold_lr"],
        console=console,
    )
    record = {
        "seed": seed,
        "prompts": setup["cold_prompts"],
        "accepted": len(answers),
        "rewrite_style_share": styles.count("rewrite") / max(1, len(styles)),
        "rollout_s": round(rollout_s, 1),
        "sft_steps": setup["cold_steps"],
        "examples_per_step": setup["cold_examples"],
        "lr": setup["cold_lr"],
        "sft_s": round(time.perf_counter() - start, 1),
        "student_after_sft": measure(
            student,
            out_dir / "work" / f"cold_student_eval_s{seed}",
            limit=limit,
            max_new_tokens=tokens,
            console=console,
        ),
    }
    atomic_write_json(done, record)
    return student, record


def run_experiment(
    name: str,
    *,
    out_dir: str | Path = "runs/lab",
    steps: int = 50,
    overrides: list[str] | None = None,
    only: list[str] | None = None,
    seeds: list[int] | None = None,
    check: bool = False,
    threads: int | None = 1,
    setup: dict[str, Any] | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Run every variant of experiment `name` for `steps` OPD steps; return (and write) the summary.

    overrides: extra DistillConfig key=value pairs for every run (e.g. `eval.limit=100`)
    only:      run only these variants (names as in EXPERIMENTS[name])
    seeds:     run each variant once per seed (run.seed); None: once, with the demo's seed 0 and the plain name
    check:     `opd check` of each variant's pair (CHECK_SETTINGS) before its OPD run: the forecast in the summary
    setup:     `style` only: changes to STYLE_SETUP (the rewrite teacher and the cold start)

    Phases: 1. the variants asked for; 2. the overrides shared by every run and what a summary of the same
    configuration already holds; 3. the `style` experiment's rewrite teacher; 4. each variant × seed
    (`_run_variant`); 5. the summary (`_write_summary`).
    """
    variants = _chosen_variants(name, only)
    console = console or Console()
    set_threads(threads)
    out_dir = Path(out_dir) / name
    # the student before OPD is measured once (`_write_summary`), not by every run
    base = [
        f"run.out_dir={out_dir}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.eval_at_start=false",
        *EXPERIMENT_BASE.get(name, []),
        *(overrides or []),
    ]
    base_config = demo_config(base)
    limit = base_config.eval.limit
    if base_config.run.deterministic:
        deterministic_workspace()  # before the teachers' and students' CUDA work: torch reads it once per process
    paths: dict[str, str] = {"student": str(student_path())}
    previous = _previous_summary(out_dir / "summary.json", steps, overrides)
    prepared: dict[str, Any] = {
        k: v for k, v in previous.items() if k in ("teacher", "teacher_accuracy", "teacher_sft", "setup", "cold_start")
    }
    style_setup = {**STYLE_SETUP, **(setup or {})}
    if any("{rewrite_teacher}" in e for extra in variants.values() for e in extra):
        teacher, record = rewrite_teacher(out_dir, style_setup, limit=limit, console=console)
        paths["rewrite_teacher"] = str(teacher)
        prepared.update(record, setup=style_setup)
    results: dict[str, Any] = dict(previous.get("runs", {}))
    run_dirs = []
    for variant, extra in variants.items():
        for seed in seeds if seeds is not None else [None]:
            run_name = variant if seed is None else f"{variant}_s{seed}"
            results[run_name] = _run_variant(
                variant,
                extra,
                seed,
                base=base,
                paths=paths,
                out_dir=out_dir,
                steps=steps,
                style_setup=style_setup,
                limit=limit,
                prepared=prepared,
                earlier_wall_s=results.get(run_name, {}).get("wall_s"),
                check=check,
                console=console,
            )
            run_dirs.append(out_dir / run_name)
    head = {"experiment": name, "steps": steps, "overrides": overrides or []}
    return _write_summary(head, results, prepared, run_dirs, out_dir, base_config.eval, console)


def _chosen_variants(name: str, only: list[str] | None) -> dict[str, list[str]]:
    """The variants of experiment `name` to run (all, or those in `only`): run name → overrides."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown lab experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    unknown = [v for v in only or [] if v not in EXPERIMENTS[name]]
    if unknown:
        raise ValueError(
            f"unknown variant {unknown[0]!r} of lab experiment {name!r}; known: {', '.join(EXPERIMENTS[name])}"
        )
    variants = {k: v for k, v in EXPERIMENTS[name].items() if not only or k in only}
    if not variants:
        raise ValueError(f"no variant of {name} matches {only}; known: {', '.join(EXPERIMENTS[name])}")
    return variants


def _previous_summary(path: Path, steps: int, overrides: list[str] | None) -> dict[str, Any]:
    """The summary an earlier call wrote at `path`, when it ran the same steps and overrides; else {}."""
    previous = json.loads(path.read_text()) if path.is_file() else {}
    if previous and (previous.get("steps"), previous.get("overrides")) != (steps, overrides or []):
        return {}  # another configuration: its runs are not this summary's
    return previous


def _run_variant(
    variant: str,
    extra: list[str],
    seed: int | None,
    *,
    base: list[str],
    paths: dict[str, str],
    out_dir: Path,
    steps: int,
    style_setup: dict[str, Any],
    limit: int | None,
    prepared: dict[str, Any],
    earlier_wall_s: float | None,
    check: bool,
    console: Any,
) -> dict[str, Any]:
    """One OPD run of `variant` (with `seed`), reused when finished: its summary entry. A cold-start variant first
    gets its cold-started student (recorded in `prepared["cold_start"]`)."""
    run_name = variant if seed is None else f"{variant}_s{seed}"
    local = dict(paths)
    if any("{cold_student}" in e for e in extra):
        cold_student, record = cold_start(
            out_dir, Path(paths["rewrite_teacher"]), style_setup, seed=seed or 0, limit=limit, console=console
        )
        local["cold_student"] = str(cold_student)
        prepared.setdefault("cold_start", {})[str(seed or 0)] = record
    formatted = [e.format(**local) for e in extra]
    seeded = [] if seed is None else [f"run.seed={seed}"]
    config = demo_config([*base, f"run.name={run_name}", *seeded, *formatted])
    run_dir = out_dir / run_name
    entry: dict[str, Any] = {"variant": variant, "seed": config.run.seed, "overrides": formatted}
    if check:
        entry["forecast"] = _forecast(config, out_dir / f"{run_name}_check", console)
    if (run_dir / "eval" / f"step_{steps}" / "results.json").is_file():
        console.print(f"reusing the finished run {run_dir}")
        entry["wall_s"] = earlier_wall_s
    else:
        start = time.perf_counter()
        distill(config, console=console)
        entry["wall_s"] = round(time.perf_counter() - start, 1)
    entry.update(summarize_run(run_dir, steps))
    if "cold_student" in local:
        entry["student_before"] = prepared["cold_start"][str(seed or 0)]["student_after_sft"]
    return entry


def _write_summary(
    head: dict[str, Any],
    results: dict[str, Any],
    prepared: dict[str, Any],
    run_dirs: list[Path],
    out_dir: Path,
    eval_spec: Any,
    console: Any,
) -> dict[str, Any]:
    """Measure the student before OPD, then write summary.json, summary.md and (several runs) the comparison
    report; print the markdown. Returns the summary."""
    limit, tokens = eval_spec.limit, eval_spec.max_new_tokens
    before = measure(student_path(), out_dir / "student_before", limit=limit, max_new_tokens=tokens, console=console)
    summary = {
        **head,
        "test_set": str(test_set_path()),
        "eval_limit": limit,
        "student_before": before,
        "runs": results,
        **prepared,
    }
    summary["variants"] = aggregate(summary)
    summary_path = out_dir / "summary.json"
    atomic_write_json(summary_path, summary)
    atomic_write_text(out_dir / "summary.md", markdown(summary))
    if len(run_dirs) > 1:
        summary["report"] = str(write_report(run_dirs, out_dir / "compare"))
    console.print(markdown(summary), markup=False)
    console.print(f"summary: {summary_path}")
    return summary


def _forecast(config: Any, out: Path, console: Any) -> dict[str, Any]:
    """`opd check` of the run's pair with the run's own config: verdict, recovery and step-0 signals (check.json in
    `out`, reused when there)."""
    path = out / "check.json"
    if not path.is_file():
        run_check(
            config,
            n=CHECK_SETTINGS["n"],
            prompts_sample=CHECK_SETTINGS["prompts_sample"],
            out=out,
            skip=["resources"],
            console=console,
        )
    data = json.loads(path.read_text())
    forecast = data.get("forecast") or {}
    keep = (
        "overlap_ratio",
        "overlap_mass_student",
        "overlap_mass_teacher",
        "overlap_advantage",
        "entropy_gap",
        "seq_reward_auroc",
        "seq_reward_mean",
        "student_accuracy",
        "teacher_accuracy",
    )
    return {
        "verdict": forecast.get("verdict"),
        "recovery": forecast.get("recovery"),
        "exit_code": data["exit_code"],
        **{k: (forecast.get("values") or {}).get(k) for k in keep},
        "failed": [r["name"] for r in data["results"] if r["status"] == "fail"],
    }


def aggregate(summary: dict[str, Any]) -> dict[str, Any]:
    """Per variant over its seeds: mean and sample sd of the final accuracy and of the gain over its own start
    (the shipped student, or the cold-started one), and the forecast verdicts."""
    out: dict[str, Any] = {}
    for run in summary["runs"].values():
        variant = run.get("variant")
        if variant is None:
            continue
        start = run.get("student_before", summary["student_before"])
        v = out.setdefault(variant, {"accuracy": [], "gain": [], "seeds": [], "verdicts": []})
        v["accuracy"].append(run["test_accuracy"])
        v["gain"].append(run["test_accuracy"] - start)
        v["seeds"].append(run["seed"])
        v["verdicts"].append((run.get("forecast") or {}).get("verdict"))
    for v in out.values():
        for key in ("accuracy", "gain"):
            v[f"{key}_mean"] = statistics.fmean(v[key])
            v[f"{key}_sd"] = statistics.stdev(v[key]) if len(v[key]) > 1 else None
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The summary as markdown: per run accuracy and first → last-10-step means of the overlap metrics (+ the
    forecast when checked), and per variant the mean ± sd over seeds."""

    def f(v: Any, pct: bool = False) -> str:
        return "–" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.3f}")

    def cell(r: dict[str, Any], key: str) -> str:
        return f"{f(r[key + '_first10'])} → {f(r[key + '_last10'])}"

    lines = [
        f"Experiment `{summary['experiment']}`: {summary['steps']} OPD steps per run, student before "
        f"{f(summary['student_before'], True)}% (greedy avg@1 on the lab test set).",
        "",
        "| run | test acc % | overlap ratio (first 10 → last 10 steps) | overlap advantage | reward mean | "
        "student entropy | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    style = summary["experiment"] == "style"
    checked = any(r.get("forecast") for r in summary["runs"].values())
    if style:
        lines[-2:] = [lines[-2] + " rewrite-style answers % |", lines[-1] + "---|"]
    if checked:
        lines[-2:] = [lines[-2] + " forecast | step-0 AUROC |", lines[-1] + "---|---|"]
    notes = []
    if "teacher_accuracy" in summary:
        sft = summary.get("teacher_sft") or {}
        notes.append(
            f"Rewrite-style teacher ({summary.get('teacher', 'trained here')}): "
            f"{f(summary['teacher_accuracy'], True)}% after {sft.get('steps')} SFT steps × "
            f"{sft.get('examples_per_step')} rewrite-style solutions."
        )
    for seed, c in sorted((summary.get("cold_start") or {}).items()):
        notes.append(
            f"Cold start (seed {seed}): {c['accepted']} correct teacher answers from {c['prompts']} prompts "
            f"({f(c['rewrite_style_share'], True)}% rewrite style, {c['rollout_s']} s), SFT "
            f"{c['sft_steps']} steps × {c['examples_per_step']} ({c['sft_s']} s): student "
            f"{f(c['student_after_sft'], True)}% before OPD."
        )
    lines[1:1] = [x for note in notes for x in ("", note)]
    for name, r in summary["runs"].items():
        row = (
            f"| {name} | {f(r['test_accuracy'], True)} | {cell(r, 'overlap_ratio')} | {cell(r, 'overlap_advantage')} "
            f"| {cell(r, 'reward_mean')} | {cell(r, 'entropy_student')} | {r.get('wall_s')} |"
        )
        if style:
            row += f" {f(r.get('rewrite_share'), True)} |"
        if checked:
            fc = r.get("forecast") or {}
            row += f" {fc.get('verdict', '–')} | {f(fc.get('seq_reward_auroc'))} |"
        lines.append(row)
    variants = summary.get("variants") or {}
    if any(len(v["seeds"]) > 1 for v in variants.values()):
        lines += [
            "",
            "| variant | seeds | test acc % (mean ± sd) | gain over its start, points (mean ± sd) | forecasts |",
            "|---|---|---|---|---|",
        ]
        for name, v in variants.items():
            sd = lambda x: "" if x is None else f" ± {100 * x:.1f}"  # noqa: E731
            lines.append(
                f"| {name} | {len(v['seeds'])} | {f(v['accuracy_mean'], True)}{sd(v['accuracy_sd'])} | "
                f"{100 * v['gain_mean']:+.1f}{sd(v['gain_sd'])} | "
                f"{', '.join(str(x) for x in v['verdicts'] if x) or '–'} |"
            )
    return "\n".join(lines) + "\n"
