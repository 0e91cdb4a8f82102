"""What every trainer (`opd distill`, `opd sft`) does the same way around its step: the run directory (claimed, locked,
never mixed with another run), resume from the newest verified checkpoint with the saved config compared, the trainer
state a checkpoint carries, evaluation through `opd eval` on a cadence, the report at the end, phase timing, and
deterministic kernels on request.
Plain functions over plain arguments: there is no base Trainer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch

from opd.config import EvalConfig, EvalSpec, ModelSpec, OptimSpec, RunSpec
from opd.data.templates import encode_prompts
from opd.eval.benchmarks import load_benchmark
from opd.eval.sampling import evaluate_model, summarize_records
from opd.fingerprints import data_fingerprint, weights_fingerprint
from opd.io import read_jsonl
from opd.models import resolve_dtype
from opd.names import benchmark_names
from opd.report import write_report
from opd.rundir import RunDirectoryError
from opd.teacher.registry import route_prompts
from opd.train.checkpoint import load_trainer_state, set_rng_state
from opd.train.optim import apply_optim_settings


def load_eval_sets(
    spec: EvalSpec, tokenizer: Any, *, template: str, enable_thinking: bool | None, max_prompt_length: int
) -> None:
    """Load and encode every `spec.benchmarks` entry exactly as the in-run `opd eval` will (`load_benchmark`,
    `encode_prompts`), so that an unknown name, a bad column or a set with no prompt short enough fails at startup,
    before any training, instead of after the last step."""
    for benchmark in spec.benchmarks:
        try:
            prompts = load_benchmark(benchmark, prompt_key=spec.prompt_key, answer_key=spec.answer_key)
            if spec.limit:
                prompts = prompts[: spec.limit]
            encode_prompts(
                tokenizer,
                prompts,
                max_prompt_length=max_prompt_length,
                template=template,
                enable_thinking=enable_thinking,
            )
        except ValueError as error:
            raise ValueError(f"eval.benchmarks: {error}") from None


def eval_pending(run_dir: Path, step: int) -> bool:
    """Whether the in-run eval of `step` has not finished (no `eval/step_N/results.json`): a run resumed from the
    checkpoint of an eval step (saved before its eval) redoes that eval first."""
    return not (run_dir / "eval" / f"step_{step}" / "results.json").is_file()


def trainer_state(optimizer: torch.optim.Optimizer, scheduler: Any, sampler: Any, **extra: Any) -> dict:
    """What a checkpoint stores besides the weights (`save_checkpoint` adds the step and the RNG states)."""
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        **extra,
    }


def restore_trainer_state(
    checkpoint: Path,
    optimizer: Any,
    scheduler: Any,
    sampler: Any,
    *,
    optim: OptimSpec | None = None,
    torch_optimizer: torch.optim.Optimizer | None = None,
    console: Any = None,
) -> dict:
    """Load optimizer, scheduler, sampler and RNG states from `checkpoint`; return its whole trainer state (step, …).
    Call it after everything that draws random numbers during setup, so the restored RNG is the one training uses.
    With `optim`, the restored optimizer (`torch_optimizer`, default `optimizer`) and schedule then run with its
    lr, betas, eps and weight decay (`apply_optim_settings`: what config.yaml says is what runs), each change noted."""
    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    if optim is not None:
        changed = apply_optim_settings(torch_optimizer or optimizer, scheduler, optim)
        if changed and console is not None:
            console.print(f"resume: the restored optimizer now runs with {'; '.join(changed)}", soft_wrap=True)
    return state


_FINGERPRINTS: dict[int, tuple[Any, str]] = {}


def cached_fingerprint(data: Any, rows: Callable[[], Iterable[tuple[Sequence[int], Any]]]) -> str:
    """`data_fingerprint(rows())`, computed once per data object (`data`: the trainer's list, alive for the run; it
    is kept referenced so that its id is not reused) — a checkpoint save does not hash the whole set again."""
    entry = _FINGERPRINTS.get(id(data))
    if entry is None or entry[0] is not data:
        entry = _FINGERPRINTS[id(data)] = (data, data_fingerprint(rows()))
    return entry[1]


def check_data_fingerprint(
    state: dict,
    fingerprint: str,
    *,
    what: str,
    run: RunSpec,
    checkpoint: Path,
    console: Any,
    key: str = "data_fingerprint",
    consequence: str = "its sampler position would index other rows",
) -> None:
    """Refuse a resume whose data differ from those the checkpoint was trained on (one line naming `what`), unless
    `run.allow_config_change` (then a note). `key`: the state's entry compared (the prompt set's; distill also keeps
    its routing's). Checkpoints written before that fingerprint was saved are not compared."""
    saved = state.get(key)
    if saved is None or saved == fingerprint:
        return
    if not run.allow_config_change:
        raise RunDirectoryError(
            f"--resume: {what} changed since {checkpoint} was saved (content sha256 {saved[:12]} → "
            f"{fingerprint[:12]}): {consequence}. Restore the file, pass "
            f"--allow-config-change to continue on the new data anyway, or start another run.name"
        )
    if console is not None:
        console.print(
            f"[yellow]resume: {what} changed since {checkpoint} was saved (content sha256 {saved[:12]} → "
            f"{fingerprint[:12]}); continuing on the new data (--allow-config-change)[/]",
            soft_wrap=True,
        )


def check_skipped_steps(consecutive: int, step: int, spec: OptimSpec) -> None:
    """Stop a run whose last `spec.max_skipped_steps` steps were all skipped for a non-finite gradient norm (one
    line): nothing is being learned, and a run that exits 0 would say otherwise. 0 never stops."""
    if spec.max_skipped_steps and consecutive >= spec.max_skipped_steps:
        raise ValueError(
            f"steps {step - consecutive + 1}..{step}: {consecutive} consecutive steps skipped for a non-finite "
            f"gradient norm (optim.max_skipped_steps={spec.max_skipped_steps}); nothing is being learned — lower "
            f"optim.lr, check the teacher's temperature and the data (metrics.jsonl: grad_norm), or raise "
            f"optim.max_skipped_steps"
        )


def check_run_trained(consecutive: int, step: int, steps_run: int) -> None:
    """Fail a run that ends on a streak of skipped steps (non-finite gradient norms) covering every step it ran, or on
    two or more (weights that diverged skip every step after: the run is dead, whatever optim.max_skipped_steps
    allows): an exit code of 0 would say the run trained. One line; the metrics and checkpoints stay as written."""
    if not consecutive or (consecutive < 2 and consecutive < steps_run):
        return
    every = consecutive >= steps_run
    which = (
        f"every step of this run ({step - consecutive + 1}..{step})"
        if every
        else (f"its last {consecutive} steps ({step - consecutive + 1}..{step})")
    )
    raise ValueError(
        f"the run ended with {which} skipped for a non-finite gradient norm: the weights are "
        f"{'the ones it started from' if every else f'where step {step - consecutive} left them'}; lower optim.lr, "
        f"check the teacher's temperature and the data (metrics.jsonl: grad_norm)"
    )


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
    model: Any = None,
    teachers: Sequence[Any] = (),
    tools: str | None = None,
    sandbox: Literal["namespaces", "rlimits-only"] = "namespaces",
    max_turns: int = 4,
    tool_format: str = "hermes",
) -> dict | None:
    """Run `opd eval` on the model in memory into `run_dir/eval/step_N/` and log `eval/<bench>/<metric>` at `step`.
    `model`: the module whose weights `generator` samples with; its `weights_fingerprint` identifies the eval (not
    `model_path`, the weights training started from). None when `spec.benchmarks` is empty.
    `tools`, `sandbox`, `max_turns`, `tool_format`: a tool-integrated eval (`opd eval --tools`), as a run with
    rollout.tools trains.
    `teachers`: with several, the run's teacher entries: each benchmark whose every problem their routes place
    (`route_prompts`) also logs `eval/teacher/<name>/<bench>/<metric>` over the problems routed to each teacher."""
    if not spec.benchmarks:
        return None
    out = Path(run_dir) / "eval" / f"step_{step}"
    eval_config = EvalConfig(
        model=ModelSpec(path=model_path),
        benchmarks=spec.benchmarks,
        n=spec.n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        max_new_tokens=spec.max_new_tokens,
        limit=spec.limit,
        prompt_key=spec.prompt_key,
        answer_key=spec.answer_key,
        on_missing_answer=spec.on_missing_answer,
        template=template,
        enable_thinking=enable_thinking,
        max_prompt_length=max_prompt_length,
        batch_size=batch_size,
        seed=seed,
        out=str(out),
        tools=tools,
        sandbox=sandbox,
        max_turns=max_turns,
        tool_format=tool_format,
    )
    weights = None if model is None else weights_fingerprint(model)
    results = evaluate_model(
        eval_config, out, generator=generator, tokenizer=tokenizer, console=console, weights=weights
    )
    flat = {
        f"eval/{bench}/{key}": value
        for bench, summary in results.items()
        for key, value in summary.items()
        if isinstance(value, (int, float))
    }
    if len(teachers) > 1:
        flat.update(_per_teacher_results(eval_config, out, teachers, console))
    sink.log(step, flat)
    return results


