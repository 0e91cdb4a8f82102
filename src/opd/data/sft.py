"""SFT examples: read conversations, tokenise them with a loss mask on exactly the assistant tokens, batch them.

Layouts, detected per file or forced with `format`: chat (`messages`, also what `opd rollout` writes), sharegpt
(`conversations`) and alpaca (`instruction` / `input` / `output`); sources as `opd.data.prompts` reads them. For each
assistant turn the prompt is `render_prompt(messages[:k])`, exactly the tokens the model sees at rollout and eval
time, and the target its content plus the end-of-turn id (SPEC §5); a multi-turn conversation is one sequence unless
its template rewrites history. Batches are `Rollouts`, so the grad pass is `forward_hidden`, as in `opd distill`.
The layouts and the tokenisation in detail: docs/design.md, "opd.data.sft".

Tool use (`opd rollout --tools` rows): chat records may hold assistant turns with `tool_calls`, `tool` turns with the
answers, and a top-level `tools` (the JSON schemas offered). Such a conversation is rendered with
`apply_chat_template(tools=…)`, as its episodes were; an assistant turn's target is what the template writes for it
(its text and its calls) up to the end-of-turn; the `tool` turns, like the prompt and the user turns, are context,
never targets.

Omitted on purpose: multimodal content (content must be a string), per-turn loss weights, `{% generation %}`
assistant masks of HF templates (rendering the prompt per turn works for every template).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from opd.data.prompts import DataError, _read_rows, _short
from opd.data.templates import encode_prompts, has_chat_template, render_prompt
from opd.types import Prompt, Rollouts

SFTFormat = Literal["auto", "chat", "sharegpt", "alpaca"]
OnOverflow = Literal["filter", "truncate", "error"]
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
_LAYOUTS = "`messages` (chat / opd rollout), `conversations` (sharegpt) or `instruction` + `output` (alpaca)"
_PROBE = "OPD_END_OF_TURN_PROBE"
_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    """messages: `[{role, content}]` (assistant turns may add `tool_calls`, tool turns `name`) with at least one
    assistant turn; origin: "file: record N" for messages; tools: the JSON schemas offered (None: no tools)."""

    messages: list[dict[str, Any]]
    origin: str
    tools: list[dict[str, Any]] | None = None


@dataclass
class SFTExample:
    """One training sequence.

    input_ids:   [L] token ids: prompt, then assistant content + end-of-turn (and later turns, for multi-turn)
    target_mask: [L] bool, True on the tokens the loss predicts (assistant content and end-of-turn); the first is False
    origin:      "file: record N" of the conversation it came from
    """

    input_ids: list[int]
    target_mask: list[bool]
    origin: str

    @property
    def num_targets(self) -> int:
        return sum(self.target_mask)


@dataclass
class SFTDataset:
    """examples: kept sequences; num_filtered / num_truncated: sequences over `max_length` dropped / cut."""

    examples: list[SFTExample]
    num_filtered: int
    num_truncated: int
    end_of_turn_id: int


# --------------------------------------------------------------------------------------------------- reading


def detect_format(record: dict, origin: str) -> str:
    """The layout of one record (docs/design.md, "opd.data.sft"); `DataError` naming the file and its keys otherwise."""
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    keys = ", ".join(map(str, record)) or "(none)"
    raise DataError(f"{origin}: unknown SFT layout (record keys: {keys}); expected {_LAYOUTS}")


def read_conversations(path: str | Path, *, format: SFTFormat = "auto", limit: int | None = None) -> list[Conversation]:
    """The conversations of one file, in file order. Raises `DataError` (one line: file, record, field)."""
    if format not in ("auto", "chat", "sharegpt", "alpaca"):
        raise DataError(f"format must be auto, chat, sharegpt or alpaca, got {format!r}")
    rows, origin, _ = _read_rows(path, split="train", hub_config=None, limit=limit)
    if not rows:
        raise DataError(f"{origin}: no records; expected {_LAYOUTS}")
    layout = detect_format(rows[0], f"{origin}: record 0") if format == "auto" else format
    parse = {"chat": _chat, "sharegpt": _sharegpt, "alpaca": _alpaca}[layout]
    conversations = []
    for i, row in enumerate(rows):
        where = f"{origin}: record {i}"
        messages = parse(row, where)
        _check_turns(messages, where)
        conversations.append(Conversation(messages, where, _tools(row, where) if layout == "chat" else None))
    return conversations


def _tools(row: dict, where: str) -> list[dict[str, Any]] | None:
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: 'tools' must be a list of JSON schemas (objects), got {_short(tools)}")
    return tools or None


def _field(row: dict, key: str, where: str, layout: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: no field {key!r} ({layout} layout); record keys: {', '.join(map(str, row))}")
    return row[key]


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {_short(value)}")
    return value


def _chat(row: dict, where: str) -> list[dict[str, Any]]:
    messages = _field(row, "messages", where, "chat")
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}}, got {_short(messages)}")
    out = []
    for j, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
            raise DataError(f"{where}: messages[{j}] must be {{role, content}}, got {_short(m)}")
        message: dict[str, Any] = {
            "role": _text(m["role"], where, f"messages[{j}].role"),
            "content": _text(m.get("content") or "", where, f"messages[{j}].content"),
        }
        if calls:
            if message["role"] != "assistant" or not isinstance(calls, list):
                raise DataError(
                    f"{where}: messages[{j}].tool_calls must be a list on an assistant turn, got {_short(calls)} "
                    f"on a {message['role']} turn"
                )
            for c, call in enumerate(calls):
                function = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise DataError(
                        f"{where}: messages[{j}].tool_calls[{c}] must be {{function: {{name, arguments}}}}, got "
                        f"{_short(call)}"
                    )
            message["tool_calls"] = calls
        for key in ("name", "tool_call_id"):
            if message["role"] == "tool" and isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _sharegpt(row: dict, where: str) -> list[dict[str, str]]:
    turns = _field(row, "conversations", where, "sharegpt")
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'conversations' must be a list of {{from, value}}, got {_short(turns)}")
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(f"{where}: conversations[{j}] must be {{from, value}}, got {_short(turn)}")
        role = _SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise DataError(
                f"{where}: conversations[{j}].from is {turn['from']!r}; expected one of {', '.join(_SHAREGPT_ROLES)}"
            )
        out.append({"role": role, "content": _text(turn["value"], where, f"conversations[{j}].value")})
    system = row.get("system")
    if system and (not out or out[0]["role"] != "system"):
        out.insert(0, {"role": "system", "content": _text(system, where, "'system'")})
    return out


def _alpaca(row: dict, where: str) -> list[dict[str, str]]:
    instruction = _text(_field(row, "instruction", where, "alpaca"), where, "'instruction'")
    output = _text(_field(row, "output", where, "alpaca"), where, "'output'")
    extra = row.get("input") or ""
    user = instruction + "\n" + _text(extra, where, "'input'") if extra else instruction
    system = row.get("system")
    head = [{"role": "system", "content": _text(system, where, "'system'")}] if system else []
    return [*head, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _check_turns(messages: list[dict[str, Any]], where: str) -> None:
    roles = [m["role"] for m in messages]
    for j, m in enumerate(messages):
        if m["role"] not in _ROLES:
            raise DataError(f"{where}: turn {j} has role {m['role']!r}; expected one of {', '.join(_ROLES)}")
        # a call may come without text, and a tool may answer nothing (a program that prints nothing)
        if m["role"] not in ("system", "tool") and not m.get("tool_calls") and not m["content"].strip():
            what = "answer" if m["role"] == "assistant" else "prompt"
            raise DataError(f"{where}: turn {j} ({m['role']}) is empty; expected the {what} text")
    if "assistant" not in roles:
        raise DataError(f"{where}: no assistant turn to train on (roles: {roles})")
    if roles[0] == "assistant":
        raise DataError(f"{where}: the conversation starts with an assistant turn; it needs a prompt before it")


# ---------------------------------------------------------------------------------------------- tokenising


def end_of_turn_id(tokenizer: Any, token: str | None = None) -> int:
    """The id that ends an assistant turn: `token` when given; else the first special token the chat template writes
    after an assistant message's content (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3); else the EOS id."""
    if token is not None:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"end_of_turn {token!r} is not a single token of this tokenizer (it encodes to {ids})")
        return ids[0]
    if has_chat_template(tokenizer):
        messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        if _PROBE in text:
            after = text.split(_PROBE, 1)[1]
            special = set(tokenizer.all_special_ids)
            special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
            for i in tokenizer(after, add_special_tokens=False)["input_ids"]:
                if i in special:
                    return i
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "cannot tell which token ends an assistant turn: the tokenizer has no EOS and its chat "
            "template writes no special token after the content; set data.end_of_turn"
        )
    return tokenizer.eos_token_id


