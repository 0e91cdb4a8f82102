"""The probes `opd distill` hands `opd check`'s startup rows (`startup_checks` → `opd.check.preflight`): per teacher
its routed prompts and scoring context (`scoring_probes`, `view_probes`), its tokenizer (`tokenizer_probes`) and
what it holds in memory (`local_teachers`). Built from the loaded models (`opd.train.state.Models`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from opd.check.report import CheckReport, CheckResult
from opd.check.scoring import ViewProbe
from opd.check.startup import ScoringProbe, TokenizerProbe, preflight
from opd.check.tokenizers import check_cross_tokenizer
from opd.config import STUDENT, DistillConfig
from opd.data.templates import EncodedPrompts
from opd.models import load_tokenizer, on_device
from opd.rollout import Generator
from opd.teacher.registry import RoutedTeacher
from opd.train.common import autocast
from opd.train.distributed import DistInfo
from opd.train.state import Models

__all__ = [
    "cross_rows",
    "cross_sample_texts",
    "local_teachers",
    "placed",
    "scoring_probes",
    "startup_checks",
    "tokenizer_probes",
    "view_probes",
]


def startup_checks(
    config: DistillConfig,
    models: Models,
    generator: Generator,
    data: EncodedPrompts,
    student_tokenizer: Any,
    dist: DistInfo,
    console: Any,
    prompt_teacher: list[int] | None = None,
) -> CheckReport:
    """`opd check`'s tokenizers, scoring and resources rows on the loaded models; raises on a hard failure, else
    returns the report. `prompt_teacher`: each prompt's teacher (`route_teachers`): with several teachers each one's
    scoring rows and step_time run on its own first prompts (`scoring_probes`), and the views' row (one process
    only); the tokenizer rows run once per teacher model, in process or in vLLM (`tokenizer_probes`)."""
    return preflight(
        config,
        student_tokenizer=student_tokenizer,
        student=models.student,
        student_scorer=models.student_scorer,
        generator=generator,
        prompts=data.prompts,
        prompt_ids=data.input_ids,
        vocab_size=models.vocab_size,
        autocast_dtype=models.autocast_dtype,
        world_size=dist.world_size,
        console=console if dist.is_main else None,
        views=view_probes(models, data, prompt_teacher) if dist.world_size == 1 else (),
        teachers=local_teachers(models),
        scoring=scoring_probes(models, data, prompt_teacher or []),
        tokenizers=tokenizer_probes(models, config.student.path),
        cross_rows=cross_rows(models, data, student_tokenizer),
    )


def cross_sample_texts(prompts: list[Any], limit: int = 8) -> list[str]:
    """What the cross-tokenizer row aligns: the message texts and answers of the first `limit` prompts (the text a
    student of the task writes: its words, digits and symbols)."""
    texts: list[str] = []
    for prompt in prompts[:limit]:
        texts += [str(m.get("content", "")) for m in prompt.messages]
        answers = prompt.answer if isinstance(prompt.answer, list) else [prompt.answer]
        texts += [str(a) for a in answers if a is not None]
    return [t for t in texts if t]


def cross_rows(models: Models, data: EncodedPrompts, student_tokenizer: Any) -> list[CheckResult]:
    """The `cross_tokenizer` row of every teacher of another vocabulary (`check_cross_tokenizer`), named when the
    run has several teachers."""
    several = len(models.teachers) > 1
    texts = cross_sample_texts(data.prompts)
    out = []
    for routed in models.teachers:
        if routed.cross is None:
            continue
        row = check_cross_tokenizer(routed.cross, student_tokenizer, texts)
        out.append(replace(row, name=f"{row.name}[{routed.name}]") if several else row)
    return out


def scoring_probes(models: Models, data: EncodedPrompts, prompt_teacher: list[int]) -> list[ScoringProbe]:
    """Per teacher: its first two routed prompts as the student and as it sees them, its module (None for a served or
    vLLM teacher and the live student: `served_scores`), scorer, temperature and the context it scores in (the startup
    scoring rows and step_time). A run's only teacher is unnamed: its rows keep their plain names."""
    several = len(models.teachers) > 1
    probes = []
    for index, routed in enumerate(models.teachers):
        mine = [j for j, t in enumerate(prompt_teacher) if t == index][:2]
        if not mine or routed.cross is not None:  # another vocabulary: its row is cross_tokenizer's
            continue
        own_ids = routed.prompt_ids or data.input_ids  # with a view: the prompts as this teacher sees them
        probes.append(
            ScoringProbe(
                routed.name if several else None,
                None if routed.entry.path == STUDENT else routed.teacher.module,
                routed.teacher.scorer,
                float(routed.entry.temperature or 1.0),
                mine,
                [list(data.input_ids[j]) for j in mine],
                [list(own_ids[j]) for j in mine],
                placed(models, routed),
            )
        )
    return probes