def _per_teacher_results(config: EvalConfig, out: Path, teachers: Sequence[Any], console: Any) -> dict[str, float]:
    """`eval/teacher/<name>/<bench>/<metric>`: each benchmark's samples (`out/samples.jsonl`) split by the teacher
    whose route takes each problem. A benchmark the routes do not place whole (no `data_source` or route column, say)
    is skipped with one line: a split of part of it would read as the whole."""
    records = read_jsonl(out / "samples.jsonl")
    flat: dict[str, float] = {}
    for benchmark, name in zip(config.benchmarks, benchmark_names(config.benchmarks)):
        prompts = load_benchmark(benchmark, prompt_key=config.prompt_key, answer_key=config.answer_key)
        try:
            owners = route_prompts(prompts[: config.limit] if config.limit else prompts, list(teachers))
        except ValueError as error:
            console.print(f"[yellow]eval {name}: no per-teacher split ({error})[/]")
            continue
        teacher_of = {str(p.id): teachers[i].name for p, i in zip(prompts, owners)}
        for teacher in dict.fromkeys(teacher_of.values()):
            mine = [r for r in records if r["benchmark"] == name and teacher_of.get(str(r["problem_id"])) == teacher]
            for key, value in summarize_records(mine).get(name, {}).items():
                if isinstance(value, (int, float)):
                    flat[f"eval/teacher/{teacher}/{name}/{key}"] = value
    return flat


def finish_run(run_dir: Path, sink: Any, *, report: bool, console: Any) -> None:
    """Close the metrics sink; write plots and report.html when asked."""
    sink.close()
    if report:
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
    if spec.dtype != "auto":
        return resolve_dtype(spec.dtype, device), None
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.float32, (torch.bfloat16 if bf16 else None)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """`torch.autocast` for `dtype`, or a no-op context when it is None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the cuBLAS workspace settings torch accepts as deterministic


def deterministic_workspace() -> bool:
    """Make sure CUBLAS_WORKSPACE_CONFIG holds a setting torch accepts as deterministic, setting :4096:8 where it is
    unset; returns whether it set it. Torch reads the variable once, at the process's first cuBLAS call: a program
    that runs several stages in one process (`opd pipeline`, `opd lab run`, `opd demo`) calls this before its first
    stage when a later one has run.deterministic, and leaves it set. Raises ValueError (one line) for any other
    setting."""
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
        return True
    if workspace not in CUBLAS_DETERMINISTIC:
        raise ValueError(
            f"run.deterministic=true needs the environment's CUBLAS_WORKSPACE_CONFIG to be "
            f"{' or '.join(CUBLAS_DETERMINISTIC)} (torch's deterministic cuBLAS), got {workspace!r}; unset it "
            f"(opd sets :4096:8) or set run.deterministic=false"
        )
    return False


@contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """`run.deterministic`: inside, torch uses deterministic kernels only (`torch.use_deterministic_algorithms`:
    attention backward without atomic adds, scatters and index_put sorted, inductor without atomics or on-device
    tuning, empty tensors filled with NaN so that a read of one shows) and cuBLAS a fixed workspace
    (`deterministic_workspace`). A run on a GPU can then replay bit for bit (resume, reruns) on the same hardware and
    software, as one on a CPU does without it; it covers this process's torch kernels, not a served teacher's. Torch
    raises for an op with no deterministic kernel (opd's paths met none on the CPU); inductor's float scan ignores the
    mode, so the compiled sampling step sums top-p's mass in integers (`opd.rollout.sampling.nucleus_mass_before`).
    Everything is as before after the block (the variable is unset again where this set it). Raises ValueError,
    before any work, for a CUBLAS_WORKSPACE_CONFIG torch does not accept, or when this process ran a CUDA matmul
    before the variable was set (the trainers enter this before any CUDA work)."""
    if not enabled:
        yield
        return
    set_here = deterministic_workspace()
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        if torch.cuda.is_initialized():  # torch read the variable at the process's first cuBLAS call: probe it
            try:
                torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")
            except RuntimeError as error:
                if "CUBLAS_WORKSPACE_CONFIG" not in str(error):
                    raise
                raise ValueError(
                    "run.deterministic=true: this process ran CUDA matmuls before CUBLAS_WORKSPACE_CONFIG was set, "
                    "and torch reads it once; set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before "
                    "starting Python, or set run.deterministic=false"
                ) from None
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if set_here:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
