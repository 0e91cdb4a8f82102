"""`opd check`: the four check groups (`opd.check`) for the run a `DistillConfig` describes, on a seeded prompt
sample. Config → setup (tokenizers and the prompt sample; the tokenizer rows from the files, before any weights are
loaded; then both models and their scorers) → run (scoring, forecast, resources) → the table, check.json (never
replaced) and the report, whose `exit_code()` the command exits with.

With several teachers (`teachers:`), the four groups run once per teacher on the prompts routed to it
(`<out>/<name>/check.json` each), and `<out>/check.json` holds the routing table and every teacher's exit code.

A teacher with a view gets `teacher_view` (its context must move its scores) and no forecast (which scores the student's
prompt ids). A teacher of another vocabulary (SPEC §9) gets the `cross_tokenizer` row (on the prompts' texts, then on
the forecast's rollouts) and the forecast on the aligned signal (`CrossForecastScorer`); its scoring and resources rows
are not run; a served one (`url` with `tokenizer_path`, hash-checked against /info) gets the same rows, its scores
over the wire. A served teacher (`url`: an `opd serve-teacher`, or its replicas) gets its tokenizer rows from the
server's /info, `served_scores` and `determinism` instead of the rows that need its weights, and a forecast without
its accuracy (it cannot generate). The live student (`path: student`) is checked as `student_init` is, with the
student itself scoring (at the start of a run the two are the same weights).

A vLLM teacher (`engine: vllm`, one or one of several) is checked as the same model in process, through its Hugging
Face forward, as a local teacher is (a note says so): its tokenizer, template, scores and forecast are the model's;
what vLLM's prompt log-probs add (their normalisation, what the installed vLLM serves) is checked when the run starts
(the startup row `served_scores`, `opd.teacher.vllm_scorer.check_objective`), not here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console

from opd.check.forecasting import (
    CrossForecastScorer,
    EpisodeSampling,
    ForecastThresholds,
    forecast,
    forecast_rows,
    sample_accuracy,
)
from opd.check.probes import cross_sample_texts
from opd.check.report import (
    CHECKS,
    GROUPS,
    CheckReport,
    CheckResult,
    jsonable,
    render_table,
    resolve_skips,
    skipped_rows,
)
from opd.check.resources import check_memory, check_step_time, estimate_memory, loaded_bytes, mini_step
from opd.check.sandbox import tool_rows
from opd.check.scoring import (
    ViewProbe,
    check_determinism,
    check_served_scores,
    check_teacher_views,
    prompt_tail_rollouts,
    scoring_rows,
)
from opd.check.tokenizers import check_cross_tokenizer, check_served_tokenizers, check_tokenizers
from opd.config import STUDENT, DistillConfig, TeacherEntry, TeacherSpec
from opd.data.prompts import load_prompts
from opd.data.templates import encode_prompts
from opd.io import atomic_write_json
from opd.models import (
    check_tokenizer_compatibility,
    check_top_k,
    eos_token_ids,
    fix_rope,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    rows_and_eos_from_files,
)
from opd.objectives.diagnostics import diagnostic_top_k
from opd.rollout import make_generator
from opd.rundir import locked
from opd.teacher.client import remote_scorer
from opd.teacher.cross_vocab import (
    build_cross_vocab,
    cross_metrics,
    resolve_tokenizer_mode,
    served_teacher_tokenizer,
)
from opd.teacher.local import LocalScorer
from opd.teacher.registry import check_teacher_serves, route_prompts, view_prompts
from opd.teacher.routing import check_routes_match
from opd.train.common import autocast, training_precision


def run_check(
    config: DistillConfig,
    *,
    n: int = 4,
    prompts_sample: int = 64,
    out: str | Path | None = None,
    skip: Sequence[str] = (),
    thresholds: ForecastThresholds | None = None,
    console: Any = None,
    prompts: Sequence[Any] | None = None,
    view: TeacherEntry | None = None,
    live_student: bool = False,
    route: str | None = None,
) -> CheckReport:
    """`opd check`: all four groups for `config` (a `DistillConfig`: student, teacher, data and the lengths and batch
    sizes of the run to come); the forecast on `prompts_sample` prompts × `n` rollouts. Prints the table, writes
    `<out>/check.json` (refusing to replace one) and returns the report (`exit_code()`). `prompts`: check on these
    instead of `data.path`'s (one teacher's routed prompts, `_run_per_teacher`). `view`: that teacher's entry when it
    has a view: `teacher_view` checks that its context moves the teacher's scores, and the forecast is not run (it
    scores the student's prompt ids, not the view's). `live_student`: the teacher is the student itself (`path:
    student`; `config.teacher.path` is then the student's). `route`: that teacher's route, which the recovery
    command names."""
    console = console or Console()
    if config.teacher is not None and config.teacher.engine == "vllm":
        console.print(
            "note: the teacher runs in vLLM (engine: vllm): checked as the same model in process (its Hugging Face "
            "forward); vLLM's own answers are checked when the run starts (served_scores)"
        )
    if config.teachers:
        return _run_per_teacher(
            config, n=n, prompts_sample=prompts_sample, out=out, skip=skip, thresholds=thresholds, console=console
        )
    if config.teacher is None:
        raise ValueError("opd check needs a teacher: pass --teacher (teacher.path)")
    if n < 1 or prompts_sample < 1:
        raise ValueError(f"n and prompts_sample must be ≥ 1, got n={n}, prompts_sample={prompts_sample}")
    skipped = resolve_skips([*config.skip_checks, *skip])
    thresholds = thresholds or ForecastThresholds()
    out_dir = Path(out) if out is not None else Path(config.run.out_dir) / f"check-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out_dir / "check.json").exists():
        raise FileExistsError(f"{out_dir / 'check.json'} exists; choose another --out (opd check never replaces it)")
    # held for the whole check (a second `opd check --out DIR` refuses), and proof that DIR is writable before any
    # row is computed: results that could not be written would be lost unprinted
    with locked(out_dir, "check", console=console):
        if (out_dir / "check.json").exists():  # written by another check between the test above and the lock
            raise FileExistsError(
                f"{out_dir / 'check.json'} exists; choose another --out (opd check never replaces it)"
            )
        probe = out_dir / f".write-test-{os.getpid()}"
        try:
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise ValueError(
                f"--out {out_dir}: not writable ({error.strerror or error}); choose another --out"
            ) from None
        return _run_checks(
            config,
            n=n,
            prompts_sample=prompts_sample,
            skipped=skipped,
            thresholds=thresholds,
            out_dir=out_dir,
            console=console,
            prompts=prompts,
            view=view,
            live_student=live_student,
            route=route,
        )


def _run_checks(
    config: DistillConfig,
    *,
    n: int,
    prompts_sample: int,
    skipped: set[str],
    thresholds: ForecastThresholds,
    out_dir: Path,
    console: Any,
    prompts: Sequence[Any] | None = None,
    view: TeacherEntry | None = None,
    live_student: bool = False,
    route: str | None = None,
) -> CheckReport:
    """run_check's four groups, holding `out_dir`; on `prompts` (default: `data.path`'s); the rest: see run_check."""
    assert config.teacher is not None  # run_check refuses a config without a teacher
    report = CheckReport()
    report.results += tool_rows(config, skipped)  # the python tool's sandbox (opd.check.sandbox), before any model
    served = remote_scorer(config.teacher) if config.teacher.url is not None else None
    try:
        student_tokenizer, teacher_tokenizer, sample = _tokenizers_and_sample(config, prompts_sample, prompts)
        check_top_k(config.objective.top_k, student_tokenizer)  # user errors, before any weights load
        if served is not None:
            check_teacher_serves(config.teacher, config.objective)
        # 1. tokenizers: from the files (or the server's /info), before any weights are loaded
        if not live_student and _is_cross(config, student_tokenizer, teacher_tokenizer):
            if served is not None:  # its tokenizer_path, hash-checked against /info (the one distill aligns with)
                teacher_tokenizer = served_teacher_tokenizer(config.teacher, served)
            _cross_checks(
                report,
                config,
                student_tokenizer,
                teacher_tokenizer,
                sample,
                n=n,
                thresholds=thresholds,
                skipped=skipped,
                forecast_too=view is None,
                route=route,
                served=served,
            )
            report.results += skipped_rows(skipped, GROUPS)
            return _finish(report, out_dir, console)
        rows = _tokenizer_rows(config, student_tokenizer, teacher_tokenizer, sample, served)
        report.results += [r for r in rows if r.name not in skipped]
        if any(r.name == "tokenizer_vocab" and r.status == "fail" for r in rows):
            # every other row scores the student's ids with the teacher: meaningless across vocabularies
            report.results += [
                CheckResult(name, "skip", None, "not run: the vocabularies differ")
                for name in CHECKS
                if CHECKS[name] not in ("tokenizers", "tools") and name not in skipped
            ]
            return _finish(report, out_dir, console)
        pair = _load_pair(config, student_tokenizer, teacher_tokenizer, sample, served, live_student)
        teacher_name = config.teacher.url if served is not None else config.teacher.path
        console.print(
            f"opd check: {len(sample)} prompts of {config.data.path}, student {config.student.path}, teacher "
            f"{'the live student' if live_student else teacher_name}"
        )
        # 2. scoring sanity
        report.results += _scoring_group(config, pair, student_tokenizer, skipped)
        if view is not None and "teacher_view" not in skipped:
            report.results.append(_view_row(config, pair, student_tokenizer, sample[0], view))
        # 3. forecast
        if view is not None and "forecast" not in skipped:
            report.results.append(
                CheckResult(
                    "forecast", "skip", None, "not run for a teacher with a view: it scores the student's prompt ids"
                )
            )
        elif "forecast" not in skipped:
            _forecast_group(
                report,
                config,
                pair,
                student_tokenizer,
                sample,
                n=n,
                thresholds=thresholds,
                skipped=skipped,
                route=route,
            )
        # 4. resources
        _resources_group(report, config, pair, student_tokenizer, skipped)
        report.results += skipped_rows(skipped, GROUPS)
        return _finish(report, out_dir, console)
    finally:
        if served is not None:
            served.close()


def _scoring_group(config: DistillConfig, pair: _LoadedPair, tokenizer: Any, skipped: set[str]) -> list[CheckResult]:
    """The scoring rows: those of `scoring_rows` for a teacher in process; for a served one (no weights here to
    sample from) `served_scores` and `determinism` on the sample's own prompt tails."""
    if pair.teacher is not None:
        return scoring_rows(
            config,
            teacher=pair.teacher,
            tokenizer=tokenizer,
            student_scorer=pair.student_scorer,
            teacher_scorer=pair.teacher_scorer,
            prompt_ids=pair.prompt_ids,
            vocab_size=pair.vocab_size,
            student_params=sum(p.numel() for p in pair.student.parameters()),
            skip=skipped,
            autocast_dtype=pair.autocast_dtype,
        )
    rows = []
    top_k = diagnostic_top_k(config.objective.top_k)
    temperature = config.objective.teacher_temperature
    if "served_scores" not in skipped:
        rows.append(
            check_served_scores(
                pair.teacher_scorer,
                pair.prompt_ids,
                temperature=temperature,
                top_k=top_k,
                vocab_rows=pair.vocab_size,
                pad_id=tokenizer.pad_token_id,
            )
        )
    if "determinism" not in skipped:
        rollouts = prompt_tail_rollouts(pair.prompt_ids[:4], pad_id=tokenizer.pad_token_id)
        rows.append(check_determinism(pair.teacher_scorer, rollouts, top_k=top_k, temperature=temperature))
    no_weights = "not run for a served teacher: it needs the teacher's weights here"
    rows += [CheckResult(name, "skip", None, no_weights) for name in ("self_distillation_zero", "prompt_logprobs")]
    return [r for r in rows if r.name not in skipped]


