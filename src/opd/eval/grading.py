"""Math answer grading: extract the final answer from a response and compare it with the ground truth.

`grade(response, ground_truth)` = `extract_answer` (SPEC §7) + `is_equivalent`, in three stages, cheapest first:

1. **string**: both sides are normalised and compared. The normaliser follows the MATH reference
   `_strip_string` (hendrycks/math `modeling/math_equivalence.py`) and the DAPO/Minerva
   `normalize_final_answer` (volcengine/verl `verl/utils/reward_score/math_dapo.py`): `\\left`/`\\right`,
   thin spaces, `\\dfrac`/`\\tfrac`, `\\frac12`, `\\sqrt2`, `\\text{…}`, right units (`\\text{ cm}`), degrees,
   `\\%`, `\\$`, `x = ` prefixes, thousands separators, trailing periods. Unlike hendrycks we never rewrite
   `\\\\` (matrix rows) and never strip a one-letter unit (`6m` is an answer, not six metres).
2. **numeric**: when both sides are plain numbers (integers, decimals, `a/b`, `\\frac{a}{b}`, `1.5e3`,
   `1.5\\times10^{3}`, optional `%`) they are compared exactly as `Fraction`s; if either side is a
   decimal, they may differ by 1e-6, both relative and absolute (`0.333333` = `1/3`, but
   `1000000.5` ≠ `1000000`). math-verify instead rounds to 6 decimal places, which would equate
   Minerva's `7.4e-12` and `7.5e-12`. No sympy here: integer
   answers grade at ~30k/s (9 kB responses, one core).
3. **symbolic**: `math_verify.parse` + `math_verify.verify` on the cleaned strings (each wrapped in
   `\\boxed{}`), bounded by `timeout` seconds for the parse + verify of one pair.

Timeouts. math-verify's own timeout is `signal.alarm`: whole seconds and main thread only (it raises
`ValueError` elsewhere). We disable it and bound the symbolic stage ourselves:
- main thread (POSIX): `signal.setitimer` with a float deadline raising a `BaseException` (so broad
  `except Exception` in sympy/latex2sympy cannot swallow it), re-armed every 50 ms until we leave;
  the previous SIGALRM handler and timer are restored.
- any other thread: the pair goes to a pool of grading subprocesses (`python -c` loading this file
  by path, so the package's `__init__` is not imported; JSON lines over pipes). The worker applies
  the same alarm; if it still has not answered `timeout + 1 s` later (a C-level loop), it is killed
  and replaced. Waiting for a free worker or for a fresh worker's start-up (~1-5 s: the sympy import) is
  not counted in `timeout`. Workers exit when the parent closes their stdin or exits.
- answers longer than `MAX_ANSWER_CHARS` skip stages 2-3 (exact string match only), so 100 kB of
  garbage is rejected in microseconds; extraction itself is a single linear pass.

Omitted, on purpose: executing or `eval`-ing model output (never); Minerva's ±1 % numeric tolerance
(the reference recipe grades with math-verify, which does not have it); `\\text{…}` case folding in the
string stage (math-verify lowercases text in stage 3); POSIX only (the worker pool relies on `select`
over pipes).
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
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

_log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 1000
"""Extracted answers / ground truths longer than this are compared by exact string match only."""

_TOL = Fraction(1, 10**6)  # stage 2: relative and absolute
_ALARM_REPEAT_S = 0.05
_WORKER_GRACE_S = 1.0
_WORKER_START_S = 120.0

__all__ = [
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

    correct:   True iff the extracted answer is equivalent to the ground truth.
    extracted: the answer found in the response (`extract_answer`), None if there was none.
    reason:    the stage that decided: "string" | "numeric" | "symbolic" | "no_answer" | "empty" |
               "too_long" | "timeout" | "unavailable" (symbolic stage could not run) | "error".
    """

    correct: bool
    extracted: str | None
    reason: str


def grade(response: str, ground_truth: str, *, timeout: float = 5.0) -> Grade:
    """Grade a model response against a ground truth (which may itself be wrapped in `\\boxed{}`).

    `timeout` (seconds) bounds the symbolic comparison; `<= 0` skips it. Never raises.
    """
    extracted = None
    try:
        extracted = extract_answer(response)
        if extracted is None:
            return Grade(False, None, "no_answer")
        correct, reason = _compare(extracted, _unwrap_gold(ground_truth), timeout)
        return Grade(correct, extracted, reason)
    except Exception as e:  # the contract is "never raises": a grading bug must not kill an eval
        return Grade(False, extracted, f"error: {type(e).__name__}")