def tokenizer_probes(models: Models, student_path: str) -> list[TokenizerProbe]:
    """Per teacher model, once per path: its tokenizer with the output rows and EOS ids of its module, or of its files
    for a vLLM teacher (its weights live in the engine); named when the run has several teachers (the startup
    tokenizer rows). A served teacher's tokenizer was compared with the student's over /info before any model loaded;
    the live student and `student_init` (the student's path) have the student's own tokenizer."""
    several = len(models.teachers) > 1
    # one teacher that is the student's frozen start keeps its (trivial) rows, as before teachers were a list
    out, seen = [], {STUDENT, student_path} if several else {STUDENT}
    for routed in models.teachers:
        entry, module = routed.entry, routed.teacher.module
        if entry.path is None or entry.path in seen or (module is None and entry.engine != "vllm"):
            continue
        if routed.cross is not None:  # another vocabulary: the cross_tokenizer row (`cross_rows`)
            continue
        seen.add(entry.path)
        tokenizer = load_tokenizer(entry.path, trust_remote_code=entry.trust_remote_code)
        name = routed.name if several else None
        if module is not None:
            out.append(TokenizerProbe.of_module(name, tokenizer, module))
        else:
            out.append(TokenizerProbe.of_files(name, tokenizer, entry.path, entry.trust_remote_code))
    return out


def local_teachers(models: Models) -> list[tuple[str, torch.nn.Module, bool]]:
    """Every in-process teacher module once (entries naming one model share it), with its name and whether it is
    offloaded: what the teachers hold in memory (`estimate_memory`). Served teachers and the live student hold
    nothing of their own."""
    out, seen = [], set()
    for routed in models.teachers:
        module = routed.teacher.module
        if module is None or routed.entry.path == STUDENT or id(module) in seen:
            continue
        seen.add(id(module))
        out.append((routed.name, module, bool(routed.entry.offload)))
    return out


def view_probes(models: Models, data: EncodedPrompts, prompt_teacher: list[int] | None) -> list[ViewProbe]:
    """Per teacher with a view: its first routed prompt as the student and as the teacher see it, its scorer and the
    context it scores in (`check_teacher_views`)."""
    probes = []
    for index, routed in enumerate(models.teachers):
        mine = [j for j, t in enumerate(prompt_teacher or []) if t == index]
        if routed.prompt_ids is None or not mine or routed.cross is not None:
            continue
        j = mine[0]
        probes.append(
            ViewProbe(
                routed.name,
                routed.teacher.scorer,
                list(data.input_ids[j]),
                list(routed.prompt_ids[j]),
                float(routed.entry.temperature or 1.0),
                placed(models, routed),
            )
        )
    return probes


def placed(models: Models, routed: RoutedTeacher) -> Callable[[], contextlib.AbstractContextManager]:
    """The context a teacher scores in at start-up: the live student under its autocast, an offloaded teacher moved
    to the device while it scores."""
    if routed.entry.path == STUDENT:
        return functools.partial(autocast, models.device, models.autocast_dtype)
    return functools.partial(on_device, routed.teacher.module, models.device if routed.entry.offload else None)
