"""The shared config sections (`opd.config.sections`): values used as folder or file names are names, view templates
use their one field, temperatures stay where float32 arithmetic holds, and rollout.max_staleness is bounded — each
refused at config load in one line naming the key and what is accepted."""

from __future__ import annotations

import pytest

from opd.config import ConfigError, DistillConfig, EvalConfig, build_config
from opd.config.rollout import RolloutConfig
from opd.config.sections import MAX_STALENESS, MAX_TEMPERATURE, MIN_TEMPERATURE, NAME_MAX_CHARS
from opd.teacher import wire

DISTILL = {"student.path": "s", "data.path": "d"}


def distill(*overrides: str) -> DistillConfig:
    return build_config(DistillConfig, options=DISTILL, overrides=list(overrides))


def refusal(model, options: dict, *overrides: str) -> str:
    with pytest.raises(ConfigError) as raised:
        build_config(model, options=options, overrides=list(overrides))
    message = str(raised.value)
    assert "\n" not in message
    return message


def teacher(name: str, **fields: str) -> str:
    extra = "".join(f", {key}: {value}" for key, value in fields.items())
    return f"teachers=[{{name: '{name}', path: t{extra}}}]"


@pytest.mark.parametrize(
    "name", ["..", ".", "../up", "a/b", "a\\b", ".hidden", "-x", "_x", "x" * 300, "CON", "nul.txt", "check.json", ""]
)
def test_a_teacher_name_that_is_not_an_identifier_is_refused(name):
    message = refusal(DistillConfig, DISTILL, teacher(name))
    assert "teachers.0.name" in message and "letters, digits" in message
    assert "x" * (NAME_MAX_CHARS + 1) not in message  # a long name is counted, not echoed


@pytest.mark.parametrize("name", ["math", "qwen2.5-math_7B", "t1", "x" * NAME_MAX_CHARS])
def test_identifiers_are_teacher_names(name):
    assert distill(teacher(name)).teachers[0].name == name


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", "a\\b", "", "x" * 129, "aux"])
def test_a_run_name_is_one_folder_name(name):
    message = refusal(DistillConfig, DISTILL, f"run.name='{name}'")
    assert "run.name" in message


@pytest.mark.parametrize("name", ["my run", "distill-qwen3_1.7b", "x" * 128])
def test_run_names_that_are_one_folder_are_accepted(name):
    assert distill("teacher.path=t", f"run.name='{name}'").run.name == name


@pytest.mark.parametrize("name", ["..", "a/b", "dataset_info", "x" * 300])
def test_the_llamafactory_dataset_name_is_a_file_name(name):
    options = {"model.path": "m", "data.path": "d", "out": "o"}
    assert "dataset_name" in refusal(RolloutConfig, options, f"dataset_name='{name}'")


@pytest.mark.parametrize(
    "template, says",
    [
        ("{{context}}", "no {context} field"),
        ("plain text", "no {context} field"),
        ("{source}", "unknown field {source}"),
        ("{0}", "unknown field {0}"),
        ("{}", "unknown field {}"),
        ("{context!r}", "unknown field {context!r}"),
        ("{context:>9}", "unknown field {context:>9}"),
        ("{context} }", "Single '}'"),
        ("{ {context}", "'{'"),
    ],
)
def test_a_view_template_must_use_its_one_field(template, says):
    message = refusal(DistillConfig, DISTILL, teacher("a", view=f"{{context_key: c, context_template: '{template}'}}"))
    assert "teachers.0.view.context_template" in message and says in message


@pytest.mark.parametrize("template", ["{context}", "\n\nReference: {context}", "{{json}}: {context} {context}"])
def test_view_templates_with_their_field_are_accepted(template):
    config = distill(teacher("a", view=f'{{context_key: c, context_template: "{template}"}}'))
    assert config.teachers[0].view.context_template.format(context="X").count("X") >= 1


@pytest.mark.parametrize(
    "key", ["rollout.temperature", "objective.teacher_temperature", "eval.temperature", "teachers.0.temperature"]
)
@pytest.mark.parametrize("value", ["1e-40", "1e-300", "5e-324", "1e-7"])
def test_a_temperature_where_float32_breaks_is_refused(key, value):
    override = teacher("a", temperature=value) if key.startswith("teachers") else f"{key}={value}"
    options = DISTILL if key.startswith("teachers") else {**DISTILL, "teacher.path": "t"}
    message = refusal(DistillConfig, options, override)
    assert key in message and f"{MIN_TEMPERATURE:g}" in message


@pytest.mark.parametrize("key", ["objective.teacher_temperature", "teachers.0.temperature"])
def test_a_teacher_temperature_a_served_teacher_would_refuse_is_refused(key):
    override = teacher("a", temperature="1e7") if key.startswith("teachers") else f"{key}=1e7"
    options = DISTILL if key.startswith("teachers") else {**DISTILL, "teacher.path": "t"}
    assert key in refusal(DistillConfig, options, override) and f"{MAX_TEMPERATURE:g}" in refusal(
        DistillConfig, options, override
    )


def test_the_temperature_range_is_the_served_teachers():
    assert (MIN_TEMPERATURE, MAX_TEMPERATURE) == (wire.MIN_TEMPERATURE, wire.MAX_TEMPERATURE)


def test_temperatures_at_the_bound_and_greedy_are_accepted():
    config = distill("teacher.path=t", f"rollout.temperature={MIN_TEMPERATURE}", "eval.temperature=0")
    assert config.rollout.temperature == MIN_TEMPERATURE and config.eval.temperature == 0
    eval_options = {"model.path": "m", "benchmarks": "aime24"}
    assert "temperature" in refusal(EvalConfig, eval_options, "temperature=1e-40")
    assert build_config(EvalConfig, options=eval_options, overrides=["temperature=0"]).temperature == 0


def test_max_staleness_is_bounded_with_its_reason():
    message = refusal(DistillConfig, {**DISTILL, "teacher.path": "t"}, "rollout.max_staleness=1000000")
    assert "rollout.max_staleness" in message and f"0 to {MAX_STALENESS}" in message and "in flight" in message
    assert distill("teacher.path=t", f"rollout.max_staleness={MAX_STALENESS}").rollout.max_staleness == MAX_STALENESS
