"""The `opd` command line. Each command: build its typed config (YAML < options < key=value), then call its recipe.
No logic lives here; every command's program is also a Python function in `opd.recipes` (e.g. `opd.recipes.sft.sft`
for `opd sft`)."""

from __future__ import annotations

import errno
import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from opd.config import DistillConfig, EvalConfig, build_config
from opd.report import write_report

# Each command imports its recipe inside its function, on purpose: `opd --help` and a config error stay fast and
# torch-free, and a command loads only what its own program needs.

app = typer.Typer(
    name="opd",
    help="On-policy distillation of LLMs: teacher rollout, SFT cold start, OPD, evaluation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help strings hold literal "[default: …]"
    context_settings={"help_option_names": ["-h", "--help"]},
)

OVERRIDES_HELP = "Config overrides as dotted key=value pairs, e.g. `n=4 model.dtype=bf16` (applied last)."
CONFIG_HELP = "YAML file with config keys (see `configs/`); CLI options and key=value overrides take precedence."


def _overrides() -> Any:
    return typer.Argument(None, help=OVERRIDES_HELP, show_default=False)


def _config() -> Any:
    return typer.Option(None, "--config", "-c", help=CONFIG_HELP, exists=False, dir_okay=False)


THINKING_HELP = "Thinking on/off: enable_thinking of the chat template (Qwen3){key}. [default: the template's own]"


def _thinking(key: str = "") -> Any:
    """The one spelling of the thinking switch in every command: `--thinking` / `--no-thinking` (as every other
    on/off option of opd). `--thinking on|off`, `opd rollout`'s earlier spelling, still works for one release
    (rewritten by `_legacy_thinking`)."""
    return typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP.format(key=f" ({key})" if key else ""))


@app.command("eval")
def eval_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    model: str | None = typer.Option(None, help="Model to sample from: Hugging Face id or local directory."),
    responses: Path | None = typer.Option(
        None,
        help="Grade this JSONL of existing generations (fields: problem/prompt id or text, response, answer) "
        "instead of sampling.",
    ),
    benchmarks: str | None = typer.Option(
        None,
        help="Comma-separated built-in names (aime24, aime25, amc23, math500, minerva, olympiadbench) or file paths. "
        "[default: aime24,aime25,amc23,math500]",
    ),
    n: int | None = typer.Option(None, help="Samples per problem. [default: 16]"),
    temperature: float | None = typer.Option(None, help="Sampling temperature, 0 = greedy. [default: 0.7]"),
    top_p: float | None = typer.Option(None, help="Nucleus sampling mass in (0, 1]. [default: 0.95]"),
    top_k: int | None = typer.Option(None, help="Top-k sampling, 0 = off. [default: 0]"),
    max_new_tokens: int | None = typer.Option(None, help="Longest response in tokens. [default: 4096]"),
    batch_size: int | None = typer.Option(None, help="Sequences generated together. [default: 64]"),
    limit: int | None = typer.Option(None, help="Only the first N problems of each benchmark."),
    prompt_key: str | None = typer.Option(
        None, help="Prompt column of benchmark files given by path. [default: prompt]"
    ),
    answer_key: str | None = typer.Option(
        None, help="Answer column of benchmark files given by path. [default: reward_model.ground_truth]"
    ),
    template: str | None = typer.Option(
        None, help="Instruction template: keep | dapo | boxed | custom:'…{problem}…'. [default: keep]"
    ),
    thinking: bool | None = _thinking(),
    dtype: str | None = typer.Option(
        None, help="auto | bf16 | fp16 | fp32. [default: auto = bf16 on GPU, fp32 on CPU]"
    ),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | cuda:N. [default: auto]"),
    seed: int | None = typer.Option(None, help="Sampling seed. [default: 0]"),
    out: Path | None = typer.Option(
        None, help="Output directory; rerunning into it resumes. [default: runs/eval-<time>]"
    ),
    engine: str | None = typer.Option(
        None,
        help="Generation engine: auto | torch | static | vllm (engine; "
        "vllm loads the model itself, options as vllm.*). [default: auto]",
    ),
) -> None:
    """Sample n answers per benchmark problem, grade them, write results.json + samples.jsonl, print a table."""
    options = {
        "model.path": model,
        "model.dtype": dtype,
        "model.device": device,
        "responses": _str(responses),
        "benchmarks": benchmarks,
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "limit": limit,
        "prompt_key": prompt_key,
        "answer_key": answer_key,
        "template": template,
        "enable_thinking": thinking,
        "seed": seed,
        "out": _str(out),
        "engine": engine,
    }
    cfg = build_config(EvalConfig, config_file=config, options=options, overrides=overrides)
    from opd.recipes.eval import evaluate

    evaluate(cfg)


