"""Math answer grading: extract the final answer from a response and compare it with the ground truth.

`grade(response, ground_truth)` = `extract_answer` (SPEC §7) + `is_equivalent`, in three stages, cheapest first:

1. **string**: both sides are normalised and compared. The normaliser follows the MATH reference
   `_strip_string` (hendrycks/math `modeling/math_equivalence.py`) and the DAPO/Minerva
   `normalize_final_answer` (volcengine/verl `verl/utils/reward_score/math_dapo.py`): `\\left`/`\\right`,
   thin spaces, `\\dfrac`/`\\tfrac`, `\\frac12`, `\\sqrt2`, `\\text{…}`, right units (`\\text{ cm}`), degrees,
   `\\%`, `\\$`, `x = ` prefixes, thousands separators, trailing periods. Unlike hendrycks we never rewrite
   `\\\\` (matrix rows) and never strip a bare one-letter unit (`6m` is an answer, not six metres; inside a
   text wrapper, `6\\,\\mathrm{m}`, it is a unit). Added here: unit wrappers `\\mbox`/`\\mathrm`/`\\textrm`
   with any unit text (`9.8 \\mathrm{~m} / \\mathrm{s}^{2}`), `°C`, number words (`2.5 million`), Minerva's
   Python spellings (`-1./3`, `np.arcsin`, `**`), and a named left-hand side (`k = 3`, `f(x) = 2x`,
   `m_{\\max} = …`, or `a = 2, a = -6` for one name) is dropped on both sides.
2. **numeric**: when both sides are plain numbers (integers, decimals, `a/b`, `\\frac{a}{b}`, `1.5e3`,
   `1.5\\times10^{3}`, optional `%`, repeating decimals `0.1\\overline{6}`, mixed numbers) they are
   compared exactly as `Fraction`s; if either side is a decimal, they may differ by 1e-6, both relative
   and absolute (`0.333333` = `1/3`, but `1000000.5` ≠ `1000000`). math-verify instead rounds to 6
   decimal places, which would equate Minerva's `7.4e-12` and `7.5e-12`. No sympy here: integer
   answers grade at ~30k/s (9 kB responses, one core).
   Mixed numbers: an integer directly followed by `\\frac{p}{q}` with integers 0 < p < q is N + p/q (the MATH
   convention: `1\\frac{4}{5}`, `137 \\frac{1}{2}`); with p ≥ q it is the product (`3\\frac{5}{2}` = 15/2). Inside
   a larger expression latex2sympy's own rule applies (an integer times a positive rational is mixed).
3. **symbolic**: the *whole* cleaned answer is parsed by latex2sympy (after math-verify's `normalize_latex`)
   and the two sympy objects are compared by `math_verify.verify`. We do not use `math_verify.parse`: its
   extraction regexes search inside the string, so a box that is not math (`12345 garbage)( 7`, Python
   code ending in `7`) used to be read as its last number. An answer that does not parse as a whole is
   wrong unless stage 1 already matched it with the ground truth (reason "not_math"). `\\pm` answers parse
   as the two-element set they stand for (`1 \\pm \\sqrt{19}` = `1+\\sqrt{19}, 1-\\sqrt{19}`).

Ground truths: a string, or a list/tuple of strings meaning "any of them" (`grade(r, ["1", "2"])`).

Time. `timeout` (seconds) bounds the symbolic stage of one `grade` call, from its start: one-time imports,
waiting for and starting a grading worker, parsing and verifying all count, so a call returns within about
`timeout` (measured: `benchmarks/grading_latency.py`). Verdicts, timeouts included, are cached per
(answer, ground truth), so a pathological pair costs its budget once per process, not once per sample
(a cached timeout is retried only with a larger budget). math-verify's own timeout is `signal.alarm`
(whole seconds, main thread only); we disable it and bound the work ourselves:
- main thread (POSIX): `signal.setitimer` with a float deadline raising a `BaseException` (so broad
  `except Exception` in sympy/latex2sympy cannot swallow it), re-armed every 50 ms until we leave;
  the previous SIGALRM handler and timer are restored.
- any other thread: the pair goes to a pool of grading subprocesses (`python -c` loading this file
  by path, so the package's `__init__` is not imported; JSON lines over pipes), started once per process
  (the first worker when the pool is made; a killed one is replaced at once). The worker applies the same
  alarm, ending shortly before our deadline; if it has not answered at the deadline (a C-level loop), it is
  killed. Callers queue for a worker first come first served; one that gets none in time answers "busy",
  which is not cached (that was the load, not the pair).
- answers longer than `MAX_ANSWER_CHARS` skip stages 2-3 (exact string match only), so 100 kB of
  garbage is rejected in microseconds; extraction itself is a single linear pass.

Omitted, on purpose: executing or `eval`-ing model output (never: math-verify's `ExprExtractionConfig`,
which hands text to sympy's `parse_expr`, an `eval`, is not used); Minerva's ±1 % numeric tolerance (the
reference recipe grades with math-verify, which does not have it); `\\text{…}` case folding in the string
stage (latex2sympy lowercases text in stage 3); units written bare after a number with one letter
(`9.8 m/s`); POSIX only (the worker pool relies on `select` over pipes).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Sequence

_log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 1000
"""Extracted answers / ground truths longer than this are compared by exact string match only."""

DEFAULT_TIMEOUT_S = 5.0
"""Default wall-time budget (seconds) of the symbolic stage of one `grade` call."""

_TOL = Fraction(1, 10**6)  # stage 2: relative and absolute
_ALARM_REPEAT_S = 0.05
_RETURN_MARGIN_S = 0.3  # measured: an interrupted comparison returns 10-30 ms after its alarm, up to ~0.3 s at load 5 on 2 cores
_WORKER_MARGIN_S = 0.25  # the worker's own alarm ends this long before our deadline, so it can still answer
_STATS = Counter()  # "symbolic": comparisons run, "cached": cache hits, "timeout", "worker_starts"

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Grade",
    "MAX_ANSWER_CHARS",
    "answer_key",
    "extract_answer",
    "grade",
    "is_equivalent",
    "normalize_answer",
]


@dataclass(frozen=True)
class Grade:
    """Outcome of grading one response.

    correct:   True iff the extracted answer is equivalent to the ground truth (to one of them, for a list).
    extracted: the answer found in the response (`extract_answer`), None if there was none.
    reason:    the stage that decided: "string" | "numeric" | "symbolic" | "not_math" (an answer or ground
               truth that does not parse as a whole) | "no_answer" | "empty" | "too_long" | "timeout" |
               "busy" (no grading worker free before the deadline; not cached) | "unavailable" (symbolic
               stage could not run) | "error: …".
    """

    correct: bool
    extracted: str | None
    reason: str


def grade(response: str, ground_truth: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Grade a model response against a ground truth (which may itself be wrapped in `\\boxed{}`).

    ground_truth: a string, or a list/tuple of strings of which any one counts as correct (SPEC §8 names
    `grade(response: str, ground_truth: str)`; the sequence form is an extension, a str behaves as before).
    `timeout` (seconds) bounds the symbolic comparison of the whole call; `<= 0` skips it. Never raises.
    """
    extracted = None
    try:
        extracted = extract_answer(response)
        if extracted is None:
            return Grade(False, None, "no_answer")
        deadline = _deadline(timeout)
        golds = list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]
        reason = "empty"
        for gold in golds:
            correct, reason = _compare(extracted, _unwrap_gold(gold), deadline)
            if correct:
                return Grade(True, extracted, reason)
        return Grade(False, extracted, reason)
    except Exception as e:  # the contract is "never raises": a grading bug must not kill an eval
        return Grade(False, extracted, f"error: {type(e).__name__}")


