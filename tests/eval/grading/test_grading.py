"""Tests for `opd.eval.grading`'s `grade`: a table of answer formats, benchmark self-consistency, garbage, model output
never evaluated. The answer extraction: test_extraction.py; deadlines, threads and worker processes: test_workers.py."""

import glob
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_grading import CASES
from opd.eval import grading
from opd.eval.grading import Grade, grade, is_equivalent

BENCHMARK_DIR = "/work/shared/data/benchmarks"


@pytest.mark.parametrize("answer, gold, expected", CASES)
def test_grade_table(answer, gold, expected):
    g = grade(f"Some reasoning... so the answer is $\\boxed{{{answer}}}$.", gold)
    assert g.correct is expected, g
    assert g.extracted == answer


# --- adversarial: a box that is not math is wrong unless it is, normalised, the ground truth itself
ADVERSARIAL_CASES = [
    ("12345 garbage)( 7", "7", False),
    (")( 7", "7", False),
    ("7)(", "7", False),
    ("7 garbage)(", "7", False),
    ("))))7", "7", False),
    ("def f(): return 7", "7", False),
    ("def f():\n    return 7", "7", False),
    ("import os; os.system('ls'); 7", "7", False),
    ("print(7)", "7", False),
    ("lambda: 7", "7", False),
    ("return 7", "7", False),
    ("x = 3; y = 4; x + y == 7", "7", False),
    ("for i in range(10): total += i; total = 7", "7", False),
    ("# python\nx = 7\nprint(x)", "7", False),
    ("\\frac{1}{2} garbage)( 7", "7", False),
    ("1, 2, 3, )( 7", "7", False),
    ("\\text{I don't know} )( 7", "7", False),
    ("2^{2^{2^{2^{10}}}} )( 7", "7", False),
    ("garbage)( = 3 = 7", "7", False),
    ("7, 8, 9", "7", False),
    ("7 \\text{ or } 8", "7", False),
    ("1,2,3,4,5,6,7", "7", False),
    ("[0, 10]", "7", False),
    ("7x", "7", False),
    ("7 7", "7", False),
    ("\\infty", "7", False),
    ("The answer is 7", "7", False),
    # positive controls: real math, or the very string of the ground truth
    ("12345 garbage)( 7", "12345 garbage)( 7", True),
    ("7 \\cdot 1", "7", True),
    ("70/10", "7", True),
    ("\\frac{14}{2}", "7", True),
    ("3 + 4", "7", True),
]