def _run_per_teacher(
    config: DistillConfig,
    *,
    n: int,
    prompts_sample: int,
    out: str | Path | None,
    skip: Sequence[str],
    thresholds: ForecastThresholds | None,
    console: Any,
) -> CheckReport:
    """`opd check` of a run with several teachers: each teacher's four groups on the prompts routed to it, into
    `<out>/<name>/`; `<out>/check.json` is the routing table with each teacher's exit code. The returned report
    holds every teacher's rows (its exit code: a hard failure of any, else "unlikely" if any forecast says so)."""
    entries = config.teacher_entries()
    out_dir = Path(out) if out is not None else Path(config.run.out_dir) / f"check-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out_dir / "check.json").exists():
        raise FileExistsError(f"{out_dir / 'check.json'} exists; choose another --out (opd check never replaces it)")
    for entry in entries:  # every teacher's folder, before the first teacher's check runs
        folder = out_dir / entry.name
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            raise FileExistsError(f"{folder} is not a folder; opd check writes teacher {entry.name}'s rows there")
        if (folder / "check.json").exists():
            raise FileExistsError(
                f"{folder / 'check.json'} exists (teacher {entry.name}'s); choose another --out (opd check never "
                f"replaces it)"
            )
    prompts = _load_run_prompts(config)
    if not prompts:
        raise ValueError(f"data.path {config.data.path}: no prompts")
    owners = route_prompts(prompts, entries)  # a prompt no route (or two) takes: one line, before any model loads
    check_routes_match(config, prompts, owners)  # and a route that takes no prompt
    with locked(out_dir, "check", console=console):  # held throughout: one check per directory
        combined = CheckReport()
        table: dict[str, Any] = {}
        for i, entry in enumerate(entries):
            mine = [p for p, owner in zip(prompts, owners) if owner == i]
            live = entry.path == STUDENT
            # the live student is checked as its initial weights (student_init): the same weights at step 0
            fields = entry.model_dump(include=set(TeacherSpec.model_fields))
            spec = TeacherSpec(**({**fields, "path": config.student.path} if live else fields))
            single = config.model_copy(
                update={
                    "teacher": spec,
                    "teachers": None,
                    "teacher_offload": bool(entry.offload),
                    "objective": config.objective.model_copy(update={"teacher_temperature": entry.temperature}),
                }
            )
            table[entry.name] = {"route": entry.route.describe() if entry.route else "all", "prompts": len(mine)}
            if not mine:
                table[entry.name]["exit_code"] = None
                continue
            console.print(
                f"[bold]teacher {entry.name}[/]: {len(mine)} of {len(prompts)} prompts ({table[entry.name]['route']})"
            )
            report = run_check(
                single,
                n=n,
                prompts_sample=prompts_sample,
                out=out_dir / entry.name,
                skip=skip,
                thresholds=thresholds,
                console=console,
                prompts=mine,
                view=entry if entry.view is not None else None,
                live_student=live,
                route=f"teacher {entry.name}'s route ({table[entry.name]['route']}, {len(mine)} prompts)",
            )
            table[entry.name].update(exit_code=report.exit_code(), check=f"{entry.name}/check.json")
            combined.results += report.results
            if report.verdict == "unlikely" or "forecast" not in combined.values:
                combined.values["forecast"] = {"verdict": report.verdict}
        atomic_write_json(out_dir / "check.json", {"exit_code": combined.exit_code(), "teachers": table})
    console.print(f"check.json: {out_dir / 'check.json'} (exit code {combined.exit_code()})")
    return combined


