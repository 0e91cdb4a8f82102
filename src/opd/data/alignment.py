"""Teacher-aligned prompt sets (`opd prompts template | score | select`): the paper's second recovery strategy for
an OPD run that does not take off.

OPD learns where the teacher and the student already share their top-k support (SPEC §6: overlap ratio, shared
mass). On prompts where they do, OPD works from the first step; so a prompt set can be chosen for alignment first:

  template  `retemplate`: strip the old instruction and apply another (boxed | dapo | custom), so that the student is
            asked in the format the teacher answers in (DAPO-Math-17k's "Answer:" line vs Qwen's "\\boxed{}").
  score     `score_prompts`: per prompt, n student rollouts scored by the student and by the teacher exactly as one
            OPD step does (train/opd.py steps 2–4), then the §6 metrics (`opd_diagnostics`) over its tokens.
  select    `select_prompts`: keep the most aligned prompts, optionally mixed with prompts from another set — the
            paper warns that purely aligned prompts collapse the student's entropy.

`retemplate_file`, `score_prompt_file` and `select_prompt_file` are the commands (load → run → save, and resume);
the three functions above are the library and know nothing about files.

Scores file (`opd prompts score --out scores.jsonl`): one JSON object per prompt (`PromptScore` fields), appended per
batch. Batches are fixed slices of the encoded set with a seed that depends only on (seed, batch index), so a rerun
skips the prompt ids already scored and reproduces the rest exactly as an uninterrupted run would have. A prompt
longer than `data.max_prompt_length` gets a record with `skipped` set and no metrics (the trainer would drop it too).

The teacher is whatever `opd.teacher.registry.load_teacher` builds from `teacher` (in process, or `teacher.url`: an
`opd serve-teacher`); the student runs in process, its rollouts from any engine (`engine: vllm` included).

Omitted on purpose: a vLLM teacher (the metrics need the teacher's entropy and its log-probs at the student's
top-k, which `prompt_logprobs` does not give), selection by a combination of metrics (one `by` metric; rank differently
by choosing another), and re-balancing sources inside the aligned part (the mix is the explicit knob).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch
from pydantic import Field

from opd.config import ConfigError, DataSpec, ModelSpec, Section, Teacher, VLLMSpec, save_config
from opd.data.prompts import JSONL_SUFFIXES, DataError, load_prompts, save_prompts
from opd.data.templates import InstructionTemplate, apply_template, encode_prompts, parse_template
from opd.types import Prompt, TokenScores
from opd.seeds import SALT_STEP_ROLLOUT, derive_seed

if TYPE_CHECKING:
    from opd.teacher.base import TeacherScorer

METRICS = (
    "overlap_ratio", "overlap_mass_student", "overlap_mass_teacher", "overlap_advantage",
    "topk_mass_student", "topk_mass_teacher", "entropy_student", "entropy_teacher", "entropy_gap",
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


# ------------------------------------------------------------------------------------------------ template


def retemplate(prompts: Sequence[Prompt], template: str | InstructionTemplate) -> list[Prompt]:
    """Copies of `prompts` whose last user message carries `template` (boxed | dapo | custom:"…{problem}…" | keep)
    instead of its old instruction: a known DAPO / boxed instruction is stripped first (`strip_template`), so the
    problem text, the answer, the id and `meta` are kept. Raises `ValueError` (one line) on an unknown template."""
    parsed = parse_template(template)
    return [apply_template(p, parsed) for p in prompts]


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict, origin: str = "scores") -> "PromptScore":
        """Read one record; unknown keys are ignored (newer files), a record without an id is a one-line `DataError`."""
        if not isinstance(record, dict) or record.get("id") is None:
            raise DataError(f"{origin}: a score record without an 'id': {str(record)[:80]}; expected PromptScore lines "
                            f"written by `opd prompts score`")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in known} | {"id": str(record["id"])})


def read_scores(path: str | Path) -> list[PromptScore]:
    """The records of a scores JSONL (a partial last line from an interrupted append is ignored)."""
    from opd.io import read_jsonl

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

    Mirrors one OPD step (train/opd.py): encode (`template`, `enable_thinking`, `max_prompt_length`) → rollouts
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
    from opd.models import check_tokenizer_compatibility
    from opd.rollout import SamplingParams
    from opd.rollout.batch import build_rollouts
    from opd.rollout import make_generator
    from opd.teacher.local import LocalScorer

    checks = [("n", n, n >= 1, "an integer ≥ 1"), ("top_k", top_k, top_k >= 1, "an integer ≥ 1"),
              ("temperature", temperature, temperature > 0, "> 0"),
              ("teacher_temperature", teacher_temperature, teacher_temperature > 0, "> 0"),
              ("batch_size", batch_size, batch_size >= 1, "an integer ≥ 1")]
    for name, value, ok, legal in checks:
        if not ok:
            raise ValueError(f"score_prompts: {name} must be {legal}, got {value!r}")
    skip = set(skip_ids)
    encoded = encode_prompts(tokenizer, prompts, max_prompt_length=max_prompt_length, enable_thinking=enable_thinking,
                             template=template)
    kept = {p.id for p in encoded.prompts}
    too_long = [PromptScore(p.id, p.source, skipped=f"longer than max_prompt_length={max_prompt_length} tokens")
                for p in prompts if p.id not in kept and p.id not in skip]
    if too_long and on_batch is not None:
        on_batch(too_long)

    # ids beyond the tokenizer are embedding padding rows: never sampled, never a top-k candidate (SPEC §1)
    rows = {who: m.get_output_embeddings().weight.shape[0] for who, m in (("student", student), ("teacher", teacher))
            if isinstance(m, torch.nn.Module)}
    vocab = check_tokenizer_compatibility(tokenizer, tokenizer, student_vocab_size=rows["student"],
                                          teacher_vocab_size=rows.get("teacher"))
    student_scorer = LocalScorer(student, max_tokens_per_batch=score_batch_tokens, vocab_size=vocab.tokenizer_size)
    teacher_scorer = teacher if not isinstance(teacher, torch.nn.Module) else LocalScorer(
        teacher, max_tokens_per_batch=score_batch_tokens, vocab_size=vocab.tokenizer_size)
    if generator is None:
        generator = make_generator(student, tokenizer, max_batch_size=batch_size * n, vocab_size=vocab.tokenizer_size)
    device = next(student.parameters()).device

    new: dict[str, PromptScore] = {s.id: s for s in too_long}
    for index, start in enumerate(range(0, len(encoded.prompts), batch_size)):
        batch = encoded.prompts[start:start + batch_size]
        if all(p.id in skip for p in batch):
            continue
        prompt_ids = encoded.input_ids[start:start + batch_size]
        # 2. rollouts: n samples per prompt from the student
        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                seed=derive_seed(seed, step=index, salt=SALT_STEP_ROLLOUT))
        output = generator.generate(prompt_ids, params)
        rollouts = build_rollouts(prompt_ids, output, pad_id=tokenizer.pad_token_id, device=device)
        # 3. student scores (top-k support, log-probs, entropy); 4. teacher scores, also at the student's top-k
        student_scores = student_scorer.score(rollouts, top_k=top_k, temperature=temperature)
        teacher_scores = teacher_scorer.score(rollouts, top_k=top_k, requested_ids=student_scores.topk_ids,
                                              temperature=teacher_temperature)
        if on_scored is not None:
            on_scored(list(batch), rollouts, student_scores, teacher_scores)
        # 7. diagnostics, per prompt
        per_group = group_diagnostics(student_scores, teacher_scores, rollouts.response_mask, rollouts.group_ids,
                                      len(batch))
        lengths_Gn = rollouts.response_mask.sum(-1).view(len(batch), n).float()  # rows are prompt-major
        per_group.update(num_tokens=lengths_Gn.sum(-1), response_length=lengths_Gn.mean(-1),
                         truncation_rate=rollouts.truncated.view(len(batch), n).float().mean(-1))
        values = {k: v.tolist() for k, v in per_group.items()}  # one host sync per batch
        scores = []
        for g, prompt in enumerate(batch):
            if prompt.id in skip:
                continue
            metrics = {k: float(v[g]) for k, v in values.items() if k != "num_tokens"}
            scores.append(PromptScore(prompt.id, prompt.source, n=n, num_tokens=round(values["num_tokens"][g]),
                                      **metrics))
        if on_batch is not None:
            on_batch(scores)
        new.update((s.id, s) for s in scores)
    return [new[p.id] for p in prompts if p.id in new]


@torch.no_grad()
def group_diagnostics(
    student: TokenScores, teacher: TokenScores, response_mask: torch.Tensor, group_ids: torch.Tensor, num_groups: int
) -> dict[str, torch.Tensor]:
    """`opd_diagnostics_from_scores` per prompt group: {metric: [G] tensor}, each the token mean over the valid
    positions of the group's rows (`METRICS`; entropies when both scores carry them). Calls the batch function once
    per group on the group's rows, so the math lives in `opd.objectives.diagnostics` only. A group with no rows
    gets 0 (as an empty mask does there)."""
    from opd.objectives import opd_diagnostics_from_scores

    T = response_mask.shape[1]
    per_group: dict[str, list[torch.Tensor]] = {}
    for g in range(num_groups):
        rows = (group_ids == g).nonzero(as_tuple=True)[0]
        d = opd_diagnostics_from_scores(_select_scores(student, rows), _select_scores(teacher, rows),
                                        response_mask[rows], chunk_size=max(T, 1))  # one chunk: its key is dropped
        for key in METRICS:
            if key in d:
                per_group.setdefault(key, []).append(d[key])
    return {key: torch.stack(values) for key, values in per_group.items()}


def _select_scores(scores: TokenScores, rows: torch.Tensor) -> TokenScores:
    """The `TokenScores` of some rows (every tensor field indexed along dim 0)."""
    return TokenScores(**{f.name: None if getattr(scores, f.name) is None else getattr(scores, f.name)[rows]
                          for f in fields(scores)})


# ------------------------------------------------------------------------------------------------ select


def parse_top(text: str | float | int) -> float | int:
    """`--top` as given on the command line: "0.5" or "50%" → the fraction 0.5; "100" → a count of 100 prompts."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return text
    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            return float(raw[:-1]) / 100
        return float(raw) if any(c in raw.lower() for c in ".e") else int(raw)
    except ValueError:
        raise ValueError(f"top must be a fraction in (0, 1] (e.g. 0.5 or 50%) or a count ≥ 1 (e.g. 500), "
                         f"got {raw!r}") from None


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
        raise DataError(f"scores: {len(stray)} of {len(by_id)} score ids are not ids of the prompt set (first: "
                        f"{stray[0]!r}); were the scores computed on another set or with another id_key?")
    unscored = [p.id for p in prompts if p.id not in by_id]
    if unscored:
        raise DataError(f"scores: {len(unscored)} of {len(prompts)} prompts have no score (first: {unscored[0]!r}); "
                        f"finish scoring them (rerun `opd prompts score`, it resumes)")
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
        raise DataError(f"mix_with: ratio={ratio} with {count} aligned prompts needs {wanted} other prompts but "
                        f"mix_with has {len(pool)} not already selected; lower ratio or top")
    drawn = sorted(random.Random(seed).sample(pool, wanted))
    return selected + [mix_with[i] for i in drawn]


# ------------------------------------------------------------------------------------------------ commands


class PromptScoreConfig(Section):
    """`opd prompts score`: how teacher-aligned each prompt of a set is (SPEC §6 metrics on student rollouts)."""

    student: ModelSpec
    teacher: Teacher = Field(description="The teacher: a model to load (`path`) or an `opd serve-teacher` (`url`).")
    data: DataSpec
    out: str = Field(description="Scores JSONL, one record per prompt, appended per batch; rerunning resumes. "
                                 "config.yaml is written beside it.")
    n: int = Field(4, ge=1, description="Student rollouts per prompt.")
    top_k: int = Field(16, ge=1, description="K of the top-k supports compared (the paper: 16).")
    temperature: float = Field(1.0, gt=0.0, description="Student sampling temperature τ_S; also scales its log-probs.")
    teacher_temperature: float = Field(1.0, gt=0.0, description="τ_T: scales the teacher's logits only.")
    max_new_tokens: int = Field(1024, ge=1, description="Longest rollout in tokens.")
    batch_size: int = Field(32, ge=1, description="Prompts per batch (× n rollouts decoded together); the unit of "
                                                  "resume, so keep it when resuming.")
    score_batch_tokens: int = Field(32768, ge=1, description="Token budget of one no-grad scoring forward.")
    seed: int = Field(0, description="Sampling seed (each batch's seed derives from it and the batch index).")
    engine: Literal["auto", "torch", "static", "vllm"] = Field("auto", description="Engine of the student rollouts (opd.rollout.registry); vllm loads the student itself (needs the vllm extra); the scores stay in-process.")
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")


# Settings that change the scores: a resumed file must have been written with the same ones. (data.path may move:
# the prompt ids are checked instead.)
_RESUME_KEYS = ("student.path", "student.dtype", "teacher.path", "teacher.dtype", "data.prompt_key",
                "data.id_key", "data.template", "data.enable_thinking", "data.max_prompt_length", "n", "top_k",
                "temperature", "teacher_temperature", "max_new_tokens", "batch_size", "seed", "engine")


def score_prompt_file(config: PromptScoreConfig, *, console: Any = None) -> Path:
    """Run `opd prompts score`: check tokenizers, load the set, skip the ids already in `config.out`, load both
    models, score the rest batch by batch (appending), print a summary. Returns the scores path."""
    from rich.console import Console

    console = console or Console()
    out = Path(config.out)
    if out.suffix.lower() not in JSONL_SUFFIXES:
        raise DataError(f"out: scores are written as JSON lines; expected a .jsonl path, got {str(out)!r}")
    from opd.io import DirectoryLock

    with DirectoryLock(out.parent, "prompts score"):  # the scores and their config.yaml: one process at a time
        return _score_locked(config, out, console)


def _score_locked(config: PromptScoreConfig, out: Path, console: Any) -> Path:
    """The body of `score_prompt_file`, run holding the lock of the directory of `out`."""
    from opd.report.sinks import progress_bar
    from opd.io import append_jsonl, repair_jsonl
    from opd.models import load_model, load_tokenizer
    from opd.teacher.registry import check_teacher_tokenizer, load_teacher

    if getattr(config.teacher, "engine", "local") == "vllm":
        raise ValueError("opd prompts score needs the teacher's entropy and its log-probs at the student's top-k, which "
                         "a vLLM teacher (teacher.engine=vllm) cannot give: use teacher.engine=local or teacher.url "
                         "(opd serve-teacher)")
    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    check_teacher_tokenizer(config.teacher, student_tokenizer)
    data = config.data
    prompts = load_prompts(data.path, prompt_key=data.prompt_key, answer_key=data.answer_key, id_key=data.id_key,
                           split=data.split, limit=data.limit, on_missing_answer="keep")  # answers are not graded here

    repair_jsonl(out)
    done = read_scores(out) if out.is_file() else []
    if done:
        _check_resume(config, out.parent / "config.yaml")
        ids = {p.id for p in prompts}
        stray = [s.id for s in done if s.id not in ids]
        if stray:
            raise DataError(f"{out}: holds scores of {len(stray)} prompt ids not in {data.path} (first: {stray[0]!r});"
                            f" it belongs to another set: choose another --out")
    save_config(config, out.parent)
    skip = {s.id for s in done}
    todo = len([p for p in prompts if p.id not in skip])
    if done:
        console.print(f"resuming: {len(skip)} of {len(prompts)} prompts already scored in {out}")
    if todo:
        student, tokenizer = load_model(config.student.path, dtype=config.student.dtype, device=config.student.device,
                                        trust_remote_code=config.student.trust_remote_code,
                                        attn_implementation=config.student.attn_implementation)
        loaded = load_teacher(config.teacher, student_tokenizer=student_tokenizer,
                              student_rows=student.get_output_embeddings().weight.shape[0],
                              student_device=next(student.parameters()).device,
                              max_tokens_per_batch=config.score_batch_tokens)
        teacher, vocab = loaded.scorer, loaded.vocab
        generator = None
        if config.engine == "vllm":  # the student's rollouts from vLLM; its scores stay with the HF model above
            from opd.rollout import make_generator
            from opd.rollout.vllm_engine import EngineOptions

            options = EngineOptions.from_config(config.vllm, dtype=config.student.dtype,
                                                 trust_remote_code=config.student.trust_remote_code)
            generator = make_generator(None, tokenizer, engine="vllm", model_path=config.student.path,
                                       max_batch_size=config.batch_size * config.n, engine_options=options,
                                       vocab_size=vocab.tokenizer_size)
        elif config.engine != "auto":
            from opd.rollout import make_generator

            generator = make_generator(student, tokenizer, engine=config.engine,
                                       max_batch_size=config.batch_size * config.n, vocab_size=vocab.tokenizer_size)
        with progress_bar(console) as progress:
            task = progress.add_task("opd prompts score", total=todo)

            def on_batch(batch: list[PromptScore]) -> None:
                append_jsonl(out, [s.to_json() for s in batch])
                progress.advance(task, len(batch))

            score_prompts(student, teacher, tokenizer, prompts, n=config.n, top_k=config.top_k,
                          temperature=config.temperature, teacher_temperature=config.teacher_temperature,
                          max_new_tokens=config.max_new_tokens, max_prompt_length=data.max_prompt_length,
                          enable_thinking=data.enable_thinking, template=data.template, batch_size=config.batch_size,
                          score_batch_tokens=config.score_batch_tokens, seed=config.seed, skip_ids=skip,
                          on_batch=on_batch, generator=generator)
    console.print(summarize_scores(read_scores(out)) + f"\nscores: {out}")
    return out


