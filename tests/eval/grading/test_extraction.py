"""`opd.eval.grading.extract_answer`: the answer a response gives (the last box, an `Answer:` line)."""

import pytest

from opd.eval.grading import extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{3} and finally \\boxed{4}.", "4"),
        ("$\\boxed{\\frac{1}{\\sqrt{2}}}$", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),
        ("\\fbox{7}", "7"),
        ("the answer is $\\boxed 5$.", "5"),
        ("\\boxed{3} then a truncated \\boxed{4", "3"),
        ("\\boxed{}", None),
        ("\\boxed{3} \\boxed{ }", "3"),
        ("\\boxed{\\boxed{12}}", "12"),
        ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("\\boxedfoo{3}", None),
        ("Work.\nAnswer: 42", "42"),
        ("Answer: 1\nmore work\nAnswer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("**Answer:** 17.", "17"),
        ("Final Answer: The final answer is $8$. I hope it is correct.", "8"),
        ("Answer: \\boxed{5} is boxed", "5"),
        ("no answer here", None),
        ("", None),
        ("Answer:", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected
