"""Tool calls in the model's own chat format: parse the calls out of a turn, render the environment's answers as the
chat template does, and tokenize them.

Parsing reads the Qwen / Hermes format, `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5, Qwen3,
Hermes and the templates that copy them). A malformed call (bad JSON, no name, arguments that are not an object, a
block left open) is not dropped and never raises: it becomes an error the model sees as its tool's answer.

Rendering asks the tokenizer's template: the tokens the environment appends after a turn are the difference between
the template's rendering of a conversation before and after the `tool` messages (with the generation prompt of the
next assistant turn), so whatever the template wraps around tool results (Qwen's `<tool_response>` inside a user turn,
another model's `tool` role) comes out as the model was trained on it. Tool results are tokenized with special
tokens split: code that prints `<|im_end|>` cannot end a turn or forge one.

The markdown format (`tool_format="markdown"`) reads the tool-integrated reasoning of Qwen2.5-Math / ToRA-style
models and of small instruct models that write code blocks when asked to run code: a turn whose last fenced block is
```python (or ```py) and closed, with only whitespace after it, calls the tool named `python` with `{"code": <the
block>}`. A block left open (the turn ran out of tokens) or followed by text (a made-up ```output block and an
answer) is no call: the episode ends there. The call lives in the turn's text (`ParsedTurn.inline`): the assistant
message is the whole turn, without `tool_calls`, and the answer is the `tool` message as the template renders it.

Left out on purpose: other call formats (Llama 3's JSON, Mistral's `[TOOL_CALLS]`) until a model that needs them is
tested; a parser is one function of text → `ParsedTurn` (`PARSERS`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opd.tools.environments import Observation, ToolCall

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"

# markdown: the info strings of a code block that is a call, and the tool and argument it calls
_CODE_LANGUAGES = ("python", "py")
MARKDOWN_TOOL, MARKDOWN_ARGUMENT = "python", "code"


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn: its text outside the calls, the well-formed calls and an error line per malformed one, in
    the order they were written (`items`: each a `ToolCall` or an error string)."""

    content: str
    items: list[ToolCall | str] = field(default_factory=list)
    inline: bool = False  # the calls are written in `content` (markdown): the message carries no `tool_calls`

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.items if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [c for c in self.items if isinstance(c, str)]


def parse_tool_calls(text: str) -> ParsedTurn:
    """The calls in `text` (Qwen / Hermes `<tool_call>` JSON blocks) and the text around them."""
    items: list[ToolCall | str] = []
    pieces = []
    end = 0
    for match in _CALL.finditer(text):
        pieces.append(text[end : match.start()])
        items.append(_parse_one(match.group(1)))
        end = match.end()
    rest = text[end:]
    if _OPEN in rest:
        before, _, after = rest.partition(_OPEN)
        pieces.append(before)
        items.append(f"error: a <tool_call> block was not closed: {_excerpt(after)}")
    else:
        pieces.append(rest)
    return ParsedTurn("".join(pieces).strip(), items)


def parse_markdown_calls(text: str) -> ParsedTurn:
    """The call in `text` (markdown format): its last fenced block when that is ```python / ```py, closed, with only
    whitespace after it; `content` is the whole turn. No call otherwise (a block left open, text after the block)."""
    blocks: list[tuple[str, list[str], int]] = []  # (info string, body lines, offset after the closing fence)
    info: str | None = None
    body: list[str] = []
    offset = 0
    for line in text.splitlines(keepends=True):
        offset += len(line)
        stripped = line.strip()
        if info is None:
            if stripped.startswith("```"):
                info, body = stripped[3:].strip().lower(), []
        elif stripped == "```":
            blocks.append((info, body, offset))
            info = None
        else:
            body.append(line)
    content = text.strip()
    if info is not None or not blocks:  # a block left open, or none
        return ParsedTurn(content, inline=True)
    language, lines, end = blocks[-1]
    if language not in _CODE_LANGUAGES or text[end:].strip():
        return ParsedTurn(content, inline=True)
    return ParsedTurn(content, [ToolCall(MARKDOWN_TOOL, {MARKDOWN_ARGUMENT: "".join(lines)})], inline=True)


PARSERS = {"hermes": parse_tool_calls, "markdown": parse_markdown_calls}