@app.command("distill")
def distill_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    student: str | None = typer.Option(None, help="Student model: Hugging Face id or local directory (student.path)."),
    teacher: str | None = typer.Option(
        None,
        help="Teacher model: Hugging Face id or local directory (teacher.path); "
        "not needed for objective.advantage=grpo.",
    ),
    prompts: str | None = typer.Option(
        None, help="Prompt set: parquet / JSONL / JSON / dataset dir / hub id (data.path)."
    ),
    steps: int | None = typer.Option(None, help="Optimizer steps, one per rollout batch (run.steps). [default: 100]"),
    name: str | None = typer.Option(
        None, help="Run directory name under run.out_dir (run.name). [default: distill-<time>]"
    ),
    out_dir: str | None = typer.Option(None, help="Parent directory of runs (run.out_dir). [default: runs]"),
    resume: bool | None = typer.Option(
        None,
        "--resume/--no-resume",
        help="Continue from the newest complete checkpoint of the run directory (run.resume).",
    ),
    top_k: int | None = typer.Option(
        None, help="Top-k candidates per position, 0 = sampled-token OPD (objective.top_k). [default: 16]"
    ),
    strategy: str | None = typer.Option(
        None,
        help="only_stu | only_tch | intersection | union | union-intersection (objective.strategy). "
        "[default: only_stu]",
    ),
    weight: str | None = typer.Option(
        None, help="student_p | teacher_p | none (objective.weight). [default: student_p]"
    ),
    advantage: str | None = typer.Option(
        None, help="token_reward | grpo | token_reward+grpo | token_grpo (objective.advantage). [default: token_reward]"
    ),
    lr: float | None = typer.Option(None, help="Peak learning rate (optim.lr). [default: 1e-6]"),
    seed: int | None = typer.Option(None, help="Seed of data order, sampling and init (run.seed). [default: 0]"),
    thinking: bool | None = _thinking("data.enable_thinking"),
    allow_config_change: bool | None = typer.Option(
        None,
        "--allow-config-change",
        help="With --resume: continue even though settings that change the math or data order differ from the saved "
        "config.yaml (run.allow_config_change).",
    ),
    skip_check: list[str] | None = typer.Option(
        None, help="Startup check (an `opd check` row or group name, or all) not to stop on; repeatable (skip_checks)."
    ),
) -> None:
    """On-policy distillation: the student samples, the teacher scores the student's tokens, policy-gradient update.

    Every config key (see `configs/opd_qwen3_1.7b_from_4b.yaml`) can be set as key=value, e.g.
    `prompts_per_step=32 rollout.n=4`.
    """
    options = {
        "student.path": student,
        "teacher.path": teacher,
        "data.path": prompts,
        "run.steps": steps,
        "run.name": name,
        "run.out_dir": out_dir,
        "run.resume": resume,
        "objective.top_k": top_k,
        "objective.strategy": strategy,
        "objective.weight": weight,
        "objective.advantage": advantage,
        "optim.lr": lr,
        "run.seed": seed,
        "data.enable_thinking": thinking,
        "run.allow_config_change": allow_config_change,
        "skip_checks": skip_check or None,
    }
    cfg = build_config(DistillConfig, config_file=config, options=options, overrides=overrides)
    from opd.recipes.distill import distill

    distill(cfg)


@app.command("check")
def check_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    student: str | None = typer.Option(None, help="Student model: Hugging Face id or local directory (student.path)."),
    teacher: str | None = typer.Option(None, help="Teacher model: Hugging Face id or local directory (teacher.path)."),
    prompts: str | None = typer.Option(
        None, help="Prompt set of the OPD run (data.path); answers make the AUROC and accuracies."
    ),
    n: int = typer.Option(4, help="Student rollouts per sampled prompt for the forecast."),
    prompts_sample: int = typer.Option(64, help="Prompts drawn (seeded by run.seed) for the forecast."),
    out: Path | None = typer.Option(
        None, help="Directory for check.json (never replaced). [default: <run.out_dir>/check-<time>]"
    ),
    skip_check: list[str] | None = typer.Option(
        None, help="Row or group (tokenizers, scoring, forecast, resources) to skip; repeatable."
    ),
) -> None:
    """Pre-flight of an OPD run: tokenizers, scoring sanity, the success forecast (likely / uncertain / unlikely, with
    the recovery command) and memory/time, for the config `opd distill` would get (same -c file and key=value pairs).

    Exit codes: 0 no hard failure (forecast likely or uncertain), 1 a hard check failed, 2 bad input,
    3 no hard failure but OPD is unlikely to improve the student.
    """
    from opd.recipes.check import run_check

    options = {"student.path": student, "teacher.path": teacher, "data.path": prompts}
    cfg = build_config(DistillConfig, config_file=config, options=options, overrides=overrides)
    report = run_check(cfg, n=n, prompts_sample=prompts_sample, out=out, skip=list(skip_check or []))
    raise typer.Exit(report.exit_code())


