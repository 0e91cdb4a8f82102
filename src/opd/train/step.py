"""One OPD step (SPEC §1–§6, DESIGN): `opd_step` reads `sample → score → targets → update → metrics`, one
function per phase below. The math lives in `opd.objectives` (`build_targets`, `micro_loss`, the statistics),
rollout-ahead in `opd.train.overlap`, setup, the loop and checkpoints in the recipe (`opd.recipes.distill`).

Multi-process (torchrun): each rank takes a slice of every step's prompts, the student is sharded by FSDP2 and the
token-mean stays global across ranks (`opd.train.distributed`). With one process the `tr.run.dist` calls are no-ops.

Omitted on purpose: PPO mini-batch epochs (the paper makes one optimizer step per rollout batch, so the ratio is
≡ 1 and the old log-probs are the student's no-grad scores).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any, cast

import torch

from opd.config import DistillConfig
from opd.eval.grading import grade_rollouts
from opd.forward import forward_hidden, needed_lengths, output_head, split_by_token_budget, uses_packing
from opd.io import write_jsonl
from opd.models import activation_budget, warm_up_layouts
from opd.objectives import (
    build_targets,
    diagnostic_top_k,
    is_weight_stats,
    micro_loss,
    opd_diagnostics,
    reward_stats,
    seq_reward_metrics,
    strategy_spec,
    teacher_logprobs_at_student_topk,
)
from opd.objectives.full_vocab import full_divergence
from opd.objectives.targets import FULL_LOSSES, ObjectiveSettings, Targets
from opd.rollout import SamplingParams
from opd.rollout.base import Generator
from opd.rollout.batch import build_rollouts, random_rollouts
from opd.rollout.episodes import EpisodeOutput, episode_rollouts
from opd.rollout.static_engine import StaticGenerator
from opd.scoring import candidate_logprobs_and_entropy, warm_up_row_buckets
from opd.seeds import SALT_STEP_ROLLOUT, derive_seed
from opd.train.common import autocast, timed
from opd.train.compiles import CompileLog, compiled_graphs, describe_compiles
from opd.train.distributed import all_reduce_sum, gathered, gathered_bytes, max_over_ranks, reduce_metrics
from opd.train.episodes import EPISODE_SUMMED, CountedGenerator, generate_episodes, step_episodes
from opd.train.optim import adamw_state_bytes, clip_and_step
from opd.train.overlap import AheadStream
from opd.train.state import Batch, EngineCounts, Scores, Trainer, Update
from opd.train.stream import GenerateFn, RolloutStream, in_flight_batches
from opd.train.teachers import (
    answer_metrics,
    exact_reverse_kl,
    hidden_scorer,
    prealign_teachers,
    row_teachers,
    score_full_teacher,
    start_teachers,
    teacher_metrics,
    xtok_metrics,
)
from opd.types import Rollouts

__all__ = [  # Trainer, the step's records and the compile log live in their own modules; imported from here too
    "Batch",
    "CompileLog",
    "EngineCounts",
    "Scores",
    "Trainer",
    "Update",
    "compiled_graphs",
    "decode_warm_up_rows",
    "describe_compiles",
    "engine_warm_up_rows",
    "micro_backward",
    "opd_step",
    "partial_metrics",
    "row_teachers",
    "sample_rollouts",
    "score_rollouts",
    "step_metrics",
    "step_targets",
    "update_student",
    "warm_up",
    "warm_up_prefills",
]


def opd_step(tr: Trainer) -> dict[str, float]:
    """One on-policy step: rollouts of the current student, scored by the teacher, one optimizer update."""
    timings: dict[str, float] = {}
    device = next(tr.models.student.parameters()).device
    if tr.run.gpu_busy is not None:
        tr.run.gpu_busy.mark()
    if device.type == "cuda" and tr.run.memory_trace is None:  # the step's own peak (`gpu/peak_gib`)
        torch.cuda.reset_peak_memory_stats(device)
    batch = sample_rollouts(tr, timings, device)
    scores = score_rollouts(tr, batch, timings, device)
    targets = step_targets(tr, batch, scores, device)
    result = update_student(tr, batch.rollouts, targets, timings, device)
    if tr.engines.ahead is not None:  # waiting here keeps every step self-contained: nothing runs during eval or a save
        with timed(timings, "rollout_wait"):
            tr.engines.ahead.wait()
    metrics = step_metrics(tr, batch, scores, targets, result, timings)
    if device.type == "cuda" and tr.run.memory_trace is None:
        metrics["gpu/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return metrics


# ------------------------------------------------------------------------------------------------ the phases


def sample_rollouts(tr: Trainer, timings: dict, device: torch.device) -> Batch:
    """Prompts and rollouts. Every rank draws the same global batch from the resumable seeded sampler and keeps its
    own slice; the current student samples n responses to each (FSDP: weights gathered once, see `gathered`). With
    rollout.overlap they were generated during the previous step, from the weights before its update, and the next
    step's generation starts here."""
    rank, world = tr.run.dist.rank, tr.run.dist.world_size
    if tr.engines.stream is not None:
        return _stream_rollouts(tr, tr.engines.stream, timings, device)
    assert not isinstance(tr.engines.ahead, AheadStream)  # built only with a stream
    pending = None if tr.engines.ahead is None else tr.engines.ahead.take()
    episodes = None
    if pending is None:
        indices = tr.data.sampler.next_batch()[rank::world]
        prompt_ids = [tr.data.prompt_ids[i] for i in indices]
        counts = EngineCounts()
        params = _sampling_params(tr.config, tr.run.step, rank)
        with (
            timed(timings, "rollout"),
            gathered(tr.models.student, tr.run.dist),
            autocast(device, tr.models.autocast_dtype),
        ):
            if tr.engines.environment is None:
                output = tr.engines.generator.generate(prompt_ids, params)
                rollouts = build_rollouts(prompt_ids, output, pad_id=tr.models.tokenizer.pad_token_id, device=device)
                counts.add(tr.engines.generator)
            else:  # rollout.tools: an engine call per turn, the tools answered in between
                rollouts, episodes = generate_episodes(
                    tr.config,
                    CountedGenerator(tr.engines.generator, counts.add),
                    tr.models.tokenizer,
                    tr.engines.environment,
                    [tr.data.prompts[i] for i in indices],
                    prompt_ids,
                    params,
                    device,
                )
        tr.engines.generator.release()  # the scoring and update phases get the engine's caches back
    else:
        counts = None  # generated in the background during the previous step
        indices, prompt_ids = pending.indices, [tr.data.prompt_ids[i] for i in pending.indices]
        episodes = pending.episodes
        if episodes is None:
            rollouts = build_rollouts(
                prompt_ids, pending.output, pad_id=tr.models.tokenizer.pad_token_id, device=device
            )
        else:  # rollout.tools: episodes generated ahead
            rollouts = episode_rollouts(episodes, pad_id=tr.models.tokenizer.pad_token_id, device=device)
    _mark_memory(tr, "rollout")
    if (
        tr.engines.ahead is not None
    ):  # also after the last step: the checkpoint carries them, and a longer resume continues
        next_indices = tr.data.sampler.next_batch()[rank::world]
        next_ids = [tr.data.prompt_ids[i] for i in next_indices]
        next_params = _sampling_params(tr.config, tr.run.step + 1, rank)
        environment = tr.engines.environment
        ahead_episodes = None
        if environment is not None:  # rollout.tools: the next step's episodes, tool calls included, in the background
            next_prompts = [tr.data.prompts[i] for i in next_indices]

            def ahead_episodes(generator: Generator) -> EpisodeOutput:
                assert environment is not None
                return step_episodes(
                    tr.config, generator, tr.models.tokenizer, environment, next_prompts, next_ids, next_params
                )

        tr.engines.ahead.start(
            tr.models.student,
            next_indices,
            next_ids,
            next_params,
            device=device,
            autocast_dtype=tr.models.autocast_dtype,
            episodes=ahead_episodes,
        )
    return Batch(indices, rollouts, policy_lag=0 if pending is None else 1, engine_counts=counts, episodes=episodes)


