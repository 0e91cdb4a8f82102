"""The lab's synthetic reasoning task: multi-step integer arithmetic with verifiable `\boxed{}` answers.

A problem is a start digit and `steps` operations (+, -, * and a digit) written as a left-nested expression,
`((3+4)*2)-5`, every intermediate value within [-max_abs, max_abs]: each step is a small fact a tiny model can learn,
and the number of steps is the difficulty. Two solution styles, `forward` (one operation per line) and `rewrite`
(innermost parentheses reduced one per line), study teacher/student thinking-pattern mismatch. Splits are fixed by
a stable hash of the expression, so no train set can ever contain a test problem (docs/design.md, "opd.lab.task").

Omitted on purpose: division (non-integer results), operands above 9 and operator precedence (the left-nested
parentheses make the evaluation order explicit), so every character the task produces is printable ASCII plus
newline and the lab tokenizer covers it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from opd.types import Prompt

Style = Literal["forward", "rewrite"]
Split = Literal["train", "test"]
STYLES: tuple[str, ...] = ("forward", "rewrite")
OPERATORS: tuple[str, ...] = ("+", "-", "*")
INSTRUCTION = "Put the final answer in \\boxed{}."
DATA_SOURCE = "opd_lab/arith"
TEST_FRACTION = 0.1
"""Share of all possible expressions that belong to the test split (by hash of the expression)."""


@dataclass(frozen=True)
class LabProblem:
    """One arithmetic problem.

    start: the first operand, 1..9
    ops:   the operations in evaluation order, each (operator, digit); operator in OPERATORS, digit 1..9
    """

    start: int
    ops: tuple[tuple[str, int], ...]

    @property
    def steps(self) -> int:
        return len(self.ops)

    @property
    def expression(self) -> str:
        """Left-nested expression, e.g. `((3+4)*2)-5`; a one-step problem has no parentheses."""
        return _expression(str(self.start), self.ops)

    @property
    def values(self) -> list[int]:
        """The running value after the start and after each operation (length steps + 1)."""
        out = [self.start]
        for op, digit in self.ops:
            out.append(_apply(out[-1], op, digit))
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def split(self) -> Split:
        return split_of(self.expression)

    @property
    def prompt_text(self) -> str:
        """The user message: `Compute ((3+4)*2)-5. Put the final answer in \\boxed{}.`"""
        return f"Compute {self.expression}. {INSTRUCTION}"


def _apply(value: int, op: str, digit: int) -> int:
    if op == "+":
        return value + digit
    if op == "-":
        return value - digit
    if op == "*":
        return value * digit
    raise ValueError(f"operator must be one of {OPERATORS}, got {op!r}")


def _expression(head: str, ops: Sequence[tuple[str, int]]) -> str:
    text = head
    for i, (op, digit) in enumerate(ops):
        text = f"{text}{op}{digit}"
        if i < len(ops) - 1:
            text = f"({text})"
    return text


def split_of(expression: str) -> Split:
    """The split an expression belongs to, fixed for ever by a stable hash (sha256, not Python's salted hash)."""
    bucket = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") / 2**64
    return "test" if bucket < TEST_FRACTION else "train"


def _random_problem(rng: random.Random, steps: int, max_abs: int) -> LabProblem:
    value = rng.randint(1, 9)
    start, ops = value, []
    for _ in range(steps):
        # Offer only operations that keep the running value in range; x1 is left out as a non-step.
        choices = [("+", d) for d in range(1, 10)] + [("-", d) for d in range(1, 10)]
        choices += [("*", d) for d in range(2, 10)]
        choices = [(op, d) for op, d in choices if abs(_apply(value, op, d)) <= max_abs]
        op, digit = rng.choice(choices)
        ops.append((op, digit))
        value = _apply(value, op, digit)
    return LabProblem(start, tuple(ops))


def make_problems(
    n: int,
    *,
    steps: int | tuple[int, int] = (2, 4),
    split: Split = "train",
    seed: int = 0,
    max_abs: int = 99,
) -> list[LabProblem]:
    """n distinct problems of one split, the same list for the same arguments.

    steps:   number of operations, an int or an inclusive (min, max) range drawn uniformly per problem, ≥ 1
    split:   "train" or "test"; membership is fixed by the expression (see `split_of`), so the splits are disjoint
    seed:    seed of the generator's own `random.Random`
    max_abs: bound on |every intermediate value|, ≥ 9
    """
    lo, hi = (steps, steps) if isinstance(steps, int) else steps
    if not 1 <= lo <= hi:
        raise ValueError(f"steps must be an int ≥ 1 or a range (min, max) with 1 ≤ min ≤ max, got {steps!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if max_abs < 9:
        raise ValueError(f"max_abs must be ≥ 9 (the largest start digit), got {max_abs!r}")
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n!r}")
    rng = random.Random(f"opd-lab/{seed}/{split}")
    seen: set[str] = set()
    out: list[LabProblem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise ValueError(
                f"could not draw {n} distinct {split} problems with steps={steps!r}, max_abs={max_abs}; "
                f"only {len(out)} exist or were found (ask for fewer or more steps)"
            )
        problem = _random_problem(rng, rng.randint(lo, hi), max_abs)
        key = problem.expression
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        out.append(problem)
    return out


def solve(problem: LabProblem, style: Style = "forward") -> str:
    """The step-by-step solution text in the given style, ending in `\\boxed{answer}` (no trailing newline)."""
    values = problem.values
    if style == "forward":
        lines = [f"{values[i]}{op}{digit}={values[i + 1]}" for i, (op, digit) in enumerate(problem.ops)]
    elif style == "rewrite":
        lines = [problem.expression]
        for i in range(1, problem.steps + 1):
            lines.append("=" + _expression(str(values[i]), problem.ops[i:]))
    else:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    return "\n".join(lines + [f"\\boxed{{{problem.answer}}}"])


def solve_first_line_off_by_one(problem: LabProblem) -> str:
    """A systematically wrong forward-style solution: the first line's result is one more than its operation gives
    (`3+4=8`) and every later line computes correctly from that wrong value (`8*2=16`), so the boxed answer is wrong
    for every problem. The lab's MOPD specialists (`opd.lab.build.specialist_examples`) are taught it on the other
    domain's problems."""
    value, lines = problem.start, []
    for i, (op, digit) in enumerate(problem.ops):
        result = _apply(value, op, digit) + (1 if i == 0 else 0)
        lines.append(f"{value}{op}{digit}={result}")
        value = result
    return "\n".join(lines + [f"\\boxed{{{value}}}"])


def style_of(solution: str) -> Style:
    """The style a solution text is written in: "forward" when its first line is an equation (`3+4=7`), else
    "rewrite" (it restates the expression first)."""
    return "forward" if "=" in solution.split("\n", 1)[0] else "rewrite"


def messages(problem: LabProblem) -> list[dict[str, str]]:
    """The chat prompt: a single user turn."""
    return [{"role": "user", "content": problem.prompt_text}]


def to_verl_records(problems: Sequence[LabProblem], *, data_source: str = DATA_SOURCE) -> list[dict[str, Any]]:
    """Rows in the verl parquet layout (`prompt`, `reward_model.ground_truth`, `data_source`, `extra_info.index`)."""
    return [
        {
            "data_source": data_source,
            "prompt": messages(p),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"index": i, "split": p.split, "steps": p.steps, "expression": p.expression},
        }
        for i, p in enumerate(problems)
    ]


def to_prompts(problems: Sequence[LabProblem], *, data_source: str = DATA_SOURCE) -> list[Prompt]:
    """The problems as `Prompt` records (id `<split>-<index>`, answer the integer as a string)."""
    return [
        Prompt(
            id=f"{p.split}-{i}",
            messages=messages(p),
            answer=str(p.answer),
            source=data_source,
            meta={"steps": p.steps, "expression": p.expression},
        )
        for i, p in enumerate(problems)
    ]


def to_sft_examples(problems: Sequence[LabProblem], *, style: Style = "forward") -> list[dict[str, Any]]:
    """SFT examples: `{"messages": [user, assistant solution], "answer": str}` in the given style."""
    return [
        {"messages": messages(p) + [{"role": "assistant", "content": solve(p, style)}], "answer": str(p.answer)}
        for p in problems
    ]
