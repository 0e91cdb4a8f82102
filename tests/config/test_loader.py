"""The config loader (`opd.config.loader`): unknown keys, types, suggestions, precedence, non-finite floats, and the
shipped configs. The CLI surface (help, one-line errors): tests/test_cli.py; the distill defaults: test_distill.py."""

import pytest
import yaml

from opd.config import ConfigError, DistillConfig, EvalConfig, build_config, parse_override, save_config


def test_precedence_yaml_then_options_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"n": 2, "temperature": 0.1, "model": {"path": "from-yaml"}}))
    cfg = build_config(
        EvalConfig,
        config_file=path,
        options={"temperature": 0.5, "model.path": None},
        overrides=["temperature=0.9", "benchmarks=aime24,amc23"],
    )
    assert cfg.n == 2 and cfg.temperature == 0.9 and cfg.model.path == "from-yaml"
    assert cfg.benchmarks == ["aime24", "amc23"]


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'objective.strategi' \(did you mean 'objective.strategy'\?\)"
    ):
        build_config(
            DistillConfig, options={"student.path": "s", "data.path": "d"}, overrides=["objective.strategi=union"]
        )


def test_wrong_type_and_range_name_the_key():
    with pytest.raises(ConfigError, match="config key 'rollout.n'.*got 'many'"):
        build_config(DistillConfig, options={"student.path": "s", "data.path": "d"}, overrides=["rollout.n=many"])
    with pytest.raises(ConfigError, match="config key 'objective.strategy'"):
        build_config(
            DistillConfig, options={"student.path": "s", "data.path": "d"}, overrides=["objective.strategy=both"]
        )
    with pytest.raises(ConfigError, match="config key 'top_p'"):
        build_config(EvalConfig, overrides=["top_p=1.5"])


def test_override_values_parse_as_yaml():
    assert parse_override("optim.lr=1e-6") == ("optim.lr", 1e-6)
    assert parse_override("run.resume=true") == ("run.resume", True)
    assert parse_override("eval.benchmarks=[aime24, amc23]") == ("eval.benchmarks", ["aime24", "amc23"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("lr")


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config(DistillConfig, options={"student.path": "s", "teacher.path": "t", "data.path": "d"})
    path = save_config(cfg, tmp_path)
    again = build_config(DistillConfig, config_file=path)
    assert again == cfg


def test_shipped_configs_validate():
    from pathlib import Path

    for path in sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")):
        from opd.recipes.pipeline import PipelineConfig

        data = yaml.safe_load(path.read_text())
        if "sft_prompts" in data:
            build_config(PipelineConfig, config_file=path).stage_configs()
        else:
            build_config(DistillConfig, config_file=path)


@pytest.mark.parametrize(
    "model, key",
    [
        ("distill", "rollout.temperature"),
        ("distill", "optim.lr"),
        ("distill", "optim.betas"),
        ("distill", "objective.clip_ratio_c"),
        ("eval", "temperature"),
        ("sft", "epochs"),
        ("sft", "lora.alpha"),
        ("rollout", "grade_timeout"),
        ("score", "teacher_temperature"),
    ],
)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", ".nan"])
def test_non_finite_floats_are_rejected_in_every_config(model, key, value):
    """NaN and ±inf fail in every float field of every config (the shared Section base), naming the key: a field with
    only a lower bound (temperature > 0, clip_ratio_c > 1) would otherwise accept inf."""
    from opd.recipes.prompts import PromptScoreConfig
    from opd.recipes.rollout import RolloutConfig
    from opd.recipes.sft import SFTConfig

    models = {
        "distill": (DistillConfig, {"student.path": "s", "data.path": "d"}),
        "eval": (EvalConfig, {}),
        "sft": (SFTConfig, {"model.path": "m", "data.path": "d"}),
        "rollout": (RolloutConfig, {"model.path": "m", "data.path": "d", "out": "o"}),
        "score": (PromptScoreConfig, {"student.path": "s", "teacher.path": "t", "data.path": "d", "out": "o.jsonl"}),
    }
    cls, options = models[model]
    text = f"[0.9, {value}]" if key == "optim.betas" else value
    with pytest.raises(ConfigError, match=rf"config key '{key}(\.1)?': Input should be a finite number"):
        build_config(cls, options=options, overrides=[f"{key}={text}"])