def _stream_rollouts(tr: Trainer, stream: RolloutStream, timings: dict, device: torch.device) -> Batch:
    """rollout.partial: the stream continues its in-flight samples (one seeded engine call each round, call index c
    of step t seeded by `_step_seed(seed, t, rank, c)`) and hands over `prompts_per_step` finished groups. With
    rollout.overlap the batch was built during the previous step (from its weights), and the next one starts here."""
    ahead = tr.engines.ahead if isinstance(tr.engines.ahead, AheadStream) else None
    taken = None if ahead is None else ahead.take()
    counts = None
    if taken is None:
        counts = EngineCounts()
        with (
            timed(timings, "rollout"),
            gathered(tr.models.student, tr.run.dist),
            autocast(device, tr.models.autocast_dtype),
        ):
            generate = _stream_generate(tr.config, tr.engines.generator, tr.run.step, tr.run.dist.rank, counts)
            # a vLLM engine stays awake over the step's calls (its prefix cache holds the continued samples' prefixes)
            held = getattr(tr.engines.generator, "held", None)
            with held() if held is not None else nullcontext():
                taken = stream.next_batch(tr.run.step, tr.data.sampler.next_batch, tr.data.prompt_ids, generate)
        tr.engines.generator.release()
    counters = {  # the stream after this step's batch, before the next one's build changes it
        "partial/calls": taken.calls,
        "partial/dropped": taken.dropped,
        "partial/dropped_total": stream.dropped,
        "partial/started_total": stream.started,
        "partial/trained_total": stream.trained,
        "partial/in_flight": stream.in_flight,
        "partial/cut_total": stream.cut,
    }
    if ahead is not None:  # also after the last step: the checkpoint carries the batch, a longer resume trains it
        ahead.start(
            tr.models.student,
            tr.run.step + 1,
            tr.data.sampler.next_batch,
            tr.data.prompt_ids,
            _stream_generate(tr.config, ahead.generator, tr.run.step + 1, tr.run.dist.rank),
            device=device,
            autocast_dtype=tr.models.autocast_dtype,
        )
    prompt_ids = [tr.data.prompt_ids[i] for i in taken.indices]
    if taken.episodes is None:
        rollouts = build_rollouts(prompt_ids, taken.output, pad_id=tr.models.tokenizer.pad_token_id, device=device)
    else:  # rollout.tools: the environment's tokens out of response_mask
        rollouts = episode_rollouts(taken.episodes, pad_id=tr.models.tokenizer.pad_token_id, device=device)
    versions_BT = torch.full(rollouts.response_mask.shape, tr.run.step, dtype=torch.long)
    for b, versions in enumerate(taken.versions):
        versions_BT[b, : len(versions)] = torch.tensor(versions, dtype=torch.long)
    versions_BT = versions_BT.to(device)
    lag = max((tr.run.step - v[0] for v in taken.versions if v), default=0)
    _mark_memory(tr, "rollout")
    return Batch(
        taken.indices,
        rollouts,
        policy_lag=lag,
        versions_BT=versions_BT,
        stream_metrics=counters,
        engine_counts=counts,
        episodes=taken.episodes,
    )