# --- the answer styles of the shipped benchmarks against equivalent forms a model writes
BENCHMARK_STYLE_CASES = [
    # Minerva: Python-style floats and calls, e-notation, trailing zeros, units in the question
    ("-\\frac{1}{3}", "-1./3", True),
    ("-1/3", "-1./3", True),
    ("\\frac{-1}{3}", "-1./3", True),
    ("-0.3333333", "-1./3", True),
    ("-0.33", "-1./3", False),
    ("\\frac{1}{3}", "-1./3", False),
    ("-\\frac{3}{2}", "-3./2", True),
    ("-1.5", "-3./2", True),
    ("1.5", "-3./2", False),
    ("\\arcsin(10/13)", "np.arcsin(10/13)", True),
    ("\\arcsin\\left(\\frac{10}{13}\\right)", "np.arcsin(10/13)", True),
    ("\\arccos(10/13)", "np.arcsin(10/13)", False),
    ("3.83 \\times 10^{35}", "3.83e35", True),
    ("3.83\\cdot10^{35}", "3.83e35", True),
    ("3.8 \\times 10^{35}", "3.83e35", False),
    ("2.7778 \\times 10^{-6}", "2.7778e-6", True),
    ("10^{-5}", "1e-5", True),
    ("0.00001", "1e-5", True),
    ("361", "3.61e2", True),
    ("0.065", "6.5e-2", True),
    ("56", "56.0", True),
    ("0.1", "0.10", True),
    ("2", "+2", True),
    ("24.31", "24.310", True),
    ("\\frac{e^{at}-e^{-at}}{2a}", "\\frac{1}{2a}(\\exp{a*t} - \\exp{-a*t})", True),
    ("\\frac{e^{at}+e^{-at}}{2}", "\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})", True),
    ("\\frac{e^{at}-e^{-at}}{2}", "\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})", False),
    (
        "x_0\\cos(\\omega t)+\\frac{\\dot{x}_0}{\\omega}\\sin(\\omega t)",
        "x_{0} \\cos (\\omega t)+$ $\\dot{x}_{0} \\sin (\\omega t) / \\omega",
        True,
    ),
    ("4.5 \\times 10^{33} \\mathrm{erg/s}", "4.5e33", True),
    ("41.8 \\mathrm{~nm}", "41.8", True),
    ("1.6 \\text{ km}", "1.6", True),
    ("9.6 \\mathrm{~s}", "9.6", True),
    ("\\frac{2\\pi}{\\omega}", "2 \\pi / \\omega", True),
    ("\\frac{\\pi}{\\omega}", "2 \\pi / \\omega", False),
    ("125-1.25P", "X_{d}=125-1.25 P", True),
    ("X_d = 125 - 1.25P", "X_{d}=125-1.25 P", True),
    ("\\frac{e^{t}}{3}", "e^{t} / 3", True),
    # OlympiadBench: `$…$` per element, named left-hand sides, degrees and percent in lists
    ("\\frac{1}{2n+2}", "$\\frac{1}{2 n+2}$", True),
    ("69, 84", "$69$,$84$", True),
    ("84, 69", "$69$,$84$", True),
    ("69", "$69$,$84$", False),
    ("1", "$k=1$", True),
    ("2", "$k=1$", False),
    ("2x", "$f(x)=2 x$", True),
    ("f(x) = 2x", "$f(x)=2 x$", True),
    ("n^2 - n - 1", "$m_{\\max }=n^{2}-n-1$", True),
    ("2^{N-2}+1", "$M=2^{N-2}+1$", True),
    ("\\frac{9}{32}\\sqrt{2}", "$M=\\frac{9}{32} \\sqrt{2}$", True),
    ("k+4", "$n=k+4$", True),
    ("k+5", "$n=k+4$", False),
    ("62.5\\%", "62.5%", True),
    ("8", "$8 \\%$", True),
    ("8\\%", "$8 \\%$", True),
    ("90, 60", "$90^{\\circ}$,$60^{\\circ}$", True),
    ("90^\\circ, 60^\\circ", "$90^{\\circ}$,$60^{\\circ}$", True),
    ("90, 45", "$90^{\\circ}$,$60^{\\circ}$", False),
    ("18.8", "$18.8^{\\circ}$", True),
    ("(-\\infty,0)\\cup\\{1\\}", "$(-\\infty, 0) \\cup\\{1\\}$.", True),
    ("(2+\\sqrt2, 1+\\sqrt2)", "$\\quad(2+\\sqrt{2}, 1+\\sqrt{2})$", True),
    ("2, -6-4\\sqrt{2}", "$a=2$, $a=-6-4 \\sqrt{2}$", True),
    ("2", "$a=2$, $a=-6-4 \\sqrt{2}$", False),
    ("\\lfloor \\frac{2n}{3} \\rfloor + 1", "$N(n)=\\left\\lfloor\\frac{2 n}{3}\\right\\rfloor+1$", True),
    ("1.68, 0.45", "$1.68,0.45$", True),
    ("7500, 2500", "2500,7500", True),
    ("k \\ge 2", "$k \\geqslant 2$", True),
    # MATH-500: mixed numbers, money, leading-dot decimals, degrees, choices, vectors, bases
    ("\\frac{9}{5}", "1\\frac{4}{5}", True),
    ("1.8", "1\\frac{4}{5}", True),
    ("\\frac{4}{5}", "1\\frac{4}{5}", False),
    ("\\frac{275}{2}", "137 \\frac{1}{2}", True),
    ("137.5", "137 \\frac{1}{2}", True),
    ("137", "137 \\frac{1}{2}", False),
    ("36", "\\$36", True),
    ("36 dollars", "\\$36", True),
    ("\\$36.00", "\\$36", True),
    ("36 \\text{ dollars}", "\\$36", True),
    ("6.72 \\times 10^{-5}", ".0000672", True),
    ("0.0000672", ".0000672", True),
    ("145", "145^\\circ", True),
    ("145 degrees", "145^\\circ", True),
    ("145^{\\circ}", "145^\\circ", True),
    ("\\frac{270}{7}^\\circ", "\\frac{270}7\\text{ degrees}", True),
    ("\\textbf{(C)}", "\\text{(C)}", True),
    ("\\text{C}", "\\text{(C)}", True),
    (
        "\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}",
        "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}",
        True,
    ),
    ("4210_5", "4210_{5}", True),
    ("10{,}080", "10,\\!080", True),
    ("\\$32,348", "\\$32,\\!348", True),
    ("864 \\text{ square inches}", "864 \\mbox{ inches}^2", True),
    ("2x+3", "y = 2x + 3", True),
    # AIME / AMC: integers, boxed ground truths
    ("204.0", "\\boxed{204}", True),
    ("\\text{204}", "\\boxed{204}", True),
    ("204 \\text{ ways}", "\\boxed{204}", True),
    ("2.04 \\times 10^2", "\\boxed{204}", True),
    ("0204", "\\boxed{204}", True),
    ("240", "\\boxed{204}", False),
    # a box holding an equation: right only as the reference's own form (a name = the value), never a false one
    ("7 = 3", "3", False),
    ("100 = 4", "4", False),
    ("2+2=5", "5", False),
    ("10 = 0", "\\boxed{0}", False),
    ("3 = 3", "3", False),
    ("3 = 3 + 1", "4", False),
    ("5 = x", "x = 5", False),
    ("x = 3", "3", True),
    ("k=5", "\\boxed{5}", True),
    ("y = 2x + 1", "y = 2x+1", True),
    ("x = 3", "x = 3", True),
    # a percent sign is not a unit to drop when the reference has none (0.5% of a probability 0.5 is wrong)
    ("0.5\\%", "0.5", False),
    ("12.5\\%", "0.125", True),
    ("0.25\\%", "0.25", False),
    ("50\\%", "0.5", True),
    ("0.5\\%", "0.5\\%", True),
    ("0.5%", "0.5\\%", True),
    ("0.005", "0.5\\%", True),
    ("0.5", "0.5\\%", True),
    # unicode a model writes: vulgar fractions (mixed numbers too) and the empty set
    ("\u00bd", "\\frac{1}{2}", True),
    ("\u00bc", "\\frac14", True),
    ("\u00be", "0.75", True),
    ("\u2153", "\\frac{1}{3}", True),
    ("2\u00bd", "\\frac{5}{2}", True),
    ("\u00bd", "\\frac{1}{3}", False),
    ("\\emptyset", "\\varnothing", True),
    ("\u2205", "\\varnothing", True),
    ("\\varnothing", "\\emptyset", True),
    ("\\varnothing", "\\{0\\}", False),
]