def is_equivalent(pred: str, gold: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True iff answer `pred` is equivalent to answer `gold` (string, numeric, then symbolic stage).

    Not symmetric for equations (`2x+3` matches gold `2x+3=y`, as in math-verify). Never raises.
    """
    try:
        return _compare(pred, gold, _deadline(timeout))[0]
    except Exception:
        return False


def _deadline(timeout: float | None) -> tuple[float, float] | None:
    """(monotonic deadline, budget) of a call, None when the symbolic stage is off. The deadline keeps
    `_RETURN_MARGIN_S` for unwinding an interrupted sympy call, so that the call returns within `timeout`."""
    if timeout is None or not timeout > 0:
        return None
    timeout = min(float(timeout), 1e6)
    return time.monotonic() + max(timeout - _RETURN_MARGIN_S, timeout / 2), timeout


# ---------------------------------------------------------------------------------------------
# Extraction

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


# ---------------------------------------------------------------------------------------------
# Normalisation (stage 1) and plain numbers (stage 2)

_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u22c5": "\\cdot ", "\u00b7": "\\cdot ",
    "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u2264": "\\le ", "\u2265": "\\ge ",
    "\u00b0": "^\\circ", "\u00a0": " ", "\u2009": " ", "\u202f": " ", "\u00b1": "\\pm ", "\u2213": "\\mp ",
}
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))
# A matrix row break `\\` is matched first, so that its second backslash is not read as `\ `.
_SPACING_RE = re.compile(r"\\\\|\\[,;:> ]|\\q?quad(?![A-Za-z])|\\displaystyle(?![A-Za-z])|~")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)\.|\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
# `90^\circ`, `25^{\circ}\mathrm{C}`, `25°C`: the degree sign and a Celsius/Fahrenheit letter after it
_DEGREE_RE = re.compile(
    r"(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\degree(?![A-Za-z]))"
    r"(?:\s*(?:\\(?:text|mathrm|mbox|textrm)\s*\{\s*[CF]\s*\}|[CF](?![A-Za-z])))?"
)
_MATH_DELIMS_RE = re.compile(r"^\\[(\[](.*)\\[)\]]$", re.S)
_BARE_PERCENT_RE = re.compile(r"(?<!\\)%")
_SCI_E_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d{1,4})$")
_THOUSANDS_RE = re.compile(r"^([+-]?)(\d{1,3}(?:,\d{3})+)(\.\d+)?$")
# Minerva writes Python: `-1./3`, `np.arcsin(10/13)`, `2**10`. A dot ending a number is dropped (not before
# `\overline` etc.: `1.\overline{27}`), a module prefix becomes a TeX command, `**` a power.
_PY_TRAILING_DOT_RE = re.compile(r"(?<=\d)\.(?![\d.]|\\(?:overline|bar|dot)(?![A-Za-z]))")
_PY_MODULE_RE = re.compile(r"(?<![\w\\])(?:np|numpy|math|sp|sympy)\.(arcsin|arccos|arctan|sinh|cosh|tanh|sin|cos|tan|exp|pi)\b")
_UNITS = (
    "square|sq|cubic|units?|degrees?|radians?|cents?|dollars?|hours?|hrs?|minutes?|mins?|seconds?|"
    "secs?|days?|weeks?|months?|years?|mph|kph|km|cm|mm|nm|meters?|metres?|feet|foot|ft|inches|inch|"
    "miles?|yards?|yd|gm|grams?|kg|mg|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|mL|points?|ways|people|"
    "students|persons|marbles|integers|digits|edges|meals|multiples|times|sides|coins|pieces|percent|"
    "USD|usd|euros?|Hz|kHz|MHz|GHz|eV|keV|MeV|GeV|ergs?|AU|pc|kpc|Mpc|yrs?|arcsec|arcmin|atm|mol|kcal|cal|kJ|kW"
)
_NUMBER_WORDS = {"hundred": 2, "thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_NUMBER_WORD = "(?:" + "|".join(_NUMBER_WORDS) + ")"
# A text-wrapped tail after the value: `\text{ cm}^2`, `\mbox{cm}`, `\,\mathrm{~m} / \mathrm{s}^{2}`
# (hendrycks `_remove_right_units`, widened to every wrapper and to unit text without a leading space).
_TEXT_TAIL_RE = re.compile(
    r"(?<=\S)\s*(?:/|\\cdot(?![A-Za-z]))?\s*\\(?:text|mbox|mathrm|textrm)\s*\{([^{}]*)\}"
    r"(?:\s*\^\s*(?:\{\s*-?\d{1,2}\s*\}|-?\d))?\s*$"
)
_UNIT_SYMBOL = r"(?:[A-Za-z\u00c5\u00b5\u03bc\u03a9]+|\\(?:mu|AA|Omega|circ)(?![A-Za-z]))"
_UNIT_TEXT_RE = re.compile(
    rf"^{_UNIT_SYMBOL}(?:\s*(?:/|\\cdot|\*|\^\s*\{{?\s*-?\d{{1,2}}\s*\}}?|\s)\s*{_UNIT_SYMBOL}?)*(?:\^\s*\{{?-?\d{{1,2}}\}}?)?$"
)
# One letter inside a wrapper is a unit only when it is an SI symbol (not `i`, `e`, `d`, `x`, ...).
_ONE_LETTER_UNITS = frozenset("msgKJNWVALTCFh")
_WORD_UNIT_RE = re.compile(
    r"(?:(?<=[\d}.])|" + "|".join(f"(?<={w})" for w in _NUMBER_WORDS) + r")"
    r"\s+(?:(?:" + _UNITS + r")\s*)+(?:\^\{?\d\}?)?\s*$"
)
_NUMBER_WORD_RE = re.compile(
    rf"^([+-]?(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?)\s*(?:\\(?:text|mbox|mathrm)\s*\{{\s*({_NUMBER_WORD})s?\s*\}}|({_NUMBER_WORD})s?)$"
)
_TEXT_MACRO_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|operatorname|boldsymbol)\s*\{"
)
_AND_RE = re.compile(r"\\(?:text|mbox)\{\s*(?:and|or)\s*\}|,?\s+(?:and|or)\s+")
_VAR_PREFIX_RE = re.compile(r"^(?:[A-Za-z]|[A-Za-z]_\{?\w{1,3}\}?|\\[A-Za-z]+)(?:=|\\in(?![A-Za-z]))(?!=)")
# A named left-hand side: `k`, `x_1`, `m_{\max }`, `\theta`, `f(x)`, `N(n)`, `y'` (then `=` or `\in`).
_LHS_NAME = (
    r"(?:[A-Za-z]|\\(?!(?:frac|sqrt|left|right|text|mathrm|begin|end|boxed)(?![A-Za-z]))[A-Za-z]+)"
    r"(?:\s*_\s*(?:\{[^{}=]{1,16}\}|[A-Za-z0-9]))?(?:'|\s*\^\s*\{?\s*\\prime\s*\}?)*"
    r"(?:\s*\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])*\s*\))?"
)
_LHS_RE = re.compile(rf"^\s*({_LHS_NAME})\s*(=|\\in(?![A-Za-z]))(?!=)\s*(.*)$", re.S)
_CHOICE_RE = re.compile(r"^\(([A-Z])\)$")
_LEADING_DOT_RE = re.compile(r"(^|[^\w}.\\])\.(\d)")
_SHORTHAND_RE = re.compile(r"\\(frac|sqrt)(?![A-Za-z])")


def _clean(s: str) -> str:
    """Light normalisation that keeps the string parseable (for latex2sympy): no space removal."""
    s = _UNICODE_RE.sub(lambda m: _UNICODE[m.group(0)], s.strip())
    s = s.replace("\\$", "").replace("$", "").strip()
    m = _MATH_DELIMS_RE.match(s)
    if m:
        s = m.group(1).strip()
    s = _unwrap_whole_box(_strip_trailing_period(s))
    s = s.replace("\n", " ").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\dbinom", "\\binom")
    s = s.replace("\\!", "")  # negative thin space: `10,\\!080`
    s = _SPACING_RE.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _PY_MODULE_RE.sub(r"\\\1", s).replace("**", "^")
    s = _PY_TRAILING_DOT_RE.sub("", s)
    s = _DEGREE_RE.sub("", s).replace("{,}", ",")
    s = _strip_units(s)
    s = _strip_trailing_period(_BARE_PERCENT_RE.sub(r"\\%", s))
    s = _AND_RE.sub(", ", s)
    m = _THOUSANDS_RE.match(s)
    if m:
        s = m.group(1) + m.group(2).replace(",", "") + (m.group(3) or "")
    m = _SCI_E_RE.match(s)
    if m:  # `4.5e33` would parse as 4.5·e·33
        s = f"{m.group(1)}\\times 10^{{{m.group(2)}}}"
    return _strip_named_lhs(s)


def _strip_trailing_period(s: str) -> str:
    s = s.strip()
    while s.endswith(".") or s.endswith("\\."):
        s = s[:-2].rstrip() if s.endswith("\\.") else s[:-1].rstrip()
    return s


def _strip_units(s: str) -> str:
    """Drop units written after the value (text-wrapped ones, and known unit words), then scale by a number
    word (`2.5 million` → `2500000`)."""
    for _ in range(8):  # one unit group per pass: `\mathrm{m} / \mathrm{s}^{2}` takes two
        m = _TEXT_TAIL_RE.search(s)
        if m is None or not _is_unit_text(m.group(1), s[: m.start()]):
            break
        s = s[: m.start()].rstrip()
    s = _WORD_UNIT_RE.sub("", s)
    m = _NUMBER_WORD_RE.match(s)
    if m:
        value = Decimal(m.group(1).replace(",", "")).scaleb(_NUMBER_WORDS[m.group(2) or m.group(3)])
        s = format(value.normalize(), "f")
    return s


def _is_unit_text(content: str, before: str) -> bool:
    text = content.strip()
    if not before.strip() or re.fullmatch(rf"\s*{_NUMBER_WORD}s?\s*", content) or text in ("and", "or"):
        return False
    if not text or content[:1].isspace():  # `\text{ cm}`, `\text{ square units}` (hendrycks)
        return True
    if not re.search(r"[\d}.)]\s*$|\\pi\s*$", before):  # a unit follows a value
        return False
    if len(text) == 1:
        return text in _ONE_LETTER_UNITS
    return _UNIT_TEXT_RE.match(text) is not None


def _top_level_split(s: str) -> list[str]:
    """Split at commas outside (), [], {} (and `\\{ \\}`)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
        i += 1
    parts.append(s[start:])
    return parts


def _strip_named_lhs(s: str) -> str:
    """`k = 3` → `3`, `f(x) = 2x` → `2x`, `x \\in [0,1]` → `[0,1]`, `x = 1, 2` → `1, 2`; `a = 2, a = -6` → `2, -6`
    (one name only: `x = 1, y = 2` keeps its names, they say which value is which). A chain `a = b = c` is kept."""
    parts = _top_level_split(s)
    if len(parts) > 1 and sum(p.count("=") for p in parts) == len(parts):
        matches = [_LHS_RE.match(p) for p in parts]
        names = {re.sub(r"\s+", "", m.group(1)) for m in matches if m}
        if all(m and m.group(2) == "=" and m.group(3).strip() for m in matches) and len(names) == 1:
            return ", ".join(m.group(3).strip() for m in matches)
        return s
    m = _LHS_RE.match(s)  # one name for the whole answer: `k = 3`, `x = 1, 2`
    if m and m.group(3).strip() and "=" not in m.group(3):
        return m.group(3).strip()
    return s


def _unwrap_macro_args(s: str) -> str:
    """`\\text{abc}` → `abc` for text-like macros, with nested braces."""
    while True:
        m = _TEXT_MACRO_RE.search(s)
        if m is None:
            return s
        open_ = m.end() - 1
        depth, j = 0, open_
        while j < len(s):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if j >= len(s):  # unbalanced: drop the macro name only
            return s[: m.start()] + s[open_ + 1 :]
        s = s[: m.start()] + s[open_ + 1 : j] + s[j + 1 :]


def _read_arg(s: str, i: int) -> tuple[str, int] | None:
    """One TeX argument at `s[i:]`: a braced group, a command name, or one character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i : j + 1], j + 1
        return None
    if s[i] == "\\":
        m = re.match(r"\\(?:[A-Za-z]+|.)", s[i:])
        return "{" + m.group(0) + "}", i + m.end()
    if s[i] in "}^_":
        return None
    return "{" + s[i] + "}", i + 1


def _fix_shorthand(s: str) -> str:
    """`\\frac12` → `\\frac{1}{2}`, `\\frac 59`, `\\frac{270}7`, `\\sqrt2` → `\\sqrt{2}`."""
    out, pos = [], 0
    for m in _SHORTHAND_RE.finditer(s):
        if m.start() < pos:
            continue
        out.append(s[pos : m.end()])
        i = m.end()
        if m.group(1) == "sqrt" and i < len(s) and s[i] == "[":
            close = s.find("]", i)
            if close < 0:
                pos = i
                continue
            out.append(s[i : close + 1])
            i = close + 1
        for _ in range(2 if m.group(1) == "frac" else 1):
            arg = _read_arg(s, i)
            if arg is None:
                break
            out.append("{" + _fix_shorthand(arg[0][1:-1]) + "}")  # nested: `\\frac{\\sqrt2}{2}`
            i = arg[1]
        pos = i
    out.append(s[pos:])
    return "".join(out)


def _normalize_cleaned(c: str) -> str:
    s = _unwrap_macro_args(c)
    s = s.replace("\\%", "").replace("%", "")
    s = _fix_shorthand(s)
    s = re.sub(r"\s+", "", s)
    s = _VAR_PREFIX_RE.sub("", s, count=1) if s.count("=") <= 1 else s
    m = _CHOICE_RE.match(s)
    if m:
        s = m.group(1)
    s = _LEADING_DOT_RE.sub(r"\g<1>0.\2", s)
    m = _THOUSANDS_RE.match(s)
    if m:
        s = m.group(1) + m.group(2).replace(",", "") + (m.group(3) or "")
    return s.rstrip(".")


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer (stage 1 of `is_equivalent`); never raises."""
    try:
        return _prepare(answer).norm
    except Exception:
        return answer.strip() if isinstance(answer, str) else ""


def answer_key(answer: str) -> str:
    """Grouping key for majority voting: the normalised form, with plain numbers canonicalised
    (`0.5`, `\\frac12`, `1/2` share a key). Never raises."""
    try:
        p = _prepare(answer)
    except Exception:
        return answer.strip() if isinstance(answer, str) else ""
    if p.number is not None:
        v = p.number[0]
        return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"
    return p.norm


_DEC = r"[+-]?(?:\d{1,400}(?:\.\d{0,400})?|\.\d{1,400})"
_NUM_PLAIN_RE = re.compile(rf"({_DEC})(?:[eE]([+-]?\d{{1,4}}))?")
_NUM_SCI_RE = re.compile(rf"({_DEC})(?:\\times|\\cdot|\*)10\^(?:\{{([+-]?\d{{1,4}})\}}|([+-]?\d))")
_NUM_POW10_RE = re.compile(r"10\^(?:\{([+-]?\d{1,4})\}|([+-]?\d))")
_NUM_FRAC_RE = re.compile(r"([+-]?)\\frac\{([+-]?\d{1,400})\}\{([+-]?\d{1,400})\}")
_NUM_MIXED_RE = re.compile(r"([+-]?)(\d{1,400})\\frac\{(\d{1,400})\}\{(\d{1,400})\}")
_NUM_SLASH_RE = re.compile(rf"({_DEC})/({_DEC.replace('[+-]?', '')})")
# `0.1\overline{6}`, `0.\bar{3}`, `0.\dot{3}`: digits, then the repeating block
_NUM_REPEAT_RE = re.compile(
    r"([+-]?)(\d{0,400})\.(\d{0,400})(?:\\(?:overline|bar)\{(\d{1,100})\}|\\(?:overline|bar|dot)\{?(\d)\}?)"
)


def _to_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, written_as_decimal) if `s` (normalised, no spaces) is a plain number, else None."""
    if m := _NUM_PLAIN_RE.fullmatch(s):
        v = Fraction(m.group(1))
        if m.group(2):
            v *= Fraction(10) ** int(m.group(2))
        return v, "." in s or bool(m.group(2))
    if m := _NUM_SCI_RE.fullmatch(s):
        return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2) or m.group(3)), True
    if m := _NUM_POW10_RE.fullmatch(s):
        return Fraction(10) ** int(m.group(1) or m.group(2)), False
    if m := _NUM_FRAC_RE.fullmatch(s):
        num, den = int(m.group(2)), int(m.group(3))
        return (Fraction(-num if m.group(1) == "-" else num, den), False) if den else None
    if m := _NUM_MIXED_RE.fullmatch(s):
        whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
        if not den:
            return None
        v = whole + Fraction(num, den) if 0 < num < den else whole * Fraction(num, den)
        return (-v if m.group(1) == "-" else v), False
    if m := _NUM_SLASH_RE.fullmatch(s):
        num, den = Fraction(m.group(1)), Fraction(m.group(2))
        return (num / den, "." in m.group(1).rstrip(".") or "." in m.group(2).rstrip(".")) if den else None
    if m := _NUM_REPEAT_RE.fullmatch(s):
        whole, fixed, block = m.group(2) or "0", m.group(3), m.group(4) or m.group(5)
        v = int(whole) + Fraction(int(fixed or "0"), 10 ** len(fixed))
        v += Fraction(int(block), 10 ** len(fixed) * (10 ** len(block) - 1))
        return (-v if m.group(1) == "-" else v), False
    return None


@dataclass(frozen=True)
class _Prepared:
    clean: str  # for latex2sympy
    norm: str  # for string comparison
    number: tuple[Fraction, bool] | None  # stage-2 value and whether a decimal was written
    percent: bool


@lru_cache(maxsize=1 << 16)
def _prepare(answer: str) -> _Prepared:
    clean = _clean(answer)
    norm = _normalize_cleaned(clean)
    return _Prepared(clean, norm, _to_number(norm), "%" in clean)


def _numbers_equal(p: _Prepared, g: _Prepared) -> bool:
    (pv, p_dec), (gv, g_dec) = p.number, g.number  # type: ignore[misc]
    # `50\%` may stand for 50 or for 0.5, as in math-verify
    pvs = (pv, pv / 100) if p.percent else (pv,)
    gvs = (gv, gv / 100) if g.percent else (gv,)
    inexact = p_dec or g_dec
    return any(
        a == b or (inexact and abs(a - b) <= _TOL * min(1, max(abs(a), abs(b)))) for a in pvs for b in gvs
    )


def _compare(pred: str, gold: str, deadline: tuple[float, float] | None) -> tuple[bool, str]:
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False, "error: not a string"
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return (pred.strip() == gold.strip() and bool(gold.strip())), "too_long"
    p, g = _prepare(pred), _prepare(gold)
    if not p.norm or not g.norm:
        return False, "empty"
    if p.norm == g.norm:
        return True, "string"
    if p.number is not None and g.number is not None:
        return _numbers_equal(p, g), "numeric"
    if deadline is None:
        return False, "string"
    return _symbolic(p.clean, g.clean, deadline)


# ---------------------------------------------------------------------------------------------
# Symbolic stage (3): latex2sympy + math-verify's `verify`, under a deadline

class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException so `except Exception` cannot swallow it."""