def sample_prompts(prompts: Sequence[Any], count: int, seed: int) -> list[Any]:
    """`count` prompts drawn without replacement (seeded), in file order; all when there are fewer."""
    if count >= len(prompts):
        return list(prompts)
    chosen = sorted(random.Random(seed).sample(range(len(prompts)), count))
    return [prompts[i] for i in chosen]


@dataclass
class _LoadedPair:
    """Both models as the run would load them, their scorers, and the sample's prompt ids (the student's template).
    `teacher` is None for a served teacher (its scorer is the server's client), the student itself for the live
    student (`live`)."""

    student: torch.nn.Module
    teacher: torch.nn.Module | None
    student_scorer: LocalScorer
    teacher_scorer: Any
    vocab_size: int
    weights_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    prompt_ids: list[list[int]]
    live: bool = False


def _load_run_prompts(config: DistillConfig) -> list[Any]:
    data = config.data
    return load_prompts(
        data.path,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        id_key=data.id_key,
        split=data.split,
        limit=data.limit,
    )


def _tokenizers_and_sample(
    config: DistillConfig, prompts_sample: int, prompts: Sequence[Any] | None = None
) -> tuple[Any, Any, list[Any]]:
    """Both tokenizers (the teacher's None when it is served) and the seeded prompt sample of `prompts` (default:
    `data.path`'s); no prompts is a one-line ValueError."""
    data, teacher = config.data, config.teacher
    assert teacher is not None  # run_check refuses a config without a teacher
    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    teacher_tokenizer = (
        None if teacher.path is None else load_tokenizer(teacher.path, trust_remote_code=teacher.trust_remote_code)
    )
    prompts = _load_run_prompts(config) if prompts is None else list(prompts)
    if not prompts:
        raise ValueError(f"data.path {data.path}: no prompts")
    return student_tokenizer, teacher_tokenizer, sample_prompts(prompts, prompts_sample, config.run.seed)