def _stream_generate(
    cfg: DistillConfig, generator: Generator, step: int, rank: int, counts: EngineCounts | None = None
) -> GenerateFn:
    """The stream's engine calls for the batch step `step` trains: call c seeded by `_step_seed(seed, step, rank, c)`
    whichever thread and weights make it (with rollout.tools by `derive_seed(_step_seed(seed, step, rank), call=c)`,
    as an episode's turn c is seeded without rollout.partial); each call's decode work is added to `counts` when
    given."""

    def generate(prompt_ids, n, max_new_tokens, call, stop_when, caps):
        params = replace(_sampling_params(cfg, step, rank, call), n=n, max_new_tokens=max_new_tokens)
        if cfg.rollout.tools is not None and call > 0:
            params = replace(params, seed=derive_seed(_step_seed(cfg.run.seed, step, rank), call=call))
        # the stream's engines (torch, static) take per-sample caps: the Generator protocol does not name them yet
        engine: Any = generator
        output = engine.generate(prompt_ids, params, max_new_tokens_per_sample=caps, stop_when=stop_when)
        if counts is not None:
            counts.add(generator)
        return output

    return generate


def partial_metrics(
    step: int, versions_BT: torch.Tensor, mask_BT: torch.Tensor, max_staleness: int
) -> dict[str, torch.Tensor]:
    """The trained tokens by lag (steps between their sampling weights and this update): `partial/lag_<k>_frac` for
    k = 0..max_staleness, `partial/mean_lag`, `partial/max_lag`."""
    mask = mask_BT.bool()
    lag_BT = step - versions_BT
    count = mask.sum().clamp(min=1)
    out = {f"partial/lag_{k}_frac": ((lag_BT == k) & mask).sum() / count for k in range(max_staleness + 1)}
    out["partial/mean_lag"] = (lag_BT * mask).sum() / count
    out["partial/max_lag"] = torch.where(mask, lag_BT, torch.zeros_like(lag_BT)).max()
    return out


def score_rollouts(tr: Trainer, batch: Batch, timings: dict, device: torch.device) -> Scores:
    """The student's no-grad scores (the behaviour policy: top-k support, log-probs, entropy), a reference's, and the
    teacher's scores of the student's tokens. A served teacher's requests go out as soon as the student's top-k
    exists and overlap the grading of the rollouts."""
    cfg, obj, rollouts = tr.config, tr.config.objective, batch.rollouts
    diag_k = diagnostic_top_k(obj.top_k)
    prealign_teachers(tr, batch)  # a cross-vocabulary teacher's alignment, on the CPU while the student scores
    with (
        timed(timings, "student"),
        gathered(tr.models.student, tr.run.dist),
        autocast(device, tr.models.autocast_dtype),
    ):
        student = tr.models.student_scorer.score(rollouts, top_k=diag_k, temperature=cfg.rollout.temperature)
        reference_BT = (
            None
            if tr.models.reference_scorer is None
            else tr.models.reference_scorer.score(
                rollouts, top_k=0, temperature=cfg.rollout.temperature, with_entropy=False
            ).sampled_logprobs
        )
    teacher = student_at_teacher_BTK = teacher_hidden_BTE = exact_kl_BT = answer = None
    teacher_call = None
    if tr.models.teachers and cfg.needs_full_distribution():  # one teacher, answering with hidden states
        with timed(timings, "teacher"):
            full_scores, teacher_hidden_BTE, answer = score_full_teacher(tr, batch, student, diag_k, device)
            teacher_call = lambda: full_scores  # noqa: E731 -- the same shape as start_teachers' answer
            if obj.token_reward != "log_ratio":
                exact_kl_BT = exact_reverse_kl(tr, rollouts, teacher_hidden_BTE, device)
    elif tr.models.teachers:  # no time/teacher without a teacher (GRPO)
        with timed(timings, "teacher"):
            teacher_call = start_teachers(tr, batch, student, diag_k, device)
    texts, correct = _grade_rollouts(tr, batch)
    if teacher_call is not None:
        with timed(timings, "teacher"):
            teacher = teacher_call()
        if answer is None:
            answer = answer_metrics(tr, teacher, diag_k, device)
        if obj.top_k and strategy_spec(obj.strategy).teacher_slots:
            with (
                timed(timings, "student"),
                gathered(tr.models.student, tr.run.dist),
                autocast(device, tr.models.autocast_dtype),
            ):
                student_at_teacher_BTK = tr.models.student_scorer.score(
                    rollouts,
                    top_k=0,
                    requested_ids=teacher.topk_ids,
                    temperature=cfg.rollout.temperature,
                    with_entropy=False,
                ).requested_logprobs
    _mark_memory(tr, "scoring")
    return Scores(
        student,
        reference_BT,
        teacher,
        student_at_teacher_BTK,
        texts,
        correct,
        teacher_hidden_BTE=teacher_hidden_BTE,
        exact_kl_BT=exact_kl_BT,
        teacher_answer=answer,
    )