def _check_resume(config: PromptScoreConfig, saved_path: Path) -> None:
    """A scores file is extended only with the settings it was written with (else its lines would disagree)."""
    import yaml

    if not saved_path.is_file():
        return
    saved = yaml.safe_load(saved_path.read_text()) or {}
    if not isinstance(saved, dict) or saved.get("out") != config.out:
        return  # a config.yaml of something else in that directory
    now = config.model_dump(mode="json")
    for key in _RESUME_KEYS:
        before, after = _dotted(saved, key), _dotted(now, key)
        if before != after:
            raise ConfigError(f"{config.out} was scored with {key}={before!r}, this run has {key}={after!r}; "
                              f"use the same settings to resume, or another --out")


def _dotted(data: dict, key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def summarize_scores(scores: Sequence[PromptScore]) -> str:
    """One line per alignment metric: mean and quartiles over the scored prompts."""
    scored = [s for s in scores if s.skipped is None]
    lines = [f"{len(scored)} prompts scored, {len(scores) - len(scored)} skipped"]
    for key in ALIGNMENT_METRICS:
        values = sorted(getattr(s, key) for s in scored if getattr(s, key) is not None)
        if values:
            q = [values[min(len(values) - 1, int(f * len(values)))] for f in (0.25, 0.5, 0.75)]
            lines.append(f"  {key:<22} mean {sum(values) / len(values):.4f}  q25 {q[0]:.4f}  median {q[1]:.4f}  "
                         f"q75 {q[2]:.4f}")
    return "\n".join(lines)


def retemplate_file(source: str | Path, out: str | Path, template: str, *, prompt_key: str = "prompt",
                    answer_key: str | None = "reward_model.ground_truth", id_key: str | None = None) -> str:
    """Run `opd prompts template`: load, `retemplate`, save (verl layout, by `out`'s extension). Returns a summary."""
    prompts = load_prompts(source, prompt_key=prompt_key, answer_key=answer_key, id_key=id_key, on_missing_answer="keep")
    templated = retemplate(prompts, template)
    changed = sum(a.messages != b.messages for a, b in zip(prompts, templated))
    path = save_prompts(templated, out)
    return f"{len(templated)} prompts ({changed} changed) with template {parse_template(template).name} → {path}"


def select_prompt_file(source: str | Path, scores: str | Path, out: str | Path, *, top: str | float | int = 0.5,
                       by: str = "overlap_ratio", mix_with: str | Path | None = None, ratio: float = 0.3,
                       seed: int = 0, prompt_key: str = "prompt", answer_key: str | None = "reward_model.ground_truth",
                       id_key: str | None = None) -> str:
    """Run `opd prompts select`: load the set (and `mix_with`, read with the same column mapping) and the scores,
    `select_prompts`, save. Returns a summary line."""
    mapping = dict(prompt_key=prompt_key, answer_key=answer_key, id_key=id_key, on_missing_answer="keep")
    prompts = load_prompts(source, **mapping)
    score_list = read_scores(scores)
    others = load_prompts(mix_with, **mapping) if mix_with is not None else None
    aligned = select_prompts(prompts, score_list, top=parse_top(top), by=by)
    selected = select_prompts(prompts, score_list, top=parse_top(top), by=by, mix_with=others, ratio=ratio, seed=seed)
    path = save_prompts(selected, out)
    by_id = {s.id: s for s in score_list}
    ranked = [s for s in score_list if getattr(s, by) is not None]
    line = (f"{len(aligned)} of {len(ranked)} prompts by {by} (mean {_mean([by_id[p.id] for p in aligned], by):.4f} "
            f"vs {_mean(ranked, by):.4f} over all)")
    mixed = len(selected) - len(aligned)
    if mixed:
        line += f" + {mixed} from {mix_with} ({mixed / len(selected):.0%} of {len(selected)})"
    return f"{line} → {path}"


def _mean(scores: Sequence[PromptScore], key: str) -> float:
    values = [getattr(s, key) for s in scores]
    return sum(values) / len(values) if values else math.nan