def _tokenizer_rows(
    config: DistillConfig, student_tokenizer: Any, teacher_tokenizer: Any, sample: Sequence[Any], served: Any = None
) -> list[CheckResult]:
    """The tokenizers group, with the models' output rows and EOS ids read from their files (no weights); for a
    `served` teacher (its `RemoteScorer`) from the server's /info."""
    if served is not None:
        return check_served_tokenizers(
            student_tokenizer, served, student_rows=_from_files(config.student, student_tokenizer)[0]
        )
    (rows_s, eos_s), (rows_t, eos_t) = (
        _from_files(config.student, student_tokenizer),
        _from_files(config.teacher, teacher_tokenizer),
    )
    return check_tokenizers(
        student_tokenizer,
        teacher_tokenizer,
        messages=sample[0].messages,
        enable_thinking=config.data.enable_thinking,
        student_rows=rows_s,
        teacher_rows=rows_t,
        student_eos_ids=eos_s,
        teacher_eos_ids=eos_t,
    )


def _is_cross(config: DistillConfig, student_tokenizer: Any, teacher_tokenizer: Any) -> bool:
    """Whether the teacher scores the student's text under its own tokenizer (`resolve_tokenizer_mode`; a served
    one's tokenizer is its `tokenizer_path`'s: without one it scores the student's ids)."""
    return resolve_tokenizer_mode(config.teacher, student_tokenizer, teacher_tokenizer) == "cross"