# (pred, gold) -> (correct, reason, budget it was decided with); timeouts are kept with their budget
_verdicts: dict[tuple[str, str], tuple[bool, str, float]] = {}
_verdicts_lock = threading.Lock()


def _symbolic(pred: str, gold: str, deadline: tuple[float, float]) -> tuple[bool, str]:
    end, budget = deadline
    with _verdicts_lock:
        hit = _verdicts.get((pred, gold))
    if hit is not None and (hit[1] != "timeout" or hit[2] >= budget):
        _STATS["cached"] += 1
        return hit[0], hit[1]
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        try:
            correct, reason, cacheable = _symbolic_main_thread(pred, gold, end)
        except ValueError:  # signals unusable here (e.g. a sub-interpreter): use a worker
            correct, reason, cacheable = _pool().compare(pred, gold, end)
    else:
        correct, reason, cacheable = _pool().compare(pred, gold, end)
    if reason == "timeout":
        _STATS["timeout"] += 1
    if cacheable:
        with _verdicts_lock:
            if len(_verdicts) > 1 << 16:
                _verdicts.clear()
            _verdicts[(pred, gold)] = (correct, reason, budget)
    return correct, reason


def _symbolic_main_thread(pred: str, gold: str, end: float) -> tuple[bool, str, bool]:
    _math_verify()  # the one-time import counts against the budget, but is never interrupted (a half import breaks)
    left = end - time.monotonic()
    if left <= 0:
        return False, "timeout", False
    correct, reason = _symbolic_in_process(pred, gold, left)
    return correct, reason, reason in ("symbolic", "not_math", "timeout")