@app.command("sft")
def sft_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    model: str | None = typer.Option(None, help="Model to fine-tune: Hugging Face id or local directory (model.path)."),
    data: list[str] | None = typer.Option(
        None,
        help="SFT data: chat / opd rollout / sharegpt / alpaca file (.jsonl, .json, .parquet); "
        "repeat for several (data.path).",
    ),
    epochs: float | None = typer.Option(
        None, help="Passes over the data (epochs); or set run.steps instead. [default: 1]"
    ),
    lr: float | None = typer.Option(None, help="Peak learning rate (optim.lr). [default: 1e-5]"),
    lora: bool | None = typer.Option(
        None, "--lora/--no-lora", help="Train LoRA adapters only, merged into <run>/merged at the end (lora.enabled)."
    ),
    name: str | None = typer.Option(
        None, help="Run directory name under run.out_dir (run.name). [default: sft-<time>]"
    ),
    resume: bool | None = typer.Option(
        None,
        "--resume/--no-resume",
        help="Continue from the newest complete checkpoint of the run directory (run.resume).",
    ),
    thinking: bool | None = _thinking("data.enable_thinking; must match how the answers were generated"),
    allow_config_change: bool | None = typer.Option(
        None,
        "--allow-config-change",
        help="With --resume: continue even though settings that change the math or data order differ from the saved "
        "config.yaml (run.allow_config_change).",
    ),
) -> None:
    """Supervised fine-tuning on (teacher) answers, loss on assistant tokens only: the cold start before
    `opd distill`."""
    from opd.recipes.sft import SFTConfig, sft

    options = {
        "model.path": model,
        "data.path": data or None,
        "epochs": epochs,
        "optim.lr": lr,
        "lora.enabled": lora,
        "run.name": name,
        "run.resume": resume,
        "data.enable_thinking": thinking,
        "run.allow_config_change": allow_config_change,
    }
    sft(build_config(SFTConfig, config_file=config, options=options, overrides=overrides))


@app.command("merge")
def merge_command(
    checkpoint: Path = typer.Argument(
        ..., help="LoRA checkpoint directory (checkpoints/step_N of an `opd sft` run with lora.enabled)."
    ),
    out: Path = typer.Argument(..., help="Output directory for the merged Hugging Face weights + tokenizer."),
    base: str | None = typer.Option(
        None, help="Base model id or path. [default: base_model_name_or_path of the adapter config]"
    ),
    dtype: str = typer.Option(
        "auto", help="Dtype of the written weights: auto (the base model's) | bf16 | fp16 | fp32."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="When OUT is a file or a non-empty directory, move it aside to OUT.old-<time> (never deleted). "
        "[default: refuse]",
    ),
) -> None:
    """Merge LoRA adapters into their base model: full weights that load without peft."""
    from opd.recipes.sft import merge_lora

    merged = merge_lora(checkpoint, out, base=base, dtype=dtype, existing="move" if overwrite else "refuse")
    typer.echo(f"merged: {merged}")


@app.command("rollout")
def rollout_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    model: str | None = typer.Option(None, help="Teacher model: Hugging Face id or local directory (model.path)."),
    prompts: str | None = typer.Option(
        None, help="Prompt set: parquet / JSONL / JSON / dataset dir / hub id (data.path)."
    ),
    out: Path | None = typer.Option(None, help="Output directory; rerunning into it skips finished prompts (out)."),
    n: int | None = typer.Option(None, help="Accepted samples wanted per prompt. [default: 1]"),
    temperature: float | None = typer.Option(None, help="Sampling temperature, 0 = greedy. [default: 1.0]"),
    top_p: float | None = typer.Option(None, help="Nucleus sampling mass in (0, 1]. [default: 0.95]"),
    max_new_tokens: int | None = typer.Option(
        None, help="Longest response in tokens; longer ones are rejected as truncated. [default: 7168]"
    ),
    thinking: bool | None = _thinking("data.enable_thinking"),
    max_attempts: int | None = typer.Option(None, help="Draws per wanted sample before it is given up. [default: 3]"),
    require_correct: bool | None = typer.Option(
        None,
        "--require-correct/--no-require-correct",
        help="Also reject answers graded wrong against the ground truth. [default: off]",
    ),
    prompt_key: str | None = typer.Option(None, help="Prompt column (data.prompt_key). [default: prompt]"),
    answer_key: str | None = typer.Option(
        None,
        help="Ground-truth column (data.answer_key); data.answer_key=null for none. "
        "[default: reward_model.ground_truth]",
    ),
    template: str | None = typer.Option(
        None, help="Instruction template: keep | dapo | boxed | custom:'…{problem}…' (data.template). [default: keep]"
    ),
    batch_size: int | None = typer.Option(
        None, help="Sequences generated together (prompts × n); the unit of resume. [default: 64]"
    ),
    num_workers: int | None = typer.Option(
        None, help="Worker processes, one per GPU (cuda:0..N-1), over disjoint batches. [default: 1]"
    ),
    llamafactory: bool | None = typer.Option(
        None,
        "--llamafactory/--no-llamafactory",
        help="Also write the LlamaFactory sharegpt dataset + dataset_info.json. [default: off]",
    ),
    dtype: str | None = typer.Option(None, help="auto | bf16 | fp16 | fp32 (model.dtype). [default: auto]"),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | cuda:N (model.device). [default: auto]"),
    seed: int | None = typer.Option(None, help="Base sampling seed. [default: 0]"),
    engine: str | None = typer.Option(
        None,
        help="Generation engine: torch | vllm (engine; vllm loads the model itself, options as vllm.*). "
        "[default: torch]",
    ),
) -> None:
    """Teacher answers for SFT with rejection sampling: rollouts.jsonl, rejected.jsonl, stats.json
    (+ LlamaFactory files).

    Rejects truncated, answer-less and degenerate responses (and, with --require-correct, wrong ones), retrying up
    to --max-attempts times. Degeneracy thresholds are config keys, e.g. `degeneracy.token_run=128`.
    """
    from opd.recipes.rollout import RolloutConfig, teacher_rollout

    options = {
        "model.path": model,
        "model.dtype": dtype,
        "model.device": device,
        "data.path": prompts,
        "out": _str(out),
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "data.enable_thinking": thinking,
        "max_attempts": max_attempts,
        "require_correct": require_correct,
        "data.prompt_key": prompt_key,
        "data.answer_key": answer_key,
        "data.template": template,
        "batch_size": batch_size,
        "num_workers": num_workers,
        "llamafactory": llamafactory,
        "seed": seed,
        "engine": engine,
    }
    teacher_rollout(build_config(RolloutConfig, config_file=config, options=options, overrides=overrides))


