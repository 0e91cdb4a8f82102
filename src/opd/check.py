"""`opd check`: before any GPU hour is spent, whether OPD of this student from this teacher can work, and what to do
if not. Four groups of checks, each row pass / warn / fail with the measured value and the fix:

  tokenizers  `tokenizer_vocab` (identical token → id maps, vocabulary padding rows allowed: `check_tokenizer_
              compatibility`), `special_tokens` (EOS, pad, BOS, UNK, the rest), `chat_template` (one prompt rendered
              by both templates, thinking default / on / off, to the same ids; else the first differing token)
  scoring     `determinism` (the teacher scores the same rows twice), `self_distillation_zero` (the teacher's
              scores of its *own* samples against the log-probs its generation reported: the sampled-token reward
              of a model against itself, ≈ 0), `prompt_logprobs` (both models' per-token NLL of the same rendered
              prompts, against what their sizes predict)
  forecast    from n student rollouts on a prompt sample, scored as one OPD step scores them
              (`opd.data.alignment.score_prompts`): the SPEC §6 overlap metrics, the sequence-reward AUROC, student
              and teacher accuracy → likely / uncertain / unlikely to improve (`classify`), and the recovery command
  resources   `memory` (weights, gradients, AdamW state, the generation KV cache and update activations at the
              configured lengths, against what is free on each device), `step_time` (a measured mini-step scaled to
              the configured batch)

A failed *hard* row (`CheckResult.hard`) stops `opd distill` (which runs the tokenizers, scoring and resources
groups at startup: `preflight`) unless skipped with `--skip-check NAME` / `skip_checks`; forecast rows never stop it.
`opd check` exits with `EXIT_OK`, `EXIT_FAILED`, `EXIT_UNLIKELY`, or 2 for bad input (the CLI's convention).

Omitted on purpose: a forecast for sampled-token OPD other than through the same top-k metrics (the diagnostics always
look at a top-16 support, as the trainer's do), served/vLLM teachers (the in-process `LocalScorer`; the checks take
any `TeacherScorer`, so one plugs in), and a memory model of FSDP sharding (one process per device is estimated).
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from opd.config import DistillConfig, Section
from opd.objectives.diagnostics import diagnostic_top_k
from opd.seeds import SALT_CHECK_ACCURACY, derive_seed

Status = Literal["pass", "warn", "fail", "skip"]

EXIT_OK = 0
"""No hard check failed and the forecast is likely or uncertain (or was not run)."""
EXIT_FAILED = 1
"""A hard check failed: `opd distill` would refuse to start (or run into the problem)."""
EXIT_UNLIKELY = 3
"""No hard check failed, but the forecast says OPD is unlikely to improve the student (follow the recovery)."""

GROUPS: tuple[str, ...] = ("tokenizers", "scoring", "forecast", "resources")
CHECKS: dict[str, str] = {
    "tokenizer_vocab": "tokenizers", "special_tokens": "tokenizers", "chat_template": "tokenizers",
    "determinism": "scoring", "self_distillation_zero": "scoring", "prompt_logprobs": "scoring",
    "overlap_ratio": "forecast", "overlap_mass_student": "forecast", "overlap_mass_teacher": "forecast",
    "overlap_advantage": "forecast", "entropy_gap": "forecast", "seq_reward_auroc": "forecast",
    "student_accuracy": "forecast", "teacher_accuracy": "forecast", "forecast": "forecast",
    "memory": "resources", "step_time": "resources",
}
"""Every row name and its group; `--skip-check` takes a row name, a group name, or `all`."""
PREFLIGHT_GROUPS: tuple[str, ...] = ("tokenizers", "scoring", "resources")
"""What `opd distill` runs at startup (the forecast needs rollouts of a whole prompt sample: `opd check`)."""


def resolve_skips(names: Sequence[str]) -> set[str]:
    """Row names to skip from row / group names and `all`; an unknown name is a one-line ValueError."""
    out: set[str] = set()
    for name in names:
        if name == "all":
            out |= set(CHECKS)
        elif name in GROUPS:
            out |= {row for row, group in CHECKS.items() if group == name}
        elif name in CHECKS:
            out.add(name)
        else:
            raise ValueError(f"skip_checks: unknown check {name!r}; use a row ({', '.join(CHECKS)}), a group "
                             f"({', '.join(GROUPS)}) or all")
    return out


@dataclass
class CheckResult:
    """One row. value: the measured number (or a short text); detail: what was measured; fix: what to do when it is
    not a pass; hard: whether a fail stops `opd distill` (and makes `opd check` exit EXIT_FAILED)."""

    name: str
    status: Status
    value: Any = None
    detail: str = ""
    fix: str = ""
    hard: bool = False

    @property
    def group(self) -> str:
        return CHECKS[self.name]


@dataclass
class CheckReport:
    """All rows plus every measured number (`values`, what check.json holds besides the rows)."""

    results: list[CheckResult] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def hard_failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail" and r.hard]

    @property
    def verdict(self) -> str | None:
        return self.values.get("forecast", {}).get("verdict")

    def exit_code(self) -> int:
        if self.hard_failures:
            return EXIT_FAILED
        return EXIT_UNLIKELY if self.verdict == "unlikely" else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code(),
                "results": [{**asdict(r), "group": r.group} for r in self.results], **self.values}


# ------------------------------------------------------------------------------------------------ 1. tokenizers


def check_tokenizers(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    *,
    messages: Sequence[dict[str, str]],
    enable_thinking: bool | None = None,
    student_rows: int | None = None,
    teacher_rows: int | None = None,
    student_eos_ids: Sequence[int] = (),
    teacher_eos_ids: Sequence[int] = (),
) -> list[CheckResult]:
    """The tokenizer rows. `messages`: a prompt to render (the first of the set); `enable_thinking`: the mode the run
    uses (its row is hard, the other modes warn); *_rows: output-embedding rows of the models; *_eos_ids: every EOS
    id each model stops on (`opd.models.eos_token_ids`), compared besides the tokenizers' EOS tokens."""
    from opd.models import TokenizerMismatchError, check_tokenizer_compatibility

    rows = []
    try:
        vocab = check_tokenizer_compatibility(student_tokenizer, teacher_tokenizer, student_vocab_size=student_rows,
                                              teacher_vocab_size=teacher_rows)
        padding = (f"; model rows {vocab.student_size} / {vocab.teacher_size} (ids ≥ {vocab.tokenizer_size} are "
                   f"padding)" if vocab.student_size != vocab.teacher_size else "")
        rows.append(CheckResult("tokenizer_vocab", "pass", vocab.tokenizer_size,
                                f"{vocab.tokenizer_size} ids, identical token → id maps{padding}", hard=True))
    except TokenizerMismatchError as error:
        rows.append(CheckResult("tokenizer_vocab", "fail", "mismatch", str(error),
                                "use a teacher with the student's tokenizer (same model family): OPD scores the "
                                "student's token ids with the teacher", hard=True))
    rows.append(_special_tokens(student_tokenizer, teacher_tokenizer, student_eos_ids, teacher_eos_ids))
    rows.append(_chat_templates(student_tokenizer, teacher_tokenizer, messages, enable_thinking))
    return rows