@lru_cache(maxsize=1)
def _math_verify():
    import sympy
    from latex2sympy2_extended import NormalizationConfig, latex2sympy
    from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
    from latex2sympy2_extended.math_normalization import normalize_latex
    from math_verify import grader
    from math_verify.grader import should_treat_as_complex, verify

    def parse_number(self, text: str):
        # latex2sympy's own version is `sympy.Number(text)`, i.e. sympify → parse_expr → `eval` of the
        # token; these build the same Integer / Float without it (SPEC §7: model output is never eval'd).
        text = text.replace(",", "")
        if text.isdigit():
            return sympy.Integer(int(text))
        if _FLOAT_TOKEN_RE.fullmatch(text):
            return sympy.Float(text)
        raise ValueError(f"not a number: {text[:50]!r}")

    _Latex2Sympy.parse_number = parse_number
    # We pass timeouts of None (we bound time ourselves); silence the one-time warning about that.
    grader.TIMEOUT_WARNING_SHOWN = True
    # Unit stripping off: math-verify's list has one-letter "units" (m, t, s, h, d, …), so `6m`
    # would equal `6`. Worded units are stripped by `_clean` instead. boxed="none": `_clean` unwrapped the
    # answer's box; a box left inside (`\\boxed{1}+\\boxed{2}`) is not extracted as if it were the answer.
    norm = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="none")

    def parse(answer: str):
        text = normalize_latex(answer, norm)
        return latex2sympy(text, is_real=not should_treat_as_complex(text), convert_degrees=False,
                           normalization_config=None)

    return parse, verify


