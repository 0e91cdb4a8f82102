"""The lab tokenizer: a real Hugging Face fast tokenizer with a Qwen-style chat template and a 34-token vocabulary.

Each character the lab task writes is its own token (single-digit tokens make arithmetic learnable by tiny models),
plus a few whole-word tokens that shorten the prompt and the Qwen chat special tokens: a `tokenizers` WordLevel model
behind a regex, wrapped in `PreTrainedTokenizerFast`, so chat templates, `decode` and `save_pretrained` /
`from_pretrained` behave as with a real model's tokenizer.

Omitted on purpose: every other character and a byte fallback (they become `<unk>`). A token no training text
contains is a dead output row, which top-k OPD pushes up at every step and Adam turns into full-size steps; dead rows
collected a real share of the student's probability mass in the lab prototype, so the vocabulary holds only what the
task uses (docs/design.md, "opd.lab.tokenizer"; the figures: docs/performance.md).
"""

from __future__ import annotations

import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"  # opens every chat turn; not a BOS (none is prepended)
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, EOS_TOKEN, UNK_TOKEN)
CHARACTERS: tuple[str, ...] = ("\n", " ", "(", ")", "*", "+", "-", ".", "=", "}") + tuple("0123456789")
"""Every character the task writes outside WORDS (`task.py`: digits, + - * ( ) =, the prompt's `.` and spaces)."""
WORDS: tuple[str, ...] = (
    "user",
    "assistant",
    "system",
    "Compute",
    " Put",
    " the",
    " final",
    " answer",
    " in",
    "\\boxed{",
)
"""Multi-character tokens. A word is matched wherever it occurs (also inside longer words); that only changes how
a text is split, never what it decodes to."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""Qwen's layout without tools or thinking: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
`<|im_start|>assistant\\n` when a generation prompt is asked for."""


TOOL_WORDS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name": "calculator", "arguments": {"expression": "',
    '"}}',
)
"""The tool lab's extra tokens (`tools=True`; `opd.lab.tools`): a calculator call in Qwen's `<tool_call>` JSON as
`opd.tools.calls` parses it is `<tool_call>` `\\n` `{"name": …: "` digits `*` digits `"}}` `\\n` `</tool_call>`, and a
tool answer `<tool_response>` `\\n` digits `\\n` `</tool_response>`."""

TOOLS_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""`CHAT_TEMPLATE` that also writes tool calls and answers as Qwen2.5 does (`tools=True`): an assistant turn's
`tool_calls` as `<tool_call>` JSON blocks after its text, a `tool` message as a user turn holding
`<tool_response>`. The tools offered are not written (the lab has one tool, and a schema would need letters the
vocabulary lacks): prompts read the same with and without tools."""


DIGIT_PAIRS: tuple[str, ...] = tuple(f"{a}{b}" for a in range(10) for b in range(10))
"""The cross-tokenizer lab teacher's extra tokens (`digit_pairs=True`): every two-digit string, matched left to right
("1234" is "12" "34", "123" is "12" "3"), as BPE vocabularies merge digits."""


def build_lab_tokenizer(
    model_max_length: int = 512,
    *,
    digit_pairs: bool = False,
    order: tuple[str, ...] | None = None,
    tools: bool = False,
) -> PreTrainedTokenizerFast:
    """The lab tokenizer; ids are fixed: special tokens 0..3, then CHARACTERS, then WORDS (len = 34). With
    `digit_pairs` the 100 `DIGIT_PAIRS` follow (len = 134): another vocabulary over the same text, the
    cross-tokenizer lab teacher's (configs/lab_cross_tokenizer.yaml). With `tools` the 6 `TOOL_WORDS` follow
    instead (len = 40) and the chat template writes tool calls and answers (`TOOLS_CHAT_TEMPLATE`; the tool lab,
    `opd.lab.tools`). `order`: the pieces after the special tokens
    in another id order (`opd.lab.build.permute_vocabulary`: the same segmentation under another token → id map).

    eos = `<|im_end|>` (what ends an assistant turn), pad = `<|endoftext|>`, no bos is prepended.
    """
    if digit_pairs and tools:
        raise ValueError("digit_pairs and tools are two different lab vocabularies; choose one")
    pairs = DIGIT_PAIRS if digit_pairs else ()
    pieces = CHARACTERS + WORDS + pairs + (TOOL_WORDS if tools else ())
    if order is not None:  # the same pieces at other ids (the special tokens keep theirs)
        if sorted(order) != sorted(pieces):
            raise ValueError("order must hold every lab piece exactly once")
        pieces = order
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + pieces)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Leftmost alternative wins, so the words (and digit pairs) are tried before the single-character fallback.
    words = (TOOL_WORDS if tools else ()) + WORDS
    pattern = "|".join(re.escape(w) for w in words) + (r"|\d\d" if digit_pairs else "") + r"|[\s\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate tokens as they are (the default would join them with spaces)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
