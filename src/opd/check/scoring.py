"""The scoring group of `opd check`: is the teacher's scorer sane? `determinism` (the teacher scores the same rows
twice), `self_distillation_zero` (the teacher's scores of its *own* samples against the log-probs its generation
reported: the sampled-token reward of a model against itself, ≈ 0), `generation_scoring` (the same for the student's
own rollout engine and scorer, at the run's length), `prompt_logprobs` (both models' per-token NLL of
the same rendered prompts, against what their sizes predict). `scoring_rows` runs them on a few prompts.
A teacher without a local module (served, vLLM) gets `served_scores` instead: its answers must be what the client
asked for (issue 25, item 7): normalised log-probs, the temperature applied, ids inside its vocabulary.

The checks take any `TeacherScorer`; the teacher's own samples come from the torch engine, a code path independent of
`LocalScorer`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from opd.check.report import CheckResult
from opd.config import DistillConfig
from opd.models import rope_choice
from opd.objectives.diagnostics import diagnostic_top_k
from opd.rollout import SamplingParams, make_generator
from opd.rollout.base import GenerationOutput
from opd.rollout.batch import build_rollouts
from opd.train.common import autocast

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
VIEW_TOLERANCE = 1e-6
"""Below this mean |Δ log-prob| a teacher's scores did not move when its view added the context: the same ids, or a
context the model cannot see. A real context moves a causal LM's scores of the following tokens by far more."""
SERVED_TOLERANCE = 2e-2
"""Max |Δ| (nats) in `served_scores`' identities: a bf16 server's log-probs are rounded by ~0.4 % of a logit (~0.03
nats at 8-nat logits, halved by the float32 log-softmax over bf16 logits), the wire's float16 log-probs by 2^-11 of
their value; a server that ignores the temperature is off by |1 − 1/τ| times a top-2 gap (≥ 0.05 at τ = 0.9 on
any non-flat position), one that scores other positions or another vocabulary by whole nats."""
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
    fix = (
        "the teacher must score deterministically: eval mode (no dropout), no sampling in the scorer, the same "
        "batching; OPD's rewards are differences of its log-probs"
    )
    if worst == 0.0 and same_ids:
        return CheckResult("determinism", "pass", 0.0, detail + ": bit-identical", hard=True)
    if worst <= DETERMINISM_TOLERANCE and same_ids:
        return CheckResult(
            "determinism",
            "warn",
            worst,
            detail + f" (≤ {DETERMINISM_TOLERANCE:g}: reduction-order noise)",
            fix,
            hard=True,
        )
    return CheckResult(
        "determinism", "fail", worst, detail + ("" if same_ids else "; the top-k ids differ"), fix, hard=True
    )


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
    detail = (
        f"mean |t(y) − g(y)| {mean_abs:.3g} nats/token (mean {float(reward.mean()) if reward.numel() else 0:.3g})"
        f" over {reward.numel()} tokens of {rollouts.batch_size} teacher samples; tolerance {tolerance:g} "
        f"({str(dtype).removeprefix('torch.')})"
    )
    if mean_abs <= tolerance:
        return CheckResult("self_distillation_zero", "pass", mean_abs, detail, hard=True)
    return CheckResult(
        "self_distillation_zero",
        "fail",
        mean_abs,
        detail,
        "the teacher's scorer disagrees with its own generation: check positions / padding, the "
        "temperature (objective.teacher_temperature), the dtype and the attention implementation",
        hard=True,
    )


def nll_of_texts(scorer: Any, ids_per_text: Sequence[Sequence[int]], *, pad_id: int, device: torch.device) -> float:
    """Mean per-token NLL (nats) of token-id texts, teacher-forced: each text's first token is its prompt, the rest a
    response (`build_rollouts`), so any `TeacherScorer` scores it."""
    prompts = [list(ids[:1]) for ids in ids_per_text]
    output = GenerationOutput(
        response_ids=[list(ids[1:]) for ids in ids_per_text],
        finish_reasons=["stop"] * len(ids_per_text),
        group_ids=list(range(len(ids_per_text))),
    )
    rollouts = build_rollouts(prompts, output, pad_id=pad_id, device=device)
    lp = scorer.score(rollouts, top_k=0, with_entropy=False).sampled_logprobs
    return float(-_mask(lp, rollouts.response_mask).mean())