_SPECIAL = ("eos_token", "pad_token", "bos_token", "unk_token")


def _special_tokens(student_tokenizer: Any, teacher_tokenizer: Any, student_eos: Sequence[int],
                    teacher_eos: Sequence[int]) -> CheckResult:
    """EOS must agree (the teacher scores the student's end of turn); pad, BOS, UNK and the other special tokens
    only warn (pad positions are masked; the prompt ids are the student's either way)."""
    differ = {name: (getattr(student_tokenizer, name, None), getattr(teacher_tokenizer, name, None))
              for name in _SPECIAL if getattr(student_tokenizer, name, None) != getattr(teacher_tokenizer, name, None)}
    others = set(student_tokenizer.all_special_tokens) ^ set(teacher_tokenizer.all_special_tokens)
    eos_ids = (set(student_eos) != set(teacher_eos)) if student_eos and teacher_eos else False
    shown = "; ".join(f"{k}: {s!r} vs {t!r}" for k, (s, t) in differ.items())
    if eos_ids:
        shown = "; ".join(x for x in (shown, f"EOS ids {sorted(student_eos)} vs {sorted(teacher_eos)}") if x)
    if others:
        shown = "; ".join(x for x in (shown, f"special tokens only in one: {sorted(others)[:6]}") if x)
    value = f"eos {student_tokenizer.eos_token!r}, pad {student_tokenizer.pad_token!r}"
    if "eos_token" in differ or eos_ids:
        return CheckResult("special_tokens", "fail", value, shown,
                           "the student ends its turns with a token the teacher does not end with; use a teacher "
                           "whose EOS / end-of-turn token (generation_config.eos_token_id) is the student's", hard=True)
    if differ or others:
        return CheckResult("special_tokens", "warn", value, shown,
                           "harmless when the differing tokens never occur in rollouts; check the templates", hard=True)
    return CheckResult("special_tokens", "pass", value, "EOS, pad, BOS, UNK and all special tokens agree", hard=True)


