"""`preflight`: what `opd distill` runs at startup on its loaded models, the tokenizers, scoring and resources groups
of `opd check` (the forecast needs rollouts of a whole prompt sample: run `opd check` for it). A failed hard row
stops the run with a one-line ValueError unless skipped (`skip_checks`).

With several teachers the scoring rows and step_time run once per teacher (`ScoringProbe`), each on the first prompts
routed to it as it sees them, and the tokenizer rows once per in-process teacher model (`TokenizerProbe`), all named
`row[teacher]`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from opd.check.report import PREFLIGHT_GROUPS, CheckReport, CheckResult, resolve_skips, skipped_rows
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
from opd.models import eos_token_ids, rows_and_eos_from_files
from opd.objectives.diagnostics import diagnostic_top_k
from opd.train.common import autocast


@dataclass(frozen=True)
class ScoringProbe:
    """One teacher for the startup scoring rows and step_time. name: None for the run's only teacher (its rows keep
    their plain names), else the teacher's (rows `determinism[name]`, …); module: its in-process model (None: served,
    vLLM or the live student, checked through `served_scores`); scorer and temperature: as the run scores with it;
    prompts: indices of its first routed prompts into the run's prompt set, `student_prompt_ids` their ids as the
    student sees them and `prompt_ids` as this teacher does (its view); placed: the context it scores in
    (offloaded: moved in; the live student: autocast, no grad)."""

    name: str | None
    module: torch.nn.Module | None
    scorer: Any
    temperature: float
    prompts: list[int]
    student_prompt_ids: list[list[int]]
    prompt_ids: list[list[int]]
    placed: Callable[[], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class TokenizerProbe:
    """One teacher model for the startup tokenizer rows. name: None for the run's only teacher (plain row names),
    else the teacher's (`chat_template[name]`, …); tokenizer: its own; rows and eos_ids: its output rows and every EOS
    id it stops on (`of_module`, or from its files for a teacher outside this process: `opd.models`)."""

    name: str | None
    tokenizer: Any
    rows: int | None
    eos_ids: list[int]

    @classmethod
    def of_module(cls, name: str | None, tokenizer: Any, module: torch.nn.Module) -> TokenizerProbe:
        rows = int(cast(Any, module).get_output_embeddings().weight.shape[0])
        return cls(name, tokenizer, rows, eos_token_ids(module, tokenizer))

    @classmethod
    def of_files(cls, name: str | None, tokenizer: Any, path: str, trust_remote_code: bool = False) -> TokenizerProbe:
        rows, eos_ids = rows_and_eos_from_files(path, tokenizer, trust_remote_code=trust_remote_code)
        return cls(name, tokenizer, rows, eos_ids)


def _at_temperature(config: DistillConfig, temperature: float) -> DistillConfig:
    """`config` with the teacher temperature of one teacher (the scoring rows and mini_step read it there)."""
    if temperature == config.objective.teacher_temperature:
        return config
    return config.model_copy(
        update={"objective": config.objective.model_copy(update={"teacher_temperature": temperature})}
    )


def _named(rows: list[CheckResult], name: str | None) -> list[CheckResult]:
    """One teacher's rows named after it when the run has several (`row[teacher]`; name None: its only one)."""
    if name is None:
        return rows
    return [dataclasses.replace(r, name=f"{r.name}[{name}]") for r in rows]


def preflight(
    config: DistillConfig,
    *,
    student_tokenizer: Any,
    student: torch.nn.Module,
    student_scorer: Any,
    generator: Any,
    prompts: Sequence[Any],
    prompt_ids: Sequence[Sequence[int]],
    vocab_size: int,
    autocast_dtype: torch.dtype | None,
    world_size: int = 1,
    console: Any = None,
    views: Sequence[ViewProbe] = (),
    teachers: Sequence[tuple[str, torch.nn.Module, bool]] = (),
    scoring: Sequence[ScoringProbe] = (),
    tokenizers: Sequence[TokenizerProbe] = (),
    cross_rows: Sequence[CheckResult] = (),
) -> CheckReport:
    """What `opd distill` runs at startup, on the loaded models (before the first step, the optimizer and layer
    compilation): the tokenizers, scoring and resources groups, minus `config.skip_checks`. Raises ValueError
    (one line: the failed rows, their fix, how to skip) on a hard failure. With several processes the rows that
    run the (sharded) student are left out: prompt_logprobs, step_time and generation_scoring. `views`: one probe
    per teacher with a view (`teacher_view`). `teachers`: every in-process teacher (name, module, offloaded), for
    the memory row (`estimate_memory`). `scoring`: one probe per teacher for the scoring rows and step_time (none:
    no teacher, e.g. GRPO). `tokenizers`: one probe
    per teacher model for the tokenizer rows (none: no teacher model to compare, e.g. a served one). `cross_rows`:
    the `cross_tokenizer` rows of the teachers of another vocabulary (`opd.check.probes.cross_rows`)."""
    skip = resolve_skips(config.skip_checks)
    if world_size > 1:
        skip |= {"prompt_logprobs", "step_time", "generation_scoring"}
    report = CheckReport()
    start = time.perf_counter()
    report.results += [r for r in cross_rows if r.name.partition("[")[0] not in skip]
    for tokenizer_probe in tokenizers:
        rows = _tokenizer_rows(config, tokenizer_probe, student_tokenizer, student, prompts[0].messages)
        report.results += _named([r for r in rows if r.name not in skip], tokenizer_probe.name)
    for probe in scoring:
        report.results += _named(
            _probe_rows(config, probe, student_tokenizer, student_scorer, student, vocab_size, skip, autocast_dtype),
            probe.name,
        )
    report.values["scoring_prompts"] = {probe.name or "teacher": probe.prompts for probe in scoring}
    if "generation_scoring" not in skip:
        report.results.append(
            _generation_row(config, generator, student, student_scorer, prompt_ids, student_tokenizer, autocast_dtype)
        )
    if views and "teacher_view" not in skip:
        report.results.append(check_teacher_views(views, pad_id=student_tokenizer.pad_token_id))
    if "memory" not in skip:
        report.results.append(_memory_row(config, student, teachers, autocast_dtype))
    if "step_time" not in skip:
        # without a teacher (objective grpo) the mini-step has nothing to score with
        for timed_probe in cast(list[ScoringProbe | None], list(scoring)) or [None]:
            row = _step_time_row(
                config,
                timed_probe,
                generator,
                student,
                student_scorer,
                prompt_ids,
                student_tokenizer,
                vocab_size,
                autocast_dtype,
            )
            report.results += [row] if timed_probe is None else _named([row], timed_probe.name)
    report.results += skipped_rows(skip, PREFLIGHT_GROUPS)
    report.values["seconds"] = round(time.perf_counter() - start, 2)
    _print_and_raise(report, console)
    return report