_NOT_MATH = object()
_FLOAT_TOKEN_RE = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


@lru_cache(maxsize=1 << 14)
def _parse(answer: str):
    """The whole answer as one sympy object, or `_NOT_MATH` when it does not parse as a whole."""
    parse, _ = _math_verify()
    try:
        return parse(answer)
    except Exception:  # latex2sympy raises plain Exceptions for syntax errors; `_Deadline` passes through
        return _NOT_MATH


def _symbolic_in_process(pred: str, gold: str, timeout: float) -> tuple[bool, str]:
    """Stage 3 in this process; must run in the main thread (SIGALRM)."""
    _, verify = _math_verify()  # import outside the deadline: it is slow once, not per answer
    _STATS["symbolic"] += 1

    def work() -> tuple[bool, str]:
        g, p = _parse(gold), _parse(pred)
        if g is _NOT_MATH or p is _NOT_MATH:
            return False, "not_math"
        return bool(verify(g, p, timeout_seconds=None)), "symbolic"

    try:
        return _with_alarm(work, timeout)
    except _Deadline:
        return False, "timeout"
    except Exception:
        return False, "error"


def _with_alarm(fn, seconds: float):
    """Run `fn()` raising `_Deadline` after `seconds` (main thread only; restores the old handler/timer).

    Raises ValueError where signals cannot be used (not the main thread; a SIGALRM handler installed
    from C, which we could not restore).
    """
    if signal.getsignal(signal.SIGALRM) is None:
        raise ValueError("SIGALRM handler not installed from Python")
    armed = True

    def on_alarm(signum, frame):
        if armed:
            raise _Deadline()

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3), _ALARM_REPEAT_S)
    try:
        return fn()
    finally:
        # Disarm first, retrying if an alarm lands right here: once disarmed, the handler is inert,
        # so the cleanup below cannot be skipped (a live repeating timer would outlive this call).
        while True:
            try:
                armed = False
                break
            except _Deadline:
                continue
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # someone else's alarm (e.g. pytest-timeout): give back what is left
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3), old_interval)


