"""Typed configuration for every command: pydantic models, a YAML file, dotted `key=value` overrides.

A config is plain data at layer L0 (docs/design.md "Configs"): the sections commands share are in
`opd.config.sections`, each command's config in `opd.config.<command>` (`distill`, `eval`, `sft`, `prompts`, `rollout`,
`serve_teacher`, `pipeline`), and the
loader in `opd.config.loader`. Precedence (later wins): model defaults < `--config file.yaml` < explicit CLI options <
positional `key=value` overrides. Unknown keys and wrong types fail at once with the dotted key's name and a
close-match suggestion; bad values are rejected, never rewritten. The resolved config is saved into the run dir.

Every name is re-exported here, so `from opd.config import DistillConfig` works as before the split.
"""

from opd.config.distill import DistillConfig
from opd.config.eval import EvalConfig
from opd.config.loader import (
    ConfigError,
    Model,
    build_config,
    flatten_dotted,
    parse_override,
    read_yaml,
    save_config,
    set_dotted,
    validate_config,
)
from opd.config.pipeline import PipelineConfig
from opd.config.prompts import PromptScoreConfig
from opd.config.rollout import DegeneracySpec, RolloutConfig
from opd.config.sections import (
    STUDENT,
    STUDENT_INIT,
    BenchmarkList,
    CommaList,
    DataSpec,
    EvalSpec,
    ModelSpec,
    ObjectiveSpec,
    OptimSpec,
    RouteValues,
    RunSpec,
    SamplingSpec,
    Section,
    Teacher,
    TeacherEntry,
    TeacherRoute,
    TeacherSpec,
    TeacherView,
    VLLMSpec,
)
from opd.config.serve_teacher import ServeConfig, ServeLimits
from opd.config.sft import LoraSpec, SFTConfig, SFTDataSpec, SFTEvalSpec, SFTOptimSpec, SFTRunSpec

__all__ = [
    "ServeLimits",
    "ServeConfig",
    "RolloutConfig",
    "PipelineConfig",
    "DegeneracySpec",
    "STUDENT",
    "STUDENT_INIT",
    "BenchmarkList",
    "CommaList",
    "ConfigError",
    "DataSpec",
    "DistillConfig",
    "EvalConfig",
    "EvalSpec",
    "LoraSpec",
    "Model",
    "ModelSpec",
    "ObjectiveSpec",
    "OptimSpec",
    "PromptScoreConfig",
    "RouteValues",
    "RunSpec",
    "SFTConfig",
    "SFTDataSpec",
    "SFTEvalSpec",
    "SFTOptimSpec",
    "SFTRunSpec",
    "SamplingSpec",
    "Section",
    "Teacher",
    "TeacherEntry",
    "TeacherRoute",
    "TeacherSpec",
    "TeacherView",
    "VLLMSpec",
    "build_config",
    "flatten_dotted",
    "parse_override",
    "read_yaml",
    "save_config",
    "set_dotted",
    "validate_config",
]
