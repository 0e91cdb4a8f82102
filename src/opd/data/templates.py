"""Instruction templates on the problem text, chat rendering, and prompt encoding to token ids.

Instruction templates (`parse_template`, `apply_template`) are the exact strings of the released prompt sets: keep,
dapo (DAPO-Math-17k), boxed (DeepMath) and custom:<text> with `{problem}` in it. Every template but keep first strips
a known instruction (`strip_template`), so a set can be re-templated, and leaves a text that already carries it
byte-exact. Chat rendering goes through the tokenizer's chat template, or a plain-text "Role: content" fallback for
a tokenizer without one. The templates' strings and the fallback: docs/design.md, "opd.data.templates".

Omitted on purpose: few-shot prompting and per-model prompt tweaks (a custom template or a system prompt covers
them), and truncation of long prompts (a cut problem is a different problem: they are filtered or rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from opd.data.prompts import DataError
from opd.types import Prompt

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."
# Other common wordings of the boxed instruction, recognised by `strip_template` only.
_BOXED_VARIANTS = (BOXED_SUFFIX, " Let's think step by step and output the final answer within \\boxed{}.")

PLACEHOLDER = "{problem}"
_ACCEPTED = "keep, dapo, boxed, custom:<text containing {problem}>"


@dataclass(frozen=True)
class InstructionTemplate:
    """A parsed template. name: keep | dapo | boxed | custom; text: the template with `{problem}` in it."""

    name: str
    text: str

    def format(self, problem: str) -> str:
        """The instruction wrapped around `problem` (an already stripped problem text)."""
        return problem if self.name == "keep" else self.text.replace(PLACEHOLDER, problem)

    def wraps(self, text: str) -> bool:
        """Whether `text` already carries this instruction (so re-applying it must leave the text byte-exact:
        part of DAPO-Math-17k keeps whitespace around its template that stripping would lose; docs/performance.md)."""
        parts = self.text.split(PLACEHOLDER)
        if self.name == "keep" or len(parts) != 2 or parts == ["", ""]:
            return False
        before, after = parts
        return len(text) >= len(before) + len(after) and text.startswith(before) and text.endswith(after)


TEMPLATES = {
    "keep": InstructionTemplate("keep", PLACEHOLDER),
    "dapo": InstructionTemplate("dapo", DAPO_PREFIX + PLACEHOLDER + DAPO_SUFFIX),
    "boxed": InstructionTemplate("boxed", PLACEHOLDER + BOXED_SUFFIX),
}


def parse_template(spec: str | InstructionTemplate) -> InstructionTemplate:
    """Validate a template spec ("keep", "dapo", "boxed", "custom:<text with {problem}>"); names are
    case-insensitive. Raises `ValueError` (one line) listing the accepted forms."""
    if isinstance(spec, InstructionTemplate):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"template must be a string, got {spec!r}; accepted: {_ACCEPTED}")
    if spec.lower().startswith("custom:"):
        text = spec[len("custom:") :]
        if PLACEHOLDER not in text:
            raise ValueError(
                f"template {_short(spec)} has no {PLACEHOLDER} placeholder; a custom template must "
                f"contain it, e.g. 'custom:{PLACEHOLDER} Give only the number.'; accepted: {_ACCEPTED}"
            )
        return InstructionTemplate("custom", text)
    template = TEMPLATES.get(spec.strip().lower())
    if template is None:
        raise ValueError(f"unknown template {_short(spec)}; accepted: {_ACCEPTED}")
    return template


def strip_template(text: str) -> str:
    """`text` without a known DAPO prefix/suffix or boxed instruction, and without surrounding whitespace."""
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX) :]
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    stripped = text.rstrip()
    for suffix in _BOXED_VARIANTS:
        for candidate in (suffix, suffix.lstrip()):
            if stripped.endswith(candidate):
                return stripped[: -len(candidate)].strip()
    return text.strip()


def apply_template(prompt: Prompt, template: str | InstructionTemplate) -> Prompt:
    """A copy of `prompt` whose last user message is `template` applied to its problem (known instructions
    stripped first; a message that already carries `template` is kept as is). `keep` returns the prompt unchanged.
    Raises `ValueError` when there is no user message."""
    template = parse_template(template)
    if template.name == "keep":
        return prompt
    messages = [dict(m) for m in prompt.messages]
    for m in reversed(messages):
        if m.get("role") == "user":
            if not template.wraps(m["content"]):
                m["content"] = template.format(strip_template(m["content"]))
            return replace(prompt, messages=messages, meta=dict(prompt.meta))
    roles = [m.get("role") for m in prompt.messages]
    raise ValueError(f"prompt {prompt.id!r} has no user message to template (roles: {roles}); expected one")


# ---------------------------------------------------------------- chat rendering


def has_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` carries a chat template (else `render_prompt` uses the plain-text fallback)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    enable_thinking: bool | None = None,
    system_prompt: str | None = None,
) -> str:
    """The text a model sees before its answer: `messages` through the tokenizer's chat template with the
    generation prompt added.

    enable_thinking: passed to the template (Qwen3-style thinking switch) only when not None.
    system_prompt:   a system message put first; it replaces a system message the prompt already has.
    Tokenizers without a chat template: "Role: content" lines and a final "Assistant:" (docs/design.md,
    "opd.data.templates").
    """
    messages = [dict(m) for m in messages]
    if system_prompt is not None:
        if messages and messages[0].get("role") == "system":
            messages = messages[1:]
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not has_chat_template(tokenizer):
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n".join([*lines, "Assistant:"])
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@dataclass
class EncodedPrompts:
    """Prompts ready for rollout, in input order minus the filtered ones.

    input_ids:    per kept prompt, the token ids of its rendered text (special tokens as the template wrote them)
    prompts:      the kept prompts, with the instruction template applied
    num_filtered: how many prompts were dropped for being longer than `max_prompt_length`
    """

    input_ids: list[list[int]]
    prompts: list[Prompt]
    num_filtered: int


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    max_prompt_length: int,
    on_overflow: Literal["filter", "error"] = "filter",
    enable_thinking: bool | None = None,
    template: str | InstructionTemplate = "keep",
    system_prompt: str | None = None,
) -> EncodedPrompts:
    """Apply `template`, render with the chat template, tokenize, and drop (or reject) prompts over
    `max_prompt_length` tokens.

    Special tokens are not added by the tokenizer: a chat template already writes BOS where the model wants it.
    The plain-text fallback gets the tokenizer's BOS prepended when it has one.
    on_overflow: "filter" drops long prompts and counts them; "error" raises `DataError` naming the first one.
    Raises `DataError` when every prompt is too long.
    """
    if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be an integer ≥ 1, got {max_prompt_length!r}")
    if on_overflow not in ("filter", "error"):
        raise ValueError(f"on_overflow must be 'filter' or 'error', got {on_overflow!r}")
    parsed = parse_template(template)
    templated = [apply_template(p, parsed) for p in prompts]
    texts = [
        render_prompt(tokenizer, p.messages, enable_thinking=enable_thinking, system_prompt=system_prompt)
        for p in templated
    ]
    if not texts:
        return EncodedPrompts([], [], 0)
    ids_per_prompt = tokenizer(texts, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if not has_chat_template(tokenizer) and bos is not None:
        ids_per_prompt = [[bos, *ids] for ids in ids_per_prompt]

    kept_ids, kept = [], []
    for prompt, ids in zip(templated, ids_per_prompt):
        if len(ids) <= max_prompt_length:
            kept_ids.append(list(ids))
            kept.append(prompt)
        elif on_overflow == "error":
            raise DataError(
                f"prompt {prompt.id!r} is {len(ids)} tokens, over max_prompt_length={max_prompt_length}; "
                f"raise max_prompt_length or use on_overflow='filter'"
            )
    if not kept:
        raise DataError(
            f"all {len(templated)} prompts are longer than max_prompt_length={max_prompt_length} tokens "
            f"(shortest: {min(len(i) for i in ids_per_prompt)}); raise max_prompt_length"
        )
    return EncodedPrompts(kept_ids, kept, len(templated) - len(kept))


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
