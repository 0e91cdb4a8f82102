"""The lab's tokenizer (`opd.lab.tokenizer`) on generated problems: round trip, no dead tokens, the chat template,
the special ids, save and load (no models, no network)."""

from __future__ import annotations

import pytest

from opd.lab.task import STYLES, solve, to_sft_examples
from opd.lab.tokenizer import CHARACTERS, build_lab_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_lab_tokenizer()


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


def test_the_digit_pair_vocabulary_spells_the_same_text_in_other_tokens(tokenizer, problems):
    """The cross-tokenizer lab teacher's vocabulary: the lab's 34 tokens at their ids, then every digit pair; lab
    text round-trips, and against the lab tokenizer it aligns span by span, a pair of digits one span."""
    from opd.data.token_alignment import align_batch, token_bytes

    pairs = build_lab_tokenizer(digit_pairs=True)
    assert len(pairs) == len(tokenizer) + 100
    assert [pairs.convert_ids_to_tokens(i) for i in range(len(tokenizer))] == tokenizer.convert_ids_to_tokens(
        list(range(len(tokenizer)))
    )
    texts = [solve(p, "forward") for p in problems[:50]]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    student, teacher = token_bytes(tokenizer), token_bytes(pairs)
    batch = align_batch(rows, [True] * len(rows), student, teacher, pairs, teacher_eos_id=pairs.eos_token_id)
    assert batch.status["ok"] == len(rows)
    for text, row in zip(texts, batch.rows):
        assert pairs.decode(row.teacher_ids, skip_special_tokens=True) == text
    assert sum(r.num_spans for r in batch.rows) < sum(len(r) for r in rows)  # some spans hold two digits