def check_prompt_logprobs(
    nll_student: float, nll_teacher: float, *, student_params: int, teacher_params: int, vocab_size: int
) -> CheckResult:
    """Rule: a model of N_t parameters should reach NLL_t ≈ NLL_s · (N_s / N_t)^α_N on the same text (`SIZE_EXPONENT`);
    warn when NLL_t > PROMPT_NLL_SLACK · that + 0.1, fail when either is not finite; skip (uninformative) when the
    student itself does no better than ln V, the NLL of uniform guessing, on the text."""
    predicted = nll_student * (student_params / max(teacher_params, 1)) ** SIZE_EXPONENT
    value = {
        "student": nll_student,
        "teacher": nll_teacher,
        "predicted_teacher": predicted,
        "uniform": math.log(max(vocab_size, 1)),
    }
    detail = (
        f"per-token NLL of the rendered prompts: student {nll_student:.3f}, teacher {nll_teacher:.3f} nats "
        f"(sizes predict ≈ {predicted:.3f} for the teacher; uniform guessing ln V = {value['uniform']:.2f})"
    )
    if not (math.isfinite(nll_student) and math.isfinite(nll_teacher)):
        return CheckResult(
            "prompt_logprobs",
            "fail",
            value,
            detail,
            "non-finite log-probs: overflow in fp16? load with dtype bf16 or fp32",
            hard=True,
        )
    if nll_student >= value["uniform"]:
        return CheckResult(
            "prompt_logprobs",
            "skip",
            value,
            detail + ": uninformative, the student does no better "
            "than uniform guessing on this text (prompt tokens it never trained on, as in the lab)",
        )
    if nll_teacher > PROMPT_NLL_SLACK * predicted + 0.1:
        return CheckResult(
            "prompt_logprobs",
            "warn",
            value,
            detail,
            "the teacher predicts this text far worse than its size suggests: a wrong or untrained "
            "checkpoint, another tokenizer's weights, or a dtype problem?",
            hard=True,
        )
    return CheckResult("prompt_logprobs", "pass", value, detail, hard=True)


@torch.no_grad()
def teacher_samples(
    teacher: torch.nn.Module,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    vocab_size: int | None,
    seed: int,
    stop_at_eos: bool = True,
) -> Any:
    """One sample per prompt from the teacher with the log-probs its generation reported (the torch engine: the HF
    model with a KV cache, a code path independent of `LocalScorer`); `stop_at_eos=False`: every sample runs to
    `max_new_tokens`."""
    generator = make_generator(
        teacher, tokenizer, engine="torch", max_batch_size=len(prompt_ids), vocab_size=vocab_size
    )
    params = SamplingParams(
        n=1,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        return_logprobs=True,
        stop_at_eos=stop_at_eos,
    )
    ids = [list(x) for x in prompt_ids]
    return build_rollouts(
        ids, generator.generate(ids, params), pad_id=tokenizer.pad_token_id, device=next(teacher.parameters()).device
    )


def _tail(ids: Sequence[int]) -> list[int]:
    """A prompt's last ≤ 16 tokens: a response the checks score where any valid ids serve."""
    return list(ids[-min(len(ids), 16) :])


