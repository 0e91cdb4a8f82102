"""Stages 2 and 3 of grading: plain numbers compared as exact fractions, anything else by sympy under a deadline.

The symbolic stage parses the *whole* cleaned answer with latex2sympy and compares with `math_verify.verify`; an
answer that does not parse as a whole is wrong ("not_math") unless stage 1 matched it. Verdicts, timeouts
included, are cached per (answer, ground truth), so a pathological pair costs its budget once per process; a
cached timeout is retried only with a larger budget. The deadline is our own (math-verify's `signal.alarm` is whole
seconds and main thread only; it is off): a `signal.setitimer` alarm in the main thread, a grading worker
(`opd.eval.grading.workers`) in any other thread.

Omitted: executing or `eval`-ing model output (SPEC §7: math-verify's `ExprExtractionConfig`, which hands text to
sympy's `parse_expr`, is not used); Minerva's ±1 % numeric tolerance (the reference recipe grades with math-verify,
which does not have it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from fractions import Fraction
from functools import lru_cache

from opd.eval.grading.extraction import MAX_ANSWER_CHARS
from opd.eval.grading.normalise import _prepare, _Prepared
from opd.eval.grading.workers import _STATS, _pool

_TOL = Fraction(1, 10**6)  # stage 2: relative and absolute
_ALARM_REPEAT_S = 0.05


def _numbers_equal(p: _Prepared, g: _Prepared) -> bool:
    """Exact as `Fraction`s; if either side was written as a decimal they may differ by `_TOL`, relative and
    absolute (`0.333333` = `1/3`, but `1000000.5` ≠ `1000000`). math-verify instead rounds to 6 decimal places,
    which would equate Minerva's `7.4e-12` and `7.5e-12`. No sympy here: stage 2 is what makes integers cheap."""
    (pv, p_dec), (gv, g_dec) = p.number, g.number  # type: ignore[misc]
    # A reference's `50\%` may be answered 50 or 0.5, as in math-verify. An answer's percent sign is not a unit to
    # drop when the reference has none: `0.5\%` is 0.005, not the 0.5 of a probability. Only a reference of at least
    # 1 (`50` to "what percent …?", MATH's style) is also met by its own number with a sign (`50\%`).
    pvs = (pv,) if not p.percent or g.percent else ((pv / 100, pv) if gv >= 1 else (pv / 100,))
    gvs = (gv, gv / 100) if g.percent else (gv,)
    inexact = p_dec or g_dec
    return any(a == b or (inexact and abs(a - b) <= _TOL * min(1, max(abs(a), abs(b)))) for a in pvs for b in gvs)


def _compare(pred: str, gold: str, deadline: tuple[float, float] | None) -> tuple[bool, str]:
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False, "error: not a string"
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return (pred.strip() == gold.strip() and bool(gold.strip())), "too_long"
    p, g = _prepare(pred), _prepare(gold)
    if not p.norm or not g.norm:
        return False, "empty"
    if "=" in p.clean and "=" not in g.clean:  # named left-hand sides are gone: `7 = 3` is not the answer 3
        return False, "equation"
    if p.norm == g.norm and (g.percent or not p.percent or (g.number is not None and g.number[0] >= 1)):
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
        return latex2sympy(
            text, is_real=not should_treat_as_complex(text), convert_degrees=False, normalization_config=None
        )

    return parse, verify


_NOT_MATH = object()
_FLOAT_TOKEN_RE = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


@lru_cache(maxsize=1 << 14)
def _parse(answer: str):
    """The whole answer as one sympy object, or `_NOT_MATH` when it does not parse as a whole.

    Not `math_verify.parse`: its extraction regexes search inside the string, so a box that is not math
    (`12345 garbage)( 7`, Python code ending in `7`) would be read as its last number. `\\pm` answers parse as the
    two-element set they stand for (`1 \\pm \\sqrt{19}` = `1+\\sqrt{19}, 1-\\sqrt{19}`).
    """
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

    The alarm is re-armed every `_ALARM_REPEAT_S` until we leave, and `_Deadline` is a `BaseException`, so a
    broad `except Exception` inside sympy/latex2sympy cannot swallow it.

    Raises ValueError where signals cannot be used (not the main thread; a SIGALRM handler installed
    from C, which we could not restore).
    """
    if signal.getsignal(signal.SIGALRM) is None:
        raise ValueError("SIGALRM handler not installed from Python")
    armed, reporting = True, False

    def on_alarm(signum, frame):
        if armed and not reporting:
            raise _Deadline()

    def on_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
        # An alarm landing in a finalizer (__del__, a weakref callback) is reported here instead of raised. Such a
        # `_Deadline` is dropped: the repeating alarm raises it again in `fn`. Anything else goes to the old hook
        # with the alarm held off, which would otherwise break that hook mid-report (pytest's, in an import).
        nonlocal reporting
        reporting = True
        try:
            if not isinstance(unraisable.exc_value, _Deadline):
                old_unraisable(unraisable)
        finally:
            reporting = False

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)  # raises ValueError outside the main thread
    old_unraisable, sys.unraisablehook = sys.unraisablehook, on_unraisable
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
        sys.unraisablehook = old_unraisable
        if old_delay > 0:  # someone else's alarm (e.g. pytest-timeout): give back what is left
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3), old_interval)


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
