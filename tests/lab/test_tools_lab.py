"""The tool lab (opd.lab.tools, opd.recipes.lab_tools): the tool vocabulary and template write a calculator episode
that opd.tools.calls parses and renders back; the product problems are deterministic and split by hash; a reduced
`opd lab build --only tools_teacher,tools_student` trains and measures both with the calculator and without;
configs/lab_tools.yaml validates as a tool-using distill config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from helpers import string_console
from opd.config import DistillConfig, build_config
from opd.lab.task import split_of
from opd.lab.tokenizer import TOOL_WORDS, build_lab_tokenizer
from opd.lab.tools import calculator_tools, make_products, tool_examples, tool_messages
from opd.tools.calls import observation_ids, parse_tool_calls, prompt_ids

ROOT = Path(__file__).parents[2]


def test_the_tool_vocabulary_extends_the_lab_one_and_leaves_it_alone():
    base, tools = build_lab_tokenizer(), build_lab_tokenizer(tools=True)
    assert len(base) == 34 and len(tools) == 34 + len(TOOL_WORDS)
    assert all(tools.convert_tokens_to_ids(t) == i for t, i in base.get_vocab().items())
    assert "tool_call" not in (base.chat_template or "")
    with pytest.raises(ValueError, match="choose one"):
        build_lab_tokenizer(tools=True, digit_pairs=True)


def test_an_episode_renders_without_unknown_tokens_and_its_call_parses():
    tokenizer = build_lab_tokenizer(tools=True)
    messages = tool_messages(123, 456)
    text = tokenizer.apply_chat_template(messages, tools=calculator_tools(), tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse_tool_calls(turn)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "123*456"})]
    assert not parsed.errors
    answer = tokenizer.decode(observation_ids(tokenizer, [messages[2]], calculator_tools()))
    assert answer == "\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # the prompt reads the same with the tool offered and without (the lab template writes no tool schemas)
    assert prompt_ids(tokenizer, messages[:1], calculator_tools()) == prompt_ids(tokenizer, messages[:1], [])


def test_products_are_deterministic_three_digit_and_split_by_hash():
    pairs = make_products(50, split="test", seed=0)
    assert pairs == make_products(50, split="test", seed=0) and len(set(pairs)) == 50
    assert all(100 <= a <= 999 and 100 <= b <= 999 and split_of(f"{a}*{b}") == "test" for a, b in pairs)
    assert not set(pairs) & set(make_products(500, split="train", seed=0))
    row = tool_examples(pairs[:1])[0]
    assert row["answer"] == str(pairs[0][0] * pairs[0][1]) and row["tools"][0]["function"]["name"] == "calculator"


def test_lab_tools_config_validates_as_tool_distillation():
    config = build_config(DistillConfig, config_file=ROOT / "configs" / "lab_tools.yaml")
    assert config.rollout.tools == "calculator" and config.teacher is not None
    assert config.teacher.path.endswith("tools_teacher") and config.student.path.endswith("tools_student")
    single = build_config(
        DistillConfig, config_file=ROOT / "configs" / "lab_tools.yaml", overrides=["rollout.tools=null"]
    )
    assert single.rollout.tools is None


@pytest.mark.slow
def test_build_the_tool_lab_reduced(tmp_path):
    from opd.recipes.lab import build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = build(
            tmp_path,
            only=["tools_teacher", "tools_student"],
            tool_steps={"tools_teacher": 2, "tools_student": 1},
            sft_examples=64,
            eval_limit=4,
            console=string_console(),
        )
    finally:
        torch.set_num_threads(threads)
    manifest = json.loads(path.read_text())
    assert set(manifest["models"]) == {"tools_teacher", "tools_student"}
    for name, steps in (("tools_teacher", 2), ("tools_student", 1)):
        record = manifest["models"][name]
        assert record["training"]["steps"] == steps and record["training"]["examples"] == 64
        for key in ("with_calculator", "without_tools"):
            assert 0.0 <= record[key]["accuracy"] <= 1.0
        assert "tool_calls_mean" in record["with_calculator"]
        assert len(AutoTokenizer.from_pretrained(tmp_path / name)) == 34 + len(TOOL_WORDS)
        results = json.loads((tmp_path / "work" / f"{name}_eval_with_calculator" / "results.json").read_text())
        assert results["tools"]["name"] == "calculator"
    assert sum(1 for _ in open(tmp_path / "data" / "tools_sft.jsonl")) == 64
    assert sum(1 for _ in open(tmp_path / "data" / "tools_test.jsonl")) == 200