@app.command("dedup")
def dedup_command(
    in_path: str = typer.Option(
        ..., "--in", help="Prompt set A to clean: parquet / JSONL / JSON / dataset dir / hub id."
    ),
    against: str | None = typer.Option(
        None,
        help="Prompt set B: remove from A what duplicates B. "
        "[default: none = dedup A within itself, keeping the first]",
    ),
    out: Path = typer.Option(..., help="Where the kept prompts of A go (.parquet or .jsonl, verl layout)."),
    report: Path | None = typer.Option(
        None, help="JSON report: counts per rule, examples, every removed id. [default: <out stem>.report.json]"
    ),
    exact: bool = typer.Option(
        True,
        "--exact/--no-exact",
        help="Remove exact duplicates after normalisation (whitespace, case, instruction templates, LaTeX spacing).",
    ),
    minhash_threshold: float = typer.Option(
        0.8, help="Character 5-gram Jaccard similarity at or above which prompts are near-duplicates; 0 = skip MinHash."
    ),
    embeddings: str | None = typer.Option(
        None,
        help="Sentence-embedding model (name or directory, e.g. all-MiniLM-L6-v2) for a cosine stage. [default: off]",
    ),
    cosine_threshold: float = typer.Option(
        0.6, help="Cosine similarity at or above which the embedding stage removes a prompt."
    ),
    prompt_key: str = typer.Option("prompt", help="Prompt column of A (and of B unless --against-prompt-key)."),
    against_prompt_key: str | None = typer.Option(None, help="Prompt column of B. [default: --prompt-key]"),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="When OUT or the report exists, move it aside to <name>.old-<time> (never deleted). [default: refuse]",
    ),
) -> None:
    """Remove from a prompt set the exact and near duplicates of another set (or of itself): MinHash + optional
    embeddings."""
    from opd.recipes.dedup import dedup_files

    dedup_files(
        in_path,
        against,
        out,
        report=report,
        prompt_key=prompt_key,
        against_prompt_key=against_prompt_key,
        exact=exact,
        minhash_threshold=minhash_threshold or None,
        embedding_model=embeddings,
        cosine_threshold=cosine_threshold,
        overwrite=overwrite,
    )


@app.command("serve-teacher")
def serve_teacher_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    model: str | None = typer.Option(None, help="Teacher model: Hugging Face id or local directory (model.path)."),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | cuda:N (model.device). [default: auto]"),
    device_map: str | None = typer.Option(
        None,
        help="auto: split the model over all visible GPUs (accelerate) for a teacher larger than one GPU; its layers "
        "then run one GPU at a time (device_map). [default: off]",
    ),
    dtype: str | None = typer.Option(
        None, help="auto | bf16 | fp16 | fp32 (model.dtype). [default: auto = bf16 on GPU, fp32 on CPU]"
    ),
    host: str | None = typer.Option(
        None, help="Address to bind; a non-loopback address needs a token. [default: 127.0.0.1]"
    ),
    port: int | None = typer.Option(None, help="TCP port, 0 = any free one (printed). [default: 8765]"),
    token_file: Path | None = typer.Option(
        None, help="File with the bearer token clients must send. [default: $OPD_TEACHER_TOKEN, else none]"
    ),
) -> None:
    """Serve a teacher over HTTP: scores any token ids (sampled, top-k, requested ids, entropy) for `teacher.url`.

    Limits and batching are config keys, e.g. `max_batch_tokens=65536 max_rows=1024` (see
    opd.recipes.serve_teacher.ServeConfig).
    """
    from opd.recipes.serve_teacher import ServeConfig, serve

    options = {
        "model.path": model,
        "model.device": device,
        "device_map": device_map,
        "model.dtype": dtype,
        "host": host,
        "port": port,
        "token_file": _str(token_file),
    }
    serve(build_config(ServeConfig, config_file=config, options=options, overrides=overrides))