def _with_responses(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> Any:
    """Rollouts on the CPU of each prompt followed by its response, as if generated to their lengths."""
    return build_rollouts(
        [list(p) for p in prompts],
        GenerationOutput([list(r) for r in responses], ["length"] * len(responses), list(range(len(responses)))),
        pad_id=pad_id,
        device=torch.device("cpu"),
    )


def prompt_tail_rollouts(prompt_ids: Sequence[Sequence[int]], *, pad_id: int) -> Any:
    """Rollouts on the CPU of each prompt followed by its own last ≤ 16 tokens as the response: rows any scorer can
    score without a model here to sample from (a served teacher's `determinism`, `served_scores`)."""
    return _with_responses(prompt_ids, [_tail(ids) for ids in prompt_ids], pad_id)


@dataclass(frozen=True)
class ViewProbe:
    """One teacher with a view, for `check_teacher_views`: a prompt routed to it as the student sees it and as its
    view shows it, its scorer and temperature, and the context it scores in (offloaded: moved in; the live student:
    autocast, no grad)."""

    name: str
    scorer: Any
    student_ids: list[int]
    teacher_ids: list[int]
    temperature: float
    placed: Callable[[], contextlib.AbstractContextManager]


@torch.no_grad()
def check_teacher_views(probes: Sequence[ViewProbe], *, pad_id: int) -> CheckResult:
    """Each teacher with a view (a teacher-only context column) scores the same response after the student's prompt
    and after its own view of it; scores that do not move mean the context is not in what it scores (a template
    that drops it, a column rendered empty). The response is the prompt's own last ≤ 16 tokens: any valid ids serve."""
    unchanged, moved = [], []
    for probe in probes:
        response = _tail(probe.student_ids)
        rollouts = _with_responses([probe.student_ids, probe.teacher_ids], [response, response], pad_id)
        with probe.placed():
            lp_BT = probe.scorer.score(rollouts, top_k=0, temperature=probe.temperature, with_entropy=False)
        mask_BT = rollouts.response_mask.bool()
        lp_BT = lp_BT.sampled_logprobs.float().cpu()
        delta = float((lp_BT[0][mask_BT[0]] - lp_BT[1][mask_BT[1]]).abs().mean())
        moved.append(f"{probe.name} {delta:.3g}")
        if probe.student_ids == probe.teacher_ids or delta <= VIEW_TOLERANCE:
            unchanged.append(probe.name)
    detail = f"mean |Δ log-prob| with the view's context vs without, per teacher: {', '.join(moved)}"
    if not unchanged:
        return CheckResult("teacher_view", "pass", None, detail, hard=True)
    return CheckResult(
        "teacher_view",
        "fail",
        None,
        f"{detail}; unchanged for {', '.join(unchanged)}",
        "the view's context does not reach the teacher's prompt: check view.context_key (a column of every routed "
        "prompt) and view.context_template (it must contain {context}), and that the chat template keeps the user "
        "message",
        hard=True,
    )


@torch.no_grad()
def check_served_scores(
    scorer: Any, prompt_ids: Sequence[Sequence[int]], *, temperature: float, top_k: int, vocab_rows: int, pad_id: int
) -> CheckResult:
    """A module-less teacher scores the prompts' own tokens (as responses: any valid ids serve) at the run's
    temperature: its top-k log-probs must descend with a log-sum-exp ≤ 0, the sampled token's log-prob must equal
    its top-k entry wherever it is in the top-k, ids must lie below its vocabulary rows, entropies (when it gives
    log_v = math.log(vocab_rows) + SERVED_TOLERANCE
    if entropy_N is not None and not -SERVED_TOLERANCE <= entropy_N.min() <= entropy_N.max() <= log_v:
    larger (the temperature was applied, once)."""
    k = top_k  # what the trainer asks for: a server's max_top_k (or vLLM's max_logprobs) allows it
    rollouts = prompt_tail_rollouts(prompt_ids[:2], pad_id=pad_id)
    mask_BT = rollouts.response_mask.bool()
    at_t = scorer.score(rollouts, top_k=k, temperature=temperature, with_entropy=True)
    lp_NK, ids_NK = at_t.topk_logprobs[mask_BT].float(), at_t.topk_ids[mask_BT]
    sampled_N = at_t.sampled_logprobs[mask_BT].float()
    problems = []
    rises = lp_NK.diff(dim=-1).clamp(min=0).amax() if k > 1 else lp_NK.new_zeros(())
    if rises > SERVED_TOLERANCE or lp_NK.logsumexp(-1).max() > SERVED_TOLERANCE:
        problems.append("top-k log-probs that are not a descending part of a normalised distribution")
    if ids_NK.min() < 0 or ids_NK.max() >= vocab_rows:
        problems.append(f"top-k ids outside [0, {vocab_rows})")
    hit_NK = ids_NK == rollouts.response_ids[mask_BT][:, None]
    if hit_NK.any() and (sampled_N[:, None] - lp_NK).abs()[hit_NK].max() > SERVED_TOLERANCE:
        problems.append("a sampled token's log-prob that differs from its own top-k entry")
    entropy_N = None if at_t.entropy is None else at_t.entropy[mask_BT].float()  # vLLM gives none
    if (
        entropy_N is not None
        and not -SERVED_TOLERANCE <= entropy_N.min() <= entropy_N.max() <= math.log(vocab_rows) + SERVED_TOLERANCE
    ):
        problems.append(f"entropies outside [0, log {vocab_rows}]")
    detail = f"{int(mask_BT.sum())} positions of 2 prompts at temperature {temperature}"
    if temperature != 1.0 and k >= 2 and not problems:
        at_1 = scorer.score(rollouts, top_k=k, temperature=1.0, with_entropy=False)
        gap_N = lp_NK[:, 0] - lp_NK[:, 1]
        gap1_N = at_1.topk_logprobs[mask_BT][:, 0].float() - at_1.topk_logprobs[mask_BT][:, 1].float()
        same_top = at_1.topk_ids[mask_BT][:, 0] == ids_NK[:, 0]
        if not same_top.all() or (gap_N * temperature - gap1_N).abs().max() > SERVED_TOLERANCE * (1 + temperature):
            problems.append(f"log-prob gaps that do not scale as temperature {temperature} asks")
        detail += " and at 1"
    if problems:
        return CheckResult(
            "served_scores",
            "fail",
            problems[0],
            detail + ": " + "; ".join(problems),
            "the teacher server answers something else than this client asks for: check that it runs this "
            "version of opd serve-teacher and the model you meant",
            hard=True,
        )
    return CheckResult("served_scores", "pass", 0.0, detail + ": consistent", hard=True)


GENERATION_CHECK_TOKENS = 64
"""Tokens of `generation_scoring`'s row: enough to show a decode step that differs from the scorer."""


def length_dependent_rope(model: torch.nn.Module) -> bool:
    """Whether the model's config asks for a RoPE whose table depends on the sequence length (longrope, dynamic:
    `opd.models.LENGTH_DEPENDENT_ROPE`), fixed by `opd.models.fix_rope` or not: generation and scoring can then
    disagree only once a row is long enough to switch the table, so the checks run at the run's whole length."""
    return rope_choice(cast(Any, model).config, 1) is not None


HIDDEN_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Max |Δ log-prob| (nats) between a teacher's own scores and the same scores computed from its hidden states and
head (`hidden_scores`): in float32 the same `score_hidden` on differently batched rows, ~1e-5; half precision: the
hidden states' rounding, `SELF_ZERO_HALF_TOLERANCE`. A head applied wrongly (scale, soft-cap, another head) is off
by whole nats."""


def check_hidden_scores(
    scorer: Any, rollouts: Any, *, top_k: int, temperature: float, dtype: torch.dtype
) -> CheckResult:
    """The teacher's own scores against the scores computed here from its hidden states and its head (what a run
    with `teacher.answer: hidden` trains on): sampled and top-k log-probs must agree within `HIDDEN_TOLERANCE`."""
    from opd.teacher.base import HiddenStateScorer

    own = scorer.score(rollouts, top_k=top_k, temperature=temperature, with_entropy=False)
    mine = HiddenStateScorer(scorer).score(rollouts, top_k=top_k, temperature=temperature, with_entropy=False)
    mask = rollouts.response_mask.bool()
    worst = _max_abs(own.sampled_logprobs[mask] - mine.sampled_logprobs[mask])
    if own.topk_logprobs is not None and mine.topk_logprobs is not None:
        worst = max(worst, _max_abs(own.topk_logprobs[mask] - mine.topk_logprobs[mask]))
    tolerance = HIDDEN_TOLERANCE.get(dtype, SELF_ZERO_HALF_TOLERANCE)
    detail = (
        f"max |Δ log-prob| {worst:.3g} nats between the teacher's scores and those from its hidden states and head, "
        f"over {int(mask.sum())} positions × {top_k} top-k; tolerance {tolerance:g}"
    )
    if worst <= tolerance:
        return CheckResult("hidden_scores", "pass", worst, detail, hard=True)
    return CheckResult(
        "hidden_scores",
        "fail",
        worst,
        detail,
        "the teacher's output head is not applied as its model applies it (scale, soft-cap, bias): use "
        "teacher.answer=scores",
        hard=True,
    )


def generation_check_tokens(model: torch.nn.Module, max_new_tokens: int) -> int:
    """`GENERATION_CHECK_TOKENS`, or the run's whole length for a RoPE whose table depends on the sequence length
    (`length_dependent_rope`)."""
    if length_dependent_rope(model):
        return max_new_tokens
    return min(max_new_tokens, GENERATION_CHECK_TOKENS)


@torch.no_grad()
def check_generation_scoring(
    generator: Any,
    scorer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    pad_id: int,
    device: torch.device,
    dtype: torch.dtype,
) -> CheckResult:
    """The student's engine and its scorer on one row of the run's own length: the log-probs the engine reported
    for its tokens against the scorer's of the same tokens (the behaviour policy the update divides by). A RoPE whose
    table depends on the sequence length (longrope, dynamic), a decode step that misses a model feature or a mask
    that differs makes them disagree by ≥ 0.3 nats/token; agreeing paths differ by rounding
    (`SELF_ZERO_TOLERANCE`). The row runs without EOS to its full length, so that a length-dependent table crosses
    its switch as the run's rows will."""
    params = SamplingParams(
        n=1,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        return_logprobs=True,
        stop_at_eos=False,
    )
    ids = [list(prompt_ids[0])]
    rollouts = build_rollouts(ids, generator.generate(ids, params), pad_id=pad_id, device=device)
    if rollouts.rollout_logprobs is None:
        return CheckResult("generation_scoring", "skip", None, "the engine reports no log-probs")
    scores = scorer.score(rollouts, top_k=0, temperature=temperature, with_entropy=False)
    mask_BT = rollouts.response_mask.bool()
    delta = (scores.sampled_logprobs.float() - rollouts.rollout_logprobs.float())[mask_BT].abs()
    mean_abs = float(delta.mean()) if delta.numel() else 0.0
    tolerance = SELF_ZERO_TOLERANCE.get(dtype, SELF_ZERO_HALF_TOLERANCE)
    detail = f"mean |engine - scorer| log-prob over {delta.numel()} tokens of one row: {mean_abs:.3g} nats/token"
    if mean_abs <= tolerance:
        return CheckResult("generation_scoring", "pass", mean_abs, detail, hard=True)
    return CheckResult(
        "generation_scoring",
        "fail",
        mean_abs,
        f"{detail} (> {tolerance})",
        "the student's rollout engine and its scorer compute different distributions: a length-dependent RoPE "
        "(longrope, dynamic) or a model feature one of them misses; try rollout.engine=torch, or a model without it",
        hard=True,
    )


