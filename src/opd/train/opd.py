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

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opd.config import DistillConfig
from opd.train.common import (
    evaluate_in_training, finish_run, is_due, open_run, restore_trainer_state, resume_checkpoint, run_directory,
    trainer_state, training_precision,
)
from opd.train.common import autocast
from opd.train.common import timed as _timed
from opd.train.distributed import SINGLE, DistInfo, all_reduce_sum, gathered, max_over_ranks, reduce_metrics
from opd.types import Prompt, Rollouts, TokenScores

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


# ------------------------------------------------------------------------------------------------ the step


def opd_step(tr: Trainer) -> dict[str, float]:
    """One on-policy step: rollouts of the current student, scored by the teacher, one optimizer update."""
    from opd.objectives import (
        build_candidates, candidate_rewards, compute_advantages, gather_candidate_logprobs, opd_diagnostics,
        sampled_token_rewards, strategy_spec, truncated_is_weights,
    )
    from opd.models import activation_budget
    from opd.rollout import SamplingParams
    from opd.rollout.batch import build_rollouts
    from opd.scoring import candidate_logprobs_and_entropy
    from opd.teacher.local import forward_hidden, needed_lengths, output_head, split_by_token_budget, uses_packing
    from opd.train.optim import clip_and_step

    cfg, obj, timings = tr.config, tr.config.objective, {}
    diag_k = obj.top_k or 16  # diagnostics always look at a top-16 support, also for sampled-token OPD
    device = next(tr.student.parameters()).device

    # 1. prompts (resumable seeded sampler): every rank draws the same global batch and keeps its own slice
    rank, world = tr.dist.rank, tr.dist.world_size
    indices = tr.sampler.next_batch()[rank::world]
    prompt_ids = [tr.prompt_ids[i] for i in indices]

    # 2. rollout: n samples per prompt from the current student (FSDP: weights gathered once, see `gathered`)
    with _timed(timings, "rollout"), gathered(tr.student, tr.dist), autocast(device, tr.autocast_dtype):
        params = SamplingParams(
            n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens, seed=_step_seed(cfg.run.seed, tr.step, rank),
            return_logprobs=obj.tis_cap is not None,
        )
        output = tr.generator.generate(prompt_ids, params)
        rollouts = build_rollouts(prompt_ids, output, pad_id=tr.tokenizer.pad_token_id, device=device)
    mask_BT = rollouts.response_mask

    # 3. student scores without grad (the behaviour policy): top-k support, log-probs, entropy
    with _timed(timings, "student"), gathered(tr.student, tr.dist), autocast(device, tr.autocast_dtype):
        student = tr.student_scorer.score(rollouts, top_k=diag_k, temperature=cfg.rollout.temperature)
        reference_BT = None if tr.reference_scorer is None else tr.reference_scorer.score(
            rollouts, top_k=0, temperature=cfg.rollout.temperature, with_entropy=False).sampled_logprobs

    # 4. teacher scores of the student's tokens: sampled token, its own top-k, log-probs at the student's top-k
    teacher: TokenScores | None = None
    student_at_teacher_BTK = None
    if tr.teacher_scorer is not None:
        with _timed(timings, "teacher"), _on_device(tr.teacher, device if cfg.teacher_offload else None):
            teacher = tr.teacher_scorer.score(
                rollouts, top_k=diag_k, requested_ids=student.topk_ids, temperature=obj.teacher_temperature
            )
        if obj.top_k and strategy_spec(obj.strategy).teacher_slots:
            with _timed(timings, "student"), gathered(tr.student, tr.dist), autocast(device, tr.autocast_dtype):
                student_at_teacher_BTK = tr.student_scorer.score(
                    rollouts, top_k=0, requested_ids=teacher.topk_ids, temperature=cfg.rollout.temperature,
                    with_entropy=False,
                ).requested_logprobs

    # 5. token rewards → advantages
    texts, correct = _grade_rollouts(tr, rollouts, indices)
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
            obj.strategy, student.topk_logprobs[..., :k], teacher.requested_logprobs[..., :k],
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
        grad_norm, stepped = clip_and_step(tr.student, tr.optimizer, tr.scheduler, cfg.optim.grad_clip)
        tr.generator.sync_weights()
    tr.skipped_steps += 0 if stepped else 1

    # 7. diagnostics (one host sync for all of them)
    metrics: dict[str, Any] = {"grad_norm": grad_norm, "lr": tr.scheduler.get_last_lr()[0], "skipped_steps": tr.skipped_steps}
    metrics.update(_sum_micro_metrics(loss_metrics))
    metrics.update(reward_metrics, **_reward_stats("advantage", advantages_BTJ, valid_BTJ, mask_BT))
    metrics["valid_slots_per_token"] = valid_BTJ.sum() / mask_BT.sum().clamp(min=1)
    if teacher is not None:
        metrics.update(opd_diagnostics(
            student_topk_ids=student.topk_ids, student_topk_logprobs=student.topk_logprobs,
            teacher_topk_ids=teacher.topk_ids, teacher_topk_logprobs=teacher.topk_logprobs,
            teacher_logprobs_at_student_topk=teacher.requested_logprobs, student_entropy=student.entropy,
            teacher_entropy=teacher.entropy, response_mask=mask_BT,
        ))
        metrics.update(_seq_reward_metrics(student, teacher, mask_BT, correct))
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
    tr = setup(config, run_dir, checkpoint=resume_checkpoint(run_dir, config.run, console), console=console,
               dist=info)
    train(tr, console=console)
    destroy_distributed(info)
    return run_dir