def parse_turn(text: str, tool_format: str = "hermes") -> ParsedTurn:
    """`text`'s calls in `tool_format` (`PARSERS`)."""
    return PARSERS[tool_format](text)


def check_tool_format(tools: Sequence[dict[str, Any]], tool_format: str) -> None:
    """Refuse (ValueError, one line) tools a format cannot call: markdown calls a tool named `python` that takes
    `code`, the only thing its blocks carry."""
    if tool_format not in PARSERS:
        raise ValueError(f"tool_format must be one of {', '.join(PARSERS)}, got {tool_format!r}")
    if tool_format != "markdown":
        return
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == MARKDOWN_TOOL and MARKDOWN_ARGUMENT in function.get("parameters", {}).get(
            "properties", {}
        ):
            return
    names = ", ".join(str(t.get("function", t).get("name")) for t in tools) or "none"
    raise ValueError(
        f"tool_format=markdown: code blocks call a tool named {MARKDOWN_TOOL!r} that takes {MARKDOWN_ARGUMENT!r}; "
        f"this environment offers {names} (use tools=python, or tool_format=hermes)"
    )


def _parse_one(body: str) -> ToolCall | str:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return f"error: the tool call is not valid JSON ({e.msg} at character {e.pos}): {_excerpt(body)}"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return f'error: a tool call must be {{"name": <tool name>, "arguments": {{…}}}}, got {_excerpt(body)}'
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"error: the arguments of {value['name']} are not a JSON object: {_excerpt(arguments)}"
    if not isinstance(arguments, dict):
        return f"error: the arguments of {value['name']} must be a JSON object, got {_excerpt(json.dumps(arguments))}"
    return ToolCall(value["name"], arguments)


def _excerpt(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "…"


def assistant_message(turn: ParsedTurn) -> dict[str, Any]:
    """The turn as a chat message with `tool_calls` (the format chat templates render); a turn whose calls are written
    in its text (`inline`, markdown) is its text only."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.calls and not turn.inline:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in turn.calls
        ]
    return message


def tool_messages(turn: ParsedTurn, observations: Sequence[Observation]) -> list[dict[str, Any]]:
    """One `tool` message per item of the turn, in order: the environment's observation for a call, the error line
    for a malformed one. `observations` answer `turn.calls`, in order."""
    if len(observations) != len(turn.calls):
        raise ValueError(f"{len(turn.calls)} tool calls but {len(observations)} observations")
    answers = iter(observations)
    messages = []
    for item in turn.items:
        if isinstance(item, ToolCall):
            messages.append({"role": "tool", "name": item.name, "content": next(answers).content})
        else:
            messages.append({"role": "tool", "name": "error", "content": item})
    return messages


def prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **template: Any
) -> list[int]:
    """The token ids of a conversation's start with the tools offered, ending with the generation prompt."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=True, **template
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# Stand-ins for the messages before the tool results; only what the template adds after them is kept.
_BEFORE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
_SLOT = "\x00opd-tool-result-{}\x00"


def observation_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **template: Any
) -> list[int]:
    """The ids the environment appends after an assistant turn that ended with the tokenizer's end-of-turn token:
    the `tool` messages `messages` as the template renders them, then the next assistant turn's generation prompt.
    Raises ValueError when the template rewrites earlier turns once tool results follow (no ids could be appended)."""
    slotted = [{**m, "content": _SLOT.format(i)} for i, m in enumerate(messages)]
    kwargs = {"tools": tools or None, "tokenize": False, **template}
    before = tokenizer.apply_chat_template(_BEFORE, **kwargs)
    after = tokenizer.apply_chat_template(_BEFORE + slotted, add_generation_prompt=True, **kwargs)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once tool results follow")
    eos = tokenizer.eos_token or ""
    cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    text = after[cut:]
    ids: list[int] = []
    for i, message in enumerate(messages):
        slot = _SLOT.format(i)
        if slot not in text:
            raise ValueError(f"the chat template does not render {message['role']} messages")
        head, text = text.split(slot, 1)
        ids += tokenizer(head, add_special_tokens=False)["input_ids"]
        ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + tokenizer(text, add_special_tokens=False)["input_ids"]
