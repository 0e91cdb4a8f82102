"""The teachers' part of an OPD step: every teacher scores the rollout rows of the prompts routed to it
(`start_teachers`, one teacher: the whole batch), and the per-teacher metrics of a run with several
(`teacher_metrics`). Teachers are a list everywhere (`Trainer.teachers`; a `teacher:` config is a list of one)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import fields, replace
from typing import Any, cast

import torch

from opd.config import STUDENT
from opd.models import on_device
from opd.objectives import reward_stats
from opd.objectives.full_vocab import full_divergence
from opd.objectives.targets import Targets
from opd.teacher.base import (
    HiddenStateScorer,
    HiddenStateSource,
    choose_answer,
    head_bytes,
    score_bytes_per_position,
    scores_from_hidden,
    start_scoring,
)
from opd.teacher.cross_vocab import cross_metrics, start_alignment, start_cross_scoring
from opd.teacher.registry import RoutedTeacher
from opd.train.common import autocast
from opd.train.distributed import gathered
from opd.train.state import Batch, Scores, Trainer
from opd.types import Rollouts, TokenScores

__all__ = [
    "answer_metrics",
    "answers_hidden",
    "exact_reverse_kl",
    "hidden_scorer",
    "live_student",
    "prealign_teachers",
    "row_teachers",
    "score_full_teacher",
    "start_teachers",
    "teacher_metrics",
    "xtok_metrics",
]


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
    if answers_hidden(routed, top_k):
        scorer = hidden_scorer(routed, device)
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
    taken at the new prompt lengths (`Rollouts.response_positions`). A row's response is all its tokens after the
    prompt, an episode's environment tokens among them (outside `response_mask`, inside `attention_mask`)."""
    lengths = (rollouts.attention_mask.sum(-1) - rollouts.prompt_lengths).tolist()
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


# ------------------------------------------------------------------------------------------------ hidden states

_HIDDEN: weakref.WeakKeyDictionary[Any, HiddenStateScorer] = weakref.WeakKeyDictionary()


def hidden_scorer(routed: RoutedTeacher, device: torch.device) -> HiddenStateScorer:
    """The teacher as a `HiddenStateScorer`: its head fetched once onto `device` (the student's; a copy for an
    offloaded or served teacher, the teacher's own weights otherwise) and kept for the run."""
    scorer = _HIDDEN.get(routed.teacher.scorer)
    if scorer is None:
        source = routed.teacher.scorer
        if not isinstance(source, HiddenStateSource):
            raise ValueError(
                f"teacher {routed.name} cannot answer with hidden states ({type(source).__name__}); "
                f"set its answer=scores or use a local or served teacher"
            )
        scorer = _HIDDEN[source] = HiddenStateScorer(source, device=device)
    return scorer


def score_full_teacher(
    tr: Trainer, batch: Batch, student: TokenScores, top_k: int, device: torch.device
) -> tuple[TokenScores, torch.Tensor, dict[str, float]]:
    """The one teacher of a full-vocabulary objective (`DistillConfig.needs_full_distribution`): its hidden states
    for the whole batch, its scores computed here from them (the diagnostics and rewards read them as any teacher's)
    and the answer's metrics: (scores, hidden [B, T, E], {teacher/bytes_per_token, teacher/head_bytes})."""
    (routed,) = tr.models.teachers
    rollouts = batch.rollouts
    if routed.prompt_ids is not None and routed.cross is None:  # its view, as `_start_routed` reads it
        views = routed.prompt_ids
        rollouts = _with_prompts(
            rollouts, [views[batch.indices[g]] for g in rollouts.group_ids.tolist()], tr.models.tokenizer
        )
    scorer = hidden_scorer(routed, device)
    placed = on_device(routed.teacher.module, device if routed.entry.offload else None)
    with placed:
        hidden_BTE = scorer.hidden_states(rollouts)
    with torch.no_grad():
        scores = scores_from_hidden(
            hidden_BTE,
            scorer.head,
            rollouts,
            top_k=top_k,
            requested_ids=student.topk_ids,
            temperature=cast(float, routed.entry.temperature),
            vocab_size=tr.models.vocab_size,
        )
    answer = {
        "teacher/bytes_per_token": float(hidden_BTE.shape[-1] * _hidden_itemsize(routed, hidden_BTE.dtype)),
        "teacher/head_bytes": float(head_bytes(scorer.head)),
    }
    return scores, hidden_BTE, answer


def exact_reverse_kl(
    tr: Trainer, rollouts: Rollouts, teacher_hidden_BTE: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """[B, T] the exact KL(p‖q) at every response position, no grad (objective.token_reward full_reverse_kl*): the
    student's hidden states from one more no-grad forward (its scorer's), the teacher's as answered."""
    (routed,) = tr.models.teachers
    student_scorer: Any = tr.models.student_scorer
    mask_BT = rollouts.response_mask.bool()
    with torch.no_grad(), gathered(tr.models.student, tr.run.dist), autocast(device, tr.models.autocast_dtype):
        student_BTD = student_scorer.hidden_states(rollouts)
        rows_N, cols_N = mask_BT.nonzero(as_tuple=True)
        kl_N = full_divergence(
            student_BTD[rows_N, cols_N],
            student_scorer.output_head(),
            teacher_hidden_BTE[rows_N, cols_N],
            hidden_scorer(routed, device).head,
            kind="reverse_kl",
            temperature=tr.config.rollout.temperature,
            teacher_temperature=cast(float, routed.entry.temperature),
            vocab_size=tr.models.vocab_size,
        )
    kl_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    kl_BT[rows_N, cols_N] = kl_N.float().to(kl_BT.device)
    return kl_BT


def answers_hidden(routed: RoutedTeacher, top_k: int) -> bool:
    """Whether this teacher answers with hidden states (its `answer`, auto resolved by `choose_answer`)."""
    scorer = routed.teacher.scorer
    hidden_size = getattr(scorer, "hidden_size", None)
    served = routed.entry.url is not None
    return choose_answer(
        routed.entry.answer, needs_full=False, served=served, top_k=top_k, hidden_size=hidden_size
    ) == ("hidden")


def answer_metrics(tr: Trainer, scores: TokenScores, top_k: int, device: torch.device) -> dict[str, float]:
    """teacher/bytes_per_token (what a teacher's answer takes a scored position: its arrays on the wire, or its
    hidden states; the largest over a run's teachers) and teacher/head_bytes (heads kept resident for hidden states)."""
    k = 0 if scores.topk_ids is None else scores.topk_ids.shape[-1]
    q = 0 if scores.requested_logprobs is None else scores.requested_logprobs.shape[-1]
    per, heads = 0.0, 0.0
    for routed in tr.models.teachers:
        if answers_hidden(routed, top_k):
            head = hidden_scorer(routed, device).head
            per = max(per, float(head.weight.shape[1] * _hidden_itemsize(routed, head.weight.dtype)))
            heads += head_bytes(head)
        else:
            per = max(per, float(score_bytes_per_position(k, q, with_entropy=scores.entropy is not None)))
    out = {"teacher/bytes_per_token": per}
    if heads:
        out["teacher/head_bytes"] = heads
    return out


def _hidden_itemsize(routed: RoutedTeacher, model_dtype: torch.dtype) -> int:
    """Bytes a hidden-state value takes: the wire dtype of a served teacher, the model's in process."""
    if routed.entry.url is not None:
        return 4 if routed.entry.hidden_dtype == "float32" else 2
    return model_dtype.itemsize