def step_targets(tr: Trainer, batch: Batch, scores: Scores, device: torch.device) -> Targets:
    """Token rewards → advantages → the loss's support and importance weights (`opd.objectives.build_targets`), with
    the rollouts' grades as outcome rewards (GRPO)."""
    correct = scores.correct
    outcome_B = torch.tensor(correct, dtype=torch.float32, device=device) if correct is not None else None
    targets = build_targets(
        scores.student,
        scores.teacher,
        batch.rollouts,
        cast(ObjectiveSettings, tr.config.objective),  # ObjectiveSpec's Literal fields narrow the protocol's str
        student_at_teacher_topk=scores.student_at_teacher_BTK,
        reference_logprobs=scores.reference_BT,
        outcome_rewards=outcome_B,
        exact_kl_BT=scores.exact_kl_BT,
    )
    if tr.config.objective.loss in FULL_LOSSES:
        targets = replace(targets, teacher_hidden=scores.teacher_hidden_BTE)
    return targets


def update_student(tr: Trainer, rollouts: Rollouts, targets: Targets, timings: dict, device: torch.device) -> Update:
    """The grad forward in micro-batches, then one optimizer step. Each micro-batch's loss divides by the token count
    of the *whole* batch (all ranks), so the summed gradients are the batch gradient."""
    cfg, world = tr.config, tr.run.dist.world_size
    with timed(timings, "update"):
        num_tokens = all_reduce_sum(targets.mask.sum(), tr.run.dist).clamp(min=1)
        num_seqs = all_reduce_sum(torch.tensor(rollouts.batch_size, device=device), tr.run.dist)
        loss_metrics: list[dict] = []
        tr.models.student.train()
        groups = split_by_token_budget(
            needed_lengths(rollouts), cfg.micro_batch_tokens, padded=not uses_packing(tr.models.student)
        )
        # FSDP: every rank must run as many forward/backward passes (each all-gathers and reduce-scatters), so ranks
        # with fewer micro-batches repeat their first one with a zero loss.
        num_real = len(groups)
        groups += [groups[0]] * (max_over_ranks(num_real, tr.run.dist) - num_real)
        for index, rows in enumerate(groups):
            # FSDP averages gradients over ranks; the loss is already a share of the global mean, so scale it back
            # up: the summed update equals the single-process one on the same global batch. A padding pass (see
            # above) has gradients of zero, and its metrics are not counted.
            micro_metrics = micro_backward(
                tr,
                rollouts.select(rows),
                targets.select(rows),
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                scale=world if index < num_real else 0.0,
                device=device,
            )
            if index < num_real:
                loss_metrics.append(micro_metrics)
        tr.models.student.eval()
        _mark_memory(tr, "forward_backward")
        grad_norm, stepped, lr = clip_and_step(
            tr.models.student, tr.optimization.optimizer, tr.optimization.scheduler, cfg.optim.grad_clip
        )
        tr.engines.generator.sync_weights()
    tr.run.skipped_steps += 0 if stepped else 1
    _mark_memory(tr, "optimizer_step")
    return Update(grad_norm, loss_metrics, lr)


