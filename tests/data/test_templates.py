"""Instruction templates and chat rendering (`opd.data.templates`): the template strings, DAPO to boxed and back
on the shared sets, template forms, rendering with and without a chat template, and encoding prompts (length filter,
template, fallback). Offline; the shared data sets are skipped when absent."""

from __future__ import annotations

import pytest

from helpers_data import MESSAGES, needs_shared, one_line_error, shared
from opd.data.prompts import DataError
from opd.data.templates import (
    BOXED_SUFFIX,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    EncodedPrompts,
    apply_template,
    encode_prompts,
    parse_template,
    render_prompt,
    strip_template,
)
from opd.types import Prompt


def test_template_strings():
    assert DAPO_PREFIX == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    )
    assert DAPO_SUFFIX == '\n\nRemember to put your answer on its own line after "Answer:".'
    assert BOXED_SUFFIX == " Please reason step by step, and put your final answer within \\boxed{}."


@needs_shared
def test_dapo_to_boxed_on_real_rows():
    dapo = shared("train/dapo-math-17k.parquet")
    for p in dapo[:200]:
        problem = p.text[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)].strip()
        boxed = apply_template(p, "boxed")
        assert boxed.text == problem + BOXED_SUFFIX
        assert (boxed.id, boxed.answer) == (p.id, p.answer)
        assert apply_template(boxed, "dapo").text == DAPO_PREFIX + problem + DAPO_SUFFIX
        assert strip_template(p.text) == problem
    assert dapo[0].text.startswith(DAPO_PREFIX)  # the input was not modified
    # Re-applying a set's own template is byte-exact (some DAPO problems keep whitespace around them).
    assert all(apply_template(p, "dapo").text == p.text for p in dapo)


@needs_shared
def test_boxed_strip_on_deepmath():
    deepmath = shared("train/deepmath-deduped.parquet")
    assert all(p.text.endswith(BOXED_SUFFIX) for p in deepmath)
    first = deepmath[0]
    assert strip_template(first.text) == first.meta["extra_info"]["question"]
    assert apply_template(first, "dapo").text == DAPO_PREFIX + first.meta["extra_info"]["question"] + DAPO_SUFFIX


def test_parse_template_forms():
    assert parse_template("DAPO").name == "dapo"
    assert apply_template(Prompt("a", MESSAGES), "keep").text == "What is 1+1?"
    custom = apply_template(Prompt("a", MESSAGES), "custom:Q: {problem}\nPut it in \\boxed{}.")
    assert custom.text == "Q: What is 1+1?\nPut it in \\boxed{}."
    for bad, fragment in [("custom:Solve it.", "has no {problem} placeholder"), ("boxes", "unknown template")]:
        with pytest.raises(ValueError) as e:
            parse_template(bad)
        one_line_error(e, fragment, "keep, dapo, boxed, custom:<text containing {problem}>")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> {% endif %}{% endif %}"
)


def tiny_tokenizer(chat_template: str | None):
    """A word-level tokenizer (one token per word or punctuation run) whose post-processor adds BOS, so a
    double BOS would show if `encode_prompts` let the tokenizer add special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
    words = ["What", "is", "1", "+", "?", "a", "b", "c", "d", "e", "Be", "brief", ".", "User", "Assistant", ":"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


def test_render_prompt_with_chat_template():
    tok = tiny_tokenizer(CHAT_TEMPLATE)
    assert render_prompt(tok, MESSAGES) == "<s><|user|> What is 1+1? <|end|> <|assistant|> "
    assert render_prompt(tok, MESSAGES, enable_thinking=False).endswith("<|assistant|> <think> </think> ")
    assert not render_prompt(tok, MESSAGES, enable_thinking=True).endswith("</think> ")
    with_system = render_prompt(tok, MESSAGES, system_prompt="Be brief.")
    assert with_system.startswith("<s><|system|> Be brief. <|end|> <|user|>")
    replaced = render_prompt(tok, [{"role": "system", "content": "Old."}, *MESSAGES], system_prompt="Be brief.")
    assert replaced == with_system


def test_render_prompt_without_chat_template():
    tok = tiny_tokenizer(None)
    assert render_prompt(tok, MESSAGES) == "User: What is 1+1?\nAssistant:"
    assert render_prompt(tok, MESSAGES, system_prompt="Be brief.", enable_thinking=False) == (
        "System: Be brief.\nUser: What is 1+1?\nAssistant:"
    )


def test_encode_prompts_filters_by_length():
    tok = tiny_tokenizer(CHAT_TEMPLATE)
    # rendered: <s> <|user|> w_1 .. w_n <|end|> <|assistant|>  →  n + 4 tokens
    prompts = [Prompt(str(n), [{"role": "user", "content": " ".join("abcde"[:n])}]) for n in range(1, 6)]
    encoded = encode_prompts(tok, prompts, max_prompt_length=7)
    assert isinstance(encoded, EncodedPrompts)
    assert [p.id for p in encoded.prompts] == ["1", "2", "3"] and encoded.num_filtered == 2
    assert [len(ids) for ids in encoded.input_ids] == [5, 6, 7]
    bos = tok.bos_token_id
    assert all(ids[0] == bos and ids[1] != bos for ids in encoded.input_ids)  # BOS once, from the template
    assert tok.decode(encoded.input_ids[0]) == "<s> <|user|> a <|end|> <|assistant|>"

    with pytest.raises(DataError) as e:
        encode_prompts(tok, prompts, max_prompt_length=7, on_overflow="error")
    one_line_error(e, "prompt '4' is 8 tokens", "max_prompt_length=7")
    with pytest.raises(DataError) as e:
        encode_prompts(tok, prompts, max_prompt_length=4)
    one_line_error(e, "all 5 prompts")


def test_encode_prompts_template_and_fallback():
    tok = tiny_tokenizer(CHAT_TEMPLATE)
    kept = encode_prompts(tok, [Prompt("a", MESSAGES)], max_prompt_length=100)
    encoded = encode_prompts(tok, [Prompt("a", MESSAGES)], max_prompt_length=100, template="boxed")
    assert encoded.prompts[0].text == "What is 1+1?" + BOXED_SUFFIX
    assert len(encoded.input_ids[0]) > len(kept.input_ids[0])

    plain = tiny_tokenizer(None)
    encoded = encode_prompts(plain, [Prompt("a", MESSAGES)], max_prompt_length=100)
    ids = encoded.input_ids[0]
    assert ids[0] == plain.bos_token_id and ids[1] != plain.bos_token_id  # fallback gets the tokenizer's BOS once
    assert plain.decode(ids[1:]) == plain.decode(
        plain("User: What is 1+1?\nAssistant:", add_special_tokens=False)["input_ids"]
    )