def _uses_tools(conversation: Conversation) -> bool:
    return bool(conversation.tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation.messages)


def _render_with_tools(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation: bool,
    enable_thinking: bool | None,
    system_prompt: str | None,
) -> str:
    """`messages` through the chat template with `tools` offered, as an episode renders them
    (`opd.tools.calls.prompt_ids`); the system prompt rule of `render_prompt`."""
    messages = [dict(m) for m in messages]
    if system_prompt is not None:
        if messages and messages[0].get("role") == "system":
            messages = messages[1:]
        messages = [{"role": "system", "content": system_prompt}, *messages]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation, **kwargs
    )


def _segments(
    tokenizer: Any,
    conversation: Conversation,
    eot_text: str,
    enable_thinking: bool | None,
    system_prompt: str | None,
) -> list[list[tuple[str, Any]]]:
    """Sequences of one conversation as segments: ("prompt", messages[:k]) opens a sequence, then ("target",
    text), and ("bridge", text) between turns of one sequence (the template's text from one end-of-turn to the
    next generation prompt: for tool use, the tool answers). With tools, a target is what the template writes for the
    assistant turn (its text and calls) before the end-of-turn."""
    messages, tools = conversation.messages, conversation.tools
    with_tools = _uses_tools(conversation)
    if with_tools and not has_chat_template(tokenizer):
        raise DataError(f"{conversation.origin}: tool calls need a chat template that renders them; this has none")
    options: dict[str, Any] = {"enable_thinking": enable_thinking, "system_prompt": system_prompt}
    sequences: list[list[tuple[str, Any]]] = []
    rendered = None  # text of the current sequence so far, as the template writes it
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if with_tools:
            prompt = _render_with_tools(tokenizer, messages[:k], tools, generation=True, **options)
            full = _render_with_tools(tokenizer, messages[: k + 1], tools, generation=False, **options)
            body = full[len(prompt) :] if full.startswith(prompt) else None
            if body is not None and eot_text and eot_text in body:
                target = body.split(eot_text, 1)[0]
            elif message.get("tool_calls"):
                raise DataError(
                    f"{conversation.origin}: turn {k}: the chat template does not render the assistant's tool calls "
                    "after its own generation prompt, ended by its end-of-turn token"
                )
            else:
                target = message["content"]
        else:
            prompt = render_prompt(tokenizer, messages[:k], **options)
            target = message["content"]
        if rendered is not None and prompt.startswith(rendered):
            sequences[-1].append(("bridge", prompt[len(rendered) :]))
        else:
            sequences.append([("prompt", messages[:k])])
        sequences[-1].append(("target", target))
        rendered = prompt + target + eot_text
    return sequences


