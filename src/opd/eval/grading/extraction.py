"""Answer extraction (SPEC §7): the final answer of a response, and a ground truth written inside a box.

`extract_answer` takes the content of the last non-empty, balanced `\\boxed{…}` / `\\fbox{…}` (or `\\boxed 5`),
else the last `Answer: …` line (DAPO style). Braces are matched in one linear pass, so a long response full of
unbalanced braces costs one scan.

Omitted: other answer conventions (GSM8K's `#### 42`, "the answer is 42"): a response with neither a box nor an
`Answer:` line has no answer.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 1000
"""Extracted answers / ground truths longer than this are compared by exact string match only."""


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# `\\` is one token so that `\\{` is a row break plus a group; `\{` `\}` are literal braces.
_BRACE_TOKEN_RE = re.compile(r"\\\\|\\[{}]|[{}]")
_ANSWER_LINE_RE = re.compile(r"(?i)answer\s*:[ \t]*([^\n]*)")
_DOLLAR_SPAN_RE = re.compile(r"\$+([^$]+)\$+")


def extract_answer(text: str) -> str | None:
    """The content of the last non-empty, balanced `\\boxed{…}`/`\\fbox{…}` (or `\\boxed 5`);
    else the last `Answer: …` line (DAPO style; `$…$` and `**` stripped); else None."""
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for m in reversed(_ANSWER_LINE_RE.findall(text)):
        spans = _DOLLAR_SPAN_RE.findall(m)
        content = (spans[-1] if spans else m).strip().strip("*").strip()
        content = content.rstrip(".").strip().strip("$").strip()
        if content:
            return content
    return None


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    close = _brace_pairs(text, starts[0])
    for i in reversed(starts):
        j = i
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            end = close.get(j)
            content = text[j + 1 : end].strip() if end is not None else ""
        else:  # `\\boxed 5`: the next token
            m = re.match(r"[^\s$]+", text[j : j + MAX_ANSWER_CHARS])
            content = m.group(0) if (m and j > i) else ""
        if content:
            return content
    return None


def _brace_pairs(text: str, begin: int) -> dict[int, int]:
    """Map each balanced `{` at or after `begin` to its `}` (one linear pass; unmatched ones absent)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_TOKEN_RE.finditer(text, begin):
        tok = m.group()
        if tok == "{":
            stack.append(m.start())
        elif tok == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _unwrap_gold(gold: str) -> str:
    """Ground truths may be written `\\boxed{204}` (AIME24 in the verl parquet files)."""
    inner = _last_boxed(gold) if isinstance(gold, str) else None
    return gold if inner is None else inner


def _unwrap_whole_box(s: str) -> str:
    """`\\boxed{x}` → `x` only when one box spans the whole string (not `\\boxed{1}+\\boxed{2}`)."""
    while (m := _BOX_RE.match(s)) is not None:
        j = m.end()
        while j < len(s) and s[j] == " ":
            j += 1
        if j >= len(s) or s[j] != "{" or _brace_pairs(s, j).get(j) != len(s) - 1:
            return s
        s = s[j + 1 : -1].strip()
    return s