def render_ids(tokenizer: Any, messages: Sequence[dict[str, str]], enable_thinking: bool | None) -> list[int]:
    """The ids the trainer would feed for this prompt (`encode_prompts`: chat template, no added special tokens)."""
    from opd.data.templates import encode_prompts
    from opd.types import Prompt

    encoded = encode_prompts(tokenizer, [Prompt(id="check", messages=list(messages))], max_prompt_length=1 << 30,
                             enable_thinking=enable_thinking)
    return encoded.input_ids[0]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two id lists differ (the shorter length when one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _chat_templates(student_tokenizer: Any, teacher_tokenizer: Any, messages: Sequence[dict[str, str]],
                    enable_thinking: bool | None) -> CheckResult:
    """In OPD the teacher scores the prompt as the *student's* template renders it; where its own template renders
    it differently, the teacher scores text in a format it was not trained on (tinker-cookbook users measured a
    renderer mismatch biasing teacher log-probs by ~0.29 nats/token)."""
    modes = [enable_thinking] + [m for m in (None, True, False) if m != enable_thinking]
    name = {None: "default", True: "thinking on", False: "thinking off"}
    differences = []
    for mode in modes:
        s, t = render_ids(student_tokenizer, messages, mode), render_ids(teacher_tokenizer, messages, mode)
        i = first_difference(s, t)
        if i is None:
            continue

        def token(tokenizer: Any, ids: list[int]) -> str:
            return repr(tokenizer.convert_ids_to_tokens(ids[i])) if i < len(ids) else "(end)"

        differences.append((mode, f"{name[mode]}: first difference at token {i} of {len(s)}/{len(t)}: student "
                                  f"{token(student_tokenizer, s)} vs teacher {token(teacher_tokenizer, t)}"))
    if not differences:
        return CheckResult("chat_template", "pass", "identical", f"same ids with thinking default / on / off "
                           f"({len(render_ids(student_tokenizer, messages, enable_thinking))} tokens)", hard=True)
    fix = ("render prompts the way the teacher was trained: set data.enable_thinking / data.template (or a "
           "system prompt) so both templates agree, or use a teacher of the student's family")
    hard_mode = differences[0][0] == enable_thinking
    detail = "; ".join(text for _, text in differences)
    return CheckResult("chat_template", "fail" if hard_mode else "warn", "differs", detail, fix, hard=True)


# ------------------------------------------------------------------------------------------------- 2. scoring


DETERMINISM_TOLERANCE = 1e-3
"""Max |Δ log-prob| (nats) between two scorings of the same rows that still counts as deterministic (warn, not
fail): run-to-run noise of GPU reductions is ~1e-6 in fp32 and ~1e-2 · |logit| / 2^8 in bf16 at worst; dropout
left on, or a served teacher that batches rows differently, moves log-probs by 1e-2 … 1."""
SELF_ZERO_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Max mean |t(y) − g(y)| (nats/token) between the teacher scorer and its own generation's log-probs. The two paths
compute the same distribution in a different order (KV-cache decode vs one full forward, chunked head): fp32 rounding
gives ~1e-6; 1e-3 leaves room for TF32 matmuls. Half precision: `SELF_ZERO_HALF_TOLERANCE`."""
SELF_ZERO_HALF_TOLERANCE = 0.05
"""bf16/fp16: 8/11-bit mantissas round each logit by up to ~0.4 % (bf16) of its magnitude; differently ordered sums
of ~10-nat logits then differ by ~0.01–0.03 nats per token. A scorer that misaligns positions or drops the
temperature is off by ≥ 0.3 nats/token."""
SIZE_EXPONENT = 0.076
"""α_N of the parameter scaling law L(N) ∝ N^−α_N (Kaplan et al. 2020, eq. 1.1): the NLL ratio two sizes predict."""
PROMPT_NLL_SLACK = 1.5
"""`prompt_logprobs` warns when the teacher's NLL exceeds the size prediction by more than this factor (+ 0.1 nats):
far outside what model size explains, as a wrong checkpoint, random weights or a broken dtype would be."""


def _mask(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return values_BT[mask_BT.bool()]


def _max_abs(delta: torch.Tensor) -> float:
    return float(delta.abs().max()) if delta.numel() else 0.0


def check_determinism(scorer: Any, rollouts: Any, *, top_k: int, temperature: float) -> CheckResult:
    """Score the same rows twice with `scorer` (any `TeacherScorer`); every field must agree."""
    first = scorer.score(rollouts, top_k=top_k, temperature=temperature)
    second = scorer.score(rollouts, top_k=top_k, temperature=temperature)
    mask = rollouts.response_mask.bool()
    worst = _max_abs(first.sampled_logprobs[mask] - second.sampled_logprobs[mask])
    if first.topk_logprobs is not None:
        worst = max(worst, _max_abs(first.topk_logprobs[mask] - second.topk_logprobs[mask]))
    same_ids = first.topk_ids is None or bool(torch.equal(first.topk_ids[mask], second.topk_ids[mask]))
    detail = f"max |Δ log-prob| {worst:.3g} nats over {int(mask.sum())} positions × {top_k} top-k, scored twice"
    fix = ("the teacher must score deterministically: eval mode (no dropout), no sampling in the scorer, the same "
           "batching; OPD's rewards are differences of its log-probs")
    if worst == 0.0 and same_ids:
        return CheckResult("determinism", "pass", 0.0, detail + ": bit-identical", hard=True)
    if worst <= DETERMINISM_TOLERANCE and same_ids:
        return CheckResult("determinism", "warn", worst, detail + f" (≤ {DETERMINISM_TOLERANCE:g}: reduction-order "
                           "noise)", fix, hard=True)
    return CheckResult("determinism", "fail", worst, detail + ("" if same_ids else "; the top-k ids differ"), fix,
                       hard=True)


def check_self_distillation(scorer: Any, rollouts: Any, *, temperature: float, dtype: torch.dtype) -> CheckResult:
    """`rollouts`: the teacher's own samples with the log-probs its generation engine reported
    (`rollout_logprobs`). The sampled-token reward of the teacher against itself, t(y) − g(y), must be ≈ 0."""
    if rollouts.rollout_logprobs is None:
        raise ValueError("check_self_distillation needs rollouts generated with return_logprobs=True")
    mask = rollouts.response_mask.bool()
    scores = scorer.score(rollouts, top_k=0, temperature=temperature, with_entropy=False)
    reward = _mask(scores.sampled_logprobs, mask) - _mask(rollouts.rollout_logprobs.to(scores.sampled_logprobs), mask)
    mean_abs = float(reward.abs().mean()) if reward.numel() else 0.0
    tolerance = SELF_ZERO_TOLERANCE.get(dtype, SELF_ZERO_HALF_TOLERANCE)
    detail = (f"mean |t(y) − g(y)| {mean_abs:.3g} nats/token (mean {float(reward.mean()) if reward.numel() else 0:.3g})"
              f" over {reward.numel()} tokens of {rollouts.batch_size} teacher samples; tolerance {tolerance:g} "
              f"({str(dtype).removeprefix('torch.')})")
    if mean_abs <= tolerance:
        return CheckResult("self_distillation_zero", "pass", mean_abs, detail, hard=True)
    return CheckResult("self_distillation_zero", "fail", mean_abs, detail,
                       "the teacher's scorer disagrees with its own generation: check positions / padding, the "
                       "temperature (objective.teacher_temperature), the dtype and the attention implementation",
                       hard=True)


def nll_of_texts(scorer: Any, ids_per_text: Sequence[Sequence[int]], *, pad_id: int, device: torch.device) -> float:
    """Mean per-token NLL (nats) of token-id texts, teacher-forced: each text's first token is its prompt, the rest a
    response (`build_rollouts`), so any `TeacherScorer` scores it."""
    from opd.rollout.base import GenerationOutput
    from opd.rollout.batch import build_rollouts

    prompts = [list(ids[:1]) for ids in ids_per_text]
    output = GenerationOutput(response_ids=[list(ids[1:]) for ids in ids_per_text],
                              finish_reasons=["stop"] * len(ids_per_text), group_ids=list(range(len(ids_per_text))))
    rollouts = build_rollouts(prompts, output, pad_id=pad_id, device=device)
    lp = scorer.score(rollouts, top_k=0, with_entropy=False).sampled_logprobs
    return float(-_mask(lp, rollouts.response_mask).mean())


def check_prompt_logprobs(nll_student: float, nll_teacher: float, *, student_params: int, teacher_params: int,
                          vocab_size: int) -> CheckResult:
    """Rule: a model of N_t parameters should reach NLL_t ≈ NLL_s · (N_s / N_t)^α_N on the same text (`SIZE_EXPONENT`);
    warn when NLL_t > PROMPT_NLL_SLACK · that + 0.1, fail when either is not finite; skip (uninformative) when the
    student itself does no better than ln V, the NLL of uniform guessing, on the text."""
    predicted = nll_student * (student_params / max(teacher_params, 1)) ** SIZE_EXPONENT
    value = {"student": nll_student, "teacher": nll_teacher, "predicted_teacher": predicted,
             "uniform": math.log(max(vocab_size, 1))}
    detail = (f"per-token NLL of the rendered prompts: student {nll_student:.3f}, teacher {nll_teacher:.3f} nats "
              f"(sizes predict ≈ {predicted:.3f} for the teacher; uniform guessing ln V = {value['uniform']:.2f})")
    if not (math.isfinite(nll_student) and math.isfinite(nll_teacher)):
        return CheckResult("prompt_logprobs", "fail", value, detail, "non-finite log-probs: overflow in fp16? load "
                           "with dtype bf16 or fp32", hard=True)
    if nll_student >= value["uniform"]:
        return CheckResult("prompt_logprobs", "skip", value, detail + ": uninformative, the student does no better "
                           "than uniform guessing on this text (prompt tokens it never trained on, as in the lab)")
    if nll_teacher > PROMPT_NLL_SLACK * predicted + 0.1:
        return CheckResult("prompt_logprobs", "warn", value, detail,
                           "the teacher predicts this text far worse than its size suggests: a wrong or untrained "
                           "checkpoint, another tokenizer's weights, or a dtype problem?", hard=True)
    return CheckResult("prompt_logprobs", "pass", value, detail, hard=True)


# -------------------------------------------------------------------------------------------------- 3. forecast


class ForecastThresholds(Section):
    """Where the step-0 signals classify a pair. Sources: the paper (arXiv 2604.13016) states the directions — OPD
    succeeds when the student and teacher share thinking patterns (high initial top-k overlap, shared tokens holding
    97–99 % of the mass, an overlap advantage near 0 that climbs) and the teacher has something new (it solves what
    the student cannot); the numbers below are from the lab's measured pairs (docs/lab.md, "opd check forecast")."""

    nothing_overlap_ratio: float = Field(
        0.99, ge=0, le=1, description="With overlap ratio ≥ this and overlap advantage ≥ nothing_overlap_advantage "
        "the teacher's top-k distribution is the student's: nothing to learn (lab: the student as its own teacher, "
        "1.000 and 0.000).")
    nothing_overlap_advantage: float = Field(
        -0.005, le=0, description="See nothing_overlap_ratio (nats; ≤ 0).")
    min_accuracy_gain: float = Field(
        0.05, ge=0, le=1, description="Teacher minus student accuracy on the sample below this: the teacher solves "
        "nothing the student cannot (the paper's condition (ii)); only with answers.")
    fail_overlap_advantage: float = Field(
        -0.2, le=0, description="Overlap advantage below this (nats): thinking patterns differ (lab: matched teacher "
        "−0.10, rewrite-style teacher −0.30 at step 0).")
    ok_overlap_advantage: float = Field(
        -0.15, le=0, description="Overlap advantage at or above this counts as aligned (nats).")
    min_shared_mass: float = Field(
        0.9, ge=0, le=1, description="Shared top-k tokens should hold most of both models' mass (the paper: 97–99 % "
        "in successful runs); below this on either side counts against alignment.")
    min_auroc: float = Field(
        0.6, ge=0, le=1, description="Sequence-reward AUROC (correct vs wrong student rollouts) at or above this: "
        "the teacher's reward knows right from wrong; below fail_auroc it does not.")
    fail_auroc: float = Field(0.55, ge=0, le=1, description="See min_auroc.")


FORECAST_METRICS = ("overlap_ratio", "overlap_mass_student", "overlap_mass_teacher", "overlap_advantage",
                    "topk_mass_student", "topk_mass_teacher", "entropy_student", "entropy_teacher", "entropy_gap")


def classify(values: dict[str, float | None], th: ForecastThresholds | None = None) -> dict[str, Any]:
    """The verdict from step-0 signals (`values`: FORECAST_METRICS, `seq_reward_auroc`, `student_accuracy`,
    `teacher_accuracy`; None where unknown). Returns {verdict: likely | uncertain | unlikely, reasons: [...],
    recovery: none | cold_start | prompt_selection | other_teacher}. Rules, in order:
      1. nothing to teach (→ unlikely, other_teacher): the teacher's top-k distribution equals the student's
         (overlap ratio and advantage at their `nothing_*` bounds), or its accuracy is not `min_accuracy_gain` above;
      2. mismatch (→ unlikely, cold_start): overlap advantage < fail_overlap_advantage, or AUROC < fail_auroc;
      3. likely (recovery none): overlap advantage ≥ ok_overlap_advantage, shared mass ≥ min_shared_mass on both
         sides and AUROC ≥ min_auroc (each when known);
      4. otherwise uncertain (→ prompt_selection: keep the prompts where the two already agree)."""
    th = th or ForecastThresholds()
    v = {k: values.get(k) for k in (*FORECAST_METRICS, "seq_reward_auroc", "student_accuracy", "teacher_accuracy")}
    adv, ratio, auroc = v["overlap_advantage"], v["overlap_ratio"], v["seq_reward_auroc"]
    reasons: list[str] = []
    if ratio is not None and adv is not None and ratio >= th.nothing_overlap_ratio and adv >= th.nothing_overlap_advantage:
        reasons.append(f"the teacher's top-k distribution is the student's (overlap ratio {ratio:.3f}, advantage "
                       f"{adv:.4f}): nothing to learn")
    if v["teacher_accuracy"] is not None and v["student_accuracy"] is not None and \
            v["teacher_accuracy"] - v["student_accuracy"] < th.min_accuracy_gain:
        reasons.append(f"the teacher solves no more than the student (accuracy {v['teacher_accuracy']:.3f} vs "
                       f"{v['student_accuracy']:.3f}, gain < {th.min_accuracy_gain})")
    if reasons:
        return {"verdict": "unlikely", "reasons": reasons, "recovery": "other_teacher"}
    if adv is not None and adv < th.fail_overlap_advantage:
        reasons.append(f"overlap advantage {adv:.3f} < {th.fail_overlap_advantage}: the two think differently")
    if auroc is not None and auroc < th.fail_auroc:
        reasons.append(f"sequence-reward AUROC {auroc:.3f} < {th.fail_auroc}: the teacher's reward does not tell the "
                       f"student's right answers from wrong ones")
    if reasons:
        return {"verdict": "unlikely", "reasons": reasons, "recovery": "cold_start"}
    good = []
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


def recovery_command(recovery: str, *, student: str, teacher: str, prompts: str) -> str:
    """The command line of a recovery (empty for none)."""
    if recovery == "cold_start":
        return (f"opd pipeline run configs/pipeline_cold_start_qwen3.yaml student.path={student} "
                f"teacher.path={teacher} sft_prompts.path={prompts} opd_prompts.path={prompts} "
                f"out_dir=runs/cold_start   # teacher rollouts → SFT of the student → OPD from the SFT checkpoint")
    if recovery == "prompt_selection":
        return (f"opd prompts score --student {student} --teacher {teacher} --in {prompts} --out scores.jsonl && "
                f"opd prompts select --in {prompts} --scores scores.jsonl --out aligned.jsonl --top 0.5 "
                f"--by overlap_advantage --mix-with {prompts} --ratio 0.3")
    if recovery == "other_teacher":
        return "# no opd command recovers this: choose a teacher that solves what the student cannot"
    return ""


def forecast(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
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
    the prompts carry answers), and the teacher's accuracy on n samples of its own at `teacher_temperature`."""
    from opd.eval.prompt_scores import score_prompts
    from opd.objectives import auroc, opd_diagnostics_from_scores, seq_rewards

    sums: dict[str, float] = {}
    tokens = 0
    seq_B: list[torch.Tensor] = []
    correct: list[bool] = []
    answers_known = all(p.answer is not None for p in prompts)

    def on_scored(batch, rollouts, student_scores, teacher_scores) -> None:
        nonlocal tokens
        mask = rollouts.response_mask
        count = int(mask.sum())
        for key, value in opd_diagnostics_from_scores(student_scores, teacher_scores, mask,
                                                      chunk_size=max(1, mask.shape[1])).items():
            if key in FORECAST_METRICS:
                sums[key] = sums.get(key, 0.0) + float(value) * count  # token-weighted across batches
        tokens += count
        seq_B.append(seq_rewards(teacher_scores.sampled_logprobs, student_scores.sampled_logprobs, mask).cpu())
        if answers_known:
            correct.extend(_grade(tokenizer, rollouts, [batch[g].answer for g in rollouts.group_ids.tolist()]))

    start = time.perf_counter()
    scores = score_prompts(student, teacher, tokenizer, prompts, n=n, top_k=top_k, temperature=temperature,
                           teacher_temperature=teacher_temperature, max_new_tokens=max_new_tokens,
                           max_prompt_length=max_prompt_length, enable_thinking=enable_thinking, template=template,
                           batch_size=batch_size, score_batch_tokens=score_batch_tokens, seed=seed,
                           on_scored=on_scored)
    values: dict[str, Any] = {k: s / max(tokens, 1) for k, s in sums.items()}
    seq = torch.cat(seq_B) if seq_B else torch.zeros(0)
    values.update(seq_reward_mean=float(seq.mean()) if seq.numel() else None, rollouts=int(seq.numel()),
                  response_tokens=tokens, scored_prompts=sum(s.skipped is None for s in scores),
                  seconds=round(time.perf_counter() - start, 2))
    values["seq_reward_auroc"] = None
    values["student_accuracy"] = values["teacher_accuracy"] = None
    if answers_known and correct:
        labels = torch.tensor(correct)
        values["student_accuracy"] = float(labels.float().mean())
        both = 0 < int(labels.sum()) < len(correct)  # AUROC is undefined with one class only
        values["seq_reward_auroc"] = float(auroc(seq, labels)) if both else None
        values["teacher_accuracy"] = sample_accuracy(teacher, tokenizer, prompts, n=n, temperature=teacher_temperature,
                                                     max_new_tokens=max_new_tokens, max_prompt_length=max_prompt_length,
                                                     enable_thinking=enable_thinking, template=template,
                                                     batch_size=batch_size, seed=seed, vocab_size=vocab_size)
    return values


def _grade(tokenizer: Any, rollouts: Any, answers: Sequence[str]) -> list[bool]:
    from opd.eval.grading import grade_responses

    _, grades = grade_responses(tokenizer, rollouts.response_ids, answers, lengths=rollouts.response_mask.sum(-1).tolist())
    return [g.correct for g in grades or []]


@torch.no_grad()
def sample_accuracy(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Any], *, n: int, temperature: float,
                    max_new_tokens: int, max_prompt_length: int, enable_thinking: bool | None, template: str,
                    batch_size: int, seed: int, vocab_size: int | None) -> float:
    """Mean correctness of n samples per prompt from `model` (the same sampling as the student's rollouts)."""
    from opd.data.templates import encode_prompts
    from opd.rollout import SamplingParams, make_generator
    from opd.rollout.batch import build_rollouts

    encoded = encode_prompts(tokenizer, prompts, max_prompt_length=max_prompt_length, enable_thinking=enable_thinking,
                             template=template)
    generator = make_generator(model, tokenizer, max_batch_size=batch_size * n, vocab_size=vocab_size)
    device = next(model.parameters()).device
    correct: list[bool] = []
    for index, start in enumerate(range(0, len(encoded.prompts), batch_size)):
        ids = encoded.input_ids[start:start + batch_size]
        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                seed=derive_seed(seed, step=index, salt=SALT_CHECK_ACCURACY))
        rollouts = build_rollouts(ids, generator.generate(ids, params), pad_id=tokenizer.pad_token_id, device=device)
        batch = encoded.prompts[start:start + batch_size]
        correct += _grade(tokenizer, rollouts, [batch[g].answer for g in rollouts.group_ids.tolist()])
    return sum(correct) / max(1, len(correct))