REPEATING_DECIMAL_CASES = [
    ("0.\\overline{3}", "\\frac13", True),
    ("0.\\overline{3}", "1/3", True),
    ("\\frac{1}{3}", "0.\\overline{3}", True),
    ("0.\\overline{6}", "\\frac23", True),
    ("0.1\\overline{6}", "\\frac16", True),
    ("0.\\overline{142857}", "\\frac17", True),
    ("1.\\overline{27}", "\\frac{14}{11}", True),
    ("0.\\overline{9}", "1", True),
    ("0.\\bar{3}", "\\frac13", True),
    ("0.\\dot{3}", "\\frac13", True),
    (".\\overline{3}", "\\frac13", True),
    ("-0.\\overline{3}", "-\\frac13", True),
    ("2.\\overline{5}", "\\frac{23}{9}", True),
    ("0.\\overline{12}", "\\frac{4}{33}", True),
    ("0.\\overline{3}", "0.3", False),
    ("0.\\overline{3}", "\\frac{3}{10}", False),
    ("0.\\overline{12}", "\\frac{12}{100}", False),
    ("0.1\\overline{6}", "\\frac{1}{6.5}", False),
]

# Rule: an integer directly followed by \frac{p}{q} with integers 0 < p < q is a mixed number (MATH writes
# `1\frac{4}{5}`, `137 \frac{1}{2}`); with p >= q it is a product (`3\frac{5}{2}` = 15/2).
MIXED_NUMBER_CASES = [
    ("2\\frac{1}{2}", "\\frac52", True),
    ("2\\frac12", "\\frac{5}{2}", True),
    ("2 \\frac{1}{2}", "2.5", True),
    ("2\\dfrac{1}{2}", "\\frac52", True),
    ("-2\\frac{1}{2}", "-\\frac{5}{2}", True),
    ("-2\\frac{1}{2}", "-\\frac{3}{2}", False),
    ("2\\frac{1}{2}", "1", False),
    ("2\\frac{1}{2}", "\\frac{1}{2}", False),
    ("\\frac{5}{2}", "2\\frac{1}{2}", True),
    ("3\\frac{3}{4}", "\\frac{15}{4}", True),
    ("3\\frac{3}{4}", "\\frac{9}{4}", False),
    ("10\\frac{2}{3}", "\\frac{32}{3}", True),
    ("5\\frac{1}{2}\\text{ inches}", "\\frac{11}{2}", True),
    ("3\\frac{5}{2}", "\\frac{15}{2}", True),
    ("3\\frac{5}{2}", "\\frac{11}{2}", False),
]

