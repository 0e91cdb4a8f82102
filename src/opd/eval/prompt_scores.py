"""Per-prompt teacher alignment: how much of the student's and the teacher's top-k support a prompt's student rollouts
share (SPEC §6), and the selection of a prompt set by it. The library behind `opd prompts score | select`
(`opd.recipes.prompts`) and the forecast of `opd check`.

`score_prompts`: n student rollouts per prompt, scored by both models as one OPD step scores them, then the §6
metrics over their tokens (one `PromptScore` per prompt); batches are seeded by (seed, batch index), so a resumed
run (`skip_ids`) reproduces an uninterrupted one. `select_prompts`: the most aligned prompts, optionally mixed with
another set. More in docs/design.md, "opd.eval.prompt_scores".

Omitted on purpose: a vLLM teacher (`prompt_logprobs` gives neither the teacher's entropy nor its log-probs at the
student's top-k), selection by a combination of metrics, and re-balancing sources inside the aligned part.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from opd.data.prompts import DataError
from opd.data.templates import encode_prompts
from opd.fingerprints import prompt_digest
from opd.io import read_jsonl
from opd.models import check_tokenizer_compatibility
from opd.objectives import opd_diagnostics_from_scores
from opd.rollout import SamplingParams, make_generator
from opd.rollout.batch import build_rollouts
from opd.seeds import SALT_STEP_ROLLOUT, derive_seed
from opd.types import Prompt, Rollouts, TokenScores

if TYPE_CHECKING:
    from opd.teacher.base import TeacherScorer

METRICS = (
    "overlap_ratio",
    "overlap_mass_student",
    "overlap_mass_teacher",
    "overlap_advantage",
    "topk_mass_student",
    "topk_mass_teacher",
    "entropy_student",
    "entropy_teacher",
    "entropy_gap",
)
"""The per-prompt SPEC §6 metrics a `PromptScore` carries (the position metrics of `opd_diagnostics`)."""

ALIGNMENT_METRICS: dict[str, int] = {
    "overlap_ratio": 1,  # +1: larger is more aligned
    "overlap_mass_student": 1,
    "overlap_mass_teacher": 1,
    "overlap_advantage": 1,  # ≤ 0, → 0 as the student aligns
    "entropy_gap": -1,  # −1: smaller is more aligned
}
"""Metrics `select_prompts` can rank by, with the direction in which a prompt counts as more teacher-aligned."""


# ------------------------------------------------------------------------------------------------ score


@dataclass
class PromptScore:
    """How teacher-aligned one prompt is: the SPEC §6 position metrics as token means over all valid response tokens
    of its n student rollouts (the trainer logs the same means per batch). One line of the scores JSONL.

    id, source:       the prompt's
    n:                rollouts sampled; num_tokens: their valid response tokens (EOS included)
    response_length:  mean tokens per rollout; truncation_rate: fraction that hit max_new_tokens
    overlap_ratio …   see `METRICS` and `opd_diagnostics`; entropies in nats
    skipped:          why the prompt has no metrics (longer than max_prompt_length), else None; its metrics are None
    prompt_sha256:    `opd.fingerprints.prompt_digest` of the prompt's messages, compared when a run resumes (None
                      in a file of an older opd, which a rerun does not extend)
    """

    id: str
    source: str = ""
    n: int = 0
    num_tokens: int = 0
    response_length: float | None = None
    truncation_rate: float | None = None
    overlap_ratio: float | None = None
    overlap_mass_student: float | None = None
    overlap_mass_teacher: float | None = None
    overlap_advantage: float | None = None
    topk_mass_student: float | None = None
    topk_mass_teacher: float | None = None
    entropy_student: float | None = None
    entropy_teacher: float | None = None
    entropy_gap: float | None = None
    skipped: str | None = None
    prompt_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict, origin: str = "scores") -> PromptScore:
        """Read one record; unknown keys are ignored (newer files), a record without an id is a one-line `DataError`."""
        if not isinstance(record, dict) or record.get("id") is None:
            raise DataError(
                f"{origin}: a score record without an 'id': {str(record)[:80]}; expected PromptScore lines "
                f"written by `opd prompts score`"
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in known} | {"id": str(record["id"])})


def read_scores(path: str | Path) -> list[PromptScore]:
    """The records of a scores JSONL (a partial last line from an interrupted append is ignored)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such scores file; write one with `opd prompts score --out {path.name}`")
    return [PromptScore.from_json(r, str(path)) for r in read_jsonl(path)]