# ---------------------------------------------------------------------------------------------
# Worker subprocesses for callers outside the main thread

_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_opd_grading_worker', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._worker_main()\n"
)


class _WorkerError(Exception):
    pass


class _Worker:
    """One grading subprocess speaking JSON lines: `[pred, gold, timeout]` → `[correct, reason]`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
        )
        _STATS["worker_starts"] += 1
        self.ready = False
        self._buf = b""

    def _readline(self, deadline: float) -> bytes | None:
        """Next line from the worker, None at the deadline; raises `_WorkerError` if it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerError("worker exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait_ready(self, deadline: float) -> bool:
        """Whether the worker has finished starting by `deadline` (raises `_WorkerError` if it cannot start)."""
        if not self.ready:
            line = self._readline(deadline)
            if line is None:
                return False
            if line != b"ready":
                raise _WorkerError("worker did not start")
            self.ready = True
        return True

    def compare(self, pred: str, gold: str, timeout: float, hard_deadline_s: float) -> tuple[bool, str] | None:
        """Verdict, or None if the worker overran `hard_deadline_s` (it must then be killed)."""
        if not self.wait_ready(time.monotonic() + hard_deadline_s):
            return None
        data = memoryview(json.dumps([pred, gold, timeout]).encode() + b"\n")
        try:
            while data:
                data = data[os.write(self.proc.stdin.fileno(), data) :]
        except OSError as e:
            raise _WorkerError("worker exited") from e
        line = self._readline(time.monotonic() + hard_deadline_s)
        if line is None:
            return None
        correct, reason = json.loads(line)
        return bool(correct), str(reason)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except Exception:
            pass


class _WorkerPool:
    """Up to `size` workers, each used by one thread at a time; an overrunning worker is replaced at once.

    The first worker starts when the pool is made; taking the last idle one starts a spare (up to `size`), so a
    second concurrent caller rarely waits for a start-up."""

    def __init__(self, size: int) -> None:
        self.size, self.idle = size, []
        self.all: list[_Worker] = []
        self.waiting: deque[list[_Worker]] = deque()  # one slot per waiting caller, in arrival order
        self.cv = threading.Condition()
        self.pid = os.getpid()
        self.broken = False  # workers cannot start here at all: stop trying
        self.ever_ready = False
        try:
            self.idle.append(self._spawn())
        except OSError as e:
            self.broken = True
            _log.warning("opd grading worker failed to start (%s): symbolic comparison skipped", e)

    def compare(self, pred: str, gold: str, end: float) -> tuple[bool, str, bool]:
        """(correct, reason, cacheable) by the deadline `end` (monotonic seconds)."""
        if self.broken:
            return False, "unavailable", False
        worker = self._acquire(end)
        if worker is None:
            return False, "busy", False
        healthy = True
        try:
            if not worker.wait_ready(end - _WORKER_MARGIN_S):
                return False, "busy", False  # still starting: it stays in the pool for the next call
            self.ever_ready = True
            left = end - time.monotonic()
            if left <= _WORKER_MARGIN_S:
                return False, "timeout", False
            result = worker.compare(pred, gold, left - _WORKER_MARGIN_S, left)
            healthy = result is not None
            return (*result, True) if result is not None else (False, "timeout", True)
        except (_WorkerError, OSError, ValueError) as e:
            healthy = False
            if not self.ever_ready and not worker.ready:
                self.broken = True
            _log.warning("opd grading worker failed (%s): symbolic comparison skipped", e)
            return False, "unavailable", False
        finally:
            self._release(worker, healthy)

    def _acquire(self, end: float) -> _Worker | None:
        """An idle worker, a new one while fewer than `size` exist, else the next one released, first come
        first served (a thread that releases one cannot take it straight back); None at the deadline."""
        with self.cv:
            if self.idle and not self.waiting:
                worker = self.idle.pop()
                if not self.idle and len(self.all) < self.size:
                    try:  # a spare starts warming now, for the next concurrent caller
                        self.idle.append(self._spawn())
                    except OSError:
                        pass
                return worker
            if not self.idle and len(self.all) < self.size:
                try:
                    return self._spawn()
                except OSError as e:
                    _log.warning("opd grading worker failed to start (%s): symbolic comparison skipped", e)
                    return None
            slot: list[_Worker] = []
            self.waiting.append(slot)
            while not slot:
                left = end - time.monotonic()
                if left <= 0:
                    self.waiting.remove(slot)
                    return None
                self.cv.wait(timeout=left)
            return slot[0]

    def _spawn(self) -> _Worker:
        """A new worker, counted in `all` (callers hold `cv`, or are the constructor)."""
        w = _Worker()
        self.all.append(w)
        return w

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
        with self.cv:
            if not healthy:
                if worker in self.all:
                    self.all.remove(worker)
                worker = None
                if not self.broken:
                    try:
                        worker = self._spawn()  # start warming up now, not on the next call
                    except OSError:
                        pass
            if worker is not None and self.waiting:
                self.waiting.popleft().append(worker)
                self.cv.notify_all()
            elif worker is not None:
                self.idle.append(worker)

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child inherits this atexit hook: the workers are not its own
            return
        with self.cv:
            workers, self.all, self.idle = self.all, [], []
        for w in workers:
            w.kill()


_pool_lock = threading.Lock()
_pool_state: dict[int, _WorkerPool] = {}  # by pid: a forked child must not share its parent's workers


def _pool() -> _WorkerPool:
    pid = os.getpid()
    with _pool_lock:
        pool = _pool_state.get(pid)
        if pool is None:
            _pool_state.clear()
            pool = _pool_state[pid] = _WorkerPool(size=max(2, min(8, os.cpu_count() or 2)))
            atexit.register(pool.close)
        return pool


def _worker_main() -> None:
    """Entry point of a worker subprocess: answer comparisons on stdout until stdin closes."""
    # The protocol gets its own copy of fd 1; fd 1 itself (and sys.stdout) now go to stderr, so stray
    # prints, from Python or C, cannot corrupt it.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _math_verify()
    _symbolic_in_process("1", "1", 30.0)  # warm sympy's caches before announcing readiness
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            pred, gold, timeout = json.loads(line)
            result = _symbolic_in_process(pred, gold, float(timeout))
        except Exception:
            result = (False, "error")
        out.write(json.dumps(list(result)).encode() + b"\n")
        out.flush()


# ----------------------------------------------------------------------------------- decoded rollouts, graded


def decode_responses(tokenizer, response_ids, lengths: Sequence[int] | None = None) -> list[str]:
    """The text of each response (special tokens dropped): rows of `response_ids` (a `[B, T]` tensor or lists of
    ids), each cut to its length in `lengths` when given (a padded batch's response-mask sums)."""
    rows = response_ids.tolist() if hasattr(response_ids, "tolist") else [list(ids) for ids in response_ids]
    if lengths is not None:
        rows = [ids[:length] for ids, length in zip(rows, lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def grade_responses(tokenizer, response_ids, answers: Sequence, *, lengths: Sequence[int] | None = None,
                    timeout: float = DEFAULT_TIMEOUT_S) -> tuple[list[str], list[Grade] | None]:
    """Decode every response and grade it against its row's ground truth; the grades are None when any row has
    no answer (prompts without ground truth: nothing to grade)."""
    texts = decode_responses(tokenizer, response_ids, lengths)
    if any(answer is None for answer in answers):
        return texts, None
    return texts, [grade(text, answer, timeout=timeout) for text, answer in zip(texts, answers)]
