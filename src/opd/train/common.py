"""What every trainer (`opd distill`, `opd sft`) does the same way around its step: the run directory (claimed, locked,
never mixed with another run), resume from the newest verified checkpoint with the saved config compared, the trainer
state a checkpoint carries, evaluation through `opd eval` on a cadence, the report at the end, and phase timing.
Plain functions over plain arguments: there is no base Trainer (STYLE 12).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from pydantic import BaseModel

from opd.config import EvalConfig, EvalSpec, ModelSpec, RunSpec, flatten_dotted, save_config

RESUMABLE_CHANGES = (
    "run.steps", "epochs", "run.save_every", "run.eval_every", "run.keep_last", "run.report", "run.samples_per_step",
    "run.tensorboard", "run.wandb_project", "run.resume", "run.overwrite", "run.allow_config_change", "run.out_dir",
    "run.name", "eval.*", "lora.merge", "student.device", "teacher.device", "model.device", "micro_batch_tokens",
    "score_batch_tokens", "gradient_checkpointing", "activation_budget", "compile", "teacher_offload",
)
"""Config keys a `--resume` may change without `--allow-config-change` (`name.*`: the whole section). They set the
length, the bookkeeping, the periodic eval, where things run and how work is cut into micro-batches; none changes the
objective, the data or its order, the sampling or the optimizer. (Memory knobs — micro_batch_tokens,
score_batch_tokens, gradient_checkpointing, activation_budget, compile — regroup the same sums, so the result may
differ from an uninterrupted run at float rounding level; a bit-identical resume needs them unchanged. A longer
run.steps / epochs also stretches a decaying learning-rate schedule over the new length.) Everything else —
objective.*, rollout.*, data.*, optim.*, prompts_per_step, examples_per_step, run.seed, model paths and dtypes,
lora.* — is refused."""


class RunDirectoryError(ValueError):
    """The run directory cannot be used as asked (holds another run, is a file, is not writable); one line."""


def run_directory(run: RunSpec, command: str) -> Path:
    """`run.out_dir / run.name`, or `<command>-<time>` when the run has no name."""
    return Path(run.out_dir) / (run.name or f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")


@contextmanager
def claimed_run_dir(run_dir: Path, run: RunSpec, command: str, *, console: Any) -> Iterator[Path]:
    """Hold `run_dir` for one run: created if needed (and checked writable), locked against other processes
    (`opd.io.DirectoryLock`), and never shared with an earlier run — without `run.resume` a directory that holds
    anything refuses, unless `run.overwrite`, which moves it aside to `<name>.old-<time>` (never deletes it).
    Temp directories of interrupted checkpoint writes are removed. A directory this call created and that is still
    empty at the end (the run failed at startup) is removed again."""
    from opd.io import LOCK_FILE, DirectoryLock
    from opd.train.checkpoint import complete_checkpoints, remove_stale_temps

    if run.resume and run.overwrite:
        raise RunDirectoryError("run.resume and run.overwrite contradict each other: --resume continues the run in "
                                f"{run_dir}, run.overwrite=true moves it aside to start anew; set one")
    created = not run_dir.exists()
    try:
        lock = DirectoryLock(run_dir, command, note=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True)).acquire()
    except FileExistsError:
        raise RunDirectoryError(f"{run_dir}: a file is in the way of the run directory (or of a parent); choose "
                                f"another run.out_dir / run.name") from None
    except NotADirectoryError:
        raise RunDirectoryError(f"{run_dir}: a parent of the run directory is a file; choose another run.out_dir") from None
    except PermissionError:
        raise RunDirectoryError(f"{run_dir}: not writable (permission denied); choose another run.out_dir") from None
    try:
        held = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
        if held and not run.resume:
            checkpoints = complete_checkpoints(run_dir)
            what = f"checkpoint {checkpoints[-1].name}" if checkpoints else ", ".join(held[:3]) + (", …" if len(held) > 3 else "")
            if not run.overwrite:
                raise RunDirectoryError(
                    f"{run_dir} already holds a run ({what}); pass --resume (run.resume=true) to continue it, choose "
                    f"another run.name, or set run.overwrite=true to move it aside")
            aside = _aside_name(run_dir)
            os.replace(run_dir, aside)  # holding the old lock throughout: nobody starts in it meanwhile
            lock.moved(aside)
            run_dir.mkdir()
            new_lock = DirectoryLock(run_dir, command).acquire()
            lock.release()
            lock = new_lock
            console.print(f"run.overwrite: moved the earlier {run_dir} aside to {aside}", soft_wrap=True)
        remove_stale_temps(run_dir, note=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True))
        yield run_dir
    finally:
        lock.release()
        if created:
            try:
                run_dir.rmdir()  # only when empty: a run that failed before writing anything leaves nothing behind
            except OSError:
                pass


def _aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, number = run_dir.with_name(f"{run_dir.name}.old-{stamp}"), 1
    while aside.exists():
        number += 1
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{number}")
    return aside


def resume_checkpoint(run_dir: Path, run: RunSpec, console: Any, config: BaseModel | None = None) -> Path | None:
    """The newest verified checkpoint of `run_dir` when `run.resume` is set (None, with a note, when there is none).
    A newest checkpoint that fails verification (truncated, corrupt) is skipped with a warning. With `config`, the
    saved config.yaml is compared first (`check_resumed_config`)."""
    from opd.train.checkpoint import latest_checkpoint

    if not run.resume:
        return None
    checkpoint = latest_checkpoint(run_dir, hashes=True,
                                   warn=lambda line: console.print(f"[yellow]warning: {line}[/]", soft_wrap=True))
    if checkpoint is None:
        console.print(f"[yellow]run.resume: no complete checkpoint in {run_dir}; starting from scratch[/]", soft_wrap=True)
    elif config is not None:
        check_resumed_config(config, run_dir, step=int(checkpoint.name.split("_")[-1]))
    return checkpoint


def check_resumed_config(config: BaseModel, run_dir: Path, *, step: int) -> None:
    """Refuse a resume whose config differs from the saved `config.yaml` in a key outside `RESUMABLE_CHANGES` (one
    line naming each changed key, old → new), unless `run.allow_config_change`. Also refuse a run.steps below the
    checkpoint's step."""
    import yaml

    run = getattr(config, "run")
    total = getattr(run, "steps", None)
    if total is not None and total < step:
        raise RunDirectoryError(f"run.steps={total} but {run_dir} holds checkpoint step_{step}: a resume cannot go "
                                f"back; raise run.steps, or start another run.name")
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file() or run.allow_config_change:
        return
    saved = yaml.safe_load(saved_path.read_text()) or {}
    try:  # read with today's schema, so fields added since are compared at their defaults
        saved = type(config).model_validate(saved).model_dump(mode="json")
    except ValueError:
        pass  # a config of an older layout: compare the keys both have
    changed = [f"{key}: {_short(old)} → {_short(new)}"
               for key, old, new in config_changes(saved, config.model_dump(mode="json"))
               if not _resumable(key)]
    if changed:
        raise RunDirectoryError(
            f"--resume of {run_dir} (step {step}) with a changed config: {'; '.join(changed)}. Resume with the saved "
            f"settings ({saved_path}), pass --allow-config-change (run.allow_config_change=true) to continue anyway, "
            f"or start another run.name")


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs; a key absent on one side is skipped (a field
    added or removed between versions), a leaf on one side that is a section on the other (`teacher: null` → a
    teacher) is a change of that key."""
    flat_old, flat_new = flatten_dotted(old), flatten_dotted(new)
    changes = []
    for key in sorted(set(flat_old) | set(flat_new)):
        if key in flat_old and key in flat_new:
            if flat_old[key] != flat_new[key]:
                changes.append((key, flat_old[key], flat_new[key]))
        elif key in flat_old and any(k.startswith(key + ".") for k in flat_new):
            changes.append((key, flat_old[key], "{…}"))
        elif key in flat_new and any(k.startswith(key + ".") for k in flat_old):
            changes.append((key, "{…}", flat_new[key]))
    return changes


def _resumable(key: str) -> bool:
    return any(key == allowed or (allowed.endswith(".*") and key.startswith(allowed[:-1])) for allowed in RESUMABLE_CHANGES)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def open_run(config: BaseModel, run_dir: Path, run: RunSpec, *, resume_step: int | None):
    """Create the run directory, save the resolved config, and open the metrics sink (which drops lines of steps
    after `resume_step`: they are recomputed). On a resume, a saved config.yaml that differs from the new one is kept
    as `config.step_<resume_step>.yaml` (the settings of the steps up to there)."""
    from opd.report.sinks import MetricsSink

    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
        keep_config_history(config, run_dir, resume_step)
    save_config(config, run_dir)
    return MetricsSink(run_dir, tensorboard=run.tensorboard, wandb_project=run.wandb_project,
                       config=config.model_dump(mode="json"), resume_step=resume_step)


def keep_config_history(config: BaseModel, run_dir: Path, step: int) -> Path | None:
    """Copy `run_dir/config.yaml` to `config.step_<step>.yaml` (…`.2.yaml` when that exists) when it differs from
    `config`; return the copy."""
    import yaml

    from opd.io import atomic_write_text

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    text = saved.read_text()
    if text == yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False):
        return None
    copy, number = run_dir / f"config.step_{step}.yaml", 1
    while copy.exists() and copy.read_text() != text:
        number += 1
        copy = run_dir / f"config.step_{step}.{number}.yaml"
    atomic_write_text(copy, text)
    return copy


def load_eval_sets(spec: EvalSpec, tokenizer: Any, *, template: str, enable_thinking: bool | None,
                   max_prompt_length: int) -> None:
    """Load and encode every `spec.benchmarks` entry exactly as the in-run `opd eval` will (`load_benchmark`,
    `encode_prompts`), so that an unknown name, a bad column or a set with no prompt short enough fails at startup,
    before any training, instead of after the last step."""
    from opd.data.templates import encode_prompts
    from opd.eval.benchmarks import load_benchmark

    for benchmark in spec.benchmarks:
        try:
            prompts = load_benchmark(benchmark, prompt_key=spec.prompt_key, answer_key=spec.answer_key)
            if spec.limit:
                prompts = prompts[: spec.limit]
            encode_prompts(tokenizer, prompts, max_prompt_length=max_prompt_length, template=template,
                           enable_thinking=enable_thinking)
        except ValueError as error:
            raise ValueError(f"eval.benchmarks: {error}") from None


def eval_pending(run_dir: Path, step: int) -> bool:
    """Whether the in-run eval of `step` has not finished (no `eval/step_N/results.json`): a run resumed from the
    checkpoint of an eval step (saved before its eval) redoes that eval first."""
    return not (run_dir / "eval" / f"step_{step}" / "results.json").is_file()


def trainer_state(optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any, **extra: Any) -> dict:
    """What a checkpoint stores besides the weights (`save_checkpoint` adds the step and the RNG states)."""
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
            **extra}


def restore_trainer_state(checkpoint: Path, optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any) -> dict:
    """Load optimizer, scheduler, sampler and RNG states from `checkpoint`; return its whole trainer state (step, …).
    Call it after everything that draws random numbers during setup, so the restored RNG is the one training uses."""
    from opd.train.checkpoint import load_trainer_state, set_rng_state

    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    return state


def is_due(step: int, every: int, last_step: int) -> bool:
    """Whether a periodic action (save, eval) runs after `step`: every `every` steps (0 = never) and at the end."""
    return bool(every and step % every == 0) or step == last_step


def eval_at_start(run: RunSpec, spec: EvalSpec, step: int) -> bool:
    """Whether a trainer evaluates before its first step (into `eval/step_0`): the model before training, the start
    of the report's accuracy curve and the 'before' of its before → after. Not when resuming past step 0."""
    return bool(spec.benchmarks) and run.eval_at_start and step == 0


