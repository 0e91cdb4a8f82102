"""The lab task generator (`opd.lab.task`; no models, no network). Its tokenizer: test_tokenizer.py."""

from __future__ import annotations

import re

import pytest

from opd.lab.task import (
    STYLES,
    LabProblem,
    make_problems,
    solve,
    split_of,
    to_prompts,
    to_sft_examples,
    to_verl_records,
)

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


def test_worked_example():
    p = LabProblem(3, (("+", 4), ("*", 2), ("-", 5)))
    assert p.expression == "((3+4)*2)-5"
    assert p.values == [3, 7, 14, 9]
    assert p.prompt_text == "Compute ((3+4)*2)-5. Put the final answer in \\boxed{}."
    assert solve(p, "forward") == "3+4=7\n7*2=14\n14-5=9\n\\boxed{9}"
    assert solve(p, "rewrite") == "((3+4)*2)-5\n=(7*2)-5\n=14-5\n=9\n\\boxed{9}"
    assert LabProblem(2, (("-", 5),)).expression == "2-5"
    with pytest.raises(ValueError, match="style"):
        solve(p, "backward")  # type: ignore[arg-type]


def test_deterministic_by_seed():
    a = make_problems(50, steps=(2, 4), seed=7)
    assert a == make_problems(50, steps=(2, 4), seed=7)
    assert a != make_problems(50, steps=(2, 4), seed=8)
    assert make_problems(20, steps=(2, 4), seed=7) == a[:20]  # a prefix: asking for more only appends


def test_problem_constraints(problems):
    for p in problems:
        assert 1 <= p.steps <= 6 and 1 <= p.start <= 9
        assert all(abs(v) <= 99 for v in p.values)
        assert all(op in "+-*" and 1 <= d <= 9 for op, d in p.ops)
        assert eval(p.expression) == p.answer  # noqa: S307 (our own generated expression, not model output)
    assert len({p.expression for p in problems}) == len(problems)
    assert {p.steps for p in problems} == set(range(1, 7))
    assert any(p.answer < 0 for p in problems)
    small = make_problems(200, steps=3, seed=0, max_abs=20)
    assert all(p.steps == 3 and max(abs(v) for v in p.values) <= 20 for p in small)


@pytest.mark.parametrize("style", STYLES)
def test_solutions_box_the_answer(problems, style):
    for p in problems:
        text = solve(p, style)
        assert BOXED.findall(text) == [str(p.answer)]
        assert text.endswith(f"\\boxed{{{p.answer}}}")
        if style == "forward":
            lines = text.split("\n")[:-1]
            assert len(lines) == p.steps
            for line in lines:
                left, right = line.split("=")
                assert eval(left) == int(right)  # noqa: S307


def test_splits_disjoint():
    train = make_problems(2000, steps=(1, 4), seed=0)
    test = make_problems(300, steps=(1, 4), split="test", seed=0)
    other_seed = make_problems(2000, steps=(1, 4), seed=1)
    test_exprs = {p.expression for p in test}
    assert all(p.split == "train" for p in train + other_seed) and all(p.split == "test" for p in test)
    assert not test_exprs & {p.expression for p in train + other_seed}
    assert split_of("((3+4)*2)-5") == split_of("((3+4)*2)-5")


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        make_problems(3, steps=(3, 2))
    with pytest.raises(ValueError, match="split"):
        make_problems(3, split="val")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="could not draw"):
        make_problems(100, steps=1, split="test")  # only ~10% of the 234 one-step problems are test


def test_export_layouts(problems):
    rows = to_verl_records(problems[:5])
    assert [r["extra_info"]["index"] for r in rows] == list(range(5))
    for r, p in zip(rows, problems):
        assert r["prompt"] == [{"role": "user", "content": p.prompt_text}]
        assert r["reward_model"]["ground_truth"] == str(p.answer)
        assert r["data_source"] == "opd_lab/arith"
    sft = to_sft_examples(problems[:5], style="rewrite")
    assert [m["role"] for m in sft[0]["messages"]] == ["user", "assistant"]
    assert sft[0]["messages"][1]["content"] == solve(problems[0], "rewrite")
    prompts = to_prompts(problems[:5])
    assert prompts[0].answer == str(problems[0].answer) and prompts[0].text == problems[0].prompt_text