def scoring_rows(
    config: DistillConfig,
    *,
    teacher: torch.nn.Module,
    tokenizer: Any,
    student_scorer: Any,
    teacher_scorer: Any,
    prompt_ids: Sequence[Sequence[int]],
    vocab_size: int,
    student_params: int,
    skip: set[str],
    rows: int = 4,
    max_new_tokens: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[CheckResult]:
    """The scoring rows on the first `rows` prompts (teacher samples of at most `max_new_tokens`, default the
    rollout length; a teacher whose RoPE depends on the length samples the whole rollout length without stopping at
    EOS, so that its rows reach the run's own length: `length_dependent_rope`)."""
    out = []
    ids = [list(x) for x in prompt_ids[:rows]]
    whole = length_dependent_rope(teacher)
    tokens = min(config.rollout.max_new_tokens, (None if whole else max_new_tokens) or config.rollout.max_new_tokens)
    device = next(teacher.parameters()).device
    hidden = any(entry.answer == "hidden" for entry in config.teacher_entries()) and hasattr(
        teacher_scorer, "hidden_states"
    )
    if {"determinism", "self_distillation_zero"} - skip or (hidden and "hidden_scores" not in skip):
        samples = teacher_samples(
            teacher,
            tokenizer,
            ids,
            temperature=config.objective.teacher_temperature,
            max_new_tokens=tokens,
            vocab_size=vocab_size,
            seed=config.run.seed,
            stop_at_eos=not whole,
        )
        if "determinism" not in skip:
            out.append(
                check_determinism(
                    teacher_scorer,
                    samples,
                    top_k=diagnostic_top_k(config.objective.top_k),
                    temperature=config.objective.teacher_temperature,
                )
            )
        if hidden and "hidden_scores" not in skip:
            out.append(
                check_hidden_scores(
                    teacher_scorer,
                    samples,
                    top_k=diagnostic_top_k(config.objective.top_k),
                    temperature=config.objective.teacher_temperature,
                    dtype=next(teacher.parameters()).dtype,
                )
            )
        if "self_distillation_zero" not in skip:
            out.append(
                check_self_distillation(
                    teacher_scorer,
                    samples,
                    temperature=config.objective.teacher_temperature,
                    dtype=next(teacher.parameters()).dtype,
                )
            )
    if "prompt_logprobs" not in skip and student_scorer is not None:
        student_device = next(student_scorer.model.parameters()).device
        with autocast(student_device, autocast_dtype):
            nll_s = nll_of_texts(student_scorer, ids, pad_id=tokenizer.pad_token_id, device=student_device)
        nll_t = nll_of_texts(teacher_scorer, ids, pad_id=tokenizer.pad_token_id, device=device)
        out.append(
            check_prompt_logprobs(
                nll_s,
                nll_t,
                student_params=student_params,
                teacher_params=sum(p.numel() for p in teacher.parameters()),
                vocab_size=vocab_size,
            )
        )
    return out