def micro_backward(
    tr: Trainer,
    micro: Rollouts,
    micro_targets: Targets,
    *,
    num_tokens: torch.Tensor,
    num_seqs: torch.Tensor,
    scale: float,
    device: torch.device,
) -> dict:
    """One micro-batch's grad forward and `(loss × scale).backward()`; returns its detached loss metrics."""
    cfg = tr.config
    with (
        autocast(device, tr.models.autocast_dtype),
        activation_budget(tr.models.activation_budget),
    ):  # the chunked head too
        hidden = forward_hidden(
            tr.models.student, micro, through_root=tr.run.dist.world_size > 1
        )  # FSDP's root hooks must run
        head = output_head(tr.models.student)  # after the forward: under FSDP, the root's unsharded head weight
        ids_NJ = micro_targets.candidate_ids[hidden.rows_N, hidden.cols_N]
        if micro_targets.reference is not None:  # the KL term needs the sampled token's log-prob as one more column
            ids_NJ = torch.cat([ids_NJ, hidden.targets_N[:, None]], dim=-1)
        full = FULL_LOSSES.get(cfg.objective.loss)
        divergence_BT = None
        if full is not None:
            assert micro_targets.teacher_hidden is not None  # step_targets sets it for a full loss
            (routed,) = tr.models.teachers
            divergence_N = full_divergence(
                hidden.hidden_ND,
                head,
                micro_targets.teacher_hidden[hidden.rows_N, hidden.cols_N],
                hidden_scorer(routed, device).head,
                kind=cast(Any, full[0]),
                beta=cfg.objective.jsd_beta,
                temperature=cfg.rollout.temperature,
                teacher_temperature=cast(float, routed.entry.temperature),
                vocab_size=tr.models.vocab_size,
            )
            divergence_BT = hidden.to_grid(divergence_N)
        if full is not None and micro_targets.reference is None and not cfg.objective.entropy_coef:
            # the loss reads neither the candidate log-probs nor the entropy: no second pass over the vocabulary
            lp_NJ = hidden.hidden_ND.new_zeros(ids_NJ.shape, dtype=torch.float32)
            entropy_N = hidden.hidden_ND.new_zeros(ids_NJ.shape[0], dtype=torch.float32)
        else:
            lp_NJ, entropy_N = candidate_logprobs_and_entropy(
                hidden.hidden_ND, head, ids_NJ, temperature=cfg.rollout.temperature, vocab_size=tr.models.vocab_size
            )
    loss, metrics = micro_loss(
        hidden.to_grid(lp_NJ),
        hidden.to_grid(entropy_N),
        micro_targets,
        cast(ObjectiveSettings, cfg.objective),
        global_num_tokens=num_tokens,
        global_num_seqs=num_seqs,
        full_divergence_BT=divergence_BT,
    )
    (loss * scale).backward()
    return metrics