pipeline_app = typer.Typer(
    help="Cold start to evaluation from one config: rollout → SFT → OPD → eval.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(pipeline_app, name="pipeline")


@pipeline_app.command("run")
def pipeline_run_command(
    config: Path = typer.Argument(..., help="Pipeline YAML (see configs/pipeline_cold_start_qwen3.yaml)."),
    overrides: list[str] | None = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
) -> None:
    """Run every stage whose outputs are not complete (each resumable), then print the before/after/teacher table."""
    from opd.recipes.pipeline import PipelineConfig, run_pipeline

    run_pipeline(build_config(PipelineConfig, config_file=config, overrides=overrides))


@app.command("report")
def report_command(
    run_dirs: list[Path] = typer.Argument(
        ..., help="One run directory, or several to overlay their curves (ablations)."
    ),
    out: Path | None = typer.Option(
        None, help="Output directory or .html path. [default: the run dir; <first>/compare for several]"
    ),
) -> None:
    """Write plots/*.png and a self-contained report.html for one or more run directories (also while running)."""
    typer.echo(f"report: {write_report(run_dirs, out)}")


# ------------------------------------------------------------------------------------------- opd prompts

prompts_app = typer.Typer(
    help="Teacher-aligned prompt sets: re-template, score student/teacher top-k overlap per prompt, select.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(prompts_app, name="prompts")

PROMPT_KEY_HELP = "Prompt column: chat messages or plain text; dotted keys reach into structs."
ANSWER_KEY_HELP = "Ground-truth column; '' for a set without answers."
ID_KEY_HELP = "Id column. [default: extra_info.index, else id, else the row number]"


@prompts_app.command("template")
def prompts_template_command(
    source: str = typer.Option(..., "--in", help="Prompt set: parquet / JSONL / JSON / dataset dir / hub id."),
    template: str = typer.Option(
        ...,
        help="New instruction: boxed | dapo | keep | custom:'…{problem}…'; "
        "a known DAPO / boxed instruction is stripped first.",
    ),
    out: Path = typer.Option(
        ..., help="Output prompt set, .parquet or .jsonl (verl layout, loads back with the defaults)."
    ),
    prompt_key: str = typer.Option("prompt", help=PROMPT_KEY_HELP),
    answer_key: str = typer.Option("reward_model.ground_truth", help=ANSWER_KEY_HELP),
    id_key: str | None = typer.Option(None, help=ID_KEY_HELP),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="When OUT exists, move it aside to OUT.old-<time> (never deleted). [default: refuse]"
    ),
) -> None:
    """Replace each prompt's instruction, e.g. DAPO-Math-17k's "Answer:" line → Qwen's \\boxed{} (problems, answers,
    ids kept)."""
    from opd.recipes.prompts import retemplate_file

    typer.echo(
        retemplate_file(
            source,
            out,
            template,
            prompt_key=prompt_key,
            answer_key=answer_key or None,
            id_key=id_key,
            overwrite=overwrite,
        )
    )


@prompts_app.command("score")
def prompts_score_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    student: str | None = typer.Option(None, help="Student model: Hugging Face id or local directory (student.path)."),
    teacher: str | None = typer.Option(None, help="Teacher model, same tokenizer as the student (teacher.path)."),
    source: str | None = typer.Option(
        None, "--in", help="Prompt set to score: parquet / JSONL / JSON / dataset dir / hub id (data.path)."
    ),
    out: Path | None = typer.Option(
        None,
        help="Scores JSONL, one line per prompt, appended per batch; rerunning resumes. "
        "config.yaml goes beside it (out).",
    ),
    n: int | None = typer.Option(None, help="Student rollouts per prompt (n). [default: 4]"),
    top_k: int | None = typer.Option(None, help="K of the compared top-k supports (top_k). [default: 16]"),
    max_new_tokens: int | None = typer.Option(None, help="Longest rollout in tokens (max_new_tokens). [default: 1024]"),
    batch_size: int | None = typer.Option(
        None, help="Prompts per batch, × n rollouts; keep it when resuming (batch_size). [default: 32]"
    ),
    template: str | None = typer.Option(
        None, help="Instruction template applied before encoding (data.template). [default: keep]"
    ),
    seed: int | None = typer.Option(None, help="Sampling seed (seed). [default: 0]"),
    thinking: bool | None = _thinking("data.enable_thinking"),
    engine: str | None = typer.Option(
        None,
        help="Engine of the student rollouts: auto | torch | static | vllm (engine; options as vllm.*). "
        "[default: auto]",
    ),
) -> None:
    """Per prompt: n student rollouts, scored by student and teacher; SPEC §6 overlap metrics → scores JSONL.

    Other keys as key=value, e.g. `data.prompt_key=problem teacher.device=cuda:1 data.max_prompt_length=2048`.
    """
    from opd.recipes.prompts import PromptScoreConfig, score_prompt_file

    options = {
        "student.path": student,
        "teacher.path": teacher,
        "data.path": source,
        "out": _str(out),
        "n": n,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "data.template": template,
        "seed": seed,
        "data.enable_thinking": thinking,
        "engine": engine,
    }
    score_prompt_file(build_config(PromptScoreConfig, config_file=config, options=options, overrides=overrides))