def tokenize_conversations(
    tokenizer: Any,
    conversations: Sequence[Conversation],
    *,
    max_length: int,
    on_overflow: OnOverflow = "filter",
    enable_thinking: bool | None = None,
    system_prompt: str | None = None,
    end_of_turn: str | None = None,
) -> SFTDataset:
    """Tokenise conversations into `SFTExample`s (docs/design.md, "opd.data.sft").

    max_length:  longest sequence in tokens; longer ones are dropped and counted ("filter"), cut to max_length and
                 kept when a target token survives ("truncate"), or rejected ("error", naming the record).
    end_of_turn: the token that ends an assistant turn; None: see `end_of_turn_id`.
    Raises `DataError` when nothing is left.
    """
    if on_overflow not in ("filter", "truncate", "error"):
        raise ValueError(f"on_overflow must be filter, truncate or error, got {on_overflow!r}")
    eot = end_of_turn_id(tokenizer, end_of_turn)
    eot_text = tokenizer.decode([eot])
    plans = [
        (c.origin, seq, c)
        for c in conversations
        for seq in _segments(tokenizer, c, eot_text, enable_thinking, system_prompt)
    ]
    # Prompts through encode_prompts (same template, BOS rule and ids as rollout and eval); with tools as an episode
    # renders them (`opd.tools.calls.prompt_ids`); other text batched.
    plain = [i for i, (_, _, c) in enumerate(plans) if not _uses_tools(c)]
    first = encode_prompts(
        tokenizer,
        [Prompt(str(i), plans[i][1][0][1]) for i in plain],
        max_prompt_length=2**62,
        enable_thinking=enable_thinking,
        system_prompt=system_prompt,
    )
    prompt_ids_of: dict[int, list[int]] = dict(zip(plain, first.input_ids))
    for i, (_, seq, c) in enumerate(plans):
        if i not in prompt_ids_of:
            text = _render_with_tools(
                tokenizer,
                seq[0][1],
                c.tools,
                generation=True,
                enable_thinking=enable_thinking,
                system_prompt=system_prompt,
            )
            prompt_ids_of[i] = tokenizer(text, add_special_tokens=False)["input_ids"]
    texts = [payload for _, seq, _ in plans for kind, payload in seq[1:]]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])

    examples, num_filtered, num_truncated = [], 0, 0
    for i, (origin, seq, _) in enumerate(plans):
        prompt_ids = prompt_ids_of[i]
        if not prompt_ids:
            raise DataError(f"{origin}: the rendered prompt is empty; the model needs a token before its answer")
        ids, mask = list(prompt_ids), [False] * len(prompt_ids)
        for kind, _ in seq[1:]:
            piece = next(pieces)
            target = kind == "target"
            if target:
                piece = [*piece, eot]
            ids += piece
            mask += [target] * len(piece)
        if len(ids) > max_length:
            if on_overflow == "error":
                raise DataError(
                    f"{origin}: {len(ids)} tokens, over data.max_length={max_length}; raise it or set "
                    f"data.on_overflow=filter|truncate"
                )
            if on_overflow == "filter" or not any(mask[:max_length]):
                num_filtered += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            num_truncated += 1
        examples.append(SFTExample(ids, mask, origin))
    if not examples:
        raise DataError(f"no SFT examples left: all {len(plans)} are longer than max_length={max_length} tokens")
    return SFTDataset(examples, num_filtered, num_truncated, eot)


