"""The forecast group of `opd check`: from n student rollouts on a prompt sample, scored as one OPD step scores them
(`opd.eval.prompt_scores.score_prompts`), the SPEC §6 overlap metrics, the sequence-reward AUROC, student and teacher
accuracy → likely / uncertain / unlikely to improve (`classify`), and the recovery command. Its rows are never hard.
A teacher of another vocabulary scores through `CrossForecastScorer` (the training step's cross path, SPEC §9).

Omitted on purpose: a forecast for sampled-token OPD other than through the same top-k metrics (the diagnostics always
look at a top-16 support, as the trainer's do).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from pydantic import Field

from opd.check.report import CheckResult, Status
from opd.config import Section
from opd.data.templates import encode_prompts
from opd.eval.grading import grade_responses
from opd.eval.prompt_scores import score_prompts
from opd.objectives import auroc, opd_diagnostics_from_scores, seq_rewards
from opd.rollout import SamplingParams, make_generator
from opd.rollout.batch import build_rollouts
from opd.seeds import SALT_CHECK_ACCURACY, derive_seed


class ForecastThresholds(Section):
    """Where the step-0 signals classify a pair. Sources: the paper (arXiv 2604.13016) states the directions — OPD
    succeeds when the student and teacher share thinking patterns (high initial top-k overlap, shared tokens holding
    97–99 % of the mass, an overlap advantage near 0 that climbs) and the teacher has something new (it solves what
    the student cannot); the numbers below are from the lab's measured pairs (docs/lab.md, "opd check's forecast")."""

    nothing_overlap_ratio: float = Field(
        0.99,
        ge=0,
        le=1,
        description="With overlap ratio ≥ this and overlap advantage ≥ nothing_overlap_advantage "
        "the teacher's top-k distribution is the student's: nothing to learn (the lab's student as its own teacher "
        "sits at both bounds: docs/performance.md).",
    )
    nothing_overlap_advantage: float = Field(-0.005, le=0, description="See nothing_overlap_ratio (nats; ≤ 0).")
    min_accuracy_gain: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Teacher minus student accuracy on the sample below this: the teacher solves "
        "nothing the student cannot (the paper's condition (ii)); only with answers.",
    )
    fail_overlap_advantage: float = Field(
        -0.2,
        le=0,
        description="Overlap advantage below this (nats): thinking patterns differ (between the lab's "
        "matched and rewrite-style teachers at step 0: docs/performance.md).",
    )
    ok_overlap_advantage: float = Field(
        -0.15, le=0, description="Overlap advantage at or above this counts as aligned (nats)."
    )
    min_shared_mass: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Shared top-k tokens should hold most of both models' mass (the paper: 97–99 % "
        "in successful runs); below this on either side counts against alignment.",
    )
    min_auroc: float = Field(
        0.6,
        ge=0,
        le=1,
        description="Sequence-reward AUROC (correct vs wrong student rollouts) at or above this: "
        "the teacher's reward knows right from wrong; below fail_auroc it does not.",
    )
    fail_auroc: float = Field(0.55, ge=0, le=1, description="See min_auroc.")
    # 32: below it the step-0 estimates are noise next to the bands they are compared with — a student accuracy from
    # k < 32 rollouts has a standard error up to sqrt(0.25 / k) > 0.088, far above min_accuracy_gain (0.05), and an
    # AUROC of k rollouts split into right and wrong ones one of about sqrt((k + 1) / (12 · k/2 · k/2)) > 0.1 at
    # chance (Hanley–McNeil), twice the band between fail_auroc and min_auroc. `opd check`'s default (4 × 64 = 256
    # rollouts) is eight times this floor.
    min_rollouts: int = Field(
        32,
        ge=1,
        description="Fewer student rollouts than this behind the forecast: the evidence is too thin for a verdict "
        "(uncertain, recovery more_rollouts), except that a teacher whose top-k distribution is the student's is "
        "told on any number of tokens.",
    )


