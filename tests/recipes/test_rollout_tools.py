"""`opd rollout --tools`: the teacher's samples are episodes; the final turn is graded as a plain answer is, and the
accepted rows hold the whole conversation as messages (assistant turns with their `tool_calls`, `tool` turns with
the answers) plus the tools offered, the layout `opd sft` reads. A scripted teacher that really calls the calculator
and the python tool, and a tiny random model through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from helpers import write_jsonl
from helpers_tools import (
    QUESTION,
    TOOL_RESPONSE,
    ScriptedModel,
    call_then_answer,
    make_tool_tokenizer,
    python_then_answer,
)
from opd.cli import app
from opd.cli_errors import user_error_line
from opd.config import ConfigError, build_config
from opd.data.sft import load_sft_dataset
from opd.io import read_jsonl
from opd.recipes.rollout import RolloutConfig, teacher_rollout
from opd.tools.sandbox import probe

ROWS = [{"prompt": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(3)]


# the teacher's turns: "Let me compute." and its call, then the answer with what the calculator said
calculator_then_answer = call_then_answer(
    before="Let me compute.\n", answer="The calculator says {0}, so the answer is \\boxed{{{0}}}."
)


def tool_rollout(tmp_path: Path, policy=calculator_then_answer, **overrides) -> Path:
    """A rollout of the scripted teacher over ROWS into tmp_path/out; returns the output directory."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    options = {
        "model.path": "scripted",
        "data.path": str(prompts),
        "data.template": "keep",
        "data.answer_key": "answer",
        "out": str(tmp_path / "out"),
        "max_new_tokens": 400,
        "n": 2,
        "tools": "calculator",
        **overrides,
    }
    config = build_config(RolloutConfig, options=options)
    tokenizer = make_tool_tokenizer()
    return teacher_rollout(
        config, generator=ScriptedModel(tokenizer, policy), tokenizer=tokenizer, console=Console(record=True)
    )


def test_accepted_rows_hold_the_whole_conversation_with_its_tool_calls(tmp_path):
    out = tool_rollout(tmp_path, require_correct=True)
    rows = read_jsonl(out / "rollouts.jsonl")
    assert len(rows) == 6 and read_jsonl(out / "rejected.jsonl") == []
    for row in rows:
        user, call, answer, final = row["messages"]
        i = int(row["prompt_id"])
        assert user == {"role": "user", "content": f"What is {i} * 7?"}
        assert call["role"] == "assistant" and call["content"] == "Let me compute."
        assert call["tool_calls"] == [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{i} * 7"}}}
        ]
        assert answer == {"role": "tool", "name": "calculator", "content": str(7 * i)}
        assert final["role"] == "assistant" and final["content"].endswith(f"\\boxed{{{7 * i}}}.")
        assert "tool_calls" not in final
        assert row["correct"] is True and row["extracted"] == str(7 * i)  # graded on the final turn
        assert row["turns"] == 2 and row["tool_calls"] == 1 and row["tool_errors"] == 0
        assert [t["function"]["name"] for t in row["tools"]] == ["calculator"]
    # the messages render through the template into exactly what the teacher saw and wrote
    tokenizer = make_tool_tokenizer()
    row = rows[0]
    text = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "0 * 7"}}\n</tool_call>' in text
    assert "<tool_response>\n0\n</tool_response>" in text
    stats = json.loads((out / "stats.json").read_text())
    assert stats["accepted"] == 6 and stats["rejections"]["malformed_call"] == 0


def test_an_episode_with_a_malformed_call_is_rejected_and_one_without_an_answer_too(tmp_path):
    def malformed(context: str) -> str:
        if "<tool_response>" in context:
            return "So \\boxed{0}."
        if "What is 1 *" in context:
            return "I know this one without tools."  # no call and no answer
        return "<tool_call>\n{not json\n</tool_call>"

    out = tool_rollout(tmp_path, malformed, max_attempts=2)
    assert read_jsonl(out / "rollouts.jsonl") == []
    rejected = {r["prompt_id"]: r for r in read_jsonl(out / "rejected.jsonl") if r["sample"] == 0}
    assert rejected["0"]["rejections"] == [["malformed_call"], ["malformed_call"]]
    assert rejected["1"]["rejections"] == [["no_answer"], ["no_answer"]]
    assert "<tool_response>" in rejected["0"]["last_response"]  # the whole episode, the error answer included