@prompts_app.command("select")
def prompts_select_command(
    source: str = typer.Option(
        ..., "--in", help="The scored prompt set (read with the same column options as when scored)."
    ),
    scores: Path = typer.Option(..., help="Scores JSONL that `opd prompts score` wrote for --in."),
    out: Path = typer.Option(..., help="Output prompt set, .parquet or .jsonl (verl layout)."),
    top: str = typer.Option(
        "0.5", help="Keep this fraction (0.5 or 50%) or this count (500) of the most aligned prompts."
    ),
    by: str = typer.Option(
        "overlap_ratio",
        help="Rank by overlap_ratio | overlap_mass_student | overlap_mass_teacher | "
        "overlap_advantage (larger = aligned) | entropy_gap (smaller = aligned).",
    ),
    mix_with: str | None = typer.Option(
        None, help="Another prompt set to mix in: purely aligned prompts collapse the student's entropy."
    ),
    ratio: float = typer.Option(0.3, help="Fraction of the result drawn at random from --mix-with, in [0, 1)."),
    seed: int = typer.Option(0, help="Seed of the draw from --mix-with."),
    prompt_key: str = typer.Option("prompt", help=PROMPT_KEY_HELP + " Applies to --in and --mix-with."),
    answer_key: str = typer.Option("reward_model.ground_truth", help=ANSWER_KEY_HELP),
    id_key: str | None = typer.Option(None, help=ID_KEY_HELP),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="When OUT exists, move it aside to OUT.old-<time> (never deleted). [default: refuse]"
    ),
) -> None:
    """Keep the most teacher-aligned prompts by their scores, optionally mixed with prompts from another set."""
    from opd.recipes.prompts import select_prompt_file

    typer.echo(
        select_prompt_file(
            source,
            scores,
            out,
            top=top,
            by=by,
            mix_with=mix_with,
            ratio=ratio,
            seed=seed,
            prompt_key=prompt_key,
            answer_key=answer_key or None,
            id_key=id_key,
            overwrite=overwrite,
        )
    )


@app.command("demo")
def demo_command(
    overrides: list[str] | None = _overrides(),
    config: Path | None = _config(),
    steps: int | None = typer.Option(None, help="OPD steps (run.steps). [default: 200]"),
    limit: int | None = typer.Option(
        None, help="Evaluate on the first N test problems only (eval.limit). [default: all 300]"
    ),
    out_dir: str | None = typer.Option(None, help="Parent directory of the run (run.out_dir). [default: runs]"),
    name: str | None = typer.Option(None, help="Run directory name (run.name). [default: demo-<time>]"),
    threads: int = typer.Option(
        1, help="torch CPU threads; 0 = torch's default (the lab models are fastest on 1 when cores are busy)."
    ),
) -> None:
    """OPD in minutes on a CPU: distill the shipped lab student from the shipped lab teacher, print before/after.

    Evaluates teacher and student on the lab test set (`opd eval`), runs `opd distill` with configs/lab_demo.yaml's
    settings, evaluates the student again, prints the table and writes demo.json + report.html into the run dir.
    """
    from opd.recipes.demo import demo

    options = {"run.steps": steps, "eval.limit": limit, "run.out_dir": out_dir, "run.name": name}
    extra = [f"{key}={value}" for key, value in options.items() if value is not None]
    demo(extra + list(overrides or []), config_file=config, threads=threads or None)