FORECAST_METRICS = (
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


def classify(values: dict[str, float | None], th: ForecastThresholds | None = None) -> dict[str, Any]:
    """The verdict from step-0 signals (`values`: FORECAST_METRICS, `seq_reward_auroc`, `student_accuracy`,
    `teacher_accuracy`; None where unknown). Returns {verdict: likely | uncertain | unlikely, reasons: [...],
    recovery: none | cold_start | prompt_selection | other_teacher | more_rollouts}. Rules, in order:
      0. the teacher's top-k distribution equals the student's (overlap ratio and advantage at their `nothing_*`
         bounds) → unlikely, other_teacher: nothing to teach, whatever the number of rollouts;
      0b. fewer than `min_rollouts` student rollouts (`values["rollouts"]`, when given) → uncertain, more_rollouts:
         the evidence is too thin for any other verdict;
      1. nothing to teach (→ unlikely, other_teacher): the teacher's accuracy is not `min_accuracy_gain` above;
      2. mismatch (→ unlikely, cold_start): overlap advantage < fail_overlap_advantage, or AUROC < fail_auroc;
      3. likely (recovery none): overlap advantage ≥ ok_overlap_advantage, shared mass ≥ min_shared_mass on both
         sides and AUROC ≥ min_auroc (each when known);
      4. otherwise uncertain (→ prompt_selection: keep the prompts where the two already agree)."""
    th = th or ForecastThresholds()
    v = {k: values.get(k) for k in (*FORECAST_METRICS, "seq_reward_auroc", "student_accuracy", "teacher_accuracy")}
    adv, ratio, auroc = v["overlap_advantage"], v["overlap_ratio"], v["seq_reward_auroc"]
    reasons: list[str] = []
    if (
        ratio is not None
        and adv is not None
        and ratio >= th.nothing_overlap_ratio
        and adv >= th.nothing_overlap_advantage
    ):
        reasons.append(
            f"the teacher's top-k distribution is the student's (overlap ratio {ratio:.3f}, advantage "
            f"{adv:.4f}): nothing to learn"
        )
    rollouts = values.get("rollouts")
    thin = rollouts is not None and rollouts < th.min_rollouts
    if reasons and thin:  # the accuracy gain below is an estimate, and noise on so few rollouts
        return {"verdict": "unlikely", "reasons": reasons, "recovery": "other_teacher"}
    if thin:
        return {
            "verdict": "uncertain",
            "reasons": [
                f"evidence too thin: {int(cast(float, rollouts))} student rollouts, fewer than the {th.min_rollouts} a "
                f"forecast needs"
            ],
            "recovery": "more_rollouts",
        }
    if (
        v["teacher_accuracy"] is not None
        and v["student_accuracy"] is not None
        and v["teacher_accuracy"] - v["student_accuracy"] < th.min_accuracy_gain
    ):
        reasons.append(
            f"the teacher solves no more than the student (accuracy {v['teacher_accuracy']:.3f} vs "
            f"{v['student_accuracy']:.3f}, gain < {th.min_accuracy_gain})"
        )
    if reasons:
        return {"verdict": "unlikely", "reasons": reasons, "recovery": "other_teacher"}
    if adv is not None and adv < th.fail_overlap_advantage:
        reasons.append(f"overlap advantage {adv:.3f} < {th.fail_overlap_advantage}: the two think differently")
    if auroc is not None and auroc < th.fail_auroc:
        reasons.append(
            f"sequence-reward AUROC {auroc:.3f} < {th.fail_auroc}: the teacher's reward does not tell the "
            f"student's right answers from wrong ones"
        )
    if reasons:
        return {"verdict": "unlikely", "reasons": reasons, "recovery": "cold_start"}
    good: list[str] = []
    if adv is not None:
        (good if adv >= th.ok_overlap_advantage else reasons).append(f"overlap advantage {adv:.3f}")
    for side in ("student", "teacher"):
        mass = v[f"overlap_mass_{side}"]
        if mass is not None:
            (good if mass >= th.min_shared_mass else reasons).append(f"shared mass ({side}) {mass:.3f}")
    if auroc is not None:
        (good if auroc >= th.min_auroc else reasons).append(f"sequence-reward AUROC {auroc:.3f}")
    if not reasons:
        return {"verdict": "likely", "reasons": good, "recovery": "none"}
    return {"verdict": "uncertain", "reasons": [f"borderline: {r}" for r in reasons], "recovery": "prompt_selection"}


def recovery_command(
    recovery: str,
    *,
    student: str,
    teacher: str | Sequence[str],
    prompts: str,
    n: int = 4,
    prompts_sample: int = 64,
    min_rollouts: int = 32,
    route: str | None = None,
    served: bool = False,
) -> str:
    """The command line of a recovery (empty for none); `n` × `prompts_sample` the forecast's own sample. `route`:
    the prompts of `prompts` it concerns, when not all (one teacher's route of several), named after the command;
    `opd check` is then re-run on the run's own config (its `teachers:` list), without --student and --teacher.
    `teacher`: the teacher's model path, or with `served` its server's URL or replicas' URLs (`teacher.url`)."""
    command = _recovery_command(
        recovery,
        student=student,
        teacher=teacher,
        prompts=prompts,
        n=n,
        prompts_sample=prompts_sample,
        min_rollouts=min_rollouts,
        models="" if route is not None else f"--student {student} {_teacher_option(teacher, served)} ",
        served=served,
    )
    if not command or route is None or recovery == "other_teacher":
        return command
    separator = "; " if "   # " in command else "   # "
    return f"{command}{separator}on the prompts of {route}"


def _recovery_command(
    recovery: str,
    *,
    student: str,
    teacher: str | Sequence[str],
    prompts: str,
    n: int,
    prompts_sample: int,
    min_rollouts: int,
    models: str,
    served: bool,
) -> str:
    """recovery_command's command line; `models`: opd check's --student and --teacher (or nothing)."""
    if recovery == "more_rollouts":
        need = -(-min_rollouts // max(1, n))  # prompts at this n
        return (
            f"opd check {models}--prompts {prompts} --n {n} --prompts-sample "
            f"{need}   # with the same config and overrides; or --n {-(-min_rollouts // max(1, prompts_sample))} "
            f"on {prompts_sample} prompts: ≥ {min_rollouts} rollouts in all"
        )
    if recovery == "cold_start" and served:  # its SFT answers are the teacher's own generations, from its weights
        return "# a served teacher cannot write the cold start's SFT answers: run it with its model as teacher.path"
    if recovery == "cold_start":
        return (
            f"opd pipeline run configs/pipeline_cold_start_qwen3.yaml student.path={student} "
            f"teacher.path={teacher} sft_prompts.path={prompts} opd_prompts.path={prompts} "
            f"out_dir=runs/cold_start   # teacher rollouts → SFT of the student → OPD from the SFT checkpoint"
        )
    if recovery == "prompt_selection":
        return (
            f"opd prompts score --student {student} {_teacher_option(teacher, served)} --in {prompts} "
            f"--out scores.jsonl && "
            f"opd prompts select --in {prompts} --scores scores.jsonl --out aligned.jsonl --top 0.5 "
            f"--by overlap_advantage --mix-with {prompts} --ratio 0.3"
        )
    if recovery == "other_teacher":
        return "# no opd command recovers this: choose a teacher that solves what the student cannot"
    return ""


def _teacher_option(teacher: str | Sequence[str], served: bool) -> str:
    """How an opd command names the teacher: `--teacher PATH`, or for a served one the `teacher.url` override with
    every replica (--teacher is a model path; the override's value is read as YAML: `[url, url]` is a list)."""
    if not served:
        return f"--teacher {teacher}"
    urls = teacher if isinstance(teacher, str) else "[" + ",".join(teacher) + "]"
    return shlex.quote(f"teacher.url={urls}")


class _ForecastSums:
    """What `forecast` accumulates over the scored batches (`score_prompts`' on_scored): the token-weighted sums of
    the §6 metrics, the response tokens, each rollout's sequence reward and, with answers, its grade."""

    def __init__(self, tokenizer: Any, answers_known: bool) -> None:
        self.tokenizer, self.answers_known = tokenizer, answers_known
        self.sums: dict[str, float] = {}
        self.tokens = self.metric_tokens = 0  # response tokens; those the top-k metrics are taken on
        self.seq_B: list[torch.Tensor] = []
        self.correct: list[bool] = []

    def on_scored(self, batch: Any, rollouts: Any, student_scores: Any, teacher_scores: Any) -> None:
        mask = rollouts.response_mask
        if teacher_scores.exact is not None:  # a cross teacher: its top-k is the teacher's at exact positions only
            mask = mask & teacher_scores.exact.to(mask.device)
        count = int(mask.sum())
        for key, value in opd_diagnostics_from_scores(
            student_scores, teacher_scores, mask, chunk_size=max(1, mask.shape[1])
        ).items():
            if key in FORECAST_METRICS:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * count  # token-weighted across batches
        self.metric_tokens += count
        self.tokens += int(rollouts.response_mask.sum())
        self.seq_B.append(
            seq_rewards(teacher_scores.sampled_logprobs, student_scores.sampled_logprobs, rollouts.response_mask).cpu()
        )
        if self.answers_known:
            answers = [batch[g].answer for g in rollouts.group_ids.tolist()]
            self.correct.extend(_grade(self.tokenizer, rollouts, answers))


def forecast(
    student: torch.nn.Module,
    teacher: torch.nn.Module | Any,
    tokenizer: Any,
    prompts: Sequence[Any],
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
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Step-0 signals of OPD on `prompts`: n student rollouts per prompt scored by both models exactly as
    `opd prompts score` does (`score_prompts`), the §6 metrics token-means over all rollouts
    (`opd_diagnostics_from_scores`), the sequence-reward AUROC against correctness and the student's accuracy (when
    the prompts carry answers), and the teacher's accuracy on n samples of its own at `teacher_temperature`.
    `teacher`: a model, or any `TeacherScorer` (a served teacher: no samples of its own, no teacher accuracy)."""
    sums, start = _ForecastSums(tokenizer, all(p.answer is not None for p in prompts)), time.perf_counter()
    scores = score_prompts(
        student,
        teacher,
        tokenizer,
        prompts,
        n=n,
        top_k=top_k,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        max_new_tokens=max_new_tokens,
        max_prompt_length=max_prompt_length,
        enable_thinking=enable_thinking,
        template=template,
        batch_size=batch_size,
        score_batch_tokens=score_batch_tokens,
        seed=seed,
        on_scored=sums.on_scored,
    )
    tokens, correct = sums.tokens, sums.correct
    # no exact position (a cross teacher's top-k nowhere exact): the top-k metrics are unknown, not 0
    values: dict[str, Any] = {k: s / sums.metric_tokens for k, s in sums.sums.items()} if sums.metric_tokens else {}
    seq = torch.cat(sums.seq_B) if sums.seq_B else torch.zeros(0)
    values.update(
        seq_reward_mean=float(seq.mean()) if seq.numel() else None,
        rollouts=int(seq.numel()),
        response_tokens=tokens,
        topk_tokens=sums.metric_tokens,  # those the §6 metrics are over (a cross teacher's exact positions)
        scored_prompts=sum(s.skipped is None for s in scores),
        seconds=round(time.perf_counter() - start, 2),
    )
    values["seq_reward_auroc"] = None
    values["student_accuracy"] = values["teacher_accuracy"] = None
    if sums.answers_known and correct:
        labels = torch.tensor(correct)
        values["student_accuracy"] = float(labels.float().mean())
        both = 0 < int(labels.sum()) < len(correct)  # AUROC is undefined with one class only
        values["seq_reward_auroc"] = float(auroc(seq, labels)) if both else None
        values["teacher_accuracy"] = (
            None
            if not isinstance(teacher, torch.nn.Module)
            else sample_accuracy(
                teacher,
                tokenizer,
                prompts,
                n=n,
                temperature=teacher_temperature,
                max_new_tokens=max_new_tokens,
                max_prompt_length=max_prompt_length,
                enable_thinking=enable_thinking,
                template=template,
                batch_size=batch_size,
                seed=seed,
                vocab_size=vocab_size,
            )
        )
    return values


def _grade(tokenizer: Any, rollouts: Any, answers: Sequence[str]) -> list[bool]:
    _, grades = grade_responses(
        tokenizer, rollouts.response_ids, answers, lengths=rollouts.response_mask.sum(-1).tolist()
    )
    return [g.correct for g in grades or []]


@torch.no_grad()
def sample_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    max_prompt_length: int,
    enable_thinking: bool | None,
    template: str,
    batch_size: int,
    seed: int,
    vocab_size: int | None,
) -> float:
    """Mean correctness of n samples per prompt from `model` (the same sampling as the student's rollouts)."""
    encoded = encode_prompts(
        tokenizer, prompts, max_prompt_length=max_prompt_length, enable_thinking=enable_thinking, template=template
    )
    generator = make_generator(model, tokenizer, max_batch_size=batch_size * n, vocab_size=vocab_size)
    device = next(model.parameters()).device
    correct: list[bool] = []
    for index, start in enumerate(range(0, len(encoded.prompts), batch_size)):
        ids = encoded.input_ids[start : start + batch_size]
        params = SamplingParams(
            n=n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=derive_seed(seed, step=index, salt=SALT_CHECK_ACCURACY),
        )
        rollouts = build_rollouts(ids, generator.generate(ids, params), pad_id=tokenizer.pad_token_id, device=device)
        batch = encoded.prompts[start : start + batch_size]
        correct += _grade(tokenizer, rollouts, [batch[g].answer for g in rollouts.group_ids.tolist()])
    return sum(correct) / max(1, len(correct))


def forecast_rows(
    values: dict[str, Any],
    th: ForecastThresholds,
    *,
    student: str,
    teacher: str | Sequence[str],
    prompts: str,
    n: int = 4,
    prompts_sample: int = 64,
    route: str | None = None,
    served: bool = False,
) -> tuple[list[CheckResult], dict[str, Any]]:
    """The forecast's rows (never hard) and its verdict record (`classify` + the recovery command); `n` ×
    `prompts_sample` the sample the forecast was made on (for the more_rollouts command); `teacher`, `route` and
    `served`: see `recovery_command`."""
    verdict = classify(values, th)
    verdict["command"] = recovery_command(
        verdict["recovery"],
        student=student,
        teacher=teacher,
        prompts=prompts,
        n=n,
        prompts_sample=prompts_sample,
        min_rollouts=th.min_rollouts,
        route=route,
        served=served,
    )
    rows = []

    def row(name: str, ok: bool | None, detail: str, fix: str = "") -> None:
        value = values.get(name)
        status: Status = "skip" if value is None else ("pass" if ok else "warn")
        rows.append(CheckResult(name, status, value, detail, "" if status == "pass" else fix))

    adv, auroc = values.get("overlap_advantage"), values.get("seq_reward_auroc")
    row("overlap_ratio", True, "share of the student's top-k ids also in the teacher's top-k (SPEC §6)")
    for side in ("student", "teacher"):
        mass = values.get(f"overlap_mass_{side}")
        row(
            f"overlap_mass_{side}",
            mass is not None and mass >= th.min_shared_mass,
            f"{side} probability on the shared top-k tokens (≥ {th.min_shared_mass}; the paper: 97–99 %)",
            "little shared mass: the two put their probability on different tokens",
        )
    row(
        "overlap_advantage",
        adv is not None and adv >= th.ok_overlap_advantage,
        f"≤ 0, → 0 as the student aligns (aligned ≥ {th.ok_overlap_advantage}, mismatched < "
        f"{th.fail_overlap_advantage})",
        "thinking patterns differ: see the forecast row",
    )
    row("entropy_gap", True, "mean |H_teacher − H_student| (nats)")
    row(
        "seq_reward_auroc",
        auroc is not None and auroc >= th.min_auroc,
        f"does the teacher's sequence reward rank the student's correct rollouts above its wrong ones (≥ "
        f"{th.min_auroc}; chance 0.5)" + ("" if auroc is not None else ": needs answers and both outcomes"),
        "the teacher's reward does not know right from wrong here",
    )
    row("student_accuracy", True, f"the student's {values.get('rollouts')} rollouts at its sampling temperature")
    gain = (
        None
        if values.get("teacher_accuracy") is None or values.get("student_accuracy") is None
        else values["teacher_accuracy"] - values["student_accuracy"]
    )
    row(
        "teacher_accuracy",
        gain is not None and gain >= th.min_accuracy_gain,
        f"the teacher's own samples, as many per prompt (gain ≥ {th.min_accuracy_gain})",
        "the teacher solves no more than the student",
    )
    statuses: dict[str, Status] = {"likely": "pass", "uncertain": "warn", "unlikely": "fail"}
    status = statuses[verdict["verdict"]]
    rows.append(CheckResult("forecast", status, verdict["verdict"], "; ".join(verdict["reasons"]), verdict["command"]))
    return rows, verdict


class CrossForecastScorer:
    """A cross-vocabulary teacher as the forecast's `TeacherScorer` (SPEC §9): each batch of the student's rollouts
    goes through `opd.teacher.cross_vocab.start_cross_scoring`, the function the training step calls (alignment,
    the teacher's own ids, the span signal at every aligned position), so the sequence reward and its AUROC are the
    run's. The §6 top-k metrics need the teacher's own top-k in the student's vocabulary: the teacher's batch is
    scored once more with `top_k` and, at the exact positions, its candidates mapped back (the inverse of the
    exact-string map; a candidate of no counterpart is an id the student's top-k never holds). `exact` marks the
    positions the top-k metrics are taken on (`_ForecastSums`). The student's scores are taken again here (the
    cross path needs them and `score_prompts` passes only their top-k ids: the same forward, the same numbers).
    `cross.counts` gathers the rollouts' alignment shares (`cross_metrics`).

    cross:          the teacher's `CrossVocab`; scorer: its `LocalScorer` over its own vocabulary
    student_scorer: the student's `LocalScorer`; temperature: the student's scoring temperature (its rollouts')
    prompts:        the student's prompt ids (a tuple) → the teacher's rendering of that prompt
    """

    serves_requested_ids = True

    def __init__(
        self,
        cross: Any,
        scorer: Any,
        student_scorer: Any,
        prompts: dict[tuple[int, ...], list[int]],
        *,
        temperature: float,
    ) -> None:
        self.cross, self.scorer, self.student_scorer = cross, scorer, student_scorer
        self.prompts, self.temperature = prompts, temperature
        inverse = torch.full((int(cross.vocab_map.max().item()) + 2,), -1, dtype=torch.long)
        mapped = (cross.vocab_map >= 0).nonzero().flatten()
        inverse[cross.vocab_map[mapped]] = mapped  # the teacher id → a student id of the same bytes
        self.inverse = inverse

    def score(
        self, rollouts: Any, *, top_k: int = 0, requested_ids: Any = None, temperature: float | None = None
    ) -> Any:
        from opd.teacher.base import start_scoring
        from opd.teacher.cross_vocab import _teacher_rollouts, start_cross_scoring
        from opd.types import TokenScores

        student = self.student_scorer.score(rollouts, top_k=top_k, temperature=self.temperature)
        lengths = rollouts.prompt_lengths.tolist()
        prompt_ids = [self.prompts[tuple(rollouts.input_ids[b, :n].tolist())] for b, n in enumerate(lengths)]
        call = start_cross_scoring(
            self.cross, self.scorer, rollouts, student, prompt_ids, top_k=top_k, temperature=temperature
        )
        scores = call.result()
        pad_id = self.cross.teacher_tokenizer.pad_token_id
        batch = _teacher_rollouts(rollouts, call.aligned, prompt_ids, 0 if pad_id is None else pad_id)
        own = start_scoring(self.scorer, batch, top_k=top_k, temperature=temperature).result()
        assert own.topk_ids is not None and own.topk_logprobs is not None  # asked for top_k ≥ 1 (score_prompts)
        device = scores.sampled_logprobs.device
        pos_BT = call.aligned.one_to_one_BT.to(device).clamp(min=0)
        K = own.topk_ids.shape[-1]
        ids_BTK = own.topk_ids.to(device).gather(1, pos_BT[..., None].expand(-1, -1, K))
        ids_BTK = self.inverse.to(device)[ids_BTK.clamp(min=0, max=len(self.inverse) - 1)]
        exact_BT = call.diagnostic_exact_BT.to(device)
        return TokenScores(
            scores.sampled_logprobs,
            torch.where(exact_BT[..., None], ids_BTK, -1),
            own.topk_logprobs.to(device).gather(1, pos_BT[..., None].expand(-1, -1, K)).float(),
            None if own.entropy is None else own.entropy.to(device).gather(1, pos_BT).float(),
            scores.requested_logprobs,
            exact=exact_BT,
        )
