"""`opd distill`: on-policy distillation (SPEC §1–§6) and the GRPO baseline, on one device.

One step (DESIGN.md) is `opd_step` below and reads top to bottom: prompts → student rollouts → student and
teacher scores of the student's own tokens → token rewards and advantages → a policy-gradient update in
micro-batches with a *global* token-mean → diagnostics. Everything else here is setup and the loop.

Multi-process: `torchrun --nproc_per_node 8 -m opd.cli distill --config …` runs the same code with the student
sharded by FSDP2; each rank takes a slice of every step's prompts and the token-mean stays global across ranks
(see `opd.train.distributed`). With one process the `tr.dist` calls are no-ops.

Omitted on purpose: PPO mini-batch epochs (the paper makes one optimizer step per rollout batch, so the ratio is
≡ 1 and the old log-probs are the student's no-grad scores); the `full_reverse_kl` objective in the
trainer (it needs the teacher's full distribution in the grad pass; it exists as a pure function).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opd.config import DistillConfig
from opd.train.common import (
    evaluate_in_training, finish_run, is_due, open_run, restore_trainer_state, resume_checkpoint, run_directory,
    trainer_state, training_precision,
)
from opd.train.common import claimed_run_dir, eval_pending, load_eval_sets
from opd.train.common import autocast
from opd.train.common import timed as _timed
from opd.train.distributed import SINGLE, DistInfo, all_reduce_sum, gathered, max_over_ranks, reduce_metrics
from opd.train.distributed import gathered_bytes
from opd.models import on_device
from opd.types import Prompt, Rollouts, TokenScores
from opd.seeds import SALT_STEP_ROLLOUT, derive_seed

@dataclass
class Trainer:
    """Everything a step needs, built once by `setup`. No behaviour: the functions below act on it."""

    config: DistillConfig
    run_dir: Path
    student: torch.nn.Module
    tokenizer: Any
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    generator: Any
    student_scorer: Any
    teacher: torch.nn.Module | None
    teacher_scorer: Any
    reference_scorer: Any
    vocab_size: int
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Any
    sink: Any
    step: int = 0
    skipped_steps: int = 0
    history: list[dict] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None
    activation_budget: float | None = None  # selective checkpointing of compiled layers (`opd.models.activation_budget`)
    dist: DistInfo = SINGLE  # this process's rank / world size (torchrun); SINGLE without torchrun
    # rollout.overlap: a bfloat16 snapshot of the student that generates the next step's rollouts while this step
    # scores and updates (`rollout_model`, copied from the student at the start of each step), its generator, and the
    # rollouts it made for the next step (`PendingRollouts`, checkpointed so that a resume replays them)
    rollout_model: torch.nn.Module | None = None
    rollout_generator: Any = None
    pending_rollouts: "PendingRollouts | None" = None
    # benchmarks: a list → each step appends CUDA memory (allocated / peak since the last mark, GiB) after each phase
    memory_trace: list | None = None


@dataclass
class PendingRollouts:
    """Rollouts generated one step ahead (rollout.overlap): the global prompt indices of this rank's slice and the
    engine's output for them, generated from the weights before the previous update."""

    indices: list[int]
    output: Any  # opd.rollout.GenerationOutput

    def state_dict(self) -> dict:
        out = self.output
        return {"indices": self.indices, "response_ids": out.response_ids, "finish_reasons": out.finish_reasons,
                "group_ids": out.group_ids, "logprobs": out.logprobs}

    @classmethod
    def from_state(cls, state: dict | None) -> "PendingRollouts | None":
        from opd.rollout import GenerationOutput

        if not state:
            return None
        output = GenerationOutput(response_ids=state["response_ids"], finish_reasons=state["finish_reasons"],
                                  group_ids=state["group_ids"], logprobs=state["logprobs"])
        return cls(indices=list(state["indices"]), output=output)


# ------------------------------------------------------------------------------------------------ the step