def score_prompts(
    student: torch.nn.Module,
    teacher: torch.nn.Module | TeacherScorer,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    n: int = 4,
    top_k: int = 16,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    max_new_tokens: int = 1024,
    max_prompt_length: int = 1024,
    enable_thinking: bool | None = None,
    template: str = "keep",
    batch_size: int = 32,
    score_batch_tokens: int = 32768,
    seed: int = 0,
    skip_ids: Sequence[str] = (),
    on_batch: Callable[[list[PromptScore]], None] | None = None,
    generator: Any = None,
    on_scored: Callable[[list[Prompt], Any, TokenScores, TokenScores], None] | None = None,
) -> list[PromptScore]:
    """Per prompt, sample n rollouts from `student` and compute the SPEC §6 metrics of those tokens between the student
    and `teacher` (which must share `tokenizer`'s vocabulary; `score_prompt_file` checks both tokenizers). `teacher`
    is a model (scored by a `LocalScorer`) or any `TeacherScorer` (e.g. the served one `load_teacher` builds).

    Mirrors one OPD step (`opd.train.step`): encode (`template`, `enable_thinking`, `max_prompt_length`) → rollouts
    (temperature, top_p 1) → student `LocalScorer` top-k at `temperature` → teacher `LocalScorer` top-k, log-probs
    at the student's top-k at `teacher_temperature` → `opd_diagnostics` per prompt group.
    batch_size: prompts per batch (× n rollouts decoded together); batches are fixed slices of the encoded prompts
                with seed (seed, batch index), which makes a resumed run (`skip_ids`) reproduce an uninterrupted one.
    skip_ids:   prompt ids already scored: not returned, and a batch made only of them is not run.
    on_batch:   called with each batch's new scores as soon as they exist (the command appends them to the file).
    generator:  the `Generator` of the rollouts (e.g. a vLLM engine of the student); None: `make_generator(student)`.
    on_scored:  called per batch with (its prompts, the `Rollouts`, student and teacher `TokenScores`), for callers
                that need more than the per-prompt means (`opd check`: sequence rewards, correctness).
    Returns the new scores in prompt order; prompts over `max_prompt_length` come back with `skipped` set.
    """
    _check_arguments(
        n=n, top_k=top_k, temperature=temperature, teacher_temperature=teacher_temperature, batch_size=batch_size
    )
    skip = set(skip_ids)
    encoded = encode_prompts(
        tokenizer, prompts, max_prompt_length=max_prompt_length, enable_thinking=enable_thinking, template=template
    )
    too_long = _too_long(prompts, {p.id for p in encoded.prompts}, skip, max_prompt_length)
    if too_long and on_batch is not None:
        on_batch(too_long)
    student_scorer, teacher_scorer, vocab_size = scorer_pair(student, teacher, tokenizer, score_batch_tokens)
    if generator is None:
        generator = make_generator(student, tokenizer, max_batch_size=batch_size * n, vocab_size=vocab_size)
    device = next(student.parameters()).device

    new: dict[str, PromptScore] = {s.id: s for s in too_long}
    for index, start in enumerate(range(0, len(encoded.prompts), batch_size)):
        batch = encoded.prompts[start : start + batch_size]
        if all(p.id in skip for p in batch):
            continue
        prompt_ids = encoded.input_ids[start : start + batch_size]
        # 2. rollouts: n samples per prompt from the student
        params = SamplingParams(
            n=n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=derive_seed(seed, step=index, salt=SALT_STEP_ROLLOUT),
        )
        output = generator.generate(prompt_ids, params)
        rollouts = build_rollouts(prompt_ids, output, pad_id=tokenizer.pad_token_id, device=device)
        # 3. student scores (top-k support, log-probs, entropy); 4. teacher scores, also at the student's top-k
        student_scores = student_scorer.score(rollouts, top_k=top_k, temperature=temperature)
        teacher_scores = teacher_scorer.score(
            rollouts, top_k=top_k, requested_ids=student_scores.topk_ids, temperature=teacher_temperature
        )
        if on_scored is not None:
            on_scored(list(batch), rollouts, student_scores, teacher_scores)
        scores = _batch_scores(batch, n, skip, rollouts, student_scores, teacher_scores)
        if on_batch is not None:
            on_batch(scores)
        new.update((s.id, s) for s in scores)
    return [new[p.id] for p in prompts if p.id in new]


def _too_long(prompts: Sequence[Prompt], kept: set[str], skip: set[str], max_prompt_length: int) -> list[PromptScore]:
    """The skipped scores of the prompts that encoding dropped for length (those not in `skip`)."""
    return [
        PromptScore(
            p.id,
            p.source,
            skipped=f"longer than max_prompt_length={max_prompt_length} tokens",
            prompt_sha256=prompt_digest(p.messages),
        )
        for p in prompts
        if p.id not in kept and p.id not in skip
    ]