def _cross_checks(
    report: CheckReport,
    config: DistillConfig,
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    sample: Sequence[Any],
    *,
    n: int,
    thresholds: ForecastThresholds,
    skipped: set[str],
    forecast_too: bool,
    route: str | None,
    served: Any = None,
) -> None:
    """A teacher of another vocabulary, into `report`: the `cross_tokenizer` row on the sample's texts and answers
    (before any weights load: a hard failure stops there), then, unless skipped (or `forecast_too` is off: a
    teacher with a view), the forecast on the aligned signal (`CrossForecastScorer`: the training step's
    `start_cross_scoring`), whose rollouts add their alignment shares to the `cross_tokenizer` row. The scoring
    and resources rows score the student's ids with the teacher and are not run here (`opd distill`'s startup runs
    the cross row and its memory and step-time rows on the loaded models). `served`: a served teacher's
    `RemoteScorer` (`teacher_tokenizer` its tokenizer_path's): its EOS and context as `load_cross_teacher` reads
    them (the tokenizer's EOS, /info's max_positions), and its scores over the wire."""
    assert config.teacher is not None
    if served is not None:
        teacher_eos = eos_token_ids(None, teacher_tokenizer)
        positions = served.info.get("max_positions")
    else:
        teacher_eos, positions = _from_files(config.teacher, teacher_tokenizer)[1], None
    cross = build_cross_vocab(
        student_tokenizer,
        teacher_tokenizer,
        student_eos_ids=_from_files(config.student, student_tokenizer)[1],
        teacher_eos_id=next(iter(teacher_eos), None),
        teacher_positions=positions if isinstance(positions, int) else None,
        credit=config.teacher.span_credit,
    )
    row = check_cross_tokenizer(cross, student_tokenizer, cross_sample_texts(list(sample), limit=len(sample)))
    if "cross_tokenizer" not in skipped:
        report.results.append(row)
    not_run = "not run for a cross-vocabulary teacher: it scores the student's ids"
    report.results += [
        CheckResult(name, "skip", None, not_run)
        for name in CHECKS
        if CHECKS[name] in ("scoring", "resources") and name not in skipped
    ]
    if "forecast" in skipped:
        return
    if row.status == "fail" or not forecast_too:
        why = (
            "the cross_tokenizer row failed: the student's text would train with no teacher signal"
            if row.status == "fail"
            else "a teacher with a view: it scores the student's prompt ids"
        )
        report.results.append(CheckResult("forecast", "skip", None, f"not run: {why}"))
        return
    _cross_forecast(
        report,
        config,
        cross,
        student_tokenizer,
        teacher_tokenizer,
        sample,
        n=n,
        thresholds=thresholds,
        skipped=skipped,
        route=route,
        served=served,
    )
    shares = cross_metrics([cross])
    if shares and "cross_tokenizer" not in skipped:
        row.detail += (
            f"; on the forecast's rollouts: {shares['xtok/exact_frac']:.1%} exact, {shares['xtok/span_frac']:.1%} "
            f"by span, {shares['xtok/unmapped_frac']:.1%} unmapped, mean span {shares['xtok/mean_span_len']:.2f}"
            + "".join(
                f", {int(v)} rows {k.removeprefix('xtok/rows_')}"
                for k, v in shares.items()
                if k.startswith("xtok/rows_") and v
            )
        )
        report.values["cross_tokenizer"] = {"rollouts": shares}