UNIT_CASES = [
    ("5\\mbox{cm}", "5", True),
    ("5 \\mathrm{cm}", "5", True),
    ("5\\,\\mathrm{cm}", "5", True),
    ("5\\ \\text{cm}^2", "5", True),
    ("5\\text{m}", "5", True),
    ("5 \\mathrm{kg}", "5", True),
    ("9.8 \\mathrm{m/s^2}", "9.8", True),
    ("9.8 \\mathrm{~m} / \\mathrm{s}^{2}", "9.8", True),
    ("3 \\times 10^{8} \\mathrm{~m/s}", "3e8", True),
    ("25^\\circ C", "25", True),
    ("25^{\\circ}\\mathrm{C}", "25", True),
    ("30 \\text{ percent}", "30", True),
    ("12 cm", "12", True),
    ("12 \\text{cm}", "12", True),
    ("100 dollars", "100", True),
    ("\\$100", "100", True),
    ("100 \\text{ dollars}", "\\$100", True),
    ("6 \\text{ apples}", "6", True),
    ("5 \\mathrm{cm}", "6", False),
    ("6m", "6", False),
    ("6 \\text{ apples}", "7", False),
    # number words
    ("5 thousand", "5000", True),
    ("5 \\text{ thousand}", "5000", True),
    ("2.5 million", "2500000", True),
    ("2.5 \\text{ million}", "2,500,000", True),
    ("3 billion", "3000000000", True),
    ("1.2 million dollars", "1200000", True),
    ("\\$1.2 million", "1200000", True),
    ("4 hundred", "400", True),
    ("5000", "5 \\text{ thousand}", True),
    ("5 thousand", "500", False),
    ("2.5 million", "2.5", False),
    # thousands separators followed by units
    ("1,000 meters", "1000", True),
    ("1,000 \\text{ meters}", "1000", True),
    ("1{,}000\\text{ m}", "1000", True),
    ("\\$1,000", "1000", True),
    ("\\$1,000.50", "1000.5", True),
    ("12,345 \\text{ cm}^2", "12345", True),
    ("1,000,000 dollars", "1000000", True),
    ("1,000\\,\\mathrm{km}", "1000", True),
    ("2,500 \\text{ students}", "2500", True),
    ("1,000 meters", "100", False),
    ("1,000 meters", "1", False),
]