def _check_arguments(*, n: int, top_k: int, temperature: float, teacher_temperature: float, batch_size: int) -> None:
    """Raise ValueError naming the first of `score_prompts`' arguments out of its range."""
    checks = [
        ("n", n, n >= 1, "an integer ≥ 1"),
        ("top_k", top_k, top_k >= 1, "an integer ≥ 1"),
        ("temperature", temperature, temperature > 0, "> 0"),
        ("teacher_temperature", teacher_temperature, teacher_temperature > 0, "> 0"),
        ("batch_size", batch_size, batch_size >= 1, "an integer ≥ 1"),
    ]
    for name, value, ok, legal in checks:
        if not ok:
            raise ValueError(f"score_prompts: {name} must be {legal}, got {value!r}")


def scorer_pair(
    student: torch.nn.Module, teacher: torch.nn.Module | TeacherScorer, tokenizer: Any, score_batch_tokens: int
) -> tuple[TeacherScorer, TeacherScorer, int]:
    """The student's and the teacher's scorers (`LocalScorer` for a model, a `TeacherScorer` as it is) and the
    vocabulary size both score over (the tokenizer's)."""
    from opd.teacher.local import LocalScorer  # heavy (the Triton kernels, torch._dynamo): only when scoring

    # ids beyond the tokenizer are embedding padding rows: never sampled, never a top-k candidate (SPEC §1)
    rows = {
        who: _vocab_rows(m) for who, m in (("student", student), ("teacher", teacher)) if isinstance(m, torch.nn.Module)
    }
    vocab = check_tokenizer_compatibility(
        tokenizer, tokenizer, student_vocab_size=rows["student"], teacher_vocab_size=rows.get("teacher")
    )
    student_scorer = LocalScorer(student, max_tokens_per_batch=score_batch_tokens, vocab_size=vocab.tokenizer_size)
    teacher_scorer = (
        teacher
        if not isinstance(teacher, torch.nn.Module)
        else LocalScorer(teacher, max_tokens_per_batch=score_batch_tokens, vocab_size=vocab.tokenizer_size)
    )
    return student_scorer, teacher_scorer, vocab.tokenizer_size


def _vocab_rows(model: torch.nn.Module) -> int:
    """Rows of a Hugging Face model's output embedding (`get_output_embeddings` is the model's, not nn.Module's)."""
    return int(cast(Any, model).get_output_embeddings().weight.shape[0])


def _batch_scores(
    batch: Sequence[Prompt],
    n: int,
    skip: set[str],
    rollouts: Rollouts,
    student_scores: TokenScores,
    teacher_scores: TokenScores,
) -> list[PromptScore]:
    """The `PromptScore`s of one batch's prompts not in `skip`: `group_diagnostics` per prompt, lengths and
    the truncation rate."""
    # 7. diagnostics, per prompt
    per_group = group_diagnostics(
        student_scores, teacher_scores, rollouts.response_mask, rollouts.group_ids, len(batch)
    )
    lengths = rollouts.response_mask.sum(-1).view(len(batch), n).float()  # [prompts, n]: rows are prompt-major
    per_group.update(
        num_tokens=lengths.sum(-1),
        response_length=lengths.mean(-1),
        truncation_rate=rollouts.truncated.view(len(batch), n).float().mean(-1),
    )
    values = {k: v.tolist() for k, v in per_group.items()}  # one host sync per batch
    scores = []
    for g, prompt in enumerate(batch):
        if prompt.id in skip:
            continue
        metrics: dict[str, Any] = {k: float(v[g]) for k, v in values.items() if k != "num_tokens"}
        scores.append(
            PromptScore(
                prompt.id,
                prompt.source,
                n=n,
                num_tokens=round(values["num_tokens"][g]),
                prompt_sha256=prompt_digest(prompt.messages),
                **metrics,
            )
        )
    return scores


@torch.no_grad()
def group_diagnostics(
    student: TokenScores, teacher: TokenScores, response_mask: torch.Tensor, group_ids: torch.Tensor, num_groups: int
) -> dict[str, torch.Tensor]:
    """`opd_diagnostics_from_scores` per prompt group: {metric: [G] tensor}, each the token mean over the valid
    positions of the group's rows (`METRICS`; entropies when both scores carry them). Calls the batch function once
    per group on the group's rows, so the math lives in `opd.objectives.diagnostics` only. A group with no rows
    gets 0 (as an empty mask does there)."""
    T = response_mask.shape[1]
    per_group: dict[str, list[torch.Tensor]] = {}
    for g in range(num_groups):
        rows = (group_ids == g).nonzero(as_tuple=True)[0]
        d = opd_diagnostics_from_scores(
            _select_scores(student, rows), _select_scores(teacher, rows), response_mask[rows], chunk_size=max(T, 1)
        )  # one chunk: its key is dropped
        for key in METRICS:
            if key in d:
                per_group.setdefault(key, []).append(d[key])
    return {key: torch.stack(values) for key, values in per_group.items()}