def warm_up(tr: Trainer, device: torch.device, decode_rows: list[int] | None = None) -> int:
    """Compile every graph variant of the compiled layers (`opd.models.compile_layers`) before the first step, so
    that no step pays a compilation: the scoring and update phases run once per layout of `warm_up_layouts`, on the
    first prompt routed to each teacher with random response tokens, the update's losses × 0 and no optimizer step;
    then the vocabulary head's compiled functions at every row bucket a step can reach (`warm_up_row_buckets`);
    with rollout.compiled_prefill the static engine's prefills too, over the same layouts.
    decode_rows: the static engine's decode row counts, `decode_warm_up_rows(tr)` when None (a caller that names them
    first passes them, so that what it reports is what compiles). The model, the optimizer and every random stream are
    as before (gradients are reset to None); returns the number of graphs compiled."""
    before = compiled_graphs()
    trace, tr.run.memory_trace = tr.run.memory_trace, None
    cfg = tr.config
    packed = max(cfg.score_batch_tokens, cfg.micro_batch_tokens) if uses_packing(tr.models.student) else None
    layouts = warm_up_layouts(cfg.rollout.max_new_tokens, packed)
    first_prompts = (
        sorted({tr.data.prompt_teacher.index(t) for t in set(tr.data.prompt_teacher)}) if tr.models.teachers else [0]
    )
    ones = torch.ones((), device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for index in first_prompts:
            for seed, lengths in enumerate(layouts):
                rollouts = random_rollouts(
                    tr.data.prompt_ids[index],
                    lengths,
                    vocab_size=tr.models.vocab_size,
                    pad_id=tr.models.tokenizer.pad_token_id,
                    seed=seed,
                    device=device,
                )
                batch = Batch([index] * len(lengths), rollouts, policy_lag=0)
                scores = score_rollouts(tr, batch, {}, device)
                targets = step_targets(tr, batch, scores, device)
                tr.models.student.train()
                for rows in split_by_token_budget(  # the update's micro-batches: its shapes, within its memory
                    needed_lengths(rollouts), cfg.micro_batch_tokens, padded=not uses_packing(tr.models.student)
                ):
                    micro = rollouts.select(rows)
                    micro_targets = targets.select(rows)
                    micro_backward(tr, micro, micro_targets, num_tokens=ones, num_seqs=ones, scale=0.0, device=device)
                tr.models.student.eval()
        # the steps' rollouts run without gradients: so must the decode row counts' memory figure and their calls
        tr.models.student.zero_grad(set_to_none=True)
        # a step's batch may score more positions in one call than any layout: the head's larger row buckets too
        warm_up_row_buckets(_rank_samples(tr) * (cfg.rollout.max_new_tokens + 1))
        engine = tr.engines.generator
        if isinstance(engine, StaticGenerator) and engine.compiled_prefill:  # its prefills run the compiled layers
            with gathered(tr.models.student, tr.run.dist), autocast(device, tr.models.autocast_dtype):
                warm_up_prefills(
                    engine, tr.data.prompt_ids[first_prompts[0]], cfg.rollout.max_new_tokens, tr.models.vocab_size
                )
        if decode := decode_warm_up_rows(tr) if decode_rows is None else decode_rows:
            assert isinstance(engine, StaticGenerator)
            params = _sampling_params(cfg, tr.run.step, tr.run.dist.rank)
            with gathered(tr.models.student, tr.run.dist), autocast(device, tr.models.autocast_dtype):
                engine.warm_up_decode(tr.data.prompt_ids[first_prompts[0]], params, decode)
            engine.release()
    tr.run.memory_trace = trace
    return compiled_graphs() - before


def decode_warm_up_rows(tr: Trainer) -> list[int]:
    """The row counts `warm_up` compiles the static engine's decode step at (`StaticGenerator.decode_rows`), largest
    first: those of the run's calls, prompts_per_step × n samples (this rank's share), or with rollout.partial any
    count up to the samples the stream keeps in flight (its calls continue what is unfinished; where calls keep their
    exact sample counts, `round_rows=False`, only the largest: each count would be a compile); and the counts the
    memory can cap those calls to (`StaticGenerator.capped_rows`), with the optimizer state that is not allocated
    before the first step reserved (without it the first full-length call met a count the warm-up had not compiled:
    docs/performance.md). With rollout.tools an episode's later turns, calls of fewer samples, run at these counts
    too: a session's calls round to the live-row buckets of its first call's rows (`StaticGenerator._asked_rows`).
    Empty where the step does not compile (another engine, CPU, `compile=False`) and with
    rollout.overlap, whose calls run another engine over a snapshot of the weights, uncompiled
    (`opd.train.overlap.overlap_generator`)."""
    engine = tr.engines.generator
    if not isinstance(engine, StaticGenerator) or tr.engines.ahead is not None or not engine.compiles_decode():
        return []
    cfg = tr.config
    if tr.engines.stream is not None:  # its calls: any count up to the samples in flight, rows of at least a segment
        samples = in_flight_batches(cfg.rollout.max_staleness, 0) * cfg.prompts_per_step * cfg.rollout.n
        least_new_tokens = tr.engines.stream.segment
    else:
        samples, least_new_tokens = _rank_samples(tr), cfg.rollout.max_new_tokens
    unallocated = 0 if tr.optimization.optimizer.state else adamw_state_bytes(tr.models.student.parameters())
    reserve = unallocated + gathered_bytes(tr.models.student, tr.run.dist)  # calls run on the gathered weights
    with autocast(
        next(tr.models.student.parameters()).device, tr.models.autocast_dtype
    ):  # the dtype generation sizes rows in
        return engine_warm_up_rows(
            engine,
            samples,
            stream=tr.engines.stream is not None,
            prompt_lengths=[len(ids) for ids in tr.data.prompt_ids],
            new_tokens=cfg.rollout.max_new_tokens,
            least_new_tokens=least_new_tokens,
            reserve_bytes=reserve,
        )


def engine_warm_up_rows(
    engine: StaticGenerator,
    samples: int,
    *,
    stream: bool,
    prompt_lengths: list[int],
    new_tokens: int,
    least_new_tokens: int,
    reserve_bytes: int = 0,
) -> list[int]:
    """`decode_warm_up_rows` for an engine on its own: the row counts, largest first, of calls of `samples` samples
    (a partial-rollout stream's calls, `stream`: any count up to `samples`, the samples it keeps in flight) of
    prompts of these lengths and up to new_tokens each, with the counts the memory free now less reserve_bytes can
    cap them to. least_new_tokens: the fewest slots after its prompt that a call's widest row holds (the synchronous
    step: new_tokens; a stream: its segment, as a continued sample's prefix and what its cap leaves add up to at least
    that). Call it under the autocast generation runs under."""
    if stream:
        rows = engine.decode_rows([samples] if engine.round_rows is False else range(1, samples + 1))
        widest = max(prompt_lengths) + new_tokens - 1  # a continued sample's prompt: the prompt and its tokens so far
    else:
        rows = engine.decode_rows([samples])
        widest = max(prompt_lengths)
    slots = range(min(prompt_lengths) + least_new_tokens, max(prompt_lengths) + new_tokens + 1)
    capped = engine.capped_rows(samples, widest, new_tokens, slots, reserve_bytes=reserve_bytes)
    return sorted({*rows, *capped}, reverse=True)


def _rank_samples(tr: Trainer) -> int:
    """The samples of one step on this rank: its share of prompts_per_step, times rollout.n."""
    return len(range(tr.run.dist.rank, tr.config.prompts_per_step, tr.run.dist.world_size)) * tr.config.rollout.n


def warm_up_prefills(engine: StaticGenerator, prompt: list[int], max_new_tokens: int, vocab_size: int) -> None:
    """The static engine's compiled prefills (`StaticGenerator.warm_up_prefill`) over the layouts of
    `warm_up_layouts`: the prompt plus up to max_new_tokens random tokens a row (a stream prefills its continued
    samples again), up to a full forward of `prefill_tokens`. Call it under the autocast generation runs under."""
    for seed, lengths in enumerate(warm_up_layouts(max_new_tokens, engine.prefill_tokens)):
        tokens = torch.Generator().manual_seed(seed)
        engine.warm_up_prefill(
            [list(prompt) + torch.randint(vocab_size, (n,), generator=tokens).tolist() for n in lengths]
        )


def step_metrics(
    tr: Trainer, batch: Batch, scores: Scores, targets: Targets, result: Update, timings: dict[str, float]
) -> dict[str, float]:
    """The step's metrics (SPEC §6) with one host sync for all of them; rank 0 writes its samples; the ranks' values
    become one line: losses (shares of a global mean) and throughput add up, everything else is averaged."""
    rollouts, student, teacher, mask_BT = batch.rollouts, scores.student, scores.teacher, targets.mask
    obj = tr.config.objective
    out: dict[str, Any] = {
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "skipped_steps": tr.run.skipped_steps,
    }
    if tr.models.compiled_layers:  # both count from the process start: a step that raises them compiled
        out["compile/graphs"] = compiled_graphs()
        out["compile/seconds"] = torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0)
    out.update(_sum_micro_metrics(result.loss_metrics))
    advantage_valid = targets.valid if targets.advantage_valid is None else targets.advantage_valid
    out.update(
        reward_stats("reward", targets.rewards, targets.reward_valid, mask_BT),
        **reward_stats("advantage", targets.advantages, advantage_valid, mask_BT),
    )
    out["valid_slots_per_token"] = targets.valid.sum() / mask_BT.sum().clamp(min=1)
    out["policy_lag"] = batch.policy_lag  # optimizer steps between the sampling and the current policy
    if batch.engine_counts is not None:
        out.update(batch.engine_counts.metrics())
    if batch.episodes is not None:  # turns, tool calls and errors, tool seconds, student / environment tokens
        out.update(batch.episodes.metrics())
    if targets.tis_weights is not None:
        out.update(
            is_weight_stats(
                student.sampled_logprobs,
                cast(torch.Tensor, rollouts.rollout_logprobs),
                cast(float, obj.tis_cap),
                mask_BT,
            )
        )
    if batch.versions_BT is not None:
        out.update(partial_metrics(tr.run.step, batch.versions_BT, mask_BT, tr.config.rollout.max_staleness))
        out.update(batch.stream_metrics)
        if targets.tis_weights is not None:  # the truncated weights the loss used, at their smallest
            weights_BT = targets.tis_weights
            out["partial/is_weight_min"] = torch.where(mask_BT.bool(), weights_BT, torch.ones_like(weights_BT)).min()
    if teacher is not None:
        out.update(
            opd_diagnostics(  # the top-k fields are set: scoring asks for diagnostic_top_k >= 1 candidates
                student_topk_ids=cast(torch.Tensor, student.topk_ids),
                student_topk_logprobs=cast(torch.Tensor, student.topk_logprobs),
                teacher_topk_ids=cast(torch.Tensor, teacher.topk_ids),
                teacher_topk_logprobs=cast(torch.Tensor, teacher.topk_logprobs),
                teacher_logprobs_at_student_topk=teacher_logprobs_at_student_topk(student, teacher),
                student_entropy=student.entropy,
                teacher_entropy=teacher.entropy,
                response_mask=mask_BT,
            )
        )
        out.update(seq_reward_metrics(student, teacher, mask_BT, scores.correct))
    if scores.teacher_answer:  # what the teacher's answer costs: bytes a scored position, the head kept resident
        out.update(scores.teacher_answer)
    if len(tr.models.teachers) > 1:  # the metrics' rule: a run's only teacher logs no per-teacher prefixes
        out.update(teacher_metrics(tr, batch, scores, targets))
    out.update(xtok_metrics(tr))  # a cross-vocabulary teacher's exact / span / unmapped shares (SPEC §9)
    if rollouts.rollout_logprobs is not None:  # engine vs trainer: what truncated importance weights correct
        gap_BT = (student.sampled_logprobs - rollouts.rollout_logprobs).abs()
        out["rollout_logprob_abs_diff"] = (gap_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    lengths = mask_BT.sum(-1).float()
    out.update(response_length=lengths.mean(), truncation_rate=rollouts.truncated.float().mean())
    if scores.correct is not None:
        out["rollout_accuracy"] = sum(scores.correct) / len(scores.correct)
    out = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    total = sum(timings.values())
    out.update({f"time/{k}": v for k, v in timings.items()}, **{"time/step": total})
    out["tokens_per_second"] = float(lengths.sum()) / max(total, 1e-9)
    busy = None if tr.run.gpu_busy is None else tr.run.gpu_busy.fraction()
    if busy is not None:  # NVML's samples over the step: the share of its wall time a kernel ran on the device
        out["gpu/busy_frac"] = busy
    if tr.run.dist.is_main:
        _write_samples(tr, batch, scores.texts, scores.correct, targets.rewards)  # rank 0's rollouts only
    summed = tuple(k for k in out if _is_summed_loss(k) or k in EPISODE_SUMMED) + ("tokens_per_second",)
    return reduce_metrics(out, tr.run.dist, summed=summed)


# -------------------------------------------------------------------------------------------------- helpers


def _step_seed(seed: int, step: int, rank: int = 0, call: int = 0) -> int:
    """The rollout seed of a step's generation call (a step makes one, rollout.partial several); each rank samples
    with its own (rank 0's equals the single-process seed)."""
    return derive_seed(seed, step=step, index=rank, salt=SALT_STEP_ROLLOUT, call=call)


def _sampling_params(cfg: DistillConfig, step: int, rank: int, call: int = 0) -> SamplingParams:
    """How step `step`'s rollouts are sampled (the same whether they are generated in that step or one ahead)."""
    return SamplingParams(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=_step_seed(cfg.run.seed, step, rank, call),
        # vLLM's log-probs are always kept when they are the full-vocabulary ones (top_p = 1): the engine-vs-trainer
        # gap is logged every step (rollout_logprob_abs_diff)
        return_logprobs=cfg.objective.tis_cap is not None or (cfg.rollout.engine == "vllm" and cfg.rollout.top_p == 1),
    )


def _mark_memory(tr: Trainer, phase: str) -> None:
    """With `tr.run.memory_trace` set (benchmarks): record the CUDA memory allocated now and the peak since the previous
    mark (GiB), labelled by the phase that just ended, and restart the peak counter."""
    if tr.run.memory_trace is None or not torch.cuda.is_available():
        return
    tr.run.memory_trace.append(
        {
            "step": tr.run.step,
            "phase": phase,
            "allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    )
    torch.cuda.reset_peak_memory_stats()


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


def _grade_rollouts(tr: Trainer, batch: Batch) -> tuple[list[str], list[bool] | None]:
    """Decode every rollout (an episode: its final turn, the student's text after the environment's last answer);
    grade it when the prompts carry answers (rule-based accuracy, GRPO rewards)."""
    rollouts = batch.rollouts
    answers = [tr.data.prompts[batch.indices[g]].answer for g in rollouts.group_ids.tolist()]
    final_turns = None if batch.episodes is None else batch.episodes.final_turns()
    texts, grades = grade_rollouts(tr.models.tokenizer, rollouts, answers, final_turns)
    return texts, None if grades is None else [g.correct for g in grades]


def _write_samples(
    tr: Trainer, batch: Batch, texts: list[str], correct: list[bool] | None, rewards_BTJ: torch.Tensor
) -> None:
    """The first rows' prompt, graded text and per-token rewards; an episode's also its whole text, the environment's
    tokens (`env_mask`, reward 0) and its turns and tool calls."""
    rollouts, episodes = batch.rollouts, batch.episodes
    count = min(tr.config.run.samples_per_step, rollouts.batch_size)
    if not count:
        return
    records = []
    position_rewards_BT = rewards_BTJ.sum(-1)
    for row in range(count):
        if episodes is None:
            length = int(rollouts.response_mask[row].sum())
        else:  # the student's tokens and the environment's, in order
            length = len(episodes.env_masks[row])
        ids = rollouts.response_ids[row, :length].tolist()
        prompt_length = int(rollouts.prompt_lengths[row])
        record = {
            "step": tr.run.step + 1,
            "prompt": tr.models.tokenizer.decode(rollouts.input_ids[row, :prompt_length].tolist()),
            "response": texts[row],
            "correct": None if correct is None else correct[row],
            "tokens": tr.models.tokenizer.convert_ids_to_tokens(ids),
            "token_rewards": [round(r, 5) for r in position_rewards_BT[row, :length].tolist()],
        }
        if episodes is not None:
            record.update(
                episode=tr.models.tokenizer.decode(ids, skip_special_tokens=True),
                env_mask=[int(m) for m in episodes.env_masks[row]],
                turns=episodes.turns[row],
                tool_calls=episodes.tool_calls[row],
                tool_errors=episodes.tool_errors[row],
            )
        records.append(record)
    write_jsonl(tr.run.run_dir / "samples" / f"step_{tr.run.step + 1}.jsonl", records)