PM_CASES = [
    ("1+\\sqrt{19}, 1-\\sqrt{19}", "1 \\pm \\sqrt{19}", True),
    ("1-\\sqrt{19}, 1+\\sqrt{19}", "1 \\pm \\sqrt{19}", True),
    ("\\{1-\\sqrt{19}, 1+\\sqrt{19}\\}", "1 \\pm \\sqrt{19}", True),
    ("x = 1 \\pm \\sqrt{19}", "1 \\pm \\sqrt{19}", True),
    ("1 \\mp \\sqrt{19}", "1 \\pm \\sqrt{19}", True),
    ("1 \\pm \\sqrt{19}", "1+\\sqrt{19}, 1-\\sqrt{19}", True),
    ("3+2\\sqrt2, 3-2\\sqrt2", "3 \\pm 2 \\sqrt{2}", True),
    ("3\\pm 2\\sqrt{2}", "3+2\\sqrt2, 3-2\\sqrt2", True),
    ("1+\\sqrt5, 1-\\sqrt5, -2", "\\{1\\pm\\sqrt{5},-2\\}", True),
    ("\\pm 2", "2, -2", True),
    ("\\pm 2", "-2,2", True),
    ("2, -2", "\\pm 2", True),
    ("x = \\pm 3", "3, -3", True),
    ("\\pm\\frac{1}{2}", "\\frac12, -\\frac12", True),
    ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}", False),
    ("1 \\pm \\sqrt{19}", "1 \\pm \\sqrt{20}", False),
    ("\\pm 2", "2", False),
    ("2", "\\pm 2", False),
    ("1+\\sqrt5, 1-\\sqrt5", "\\{1\\pm\\sqrt{5},-2\\}", False),
]

NAMED_LHS_CASES = [
    ("3", "k=3", True),
    ("3", "k = 3", True),
    ("4", "k=3", False),
    ("x = 5", "x = 5", True),
    ("5", "x_1 = 5", True),
    ("5", "a_{n} = 5", True),
    ("2x", "f(x) = 2x", True),
    ("f(x)=2x", "f(x) = 2x", True),
    ("n^2", "f(n)=n^{2}", True),
    ("n^2+1", "f(n)=n^{2}", False),
    ("n^2-n-1", "m_{\\max}=n^2-n-1", True),
    ("\\frac{1}{2}", "p = \\frac{1}{2}", True),
    ("0.5", "p = \\frac{1}{2}", True),
    ("0.6", "p = \\frac{1}{2}", False),
    ("\\frac{\\pi}{3}", "\\theta = \\frac{\\pi}{3}", True),
    ("60^\\circ", "\\theta = 60^\\circ", True),
    ("5x-7y+11z+4=0", "5x - 7y + 11z + 4 = 0", True),
    ("k=3", "3", True),
]

NEW_CASES = (
    ADVERSARIAL_CASES
    + BENCHMARK_STYLE_CASES
    + REPEATING_DECIMAL_CASES
    + MIXED_NUMBER_CASES
    + UNIT_CASES
    + PM_CASES
    + NAMED_LHS_CASES
)


@pytest.mark.parametrize("answer, gold, expected", NEW_CASES)
def test_grade_answer_styles_table(answer, gold, expected):
    g = grade(f"Some reasoning... so the answer is $\\boxed{{{answer}}}$.", gold)
    assert g.correct is expected, g


def test_box_that_is_not_math_is_wrong_and_says_so():
    assert grade("\\boxed{12345 garbage)( 7}", "7") == Grade(False, "12345 garbage)( 7", "not_math")
    assert grade("Answer: def f(): return 7", "7").reason == "not_math"
    # ... unless the whole box is, normalised, the ground truth itself
    assert grade("\\boxed{12345 garbage)( 7}", "12345  garbage)( 7").correct


def test_list_ground_truth_is_any_of():
    assert grade("\\boxed{2}", ["1", "2"]) == Grade(True, "2", "string")
    assert grade("\\boxed{0.5}", ("\\frac{1}{3}", "\\frac12")).correct
    assert not grade("\\boxed{3}", ["1", "2"]).correct
    assert not grade("\\boxed{3}", []).correct
    # a list is not the string of the list (the old "['1', '2']" bug)
    assert not grade("\\boxed{['1', '2']}", ["1", "2"]).correct


