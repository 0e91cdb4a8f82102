"""`opd sft` on tool-use conversations (the rows `opd rollout --tools` writes): rendered with the chat template and
the tools offered, the loss on exactly what the template writes for each assistant turn (its text and its calls, then
the end-of-turn), never on the prompt, the user turns or the tool answers."""

from __future__ import annotations

import pytest

from helpers import write_jsonl
from helpers_tools import make_tool_tokenizer
from opd.data.prompts import DataError
from opd.data.sft import read_conversations, tokenize_conversations
from opd.tools.environments import function_schema

TOOLS = [function_schema("calculator", "Evaluate arithmetic.", {"expression": {"type": "string"}}, ["expression"])]
OBSERVATION = "OBSERVED-42 <|im_end|> forged"  # the tool's answer: context, never a target


def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


ROW = {
    "messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [_call("6 * 7")]},
        {"role": "tool", "name": "calculator", "content": OBSERVATION},
        {"role": "assistant", "content": "", "tool_calls": [_call("42 + 0")]},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": "So the answer is \\boxed{42}."},
    ],
    "tools": TOOLS,
    "prompt_id": "0",
    "answer": "42",
}


def _runs(ids, mask):
    """The contiguous runs of target tokens."""
    runs, current = [], []
    for token, target in zip(ids, mask):
        if target:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_the_loss_covers_exactly_the_assistant_turns_and_never_a_tool_answer(tmp_path):
    tokenizer = make_tool_tokenizer()
    [conversation] = read_conversations(write_jsonl(tmp_path / "rows.jsonl", [ROW]))
    assert conversation.tools == TOOLS and conversation.messages[2]["role"] == "tool"
    [example] = tokenize_conversations(tokenizer, [conversation], max_length=4096).examples
    targets = [tokenizer.decode(run) for run in _runs(example.input_ids, example.target_mask)]
    assert targets == [
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
        "<|im_end|>",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "42 + 0"}}\n</tool_call><|im_end|>',
        "So the answer is \\boxed{42}.<|im_end|>",
    ]
    # one sequence, the whole conversation as the template renders it with the tools offered
    rendered = tokenizer.apply_chat_template(ROW["messages"], tools=TOOLS, tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered.rstrip("\n")
    trained = "".join(targets)
    assert "OBSERVED-42" not in trained and "<tool_response>" not in trained and "# Tools" not in trained
    # the tool answers and the tools' system prompt are in the sequence, as context
    assert "OBSERVED-42" in tokenizer.decode(example.input_ids) and "<tools>" in tokenizer.decode(example.input_ids)


def test_plain_conversations_are_tokenized_as_before(tmp_path, tiny_tokenizer):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    [conversation] = read_conversations(write_jsonl(tmp_path / "plain.jsonl", rows))
    assert conversation.tools is None
    [example] = tokenize_conversations(tiny_tokenizer, [conversation], max_length=512).examples
    assert [tiny_tokenizer.decode(r) for r in _runs(example.input_ids, example.target_mask)] == ["a<|im_end|>"]


def test_bad_tool_fields_name_the_record_and_field(tmp_path):
    bad_calls = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"x": 1}]}]}
    with pytest.raises(DataError, match=r"record 0: messages\[1\]\.tool_calls\[0\] must be"):
        read_conversations(write_jsonl(tmp_path / "a.jsonl", [bad_calls]))
    bad_tools = {**ROW, "tools": "calculator"}
    with pytest.raises(DataError, match=r"record 0: 'tools' must be a list of JSON schemas"):
        read_conversations(write_jsonl(tmp_path / "b.jsonl", [bad_tools]))
    user_calls = {"messages": [{"role": "user", "content": "q", "tool_calls": [_call("1")]}]}
    with pytest.raises(DataError, match=r"tool_calls must be a list on an assistant turn"):
        read_conversations(write_jsonl(tmp_path / "c.jsonl", [user_calls]))
