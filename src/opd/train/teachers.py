"""The teachers' part of an OPD step: every teacher scores the rollout rows of the prompts routed to it
(`start_teachers`, one teacher: the whole batch), and the per-teacher metrics of a run with several
(`teacher_metrics`). Teachers are a list everywhere (`Trainer.teachers`; a `teacher:` config is a list of one)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import fields, replace
from typing import Any

import torch

from opd.config import STUDENT
from opd.models import on_device
from opd.objectives import reward_stats
from opd.objectives.targets import Targets
from opd.teacher.base import start_scoring
from opd.teacher.cross_vocab import cross_metrics, start_alignment, start_cross_scoring
from opd.teacher.registry import RoutedTeacher
from opd.train.common import autocast
from opd.train.distributed import gathered
from opd.train.state import Batch, Scores, Trainer
from opd.types import Rollouts, TokenScores

__all__ = ["live_student", "prealign_teachers", "row_teachers", "start_teachers", "teacher_metrics", "xtok_metrics"]


def start_teachers(
    tr: Trainer, batch: Batch, student: TokenScores, top_k: int, device: torch.device
) -> Callable[[], TokenScores] | None:
    """Begin every teacher's scoring of its rows (served teachers all send before any result is awaited, so they
    overlap each other and the grading); returns what waits for them and puts their scores back in row order; None
    without teachers (GRPO). A run's only teacher has every row: it scores the whole batch as it is."""
    if not tr.models.teachers:
        return None
    row_teacher = row_teachers(tr, batch)
    calls = []
    # FSDP: every rank enters `gathered` (collectives), also one with no rows for the live student
    any_live = any(t.entry.path == STUDENT for t in tr.models.teachers)
    with gathered(tr.models.student, tr.run.dist) if any_live else nullcontext():
        for index, routed in enumerate(tr.models.teachers):
            if index in row_teacher:
                calls.append(_start_routed(tr, batch, student, top_k, device, index, routed, row_teacher))
    return lambda: _in_row_order([(rows, call.result()) for rows, call in calls], batch.rollouts.batch_size)


def prealign_teachers(tr: Trainer, batch: Batch) -> None:
    """Start every cross-vocabulary teacher's alignment of its rows in the background (`start_alignment`), before
    the student's scores are taken: the CPU work runs while the GPU scores. No-op without such a teacher."""
    if not any(routed.cross is not None for routed in tr.models.teachers):
        return
    row_teacher = row_teachers(tr, batch)
    for index, routed in enumerate(tr.models.teachers):
        rows = [row for row, t in enumerate(row_teacher) if t == index]
        if routed.cross is None or not rows or routed.prompt_ids is None:
            continue
        mine = batch.rollouts.select(rows) if len(rows) < batch.rollouts.batch_size else batch.rollouts
        own = routed.prompt_ids
        lengths = [len(own[batch.indices[g]]) for g in mine.group_ids.tolist()]
        routed.cross.pending = (tuple(rows), start_alignment(routed.cross, mine, lengths))


def live_student(tr: Trainer, device: torch.device, *, gather: bool = True) -> ExitStack:
    """The context the student's own no-grad scores are taken in (`score_rollouts`): FSDP weights gathered, the
    student's autocast, no grad: `path: student` scores as the student does."""
    stack = ExitStack()
    if gather:
        stack.enter_context(gathered(tr.models.student, tr.run.dist))
    stack.enter_context(autocast(device, tr.models.autocast_dtype))
    stack.enter_context(torch.no_grad())
    return stack


def _start_routed(
    tr: Trainer,
    batch: Batch,
    student: TokenScores,
    top_k: int,
    device: torch.device,
    index: int,
    routed: RoutedTeacher,
    row_teacher: list[int],
) -> tuple[torch.Tensor, Any]:
    """Begin one routed teacher's scoring of its rows (with its view's prompt ids); returns (rows, pending call)."""
    rollouts = batch.rollouts
    rows = [row for row, t in enumerate(row_teacher) if t == index]
    rows_R = torch.tensor(rows, dtype=torch.long, device=rollouts.input_ids.device)
    whole = len(rows) == rollouts.batch_size  # every row, in order: the batch itself, no copy
    scorer, mine = routed.teacher.scorer, rollouts if whole else rollouts.select(rows_R)
    topk_ids = student.topk_ids if whole or student.topk_ids is None else student.topk_ids[rows_R]
    if routed.cross is not None:  # another vocabulary: its own ids of the student's text, scores back at ours
        own = routed.prompt_ids
        assert own is not None  # a cross teacher always has its own rendering of the prompts
        pending, routed.cross.pending = routed.cross.pending, None
        with on_device(routed.teacher.module, device if routed.entry.offload else None):
            cross_call = start_cross_scoring(
                routed.cross,
                routed.teacher.scorer,
                mine,
                student if whole else _rows_of(student, rows_R),
                [own[batch.indices[g]] for g in mine.group_ids.tolist()],
                top_k=tr.config.objective.top_k,
                temperature=routed.entry.temperature,
                alignment=pending[1] if pending is not None and pending[0] == tuple(rows) else None,
            )
        return rows_R, cross_call
    if routed.prompt_ids is not None:  # its view: its own prompt ids before the same response ids
        views = routed.prompt_ids
        mine = _with_prompts(mine, [views[batch.indices[g]] for g in mine.group_ids.tolist()], tr.models.tokenizer)
    placed: AbstractContextManager
    if routed.entry.path == STUDENT:  # the caller holds its weights gathered
        placed = live_student(tr, device, gather=False)
    else:
        placed = on_device(routed.teacher.module, device if routed.entry.offload else None)
    with placed:
        call = start_scoring(
            scorer,
            mine,
            top_k=top_k,
            requested_ids=topk_ids if scorer.serves_requested_ids else None,
            temperature=routed.entry.temperature,
        )
    return rows_R, call


def _rows_of(scores: TokenScores, rows_R: torch.Tensor) -> TokenScores:
    """The scores of the given rows."""
    picked = {f.name: getattr(scores, f.name) for f in fields(TokenScores)}
    return TokenScores(**{k: None if v is None else v[rows_R.to(v.device)] for k, v in picked.items()})  # type: ignore[arg-type]


def _with_prompts(rollouts: Rollouts, prompt_ids: list[list[int]], tokenizer: Any) -> Rollouts:
    """`rollouts` with row b's prompt replaced by `prompt_ids[b]`: the response ids and mask unchanged, the scores
    taken at the new prompt lengths (`Rollouts.response_positions`)."""
    lengths = rollouts.response_mask.sum(-1).tolist()
    width = max((len(p) + r for p, r in zip(prompt_ids, lengths)), default=0)
    device = rollouts.input_ids.device
    input_ids_BL = torch.full((rollouts.batch_size, width), tokenizer.pad_token_id, dtype=torch.long, device=device)
    attention_BL = torch.zeros((rollouts.batch_size, width), dtype=torch.bool, device=device)
    for b, (prompt, length) in enumerate(zip(prompt_ids, lengths)):
        p = len(prompt)
        input_ids_BL[b, :p] = torch.tensor(prompt, dtype=torch.long, device=device)
        input_ids_BL[b, p : p + length] = rollouts.response_ids[b, :length]
        attention_BL[b, : p + length] = True
    lengths_B = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long, device=device)
    return replace(rollouts, input_ids=input_ids_BL, attention_mask=attention_BL, prompt_lengths=lengths_B)


def row_teachers(tr: Trainer, batch: Batch) -> list[int]:
    """The index into `tr.models.teachers` of the teacher of every rollout row of `batch` (its prompt's teacher)."""
    return [tr.data.prompt_teacher[batch.indices[g]] for g in batch.rollouts.group_ids.tolist()]


def _in_row_order(parts: list[tuple[torch.Tensor, TokenScores]], batch_size: int) -> TokenScores:
    """One `TokenScores` of `batch_size` rows from the scores of disjoint row groups (rows, scores); the scores
    themselves when one group holds every row."""
    if len(parts) == 1 and len(parts[0][0]) == batch_size:  # rows 0..B-1 in order (`_start_routed`)
        return parts[0][1]
    out: dict[str, torch.Tensor | None] = {}
    for name in (f.name for f in fields(TokenScores)):
        tensors = [getattr(scores, name) for _, scores in parts]
        if name == "exact" and any(t is not None for t in tensors):  # one vocabulary: every position is exact
            tensors = [
                torch.ones_like(s.sampled_logprobs, dtype=torch.bool) if t is None else t
                for t, (_, s) in zip(tensors, parts)
            ]
        if any(t is None for t in tensors):
            out[name] = None
            continue
        first = tensors[0]
        full = first.new_zeros((batch_size, *first.shape[1:]))
        for (rows, _), tensor in zip(parts, tensors):
            full[rows] = tensor.to(full.device)
        out[name] = full
    return TokenScores(**out)  # type: ignore[arg-type]


def teacher_metrics(tr: Trainer, batch: Batch, scores: Scores, targets: Targets) -> dict[str, Any]:
    """Per teacher (several teachers): `teacher/<name>/token_frac` (its share of the step's response tokens),
    `teacher/<name>/reward_mean` (the token reward over its tokens) and `teacher/<name>/rollout_accuracy`. A teacher
    with no tokens in the step logs its token_frac (0) and leaves the other two out: a mean over nothing is no 0."""
    mask_BT = targets.mask
    row_teacher = torch.tensor(row_teachers(tr, batch), device=mask_BT.device)
    total = mask_BT.sum().clamp(min=1)
    out: dict[str, Any] = {}
    for index, routed in enumerate(tr.models.teachers):
        rows_B = row_teacher == index
        mine_BT = mask_BT * rows_B[:, None].to(mask_BT.dtype)
        prefix = f"teacher/{routed.name}"
        out[f"{prefix}/token_frac"] = mine_BT.sum() / total
        if not mine_BT.any():
            continue
        out[f"{prefix}/reward_mean"] = reward_stats("reward", targets.rewards, targets.reward_valid, mine_BT)[
            "reward_mean"
        ]
        graded = [c for c, t in zip(scores.correct or [], rows_B.tolist()) if t]
        if graded:
            out[f"{prefix}/rollout_accuracy"] = sum(graded) / len(graded)
    return out


def xtok_metrics(tr: Trainer) -> dict[str, float]:
    """The cross-vocabulary teachers' `xtok/…` metrics of the step (`opd.teacher.cross_vocab.cross_metrics`); empty
    without one."""
    crosses = [routed.cross for routed in tr.models.teachers if routed.cross is not None]
    return cross_metrics(crosses) if crosses else {}