lab_app = typer.Typer(
    help="The lab: a synthetic arithmetic task with a tiny teacher/student pair shipped in the package.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(lab_app, name="lab")


@lab_app.command("build")
def lab_build_command(
    out: Path = typer.Argument(
        ..., help="Output directory: teacher/, student/, data/, work/ (SFT runs), manifest.json."
    ),
    seed: int = typer.Option(0, help="Seed of model initialisation and data order (the student uses seed + 1)."),
    teacher_steps: int = typer.Option(
        6000, help="SFT steps of the teacher (batch 64; hours on one CPU thread: docs/performance.md)."
    ),
    student_steps: int = typer.Option(
        500, help="SFT steps of the student (batch 64; its rate on one CPU thread: docs/performance.md)."
    ),
    sft_examples: int | None = typer.Option(None, help="Size of the SFT set (train-split problems). [default: 60000]"),
    eval_limit: int | None = typer.Option(
        None, help="Measure accuracy on the first N test problems only. [default: all 300]"
    ),
    threads: int = typer.Option(1, help="torch CPU threads; 0 = torch's default."),
    rewrite_teacher_steps: int = typer.Option(
        4000,
        help="SFT steps of the rewrite-style teacher, fine-tuned from the forward teacher "
        "(batch 256; a GPU job, see docs/lab.md).",
    ),
    rewrite_teacher_batch: int = typer.Option(256, help="Examples per SFT step of the rewrite-style teacher."),
    specialist_steps: int = typer.Option(
        300, help="SFT steps of each MOPD specialist (specialist_add, specialist_mul), from the forward teacher."
    ),
    specialist_batch: int = typer.Option(64, help="Examples per SFT step of each MOPD specialist."),
    only: str | None = typer.Option(
        None,
        help="Comma-separated models to train: teacher, student, rewrite_teacher, specialist_add, "
        "specialist_mul. [default: all five]",
    ),
    device: str = typer.Option("cpu", help="Where the models train and are measured: cpu, cuda, cuda:N."),
    time_budget: float | None = typer.Option(
        None,
        help="Wall seconds per model's SFT (set-up included): train the steps that fit, "
        "then always save, measure and record. [default: none]",
    ),
) -> None:
    """Retrain the lab models (forward-style teacher and student, rewrite-style teacher, the two MOPD specialists)
    from a seed with `opd sft` and write their manifest (accuracies measured, per domain for the specialists)."""
    from opd.recipes.lab import build

    manifest = build(
        out,
        seed=seed,
        teacher_steps=teacher_steps,
        student_steps=student_steps,
        rewrite_teacher_steps=rewrite_teacher_steps,
        rewrite_teacher_batch=rewrite_teacher_batch,
        specialist_steps=specialist_steps,
        specialist_batch=specialist_batch,
        sft_examples=sft_examples,
        eval_limit=eval_limit,
        only=_names(only),
        device=device,
        time_budget_s=time_budget,
        threads=threads or None,
    )
    typer.echo(f"manifest: {manifest}")


@lab_app.command("run")
def lab_run_command(
    name: str = typer.Argument(
        ...,
        help="Experiment: topk (only_stu / intersection / union-intersection, top-1/4/16, sampled-token) | teacher "
        "(real teacher vs the student as its own teacher) | style (thinking-pattern mismatch: a rewrite-style teacher, "
        "with and without an SFT cold start, vs the matched forward teacher).",
    ),
    overrides: list[str] | None = typer.Argument(
        None, help=OVERRIDES_HELP + " Applied to every run.", show_default=False
    ),
    steps: int = typer.Option(50, help="OPD steps per run."),
    out_dir: Path = typer.Option(Path("runs/lab"), help="Parent directory; runs go to <out-dir>/<name>/<variant>."),
    only: str | None = typer.Option(None, help="Comma-separated variants to run. [default: all of the experiment]"),
    threads: int = typer.Option(1, help="torch CPU threads; 0 = torch's default."),
    seeds: str | None = typer.Option(
        None,
        help="Comma-separated run.seed values: each variant once per seed (runs <variant>_s<seed>). "
        "[default: once, seed 0]",
    ),
    check: bool = typer.Option(
        False,
        "--check/--no-check",
        help="Run `opd check` on each variant's pair first: its forecast next to the measured outcome.",
    ),
) -> None:
    """A small replication: short `opd distill` runs that differ in one setting; summary.json/.md + a comparison
    report."""
    from opd.recipes.lab import run_experiment

    run_experiment(
        name,
        out_dir=out_dir,
        steps=steps,
        overrides=list(overrides or []),
        only=_names(only),
        seeds=_seeds(seeds),
        check=check,
        threads=threads or None,
    )


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _names(value: str | None) -> list[str] | None:
    """A comma-separated option as its list of names; None when not given."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _seeds(value: str | None) -> list[int] | None:
    """`--seeds 0,1,2` as integers; None when not given."""
    try:
        return [int(s) for s in value.split(",") if s.strip()] if value else None
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {value!r}") from None


def main() -> None:
    """Entry point. User errors print one line `error: …` on stderr and exit 2; OPD_DEBUG=1 re-raises them with the
    traceback. User errors are: bad options (click's usage errors), bad config / data / paths (`ValueError`:
    ConfigError, DataError, ModelLoadError, …), and every `OSError` of a file we read or write (named with what is
    wrong there)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not os.environ.get("OPD_DEBUG"):  # libraries' deprecation notes about their own internals are not the user's
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft|accelerate)(\.|$)")
    try:
        from transformers.utils import logging as hf_logging  # heavy: not at module top, for the same reason

        hf_logging.disable_progress_bar()  # our own progress bars say what is going on
    except ImportError:
        pass
    usage_errors, no_args_errors, aborts = _click_errors()
    try:
        code = app(args=_legacy_thinking(sys.argv[1:]), standalone_mode=False, prog_name="opd")
    except no_args_errors as error:  # `opd` / `opd prompts` alone: the help, as click does
        error.show()
        sys.exit(error.exit_code)
    except aborts:  # Ctrl-C
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    except usage_errors as error:
        if os.environ.get("OPD_DEBUG"):
            raise
        _fail(_usage_line(error), 2)
    except Exception as error:  # noqa: BLE001 - every user error becomes one line; anything else keeps its traceback
        line = user_error_line(error)
        if line is None or os.environ.get("OPD_DEBUG"):
            raise
        _fail(line, 2)
    code = code if isinstance(code, int) else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun worker (torch is loaded already): see exit_process
        from opd.train.distributed import exit_process

        exit_process(code)
    sys.exit(code)


_ON_OFF = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def _legacy_thinking(args: list[str]) -> list[str]:
    """`--thinking on|off` (and `--thinking=on`), the spelling `opd rollout` had, → `--thinking` / `--no-thinking`,
    with a note on stderr; kept for one release. A word after `--thinking` that is neither on/off nor an option nor a
    key=value override is a usage error naming it (it would otherwise be read as a malformed override)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        value = arg.split("=", 1)[1] if arg.startswith("--thinking=") else None
        if arg == "--thinking" and i + 1 < len(args) and not args[i + 1].startswith("-") and "=" not in args[i + 1]:
            value, i = args[i + 1], i + 1
        if value is not None:
            if value.lower() not in _ON_OFF:
                raise ValueError(f"--thinking takes no value, got {value!r}; use --thinking or --no-thinking")
            flag = "--thinking" if _ON_OFF[value.lower()] else "--no-thinking"
            typer.echo(f"note: '--thinking {value}' is deprecated and goes in the next release; use {flag}", err=True)
            arg = flag
        out.append(arg)
        i += 1
    return out


def _click_errors() -> tuple[tuple, tuple, tuple]:
    """(usage errors, no-arguments-help errors, aborts) of the click that typer runs on: its vendored copy
    (`typer._click`, newer typer) and the click package (older typer)."""
    modules = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass

    def classes(attr: str) -> tuple:
        return tuple(dict.fromkeys(getattr(m, attr) for m in modules if hasattr(m, attr)))

    return classes("ClickException"), classes("NoArgsIsHelpError"), (*classes("Abort"), typer.Abort)


def _fail(line: str, code: int) -> None:
    rank, world = os.environ.get("RANK", "").strip(), os.environ.get("WORLD_SIZE", "").strip()
    if rank not in ("", "0") and world not in ("", "0", "1"):
        # Under torchrun only rank 0 prints: every rank meets the same bad option / config / data / path, and one line
        # per rank buried it. Another rank waits first: torchrun (polling every 0.1 s) ends it once rank 0 has failed
        # too, so its line is never printed; a rank still alive after the wait failed alone and says so.
        time.sleep(_OTHER_RANK_WAIT_S)
        line = f"rank {rank}: {line}"
    typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
    sys.exit(code)


_OTHER_RANK_WAIT_S = 5.0
"""How long a torchrun rank other than 0 waits before printing its user error (rank 0 failing too ends it first)."""


def _usage_line(error: Any) -> str:
    """click's usage error (bad option, missing argument, unknown command) as one line with where to look."""
    message = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    return f"{message} (see '{ctx.command_path} --help')" if ctx is not None else message


def user_error_line(error: BaseException) -> str | None:
    """The one-line message for an error the user can fix, or None for a bug (which keeps its traceback)."""
    if isinstance(error, OSError):
        return os_error_line(error)
    if type(error).__name__ == "SafetensorError":  # not caught where a file is known: still say what it is
        return f"a .safetensors file is corrupt or truncated ({_one_line(error)}); re-download or re-save it"
    if isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error):  # torch.load of a truncated file
        return f"a torch checkpoint file is corrupt or truncated ({_one_line(error)[:200]}); re-save or re-download it"
    if isinstance(error, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({_one_line(error)}); convert it to UTF-8"
    if isinstance(error, ValueError):
        return _one_line(error)
    return None


def _one_line(error: BaseException) -> str:
    """The message on one line: pydantic's multi-line validation errors become their first error."""
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{error.title}: {where + ': ' if where else ''}{first['msg']}, got {first.get('input')!r}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(error).__name__


def os_error_line(error: OSError) -> str:
    """An OS error as `<path>: <what is wrong there>`. Where a rename failed, the destination is the path the user
    named (the source is our hidden temp file); where a parent 'is not a directory', the regular file that is in
    the way is named."""
    if error.errno is None or error.filename is None:
        return _one_line(error)
    path = str(error.filename2 if error.filename2 is not None else error.filename)
    code = error.errno
    if code == errno.ENOTDIR:
        blocker = next((p for p in [Path(path), *Path(path).parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None and str(blocker) != path:
            return f"{path}: {blocker} is a file, not a directory; choose an output path outside it"
        return f"{path}: not a directory; expected a directory here"
    reasons = {
        errno.ENOENT: "no such file or directory",
        errno.EACCES: "permission denied; choose a location you may write to (or fix its permissions)",
        errno.EPERM: "operation not permitted; choose a location you may write to (or fix its permissions)",
        errno.EROFS: "the file system is read-only; choose an output path on a writable one",
        errno.ENOSPC: "no space left on the device; free space there or choose another location",
        errno.EDQUOT: "disk quota exceeded; free space there or choose another location",
        errno.EISDIR: "is a directory; expected a file path here",
        errno.ENOTEMPTY: "is a non-empty directory; choose another path",
        errno.ENAMETOOLONG: "the name is too long",
        errno.EMFILE: "too many open files",
    }
    if code == errno.EEXIST:
        kind = "a file" if Path(path).is_file() else "a directory" if Path(path).is_dir() else "something"
        return f"{path}: already exists as {kind}; expected {'a directory' if kind == 'a file' else 'a new path'} here"
    return f"{path}: {reasons.get(code) or error.strerror or _one_line(error)}"


if __name__ == "__main__":
    main()
