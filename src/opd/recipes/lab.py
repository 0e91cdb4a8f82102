"""`opd lab build` and `opd lab run NAME`: the lab's programs, all through the project's own components.

`opd lab build` retrains the lab teacher and student from a seed: SFT data written as chat JSONL, per model a
random-init Qwen3 trained by `opd.recipes.sft.sft` (`SFT_RECIPE`), then `opd eval` of each on the lab test set;
`<out>/manifest.json` records config, parameter count, training recipe and accuracy. Budgets are options
(`teacher_steps`, `student_steps`, `eval_limit`); how long a full build takes: docs/performance.md.

`opd lab run NAME` (small replications of the paper's findings on the lab pair) is `opd.recipes.lab_experiments`,
which builds on `finetune` and `measure` here. The steps, the variants and what the paper says of each: docs/design.md,
"opd.recipes.lab"; the results: docs/lab.md.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from opd.config import EvalConfig, ModelSpec, build_config
from opd.io import atomic_write_json
from opd.lab import SFT_SET, TEST_SET, teacher_path, test_set_path
from opd.lab.build import (
    STUDENT_ARCH,
    TEACHER_ARCH,
    domain_accuracy,
    init_model,
    n_params,
    rehome_on_digit_pairs,
    rewrite_share,
    write_sft_data,
    write_specialist_data,
)
from opd.models import fix_rope, load_model
from opd.recipes.demo import accuracy
from opd.recipes.eval import evaluate
from opd.recipes.lab_tools import TOOL_MODELS, build_tool_model
from opd.recipes.sft import SFTConfig, sft, sft_step
from opd.recipes.sft import save as save_sft  # aliased: the SFT recipe's save and setup, beside the lab's own steps
from opd.recipes.sft import setup as setup_sft
from opd.rollout import make_generator
from opd.rundir import run_directory
from opd.train.checkpoint import latest_checkpoint
from opd.train.common import deterministic_kernels, finish_run
from opd.train.optim import build_scheduler

__all__ = [
    "MODELS",
    "REWRITE_TEACHER",
    "SFT_RECIPE",
    "SPECIALIST",
    "STUDENT_STEPS",
    "TEACHER_STEPS",
    "build",
    "build_one",
    "finetune",
    "measure",
    "set_threads",
    "sft_within_budget",
    "train_model",
]

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
CROSS_TEACHER: dict[str, Any] = {
    "arch": TEACHER_ARCH,
    "init": "the forward teacher",
    "steps": 1000,
    "examples_per_step": 32,
    "lr": 1e-3,
    "warmup_steps": 10,
}
"""The cross-tokenizer lab teacher (`teacher_pairs`; configs/lab_cross_tokenizer.yaml): the forward teacher moved
onto the digit-pair vocabulary (`rehome_on_digit_pairs`) and fine-tuned with its SFT recipe on forward solutions
tokenized by that vocabulary, until it is as accurate as the lab teacher. It starts from trained weights: a short
warmup (10 steps, at most a tenth of the steps) and half the recipe's batch (32: more updates in a CPU budget)
instead of the recipe's min(100, steps/10) and 64. Its accuracy: docs/lab.md, "Cross-tokenizer OPD"."""
MODELS: tuple[str, ...] = (
    "teacher",
    "student",
    "rewrite_teacher",
    "specialist_add",
    "specialist_mul",
    "teacher_pairs",
)
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
    fix_rope(model, config.max_prompt_length + max_new_tokens)  # as `opd eval` loads it
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