def _cross_forecast(
    report: CheckReport,
    config: DistillConfig,
    cross: Any,
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    sample: Sequence[Any],
    *,
    n: int,
    thresholds: ForecastThresholds,
    skipped: set[str],
    route: str | None,
    served: Any = None,
) -> None:
    """The forecast of a cross-vocabulary teacher (`_forecast_group` with a `CrossForecastScorer`); the teacher's
    accuracy from its own samples of its own rendering of the prompts, graded with its tokenizer. A `served`
    teacher (its `RemoteScorer`) scores the teacher ids over the wire and, as any served teacher, has no accuracy
    (no samples of its own)."""
    data, spec = config.data, config.teacher
    assert spec is not None
    device = resolve_device(config.student.device)
    weights_dtype, autocast_dtype = training_precision(config.student, device)
    student, _ = load_model(
        config.student.path,
        dtype=autocast_dtype or weights_dtype,
        device=device,
        trust_remote_code=config.student.trust_remote_code,
        attn_implementation=config.student.attn_implementation,
    )
    teacher = None if served is not None else _load_teacher_module(spec)
    length = data.max_prompt_length + config.rollout.max_new_tokens
    for model in (student, teacher):
        if model is not None:
            fix_rope(model, length)
    student_rows = int(cast(Any, student).get_output_embeddings().weight.shape[0])
    vocab_size = check_tokenizer_compatibility(
        student_tokenizer, student_tokenizer, student_vocab_size=student_rows
    ).tokenizer_size
    score_tokens = config.score_batch_tokens
    teacher_vocab = len(teacher_tokenizer)
    if teacher is not None:
        teacher_vocab = min(teacher_vocab, int(cast(Any, teacher).get_output_embeddings().weight.shape[0]))
    encoded = encode_prompts(
        student_tokenizer,
        sample,
        max_prompt_length=data.max_prompt_length,
        enable_thinking=data.enable_thinking,
        template=data.template,
    )
    own = encode_prompts(
        teacher_tokenizer,
        encoded.prompts,
        max_prompt_length=1 << 30,
        enable_thinking=data.enable_thinking,
        template=data.template,
    ).input_ids
    scorer = CrossForecastScorer(
        cross,
        served
        if teacher is None
        else LocalScorer(teacher, max_tokens_per_batch=score_tokens, vocab_size=teacher_vocab),
        LocalScorer(student, max_tokens_per_batch=score_tokens, vocab_size=vocab_size),
        {tuple(s): t for s, t in zip(encoded.input_ids, own)},
        temperature=config.rollout.temperature,
    )
    pair = _LoadedPair(
        student, None, scorer.student_scorer, scorer, vocab_size, weights_dtype, autocast_dtype, encoded.input_ids
    )
    _forecast_group(
        report,
        config,
        pair,
        student_tokenizer,
        sample,
        n=n,
        thresholds=thresholds,
        skipped=skipped,
        route=route,
        teacher_accuracy=None if teacher is None else (teacher, teacher_tokenizer, teacher_vocab, encoded.prompts),
    )


def _from_files(spec: Any, tokenizer: Any) -> tuple[int | None, list[int]]:
    """(output rows, EOS ids) of a model spec's files, no weights loaded."""
    return rows_and_eos_from_files(spec.path, tokenizer, trust_remote_code=spec.trust_remote_code)