def is_equivalent(pred: str, gold: str, *, timeout: float = 5.0) -> bool:
    """True iff answer `pred` is equivalent to answer `gold` (string, numeric, then symbolic stage).

    Not symmetric for equations (`2x+3` matches gold `y=2x+3`, as in math-verify). Never raises.
    """
    try:
        return _compare(pred, gold, timeout)[0]
    except Exception:
        return False


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
    "\u00b0": "^\\circ", "\u00a0": " ", "\u2009": " ", "\u202f": " ",
}
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))
# A matrix row break `\\` is matched first, so that its second backslash is not read as `\ `.
_SPACING_RE = re.compile(r"\\\\|\\[,;:> ]|\\q?quad(?![A-Za-z])|\\displaystyle(?![A-Za-z])|~")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)\.|\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\degree(?![A-Za-z])")
_MATH_DELIMS_RE = re.compile(r"^\\[(\[](.*)\\[)\]]$", re.S)
_BARE_PERCENT_RE = re.compile(r"(?<!\\)%")
_SCI_E_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d{1,4})$")
_THOUSANDS_RE = re.compile(r"^([+-]?)(\d{1,3}(?:,\d{3})+)(\.\d+)?$")
_UNITS = (
    "square|sq|cubic|units?|degrees?|radians?|cents?|dollars?|hours?|hrs?|minutes?|mins?|seconds?|"
    "secs?|days?|weeks?|months?|years?|mph|kph|km|cm|mm|meters?|metres?|feet|foot|ft|inches|inch|"
    "miles?|yards?|yd|gm|grams?|kg|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|points?|ways|people|"
    "students|persons|marbles|integers|digits|edges|meals|multiples|times|sides|coins|pieces|percent"
)
# Right units: `\text{ cm}^2` / `\text{cm}` / ` cm` after the value (hendrycks `_remove_right_units`).
_TEXT_UNIT_RE = re.compile(
    r"(?<=\S)\s*\\(?:text|mbox|mathrm|textrm)\{(?:\s[^{}]*|\s*(?:" + _UNITS + r")\s*)\}(?:\^\{?\d\}?)?\s*$"
)
_WORD_UNIT_RE = re.compile(r"(?<=[\d}.])\s+(?:(?:" + _UNITS + r")\s*)+(?:\^\{?\d\}?)?\s*$")
_TEXT_MACRO_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|operatorname|boldsymbol)\s*\{"
)
_AND_RE = re.compile(r"\\(?:text|mbox)\{\s*(?:and|or)\s*\}|,?\s+(?:and|or)\s+")
_VAR_PREFIX_RE = re.compile(r"^(?:[A-Za-z]|[A-Za-z]_\{?\w{1,3}\}?|\\[A-Za-z]+)(?:=|\\in(?![A-Za-z]))(?!=)")
_CHOICE_RE = re.compile(r"^\(([A-Z])\)$")
_LEADING_DOT_RE = re.compile(r"(^|[^\w}.\\])\.(\d)")
_SHORTHAND_RE = re.compile(r"\\(frac|sqrt)(?![A-Za-z])")


def _clean(s: str) -> str:
    """Light normalisation that keeps the string parseable (for math-verify): no space removal."""
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
    s = _DEGREE_RE.sub("", s).replace("{,}", ",")
    s = _TEXT_UNIT_RE.sub("", s)
    s = _WORD_UNIT_RE.sub("", s)
    s = _strip_trailing_period(_BARE_PERCENT_RE.sub(r"\\%", s))
    m = _THOUSANDS_RE.match(s)
    if m:
        s = m.group(1) + m.group(2).replace(",", "") + (m.group(3) or "")
    m = _SCI_E_RE.match(s)
    if m:  # `4.5e33` would parse as 4.5·e·33
        s = f"{m.group(1)}\\times 10^{{{m.group(2)}}}"
    return s


def _strip_trailing_period(s: str) -> str:
    s = s.strip()
    while s.endswith(".") or s.endswith("\\."):
        s = s[:-2].rstrip() if s.endswith("\\.") else s[:-1].rstrip()
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
    s = _AND_RE.sub(",", c)
    s = _unwrap_macro_args(s)
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
_NUM_SLASH_RE = re.compile(r"([+-]?\d{1,400})/(\d{1,400})")


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
    if m := _NUM_SLASH_RE.fullmatch(s):
        den = int(m.group(2))
        return (Fraction(int(m.group(1)), den), False) if den else None
    return None


@dataclass(frozen=True)
class _Prepared:
    clean: str  # for math-verify
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


def _compare(pred: str, gold: str, timeout: float | None) -> tuple[bool, str]:
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
    if timeout is None or timeout <= 0:
        return False, "string"
    return _symbolic(p.clean, g.clean, float(timeout))