def _equivalent_forms(gt):
    """Forms a model writes for the reference answer `gt`, each equal to it by the conventions of its set."""
    forms = []
    s = gt.strip()
    inner = s[len("\\boxed{") : -1] if s.startswith("\\boxed{") and s.endswith("}") else s
    bare = inner.strip("$ .") if inner.count("$") == 2 and inner.startswith("$") else inner
    if bare != s:
        forms.append(bare)  # without `$…$` / `\boxed{}`
    if m := re.fullmatch(r"(-?)(\d+)\./(\d+)", bare):  # Minerva's Python floats: -1./3
        forms += [f"{m[1]}\\frac{{{m[2]}}}{{{m[3]}}}", f"{m[1]}{m[2]}/{m[3]}"]
    if m := re.fullmatch(r"(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)", bare):  # Minerva's e-notation
        forms += [f"{m[1]} \\times 10^{{{int(m[2])}}}", f"{m[1]}\\cdot10^{{{int(m[2])}}}"]
    if re.fullmatch(r"-?\d+", bare):
        forms += [f"{bare}.0", f"\\text{{{bare}}}", f"{bare} \\text{{ ways}}"]
    if re.fullmatch(r"-?\d*\.\d+", bare):
        forms.append(bare + "0")
    if m := re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", bare):
        forms += [
            f"{m[1]}{m[2]}/{m[3]}",
            f"{m[1]}\\dfrac{{{m[2]}}}{{{m[3]}}}",
            f"{m[1]}\\frac{{{2 * int(m[2])}}}{{{2 * int(m[3])}}}",
        ]
    if m := re.fullmatch(r"(\d+)\s*\\frac\{?(\d)\}?\{?(\d)\}?", bare):  # mixed number → improper fraction
        forms.append(f"\\frac{{{int(m[1]) * int(m[3]) + int(m[2])}}}{{{m[3]}}}")
    if m := re.fullmatch(r"(.+?)\s*\^\s*\{?\\circ\}?", bare):  # degrees
        forms += [m[1], f"{m[1]}^{{\\circ}}", f"{m[1]} degrees"]
    if m := re.fullmatch(r"\\text\{\(([A-E])\)\}", bare):  # multiple choice
        forms += [m[1], f"({m[1]})", f"\\textbf{{({m[1]})}}"]
    if m := re.fullmatch(r"\\\$(\d+(?:\.\d\d)?)", bare):  # money
        forms += [m[1], f"{m[1]} dollars"]
    if m := re.fullmatch(r"x \\in (.+)", bare):
        forms.append(m[1])
    if m := re.fullmatch(r"([a-zA-Z])\s*=\s*([^=,]+)", bare):  # a named left-hand side
        forms.append(m[2])
    if m := re.fullmatch(r"([^,]+?)\s*\\pm\s*([^,]+)", bare):  # ± as the two-element set
        forms.append(f"{m[1]} + {m[2]}, {m[1]} - {m[2]}")
    if "," in bare and re.fullmatch(r"[-\d,\s]+", bare) and not re.fullmatch(r"\d{1,3}(?:,\d{3})+", bare):
        forms.append(", ".join(reversed([p.strip() for p in bare.split(",")])))
    if m := re.fullmatch(r"(\d+)\s*\\mbox\{\s*(\w+)\}\^2", bare):
        forms += [m[1], f"{m[1]} \\text{{ square {m[2]}}}"]
    return [f for f in dict.fromkeys(forms) if f != gt]


def _shipped_ground_truths():
    pq = pytest.importorskip("pyarrow.parquet")
    from opd.eval.benchmarks import BENCHMARKS, benchmark_path

    return [
        (name, rm["ground_truth"])
        for name in BENCHMARKS
        for rm in pq.read_table(benchmark_path(name), columns=["reward_model"]).column("reward_model").to_pylist()
    ]


def test_every_shipped_reference_answer_matches_its_equivalent_forms():
    pairs = [(name, form, gt) for name, gt in _shipped_ground_truths() for form in _equivalent_forms(gt)]
    assert len(pairs) > 3000 and {name for name, _, _ in pairs} == {
        "aime24",
        "aime25",
        "amc23",
        "math500",
        "minerva",
        "olympiadbench",
    }
    failures = [(name, form, gt) for name, form, gt in pairs if not grade(f"\\boxed{{{form}}}", gt).correct]
    assert failures == []