def set_threads(threads: int | None) -> None:
    """torch's CPU threads for a lab program: `threads` (0 or None: torch's default)."""
    if threads is not None and threads < 0:
        raise ValueError(f"--threads must be ≥ 1 torch CPU threads (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)


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
    warmup_steps: int | None = None,
    init: Path | None = None,
    device: str = "cpu",
    time_budget_s: float | None = None,
    overrides: list[str] | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """`opd sft` for `steps` steps from a random init (`init` None) or from the model at `init`; the last checkpoint
    becomes `<out_dir>/<name>`. Returns its manifest record. `warmup_steps` None: the recipe's min(100, steps/10)."""
    init_dir = init if init is not None else init_model(arch, out_dir / "work" / f"{name}_init", seed=seed)
    start = time.perf_counter()
    warmup = max(1, min(100, steps // 10)) if warmup_steps is None else warmup_steps
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
    if name == "teacher_pairs":  # another vocabulary over the same text: the teacher moved onto digit pairs
        init = rehome_on_digit_pairs(teacher, out_dir / "work" / "teacher_pairs_init")
    record = train_model(
        name,
        arch,
        data,
        out_dir,
        steps=steps,
        seed=model_seed,
        examples_per_step=per_step,
        lr=lr,
        warmup_steps=min(CROSS_TEACHER["warmup_steps"], max(1, steps // 10)) if name == "teacher_pairs" else None,
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
    cross_teacher_steps: int = CROSS_TEACHER["steps"],
    sft_examples: int | None = None,
    eval_limit: int | None = None,
    only: list[str] | None = None,
    device: str = "cpu",
    time_budget_s: float | None = None,
    threads: int | None = 1,
    tool_steps: dict[str, int] | None = None,
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
    domain (`domain_accuracy`). The tool lab's models (`opd.recipes.lab_tools.TOOL_MODELS`: `tools_teacher`,
    `tools_student`) are built only when `only` names them, for `tool_steps[name]` steps (default their plan's)."""
    names = list(only or MODELS)
    known = MODELS + tuple(TOOL_MODELS)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"only: unknown lab model(s) {unknown or names}; choose from {', '.join(known)}")
    if time_budget_s is not None and time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be > 0 seconds, got {time_budget_s}")
    console = console or Console()
    set_threads(threads)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "work").is_dir():
        raise FileExistsError(
            f"{out_dir} exists and was not written by `opd lab build` (no work/); pass a new or empty directory"
        )
    plans = _build_plans(
        seed,
        teacher_steps=teacher_steps,
        student_steps=student_steps,
        rewrite_teacher_steps=rewrite_teacher_steps,
        rewrite_teacher_batch=rewrite_teacher_batch,
        specialist_steps=specialist_steps,
        specialist_batch=specialist_batch,
        cross_teacher_steps=cross_teacher_steps,
    )
    models: dict[str, dict] = {}
    for name in names:
        if name in TOOL_MODELS:  # the tool lab (opd.recipes.lab_tools): built only when named
            models[name] = build_tool_model(
                name,
                out_dir,
                steps=tool_steps.get(name) if tool_steps else None,
                sft_examples=sft_examples,
                eval_limit=eval_limit,
                seed=seed,
                device=device,
                time_budget_s=time_budget_s,
                console=console,
            )
            continue
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


def _build_plans(
    seed: int,
    *,
    teacher_steps: int,
    student_steps: int,
    rewrite_teacher_steps: int,
    rewrite_teacher_batch: int,
    specialist_steps: int,
    specialist_batch: int,
    cross_teacher_steps: int = CROSS_TEACHER["steps"],
) -> dict[str, tuple]:
    """Per lab model (MODELS): (arch, steps, seed, solution style, examples per step, lr, new tokens when
    measured), the `plan` of `build_one`."""
    per_step = SFT_RECIPE["examples_per_step"]
    rewrite = REWRITE_TEACHER
    return {
        "teacher": (TEACHER_ARCH, teacher_steps, seed, "forward", per_step, None, 64),
        "student": (STUDENT_ARCH, student_steps, seed + 1, "forward", per_step, None, 64),
        "rewrite_teacher": (
            rewrite["arch"],
            rewrite_teacher_steps,
            seed,
            "rewrite",
            rewrite_teacher_batch,
            rewrite["lr"],
            rewrite["eval_max_new_tokens"],
        ),
        "teacher_pairs": (
            CROSS_TEACHER["arch"],
            cross_teacher_steps,
            seed,
            "forward",
            CROSS_TEACHER["examples_per_step"],
            CROSS_TEACHER["lr"],
            64,
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
