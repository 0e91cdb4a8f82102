"""`preflight`: what `opd distill` runs at startup on its loaded models, the tokenizers, scoring and resources groups
of `opd check` (the forecast needs rollouts of a whole prompt sample: run `opd check` for it). A failed hard row
stops the run with a one-line ValueError unless skipped (`skip_checks`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from opd.check.report import PREFLIGHT_GROUPS, CheckReport, resolve_skips, skipped_rows
from opd.check.resources import check_memory, check_step_time, estimate_memory, loaded_bytes, mini_step
from opd.check.scoring import (
    ViewProbe,
    check_generation_scoring,
    check_served_scores,
    check_teacher_views,
    generation_check_tokens,
    scoring_rows,
)
from opd.check.tokenizers import check_tokenizers
from opd.config import DistillConfig
from opd.models import eos_token_ids, on_device
from opd.objectives.diagnostics import diagnostic_top_k
from opd.train.common import autocast


def preflight(
    config: DistillConfig,
    *,
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    student: torch.nn.Module,
    teacher: torch.nn.Module | None,
    student_scorer: Any,
    teacher_scorer: Any,
    generator: Any,
    prompts: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    vocab_size: int,
    autocast_dtype: torch.dtype | None,
    world_size: int = 1,
    console: Any = None,
    views: Sequence[ViewProbe] = (),
    teachers: Sequence[tuple[str, torch.nn.Module, bool]] | None = None,
) -> CheckReport:
    """What `opd distill` runs at startup, on the loaded models (before the first step, the optimizer and layer
    compilation): the tokenizers, scoring and resources groups, minus `config.skip_checks`. Raises ValueError
    (one line: the failed rows, their fix, how to skip) on a hard failure. With several processes the rows that
    run the (sharded) student are left out: prompt_logprobs, step_time and generation_scoring. `views`: one probe
    per teacher with a view (`teacher_view`). `teachers`: every in-process teacher (name, module, offloaded) of a
    run with several, for the memory row (`estimate_memory`)."""
    skip = resolve_skips(config.skip_checks)
    # an offloaded teacher scores on the student's device, as in training (memory is estimated with it offloaded)
    scoring_device = next(student.parameters()).device if config.teacher_offload else None
    if world_size > 1:
        skip |= {"prompt_logprobs", "step_time", "generation_scoring"}
    report = CheckReport()
    start = time.perf_counter()
    if teacher is not None:
        rows = check_tokenizers(
            student_tokenizer,
            teacher_tokenizer,
            messages=prompts[0].messages,
            enable_thinking=config.data.enable_thinking,
            student_rows=student.get_output_embeddings().weight.shape[0],
            teacher_rows=teacher.get_output_embeddings().weight.shape[0],
            student_eos_ids=eos_token_ids(student, student_tokenizer),
            teacher_eos_ids=eos_token_ids(teacher, teacher_tokenizer),
        )
        report.results += [r for r in rows if r.name not in skip]
        with on_device(teacher, scoring_device):
            report.results += scoring_rows(
                config,
                teacher=teacher,
                tokenizer=student_tokenizer,
                student_scorer=student_scorer,
                teacher_scorer=teacher_scorer,
                prompt_ids=prompt_ids,
                vocab_size=vocab_size,
                student_params=sum(p.numel() for p in student.parameters()),
                skip=skip,
                rows=2,
                max_new_tokens=128,
                autocast_dtype=autocast_dtype,
            )
    elif teacher_scorer is not None and "served_scores" not in skip:  # a served or vLLM teacher: no module here
        report.results.append(
            check_served_scores(
                teacher_scorer,
                prompt_ids,
                temperature=config.objective.teacher_temperature,
                top_k=diagnostic_top_k(config.objective.top_k),
                vocab_rows=vocab_size,
                pad_id=student_tokenizer.pad_token_id,
            )
        )
    if "generation_scoring" not in skip:
        device = next(student.parameters()).device
        with autocast(device, autocast_dtype):
            report.results.append(
                check_generation_scoring(
                    generator,
                    student_scorer,
                    prompt_ids,
                    temperature=config.rollout.temperature,
                    max_new_tokens=generation_check_tokens(student, config.rollout.max_new_tokens),
                    seed=config.run.seed,
                    pad_id=student_tokenizer.pad_token_id,
                    device=device,
                    dtype=autocast_dtype or next(student.parameters()).dtype,
                )
            )
    if views and "teacher_view" not in skip:
        report.results.append(check_teacher_views(views, pad_id=student_tokenizer.pad_token_id))
    if "memory" not in skip:
        needs = estimate_memory(
            config,
            student,
            teacher,
            compute_dtype=autocast_dtype or next(student.parameters()).dtype,
            teachers=teachers,
        )
        modules = [teacher] if teachers is None else [module for _, module, _ in teachers]
        report.results.append(check_memory(needs, loaded=loaded_bytes(student, *modules)))
    if "step_time" not in skip:
        with on_device(teacher, scoring_device):
            timings = mini_step(
                config,
                generator=generator,
                student=student,
                student_scorer=student_scorer,
                teacher_scorer=teacher_scorer,
                prompt_ids=prompt_ids,
                pad_id=student_tokenizer.pad_token_id,
                vocab_size=vocab_size,
                autocast_dtype=autocast_dtype,
                prompts=1,
            )
        report.results.append(check_step_time(config, timings))
    report.results += skipped_rows(skip, PREFLIGHT_GROUPS)
    report.values["seconds"] = round(time.perf_counter() - start, 2)
    if console is not None:
        console.print(
            f"opd check (preflight, {report.values['seconds']} s): "
            + ", ".join(f"{r.name} {r.status}" for r in report.results if r.status != "skip")
        )
    failed = report.hard_failures
    if failed:
        raise ValueError(
            "opd check: "
            + " | ".join(f"{r.name} failed ({r.detail}); fix: {r.fix}" for r in failed)
            + f" — to run anyway pass --skip-check {failed[0].name} (skip_checks)"
        )
    return report