def test_grade_reports_reason_and_extracted():
    assert grade("I give up", "5") == Grade(False, None, "no_answer")
    assert grade("\\boxed{5}", "5") == Grade(True, "5", "string")
    assert grade("\\boxed{0.5}", "\\frac{1}{2}").reason == "numeric"
    assert grade("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}").reason == "symbolic"
    assert grade("Answer: 12", "\\boxed{12}").correct
    # timeout <= 0 skips the symbolic stage
    assert not grade("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", timeout=0).correct


def test_answer_key_groups_equivalent_numbers():
    keys = {grading.answer_key(a) for a in ["0.5", "\\frac12", "1/2", "\\dfrac{1}{2}", "$\\frac{1}{2}$"]}
    assert keys == {"1/2"}
    assert grading.answer_key("x = 3") == grading.answer_key("3") == "3"
    assert grading.answer_key("\\text{Evelyn}") == "Evelyn"
    assert grading.normalize_answer("\\left( 3, \\frac{\\pi}{2} \\right)") == "(3,\\frac{\\pi}{2})"


def _benchmark_ground_truths():
    pq = pytest.importorskip("pyarrow.parquet")
    paths = sorted(glob.glob(os.path.join(BENCHMARK_DIR, "*.parquet")))
    if not paths:
        pytest.skip(f"no benchmark parquet files in {BENCHMARK_DIR}")
    out = []
    for path in paths:
        for rm in pq.read_table(path, columns=["reward_model"]).column("reward_model").to_pylist():
            out.append((os.path.basename(path), rm["ground_truth"]))
    return out


def test_every_benchmark_answer_grades_correct_against_itself():
    gts = _benchmark_ground_truths()
    assert len(gts) > 1000
    # symbolic stage off: an answer must match itself by normalised string alone (fast and exact)
    failures = [(src, gt) for src, gt in gts if not grade(f"\\boxed{{{gt}}}", gt, timeout=0).correct]
    assert failures == []


def test_every_benchmark_answer_survives_harmless_rewriting():
    # `$…$.` around it, `\dfrac` for `\frac`, a space after each comma: still equal by string alone
    def rewrite(gt):
        return "$" + re.sub(r"(?<!\\)\$", "", gt).replace("\\frac", "\\dfrac").replace(",", ", ") + "$."

    gts = [gt for _, gt in _benchmark_ground_truths()]
    failures = [gt for gt in gts if not grade(f"\\boxed{{{rewrite(gt)}}}", gt, timeout=0).correct]
    assert failures == []


def test_benchmark_answers_unwrap_boxed_ground_truth():
    for _, gt in _benchmark_ground_truths():
        if gt.startswith("\\boxed{"):
            inner = gt[len("\\boxed{") : -1]
            assert grade(f"Answer: {inner}", gt, timeout=0).correct, gt


def test_integer_grading_never_reaches_sympy():
    # what makes it fast (~30k grades/s, benchmarks/grading_latency.py): stages 1-2 decide every integer pair
    reasoning = "Let me think step by step. " * 40
    before = grading._STATS["symbolic"]
    for i in range(2000):
        assert grade(f"{reasoning} so \\boxed{{{i}}}", str(i)).correct
        assert not grade(f"{reasoning} so \\boxed{{{i + 1}}}", str(i)).correct
    assert grading._STATS["symbolic"] == before


GARBAGE = [
    ("", ""),
    ("", "5"),
    ("\\boxed{5}", ""),
    ("\\boxed{", "1"),
    ("\\boxed{{{{", "1"),
    ("}}}\\boxed{1}}}", "1"),
    ("\\boxed{\\frac{", "1"),
    ("\\boxed{\\frac{}{}}", "1"),
    ("\\boxed{)(][}", "1"),
    ("\\boxed{\\left(}", "(1,2)"),
    ("\\boxed{1/0}", "1"),
    ("\\boxed{0/0}", "0"),
    ("\\boxed{\\frac{1}{0}}", "\\infty"),
    ("\\boxed{$}", "$"),
    ("\\boxed{\\\\}", "\\"),
    ("\\boxed{1e99999}", "1"),
    ("\\boxed{" + "(" * 400 + "1" + ")" * 400 + "}", "1"),
    ("\\boxed{\ud800\U0001f600\u0000}", "\u00e9"),
    ("Answer: " + "\u202e" * 50, "1"),
    ("\\boxed{" * 20000, "1"),
    ("blah " * 20000, "1"),
    ("\\boxed{" + "1+" * 50000 + "1}", "1"),
    ("\\boxed{1}" * 10000, "1"),
    ("{" * 50000 + "\\boxed{2}" + "}" * 50000, "2"),
]


