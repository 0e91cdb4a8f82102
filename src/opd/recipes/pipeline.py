"""`opd pipeline run CONFIG`: the paper's off-policy cold start in one command —
teacher rollout → SFT of the student on the accepted answers → OPD from the SFT checkpoint → evaluation of the
student before, after SFT, after OPD and of the teacher, with the gap-recovery rate (SPEC §6).

Each stage writes into `<out_dir>/<stage>` and is resumable on its own (rollout skips finished prompts, SFT and
OPD resume from their newest checkpoint, eval skips graded chunks). A stage that finished writes a `STAGE_COMPLETE`
marker and is skipped on rerun. Per-stage options are the stage commands' own config keys, validated when the
pipeline config is read, so a typo fails before any compute. The pipeline holds the lock of `out_dir` (each stage
also locks its own directory), and a rerun must use the saved `out_dir/config.yaml`'s settings (only `stages` may
differ): complete stages are skipped, so other changes would mix two recipes in one comparison.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from opd.config import (
    ConfigError,
    EvalConfig,
    ModelSpec,
    save_config,
)
from opd.config.pipeline import PipelineConfig
from opd.io import atomic_write_json, atomic_write_text
from opd.names import benchmark_names
from opd.objectives import gap_recovery
from opd.recipes.distill import check_sizes, distill
from opd.recipes.eval import evaluate
from opd.recipes.rollout import teacher_rollout
from opd.recipes.sft import check_config as check_sft_config
from opd.recipes.sft import sft
from opd.rundir import config_changes, locked
from opd.train.checkpoint import latest_checkpoint
from opd.train.common import deterministic_workspace
from opd.train.distributed import SINGLE

MARKER = "STAGE_COMPLETE"


def run_pipeline(config: PipelineConfig, *, console: Any = None) -> dict:
    """Run the configured stages, skipping complete ones; return the final comparison (also `summary.json`)."""
    console = console or Console()
    root = Path(config.out_dir)
    stages = config.stage_configs()
    check_stages(config, stages)  # every stage's own startup checks that need only its config: before any compute
    if any(stages[name].run.deterministic for name in ("sft", "distill") if name in config.stages):
        deterministic_workspace()  # before the first stage's CUDA work: torch reads it once per process
    with locked(root, "pipeline", console=console):
        return _run_locked(config, root, stages, console)


def check_stages(config: PipelineConfig, stages: dict[str, Any]) -> None:
    """The cross-field checks each stage command runs at its start from its config alone (`opd sft`'s
    `check_config`, `opd distill`'s `check_sizes` for one process), for every stage to run, before the first one:
    a fault in the distill section fails now, not after the rollout and SFT stages have run."""
    for name in ("sft", "distill"):
        if name in config.stages:
            try:
                if name == "sft":
                    check_sft_config(stages[name])
                else:
                    check_sizes(stages[name], SINGLE)
            except ValueError as error:
                raise ConfigError(f"pipeline stage '{name}': {error}") from None


def _run_locked(config: PipelineConfig, root: Path, stages: dict[str, Any], console: Any) -> dict:
    _check_same_recipe(config, root)
    save_config(config, root)
    sft_model = root / "sft" / "final"
    opd_model = root / "distill" / "final"

    for stage in config.stages:
        done = root / stage / MARKER
        if done.exists():
            console.print(f"[green]pipeline: stage '{stage}' already complete ({done.parent}); skipped[/]")
            continue
        console.rule(f"pipeline: {stage}")
        if stage == "rollout":
            teacher_rollout(stages["rollout"], console=console)
        elif stage == "sft":
            run_dir = sft(stages["sft"], console=console)
            _link_final(run_dir, sft_model, prefer=run_dir / "merged")
        elif stage == "distill":
            cfg = stages["distill"]
            cfg.student.path = str(sft_model.resolve()) if sft_model.exists() else cfg.student.path
            _link_final(distill(cfg, console=console), opd_model)
        else:
            summary = _compare(config, root, sft_model, opd_model, console)
            atomic_write_json(root / "summary.json", summary)
        (root / stage).mkdir(parents=True, exist_ok=True)
        atomic_write_text(root / stage / MARKER, "done\n")
    summary_path = root / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        print_comparison(summary, console)
        return summary
    return {}


def _check_same_recipe(config: PipelineConfig, root: Path) -> None:
    """A rerun into `root` continues the saved recipe: refuse other settings (one line naming each changed key)."""
    saved_path = root / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = PipelineConfig.model_validate(yaml.safe_load(saved_path.read_text()) or {})
    except ValueError:
        raise ConfigError(f"{saved_path} is not a pipeline config of this version; choose another out_dir") from None

    def recipe(cfg: PipelineConfig) -> dict:  # the stage sections as the stages will run them (all keys)
        view = cfg.model_dump(mode="json", exclude={"stages"})
        view.update({name: stage.model_dump(mode="json") for name, stage in cfg.stage_configs().items()})
        return view

    changed = [f"{key}: {old!r} → {new!r}" for key, old, new in config_changes(recipe(saved), recipe(config))]
    if changed:
        raise ConfigError(
            f"{root} holds a pipeline run with other settings ({'; '.join(changed)}); rerun with the "
            f"saved {saved_path}, or choose another out_dir"
        )


def _link_final(run_dir: Path, final: Path, prefer: Path | None = None) -> None:
    """Point `<stage>/final` at the stage's finished weights (the merged LoRA model, else the newest checkpoint).
    Only a link is ever replaced (atomically); anything else at `final` is refused."""
    target = prefer if prefer is not None and prefer.exists() else latest_checkpoint(run_dir)
    if target is None:
        raise ValueError(f"stage in {run_dir} finished without a checkpoint")
    if final.exists() and not final.is_symlink():
        raise ValueError(f"{final} exists and is not the link this pipeline writes; move it away and rerun")
    tmp = final.with_name(f".{final.name}.tmp-link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.resolve(), target_is_directory=True)
    os.replace(tmp, final)


def _compare(config: PipelineConfig, root: Path, sft_model: Path, opd_model: Path, console: Any) -> dict:
    """Evaluate every model of the recipe on the same benchmarks and compute the gap recovery per benchmark."""
    if not config.eval.benchmarks:
        raise ValueError("pipeline: eval.benchmarks is empty; name the benchmarks of the final comparison")
    models = {
        "student": config.student,
        "sft": _spec(config.student, sft_model),
        "opd": _spec(config.student, opd_model),
        "teacher": config.teacher,
    }
    spec = config.eval
    results: dict[str, dict] = {}
    for name, model in models.items():
        if model is None:
            continue
        eval_config = EvalConfig(
            model=model,
            benchmarks=spec.benchmarks,
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            max_new_tokens=spec.max_new_tokens,
            limit=spec.limit,
            prompt_key=spec.prompt_key,
            answer_key=spec.answer_key,
            on_missing_answer=spec.on_missing_answer,
            template=config.opd_prompts.template,
            enable_thinking=config.opd_prompts.enable_thinking,
            out=str(root / "eval" / name),
        )
        results[name] = evaluate(eval_config, console=console)
    summary: dict[str, dict] = {}
    for key in benchmark_names(spec.benchmarks):
        row = {name: next(v for k, v in res[key].items() if k.startswith("avg@")) for name, res in results.items()}
        if {"student", "opd", "teacher"} <= row.keys():
            row["gap_recovery"] = float(gap_recovery(row["student"], row["opd"], row["teacher"]))
        summary[key] = row
    return summary


def _spec(base: ModelSpec, path: Path) -> ModelSpec | None:
    return base.model_copy(update={"path": str(path.resolve())}) if path.exists() else None


def print_comparison(summary: dict, console: Any) -> None:
    table = Table(title="student before → after SFT → after OPD vs teacher (avg@n, %)")
    columns = ["student", "sft", "opd", "teacher", "gap_recovery"]
    table.add_column("benchmark")
    for column in columns:
        table.add_column(column, justify="right")
    for benchmark, row in summary.items():
        table.add_row(benchmark, *("" if row.get(c) is None else f"{100 * row[c]:.1f}" for c in columns))
    console.print(table)
