"""The lab's SFT stage: `SFT_RECIPE` (both lab models' settings), `finetune` (`opd sft` of a model on chat JSONL with
that recipe, its last checkpoint copied out) and `sft_within_budget` (an SFT run that ends by a deadline with a
saved model). Used by `opd lab build` (`opd.recipes.lab`), the tool lab (`opd.recipes.lab_tools`) and `opd lab run`
(`opd.recipes.lab_experiments`); its own module so that those import it and not each other."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from opd.config import build_config
from opd.recipes.sft import SFTConfig, sft, sft_step
from opd.recipes.sft import save as save_sft  # aliased: the SFT recipe's save and setup
from opd.recipes.sft import setup as setup_sft
from opd.rundir import run_directory
from opd.train.checkpoint import latest_checkpoint
from opd.train.common import deterministic_kernels, finish_run
from opd.train.optim import build_scheduler

__all__ = ["SFT_RECIPE", "finetune", "sft_within_budget"]

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