@pytest.mark.parametrize("response, gold", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_never_raises(response, gold):
    g = grade(response, gold, timeout=1.0)
    assert isinstance(g, Grade) and isinstance(g.correct, bool)
    if len(response) > 2 * grading.MAX_ANSWER_CHARS:  # long inputs never reach sympy
        assert g.reason in {"too_long", "no_answer", "string", "numeric", "empty", "not_math"}, g


def test_non_string_inputs_do_not_raise():
    assert not grade(None, "1").correct  # type: ignore[arg-type]
    assert not grade("\\boxed{1}", None).correct  # type: ignore[arg-type]
    assert not is_equivalent(None, "1")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400), st.text(max_size=40))
def test_random_text_never_raises(response, gold):
    assert isinstance(grade(response, gold, timeout=0.5), Grade)


LATEX_ALPHABET = list("0123456789+-*/^_()[]{},.=x ") + [
    "\\frac",
    "\\sqrt",
    "\\pi",
    "\\infty",
    "\\cup",
    "\\left(",
    "\\right)",
]
LATEX_TEXT = st.lists(st.sampled_from(LATEX_ALPHABET), max_size=25).map("".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LATEX_TEXT, st.sampled_from(["1", "(1,2)", "x+1", "[0,1)"]))
def test_random_latex_never_raises(answer, gold):
    assert isinstance(grade(f"\\boxed{{{answer}}}", gold, timeout=0.5), Grade)


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**12), 10**12), st.integers(-(10**12), 10**12))
def test_integers_equal_iff_same_value(a, b):
    assert is_equivalent(str(a), str(b)) == (a == b)
    assert is_equivalent(f"{a:,}", str(a))


@settings(max_examples=200, deadline=None)
@given(st.integers(-1000, 1000), st.integers(1, 1000))
def test_fraction_forms_agree(p, q):
    assert is_equivalent(f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}")
    assert is_equivalent(f"\\dfrac{{{p}}}{{{q}}}", f"\\frac{{{2 * p}}}{{{2 * q}}}")
    assert is_equivalent(repr(p / q), f"\\frac{{{p}}}{{{q}}}") or abs(p / q) < 1e-3


def test_grading_never_evals_model_output(monkeypatch):
    import builtins

    grade("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt2}")  # imports first: importing a module execs its code
    grading._verdicts.clear()
    grading._parse.cache_clear()
    calls = []
    real_eval, real_exec = builtins.eval, builtins.exec
    monkeypatch.setattr(builtins, "eval", lambda *a, **k: calls.append(("eval", a[0])) or real_eval(*a, **k))
    monkeypatch.setattr(builtins, "exec", lambda *a, **k: calls.append(("exec", a[0])) or real_exec(*a, **k))
    canaries = [
        ("\\sqrt{86753^{2}}", "86753"),
        ("86753 + zq", "zq + 86753"),
        ("86753.5 \\cdot 2", "173507"),
        ("__import__('os').system('echo 86753')", "0"),
        ("86753*2", "173506"),
    ]
    for answer, gold, _ in CASES + NEW_CASES:
        grade(f"\\boxed{{{answer}}}", gold)
    for answer, gold in canaries:
        grade(f"\\boxed{{{answer}}}", gold)
        grade(f"Answer: {answer}", gold)
    monkeypatch.undo()
    assert grading._STATS["symbolic"] > 0
    # sympy evals some strings of its own (unit prefixes on first use, templates); never a piece of an answer
    # (latex2sympy's numbers are built without sympify, math-verify's parse_expr extraction is not used)
    assert not [c for c in calls if any(mark in str(c[1]) for mark in ("86753", "zq", "__import__"))]