def train(tr: Trainer, *, console: Any) -> None:
    from opd.report.sinks import progress_bar
    from opd.train.distributed import barrier

    cfg, main = tr.config, tr.dist.is_main
    with progress_bar(console) as progress:
        task = progress.add_task("opd distill", total=cfg.run.steps, completed=tr.step)
        while tr.step < cfg.run.steps:
            metrics = opd_step(tr)  # already reduced over ranks
            tr.step += 1
            if main:
                tr.sink.log(tr.step, metrics)
            tr.history.append({"step": tr.step, **metrics})
            progress.update(task, advance=1, description=_console_line(tr.step, metrics))
            if is_due(tr.step, cfg.run.eval_every, cfg.run.steps):
                with gathered(tr.student, tr.dist):  # rank 0 evaluates alone: no collectives inside
                    if main:
                        run_eval(tr, console)
            if is_due(tr.step, cfg.run.save_every, cfg.run.steps):
                save(tr)
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
    state = trainer_state(tr.optimizer, tr.scheduler, tr.sampler, skipped_steps=tr.skipped_steps, history=tr.history)
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
    from opd.models import (
        check_tokenizer_compatibility, compile_layers, load_model, load_tokenizer, resolve_device, resolve_dtype,
    )
    from opd.rollout import make_generator
    from opd.teacher.local import LocalScorer
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
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    if config.micro_batch_tokens < longest:
        raise ValueError(
            f"micro_batch_tokens={config.micro_batch_tokens} is smaller than one sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens = {longest}); raise it to at least {longest}"
        )
    torch.manual_seed(config.run.seed)

    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    if config.teacher is not None:
        teacher_tokenizer = load_tokenizer(config.teacher.path, trust_remote_code=config.teacher.trust_remote_code)
        check_tokenizer_compatibility(student_tokenizer, teacher_tokenizer)
    prompts = load_prompts(
        config.data.path, prompt_key=config.data.prompt_key, answer_key=config.data.answer_key,
        id_key=config.data.id_key, split=config.data.split, limit=config.data.limit,
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
        teacher_device = config.teacher.device
        if teacher_device == "auto" and dist.world_size > 1:
            teacher_device = str(device)  # a full teacher copy next to each rank's student shard
        elif teacher_device == "auto" and torch.cuda.device_count() > 1:
            teacher_device = "cuda:1"  # the teacher on its own GPU when there is one
        teacher_dtype = resolve_dtype(config.teacher.dtype, resolve_device(teacher_device))
        teacher, _ = load_model(config.teacher.path, dtype=teacher_dtype,
                                device="cpu" if config.teacher_offload else teacher_device,
                                trust_remote_code=config.teacher.trust_remote_code,
                                attn_implementation=config.teacher.attn_implementation)
        vocab = check_tokenizer_compatibility(
            student_tokenizer, teacher_tokenizer, student_vocab_size=student_rows,
            teacher_vocab_size=teacher.get_output_embeddings().weight.shape[0],
        )
    # ids beyond the tokenizer are embedding padding rows: never sampled, never a top-k candidate (SPEC §1)
    vocab_size = vocab.tokenizer_size
    if teacher is not None:
        teacher_scorer = LocalScorer(teacher, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size)
    shard_model(student, dist)  # FSDP2 (no-op for one process); the optimizer below sees the sharded parameters
    with gathered(student, dist):  # the scorer checks the head once with a forward
        student_scorer = LocalScorer(student, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab_size,
                                     through_root=dist.world_size > 1)
    generator = make_generator(student, tokenizer, max_batch_size=config.rollout.batch_size, vocab_size=vocab_size,
                               engine=config.rollout.engine if dist.world_size == 1 else "torch")
    from opd.check import preflight  # `opd check`'s tokenizers, scoring and resources rows; raises on a hard failure

    preflight(config, student_tokenizer=student_tokenizer, teacher_tokenizer=teacher_tokenizer if teacher is not None else None,
              student=student, teacher=teacher, student_scorer=student_scorer, teacher_scorer=teacher_scorer,
              generator=generator, prompts=encoded.prompts, prompt_ids=encoded.input_ids, vocab_size=vocab_size,
              autocast_dtype=autocast_dtype, world_size=dist.world_size, console=console if dist.is_main else None)
    compiled = False
    if dist.world_size == 1 or config.compile:  # FSDP2 + compile untested: only when asked for
        compiled = compile_layers(student, config.compile)
        if teacher is not None and not config.teacher_offload:
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
    scheduler = build_scheduler(optimizer, config.run.steps, config.optim)
    sampler = PromptSampler(len(encoded.prompts), config.prompts_per_step, seed=config.run.seed)
    tr = Trainer(
        config=config, run_dir=run_dir, student=student, tokenizer=tokenizer, prompts=encoded.prompts,
        prompt_ids=encoded.input_ids, generator=generator, student_scorer=student_scorer, teacher=teacher,
        teacher_scorer=teacher_scorer, reference_scorer=reference_scorer, vocab_size=vocab_size, optimizer=optimizer,
        scheduler=scheduler, sampler=sampler, sink=None, autocast_dtype=autocast_dtype, dist=dist,
        activation_budget=budget,
    )
    resume_step = None
    if checkpoint is not None:
        state = restore_trainer_state(checkpoint, _FullStateOptimizer(student, optimizer, dist), scheduler, sampler)
        tr.step, tr.skipped_steps, tr.history = state["step"], state["skipped_steps"], state["history"]
        resume_step = tr.step
        if console is not None:
            console.print(f"resumed from {checkpoint} (step {tr.step})")
    if dist.is_main:  # rank 0 writes the run directory
        tr.sink = open_run(config, run_dir, config.run, resume_step=resume_step)
    return tr


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


def _step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The rollout seed of a step; each rank samples with its own (rank 0's equals the single-process seed)."""
    return (seed * 1_000_003 + step * 7919 + 17 + rank * 104_729) % (2**31)


@contextmanager
def _on_device(module: torch.nn.Module | None, device: torch.device | None):
    """Move an offloaded module onto `device` for the duration of the block (no-op when device is None)."""
    if module is None or device is None:
        yield
        return
    module.to(device)
    try:
        yield
    finally:
        module.to("cpu")


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
    from opd.eval.grading import grade

    texts = tr.tokenizer.batch_decode(
        [ids[:length] for ids, length in zip(rollouts.response_ids.tolist(), rollouts.response_mask.sum(-1).tolist())],
        skip_special_tokens=True,
    )
    answers = [tr.prompts[indices[g]].answer for g in rollouts.group_ids.tolist()]
    if any(answer is None for answer in answers):
        return texts, None
    return texts, [grade(text, answer).correct for text, answer in zip(texts, answers)]


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
