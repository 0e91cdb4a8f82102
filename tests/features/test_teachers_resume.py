"""What routes and views read is part of a run's identity: a `--resume` over a prompt set whose route column or view
context changed in place is refused (the prompts' ids, tokens and answers alone would not tell), the routing table
the earlier steps trained with is kept beside the new one, and a view that makes the teacher's prompts longer than
its context stops the run at startup."""

import json

import pytest

from helpers import distill_config
from opd.recipes.distill import distill
from opd.rundir import RunDirectoryError

ROWS = [
    {"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": "add" if i % 2 == 0 else "mul", "hint": f"h{i}"}
    for i in range(6)
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(world, tmp_path, prompts, *overrides, steps=1, view=None):
    teachers = [
        {"name": "a", "path": str(world / "teacher"), "route": {"data_source": ["add"]}},
        {"name": "b", "path": str(world / "teacher"), "route": {"data_source": ["mul"]}},
    ]
    if view is not None:
        teachers[1]["view"] = view
    options = [f"data.path={prompts}", "prompts_per_step=2", f"teachers={json.dumps(teachers)}", *overrides]
    return distill_config(world, tmp_path, *options, teacher=False, steps=steps)


@pytest.mark.slow
def test_resume_refuses_a_route_column_edited_in_place_and_keeps_the_old_routing_table(world, tmp_path):
    prompts = _write(tmp_path / "prompts.jsonl", ROWS)
    run_dir = distill(_config(world, tmp_path, prompts))
    first = (run_dir / "teachers.json").read_bytes()
    assert [t["prompts"] for t in json.loads(first)["teachers"]] == [3, 3]
    edited = [dict(r) for r in ROWS]
    edited[0]["data_source"] = "mul"  # the same prompts, ids and answers; another teacher for prompt 0
    _write(prompts, edited)
    with pytest.raises(RunDirectoryError, match="the teachers' routing or views over data.path") as error:
        distill(_config(world, tmp_path, prompts, "run.resume=true", steps=2))
    assert "\n" not in str(error.value) and "other teachers or contexts" in str(error.value)
    assert (run_dir / "teachers.json").read_bytes() == first  # nothing rewritten by the refused resume

    resumed = distill(_config(world, tmp_path, prompts, "run.resume=true", "run.allow_config_change=true", steps=2))
    assert [t["prompts"] for t in json.loads((resumed / "teachers.json").read_text())["teachers"]] == [2, 4]
    assert (resumed / "teachers.step_1.json").read_bytes() == first  # the routing steps 1..1 trained with


def test_resume_refuses_a_view_context_edited_in_place_before_any_model_loads(world, tmp_path, monkeypatch):
    import opd.recipes.distill as recipe

    prompts = _write(tmp_path / "prompts.jsonl", ROWS)
    view = {"context_key": "hint", "context_template": " ({context})"}
    distill(_config(world, tmp_path, prompts, view=view))
    _write(prompts, [{**r, "hint": r["hint"].upper()} for r in ROWS])

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the resume's data check")

    monkeypatch.setattr(recipe, "load_model", no_load)
    with pytest.raises(RunDirectoryError, match="the teachers' routing or views"):
        distill(_config(world, tmp_path, prompts, "run.resume=true", steps=2, view=view))


def test_a_view_longer_than_the_teachers_context_stops_the_run_at_startup(world, tmp_path):
    """The tiny teacher has 512 positions: a template of 600 characters (byte-level tokens) does not fit."""
    prompts = _write(tmp_path / "prompts.jsonl", ROWS)
    view = {"context_key": "hint", "context_template": " {context}" + " pad" * 150}
    with pytest.raises(ValueError, match=r"teacher b's view \(view.context_key='hint'\) makes prompt 1 \d+ tokens"):
        distill(_config(world, tmp_path, prompts, view=view))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
