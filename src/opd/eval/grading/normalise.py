"""Stage 1 of grading: the canonical string form of an answer, and its exact value when it is a plain number.

The normaliser follows the MATH reference `_strip_string` (hendrycks/math `modeling/math_equivalence.py`) and the
DAPO/Minerva `normalize_final_answer` (volcengine/verl `verl/utils/reward_score/math_dapo.py`). Unlike hendrycks it
never rewrites `\\\\` (matrix rows) and never strips a bare one-letter unit (`6m` is an answer, not six metres;
inside a text wrapper, `6\\,\\mathrm{m}`, it is a unit). Added here: unit wrappers `\\mbox`/`\\mathrm`/`\\textrm`
with any unit text, `°C`, number words (`2.5 million`), Minerva's Python spellings (`-1./3`, `np.arcsin`, `**`),
and a named left-hand side (`k = 3`, `f(x) = 2x`, or `a = 2, a = -6` for one name) dropped on both sides.

Omitted: `\\text{…}` case folding (latex2sympy lowercases text in stage 3); units written bare after a number
with one letter (`9.8 m/s`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache

from opd.eval.grading.extraction import _unwrap_whole_box

_UNICODE = {
    "\u2212": "-",
    "\u2013": "-",
    "\u00d7": "\\times ",
    "\u22c5": "\\cdot ",
    "\u00b7": "\\cdot ",
    "\u03c0": "\\pi ",
    "\u221e": "\\infty ",
    "\u221a": "\\sqrt",
    "\u2264": "\\le ",
    "\u2265": "\\ge ",
    "\u00b0": "^\\circ",
    "\u00a0": " ",
    "\u2009": " ",
    "\u202f": " ",
    "\u00b1": "\\pm ",
    "\u2213": "\\mp ",
    "\u2205": "\\emptyset ",
}
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))
# Vulgar fractions (`½`, `2¾`: a mixed number when digits come first) as `\frac`s; `\varnothing` is `\emptyset`
_VULGAR = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5), "⅗": (3, 5)}
_VULGAR |= {"⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅐": (1, 7), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8), "⅞": (7, 8)}
_VULGAR |= {"⅑": (1, 9), "⅒": (1, 10)}
_VULGAR_RE = re.compile(r"(?<![\d.])(\d{1,9})?\s*([" + "".join(_VULGAR) + "])")
_VARNOTHING_RE = re.compile(r"\\varnothing(?![A-Za-z])")
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
_PY_MODULE_RE = re.compile(
    r"(?<![\w\\])(?:np|numpy|math|sp|sympy)\.(arcsin|arccos|arctan|sinh|cosh|tanh|sin|cos|tan|exp|pi)\b"
)
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
    s = _VARNOTHING_RE.sub(r"\\emptyset ", _VULGAR_RE.sub(_vulgar_fraction, s)).strip()
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


def _vulgar_fraction(m: re.Match) -> str:
    num, den = _VULGAR[m.group(2)]
    whole = int(m.group(1)) if m.group(1) else 0
    return f"\\frac{{{whole * den + num}}}{{{den}}}"


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
        matches = [m for p in parts if (m := _LHS_RE.match(p))]
        names = {re.sub(r"\s+", "", m.group(1)) for m in matches}
        if (
            len(matches) == len(parts)
            and all(m.group(2) == "=" and m.group(3).strip() for m in matches)
            and len(names) == 1
        ):
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
        if m is None:  # a backslash at the end (or before a newline): no argument
            return None
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
    """(value, written_as_decimal) if `s` (normalised, no spaces) is a plain number, else None.

    Plain numbers: integers, decimals, `a/b`, `\\frac{a}{b}`, `1.5e3`, `1.5\\times10^{3}`, repeating decimals
    (`0.1\\overline{6}`), mixed numbers. An integer directly followed by `\\frac{p}{q}` with integers 0 < p < q is
    N + p/q (the MATH convention: `1\\frac{4}{5}`, `137 \\frac{1}{2}`); with p ≥ q it is the product
    (`3\\frac{5}{2}` = 15/2). Inside a larger expression latex2sympy's own rule applies (stage 3: an integer times
    a positive rational is mixed).
    """
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
        top, bottom = Fraction(m.group(1)), Fraction(m.group(2))
        return (top / bottom, "." in m.group(1).rstrip(".") or "." in m.group(2).rstrip(".")) if bottom else None
    if m := _NUM_REPEAT_RE.fullmatch(s):
        integer, fixed, block = m.group(2) or "0", m.group(3), m.group(4) or m.group(5)
        v = int(integer) + Fraction(int(fixed or "0"), 10 ** len(fixed))
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
    """Both forms of an answer: `_clean` (unicode, `\\$`, `\\left`/`\\right`, thin spaces, `\\dfrac`/`\\tfrac`,
    degrees, units after the value, thousands separators, trailing periods) keeps it parseable for latex2sympy;
    `_normalize_cleaned` (`\\text{…}` unwrapped, `\\%`, `\\frac12`/`\\sqrt2`, spaces, `x = ` prefixes) is the
    string compared in stage 1."""
    clean = _clean(answer)
    norm = _normalize_cleaned(clean)
    return _Prepared(clean, norm, _to_number(norm), "%" in clean)
