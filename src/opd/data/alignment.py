"""Re-templating a prompt set: strip the old instruction and apply another (boxed | dapo | custom), so that the
student is asked in the format the teacher answers in (DAPO-Math-17k's "Answer:" line vs Qwen's "\\boxed{}"), the
`template` step of `opd prompts` (`opd.recipes.prompts`). Scoring and selecting prompts by teacher alignment is
`opd.eval.prompt_scores`."""

from __future__ import annotations

from collections.abc import Sequence

from opd.data.templates import InstructionTemplate, apply_template, parse_template
from opd.types import Prompt


def retemplate(prompts: Sequence[Prompt], template: str | InstructionTemplate) -> list[Prompt]:
    """Copies of `prompts` whose last user message carries `template` (boxed | dapo | custom:"…{problem}…" | keep)
    instead of its old instruction: a known DAPO / boxed instruction is stripped first (`strip_template`), so the
    problem text, the answer, the id and `meta` are kept. Raises `ValueError` (one line) on an unknown template."""
    parsed = parse_template(template)
    return [apply_template(p, parsed) for p in prompts]
