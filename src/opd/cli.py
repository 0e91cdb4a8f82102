"""The `opd` command line. Each command: build its typed config (YAML < options < key=value), then call its recipe.
No logic lives here; every command's program is also a Python function in `opd.recipes` (e.g. `opd.recipes.sft.sft`
for `opd sft`). An option that sets a config key takes its help and shown default from the config field
(`opd.cli_options.field_option`); a user error becomes one line (`opd.cli_errors`)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from opd.cli_errors import click_errors, os_error_line, usage_line, user_error_line
from opd.cli_options import (
    OVERRIDES_HELP,
    config_file_option,
    config_options,
    field_option,
    legacy_thinking,
    overrides_argument,
    parse_names,
    parse_seeds,
    thinking_option,
)
from opd.config import (
    DistillConfig,
    EvalConfig,
    PipelineConfig,
    PromptScoreConfig,
    RolloutConfig,
    ServeConfig,
    SFTConfig,
    build_config,
)
from opd.report import write_report

__all__ = ["app", "main", "os_error_line", "user_error_line"]

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


@app.command("eval")
def eval_command(
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    model: Annotated[str | None, field_option(EvalConfig, "model.path")] = None,
    responses: Annotated[Path | None, field_option(EvalConfig, "responses")] = None,
    benchmarks: Annotated[str | None, field_option(EvalConfig, "benchmarks")] = None,
    n: Annotated[int | None, field_option(EvalConfig, "n")] = None,
    temperature: Annotated[float | None, field_option(EvalConfig, "temperature")] = None,
    top_p: Annotated[float | None, field_option(EvalConfig, "top_p")] = None,
    top_k: Annotated[int | None, field_option(EvalConfig, "top_k")] = None,
    max_new_tokens: Annotated[int | None, field_option(EvalConfig, "max_new_tokens")] = None,
    batch_size: Annotated[int | None, field_option(EvalConfig, "batch_size")] = None,
    limit: Annotated[int | None, field_option(EvalConfig, "limit")] = None,
    prompt_key: Annotated[str | None, field_option(EvalConfig, "prompt_key")] = None,
    answer_key: Annotated[str | None, field_option(EvalConfig, "answer_key")] = None,
    template: Annotated[str | None, field_option(EvalConfig, "template")] = None,
    thinking: Annotated[bool | None, field_option(EvalConfig, "enable_thinking", "--thinking/--no-thinking")] = None,
    dtype: Annotated[str | None, field_option(EvalConfig, "model.dtype")] = None,
    device: Annotated[str | None, field_option(EvalConfig, "model.device")] = None,
    seed: Annotated[int | None, field_option(EvalConfig, "seed")] = None,
    out: Annotated[Path | None, field_option(EvalConfig, "out")] = None,
    engine: Annotated[str | None, field_option(EvalConfig, "engine")] = None,
    tools: Annotated[str | None, field_option(EvalConfig, "tools")] = None,
    sandbox: Annotated[str | None, field_option(EvalConfig, "sandbox")] = None,
    max_turns: Annotated[int | None, field_option(EvalConfig, "max_turns")] = None,
    tool_format: Annotated[str | None, field_option(EvalConfig, "tool_format")] = None,
) -> None:
    """Sample n answers per benchmark problem, grade them, write results.json + samples.jsonl, print a table.

    With --tools, each problem is an episode with that environment (python, calculator or an import path) and its
    final turn is graded."""
    cfg = build_config(EvalConfig, config_file=config, options=config_options(ctx), overrides=overrides)
    from opd.recipes.eval import evaluate

    evaluate(cfg)


@app.command("distill")
def distill_command(
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    student: Annotated[str | None, field_option(DistillConfig, "student.path")] = None,
    teacher: Annotated[str | None, field_option(DistillConfig, "teacher.path")] = None,
    prompts: Annotated[str | None, field_option(DistillConfig, "data.path")] = None,
    steps: Annotated[int | None, field_option(DistillConfig, "run.steps")] = None,
    name: Annotated[str | None, field_option(DistillConfig, "run.name")] = None,
    out_dir: Annotated[str | None, field_option(DistillConfig, "run.out_dir")] = None,
    resume: Annotated[bool | None, field_option(DistillConfig, "run.resume", "--resume/--no-resume")] = None,
    top_k: Annotated[int | None, field_option(DistillConfig, "objective.top_k")] = None,
    strategy: Annotated[str | None, field_option(DistillConfig, "objective.strategy")] = None,
    weight: Annotated[str | None, field_option(DistillConfig, "objective.weight")] = None,
    advantage: Annotated[str | None, field_option(DistillConfig, "objective.advantage")] = None,
    lr: Annotated[float | None, field_option(DistillConfig, "optim.lr")] = None,
    seed: Annotated[int | None, field_option(DistillConfig, "run.seed")] = None,
    thinking: Annotated[
        bool | None, field_option(DistillConfig, "data.enable_thinking", "--thinking/--no-thinking")
    ] = None,
    allow_config_change: Annotated[
        bool | None, field_option(DistillConfig, "run.allow_config_change", "--allow-config-change")
    ] = None,
    skip_check: Annotated[list[str] | None, field_option(DistillConfig, "skip_checks", "--skip-check")] = None,
) -> None:
    """On-policy distillation: the student samples, the teacher scores the student's tokens, policy-gradient update.

    Every config key (see `configs/opd_qwen3_1.7b_from_4b.yaml`) can be set as key=value, e.g.
    `prompts_per_step=32 rollout.n=4`.
    """
    cfg = build_config(DistillConfig, config_file=config, options=config_options(ctx), overrides=overrides)
    from opd.recipes.distill import distill

    distill(cfg)


@app.command("check")
def check_command(
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    student: Annotated[str | None, field_option(DistillConfig, "student.path")] = None,
    teacher: Annotated[str | None, field_option(DistillConfig, "teacher.path")] = None,
    prompts: Annotated[str | None, field_option(DistillConfig, "data.path")] = None,
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

    cfg = build_config(DistillConfig, config_file=config, options=config_options(ctx), overrides=overrides)
    report = run_check(cfg, n=n, prompts_sample=prompts_sample, out=out, skip=list(skip_check or []))
    raise typer.Exit(report.exit_code())


@app.command("sft")
def sft_command(
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    model: Annotated[str | None, field_option(SFTConfig, "model.path")] = None,
    data: Annotated[list[str] | None, field_option(SFTConfig, "data.path")] = None,
    epochs: Annotated[float | None, field_option(SFTConfig, "epochs")] = None,
    lr: Annotated[float | None, field_option(SFTConfig, "optim.lr")] = None,
    lora: Annotated[bool | None, field_option(SFTConfig, "lora.enabled", "--lora/--no-lora")] = None,
    name: Annotated[str | None, field_option(SFTConfig, "run.name")] = None,
    resume: Annotated[bool | None, field_option(SFTConfig, "run.resume", "--resume/--no-resume")] = None,
    thinking: Annotated[
        bool | None, field_option(SFTConfig, "data.enable_thinking", "--thinking/--no-thinking")
    ] = None,
    allow_config_change: Annotated[
        bool | None, field_option(SFTConfig, "run.allow_config_change", "--allow-config-change")
    ] = None,
) -> None:
    """Supervised fine-tuning on (teacher) answers, loss on assistant tokens only: the cold start before
    `opd distill`."""
    from opd.recipes.sft import sft

    sft(build_config(SFTConfig, config_file=config, options=config_options(ctx), overrides=overrides))


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


def _rollout(key: str, *param_decls: str) -> Any:
    return field_option(RolloutConfig, key, *param_decls)


def _serve(key: str) -> Any:
    return field_option(ServeConfig, key)


@app.command("rollout")
def rollout_command(
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    model: Annotated[str | None, _rollout("model.path")] = None,
    prompts: Annotated[str | None, _rollout("data.path")] = None,
    out: Annotated[Path | None, _rollout("out")] = None,
    n: Annotated[int | None, _rollout("n")] = None,
    temperature: Annotated[float | None, _rollout("temperature")] = None,
    top_p: Annotated[float | None, _rollout("top_p")] = None,
    max_new_tokens: Annotated[int | None, _rollout("max_new_tokens")] = None,
    thinking: Annotated[bool | None, thinking_option("data.enable_thinking")] = None,
    max_attempts: Annotated[int | None, _rollout("max_attempts")] = None,
    require_correct: Annotated[
        bool | None, _rollout("require_correct", "--require-correct/--no-require-correct")
    ] = None,
    prompt_key: Annotated[str | None, _rollout("data.prompt_key")] = None,
    answer_key: Annotated[str | None, _rollout("data.answer_key")] = None,
    template: Annotated[str | None, _rollout("data.template")] = None,
    batch_size: Annotated[int | None, _rollout("batch_size")] = None,
    num_workers: Annotated[int | None, _rollout("num_workers")] = None,
    llamafactory: Annotated[bool | None, _rollout("llamafactory", "--llamafactory/--no-llamafactory")] = None,
    dtype: Annotated[str | None, _rollout("model.dtype")] = None,
    device: Annotated[str | None, _rollout("model.device")] = None,
    seed: Annotated[int | None, _rollout("seed")] = None,
    engine: Annotated[str | None, _rollout("engine")] = None,
    tools: Annotated[str | None, _rollout("tools")] = None,
    sandbox: Annotated[str | None, _rollout("sandbox")] = None,
    max_turns: Annotated[int | None, _rollout("max_turns")] = None,
    tool_format: Annotated[str | None, _rollout("tool_format")] = None,
) -> None:
    """Teacher answers for SFT with rejection sampling: rollouts.jsonl, rejected.jsonl, stats.json
    (+ LlamaFactory files).

    Rejects truncated, answer-less and degenerate responses (and, with --require-correct, wrong ones), retrying up
    to --max-attempts times. Degeneracy thresholds are config keys, e.g. `degeneracy.token_run=128`. With --tools,
    each sample is an episode with that environment; its final turn is graded and the whole conversation (tool
    calls and answers) written for `opd sft`.
    """
    from opd.recipes.rollout import teacher_rollout

    teacher_rollout(build_config(RolloutConfig, config_file=config, options=config_options(ctx), overrides=overrides))


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
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    model: Annotated[str | None, _serve("model.path")] = None,
    device: Annotated[str | None, _serve("model.device")] = None,
    device_map: Annotated[str | None, _serve("device_map")] = None,
    dtype: Annotated[str | None, _serve("model.dtype")] = None,
    host: Annotated[str | None, _serve("host")] = None,
    port: Annotated[int | None, _serve("port")] = None,
    token_file: Annotated[Path | None, _serve("token_file")] = None,
) -> None:
    """Serve a teacher over HTTP: scores any token ids (sampled, top-k, requested ids, entropy) for `teacher.url`.

    Limits and batching are config keys, e.g. `max_batch_tokens=65536 max_rows=1024` (see
    opd.config.serve_teacher.ServeConfig).
    """
    from opd.recipes.serve_teacher import serve

    serve(build_config(ServeConfig, config_file=config, options=config_options(ctx), overrides=overrides))


pipeline_app = typer.Typer(
    help="Cold start to evaluation from one config: rollout → SFT → OPD → eval.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(pipeline_app, name="pipeline")


@pipeline_app.command("run")
def pipeline_run_command(
    config: Path = typer.Argument(..., help="Pipeline YAML (see configs/pipeline_cold_start_qwen3.yaml)."),
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
) -> None:
    """Run every stage whose outputs are not complete (each resumable), then print the before/after/teacher table."""
    from opd.recipes.pipeline import run_pipeline

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
    ctx: typer.Context,
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
    student: Annotated[str | None, field_option(PromptScoreConfig, "student.path")] = None,
    teacher: Annotated[str | None, field_option(PromptScoreConfig, "teacher.path")] = None,
    source: Annotated[str | None, field_option(PromptScoreConfig, "data.path", "--in")] = None,
    out: Annotated[Path | None, field_option(PromptScoreConfig, "out")] = None,
    n: Annotated[int | None, field_option(PromptScoreConfig, "n")] = None,
    top_k: Annotated[int | None, field_option(PromptScoreConfig, "top_k")] = None,
    max_new_tokens: Annotated[int | None, field_option(PromptScoreConfig, "max_new_tokens")] = None,
    batch_size: Annotated[int | None, field_option(PromptScoreConfig, "batch_size")] = None,
    template: Annotated[str | None, field_option(PromptScoreConfig, "data.template")] = None,
    seed: Annotated[int | None, field_option(PromptScoreConfig, "seed")] = None,
    thinking: Annotated[
        bool | None, field_option(PromptScoreConfig, "data.enable_thinking", "--thinking/--no-thinking")
    ] = None,
    engine: Annotated[str | None, field_option(PromptScoreConfig, "engine")] = None,
) -> None:
    """Per prompt: n student rollouts, scored by student and teacher; SPEC §6 overlap metrics → scores JSONL.

    Other keys as key=value, e.g. `data.prompt_key=problem teacher.device=cuda:1 data.max_prompt_length=2048`.
    """
    from opd.recipes.prompts import score_prompt_file

    score_prompt_file(
        build_config(PromptScoreConfig, config_file=config, options=config_options(ctx), overrides=overrides)
    )


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
    overrides: Annotated[list[str] | None, overrides_argument()] = None,
    config: Annotated[Path | None, config_file_option()] = None,
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
    cross_teacher_steps: int = typer.Option(
        1000,
        help="SFT steps of the cross-tokenizer teacher (teacher_pairs: the forward teacher on a digit-pair "
        "vocabulary).",
    ),
    only: str | None = typer.Option(
        None,
        help="Comma-separated models to train: teacher, student, rewrite_teacher, specialist_add, "
        "specialist_mul, teacher_pairs, and the tool lab's tools_teacher, tools_student (built only when named). "
        "[default: the first six]",
    ),
    device: str = typer.Option("cpu", help="Where the models train and are measured: cpu, cuda, cuda:N."),
    time_budget: float | None = typer.Option(
        None,
        help="Wall seconds per model's SFT (set-up included): train the steps that fit, "
        "then always save, measure and record. [default: none]",
    ),
) -> None:
    """Retrain the lab models (forward-style teacher and student, rewrite-style teacher, the two MOPD specialists,
    the cross-tokenizer teacher) from a seed with `opd sft` and write their manifest (accuracies measured, per
    domain for the specialists)."""
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
        cross_teacher_steps=cross_teacher_steps,
        sft_examples=sft_examples,
        eval_limit=eval_limit,
        only=parse_names(only),
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
    from opd.recipes.lab_experiments import run_experiment

    run_experiment(
        name,
        out_dir=out_dir,
        steps=steps,
        overrides=list(overrides or []),
        only=parse_names(only),
        seeds=parse_seeds(seeds),
        check=check,
        threads=threads or None,
    )


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
    usage_errors, no_args_errors, aborts = click_errors()
    try:
        code = app(args=legacy_thinking(sys.argv[1:]), standalone_mode=False, prog_name="opd")
    except no_args_errors as error:  # `opd` / `opd prompts` alone: the help, as click does
        error.show()
        sys.exit(error.exit_code)
    except aborts:  # Ctrl-C
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    except usage_errors as error:
        if os.environ.get("OPD_DEBUG"):
            raise
        _fail(usage_line(error), 2)
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


if __name__ == "__main__":
    main()