def evaluate_in_training(
    spec: EvalSpec,
    *,
    step: int,
    run_dir: Path,
    model_path: str,
    generator: Any,
    tokenizer: Any,
    template: str,
    enable_thinking: bool | None,
    max_prompt_length: int,
    batch_size: int,
    seed: int,
    sink: Any,
    console: Any,
) -> dict | None:
    """Run `opd eval` on the model in memory into `run_dir/eval/step_N/` and log `eval/<bench>/<metric>` at `step`.
    None when `spec.benchmarks` is empty."""
    if not spec.benchmarks:
        return None
    from opd.eval.sampling import evaluate_model

    eval_config = EvalConfig(
        model=ModelSpec(path=model_path), benchmarks=spec.benchmarks, n=spec.n, temperature=spec.temperature,
        top_p=spec.top_p, max_new_tokens=spec.max_new_tokens, limit=spec.limit, prompt_key=spec.prompt_key,
        answer_key=spec.answer_key, on_missing_answer=spec.on_missing_answer, template=template, enable_thinking=enable_thinking,
        max_prompt_length=max_prompt_length, batch_size=batch_size, seed=seed,
        out=str(run_dir / "eval" / f"step_{step}"),
    )
    results = evaluate_model(eval_config, Path(eval_config.out), generator=generator, tokenizer=tokenizer,
                             console=console)
    flat = {f"eval/{bench}/{key}": value for bench, summary in results.items() for key, value in summary.items()
            if isinstance(value, (int, float))}
    sink.log(step, flat)
    return results


def finish_run(run_dir: Path, sink: Any, *, report: bool, console: Any) -> None:
    """Close the metrics sink; write plots and report.html when asked."""
    sink.close()
    if report:
        from opd.report import write_report

        console.print(f"report: {write_report([run_dir])}")


@contextmanager
def timed(timings: dict, name: str):
    """Add the block's wall time to `timings[name]` (synchronising CUDA first, so GPU work is counted)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def training_precision(spec: ModelSpec, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(weights dtype, autocast dtype) of a model that is trained. `dtype=auto` keeps fp32 master weights and fp32
    AdamW state with a bf16 autocast forward on CUDA: at lr ~1e-6, updates to bf16 weights would mostly round away.
    An explicit dtype trains in exactly that dtype, without autocast."""
    from opd.models import resolve_dtype

    if spec.dtype != "auto":
        return resolve_dtype(spec.dtype, device), None
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.float32, (torch.bfloat16 if bf16 else None)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """`torch.autocast` for `dtype`, or a no-op context when it is None."""
    from contextlib import nullcontext

    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
