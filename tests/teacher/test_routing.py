"""Routing at startup (`opd.teacher.routing`): a route that takes no prompt, or a `route_key` no prompt has, is a
one-line error before any model loads, never every prompt sent to the default teacher; numbers compare by value."""

import pytest

from opd.config import DistillConfig
from opd.config.loader import build_config
from opd.data.templates import EncodedPrompts
from opd.teacher.routing import route_teachers
from opd.types import Prompt

PROMPTS = [
    Prompt(
        id=str(i),
        messages=[{"role": "user", "content": f"{i}+{i}="}],
        answer=str(2 * i),
        source="add" if i % 2 == 0 else "mul",
        meta={"level": i // 2, "score": i / 2, "info": {"kind": "x"}},
    )
    for i in range(6)
]


def _config(route: dict) -> DistillConfig:
    teachers = [
        {"name": "mul", "path": "/models/mul", "route": route},
        {"name": "rest", "path": "/models/rest", "route": {"default": True}},
    ]
    return build_config(
        DistillConfig,
        options={"student.path": "/models/student", "data.path": "/data/p.jsonl", "teachers": teachers},
    )


def _routes(route: dict) -> list[int]:
    return route_teachers(_config(route), EncodedPrompts([[1]] * len(PROMPTS), PROMPTS, 0), console=None)


def test_a_route_that_matches_every_prompt_it_names_is_kept():
    assert _routes({"data_source": ["mul"]}) == [1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize(
    ("route", "culprit"),
    [
        ({"data_source": ["Mul"]}, "'mul' (3)"),  # other capitals
        ({"route_key": "level", "values": [7]}, "'0' (2)"),  # a value no prompt has
        ({"route_key": "info", "values": ["x"]}, "info values"),  # a struct, not the field inside it
    ],
)
def test_a_route_that_matches_no_prompt_is_one_line_with_the_counts(route, culprit):
    with pytest.raises(ValueError) as error:
        _routes(route)
    message = str(error.value)
    assert "\n" not in message and "teacher mul: route" in message and "matches 0 of 6 prompts" in message
    assert culprit in message


@pytest.mark.parametrize(
    ("key", "why"),
    [("no_such_column", ""), ("reward_model.ground_truth", "data.answer_key"), ("prompt", "data.prompt_key")],
)
def test_a_route_key_no_prompt_has_is_one_line(key, why):
    with pytest.raises(ValueError, match=f"no prompt has the column '{key}'.*{why}"):
        _routes({"route_key": key, "values": ["a"]})


def test_numbers_match_by_value():
    """A YAML 1.0 is the integer column value 1 (and "1"): floats for integers route, by the documented rule."""
    assert _routes({"route_key": "level", "values": [1.0]}) == [1, 1, 0, 0, 1, 1]
    assert _routes({"route_key": "score", "values": [1, 1.5]}) == [1, 1, 0, 0, 1, 1]


def test_a_mapping_as_a_route_value_is_refused_at_config_load():
    with pytest.raises(ValueError, match=r"a route value is a text, a number or true/false, got \{'kind': 'x'\}"):
        _config({"route_key": "info", "values": [{"kind": "x"}]})