def forecast_rows(values: dict[str, Any], th: ForecastThresholds, *, student: str, teacher: str,
                  prompts: str) -> tuple[list[CheckResult], dict[str, Any]]:
    """The forecast's rows (never hard) and its verdict record (`classify` + the recovery command)."""
    verdict = classify(values, th)
    verdict["command"] = recovery_command(verdict["recovery"], student=student, teacher=teacher, prompts=prompts)
    rows = []

    def row(name: str, ok: bool | None, detail: str, fix: str = "") -> None:
        value = values.get(name)
        status: Status = "skip" if value is None else ("pass" if ok else "warn")
        rows.append(CheckResult(name, status, value, detail, "" if status == "pass" else fix))

    adv, auroc = values.get("overlap_advantage"), values.get("seq_reward_auroc")
    row("overlap_ratio", True, "share of the student's top-k ids also in the teacher's top-k (SPEC §6)")
    for side in ("student", "teacher"):
        mass = values.get(f"overlap_mass_{side}")
        row(f"overlap_mass_{side}", mass is not None and mass >= th.min_shared_mass,
            f"{side} probability on the shared top-k tokens (≥ {th.min_shared_mass}; the paper: 97–99 %)",
            "little shared mass: the two put their probability on different tokens")
    row("overlap_advantage", adv is not None and adv >= th.ok_overlap_advantage,
        f"≤ 0, → 0 as the student aligns (aligned ≥ {th.ok_overlap_advantage}, mismatched < "
        f"{th.fail_overlap_advantage})", "thinking patterns differ: see the forecast row")
    row("entropy_gap", True, "mean |H_teacher − H_student| (nats)")
    row("seq_reward_auroc", auroc is not None and auroc >= th.min_auroc,
        f"does the teacher's sequence reward rank the student's correct rollouts above its wrong ones (≥ "
        f"{th.min_auroc}; chance 0.5)" + ("" if auroc is not None else ": needs answers and both outcomes"),
        "the teacher's reward does not know right from wrong here")
    row("student_accuracy", True, f"the student's {values.get('rollouts')} rollouts at its sampling temperature")
    gain = None if values.get("teacher_accuracy") is None or values.get("student_accuracy") is None else \
        values["teacher_accuracy"] - values["student_accuracy"]
    row("teacher_accuracy", gain is not None and gain >= th.min_accuracy_gain,
        f"the teacher's own samples, as many per prompt (gain ≥ {th.min_accuracy_gain})",
        "the teacher solves no more than the student")
    status: Status = {"likely": "pass", "uncertain": "warn", "unlikely": "fail"}[verdict["verdict"]]
    rows.append(CheckResult("forecast", status, verdict["verdict"], "; ".join(verdict["reasons"]),
                            verdict["command"]))
    return rows, verdict