# ---------------------------------------------------------------------------------------------
# Symbolic stage (3): math-verify under a deadline

class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException so `except Exception` cannot swallow it."""


_verdicts: dict[tuple[str, str], tuple[bool, str]] = {}
_verdicts_lock = threading.Lock()


def _symbolic(pred: str, gold: str, timeout: float) -> tuple[bool, str]:
    with _verdicts_lock:
        hit = _verdicts.get((pred, gold))
    if hit is not None:
        return hit
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        try:
            result = _symbolic_in_process(pred, gold, timeout)
        except ValueError:  # signals unusable here (e.g. a sub-interpreter): use a worker
            result = _pool().compare(pred, gold, timeout)
    else:
        result = _pool().compare(pred, gold, timeout)
    if result[1] == "symbolic":  # timeouts depend on load: never cache them
        with _verdicts_lock:
            if len(_verdicts) > 1 << 16:
                _verdicts.clear()
            _verdicts[(pred, gold)] = result
    return result


@lru_cache(maxsize=1)
def _math_verify():
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, grader, parse, parser, verify

    # We pass timeouts of None (we bound time ourselves); silence the one-time warning about that.
    grader.TIMEOUT_WARNING_SHOWN = parser.TIMEOUT_WARNING_SHOWN = True
    # Unit stripping off: math-verify's list has one-letter "units" (m, t, s, h, d, …), so `6m`
    # would equal `6`. Worded units are stripped by `_clean` instead.
    norm = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all")
    config = (LatexExtractionConfig(boxed_match_priority=0, normalization_config=norm), ExprExtractionConfig())
    return parse, verify, config


@lru_cache(maxsize=1 << 14)
def _parse(answer: str) -> tuple:
    parse, _, config = _math_verify()
    return tuple(parse("\\boxed{" + answer + "}", extraction_config=config, parsing_timeout=None))


def _symbolic_in_process(pred: str, gold: str, timeout: float) -> tuple[bool, str]:
    """Stage 3 in this process; must run in the main thread (SIGALRM)."""
    _, verify, _ = _math_verify()  # import outside the deadline: it is slow once, not per answer

    def work() -> bool:
        g, p = _parse(gold), _parse(pred)
        return bool(g) and bool(p) and bool(verify(list(g), list(p), timeout_seconds=None))

    try:
        return _with_alarm(work, timeout), "symbolic"
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

    def compare(self, pred: str, gold: str, timeout: float, hard_deadline_s: float) -> tuple[bool, str] | None:
        """Verdict, or None if the worker overran `hard_deadline_s` (it must then be killed)."""
        if not self.ready:
            if self._readline(time.monotonic() + _WORKER_START_S) != b"ready":
                raise _WorkerError("worker did not start")
            self.ready = True
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
    """Up to `size` workers, each used by one thread at a time; an overrunning worker is replaced."""

    def __init__(self, size: int) -> None:
        self.size, self.count, self.idle = size, 0, []
        self.all: list[_Worker] = []
        self.cv = threading.Condition()
        self.pid = os.getpid()
        self.broken = False  # workers cannot start here at all: stop trying
        self.ever_ready = False

    def compare(self, pred: str, gold: str, timeout: float) -> tuple[bool, str]:
        if self.broken:
            return False, "unavailable"
        with self.cv:
            while not self.idle and self.count >= self.size:
                self.cv.wait()
            worker = self.idle.pop() if self.idle else None
            if worker is None:
                self.count += 1
        healthy = False
        try:
            worker = worker or self._spawn()
            result = worker.compare(pred, gold, timeout, timeout + _WORKER_GRACE_S)
            self.ever_ready = True
            healthy = result is not None
            return result if result is not None else (False, "timeout")
        except (_WorkerError, OSError, ValueError) as e:
            if not self.ever_ready and (worker is None or not worker.ready):
                self.broken = True
            _log.warning("opd grading worker failed (%s): symbolic comparison skipped", e)
            return False, "unavailable"
        finally:
            self._release(worker, healthy)

    def _spawn(self) -> _Worker:
        w = _Worker()
        with self.cv:
            self.all.append(w)
        return w

    def _release(self, worker: _Worker | None, healthy: bool) -> None:
        replacement = None
        if worker is not None and not healthy:
            worker.kill()
            if not self.broken:
                try:
                    replacement = self._spawn()  # start warming up now, not on the next call
                except OSError:
                    replacement = None
        with self.cv:
            if worker is not None and not healthy and worker in self.all:
                self.all.remove(worker)
            if healthy:
                self.idle.append(worker)
            elif replacement is not None:
                self.idle.append(replacement)
            else:
                self.count -= 1
            self.cv.notify()

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