def _load_pair(
    config: DistillConfig,
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    sample: Sequence[Any],
    served: Any = None,
    live: bool = False,
) -> _LoadedPair:
    """Load the student in the run's precision, and the teacher unless it is `served` (its `RemoteScorer`) or the
    `live` student (the student scores as its own teacher, as distill's `path: student`); build the scorers and
    encode the sample (setup)."""
    data, teacher_spec = config.data, config.teacher
    assert teacher_spec is not None  # run_check refuses a config without a teacher
    device = resolve_device(config.student.device)
    weights_dtype, autocast_dtype = training_precision(config.student, device)
    student, _ = load_model(
        config.student.path,
        dtype=autocast_dtype or weights_dtype,
        device=device,
        trust_remote_code=config.student.trust_remote_code,
        attn_implementation=config.student.attn_implementation,
    )
    student_rows = int(student.get_output_embeddings().weight.shape[0])
    teacher: torch.nn.Module | None = None
    teacher_scorer: Any = served
    if served is not None:
        vocab_size = served.check_tokenizer(student_tokenizer, student_rows=student_rows).tokenizer_size
    else:
        module: Any = student if live else _load_teacher_module(teacher_spec)
        teacher = module
        vocab_size = check_tokenizer_compatibility(
            student_tokenizer,
            teacher_tokenizer,
            student_vocab_size=student_rows,
            teacher_vocab_size=module.get_output_embeddings().weight.shape[0],
        ).tokenizer_size
    # one RoPE table per run, as distill fixes it (`opd.models.fix_rope`): the checks see the distributions it trains
    length = data.max_prompt_length + config.rollout.max_new_tokens
    for model in {id(m): m for m in (student, teacher) if m is not None}.values():
        fix_rope(model, length)
    if served is not None:
        served.check_rope(length)
    student_scorer = LocalScorer(student, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size)
    if served is None:
        teacher_scorer = (
            student_scorer
            if live
            else LocalScorer(module, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size)
        )
    encoded = encode_prompts(
        student_tokenizer,
        sample,
        max_prompt_length=data.max_prompt_length,
        enable_thinking=data.enable_thinking,
        template=data.template,
    )
    return _LoadedPair(
        student,
        teacher,
        student_scorer,
        teacher_scorer,
        vocab_size,
        weights_dtype,
        autocast_dtype,
        encoded.input_ids,
        live,
    )