# ------------------------------------------------------------------------------------------------ 4. resources


def _vocab(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _param_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    return sum(p.numel() * (size or p.element_size()) for p in model.parameters())


def estimate_memory(config: DistillConfig, student: torch.nn.Module, teacher: torch.nn.Module | None, *,
                    compute_dtype: torch.dtype, weights_dtype: torch.dtype | None = None) -> dict[str, dict[str, int]]:
    """Bytes per device the run needs, by part. Rules (coarse on purpose: within ~30 % on dense decoders):
      student weights, gradients (weights' dtype) and AdamW state (2 tensors of the weights' dtype);
      generation KV cache: rows × (max_prompt_length + max_new_tokens) × layers × 2 × kv_heads × head_dim at the
      compute dtype, rows = min(rollout.batch_size, prompts_per_step × n);
      update activations of one micro-batch: micro_batch_tokens × (12 · hidden + 3 · intermediate) values per layer,
      or with gradient checkpointing hidden per layer plus one layer's full set;
      the chunked head's float32 temporaries (`opd.scoring.CHUNK_BYTES`, or tokens × vocab when smaller) once per
      model that scores;
      teacher weights (on CPU when teacher_offload) and its no-grad scoring activations (score_batch_tokens × 4 ·
      hidden values)."""
    from opd.scoring import CHUNK_BYTES

    def shape(model: torch.nn.Module) -> dict[str, int]:
        c = model.config
        heads = c.num_attention_heads
        return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "inter": getattr(c, "intermediate_size", 4 * c.hidden_size),
                "kv": getattr(c, "num_key_value_heads", None) or heads,
                "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads}

    cb = torch.empty((), dtype=compute_dtype).element_size()
    s = shape(student)
    weights = _param_bytes(student, weights_dtype)  # training keeps weights_dtype master weights (fp32 with autocast)
    rows = min(config.rollout.batch_size, config.prompts_per_step * config.rollout.n)
    length = config.data.max_prompt_length + config.rollout.max_new_tokens
    per_token_layer = 12 * s["hidden"] + 3 * s["inter"]
    checkpointing = config.gradient_checkpointing is not False and next(student.parameters()).device.type == "cuda"
    act_values = (s["hidden"] * s["layers"] + per_token_layer) if checkpointing else per_token_layer * s["layers"]
    student_parts = {
        "student_weights": weights, "student_gradients": weights, "adamw_state": 2 * weights,
        "kv_cache": rows * length * s["layers"] * 2 * s["kv"] * s["head_dim"] * cb,
        "update_activations": config.micro_batch_tokens * act_values * cb,
        "student_head_chunk": min(CHUNK_BYTES, config.micro_batch_tokens * _vocab(student) * 4),
    }
    devices: dict[str, dict[str, int]] = {str(next(student.parameters()).device): student_parts}
    if teacher is not None:  # offloaded: weights on CPU; while scoring they visit the student's device (not counted)
        t = shape(teacher)
        weights_at = "cpu" if config.teacher_offload else str(next(teacher.parameters()).device)
        scores_at = str(next(student.parameters()).device) if config.teacher_offload else weights_at
        devices.setdefault(weights_at, {})["teacher_weights"] = _param_bytes(teacher)
        devices.setdefault(scores_at, {}).update(teacher_activations=config.score_batch_tokens * 4 * t["hidden"] * cb,
                                                 teacher_head_chunk=min(CHUNK_BYTES, config.score_batch_tokens
                                                                        * _vocab(teacher) * 4))
    return devices


def free_memory(device: str) -> tuple[int, int]:
    """(free bytes, bytes this process already holds there): CUDA from the driver (plus torch's reusable cache) and
    torch's allocation; CPU from /proc/meminfo's MemAvailable (or sysconf) and 0 (loaded weights are counted by the
    caller)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return free + cached, torch.cuda.memory_allocated(dev)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, 0
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), 0


def check_memory(needs: dict[str, dict[str, int]], *, loaded: dict[str, int] | None = None,
                 free: dict[str, int] | None = None) -> CheckResult:
    """Compare each device's estimate (`estimate_memory`) minus what is already loaded there with what is free
    (`free_memory`, or `free` given per device). Fail when a device lacks room, warn above 85 % of free."""
    lines, worst = [], 0.0
    for device, parts in needs.items():
        have, held = (free or {}).get(device), 0
        if have is None:
            have, held = free_memory(device)
        already = (loaded or {}).get(device, 0) if held == 0 else held
        total = sum(parts.values())
        more = max(0, total - already)
        worst = max(worst, more / max(have, 1))
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"{device}: needs ~{_gib(total)} ({', '.join(f'{k} {_gib(v)}' for k, v in top)}), "
                     f"{_gib(already)} already loaded, {_gib(have)} free")
    detail = "; ".join(lines)
    fix = ("lower rollout.batch_size / micro_batch_tokens / score_batch_tokens, enable gradient_checkpointing, "
           "teacher_offload, or put the teacher on another GPU (teacher.device=cuda:1)")
    status: Status = "fail" if worst > 1 else "warn" if worst > 0.85 else "pass"
    return CheckResult("memory", status, round(worst, 3), detail, "" if status == "pass" else fix, hard=True)


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def mini_step(config: DistillConfig, *, generator: Any, student: torch.nn.Module, student_scorer: Any,
              teacher_scorer: Any, prompt_ids: Sequence[Sequence[int]], pad_id: int, vocab_size: int,
              autocast_dtype: torch.dtype | None, prompts: int = 2) -> dict[str, float]:
    """Seconds of each phase of one OPD step on `prompts` prompts × rollout.n (rollout, student and teacher scoring,
    a forward/backward of the student through `opd.train.sft.forward_backward`, whose cost is the update's; the
    gradients are dropped). Changes no weights, optimizer or global RNG state."""
    from opd.rollout import SamplingParams
    from opd.rollout.batch import build_rollouts
    from opd.train.common import autocast, timed
    from opd.train.sft import forward_backward

    cfg, timings = config, {}
    device = next(student.parameters()).device
    ids = [list(x) for x in prompt_ids[:prompts]]
    k = diagnostic_top_k(cfg.objective.top_k)
    with timed(timings, "rollout"), autocast(device, autocast_dtype):
        params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.run.seed)
        rollouts = build_rollouts(ids, generator.generate(ids, params), pad_id=pad_id, device=device)
    with timed(timings, "student"), autocast(device, autocast_dtype):
        scores = student_scorer.score(rollouts, top_k=k, temperature=cfg.rollout.temperature)
    if teacher_scorer is not None:
        with timed(timings, "teacher"):
            serves_ids = getattr(teacher_scorer, "serves_requested_ids", True)  # vLLM: only its own top-k
            teacher_scorer.score(rollouts, top_k=k, requested_ids=scores.topk_ids if serves_ids else None,
                                 temperature=cfg.objective.teacher_temperature)
    # On CUDA the timed backward recomputes activations (as the run will: full or selective checkpointing), so the
    # mini-step never needs more memory than training; on CPU the run does not checkpoint either.
    checkpoint = device.type == "cuda" and not getattr(student, "is_gradient_checkpointing", True)
    if checkpoint:
        student.gradient_checkpointing_enable()
    try:
        with timed(timings, "update"):
            forward_backward(student, rollouts, micro_batch_tokens=max(cfg.micro_batch_tokens, 1), packed=False,
                             autocast_dtype=autocast_dtype, vocab_size=vocab_size)
    finally:
        student.zero_grad(set_to_none=True)
        if checkpoint:
            student.gradient_checkpointing_disable()
    timings["sequences"] = rollouts.batch_size
    timings["response_tokens"] = int(rollouts.response_mask.sum())
    return timings


def check_step_time(config: DistillConfig, timings: dict[str, float]) -> CheckResult:
    """Rule: each phase scales linearly with the sequences of a step (prompts_per_step × n) — an upper bound where
    batching is free (GPU decode below its bandwidth limit) and about right on CPU; the mini-step runs uncompiled,
    so compiled layers and CUDA graphs make the real step faster."""
    phases = {k: v for k, v in timings.items() if k in ("rollout", "student", "teacher", "update")}
    scale = config.prompts_per_step * config.rollout.n / max(1, timings["sequences"])
    per_step = sum(phases.values()) * scale
    detail = (f"{per_step:.2f} s/step ≈ {per_step * config.run.steps / 3600:.2f} h for {config.run.steps} steps, "
              f"from a mini-step of {int(timings['sequences'])} sequences ({int(timings['response_tokens'])} tokens: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()) + f") × {scale:g}")
    return CheckResult("step_time", "pass", round(per_step, 3), detail)


# -------------------------------------------------------------------------------------------- running the checks


@torch.no_grad()
def teacher_samples(teacher: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *, temperature: float,
                    max_new_tokens: int, vocab_size: int | None, seed: int) -> Any:
    """One sample per prompt from the teacher with the log-probs its generation reported (the torch engine: the HF
    model with a KV cache, a code path independent of `LocalScorer`)."""
    from opd.rollout import SamplingParams, make_generator
    from opd.rollout.batch import build_rollouts

    generator = make_generator(teacher, tokenizer, engine="torch", max_batch_size=len(prompt_ids), vocab_size=vocab_size)
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                            return_logprobs=True)
    ids = [list(x) for x in prompt_ids]
    return build_rollouts(ids, generator.generate(ids, params), pad_id=tokenizer.pad_token_id,
                          device=next(teacher.parameters()).device)


def scoring_rows(config: DistillConfig, *, teacher: torch.nn.Module, tokenizer: Any, student_scorer: Any,
                 teacher_scorer: Any, prompt_ids: Sequence[Sequence[int]], vocab_size: int, student_params: int,
                 skip: set[str], rows: int = 4, max_new_tokens: int | None = None,
                 autocast_dtype: torch.dtype | None = None) -> list[CheckResult]:
    """The scoring rows on the first `rows` prompts (teacher samples of at most `max_new_tokens`, default the
    rollout length)."""
    from opd.train.common import autocast

    out = []
    ids = [list(x) for x in prompt_ids[:rows]]
    tokens = min(config.rollout.max_new_tokens, max_new_tokens or config.rollout.max_new_tokens)
    device = next(teacher.parameters()).device
    if {"determinism", "self_distillation_zero"} - skip:
        samples = teacher_samples(teacher, tokenizer, ids, temperature=config.objective.teacher_temperature,
                                  max_new_tokens=tokens, vocab_size=vocab_size, seed=config.run.seed)
        if "determinism" not in skip:
            out.append(check_determinism(teacher_scorer, samples, top_k=diagnostic_top_k(config.objective.top_k),
                                         temperature=config.objective.teacher_temperature))
        if "self_distillation_zero" not in skip:
            out.append(check_self_distillation(teacher_scorer, samples, temperature=config.objective.teacher_temperature,
                                               dtype=next(teacher.parameters()).dtype))
    if "prompt_logprobs" not in skip and student_scorer is not None:
        student_device = next(student_scorer.model.parameters()).device
        with autocast(student_device, autocast_dtype):
            nll_s = nll_of_texts(student_scorer, ids, pad_id=tokenizer.pad_token_id, device=student_device)
        nll_t = nll_of_texts(teacher_scorer, ids, pad_id=tokenizer.pad_token_id, device=device)
        out.append(check_prompt_logprobs(nll_s, nll_t, student_params=student_params,
                                         teacher_params=sum(p.numel() for p in teacher.parameters()),
                                         vocab_size=vocab_size))
    return out


def _skipped(names: set[str], groups: Sequence[str]) -> list[CheckResult]:
    return [CheckResult(name, "skip", None, "skipped (--skip-check)") for name in CHECKS
            if name in names and CHECKS[name] in groups]


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
) -> CheckReport:
    """What `opd distill` runs at startup, on the loaded models (before the first step, the optimizer and layer
    compilation): the tokenizers, scoring and resources groups, minus `config.skip_checks`. Raises ValueError
    (one line: the failed rows, their fix, how to skip) on a hard failure. With several processes the rows that
    run the (sharded) student are left out: prompt_logprobs and step_time."""
    from opd.models import eos_token_ids

    from opd.models import on_device

    skip = resolve_skips(config.skip_checks)
    # an offloaded teacher scores on the student's device, as in training (memory is estimated with it offloaded)
    scoring_device = next(student.parameters()).device if config.teacher_offload else None
    if world_size > 1:
        skip |= {"prompt_logprobs", "step_time"}
    report = CheckReport()
    start = time.perf_counter()
    if teacher is not None:
        rows = check_tokenizers(student_tokenizer, teacher_tokenizer, messages=prompts[0].messages,
                                enable_thinking=config.data.enable_thinking,
                                student_rows=student.get_output_embeddings().weight.shape[0],
                                teacher_rows=teacher.get_output_embeddings().weight.shape[0],
                                student_eos_ids=eos_token_ids(student, student_tokenizer),
                                teacher_eos_ids=eos_token_ids(teacher, teacher_tokenizer))
        report.results += [r for r in rows if r.name not in skip]
        with on_device(teacher, scoring_device):
            report.results += scoring_rows(config, teacher=teacher, tokenizer=student_tokenizer,
                                           student_scorer=student_scorer, teacher_scorer=teacher_scorer,
                                           prompt_ids=prompt_ids, vocab_size=vocab_size,
                                           student_params=sum(p.numel() for p in student.parameters()), skip=skip,
                                           rows=2, max_new_tokens=128, autocast_dtype=autocast_dtype)
    if "memory" not in skip:
        needs = estimate_memory(config, student, teacher, compute_dtype=autocast_dtype or next(student.parameters()).dtype)
        report.results.append(check_memory(needs, loaded=_loaded_bytes(student, teacher)))
    if "step_time" not in skip:
        with on_device(teacher, scoring_device):
            timings = mini_step(config, generator=generator, student=student, student_scorer=student_scorer,
                                teacher_scorer=teacher_scorer, prompt_ids=prompt_ids,
                                pad_id=student_tokenizer.pad_token_id, vocab_size=vocab_size,
                                autocast_dtype=autocast_dtype, prompts=1)
        report.results.append(check_step_time(config, timings))
    report.results += _skipped(skip, PREFLIGHT_GROUPS)
    report.values["seconds"] = round(time.perf_counter() - start, 2)
    if console is not None:
        console.print(f"opd check (preflight, {report.values['seconds']} s): " + ", ".join(
            f"{r.name} {r.status}" for r in report.results if r.status != "skip"))
    failed = report.hard_failures
    if failed:
        raise ValueError("opd check: " + " | ".join(f"{r.name} failed ({r.detail}); fix: {r.fix}" for r in failed)
                         + f" — to run anyway pass --skip-check {failed[0].name} (skip_checks)")
    return report


def _loaded_bytes(*models: torch.nn.Module | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for model in models:
        if model is not None:
            device = str(next(model.parameters()).device)
            out[device] = out.get(device, 0) + _param_bytes(model)
    return out


def sample_prompts(prompts: Sequence[Any], count: int, seed: int) -> list[Any]:
    """`count` prompts drawn without replacement (seeded), in file order; all when there are fewer."""
    if count >= len(prompts):
        return list(prompts)
    chosen = sorted(random.Random(seed).sample(range(len(prompts)), count))
    return [prompts[i] for i in chosen]


def run_check(
    config: DistillConfig,
    *,
    n: int = 4,
    prompts_sample: int = 64,
    out: str | Path | None = None,
    skip: Sequence[str] = (),
    thresholds: ForecastThresholds | None = None,
    console: Any = None,
) -> CheckReport:
    """`opd check`: all four groups for `config` (a `DistillConfig`: student, teacher, data and the lengths and batch
    sizes of the run to come); the forecast on `prompts_sample` prompts × `n` rollouts. Prints the table, writes
    `<out>/check.json` (refusing to replace one) and returns the report (`exit_code()`)."""
    from rich.console import Console

    from opd.data.prompts import load_prompts
    from opd.data.templates import encode_prompts
    from opd.io import atomic_write_json
    from opd.models import check_tokenizer_compatibility, load_model, load_tokenizer, resolve_device, resolve_dtype
    from opd.teacher.local import LocalScorer
    from opd.train.common import training_precision

    console = console or Console()
    if config.teacher is None:
        raise ValueError("opd check needs a teacher: pass --teacher (teacher.path)")
    if n < 1 or prompts_sample < 1:
        raise ValueError(f"n and prompts_sample must be ≥ 1, got n={n}, prompts_sample={prompts_sample}")
    skipped = resolve_skips([*config.skip_checks, *skip])
    thresholds = thresholds or ForecastThresholds()
    out_dir = Path(out) if out is not None else Path(config.run.out_dir) / f"check-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out_dir / "check.json").exists():
        raise FileExistsError(f"{out_dir / 'check.json'} exists; choose another --out (opd check never replaces it)")
    report = CheckReport()
    data = config.data
    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    teacher_tokenizer = load_tokenizer(config.teacher.path, trust_remote_code=config.teacher.trust_remote_code)
    prompts = load_prompts(data.path, prompt_key=data.prompt_key, answer_key=data.answer_key, id_key=data.id_key,
                           split=data.split, limit=data.limit)
    if not prompts:
        raise ValueError(f"data.path {data.path}: no prompts")
    sample = sample_prompts(prompts, prompts_sample, config.run.seed)

    # 1. tokenizers: from the files, before any weights are loaded
    (rows_s, eos_s), (rows_t, eos_t) = _from_files(config.student, student_tokenizer), _from_files(config.teacher,
                                                                                                   teacher_tokenizer)
    rows = check_tokenizers(student_tokenizer, teacher_tokenizer, messages=sample[0].messages,
                            enable_thinking=data.enable_thinking, student_rows=rows_s, teacher_rows=rows_t,
                            student_eos_ids=eos_s, teacher_eos_ids=eos_t)
    report.results += [r for r in rows if r.name not in skipped]
    if any(r.name == "tokenizer_vocab" and r.status == "fail" for r in rows):
        # every other row scores the student's ids with the teacher: meaningless across vocabularies
        report.results += [CheckResult(name, "skip", None, "not run: the vocabularies differ") for name in CHECKS
                           if CHECKS[name] != "tokenizers" and name not in skipped]
        return _finish(report, out_dir, console, atomic_write_json)

    device = resolve_device(config.student.device)
    weights_dtype, autocast_dtype = training_precision(config.student, device)
    student, _ = load_model(config.student.path, dtype=autocast_dtype or weights_dtype, device=device,
                            trust_remote_code=config.student.trust_remote_code,
                            attn_implementation=config.student.attn_implementation)
    teacher_device = resolve_device(config.teacher.device)
    teacher, _ = load_model(config.teacher.path, dtype=resolve_dtype(config.teacher.dtype, teacher_device),
                            device=teacher_device, trust_remote_code=config.teacher.trust_remote_code,
                            attn_implementation=config.teacher.attn_implementation)
    vocab_size = check_tokenizer_compatibility(
        student_tokenizer, teacher_tokenizer, student_vocab_size=student.get_output_embeddings().weight.shape[0],
        teacher_vocab_size=teacher.get_output_embeddings().weight.shape[0]).tokenizer_size
    student_scorer = LocalScorer(student, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size)
    teacher_scorer = LocalScorer(teacher, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size)
    encoded = encode_prompts(student_tokenizer, sample, max_prompt_length=data.max_prompt_length,
                             enable_thinking=data.enable_thinking, template=data.template)
    console.print(f"opd check: {len(sample)} prompts of {data.path}, student {config.student.path}, teacher "
                  f"{config.teacher.path}")

    # 2. scoring sanity
    report.results += scoring_rows(config, teacher=teacher, tokenizer=student_tokenizer, student_scorer=student_scorer,
                                   teacher_scorer=teacher_scorer, prompt_ids=encoded.input_ids, vocab_size=vocab_size,
                                   student_params=sum(p.numel() for p in student.parameters()), skip=skipped,
                                   autocast_dtype=autocast_dtype)
    # 3. forecast
    if "forecast" not in skipped:
        values = forecast(student, teacher, student_tokenizer, sample, n=n, top_k=diagnostic_top_k(config.objective.top_k),
                          temperature=config.rollout.temperature,
                          teacher_temperature=config.objective.teacher_temperature,
                          max_new_tokens=config.rollout.max_new_tokens, max_prompt_length=data.max_prompt_length,
                          enable_thinking=data.enable_thinking, template=data.template,
                          batch_size=max(1, min(len(sample), config.rollout.batch_size // n)),
                          score_batch_tokens=config.score_batch_tokens, seed=config.run.seed, vocab_size=vocab_size)
        rows, verdict = forecast_rows(values, thresholds, student=config.student.path, teacher=config.teacher.path,
                                      prompts=data.path)
        report.results += [r for r in rows if r.name not in skipped or r.name == "forecast"]
        report.values["forecast"] = {**verdict, "values": values, "n": n, "prompts_sample": len(sample),
                                     "thresholds": thresholds.model_dump()}
    # 4. resources
    if "memory" not in skipped:
        needs = estimate_memory(config, student, teacher, compute_dtype=autocast_dtype or weights_dtype,
                                weights_dtype=weights_dtype)
        report.results.append(check_memory(needs, loaded=_loaded_bytes(student, teacher)))
        report.values["memory"] = needs
    if "step_time" not in skipped:
        from opd.rollout import make_generator

        generator = make_generator(student, student_tokenizer, max_batch_size=config.rollout.batch_size,
                                   vocab_size=vocab_size, engine=config.rollout.engine)
        timings = mini_step(config, generator=generator, student=student, student_scorer=student_scorer,
                            teacher_scorer=teacher_scorer, prompt_ids=encoded.input_ids,
                            pad_id=student_tokenizer.pad_token_id, vocab_size=vocab_size, autocast_dtype=autocast_dtype)
        report.results.append(check_step_time(config, timings))
        report.values["mini_step"] = timings
    report.results += _skipped(skipped, GROUPS)
    return _finish(report, out_dir, console, atomic_write_json)


def _from_files(spec: Any, tokenizer: Any) -> tuple[int | None, list[int]]:
    """(output rows, EOS ids) of a model from its config.json and generation_config.json, no weights loaded."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from opd.models import eos_token_ids

    try:
        config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError):
        return None, eos_token_ids(None, tokenizer)
    try:
        generation = GenerationConfig.from_pretrained(spec.path)
    except (OSError, ValueError):
        generation = None
    rows = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    return rows, eos_token_ids(SimpleNamespace(config=config, generation_config=generation), tokenizer)


