"""`opd.data.sft`: SFT data layouts (and the errors naming file, record and field), tokenisation with the
assistant-only loss mask (the answer and the end of turn, every assistant turn, the max-length rule)."""

from __future__ import annotations

import json

import pytest

from helpers import EOS_ID, chat, write_jsonl
from opd.data.prompts import DataError
from opd.data.sft import Conversation, end_of_turn_id, read_conversations, tokenize_conversations
from opd.data.templates import encode_prompts
from opd.types import Prompt


def test_every_layout_parses(tmp_path):
    rollout = write_jsonl(
        tmp_path / "rollout.jsonl",
        [{"id": "p0", "source": "dapo", "answer": "5", "attempts": 2, "messages": chat("what is 2+3?", "5")}],
    )
    sharegpt = write_jsonl(
        tmp_path / "sharegpt.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "be brief"},
                    {"from": "human", "value": "name a colour"},
                    {"from": "gpt", "value": "red"},
                ]
            }
        ],
    )
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(
        json.dumps(
            [
                {"instruction": "reverse", "input": "abc", "output": "cba"},
                {"instruction": "say hi", "output": "hi there"},
            ]
        )
    )
    assert read_conversations(rollout)[0].messages == chat("what is 2+3?", "5")
    assert read_conversations(sharegpt)[0].messages == [
        {"role": "system", "content": "be brief"},
        *chat("name a colour", "red"),
    ]
    assert [c.messages for c in read_conversations(alpaca)] == [chat("reverse\nabc", "cba"), chat("say hi", "hi there")]


def test_layout_errors_name_file_record_and_field(tmp_path):
    unknown = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "reply": "r"}])
    with pytest.raises(DataError, match=r"odd\.jsonl.*unknown SFT layout.*question, reply"):
        read_conversations(unknown)
    bad_role = write_jsonl(
        tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}]
    )
    with pytest.raises(DataError, match=r"sg\.jsonl: record 0: conversations\[1\]\.from is 'bot'"):
        read_conversations(bad_role)
    missing = write_jsonl(tmp_path / "al.jsonl", [{"instruction": "q", "output": "a"}, {"instruction": "q"}])
    with pytest.raises(DataError, match=r"al\.jsonl: record 1: no field 'output' \(alpaca layout\)"):
        read_conversations(missing)
    no_answer = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="record 0: no assistant turn"):
        read_conversations(no_answer)
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        read_conversations(tmp_path / "nope.jsonl")


def _targets(tokenizer, example):
    return tokenizer.decode([i for i, m in zip(example.input_ids, example.target_mask) if m])


def test_targets_are_the_answer_and_end_of_turn(tiny_tokenizer):
    messages = chat("what is 2+3?", "5")
    example = tokenize_conversations(tiny_tokenizer, [Conversation(messages, "x")], max_length=512).examples[0]
    prompt_ids = encode_prompts(tiny_tokenizer, [Prompt("0", messages[:1])], max_prompt_length=512).input_ids[0]
    assert example.input_ids[: len(prompt_ids)] == prompt_ids  # the same prompt tokens as rollout and eval see
    assert not any(example.target_mask[: len(prompt_ids)])
    assert _targets(tiny_tokenizer, example) == "5<|im_end|>"
    assert example.input_ids[-1] == EOS_ID == end_of_turn_id(tiny_tokenizer)
    assert end_of_turn_id(tiny_tokenizer, "<|endoftext|>") == 256


def test_multi_turn_trains_every_assistant_turn(tiny_tokenizer):
    messages = [*chat("a", "b"), *chat("c", "d")]
    kept = tokenize_conversations(tiny_tokenizer, [Conversation(messages, "x")], max_length=512).examples
    assert len(kept) == 1 and _targets(tiny_tokenizer, kept[0]) == "b<|im_end|>d<|im_end|>"
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tiny_tokenizer.decode(kept[0].input_ids) + "\n" == rendered  # as the template writes it
    # a template whose history differs from its generation prompt (thinking off) gets one sequence per turn
    split = tokenize_conversations(
        tiny_tokenizer, [Conversation(messages, "x")], max_length=512, enable_thinking=False
    ).examples
    assert [_targets(tiny_tokenizer, ex) for ex in split] == ["b<|im_end|>", "d<|im_end|>"]
    assert tiny_tokenizer.decode(split[1].input_ids).endswith("assistant\n<think>\n\n</think>\n\nd<|im_end|>")


def test_max_length_filter_truncate_error(tiny_tokenizer):
    conversations = [Conversation(chat("q", "short"), "a"), Conversation(chat("q", "x" * 200), "b")]
    filtered = tokenize_conversations(tiny_tokenizer, conversations, max_length=64)
    assert (len(filtered.examples), filtered.num_filtered, filtered.num_truncated) == (1, 1, 0)
    cut = tokenize_conversations(tiny_tokenizer, conversations, max_length=64, on_overflow="truncate")
    assert (len(cut.examples), cut.num_truncated, len(cut.examples[1].input_ids)) == (2, 1, 64)
    with pytest.raises(DataError, match="b: 2.. tokens, over data.max_length=64"):
        tokenize_conversations(tiny_tokenizer, conversations, max_length=64, on_overflow="error")
