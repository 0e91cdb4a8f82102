"""The lab task generator and its tokenizer (no models, no network)."""

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
from opd.lab.tokenizer import CHARACTERS, build_lab_tokenizer

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


@pytest.fixture(scope="module")
def tokenizer():
    return build_lab_tokenizer()


@pytest.fixture(scope="module")
def problems():
    return make_problems(300, steps=(1, 6), seed=3) + make_problems(100, steps=(1, 6), split="test", seed=3)


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


def test_tokenizer_round_trip(tokenizer, problems):
    for p in problems:
        for text in [p.prompt_text] + [solve(p, s) for s in STYLES]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text
    every_char = "".join(CHARACTERS)
    assert tokenizer.decode(tokenizer(every_char)["input_ids"]) == every_char
    digits = tokenizer("1234567890", add_special_tokens=False)["input_ids"]
    assert len(digits) == 10  # one token per digit
    assert tokenizer("Answer: 5")["input_ids"][0] == tokenizer.unk_token_id  # letters are outside the vocabulary


def test_no_dead_tokens(tokenizer, problems):
    """Every id but pad, unk and the `system` role occurs in lab conversations: top-k OPD inflates rows that no
    training text ever contains (see the tokenizer's docstring), so the vocabulary must not have any."""
    seen = set()
    for p in problems:
        for style in STYLES:
            text = tokenizer.apply_chat_template(to_sft_examples([p], style=style)[0]["messages"], tokenize=False)
            seen |= set(tokenizer(text)["input_ids"])
    unused = {tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.convert_tokens_to_ids("system")}
    assert seen == set(range(len(tokenizer))) - unused
    assert len(tokenizer) == 34


def test_chat_template(tokenizer, problems):
    p = problems[0]
    msgs = to_sft_examples([p])[0]["messages"]
    prompt = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|im_start|>user\n{p.prompt_text}<|im_end|>\n<|im_start|>assistant\n"
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert full == f"<|im_start|>user\n{p.prompt_text}<|im_end|>\n<|im_start|>assistant\n{solve(p)}<|im_end|>\n"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == full
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"user\n{p.prompt_text}\nassistant\n{solve(p)}\n"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids  # the prompt is a token prefix of the full conversation
    assert ids.count(tokenizer.eos_token_id) == 2


def test_special_ids(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.bos_token is None
    assert tokenizer("1+1")["input_ids"] == tokenizer("1+1", add_special_tokens=False)["input_ids"]  # no BOS added
    assert len(tokenizer.convert_tokens_to_ids(tokenizer.tokenize("<|im_start|>"))) == 1


def test_save_and_load(tokenizer, problems, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = to_sft_examples(problems[:3])
    for example in text:
        a = tokenizer.apply_chat_template(example["messages"], tokenize=False)
        assert loaded.apply_chat_template(example["messages"], tokenize=False) == a
        assert loaded(a)["input_ids"] == tokenizer(a)["input_ids"]
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        len(tokenizer),
    )