def _finish(report: CheckReport, out_dir: Path, console: Any, write: Any) -> CheckReport:
    order = {name: i for i, name in enumerate(CHECKS)}
    report.results.sort(key=lambda r: order[r.name])
    write(out_dir / "check.json", _jsonable(report.to_json()))
    console.print(render_table(report))
    verdict = report.values.get("forecast")
    if verdict:
        console.print(f"forecast: [bold]{verdict['verdict']}[/] to improve — {'; '.join(verdict['reasons'])}")
        if verdict["command"]:
            console.print(f"recovery: {verdict['command']}", markup=False, highlight=False)
    console.print(f"check.json: {out_dir / 'check.json'} (exit code {report.exit_code()})")
    return report


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def render_table(report: CheckReport) -> Any:
    """The console table: one row per check (group, name, status, value, fix)."""
    from rich.table import Table

    style = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    table = Table(title="opd check", show_lines=False)
    for column in ("group", "check", "status", "value", "detail / fix"):
        table.add_column(column, overflow="fold")
    for r in report.results:
        status = f"[{style[r.status]}]{r.status}{' (hard)' if r.hard and r.status == 'fail' else ''}[/]"
        text = r.detail + (f" → fix: {r.fix}" if r.fix else "")
        table.add_row(r.group, r.name, status, _short(r.value), text)
    return table


def _short(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items() if k != "predicted_teacher")
    return str(value)
