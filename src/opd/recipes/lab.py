"""`opd lab build` and `opd lab run NAME`: the lab's programs, all through the project's own components.

`opd lab build` retrains the lab teacher and student from a seed: SFT data written as chat JSONL, per model a
random-init Qwen3 trained by `opd.recipes.sft.sft` (`SFT_RECIPE`), then `opd eval` of each on the lab test set;
`<out>/manifest.json` records config, parameter count, training recipe and accuracy. Budgets are options
(`teacher_steps`, `student_steps`, `eval_limit`); a full teacher build takes hours on a CPU.

`opd lab run NAME`: small replications of the paper's findings on the lab pair (`EXPERIMENTS`: `topk`, `style`,
`teacher`), each a set of short `opd distill` runs with the demo's settings that differ in one thing, optionally
over several seeds and with `opd check`'s forecast of each pair; finished runs are reused, and the experiment
writes `summary.json`, `summary.md` and a comparison report. The steps, the variants and what the paper says of
each: docs/design.md, "opd.recipes.lab"; the results: docs/lab.md.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from opd.config import DataSpec, EvalConfig, ModelSpec, build_config
from opd.io import (
    atomic_write_json,
    atomic_write_text,
    read_json_object,
    read_jsonl,
    read_jsonl_objects,
    read_step_records,
)
from opd.lab import (
    SFT_SET,
    TEST_SET,
    manifest_path,
    opd_prompts_path,
    rewrite_teacher_path,
    student_path,
    teacher_path,
    test_set_path,
)
from opd.lab.build import (
    STUDENT_ARCH,
    TEACHER_ARCH,
    domain_accuracy,
    init_model,
    n_params,
    rewrite_share,
    write_sft_data,
    write_specialist_data,
)
from opd.lab.task import style_of
from opd.models import load_model
from opd.recipes.check import run_check
from opd.recipes.demo import accuracy, demo_config
from opd.recipes.distill import distill
from opd.recipes.eval import evaluate
from opd.recipes.rollout import RolloutConfig, teacher_rollout
from opd.recipes.sft import SFTConfig, sft, sft_step
from opd.recipes.sft import save as save_sft  # aliased: `setup` is the style setup here
from opd.recipes.sft import setup as setup_sft
from opd.report import write_report
from opd.rollout import make_generator
from opd.rundir import run_directory
from opd.train.checkpoint import latest_checkpoint
from opd.train.common import deterministic_kernels, deterministic_workspace, finish_run
from opd.train.optim import build_scheduler

# ---------------------------------------------------------------------------------------------------- opd lab build


SFT_RECIPE: dict[str, Any] = {
    "examples_per_step": 64,
    "optim": {
        "lr": 1e-3,
        "betas": [0.9, 0.98],
        "weight_decay": 0.0,
        "schedule": "cosine",
        "min_lr_ratio": 0.1,
        "grad_clip": 1.0,
    },
    "data": {"max_length": 128},
    "micro_batch_tokens": 8192,
}
"""The SFT settings of both models (the prototype's: warmup min(100, steps/10), cosine to 10% of lr)."""
TEACHER_STEPS = 6000
STUDENT_STEPS = 500
REWRITE_TEACHER: dict[str, Any] = {
    "arch": TEACHER_ARCH,
    "style": "rewrite",
    "init": "the forward teacher",
    "steps": 4000,
    "examples_per_step": 256,
    "lr": 1e-3,
    "eval_max_new_tokens": 128,
}
"""The rewrite-style teacher (the `style` replication's mismatched teacher): the forward teacher fine-tuned with its
own SFT recipe (lr 1e-3, warmup 100, cosine to 10 %) on rewrite-style solutions of the same 60 000 problems, up to
4000 steps × 256 — or as many as a time budget allows (the shipped one: see assets/manifest.json). Starting from the
forward teacher it only has to learn the new solution layout, not arithmetic: the fewest steps to a ≥ 95 % teacher.
The longest rewrite example is 122 tokens (under the recipe's 128); answers reach 83 tokens, so it is measured with
128 new tokens."""
SPECIALIST: dict[str, Any] = {
    "arch": TEACHER_ARCH,
    "init": "the forward teacher",
    "steps": 300,
    "examples_per_step": 64,
    "lr": 1e-3,
}
"""The MOPD specialists (`specialist_add`, `specialist_mul`; configs/lab_mopd.yaml): the forward teacher fine-tuned
with its SFT recipe (lr 1e-3, warmup min(100, steps/10), cosine to 10 %) on `specialist_examples` of the same 60 000
problems: forward solutions on its own domain (`opd.lab.build.DOMAINS`: problems whose first operation is + or -,
or *), the first line off by one on the other, so each is accurate on its own domain only. Measured per domain on
the test set."""
MODELS: tuple[str, ...] = ("teacher", "student", "rewrite_teacher", "specialist_add", "specialist_mul")
"""What `build` can train (`only=`); the directory names under the output and in the shipped assets."""


def measure(
    model_path: str | Path,
    out: str | Path,
    *,
    limit: int | None = None,
    max_new_tokens: int = 64,
    device: str = "cpu",
    console: Any = None,
) -> float:
    """Greedy n=1 accuracy (avg@1) on the lab test set through `opd eval` (the demo's eval settings; rewrite-style
    answers need max_new_tokens ≈ 128), generated by the torch engine on every device (on CUDA the static engine
    would first capture CUDA graphs, which cost more than a lab model's 300 answers need)."""
    config = EvalConfig(
        model=ModelSpec(path=str(model_path), device=device, dtype="fp32"),
        benchmarks=[str(test_set_path())],
        n=1,
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        batch_size=300,
        limit=limit,
        out=str(out),
    )
    model, tokenizer = load_model(str(model_path), dtype="fp32", device=device)
    generator = make_generator(model, tokenizer, engine="torch", max_batch_size=300)
    return accuracy(evaluate(config, generator=generator, tokenizer=tokenizer, console=console))


def finetune(
    model_path: str | Path,
    data: str | Path,
    work_dir: Path,
    run_name: str,
    final: Path,
    *,
    steps: int,
    seed: int = 0,
    examples_per_step: int = SFT_RECIPE["examples_per_step"],
    lr: float | None = None,
    warmup_steps: int | None = None,
    max_length: int = SFT_RECIPE["data"]["max_length"],
    device: str = "cpu",
    time_budget_s: float | None = None,
    overrides: list[str] | None = None,
    console: Any = None,
) -> tuple[Path, dict[str, Any]]:
    """`opd sft` of `model_path` on chat JSONL `data` with `SFT_RECIPE` (lr, batch, warmup changeable) for `steps`
    steps in `work_dir/run_name`; its last checkpoint is copied to `final` (replacing it). Returns (the SFT run dir,
    {"steps": steps trained, ...}). A rerun continues (or reuses) that SFT run (`run.resume`); other settings than it
    was started with are refused.

    device: where it trains (fp32 and padded micro-batches either way, so CPU and GPU run the same computation). On
    CUDA a step is one micro-batch (micro_batch_tokens = the whole padded batch): the same loss and gradient up to
    float summation order, without a kernel launch per 8192 tokens.
    time_budget_s: wall seconds from this call (set-up included) to the last step; see `sft_within_budget`."""
    start = time.perf_counter()
    options = {
        "model.path": str(model_path),
        "model.device": device,
        "model.dtype": "fp32",
        "data.path": [str(data)],
        "data.packing": "padded",
        "run.steps": steps,
        "run.seed": seed,
        "run.out_dir": str(work_dir),
        "run.name": run_name,
        "run.resume": True,
        "run.save_every": 0 if time_budget_s is None else 500,
        "run.keep_last": 1,
        "examples_per_step": examples_per_step,
        "micro_batch_tokens": (
            SFT_RECIPE["micro_batch_tokens"]
            if device == "cpu"
            else max(SFT_RECIPE["micro_batch_tokens"], examples_per_step * max_length)
        ),
        "data.max_length": max_length,
        **{f"optim.{k}": v for k, v in SFT_RECIPE["optim"].items()},
        "optim.warmup_steps": max(1, min(100, steps // 10)) if warmup_steps is None else warmup_steps,
        **({"optim.lr": lr} if lr is not None else {}),
    }
    config = build_config(SFTConfig, options=options, overrides=overrides)
    if time_budget_s is None:
        run_dir, record = sft(config, console=console), {"steps": steps}
    else:
        run_dir, record = sft_within_budget(config, start + time_budget_s, console=console)
    record["micro_batch_tokens"] = config.micro_batch_tokens
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None  # sft (and sft_within_budget) end with a saved step
    shutil.copytree(
        checkpoint,
        final,
        ignore=shutil.ignore_patterns("trainer_state*", "COMPLETE", "MANIFEST.json", "*.pt"),
    )
    return run_dir, record


def sft_within_budget(
    config: Any, deadline: float, *, calibration_steps: int = 30, log_every: int = 100, console: Any = None
) -> tuple[Path, dict[str, Any]]:
    """`opd sft` that ends by `deadline` (a `time.perf_counter()` value) with a saved model whatever happens: after
    `calibration_steps` steps it measures the step rate and shortens the run to the N ≤ run.steps steps that fit
    (95 % of the time left), rebuilding the schedule for N — warmup and the first steps are those of a plain N-step
    run when warmup_steps does not depend on the step count, so `--rewrite-teacher-steps N` without a budget replays
    the same recipe. It still stops at the deadline if the rate drops (the record says so), checkpoints every
    run.save_every steps, and prints a plain progress line every `log_every` steps."""
    with deterministic_kernels(config.run.deterministic):  # as `sft()` does: before any CUDA work
        run_dir = run_directory(config.run, "sft")
        tr = setup_sft(config, run_dir, console=console)
        planned, rate, stopped = tr.total_steps, None, "steps"
        begin = time.perf_counter()
        while tr.step < tr.total_steps:
            if time.perf_counter() >= deadline:
                stopped = "time budget"
                break
            metrics = sft_step(tr)
            tr.step += 1
            tr.sink.log(tr.step, metrics)
            if tr.step == 5:
                begin = time.perf_counter()  # the first steps warm up allocators and kernels
            if tr.step == calibration_steps and tr.step < tr.total_steps:
                rate = (time.perf_counter() - begin) / (tr.step - 5)
                fit = tr.step + int(0.95 * (deadline - time.perf_counter()) / rate)
                if fit < tr.total_steps:
                    planned = tr.total_steps = max(tr.step + 1, fit)
                    tr.scheduler = build_scheduler(tr.optimizer, planned, config.optim)
                    for _ in range(tr.step):
                        tr.scheduler.step()
            if tr.step % log_every == 0 or tr.step == tr.total_steps:
                print(
                    f"{run_dir.name} step {tr.step}/{tr.total_steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.3g} "
                    f"{metrics['time/step']:.3f} s/step, {deadline - time.perf_counter():.0f} s left",
                    flush=True,
                )
            if config.run.save_every and tr.step % config.run.save_every == 0:
                save_sft(tr)
        save_sft(tr)
        finish_run(run_dir, tr.sink, report=False, console=console)
        return run_dir, {
            "steps": tr.step,
            "planned_steps": planned,
            "max_steps": config.run.steps,
            "stopped_by": stopped,
            "calibrated_s_per_step": None if rate is None else round(rate, 4),
        }


def train_model(
    name: str,
    arch: dict[str, int],
    data: Path,
    out_dir: Path,
    *,
    steps: int,
    seed: int,
    examples_per_step: int = SFT_RECIPE["examples_per_step"],
    lr: float | None = None,
    init: Path | None = None,
    device: str = "cpu",
    time_budget_s: float | None = None,
    overrides: list[str] | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """`opd sft` for `steps` steps from a random init (`init` None) or from the model at `init`; the last checkpoint
    becomes `<out_dir>/<name>`. Returns its manifest record."""
    init_dir = init if init is not None else init_model(arch, out_dir / "work" / f"{name}_init", seed=seed)
    start = time.perf_counter()
    warmup = max(1, min(100, steps // 10))
    run_dir, trained = finetune(
        init_dir,
        data,
        out_dir / "work",
        f"{name}_sft",
        out_dir / name,
        steps=steps,
        seed=seed,
        examples_per_step=examples_per_step,
        lr=lr,
        warmup_steps=warmup,
        device=device,
        time_budget_s=time_budget_s,
        overrides=overrides,
        console=console,
    )
    seconds = time.perf_counter() - start
    recipe = {
        **SFT_RECIPE,
        "examples_per_step": examples_per_step,
        "optim": {**SFT_RECIPE["optim"], "warmup_steps": warmup, **({"lr": lr} if lr is not None else {})},
    }
    origin = "random init" if init is None else f"the model at {init}"
    return {
        "path": name,
        "arch": "Qwen3ForCausalLM",
        **arch,
        "params": n_params(out_dir / name),
        "seed": seed,
        "training": {
            "recipe": f"opd sft from {origin}",
            **recipe,
            **trained,
            "sft_data": str(data.name),
            "device": device,
            "run_dir": str(run_dir),
            "time_budget_s": time_budget_s,
            "wall_s": round(seconds, 1),
            "s_per_step": round(seconds / max(1, trained["steps"]), 3),
            "overrides": overrides or [],
        },
    }


def build_one(
    name: str,
    plan: tuple,
    out_dir: Path,
    *,
    teacher: Path,
    sft_examples: int | None,
    eval_limit: int | None,
    device: str,
    time_budget_s: float | None,
    console: Any,
) -> dict:
    """Train lab model `name` by `plan` (arch, steps, seed, solution style, examples per step, lr, new tokens when
    measured) into out_dir/name, measure it on the test set and print one line: its manifest record. `teacher`: the
    starting weights of the models trained from the teacher (the rewrite teacher, the specialists)."""
    arch, steps, model_seed, style, per_step, lr, tokens = plan
    if name.startswith("specialist_"):
        data = write_specialist_data(out_dir / "data" / f"sft_{name}.jsonl", name.split("_", 1)[1], n=sft_examples)
    else:
        data = write_sft_data(out_dir / "data" / f"sft_{style}.jsonl", style=style, n=sft_examples)
    init = teacher if name in ("rewrite_teacher", "specialist_add", "specialist_mul") else None
    record = train_model(
        name,
        arch,
        data,
        out_dir,
        steps=steps,
        seed=model_seed,
        examples_per_step=per_step,
        lr=lr,
        init=init,
        device=device,
        time_budget_s=time_budget_s,
        console=console,
    )
    record["style"] = style
    record["test_accuracy"] = measure(
        out_dir / name,
        out_dir / "work" / f"{name}_eval",
        limit=eval_limit,
        max_new_tokens=tokens,
        device=device,
        console=console,
    )
    record["rewrite_style_share"] = rewrite_share(out_dir / "work" / f"{name}_eval")
    if name.startswith("specialist_"):
        record["domain"] = name.split("_", 1)[1]
        record["domain_accuracy"] = domain_accuracy(out_dir / "work" / f"{name}_eval")
    record["test_eval"] = {
        "metric": "avg@1",
        "n": 1,
        "temperature": 0.0,
        "max_new_tokens": tokens,
        "limit": eval_limit,
        "engine": "torch",
        "machinery": "opd.eval.evaluate (opd eval)",
    }
    per_domain = record.get("domain_accuracy")
    console.print(
        f"{name}: test accuracy {record['test_accuracy']:.3f}, rewrite-style answers "
        f"{record['rewrite_style_share']:.3f}, after {record['training']['steps']} steps"
        + (f"; add {per_domain['add']:.3f}, mul {per_domain['mul']:.3f}" if per_domain else "")
    )
    return record


def build(
    out_dir: str | Path,
    *,
    seed: int = 0,
    teacher_steps: int = TEACHER_STEPS,
    student_steps: int = STUDENT_STEPS,
    rewrite_teacher_steps: int = REWRITE_TEACHER["steps"],
    rewrite_teacher_batch: int = REWRITE_TEACHER["examples_per_step"],
    specialist_steps: int = SPECIALIST["steps"],
    specialist_batch: int = SPECIALIST["examples_per_step"],
    sft_examples: int | None = None,
    eval_limit: int | None = None,
    only: list[str] | None = None,
    device: str = "cpu",
    time_budget_s: float | None = None,
    threads: int | None = 1,
    console: Any = None,
) -> Path:
    """Retrain the lab models into `out_dir` (teacher/, student/, rewrite_teacher/, specialist_add/,
    specialist_mul/, data/, work/, manifest.json); return the manifest path. Reduce the budget with `teacher_steps`,
    `student_steps`, `rewrite_teacher_steps` (and `rewrite_teacher_batch` examples per step), `specialist_steps` (and
    `specialist_batch`), `sft_examples` (size of the SFT set) and `eval_limit` (test problems measured); `only`
    trains a subset of MODELS; `device` is where they train and are measured (cpu, cuda, cuda:N); `time_budget_s`
    caps each model's SFT (set-up included) in wall seconds: it trains the steps that fit (`sft_within_budget`) and
    always saves, measures and records what it trained. The rewrite teacher and the MOPD specialists (`SPECIALIST`)
    start from the teacher this build trains, else from the shipped one; the specialists are also measured per
    domain (`domain_accuracy`)."""
    names = list(only or MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ValueError(f"only: unknown lab model(s) {unknown or names}; choose from {', '.join(MODELS)}")
    if time_budget_s is not None and time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be > 0 seconds, got {time_budget_s}")
    console = console or Console()
    if threads is not None and threads < 0:
        raise ValueError(f"--threads must be ≥ 1 torch CPU threads (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "work").is_dir():
        raise FileExistsError(
            f"{out_dir} exists and was not written by `opd lab build` (no work/); pass a new or empty directory"
        )
    rewrite = REWRITE_TEACHER
    plans = {  # name → (arch, steps, seed, solution style, examples per step, lr, new tokens when measured)
        "teacher": (TEACHER_ARCH, teacher_steps, seed, "forward", SFT_RECIPE["examples_per_step"], None, 64),
        "student": (STUDENT_ARCH, student_steps, seed + 1, "forward", SFT_RECIPE["examples_per_step"], None, 64),
        "rewrite_teacher": (
            rewrite["arch"],
            rewrite_teacher_steps,
            seed,
            "rewrite",
            rewrite_teacher_batch,
            rewrite["lr"],
            rewrite["eval_max_new_tokens"],
        ),
        **{
            f"specialist_{domain}": (
                SPECIALIST["arch"],
                specialist_steps,
                seed,
                "forward",
                specialist_batch,
                SPECIALIST["lr"],
                64,
            )
            for domain in ("add", "mul")
        },
    }
    models = {}
    for name in names:
        teacher = out_dir / "teacher" if "teacher" in models else teacher_path()
        models[name] = build_one(
            name,
            plans[name],
            out_dir,
            teacher=teacher,
            sft_examples=sft_examples,
            eval_limit=eval_limit,
            device=device,
            time_budget_s=time_budget_s,
            console=console,
        )
    manifest = {
        "built_by": "opd lab build",
        "seed": seed,
        "threads": torch.get_num_threads(),
        "device": device,
        "sft_set": {**SFT_SET, "n": sft_examples or SFT_SET["n"]},
        "test_set": TEST_SET,
        "models": models,
    }
    path = out_dir / "manifest.json"
    atomic_write_json(path, json.loads(json.dumps(manifest, default=list)))
    return path


# ------------------------------------------------------------------------------------------------------ opd lab run


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
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown lab experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    unknown = [v for v in only or [] if v not in EXPERIMENTS[name]]
    if unknown:
        raise ValueError(
            f"unknown variant {unknown[0]!r} of lab experiment {name!r}; known: {', '.join(EXPERIMENTS[name])}"
        )
    console = console or Console()
    if threads is not None and threads < 0:
        raise ValueError(f"--threads must be ≥ 1 torch CPU threads (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir) / name
    variants = {k: v for k, v in EXPERIMENTS[name].items() if not only or k in only}
    if not variants:
        raise ValueError(f"no variant of {name} matches {only}; known: {', '.join(EXPERIMENTS[name])}")
    # the student before OPD is measured once below (`measure`), not by every run
    base = [
        f"run.out_dir={out_dir}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.eval_at_start=false",
        *EXPERIMENT_BASE.get(name, []),
        *(overrides or []),
    ]
    base_config = demo_config(base)
    limit, tokens = base_config.eval.limit, base_config.eval.max_new_tokens
    if base_config.run.deterministic:
        deterministic_workspace()  # before the teachers' and students' CUDA work: torch reads it once per process
    paths: dict[str, str] = {"student": str(student_path())}
    summary_path = out_dir / "summary.json"
    previous = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if previous and (previous.get("steps"), previous.get("overrides")) != (steps, overrides or []):
        previous = {}  # another configuration: its runs are not this summary's
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
                entry["wall_s"] = results.get(run_name, {}).get("wall_s")
            else:
                start = time.perf_counter()
                distill(config, console=console)
                entry["wall_s"] = round(time.perf_counter() - start, 1)
            entry.update(summarize_run(run_dir, steps))
            if "cold_student" in local:
                entry["student_before"] = prepared["cold_start"][str(seed or 0)]["student_after_sft"]
            results[run_name] = entry
            run_dirs.append(run_dir)
    before = measure(student_path(), out_dir / "student_before", limit=limit, max_new_tokens=tokens, console=console)
    summary = {
        "experiment": name,
        "steps": steps,
        "overrides": overrides or [],
        "test_set": str(test_set_path()),
        "eval_limit": limit,
        "student_before": before,
        "runs": results,
        **prepared,
    }
    summary["variants"] = aggregate(summary)
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