def _load_teacher_module(spec: TeacherSpec) -> torch.nn.Module:
    """The teacher loaded in process from `spec.path`, as the run loads it."""
    assert spec.path is not None  # a teacher in process is loaded from teacher.path
    device = resolve_device(spec.device)
    module, _ = load_model(
        spec.path,
        dtype=resolve_dtype(spec.dtype, device),
        device=device,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    return module


def _view_row(
    config: DistillConfig, pair: _LoadedPair, tokenizer: Any, prompt: Any, entry: TeacherEntry
) -> CheckResult:
    """`teacher_view` on the sample's first prompt: the teacher's scores after the student's prompt and after its
    view of it (as distill's startup row)."""
    teacher_ids = encode_prompts(
        tokenizer,
        view_prompts([prompt], entry, [True]),
        max_prompt_length=1 << 30,  # the context may take the prompt past data.max_prompt_length
        enable_thinking=config.data.enable_thinking,
    ).input_ids[0]
    probe = ViewProbe(
        entry.name,
        pair.teacher_scorer,
        list(pair.prompt_ids[0]),
        list(teacher_ids),
        float(entry.temperature or 1.0),
        # the live student scores under its autocast, as in distill
        functools.partial(autocast, next(pair.student.parameters()).device, pair.autocast_dtype)
        if pair.live
        else contextlib.nullcontext,
    )
    return check_teacher_views([probe], pad_id=tokenizer.pad_token_id)


def _forecast_group(
    report: CheckReport,
    config: DistillConfig,
    pair: _LoadedPair,
    tokenizer: Any,
    sample: Sequence[Any],
    *,
    n: int,
    thresholds: ForecastThresholds,
    skipped: set[str],
    route: str | None = None,
    teacher_accuracy: tuple[torch.nn.Module, Any, int, list[Any]] | None = None,
) -> None:
    """The forecast's rows and its record (verdict, values, thresholds) into `report`; `route`: see run_check.
    `teacher_accuracy`: (model, tokenizer, vocabulary size, the prompts the student's rollouts answer) of a teacher
    whose samples `forecast` cannot draw with the student's tokenizer (a cross-vocabulary one): its accuracy is
    sampled here, as `forecast` samples it, on its own rendering of those prompts."""
    data, teacher = config.data, config.teacher
    assert teacher is not None  # run_check refuses a config without a teacher
    episodes = None
    if config.rollout.tools is not None:  # the run's episodes, with the environment distill builds
        from opd.train.episodes import rollout_environment

        try:
            environment = rollout_environment(config, tokenizer)
        except ValueError as error:  # e.g. the python tool where the sandbox does not hold (the sandbox row says)
            report.results.append(CheckResult("forecast", "skip", None, f"not run: {error}"))
            return
        if teacher_accuracy is not None:
            report.results.append(
                CheckResult("forecast", "skip", None, "not run: a cross-vocabulary teacher does not score episodes")
            )
            return
        episodes = EpisodeSampling(config, environment)
    values = forecast(
        pair.student,
        pair.teacher if pair.teacher is not None else pair.teacher_scorer,
        tokenizer,
        sample,
        n=n,
        top_k=diagnostic_top_k(config.objective.top_k),
        temperature=config.rollout.temperature,
        teacher_temperature=config.objective.teacher_temperature,
        max_new_tokens=config.rollout.max_new_tokens,
        max_prompt_length=data.max_prompt_length,
        enable_thinking=data.enable_thinking,
        template=data.template,
        batch_size=max(1, min(len(sample), config.rollout.batch_size // n)),
        score_batch_tokens=config.score_batch_tokens,
        seed=config.run.seed,
        vocab_size=pair.vocab_size,
        episodes=episodes,
    )
    if teacher_accuracy is not None and values["student_accuracy"] is not None:
        model, teacher_tokenizer, teacher_vocab, kept = teacher_accuracy
        values["teacher_accuracy"] = sample_accuracy(
            model,
            teacher_tokenizer,
            kept,
            n=n,
            temperature=config.objective.teacher_temperature,
            max_new_tokens=config.rollout.max_new_tokens,
            max_prompt_length=1 << 30,  # the student's length limit already chose the prompts
            enable_thinking=data.enable_thinking,
            template=data.template,
            batch_size=max(1, min(len(sample), config.rollout.batch_size // n)),
            seed=config.run.seed,
            vocab_size=teacher_vocab,
        )
    rows, verdict = forecast_rows(
        values,
        thresholds,
        student=config.student.path,
        teacher=STUDENT if pair.live else _teacher_argument(teacher),
        served=teacher.url is not None,
        prompts=data.path,
        n=n,
        prompts_sample=len(sample),
        route=route,
    )
    report.results += [r for r in rows if r.name not in skipped or r.name == "forecast"]
    report.values["forecast"] = {
        **verdict,
        "values": values,
        "n": n,
        "prompts_sample": len(sample),
        "thresholds": thresholds.model_dump(),
    }


def _teacher_argument(teacher: TeacherSpec) -> str | list[str]:
    """What names the teacher in a recovery command: its path, or its server's URL (every replica's)."""
    if teacher.path is not None:
        return teacher.path
    assert teacher.url is not None  # a teacher has a path or a url (TeacherSpec)
    return teacher.url


def _resources_group(
    report: CheckReport, config: DistillConfig, pair: _LoadedPair, tokenizer: Any, skipped: set[str]
) -> None:
    """The memory estimate against free memory, and a timed mini-step scaled to the run's batch, into `report`."""
    if "memory" not in skipped:
        own_teacher = None if pair.live else pair.teacher  # the live student holds nothing of its own
        needs = estimate_memory(
            config,
            pair.student,
            own_teacher,
            compute_dtype=pair.autocast_dtype or pair.weights_dtype,
            weights_dtype=pair.weights_dtype,
        )
        report.results.append(check_memory(needs, loaded=loaded_bytes(pair.student, own_teacher)))
        report.values["memory"] = needs
    if "step_time" not in skipped:
        generator = make_generator(
            pair.student,
            tokenizer,
            max_batch_size=config.rollout.batch_size,
            vocab_size=pair.vocab_size,
            engine=config.rollout.engine,
        )
        timings = mini_step(
            config,
            generator=generator,
            student=pair.student,
            student_scorer=pair.student_scorer,
            teacher_scorer=pair.teacher_scorer,
            prompt_ids=pair.prompt_ids,
            pad_id=tokenizer.pad_token_id,
            vocab_size=pair.vocab_size,
            autocast_dtype=pair.autocast_dtype,
        )
        report.results.append(check_step_time(config, timings))
        report.values["mini_step"] = timings


def _finish(report: CheckReport, out_dir: Path, console: Any) -> CheckReport:
    """Rows in table order, check.json written, the table, the forecast and its recovery printed (cleanup)."""
    order = {name: i for i, name in enumerate(CHECKS)}
    report.results.sort(key=lambda r: order[r.name])
    atomic_write_json(out_dir / "check.json", jsonable(report.to_json()))
    console.print(render_table(report))
    verdict = report.values.get("forecast")
    if verdict:
        thin = verdict["recovery"] == "more_rollouts"  # too few rollouts: no verdict either way
        head = "[bold]no verdict[/]:" if thin else f"[bold]{verdict['verdict']}[/] to improve —"
        console.print(f"forecast: {head} {'; '.join(verdict['reasons'])}")
        if verdict["command"]:
            console.print(f"recovery: {verdict['command']}", markup=False, highlight=False)
    console.print(f"check.json: {out_dir / 'check.json'} (exit code {report.exit_code()})")
    return report