def test_the_python_tool_writes_the_code_and_its_output(tmp_path):
    if not probe("namespaces").ok:
        pytest.skip(f"no namespaces sandbox here: {probe('namespaces').reason}")

    out = tool_rollout(tmp_path, python_then_answer, tools="python", n=1)
    rows = read_jsonl(out / "rollouts.jsonl")
    assert [r["messages"][2] for r in rows] == [
        {"role": "tool", "name": "python", "content": str(7 * i)} for i in range(3)
    ]
    assert all(r["correct"] for r in rows)


def test_rollout_with_tools_runs_a_tiny_model_from_the_command_line(tiny_model_dir, tmp_path):
    make_tool_tokenizer().save_pretrained(tiny_model_dir)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out"
    args = ["rollout", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out)]
    args += ["--tools", "calculator", "--max-turns", "2", "--max-new-tokens", "8", "--max-attempts", "1"]
    args += ["--n", "2", "--template", "keep", "--answer-key", "answer"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert stats["samples"] == 6 and stats["attempts"] == 6
    records = read_jsonl(out / "rollouts.jsonl") + read_jsonl(out / "rejected.jsonl")
    assert len(records) == 6
    config = (out / "config.yaml").read_text()
    assert "tools: calculator" in config and "max_turns: 2" in config


def test_a_bad_environment_is_one_line_before_any_model_loads(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    args = ["rollout", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, [*args, "--tools", "abacus"])
    assert result.exit_code != 0 and result.exception is not None, result.output
    line = user_error_line(result.exception)
    assert line is not None and "\n" not in line
    assert line.startswith("tools must be one of python, calculator or an import path") and "'abacus'" in line
    assert not (tmp_path / "o").exists()


def test_sft_targets_are_exactly_the_tokens_the_teacher_wrote(tmp_path):
    out = tool_rollout(tmp_path)
    rows = read_jsonl(out / "rollouts.jsonl")
    dataset = load_sft_dataset(make_tool_tokenizer(), [out / "rollouts.jsonl"], max_length=4096)
    # the template renders each assistant turn as the teacher wrote it: as many targets as the teacher's tokens
    assert [ex.num_targets for ex in dataset.examples] == [r["num_tokens"] for r in rows]


def test_sft_trains_on_the_rows_of_a_tool_rollout_from_the_command_line(tiny_model_dir, tmp_path):
    out = tool_rollout(tmp_path)
    make_tool_tokenizer().save_pretrained(tiny_model_dir)
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(out / "rollouts.jsonl"), "--name", "tools"]
    args += [f"run.out_dir={tmp_path / 'runs'}", "run.steps=2", "examples_per_step=2", "run.report=false"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "tools" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert (tmp_path / "runs" / "tools" / "checkpoints" / "step_2").is_dir()


def test_llamafactory_files_are_refused_with_tools():
    with pytest.raises(ConfigError, match="llamafactory: the LlamaFactory files opd writes hold user and assistant"):
        build_config(
            RolloutConfig,
            options={"model.path": "m", "data.path": "p", "out": "o", "tools": "calculator", "llamafactory": True},
        )


def test_markdown_rows_hold_the_code_block_in_the_assistant_turn_and_train_on_what_the_teacher_wrote(tmp_path):
    if not probe("namespaces").ok:
        pytest.skip(f"no namespaces sandbox here: {probe('namespaces').reason}")

    def blocks_then_answer(context: str) -> str:
        results = TOOL_RESPONSE.findall(context)
        if results:
            return f"So \\boxed{{{results[-1]}}}."
        return f"Let me run it.\n```python\nprint({QUESTION.findall(context)[-1]})\n```"

    out = tool_rollout(tmp_path, blocks_then_answer, tools="python", tool_format="markdown", n=1)
    rows = read_jsonl(out / "rollouts.jsonl")
    assert len(rows) == 3 and all(r["correct"] and r["tool_calls"] == 1 for r in rows)
    for i, row in enumerate(rows):
        _, block, answer, _ = row["messages"]
        assert block == {"role": "assistant", "content": f"Let me run it.\n```python\nprint({i} * 7)\n```"}
        assert answer == {"role": "tool", "name": "python", "content": str(7 * i)}
    dataset = load_sft_dataset(make_tool_tokenizer(), [out / "rollouts.jsonl"], max_length=4096)
    assert [ex.num_targets for ex in dataset.examples] == [r["num_tokens"] for r in rows]