def _select_scores(scores: TokenScores, rows: torch.Tensor) -> TokenScores:
    """The `TokenScores` of some rows (every tensor field indexed along dim 0)."""
    picked: dict[str, Any] = {
        f.name: None if getattr(scores, f.name) is None else getattr(scores, f.name)[rows] for f in fields(scores)
    }
    return TokenScores(**picked)


# ------------------------------------------------------------------------------------------------ select


def select_prompts(
    prompts: Sequence[Prompt],
    scores: Sequence[PromptScore],
    *,
    top: float | int = 0.5,
    by: str = "overlap_ratio",
    mix_with: Sequence[Prompt] | None = None,
    ratio: float = 0.3,
    seed: int = 0,
) -> list[Prompt]:
    """The most teacher-aligned prompts, optionally mixed with prompts drawn from another set.

    scores:   one `PromptScore` per prompt, matched by id (every score id a prompt id, every prompt scored; prompts
              skipped while scoring, too long to train on, are left out of the ranking and the result).
    top:      a float in (0, 1] keeps that fraction of the ranked prompts (rounded, at least 1); an int ≥ 1 that many.
    by:       the metric to rank by (`ALIGNMENT_METRICS`); ties keep file order.
    mix_with: another prompt set; m = round(a · ratio / (1 − ratio)) of its prompts, drawn at random (`seed`), are
              added to the a aligned ones, so exactly `ratio` of the result comes from it whenever that is a whole
              number (the nearest count otherwise). Prompts whose id is already selected are not drawn (so mixing a
              set with itself adds other prompts, and the ids of the result stay unique).
    ratio:    in [0, 1); ignored without `mix_with`.
    Returns the aligned prompts in file order, then the mixed ones in `mix_with`'s order. Bad inputs raise a one-line
    `DataError` / `ValueError`.
    """
    if by not in ALIGNMENT_METRICS:
        raise ValueError(f"by must be one of {', '.join(ALIGNMENT_METRICS)}, got {by!r}")
    if isinstance(top, bool) or not isinstance(top, (int, float)):
        raise ValueError(f"top must be a fraction in (0, 1] or an integer count ≥ 1, got {top!r}")
    if isinstance(top, float) and not 0 < top <= 1:
        raise ValueError(f"top as a fraction must be in (0, 1], got {top!r}; pass an integer for a count")
    if isinstance(top, int) and top < 1:
        raise ValueError(f"top as a count must be ≥ 1, got {top!r}")
    if not (isinstance(ratio, (int, float)) and 0 <= ratio < 1):
        raise ValueError(f"ratio (the fraction of the result drawn from mix_with) must be in [0, 1), got {ratio!r}")

    by_id: dict[str, PromptScore] = {}
    for s in scores:
        if s.id in by_id:
            raise DataError(f"scores: prompt id {s.id!r} is scored twice; expected one record per prompt")
        by_id[s.id] = s
    prompt_ids = {p.id for p in prompts}
    stray = [i for i in by_id if i not in prompt_ids]
    if stray:
        raise DataError(
            f"scores: {len(stray)} of {len(by_id)} score ids are not ids of the prompt set (first: "
            f"{stray[0]!r}); were the scores computed on another set or with another id_key?"
        )
    unscored = [p.id for p in prompts if p.id not in by_id]
    if unscored:
        raise DataError(
            f"scores: {len(unscored)} of {len(prompts)} prompts have no score (first: {unscored[0]!r}); "
            f"finish scoring them (rerun `opd prompts score`, it resumes)"
        )
    ranked = [i for i, p in enumerate(prompts) if getattr(by_id[p.id], by) is not None]
    if not ranked:
        raise DataError(f"scores: none of the {len(prompts)} prompts has a {by} value (all skipped while scoring)")
    count = top if isinstance(top, int) else max(1, round(top * len(ranked)))
    if count > len(ranked):
        raise ValueError(f"top={top} asks for {count} prompts but only {len(ranked)} have a score; lower top")
    sign = ALIGNMENT_METRICS[by]
    ranked.sort(key=lambda i: -sign * getattr(by_id[prompts[i].id], by))  # stable: ties keep file order
    selected = [prompts[i] for i in sorted(ranked[:count])]
    if mix_with is None or ratio == 0:
        return selected

    chosen = {p.id for p in selected}
    pool = [i for i, p in enumerate(mix_with) if p.id not in chosen]
    wanted = round(count * ratio / (1 - ratio))
    if wanted > len(pool):
        raise DataError(
            f"mix_with: ratio={ratio} with {count} aligned prompts needs {wanted} other prompts but "
            f"mix_with has {len(pool)} not already selected; lower ratio or top"
        )
    drawn = sorted(random.Random(seed).sample(pool, wanted))
    return selected + [mix_with[i] for i in drawn]