def _memory_row(
    config: DistillConfig,
    student: torch.nn.Module,
    teachers: Sequence[tuple[str, torch.nn.Module, bool]],
    autocast_dtype: torch.dtype | None,
) -> CheckResult:
    """The memory row: what training needs (`estimate_memory`) against what is free, the loaded models counted."""
    needs = estimate_memory(
        config, student, None, compute_dtype=autocast_dtype or next(student.parameters()).dtype, teachers=teachers
    )
    modules = [module for _, module, _ in teachers]
    return check_memory(needs, loaded=loaded_bytes(student, *modules))


def _generation_row(
    config: DistillConfig,
    generator: Any,
    student: torch.nn.Module,
    student_scorer: Any,
    prompt_ids: Sequence[Sequence[int]],
    student_tokenizer: Any,
    autocast_dtype: torch.dtype | None,
) -> CheckResult:
    """The generation_scoring row: the engine's log-probs against the student's scores of the same tokens."""
    device = next(student.parameters()).device
    with autocast(device, autocast_dtype):
        return check_generation_scoring(
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


def _step_time_row(
    config: DistillConfig,
    probe: ScoringProbe | None,
    generator: Any,
    student: torch.nn.Module,
    student_scorer: Any,
    prompt_ids: Sequence[Sequence[int]],
    student_tokenizer: Any,
    vocab_size: int,
    autocast_dtype: torch.dtype | None,
) -> CheckResult:
    """One step_time row (unnamed): a mini-step scored by the probe's teacher in its context; None: no teacher."""
    with probe.placed() if probe is not None else contextlib.nullcontext():
        timings = mini_step(
            config if probe is None else _at_temperature(config, probe.temperature),
            generator=generator,
            student=student,
            student_scorer=student_scorer,
            teacher_scorer=None if probe is None else probe.scorer,
            prompt_ids=prompt_ids if probe is None else probe.student_prompt_ids,
            pad_id=student_tokenizer.pad_token_id,
            vocab_size=vocab_size,
            autocast_dtype=autocast_dtype,
            prompts=1,
        )
    return check_step_time(config, timings)


def _print_and_raise(report: CheckReport, console: Any) -> None:
    """The preflight's one line on the console; a ValueError naming the hard failures, their fix and the skip."""
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
            + f" — to run anyway pass --skip-check {failed[0].check} (skip_checks)"
        )


def _tokenizer_rows(
    config: DistillConfig, probe: TokenizerProbe, student_tokenizer: Any, student: torch.nn.Module, messages: Any
) -> list[CheckResult]:
    """One teacher's tokenizer rows, unnamed, on the student's loaded model and the probe's rows and EOS ids
    (`check_tokenizers`)."""
    return check_tokenizers(
        student_tokenizer,
        probe.tokenizer,
        messages=messages,
        enable_thinking=config.data.enable_thinking,
        student_rows=cast(Any, student).get_output_embeddings().weight.shape[0],
        teacher_rows=probe.rows,
        student_eos_ids=eos_token_ids(student, student_tokenizer),
        teacher_eos_ids=probe.eos_ids,
    )


def _probe_rows(
    config: DistillConfig,
    probe: ScoringProbe,
    tokenizer: Any,
    student_scorer: Any,
    student: torch.nn.Module,
    vocab_size: int,
    skip: set[str],
    autocast_dtype: torch.dtype | None,
) -> list[CheckResult]:
    """One teacher's scoring rows, unnamed: `scoring_rows` for an in-process module, else `served_scores`."""
    if probe.module is not None:
        with probe.placed():
            return scoring_rows(
                _at_temperature(config, probe.temperature),
                teacher=probe.module,
                tokenizer=tokenizer,
                student_scorer=student_scorer,
                teacher_scorer=probe.scorer,
                prompt_ids=probe.prompt_ids,
                vocab_size=vocab_size,
                student_params=sum(p.numel() for p in student.parameters()),
                skip=skip,
                rows=2,
                max_new_tokens=128,
                autocast_dtype=autocast_dtype,
            )
    if "served_scores" in skip:  # a served or vLLM teacher (or the live student): no module here
        return []
    with probe.placed():
        return [
            check_served_scores(
                probe.scorer,
                probe.prompt_ids,
                temperature=probe.temperature,
                top_k=diagnostic_top_k(config.objective.top_k),
                vocab_rows=vocab_size,
                pad_id=tokenizer.pad_token_id,
            )
        ]
