"""`opd prompts template | score | select`: teacher-aligned prompt sets, the paper's second recovery strategy for an
OPD run that does not take off (SPEC §6: OPD learns where teacher and student already share their top-k support).

  template  `retemplate_file`: another instruction (boxed | dapo | custom) on every prompt (`opd.data.alignment`).
  score     `score_prompt_file`: per-prompt overlap scores (`opd.eval.prompt_scores.score_prompts`), appended per
            batch to a scores JSONL; a rerun skips the ids already scored and reproduces the rest exactly, with the
            settings of the `config.yaml` beside it (else refused).
  select    `select_prompt_file`: the most aligned prompts, optionally mixed with another set (`select_prompts`).

Each command is load → run → save; `retemplate`, `score_prompts` and `select_prompts` know nothing about files. The
teacher is whatever `opd.teacher.registry.load_teacher` builds from `teacher` (in process, or `teacher.url`: an
`opd serve-teacher`); the student runs in process, its rollouts from any engine (`engine: vllm` included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from opd.config import ConfigError, save_config
from opd.config.prompts import PromptScoreConfig
from opd.data.alignment import retemplate
from opd.data.prompts import JSONL_SUFFIXES, DataError, load_prompts, save_prompts
from opd.data.templates import parse_template
from opd.eval.prompt_scores import ALIGNMENT_METRICS, PromptScore, read_scores, score_prompts, select_prompts
from opd.fingerprints import model_fingerprint, prompt_digest
from opd.io import append_jsonl, repair_jsonl
from opd.models import fix_rope, load_model, load_tokenizer
from opd.report.sinks import progress_bar
from opd.rollout import make_generator
from opd.rollout.registry import check_vllm_rope, vllm_arguments
from opd.rundir import check_identity, claim_output_files, locked
from opd.types import Prompt

IDENTITY_FILE = "identity.json"  # beside the scores: the model files they were made with

# Settings that change the scores: a resumed file must have been written with the same ones. (data.path may move:
# the prompt ids are checked instead.)
_RESUME_KEYS = (
    "student.path",
    "student.dtype",
    "teacher.path",
    "teacher.dtype",
    "data.prompt_key",
    "data.id_key",
    "data.template",
    "data.enable_thinking",
    "data.max_prompt_length",
    "n",
    "top_k",
    "temperature",
    "teacher_temperature",
    "max_new_tokens",
    "batch_size",
    "seed",
    "engine",
)


def score_prompt_file(config: PromptScoreConfig, *, console: Any = None) -> Path:
    """Run `opd prompts score`: check tokenizers, load the set, skip the ids already in `config.out`, load both
    models, score the rest batch by batch (appending), print a summary. Returns the scores path."""
    console = console or Console()
    out = Path(config.out)
    if out.suffix.lower() not in JSONL_SUFFIXES:
        raise DataError(f"out: scores are written as JSON lines; expected a .jsonl path, got {str(out)!r}")
    with locked(out.parent, "prompts score"):  # the scores and their config.yaml: one process at a time
        return _score_locked(config, out, console)


def _score_locked(config: PromptScoreConfig, out: Path, console: Any) -> Path:
    """The body of `score_prompt_file`, run holding the lock of the directory of `out`.

    Phases: 1. the prompt set, after checking the teacher's tokenizer (`_load_prompt_set`); 2. the scores already
    in `out` and the identity of the work (`_resume`); 3. the models, and the rest scored (`_score_rest`);
    4. the summary."""
    student_tokenizer, prompts = _load_prompt_set(config)
    skip = _resume(config, out, prompts)
    todo = len([p for p in prompts if p.id not in skip])
    if skip:
        console.print(f"resuming: {len(skip)} of {len(prompts)} prompts already scored in {out}")
    if todo:
        _score_rest(config, out, prompts, skip, todo, student_tokenizer, console)
    console.print(summarize_scores(read_scores(out)) + f"\nscores: {out}")
    return out


def _load_prompt_set(config: PromptScoreConfig) -> tuple[Any, list[Prompt]]:
    """(the student's tokenizer, the prompts), after refusing a vLLM teacher and a teacher tokenizer that differs."""
    from opd.teacher.registry import check_teacher_tokenizer  # heavy (the Triton kernels, torch._dynamo)

    if getattr(config.teacher, "engine", "local") == "vllm":
        raise ValueError(
            "opd prompts score needs the teacher's entropy and its log-probs at the student's top-k, which "
            "a vLLM teacher (teacher.engine=vllm) cannot give: use teacher.engine=local or teacher.url "
            "(opd serve-teacher)"
        )
    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    check_teacher_tokenizer(config.teacher, student_tokenizer)
    data = config.data
    prompts = load_prompts(
        data.path,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        id_key=data.id_key,
        split=data.split,
        limit=data.limit,
        on_missing_answer="keep",
    )  # answers are not graded here
    return student_tokenizer, prompts


def _resume(config: PromptScoreConfig, out: Path, prompts: list[Prompt]) -> set[str]:
    """The ids already scored in `out` (a resume of the same work, checked), after writing the identity and the
    config beside it."""
    _check_own_files(out)
    repair_jsonl(out)
    done = read_scores(out) if out.is_file() else []
    if done:
        _check_resume(config, out.parent / "config.yaml")
        _check_same_prompts(out, done, prompts, config.data.path)
    identity = {
        "out": out.name,
        "student_files": model_fingerprint(config.student.path),
        "teacher_files": model_fingerprint(config.teacher.path)
        if config.teacher.path and not config.teacher.url
        else None,
    }
    # the student's and the teacher's files (None: a hub id not in the local cache, a served teacher)
    check_identity(out.parent / IDENTITY_FILE, identity, resuming=bool(done), out=out, what="prompt scores")
    save_config(config, out.parent)
    return {s.id for s in done}


def _score_rest(
    config: PromptScoreConfig,
    out: Path,
    prompts: list[Prompt],
    skip: set[str],
    todo: int,
    student_tokenizer: Any,
    console: Any,
) -> None:
    """Load the student, the teacher and the rollout engine; score the prompts not in `skip`, appending each batch
    to `out`."""
    student, tokenizer, teacher, generator = _load_models(config, student_tokenizer)
    data = config.data
    with progress_bar(console) as progress:
        task = progress.add_task("opd prompts score", total=todo)

        def on_batch(batch: list[PromptScore]) -> None:
            append_jsonl(out, [s.to_json() for s in batch])
            progress.advance(task, len(batch))

        score_prompts(
            student,
            teacher,
            tokenizer,
            prompts,
            n=config.n,
            top_k=config.top_k,
            temperature=config.temperature,
            teacher_temperature=config.teacher_temperature,
            max_new_tokens=config.max_new_tokens,
            max_prompt_length=data.max_prompt_length,
            enable_thinking=data.enable_thinking,
            template=data.template,
            batch_size=config.batch_size,
            score_batch_tokens=config.score_batch_tokens,
            seed=config.seed,
            skip_ids=sorted(skip),
            on_batch=on_batch,
            generator=generator,
        )


def _load_models(config: PromptScoreConfig, student_tokenizer: Any) -> tuple[Any, Any, Any, Any]:
    """(student, its tokenizer, the teacher's scorer, the rollout generator: None for `score_prompts`' default)."""
    from opd.teacher.registry import load_teacher, resolve_scorer  # heavy (the Triton kernels, torch._dynamo)

    length = config.data.max_prompt_length + config.max_new_tokens  # the run's longest sequence
    if config.engine == "vllm":  # before any model loads: vLLM must fix the run's RoPE table, or it is refused
        check_vllm_rope(config.student, config.vllm, length, "engine=vllm")
    if config.teacher.path and resolve_scorer(config.teacher) == "vllm":
        check_vllm_rope(config.teacher, getattr(config.teacher, "vllm", None), length, "teacher.engine=vllm")
    student, tokenizer = load_model(
        config.student.path,
        dtype=config.student.dtype,
        device=config.student.device,
        trust_remote_code=config.student.trust_remote_code,
        attn_implementation=config.student.attn_implementation,
    )
    loaded = load_teacher(
        config.teacher,
        student_tokenizer=student_tokenizer,
        student_rows=student.get_output_embeddings().weight.shape[0],
        student_device=next(student.parameters()).device,
        max_tokens_per_batch=config.score_batch_tokens,
    )
    # one RoPE table per run, as distill fixes it (`fix_rope`): the student's rollouts, its scores and the teacher's
    # are of one distribution each, whatever rows share a batch
    for model in {id(m): m for m in (student, loaded.module) if m is not None}.values():
        fix_rope(model, length)
    check = getattr(loaded.scorer, "check_rope", None)
    if loaded.module is None and check is not None:  # a served teacher's /info
        check(length)
    generator = None
    if config.engine == "vllm":  # the student's rollouts from vLLM; its scores stay with the HF model above
        generator = make_generator(
            None,
            tokenizer,
            engine="vllm",
            max_batch_size=config.batch_size * config.n,
            vocab_size=loaded.vocab.tokenizer_size,
            **vllm_arguments(config.vllm, config.student),
        )
    elif config.engine != "auto":
        generator = make_generator(
            student,
            tokenizer,
            engine=config.engine,
            max_batch_size=config.batch_size * config.n,
            vocab_size=loaded.vocab.tokenizer_size,
        )
    return student, tokenizer, loaded.scorer, generator


def _check_own_files(out: Path) -> None:
    """`config.yaml` and `identity.json` are written beside the scores: refuse a directory where either belongs to
    other work (another command's run, another scores file), which the run would overwrite."""
    for name in ("config.yaml", IDENTITY_FILE):
        path = out.parent / name
        if not path.is_file():
            continue
        try:
            saved = yaml.safe_load(path.read_text())  # JSON is YAML
        except yaml.YAMLError:
            saved = None
        saved_out = saved.get("out") if isinstance(saved, dict) else None
        if not isinstance(saved_out, str) or Path(saved_out).name != out.name:
            raise ValueError(
                f"{path} belongs to other work{f' (its out: {saved_out})' if isinstance(saved_out, str) else ''}; "
                f"opd prompts score writes config.yaml and {IDENTITY_FILE} beside --out: give an --out in a "
                "directory of its own"
            )


def _check_same_prompts(out: Path, done: Sequence[PromptScore], prompts: Sequence[Prompt], data_path: str) -> None:
    """Each score already in `out` must be of a prompt of this set, as it reads now (`prompt_sha256`), or the file
    would keep the score of a prompt edited under the same id."""
    digests = {p.id: prompt_digest(p.messages) for p in prompts}
    stray = [s.id for s in done if s.id not in digests]
    if stray:
        raise DataError(
            f"{out}: holds scores of {len(stray)} prompt ids not in {data_path} (first: {stray[0]!r});"
            f" it belongs to another set: choose another --out"
        )
    for score in done:
        if score.prompt_sha256 is None:
            raise DataError(
                f"{out}: its score of {score.id!r} has no prompt_sha256 (an older opd wrote it): whether the prompts "
                "changed since cannot be told; choose another --out"
            )
        if score.prompt_sha256 != digests[score.id]:
            raise DataError(
                f"{out}: prompt {score.id!r} of {data_path} is not the prompt it was scored on (prompt_sha256 "
                f"{score.prompt_sha256} → {digests[score.id]}): the set changed under the same ids; choose another "
                "--out, or score the set as it was"
            )


def _check_resume(config: PromptScoreConfig, saved_path: Path) -> None:
    """A scores file is extended only with the settings it was written with (else its lines would disagree)."""
    if not saved_path.is_file():
        return
    saved = yaml.safe_load(saved_path.read_text()) or {}
    now = config.model_dump(mode="json")
    for key in _RESUME_KEYS:
        before, after = _dotted(saved, key), _dotted(now, key)
        if before != after:
            raise ConfigError(
                f"{config.out} was scored with {key}={before!r}, this run has {key}={after!r}; "
                f"use the same settings to resume, or another --out"
            )


def _dotted(data: dict, key: str) -> Any:
    value: Any = data
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def summarize_scores(scores: Sequence[PromptScore]) -> str:
    """One line per alignment metric: mean and quartiles over the scored prompts."""
    scored = [s for s in scores if s.skipped is None]
    lines = [f"{len(scored)} prompts scored, {len(scores) - len(scored)} skipped"]
    for key in ALIGNMENT_METRICS:
        values = sorted(getattr(s, key) for s in scored if getattr(s, key) is not None)
        if values:
            q = [values[min(len(values) - 1, int(f * len(values)))] for f in (0.25, 0.5, 0.75)]
            lines.append(
                f"  {key:<22} mean {sum(values) / len(values):.4f}  q25 {q[0]:.4f}  median {q[1]:.4f}  q75 {q[2]:.4f}"
            )
    return "\n".join(lines)


def retemplate_file(
    source: str | Path,
    out: str | Path,
    template: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "reward_model.ground_truth",
    id_key: str | None = None,
    overwrite: bool = False,
) -> str:
    """Run `opd prompts template`: load, `retemplate`, save (verl layout, by `out`'s extension). Returns a summary.
    An existing `out` is refused, or with `overwrite` moved aside (`opd.rundir.claim_output_files`)."""
    claim_output_files({"--out": out}, {"--in": source}, overwrite=overwrite)
    prompts = load_prompts(
        source, prompt_key=prompt_key, answer_key=answer_key, id_key=id_key, on_missing_answer="keep"
    )
    templated = retemplate(prompts, template)
    changed = sum(a.messages != b.messages for a, b in zip(prompts, templated))
    path = save_prompts(templated, out)
    return f"{len(templated)} prompts ({changed} changed) with template {parse_template(template).name} → {path}"


def select_prompt_file(
    source: str | Path,
    scores: str | Path,
    out: str | Path,
    *,
    top: str | float | int = 0.5,
    by: str = "overlap_ratio",
    mix_with: str | Path | None = None,
    ratio: float = 0.3,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str | None = "reward_model.ground_truth",
    id_key: str | None = None,
    overwrite: bool = False,
) -> str:
    """Run `opd prompts select`: load the set (and `mix_with`, read with the same column mapping) and the scores,
    `select_prompts`, save. Returns a summary line. An existing `out` is refused, or with `overwrite` moved aside."""
    claim_output_files(
        {"--out": out}, {"--in": source, "--scores": scores, "--mix-with": mix_with}, overwrite=overwrite
    )
    load = partial(load_prompts, prompt_key=prompt_key, answer_key=answer_key, id_key=id_key, on_missing_answer="keep")
    prompts = load(source)
    score_list = read_scores(scores)
    others = load(mix_with) if mix_with is not None else None
    aligned = select_prompts(prompts, score_list, top=parse_top(top), by=by)
    selected = select_prompts(prompts, score_list, top=parse_top(top), by=by, mix_with=others, ratio=ratio, seed=seed)
    path = save_prompts(selected, out)
    by_id = {s.id: s for s in score_list}
    ranked = [s for s in score_list if getattr(s, by) is not None]
    line = (
        f"{len(aligned)} of {len(ranked)} prompts by {by} (mean {_mean([by_id[p.id] for p in aligned], by):.4f} "
        f"vs {_mean(ranked, by):.4f} over all)"
    )
    mixed = len(selected) - len(aligned)
    if mixed:
        line += f" + {mixed} from {mix_with} ({mixed / len(selected):.0%} of {len(selected)})"
    return f"{line} → {path}"


def _mean(scores: Sequence[PromptScore], key: str) -> float:
    values = [getattr(s, key) for s in scores]
    return sum(values) / len(values) if values else math.nan


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
        raise ValueError(
            f"top must be a fraction in (0, 1] (e.g. 0.5 or 50%) or a count ≥ 1 (e.g. 500), got {raw!r}"
        ) from None
