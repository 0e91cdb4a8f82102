"""`opd pipeline run`'s config (plain data; the program is `opd.recipes.pipeline.run_pipeline`): one YAML for the
whole cold-start recipe, from which each stage's own config is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field

from opd.config.distill import DistillConfig
from opd.config.loader import ConfigError, flatten_dotted, set_dotted, validate_config
from opd.config.rollout import RolloutConfig
from opd.config.sections import DataSpec, EvalSpec, ModelSpec, Section
from opd.config.sft import SFTConfig

Stage = Literal["rollout", "sft", "distill", "eval"]


class PipelineConfig(Section):
    """One YAML for the whole cold-start recipe."""

    teacher: ModelSpec
    student: ModelSpec
    sft_prompts: DataSpec = Field(description="Prompts the teacher answers for SFT (the rollout stage).")
    opd_prompts: DataSpec = Field(description="Prompts of the OPD stage.")
    eval: EvalSpec = Field(
        default_factory=EvalSpec, description="Benchmarks of the final comparison (and of in-run eval)."
    )
    out_dir: str = Field("runs/pipeline", description="Directory holding one sub-directory per stage.")
    stages: list[Stage] = Field(default_factory=lambda: list(get_args(Stage)), description="Stages to run, in order.")
    rollout: dict[str, Any] = Field(
        default_factory=dict, description="Extra `opd rollout` keys (n, max_attempts, require_correct, …)."
    )
    sft: dict[str, Any] = Field(
        default_factory=dict, description="Extra `opd sft` keys (epochs, optim.lr, lora.enabled, …)."
    )
    distill: dict[str, Any] = Field(
        default_factory=dict, description="Extra `opd distill` keys (run.steps, objective.top_k, …)."
    )

    def stage_configs(self) -> dict[str, Any]:
        """The rollout / SFT / distill configs the stages run with (validated; errors name the stage)."""
        root = Path(self.out_dir)
        rollout = {
            "model": self.teacher.model_dump(),
            "data": self.sft_prompts.model_dump(),
            "out": str(root / "rollout"),
        }
        sft = {
            "model": self.student.model_dump(),
            "data": {"path": [str(root / "rollout" / "rollouts.jsonl")]},
            "run": {"out_dir": str(root), "name": "sft", "resume": True},
        }
        distill = {
            "student": self.student.model_dump(),
            "teacher": self.teacher.model_dump(),
            "data": self.opd_prompts.model_dump(),
            "eval": self.eval.model_dump(),
            "run": {"out_dir": str(root), "name": "distill", "resume": True},
        }
        built = {}
        for name, base, extra, model in (
            ("rollout", rollout, self.rollout, RolloutConfig),
            ("sft", sft, self.sft, SFTConfig),
            ("distill", distill, self.distill, DistillConfig),
        ):
            for key, value in flatten_dotted(extra).items():
                set_dotted(base, key, value)
            try:
                built[name] = validate_config(model, base)
            except ConfigError as error:
                raise ConfigError(f"pipeline stage '{name}': {error}") from None
        return built