def load_sft_dataset(
    tokenizer: Any,
    paths: Sequence[str | Path],
    *,
    format: SFTFormat = "auto",
    limit: int | None = None,
    **tokenize_options: Any,
) -> SFTDataset:
    """Read every file (each detected on its own), keep the first `limit` conversations, tokenise them."""
    conversations: list[Conversation] = []
    for path in paths:
        conversations += read_conversations(path, format=format, limit=limit)
    return tokenize_conversations(tokenizer, conversations[:limit], **tokenize_options)


def collate(examples: Sequence[SFTExample], *, pad_id: int) -> Rollouts:
    """Right-padded `Rollouts` on CPU: prompt = tokens before each example's first target, response = the rest,
    response mask = the target mask there (user turns of later rounds are in the response but masked)."""
    starts = [ex.target_mask.index(True) for ex in examples]
    lengths = [len(ex.input_ids) for ex in examples]
    B, L, T = len(examples), max(lengths), max(n - s for n, s in zip(lengths, starts))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros(B, L, dtype=torch.bool)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (ex, s, n) in enumerate(zip(examples, starts, lengths)):
        input_ids[b, :n] = torch.tensor(ex.input_ids)
        attention[b, :n] = True
        response_ids[b, : n - s] = torch.tensor(ex.input_ids[s:])
        response_mask[b, : n - s] = torch.tensor(ex.target_mask[s:])
    zeros = torch.zeros(B, dtype=torch.bool)
    return Rollouts(input_ids, attention, torch.tensor(starts), response_ids, response_mask, torch.arange(B), zeros)