def opd_step(tr: Trainer) -> dict[str, float]:
    """One on-policy step: rollouts of the current student, scored by the teacher, one optimizer update."""
    from opd.objectives import (
        build_candidates, candidate_rewards, diagnostic_top_k, compute_advantages, gather_candidate_logprobs, opd_diagnostics,
        sampled_token_rewards, strategy_spec, truncated_is_weights,
    )
    from opd.models import activation_budget
    from opd.rollout.batch import build_rollouts
    from opd.scoring import candidate_logprobs_and_entropy
    from opd.teacher.base import start_scoring
    from opd.teacher.local import forward_hidden, needed_lengths, output_head, split_by_token_budget, uses_packing
    from opd.train.optim import clip_and_step

    cfg, obj, timings = tr.config, tr.config.objective, {}
    diag_k = diagnostic_top_k(obj.top_k)
    device = next(tr.student.parameters()).device

    # 1. prompts (resumable seeded sampler): every rank draws the same global batch and keeps its own slice
    rank, world = tr.dist.rank, tr.dist.world_size
    pending, tr.pending_rollouts = tr.pending_rollouts, None
    if pending is None:
        indices = tr.sampler.next_batch()[rank::world]
        prompt_ids = [tr.prompt_ids[i] for i in indices]

        # 2. rollout: n samples per prompt from the current student (FSDP: weights gathered once, see `gathered`)
        with _timed(timings, "rollout"), gathered(tr.student, tr.dist), autocast(device, tr.autocast_dtype):
            params = _sampling_params(cfg, tr.step, rank)
            output = tr.generator.generate(prompt_ids, params)
            rollouts = build_rollouts(prompt_ids, output, pad_id=tr.tokenizer.pad_token_id, device=device)
        _release(tr.generator)
    else:  # rollout.overlap: generated during the previous step, from the weights before its update
        indices, prompt_ids = pending.indices, [tr.prompt_ids[i] for i in pending.indices]
        rollouts = build_rollouts(prompt_ids, pending.output, pad_id=tr.tokenizer.pad_token_id, device=device)
    _mark_memory(tr, "rollout")
    # rollout.overlap: the next step's rollouts start now, in the background, from a snapshot of these weights (also
    # after the last step: the checkpoint then carries them, and a resume with more steps continues exactly)
    ahead = _start_next_rollouts(tr, device) if cfg.rollout.overlap else None
    mask_BT = rollouts.response_mask

    # 3. student scores without grad (the behaviour policy): top-k support, log-probs, entropy
    with _timed(timings, "student"), gathered(tr.student, tr.dist), autocast(device, tr.autocast_dtype):
        student = tr.student_scorer.score(rollouts, top_k=diag_k, temperature=cfg.rollout.temperature)
        reference_BT = None if tr.reference_scorer is None else tr.reference_scorer.score(
            rollouts, top_k=0, temperature=cfg.rollout.temperature, with_entropy=False).sampled_logprobs

    # 4. teacher scores of the student's tokens: sampled token, its own top-k, log-probs at the student's top-k
    #    (a served teacher's requests go out here, as soon as the student's top-k exists, and overlap the grading)
    teacher: TokenScores | None = None
    student_at_teacher_BTK = None
    teacher_call = None
    if tr.teacher_scorer is not None:
        with _timed(timings, "teacher"), on_device(tr.teacher, device if cfg.teacher_offload else None):
            serves_ids = getattr(tr.teacher_scorer, "serves_requested_ids", True)  # vLLM: only its own top-k
            teacher_call = start_scoring(tr.teacher_scorer, rollouts, top_k=diag_k,
                                         requested_ids=student.topk_ids if serves_ids else None,
                                         temperature=obj.teacher_temperature)
    texts, correct = _grade_rollouts(tr, rollouts, indices)
    if teacher_call is not None:
        with _timed(timings, "teacher"):
            teacher = teacher_call.result()
        if obj.top_k and strategy_spec(obj.strategy).teacher_slots:
            with _timed(timings, "student"), gathered(tr.student, tr.dist), autocast(device, tr.autocast_dtype):
                student_at_teacher_BTK = tr.student_scorer.score(
                    rollouts, top_k=0, requested_ids=teacher.topk_ids, temperature=cfg.rollout.temperature,
                    with_entropy=False,
                ).requested_logprobs
    _mark_memory(tr, "scoring")

    # 5. token rewards → advantages
    if obj.advantage == "grpo":
        candidate_ids_BTJ, valid_BTJ = rollouts.response_ids[..., None], mask_BT[..., None]
        old_lp_BTJ = student.sampled_logprobs[..., None]
        rewards_BTJ = torch.zeros_like(old_lp_BTJ)
    elif obj.top_k == 0:
        sampled = sampled_token_rewards(student.sampled_logprobs, teacher.sampled_logprobs, rollouts.response_ids, mask_BT)
        candidate_ids_BTJ, valid_BTJ, rewards_BTJ = sampled.candidate_ids, sampled.valid, sampled.rewards
        old_lp_BTJ, teacher_lp_BTJ = sampled.student_logprobs, sampled.teacher_logprobs
    else:
        k = obj.top_k
        candidate_ids_BTJ, valid_BTJ = build_candidates(student.topk_ids[..., :k], teacher.topk_ids[..., :k], mask_BT, obj.strategy)
        old_lp_BTJ, teacher_lp_BTJ = gather_candidate_logprobs(
            obj.strategy, student.topk_logprobs[..., :k],
            None if teacher.requested_logprobs is None else teacher.requested_logprobs[..., :k],  # None: only_tch
            teacher.topk_logprobs[..., :k], None if student_at_teacher_BTK is None else student_at_teacher_BTK[..., :k],
        )
        rewards_BTJ, _ = candidate_rewards(old_lp_BTJ, teacher_lp_BTJ, valid_BTJ, strategy=obj.strategy, weight=obj.weight)
    reward_metrics = _reward_stats("reward", rewards_BTJ, valid_BTJ, mask_BT)
    outcome_B = torch.tensor(correct, dtype=torch.float32, device=device) if correct is not None else None
    adv = compute_advantages(
        obj.advantage, rewards=rewards_BTJ, valid=valid_BTJ, response_mask=mask_BT, group_ids=rollouts.group_ids,
        outcome_rewards=outcome_B, outcome_weight=obj.outcome_weight, candidate_ids=candidate_ids_BTJ,
        response_ids=rollouts.response_ids, sampled_old_logprobs=student.sampled_logprobs, old_logprobs=old_lp_BTJ,
    )
    candidate_ids_BTJ, valid_BTJ, advantages_BTJ, old_lp_BTJ = adv.candidate_ids, adv.valid, adv.advantages, adv.old_logprobs
    if obj.loss in ("forward_kl", "jsd"):  # GKD-style objectives live on the teacher's top-k support
        k = obj.top_k or diag_k
        candidate_ids_BTJ, teacher_lp_BTJ = teacher.topk_ids[..., :k], teacher.topk_logprobs[..., :k]
        valid_BTJ = mask_BT[..., None].expand_as(candidate_ids_BTJ)
    tis_BT = None
    if obj.tis_cap is not None and rollouts.rollout_logprobs is not None:
        tis_BT = truncated_is_weights(student.sampled_logprobs, rollouts.rollout_logprobs, obj.tis_cap, mask_BT)
        is_metrics = _is_weight_stats(student.sampled_logprobs, rollouts.rollout_logprobs, obj.tis_cap, mask_BT)
    targets = {"old_lp": old_lp_BTJ, "advantages": advantages_BTJ, "valid": valid_BTJ, "mask": mask_BT,
               "teacher_lp": None if obj.loss == "pg" else teacher_lp_BTJ, "reference": reference_BT, "tis": tis_BT}

    # 6. update: grad forward in micro-batches; the loss divides by the token count of the *whole* batch (all ranks)
    with _timed(timings, "update"):
        num_tokens = all_reduce_sum(mask_BT.sum(), tr.dist).clamp(min=1)
        num_seqs = all_reduce_sum(torch.tensor(rollouts.batch_size, device=device), tr.dist)
        loss_metrics: list[dict] = []
        tr.student.train()
        lengths_B = needed_lengths(rollouts)
        groups = split_by_token_budget(lengths_B, cfg.micro_batch_tokens, padded=not uses_packing(tr.student))
        # FSDP: every rank must run as many forward/backward passes (each all-gathers and reduce-scatters), so ranks
        # with fewer micro-batches repeat their first one with a zero loss.
        num_real = len(groups)
        groups += [groups[0]] * (max_over_ranks(num_real, tr.dist) - num_real)
        for index, rows in enumerate(groups):
            micro = rollouts.select(rows)
            with autocast(device, tr.autocast_dtype), activation_budget(tr.activation_budget):  # the chunked head too
                hidden = forward_hidden(tr.student, micro, through_root=world > 1)  # FSDP's root hooks must run
                head = output_head(tr.student)  # after the forward: under FSDP, the root's unsharded head weight
                ids_NJ = candidate_ids_BTJ[rows][hidden.rows_N, hidden.cols_N]
                if reference_BT is not None:  # the KL term needs the sampled token's log-prob as one more column
                    ids_NJ = torch.cat([ids_NJ, hidden.targets_N[:, None]], dim=-1)
                lp_NJ, entropy_N = candidate_logprobs_and_entropy(
                    hidden.hidden_ND, head, ids_NJ, temperature=cfg.rollout.temperature, vocab_size=tr.vocab_size)
            loss, metrics = micro_loss(obj, hidden.to_grid(lp_NJ), hidden.to_grid(entropy_N), rows, targets,
                                       global_num_tokens=num_tokens, global_num_seqs=num_seqs)
            if index >= num_real:  # padding pass (see above): gradients of zero, metrics not counted
                loss = loss * 0.0
            else:
                loss_metrics.append(metrics)
            # FSDP averages gradients over ranks; the loss is already a share of the global mean, so scale it back
            # up: the summed update equals the single-process one on the same global batch.
            (loss * world).backward()
        tr.student.eval()
        _mark_memory(tr, "forward_backward")
        grad_norm, stepped = clip_and_step(tr.student, tr.optimizer, tr.scheduler, cfg.optim.grad_clip)
        tr.generator.sync_weights()
    tr.skipped_steps += 0 if stepped else 1
    _mark_memory(tr, "optimizer_step")
    if ahead is not None:  # waiting here keeps every step self-contained: nothing runs during eval or a save
        with _timed(timings, "rollout_wait"):
            tr.pending_rollouts = PendingRollouts(indices=ahead[0], output=ahead[1].result())
        _release(tr.rollout_generator)

    # 7. diagnostics (one host sync for all of them)
    metrics: dict[str, Any] = {"grad_norm": grad_norm, "lr": tr.scheduler.get_last_lr()[0], "skipped_steps": tr.skipped_steps}
    metrics.update(_sum_micro_metrics(loss_metrics))
    metrics.update(reward_metrics, **_reward_stats("advantage", advantages_BTJ, valid_BTJ, mask_BT))
    metrics["valid_slots_per_token"] = valid_BTJ.sum() / mask_BT.sum().clamp(min=1)
    metrics["policy_lag"] = 0 if pending is None else 1  # optimizer steps between the sampling and the current policy
    if tis_BT is not None:
        metrics.update(is_metrics)
    if teacher is not None:
        from opd.objectives.diagnostics import logprobs_on_overlap

        teacher_at_student_BTK = teacher.requested_logprobs
        if teacher_at_student_BTK is None:  # a teacher serving only its own top-k: the diagnostics need S_t ∩ T_t
            teacher_at_student_BTK = logprobs_on_overlap(student.topk_ids, teacher.topk_ids, teacher.topk_logprobs)
        metrics.update(opd_diagnostics(
            student_topk_ids=student.topk_ids, student_topk_logprobs=student.topk_logprobs,
            teacher_topk_ids=teacher.topk_ids, teacher_topk_logprobs=teacher.topk_logprobs,
            teacher_logprobs_at_student_topk=teacher_at_student_BTK, student_entropy=student.entropy,
            teacher_entropy=teacher.entropy, response_mask=mask_BT,
        ))
        metrics.update(_seq_reward_metrics(student, teacher, mask_BT, correct))
    if rollouts.rollout_logprobs is not None:  # engine vs trainer: what truncated importance weights correct
        gap_BT = (student.sampled_logprobs - rollouts.rollout_logprobs).abs()
        metrics["rollout_logprob_abs_diff"] = (gap_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    lengths = mask_BT.sum(-1).float()
    metrics.update(response_length=lengths.mean(), truncation_rate=rollouts.truncated.float().mean())
    if correct is not None:
        metrics["rollout_accuracy"] = sum(correct) / len(correct)
    metrics = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
    total = sum(timings.values())
    metrics.update({f"time/{k}": v for k, v in timings.items()}, **{"time/step": total})
    metrics["tokens_per_second"] = float(lengths.sum()) / max(total, 1e-9)
    if tr.dist.is_main:
        _write_samples(tr, rollouts, texts, correct, rewards_BTJ)  # rank 0's rollouts only
    # ranks → one line: losses (shares of a global mean) and throughput add up, everything else is averaged
    summed = tuple(k for k in metrics if _is_summed_loss(k)) + ("tokens_per_second",)
    return reduce_metrics(metrics, tr.dist, summed=summed)


def micro_loss(obj, lp_BTJ, entropy_BT, rows, targets: dict, *, global_num_tokens, global_num_seqs) -> tuple:
    """The loss of one micro-batch (rows `rows` of the step's batch), divided by the *global* token/sequence count so
    that summing micro-batch gradients gives the batch gradient (SPEC §4). `lp_BTJ` has the candidate columns, plus
    the sampled token's column last when a reference KL is on. Returns (loss, detached metrics)."""
    from opd.objectives import agg_loss, forward_kl, jsd, kl_penalty, policy_loss, topk_kl

    mask_BT, valid_BTJ = targets["mask"][rows], targets["valid"][rows]
    agg = dict(loss_agg_mode=obj.loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
    if targets["reference"] is not None:
        lp_BTJ, sampled_lp_BT = lp_BTJ[..., :-1], lp_BTJ[..., -1]
    if obj.loss == "pg":
        tis_BT = None if targets["tis"] is None else targets["tis"][rows]
        loss, metrics = policy_loss(
            lp_BTJ, targets["old_lp"][rows], targets["advantages"][rows], valid_BTJ, mask_BT,
            clip_ratio_low=obj.clip_ratio_low, clip_ratio_high=obj.clip_ratio_high, clip_ratio_c=obj.clip_ratio_c,
            rollout_is_weights=tis_BT, **agg,
        )
    else:
        divergence = {"topk_kl": topk_kl, "forward_kl": forward_kl, "jsd": lambda s, t, v: jsd(s, t, v, beta=obj.jsd_beta)}
        loss = agg_loss(divergence[obj.loss](lp_BTJ, targets["teacher_lp"][rows], valid_BTJ), mask_BT, **agg)
        metrics = {f"{obj.loss}_loss": loss.detach()}
    if targets["reference"] is not None:
        kl = agg_loss(kl_penalty(sampled_lp_BT, targets["reference"][rows], obj.kl_type), mask_BT, **agg)
        loss = loss + obj.kl_coef * kl
        metrics["kl_reference"] = kl.detach()
    if obj.entropy_coef:
        entropy = agg_loss(entropy_BT, mask_BT, **agg)
        loss = loss - obj.entropy_coef * entropy
        metrics["entropy_bonus"] = entropy.detach()
    return loss, metrics


# ----------------------------------------------------------------------------------------------- the loop


def distill(config: DistillConfig, *, console: Any = None) -> Path:
    """Run `opd distill` and return the run directory."""
    from rich.console import Console

    from opd.train.distributed import broadcast_object, destroy_distributed, init_distributed

    info = init_distributed()  # SINGLE without torchrun
    console = (console or Console()) if info.is_main else Console(quiet=True)  # rank 0 speaks for all
    run_dir = broadcast_object(run_directory(config.run, "distill"), info)  # its default name has a timestamp
    # rank 0 owns the run directory: locked, never shared with another run (common.claimed_run_dir)
    with claimed_run_dir(run_dir, config.run, "distill", console=console) if info.is_main else nullcontext(run_dir):
        tr = setup(config, run_dir, checkpoint=resume_checkpoint(run_dir, config.run, console, config),
                   console=console, dist=info)
        train(tr, console=console)
        if callable(getattr(tr.generator, "close", None)):  # vLLM: its groups go before the process group they live in
            tr.generator.close()
    destroy_distributed(info)
    return run_dir


def train(tr: Trainer, *, console: Any) -> None:
    from opd.report.sinks import progress_bar
    from opd.train.common import eval_at_start
    from opd.train.distributed import barrier

    cfg, main = tr.config, tr.dist.is_main
    if eval_at_start(cfg.run, cfg.eval, tr.step):  # the student before training: eval/step_0
        with gathered(tr.student, tr.dist):
            if main:
                run_eval(tr, console)
    with progress_bar(console) as progress:
        task = progress.add_task("opd distill", total=cfg.run.steps, completed=tr.step)
        if tr.step and cfg.eval.benchmarks and is_due(tr.step, cfg.run.eval_every, cfg.run.steps) \
                and eval_pending(tr.run_dir, tr.step):  # resumed from a checkpoint whose eval did not finish
            with gathered(tr.student, tr.dist):
                if main:
                    run_eval(tr, console)
        while tr.step < cfg.run.steps:
            metrics = opd_step(tr)  # already reduced over ranks
            tr.step += 1
            if main:
                tr.sink.log(tr.step, metrics)
            tr.history.append({"step": tr.step, **metrics})
            progress.update(task, advance=1, description=_console_line(tr.step, metrics))
            if is_due(tr.step, cfg.run.save_every, cfg.run.steps):  # before the eval: a failing eval loses no work
                save(tr)
            if is_due(tr.step, cfg.run.eval_every, cfg.run.steps):
                with gathered(tr.student, tr.dist):  # rank 0 evaluates alone: no collectives inside
                    if main:
                        run_eval(tr, console)
    if main:
        finish_run(tr.run_dir, tr.sink, report=cfg.run.report, console=console)
    barrier(tr.dist)


def _console_line(step: int, m: dict) -> str:
    parts = [f"step {step}"]
    for key, label in (("reward_mean", "r"), ("overlap_ratio", "ovl"), ("entropy_student", "H"),
                       ("rollout_accuracy", "acc"), ("grad_norm", "|g|"), ("tokens_per_second", "tok/s")):
        if key in m and m[key] is not None:
            parts.append(f"{label} {m[key]:.3g}")
    return " ".join(parts)


def run_eval(tr: Trainer, console: Any) -> dict | None:
    cfg = tr.config
    return evaluate_in_training(
        cfg.eval, step=tr.step, run_dir=tr.run_dir, model_path=cfg.student.path, generator=tr.generator,
        tokenizer=tr.tokenizer, template=cfg.data.template, enable_thinking=cfg.data.enable_thinking,
        max_prompt_length=cfg.data.max_prompt_length, batch_size=cfg.rollout.batch_size, seed=cfg.run.seed,
        sink=tr.sink, console=console,
    )


def save(tr: Trainer) -> Path:
    """Every rank calls this (FSDP: the full weights and optimizer state are gathered); rank 0 writes."""
    from opd.train.checkpoint import save_checkpoint
    from opd.train.distributed import barrier, full_optimizer_state_dict, full_state_dict

    weights = full_state_dict(tr.student, tr.dist)  # None with one process: save the module itself
    state = trainer_state(tr.optimizer, tr.scheduler, tr.sampler, skipped_steps=tr.skipped_steps, history=tr.history,
                          pending_rollouts=tr.pending_rollouts and tr.pending_rollouts.state_dict(),
                          world_size=tr.dist.world_size)
    state["optimizer"] = full_optimizer_state_dict(tr.student, tr.optimizer, tr.dist)
    path = tr.run_dir / "checkpoints" / f"step_{tr.step}"
    if tr.dist.is_main:
        path = save_checkpoint(tr.run_dir, tr.step, model=tr.student, tokenizer=tr.tokenizer, trainer_state=state,
                               keep_last=tr.config.run.keep_last, state_dict=weights)
    barrier(tr.dist)  # nobody reads the checkpoint before it is complete
    return path


# ---------------------------------------------------------------------------------------------------- setup


def setup(config: DistillConfig, run_dir: Path, *, checkpoint: Path | None = None, console: Any = None,
          dist: DistInfo = SINGLE) -> Trainer:
    """Validate everything cheap first (config, data, tokenizers), then load models and build the trainer.
    `dist` (from `init_distributed`): with world size > 1 the student is sharded with FSDP2 on the rank's device."""
    from opd.data.prompts import load_prompts
    from opd.data.templates import encode_prompts
    from opd.models import check_tokenizer_compatibility, compile_layers, load_model, load_tokenizer, resolve_device
    from opd.rollout import make_generator
    from opd.rollout.registry import check_generation_fits
    from opd.teacher.local import LocalScorer
    from opd.teacher.registry import check_teacher_serves, check_teacher_tokenizer, load_teacher
    from opd.train.distributed import shard_model
    from opd.train.optim import build_optimizer, build_scheduler
    from opd.train.sampler import PromptSampler

    obj = config.objective
    if config.prompts_per_step % dist.world_size:
        raise ValueError(f"prompts_per_step={config.prompts_per_step} must be divisible by the {dist.world_size} "
                         f"processes (each takes an equal slice of a step's prompts)")
    if obj.advantage != "grpo" and config.teacher is None:
        raise ValueError(f"objective.advantage={obj.advantage} needs a teacher: pass --teacher (or teacher.path=...)")
    if obj.advantage == "token_grpo" and obj.top_k:
        raise ValueError("objective.advantage=token_grpo is sampled-token only: set objective.top_k=0")
    if obj.loss == "full_reverse_kl":
        raise ValueError("objective.loss=full_reverse_kl needs the teacher's full distribution in the grad pass and is "
                         "only available as opd.objectives.full_reverse_kl; use pg, topk_kl, forward_kl or jsd")
    if obj.loss == "topk_kl" and obj.top_k == 0:  # a one-token support renormalises to KL = 0: nothing would learn
        raise ValueError("objective.loss=topk_kl needs a top-k support: set objective.top_k > 0 (e.g. 16)")
    if obj.loss != "pg" and obj.advantage != "token_reward":
        raise ValueError(f"objective.loss={obj.loss} uses no advantages; leave objective.advantage=token_reward")
    if config.rollout.overlap and (obj.tis_cap is None or dist.world_size > 1):
        raise ValueError("rollout.overlap=true trains on rollouts sampled one step earlier: it needs objective.tis_cap "
                         "(e.g. 2.0) to correct them, and one process" + (f" (got {dist.world_size})"
                                                                        if dist.world_size > 1 else ""))
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    if config.micro_batch_tokens < longest:
        raise ValueError(
            f"micro_batch_tokens={config.micro_batch_tokens} is smaller than one sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens = {longest}); raise it to at least {longest}"
        )
    torch.manual_seed(config.run.seed)

    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    if config.teacher is not None:
        check_teacher_tokenizer(config.teacher, student_tokenizer)
        check_teacher_serves(config.teacher, obj)
    if config.rollout.engine == "vllm":
        _check_vllm_rollouts(config, console)
    prompts = load_prompts(
        config.data.path, prompt_key=config.data.prompt_key, answer_key=config.data.answer_key,
        id_key=config.data.id_key, split=config.data.split, limit=config.data.limit,
        on_missing_answer=config.data.on_missing_answer,
    )
    encoded = encode_prompts(
        student_tokenizer, prompts, max_prompt_length=config.data.max_prompt_length,
        on_overflow=config.data.on_overflow, enable_thinking=config.data.enable_thinking, template=config.data.template,
    )
    if console is not None and encoded.num_filtered:
        console.print(f"[yellow]{encoded.num_filtered} prompts longer than data.max_prompt_length={config.data.max_prompt_length} filtered[/]")
    if not encoded.prompts:
        raise ValueError(f"no prompts left in {config.data.path} after filtering by data.max_prompt_length={config.data.max_prompt_length}")
    if config.prompts_per_step > len(encoded.prompts):
        raise ValueError(
            f"prompts_per_step={config.prompts_per_step} exceeds the {len(encoded.prompts)} prompts of {config.data.path}; lower prompts_per_step"
        )
    if obj.advantage in ("grpo", "token_reward+grpo") and any(p.answer is None for p in encoded.prompts):
        raise ValueError(f"objective.advantage={obj.advantage} needs ground-truth answers; set data.answer_key to the answer column")
    if obj.advantage in ("grpo", "token_reward+grpo") and not any(
            str(answer).strip() for p in encoded.prompts
            for answer in (p.answer if isinstance(p.answer, list) else [p.answer or ""])):
        raise ValueError(f"objective.advantage={obj.advantage} needs ground-truth answers, but every answer of "
                         f"{config.data.path} (column {config.data.answer_key!r}) is empty; point data.answer_key at "
                         f"the answers")
    load_eval_sets(config.eval, student_tokenizer, template=config.data.template,  # fails now, not after training
                   enable_thinking=config.data.enable_thinking, max_prompt_length=config.data.max_prompt_length)

    student_path = str(checkpoint) if checkpoint else config.student.path
    device = dist.device or resolve_device(config.student.device)  # under torchrun: the rank's own device
    weights_dtype, autocast_dtype = training_precision(config.student, device)
    student, tokenizer = load_model(student_path, dtype=weights_dtype, device=device,
                                    trust_remote_code=config.student.trust_remote_code,
                                    attn_implementation=config.student.attn_implementation)
    student_rows = student.get_output_embeddings().weight.shape[0]
    vocab = check_tokenizer_compatibility(tokenizer, tokenizer, student_vocab_size=student_rows, teacher_vocab_size=student_rows)
    teacher = teacher_scorer = None
    if config.teacher is not None:
        loaded = load_teacher(config.teacher, student_tokenizer=student_tokenizer, student_rows=student_rows,
                              student_device=device, world_size=dist.world_size, offload=config.teacher_offload,
                              max_tokens_per_batch=config.score_batch_tokens, objective=obj,
                              max_batch_size=config.rollout.batch_size)
        teacher, teacher_scorer, vocab = loaded.module, loaded.scorer, loaded.vocab
    # ids beyond the tokenizer are embedding padding rows: never sampled, never a top-k candidate (SPEC §1)
    vocab_size = vocab.tokenizer_size
    shard_model(student, dist)  # FSDP2 (no-op for one process); the optimizer below sees the sharded parameters
    with gathered(student, dist):  # the scorer checks the head once with a forward
        student_scorer = LocalScorer(student, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size,
                                     through_root=dist.world_size > 1)
    # Under FSDP every engine runs from full weights: the in-process ones (torch, static) read the student's unsharded
    # parameters inside `gathered` (opd_step), vLLM gets `all_full_weights` at each sync (opd.train.distributed).
    generator = make_generator(student, tokenizer, max_batch_size=config.rollout.batch_size, vocab_size=vocab_size,
                               max_batch_tokens=config.rollout.max_batch_tokens, engine=config.rollout.engine,
                               **_vllm_engine_arguments(config, student_path, student, dist))
    rollout_model = rollout_generator = None
    if config.rollout.overlap:  # a snapshot the background rollouts read while the student is updated
        rollout_model, rollout_generator = overlap_generator(student, tokenizer, config, vocab_size, autocast_dtype)
    from opd.check import preflight  # `opd check`'s tokenizers, scoring and resources rows; raises on a hard failure

    teacher_tokenizer = None  # a served or vLLM teacher has no module here: its tokenizer was compared above
    if teacher is not None:
        teacher_tokenizer = load_tokenizer(config.teacher.path, trust_remote_code=config.teacher.trust_remote_code)
    preflight(config, student_tokenizer=student_tokenizer, teacher_tokenizer=teacher_tokenizer,
              student=student, teacher=teacher, student_scorer=student_scorer, teacher_scorer=teacher_scorer,
              generator=generator, prompts=encoded.prompts, prompt_ids=encoded.input_ids, vocab_size=vocab_size,
              autocast_dtype=autocast_dtype, world_size=dist.world_size, console=console if dist.is_main else None)
    compiled = False
    if dist.world_size == 1 or config.compile:  # FSDP2 + compile untested: only when asked for
        compiled = compile_layers(student, config.compile)
        if teacher is not None:  # an offloaded teacher runs only on the GPU too (`on_device`)
            compile_layers(teacher, config.compile)
    # checkpointing: full (HF, per layer) when asked; by default on CUDA selective inside the compiled layers
    # (docs/performance.md: the update's speed and memory under each)
    budget = None
    auto_full = config.gradient_checkpointing is None and device.type == "cuda" and not compiled
    if config.gradient_checkpointing or auto_full:
        student.gradient_checkpointing_enable()
    elif config.gradient_checkpointing is None and compiled:
        budget = config.activation_budget
    reference_scorer = None
    if obj.kl_coef:  # a frozen copy of the initial student, only when a KL term asks for it
        reference, _ = load_model(config.student.path, dtype=autocast_dtype or weights_dtype, device=device,
                                  trust_remote_code=config.student.trust_remote_code,
                                  attn_implementation=config.student.attn_implementation)
        reference.requires_grad_(False)
        reference_scorer = LocalScorer(reference, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size)

    optimizer = build_optimizer(student.parameters(), config.optim)
    # One rollout must fit next to the models and the optimizer state, which AdamW allocates at its first step (two
    # moments per trainable parameter of this rank's shard, counted at the parameters' size): fail now, before any
    # data reaches the GPU.
    local = [getattr(p, "to_local", lambda p=p: p)() for p in student.parameters() if p.requires_grad]
    with autocast(device, autocast_dtype):
        check_generation_fits(generator, prompt_tokens=config.data.max_prompt_length,
                              new_tokens=config.rollout.max_new_tokens, reserve_bytes=2 * sum(
                                  p.numel() * p.element_size() for p in local) + gathered_bytes(student, dist),
                              names=("data.max_prompt_length", "rollout.max_new_tokens"))
    scheduler = build_scheduler(optimizer, config.run.steps, config.optim)
    sampler = PromptSampler(len(encoded.prompts), config.prompts_per_step, seed=config.run.seed)
    tr = Trainer(
        config=config, run_dir=run_dir, student=student, tokenizer=tokenizer, prompts=encoded.prompts,
        prompt_ids=encoded.input_ids, generator=generator, student_scorer=student_scorer, teacher=teacher,
        teacher_scorer=teacher_scorer, reference_scorer=reference_scorer, vocab_size=vocab_size, optimizer=optimizer,
        scheduler=scheduler, sampler=sampler, sink=None, autocast_dtype=autocast_dtype, dist=dist,
        activation_budget=budget, rollout_model=rollout_model, rollout_generator=rollout_generator,
    )
    resume_step = None
    if checkpoint is not None:
        state = restore_trainer_state(checkpoint, _FullStateOptimizer(student, optimizer, dist), scheduler, sampler)
        tr.step, tr.skipped_steps, tr.history = state["step"], state["skipped_steps"], state["history"]
        if config.rollout.overlap:  # the rollouts generated for the next step, from weights no longer saved
            tr.pending_rollouts = PendingRollouts.from_state(state.get("pending_rollouts"))
        resume_step = tr.step
        if console is not None:
            console.print(f"resumed from {checkpoint} (step {tr.step}){_world_size_change(state, dist)}")
    if dist.is_main:  # rank 0 writes the run directory
        tr.sink = open_run(config, run_dir, config.run, resume_step=resume_step)
    return tr


def overlap_generator(student: torch.nn.Module, tokenizer: Any, config: DistillConfig, vocab_size: int,
                      dtype: torch.dtype | None) -> tuple[torch.nn.Module, Any]:
    """rollout.overlap: a frozen copy of the student in the rollout dtype (autocast's, else the weights') and the
    configured engine over it. The copy's weights are refreshed from the student at the start of every step."""
    from opd.rollout import make_generator

    snapshot = rollout_snapshot(student, dtype or next(student.parameters()).dtype)
    generator = make_generator(snapshot, tokenizer, max_batch_size=config.rollout.batch_size, vocab_size=vocab_size,
                               engine=config.rollout.engine)
    return snapshot, generator


def rollout_snapshot(student: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the student in `dtype`, in eval mode, that runs its own weights (a deep copy drops the layers'
    in-place compilation: `nn.Module.__getstate__`). Its parameters keep requires_grad: on CPU turning it off changes
    which kernels run, and so the rounding."""
    import copy

    return copy.deepcopy(student).to(dtype).eval()


@dataclass
class _FullStateOptimizer:
    """What `restore_trainer_state` loads the optimizer state through: under FSDP the checkpoint holds the full,
    name-keyed state (`full_optimizer_state_dict`); with one process this is `optimizer.load_state_dict`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dist: DistInfo

    def load_state_dict(self, state: dict) -> None:
        from opd.train.distributed import load_full_optimizer_state_dict

        load_full_optimizer_state_dict(self.model, self.optimizer, state, self.dist)


# -------------------------------------------------------------------------------------------------- helpers


VLLM_TIS_CAP = 2.0  # the cap recommended at start-up (verl's truncated importance sampling default)


def _check_vllm_rollouts(config: DistillConfig, console: Any) -> None:
    """rollout.engine=vllm: the package is there, its log-probs are comparable, and a word on importance weights."""
    from opd.rollout.vllm_engine import vllm_available

    if not vllm_available():
        raise ValueError("rollout.engine=vllm needs the vllm package (README: vLLM); or use rollout.engine=auto")
    if config.objective.tis_cap is not None and config.rollout.top_p < 1:
        raise ValueError(f"objective.tis_cap needs full-vocabulary rollout log-probs, but vLLM reports them after "
                         f"top-p filtering: set rollout.top_p=1 (got {config.rollout.top_p}) or rollout.engine=torch")
    if console is not None and config.objective.tis_cap is None:
        console.print(f"rollout.engine=vllm: rollouts come from another engine than the trainer; their log-prob gap "
                      f"is logged as rollout_logprob_abs_diff, and no importance weights correct it (objective."
                      f"tis_cap unset, the paper's recipe); set objective.tis_cap={VLLM_TIS_CAP} to truncate them")


def _vllm_engine_arguments(config: DistillConfig, student_path: str, student: torch.nn.Module,
                           dist: DistInfo) -> dict:
    """make_generator's extra arguments for rollout.engine=vllm: the path vLLM loads, its options, and under torchrun
    the full weights every rank's engine is synced with."""
    if config.rollout.engine != "vllm":
        return {}
    from opd.rollout.vllm_engine import EngineOptions

    options = EngineOptions.from_config(config.rollout.vllm, dtype=config.student.dtype,
                                        trust_remote_code=config.student.trust_remote_code)
    arguments: dict[str, Any] = dict(model_path=student_path, engine_options=options)
    if dist.world_size > 1:
        from opd.train.distributed import all_full_weights

        arguments["weights_fn"] = lambda: all_full_weights(student, dist)
    return arguments



def _world_size_change(state: dict, dist: DistInfo) -> str:
    """A note when a checkpoint resumes at another world size than it was saved at (allowed: the global batches, the
    optimizer state and the schedule are the same; only sums over ranks regroup, at float rounding level)."""
    saved = state.get("world_size")  # absent in checkpoints written before it was recorded
    if saved is None or saved == dist.world_size:
        return ""
    return (f"; saved by {saved} process{'es' * (saved > 1)}, resumed by {dist.world_size}: the same global batches, "
            f"sums over ranks regrouped (results differ from an uninterrupted run at float rounding level; sampled "
            f"rollouts differ too, each rank drawing with its own seed)")


def _step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The rollout seed of a step; each rank samples with its own (rank 0's equals the single-process seed)."""
    return derive_seed(seed, step=step, index=rank, salt=SALT_STEP_ROLLOUT)


def _sampling_params(cfg: DistillConfig, step: int, rank: int):
    """How step `step`'s rollouts are sampled (the same whether they are generated in that step or one ahead)."""
    from opd.rollout import SamplingParams

    return SamplingParams(
        n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens, seed=_step_seed(cfg.run.seed, step, rank),
        # vLLM's log-probs are always kept when they are the full-vocabulary ones (top_p = 1): the engine-vs-trainer
        # gap is logged every step (rollout_logprob_abs_diff)
        return_logprobs=cfg.objective.tis_cap is not None or (cfg.rollout.engine == "vllm" and cfg.rollout.top_p == 1),
    )


def _release(generator: Any) -> None:
    """Let an engine free what it holds between rollouts (caches, weight copies) if it offers `release()`; the
    scoring and update phases then have that memory. Engines without it keep nothing between calls."""
    release = getattr(generator, "release", None)
    if callable(release):
        release()


def _mark_memory(tr: Trainer, phase: str) -> None:
    """With `tr.memory_trace` set (benchmarks): record the CUDA memory allocated now and the peak since the previous
    mark (GiB), labelled by the phase that just ended, and restart the peak counter."""
    if tr.memory_trace is None or not torch.cuda.is_available():
        return
    tr.memory_trace.append({"step": tr.step, "phase": phase, "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                            "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
    torch.cuda.reset_peak_memory_stats()


def _start_next_rollouts(tr: Trainer, device: torch.device) -> tuple[list[int], "_Background"]:
    """rollout.overlap: draw the next step's prompts, copy the current weights into `tr.rollout_model`, and generate
    the next step's rollouts from that copy in a background thread (on CUDA in its own stream), while this step
    scores and updates the student. Same prompts and seed as the next step would use without overlap."""
    rank, world = tr.dist.rank, tr.dist.world_size
    indices = tr.sampler.next_batch()[rank::world]
    prompt_ids = [tr.prompt_ids[i] for i in indices]
    with torch.no_grad():
        for source, target in zip(tr.student.parameters(), tr.rollout_model.parameters()):
            target.copy_(source)
    params = _sampling_params(tr.config, tr.step + 1, rank)
    return indices, _Background(lambda: tr.rollout_generator.generate(prompt_ids, params), device, tr.autocast_dtype)


class _Background:
    """`fn()` in a thread (its own CUDA stream, ordered after the work queued so far, e.g. a weight copy); `result()`
    waits for it and re-raises its exception."""

    def __init__(self, fn, device: torch.device, autocast_dtype: torch.dtype | None):
        import threading

        self._value, self._error = None, None
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: keep the CPU reductions' order
        stream = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))

        def run() -> None:
            from contextlib import nullcontext

            torch.set_num_threads(threads)
            try:  # autocast and the current stream are per thread: set them here
                with torch.cuda.stream(stream) if stream is not None else nullcontext(), autocast(device, autocast_dtype):
                    self._value = fn()
            except BaseException as error:  # noqa: BLE001 (re-raised in the training thread)
                self._error = error

        self._thread = threading.Thread(target=run, name="opd-rollout-ahead", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _is_weight_stats(old_lp_BT: torch.Tensor, rollout_lp_BT: torch.Tensor, cap: float, mask_BT: torch.Tensor) -> dict:
    """Statistics of the importance weights exp(ℓ_old − ℓ_rollout) over response tokens: the mean of the truncated
    weights the loss uses, the largest untruncated weight, and the fraction of tokens the cap truncates."""
    mask = mask_BT.bool()
    raw_BT = (old_lp_BT.detach() - rollout_lp_BT.detach()).clamp(-20.0, 20.0).exp()
    count = mask.sum().clamp(min=1)
    return {"is_weight_mean": (raw_BT.clamp_max(cap) * mask).sum() / count,
            "is_weight_max": torch.where(mask, raw_BT, torch.zeros_like(raw_BT)).max(),
            "is_weight_capped_frac": ((raw_BT > cap) & mask).sum() / count}


def _sum_micro_metrics(metrics: list[dict]) -> dict:
    """Micro-batch losses are already divided by the global count, so the step's loss is their sum."""
    if not metrics:
        return {}
    out = {}
    for key in metrics[0]:
        values = torch.stack([m[key].float() for m in metrics])
        out[key] = values.sum() if _is_summed_loss(key) else values.mean()
    return out


def _is_summed_loss(key: str) -> bool:
    """Loss terms divided by the global token count: micro-batches and ranks add up to the step's value."""
    return key.endswith("_loss") or key in ("loss", "kl_reference", "entropy_bonus")


def _reward_stats(name: str, values_BTJ, valid_BTJ, mask_BT) -> dict:
    """Token-mean of the per-position sum over slots, and of its absolute value."""
    position_BT = (values_BTJ * valid_BTJ).sum(-1)
    count = mask_BT.sum().clamp(min=1)
    return {f"{name}_mean": (position_BT * mask_BT).sum() / count,
            f"{name}_abs_mean": (position_BT.abs() * mask_BT).sum() / count}


def _seq_reward_metrics(student: TokenScores, teacher: TokenScores, mask_BT, correct) -> dict:
    from opd.objectives import auroc, seq_rewards

    seq_B = seq_rewards(teacher.sampled_logprobs, student.sampled_logprobs, mask_BT)
    metrics = {"seq_reward_mean": seq_B.mean()}
    if correct is not None:
        metrics["seq_reward_auroc"] = auroc(seq_B, torch.tensor(correct, device=seq_B.device))
    return metrics


def _grade_rollouts(tr: Trainer, rollouts: Rollouts, indices: list[int]) -> tuple[list[str], list[bool] | None]:
    """Decode every rollout; grade it when the prompts carry answers (rule-based accuracy, GRPO rewards)."""
    from opd.eval.grading import grade_responses

    answers = [tr.prompts[indices[g]].answer for g in rollouts.group_ids.tolist()]
    texts, grades = grade_responses(tr.tokenizer, rollouts.response_ids, answers,
                                    lengths=rollouts.response_mask.sum(-1).tolist())
    return texts, None if grades is None else [g.correct for g in grades]


def _write_samples(tr: Trainer, rollouts: Rollouts, texts: list[str], correct, rewards_BTJ) -> None:
    count = min(tr.config.run.samples_per_step, rollouts.batch_size)
    if not count:
        return
    from opd.io import write_jsonl

    records = []
    position_rewards_BT = rewards_BTJ.sum(-1)
    for row in range(count):
        length = int(rollouts.response_mask[row].sum())
        ids = rollouts.response_ids[row, :length].tolist()
        prompt_length = int(rollouts.prompt_lengths[row])
        records.append({
            "step": tr.step + 1,
            "prompt": tr.tokenizer.decode(rollouts.input_ids[row, :prompt_length].tolist()),
            "response": texts[row],
            "correct": None if correct is None else correct[row],
            "tokens": tr.tokenizer.convert_ids_to_tokens(ids),
            "token_rewards": [round(r, 5) for r in position_rewards_BT[row, :length].tolist()],
        })
    write_jsonl(tr.run_dir / "samples" / f"step_{tr.step + 1}.jsonl", records)
