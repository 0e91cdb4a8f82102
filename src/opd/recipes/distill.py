"""`opd distill`: on-policy distillation (SPEC §1–§6) and the GRPO baseline — `distill(config)` claims the run
directory, `setup` builds the `Trainer`, `train` runs `opd.train.step.opd_step` with checkpoints and evals, cleanup
closes the engines and the process group.

`setup` validates everything cheap first (world size, tokenizers, engines, data), then loads the models, builds the
scorers and engines, runs `opd check`'s startup rows (`opd.check.preflight`), and builds the optimizer and resumes.
The cross-field checks that need only the config are `DistillConfig`'s validators (they fail at load time).

Multi-process: `torchrun --nproc_per_node 8 -m opd.cli distill --config …` runs the same program with the student
sharded by FSDP2; rank 0 owns the run directory and speaks for all (`opd.train.distributed`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from opd.check.probes import (  # noqa: F401  (the probes' old home: importable from here)
    local_teachers,
    scoring_probes,
    startup_checks,
    tokenizer_probes,
    view_probes,
)
from opd.compile_cache import persisted
from opd.config import STUDENT, STUDENT_INIT, DistillConfig, TeacherEntry
from opd.data.prompts import load_prompts
from opd.data.templates import EncodedPrompts, encode_prompts
from opd.kernels import varlen_attention
from opd.models import (
    VocabInfo,
    check_tokenizer_compatibility,
    check_top_k,
    compile_layers,
    eos_token_ids,
    fix_rope,
    load_model,
    load_tokenizer,
    resolve_device,
)
from opd.report.gpu_busy import GpuBusy
from opd.report.sinks import progress_bar
from opd.rollout import Generator, make_generator
from opd.rollout.registry import check_generation_fits, check_vllm_rope, resolve_engine
from opd.rollout.vllm_engine import EngineOptions, vllm_available
from opd.rundir import claimed_run_dir, open_run, resume_checkpoint, run_directory
from opd.teacher.cross_vocab import check_cross_objective, cross_teacher_views, load_cross_teacher, tokenizer_modes
from opd.teacher.local import LocalScorer
from opd.teacher.manifest import check_teacher_manifest, teacher_manifest
from opd.teacher.registry import (
    RoutedTeacher,
    Teacher,
    TeacherRequest,
    build_teacher,
    check_teacher_serves,
    check_teacher_tokenizer,
    model_key,
)
from opd.teacher.registry import model_key as _model_key  # noqa: F401  (its old name and home)
from opd.teacher.routing import (  # noqa: F401  (routing's old home: importable from here)
    TEACHERS_FILE,
    _placement,
    check_routing_table_path,
    route_teachers,
    routing_table,
    teacher_views,
    write_routing_table,
)
from opd.tools.environments import Environment
from opd.train.checkpoint import load_trainer_state, save_checkpoint
from opd.train.common import (
    autocast,
    cached_fingerprint,
    check_data_fingerprint,
    check_run_trained,
    check_skipped_steps,
    deterministic_kernels,
    eval_at_start,
    eval_pending,
    evaluate_in_training,
    finish_run,
    is_due,
    load_eval_sets,
    restore_trainer_state,
    trainer_state,
    training_precision,
)
from opd.train.compiles import warm_up_cache_parts
from opd.train.distributed import (
    SINGLE,
    DistInfo,
    all_full_weights,
    barrier,
    broadcast_object,
    destroy_distributed,
    full_optimizer_state_dict,
    full_state_dict,
    gathered,
    gathered_bytes,
    init_distributed,
    load_full_optimizer_state_dict,
    shard_model,
)
from opd.train.episodes import EpisodeStream, encode_with_tools, episode_stream, rollout_environment
from opd.train.optim import adamw_state_bytes, build_optimizer, build_scheduler
from opd.train.overlap import overlap_generator, rollout_ahead
from opd.train.sampler import PromptSampler
from opd.train.state import Models, RunState, TrainData, TrainEngines, Trainer, TrainModels, TrainOptimization
from opd.train.step import CompileLog, decode_warm_up_rows, describe_compiles, opd_step, warm_up
from opd.train.stream import RolloutStream

__all__ = ["DistillConfig", "Trainer", "distill", "run_eval", "save", "setup", "train"]

VLLM_TIS_CAP = 2.0  # the cap recommended at start-up (verl's truncated importance sampling default)


def distill(config: DistillConfig, *, console: Any = None) -> Path:
    """Run `opd distill` and return the run directory."""
    with deterministic_kernels(config.run.deterministic):  # before any CUDA work: cuBLAS reads its setting once
        info = init_distributed()  # SINGLE without torchrun
        console = (console or Console()) if info.is_main else Console(quiet=True)  # rank 0 speaks for all
        run_dir = broadcast_object(run_directory(config.run, "distill"), info)  # its default name has a timestamp
        # rank 0 owns the run directory: locked, never shared with another run (common.claimed_run_dir)
        with claimed_run_dir(run_dir, config.run, "distill", console=console) if info.is_main else nullcontext(run_dir):
            tr = setup(
                config,
                run_dir,
                checkpoint=resume_checkpoint(run_dir, config.run, console, config),
                console=console,
                dist=info,
            )
            try:
                train(tr, console=console)
            finally:  # rollout.tools with rollout.partial: the in-flight episodes' environments (python's directories)
                if isinstance(tr.engines.stream, EpisodeStream):
                    tr.engines.stream.close()
            tr.engines.generator.close()  # vLLM: its groups go before the process group they live in
        destroy_distributed(info)
    return run_dir


# ----------------------------------------------------------------------------------------------- the loop


def train(tr: Trainer, *, console: Any) -> None:
    cfg, main = tr.config, tr.run.dist.is_main
    if eval_at_start(cfg.run, cfg.eval, tr.run.step):  # the student before training: eval/step_0
        with gathered(tr.models.student, tr.run.dist):
            if main:
                run_eval(tr, console)
    with progress_bar(console) as progress:
        task = progress.add_task("opd distill", total=cfg.run.steps, completed=tr.run.step)
        if (
            tr.run.step
            and cfg.eval.benchmarks
            and is_due(tr.run.step, cfg.run.eval_every, cfg.run.steps)
            and eval_pending(tr.run.run_dir, tr.run.step)
        ):  # resumed from a checkpoint whose eval did not finish
            with gathered(tr.models.student, tr.run.dist):
                if main:
                    run_eval(tr, console)
        warm_up_metrics = _warm_up(tr, console) if tr.models.compiled_layers and tr.run.step < cfg.run.steps else {}
        compiles = CompileLog()
        consecutive_skips = steps_run = 0
        while tr.run.step < cfg.run.steps:
            skipped_before = tr.run.skipped_steps
            metrics = opd_step(tr)  # already reduced over ranks
            tr.run.step += 1
            graphs, recompiled = compiles.take()
            if tr.models.compiled_layers:  # what this step compiled (rank 0's): after the warm-up, 0 is the target
                metrics["compile/step_graphs"] = graphs
            metrics.update(warm_up_metrics)  # the first step's line carries the warm-up's seconds and cache hits
            warm_up_metrics = {}
            if main:
                assert tr.run.sink is not None  # setup opens rank 0's sink
                tr.run.sink.log(tr.run.step, metrics)
                if news := describe_compiles(graphs, recompiled):  # what the warm-up left out, for the next warm-up
                    console.print(f"step {tr.run.step} compiled {news}")
            consecutive_skips = consecutive_skips + 1 if tr.run.skipped_steps > skipped_before else 0
            steps_run += 1
            check_skipped_steps(consecutive_skips, tr.run.step, cfg.optim)
            tr.run.history.append({"step": tr.run.step, **metrics})
            progress.update(task, advance=1, description=_console_line(tr.run.step, metrics))
            if is_due(tr.run.step, cfg.run.save_every, cfg.run.steps):  # before the eval: a failing eval loses no work
                save(tr)
            if is_due(tr.run.step, cfg.run.eval_every, cfg.run.steps):
                with gathered(tr.models.student, tr.run.dist):  # rank 0 evaluates alone: no collectives inside
                    if main:
                        run_eval(tr, console)
                compiles = CompileLog()  # the evaluation's own graphs (greedy decoding) are not the next step's
    if main:
        finish_run(tr.run.run_dir, tr.run.sink, report=cfg.run.report, console=console)
    barrier(tr.run.dist)
    check_run_trained(consecutive_skips, tr.run.step, steps_run)  # every rank: the grad norm is the global one


def _warm_up(tr: Trainer, console: Any) -> dict[str, float]:
    """`warm_up` with its artefacts kept in the compile cache (`opd.compile_cache`); returns its `compile/*` metrics."""
    device = next(tr.models.student.parameters()).device
    rows = decode_warm_up_rows(tr)
    with persisted(warm_up_cache_parts(tr), device) as cache:
        graphs = warm_up(tr, device, decode_rows=rows)
    decode = (
        f" and the rollout engine's decode step at {len(rows)} row counts ({rows[0]} to {rows[-1]})" if rows else ""
    )
    console.print(
        f"compiled layers: warmed up on every batch layout{decode} in {cache.seconds:.1f} s "
        f"({graphs} graphs); no step should compile again (metric compile/graphs)"
    )
    console.print(cache.describe())
    return cache.metrics()


def _console_line(step: int, m: dict) -> str:
    parts = [f"step {step}"]
    for key, label in (
        ("reward_mean", "r"),
        ("overlap_ratio", "ovl"),
        ("entropy_student", "H"),
        ("rollout_accuracy", "acc"),
        ("grad_norm", "|g|"),
        ("tokens_per_second", "tok/s"),
        ("episode/turns_mean", "turns"),  # with rollout.tools
        ("episode/tool_calls_mean", "calls"),
    ):
        if key in m and m[key] is not None:
            parts.append(f"{label} {m[key]:.3g}")
    return " ".join(parts)


def run_eval(tr: Trainer, console: Any) -> dict | None:
    cfg = tr.config
    return evaluate_in_training(
        cfg.eval,
        step=tr.run.step,
        run_dir=tr.run.run_dir,
        model_path=cfg.student.path,
        generator=tr.engines.generator,
        tokenizer=tr.models.tokenizer,
        template=cfg.data.template,
        enable_thinking=cfg.data.enable_thinking,
        max_prompt_length=cfg.data.max_prompt_length,
        batch_size=cfg.rollout.batch_size,
        seed=cfg.run.seed,
        sink=tr.run.sink,
        console=console,
        model=tr.models.student,  # the weights evaluated identify the eval, not cfg.student.path
        teachers=cfg.teacher_entries(),  # several: per-teacher results on the benchmarks their routes place
        tools=cfg.rollout.tools,  # a run that trains with tools is evaluated with them
        sandbox=cfg.rollout.sandbox,
        max_turns=cfg.rollout.max_turns,
        tool_format=cfg.rollout.tool_format,
    )


def save(tr: Trainer) -> Path:
    """Every rank calls this (FSDP: the full weights and optimizer state are gathered); rank 0 writes."""
    weights = full_state_dict(tr.models.student, tr.run.dist)  # None with one process: save the module itself
    state = trainer_state(
        tr.optimization.optimizer,
        tr.optimization.scheduler,
        tr.data.sampler,
        skipped_steps=tr.run.skipped_steps,
        history=tr.run.history,
        pending_rollouts=None if tr.engines.ahead is None else tr.engines.ahead.state_dict(),
        partial_stream=None if tr.engines.stream is None else tr.engines.stream.state_dict(),
        world_size=tr.run.dist.world_size,
        data_fingerprint=_prompt_fingerprint(tr),
        routing_fingerprint=_routing_fingerprint(tr),
    )
    state["optimizer"] = full_optimizer_state_dict(tr.models.student, tr.optimization.optimizer, tr.run.dist)
    state["teachers"] = tr.run.teacher_manifest  # `--resume` refuses another teacher set (check_teacher_manifest)
    path = tr.run.run_dir / "checkpoints" / f"step_{tr.run.step}"
    if tr.run.dist.is_main:
        path = save_checkpoint(
            tr.run.run_dir,
            tr.run.step,
            model=tr.models.student,
            tokenizer=tr.models.tokenizer,
            trainer_state=state,
            keep_last=tr.config.run.keep_last,
            state_dict=weights,
        )
    barrier(tr.run.dist)  # nobody reads the checkpoint before it is complete
    return path


# ---------------------------------------------------------------------------------------------------- setup


def setup(
    config: DistillConfig,
    run_dir: Path,
    *,
    checkpoint: Path | None = None,
    console: Any = None,
    dist: DistInfo = SINGLE,
) -> Trainer:
    """Validate everything cheap first (world size, tokenizers, engines, data), then load models and build the trainer.
    `dist` (from `init_distributed`): with world size > 1 the student is sharded with FSDP2 on the rank's device."""
    check_sizes(config, dist)
    torch.manual_seed(config.run.seed)
    student_tokenizer = load_tokenizer(config.student.path, trust_remote_code=config.student.trust_remote_code)
    modes = tokenizer_modes(config.teacher_entries(), student_tokenizer, console)  # same or cross, per teacher
    _check_teacher_and_engine(config, student_tokenizer, console, modes)
    _check_vllm_rope(config)
    environment = _tool_environment(config, student_tokenizer, console, modes)  # the python tool's sandbox probed
    data = _load_data(config, student_tokenizer, console, environment)
    prompt_teacher = route_teachers(config, data, console)  # before any model loads: an unrouted prompt fails now
    if prompt_teacher:
        check_routing_table_path(run_dir)  # and a teachers.json it could not write, before config.yaml is
    views = teacher_views(config, data, prompt_teacher, student_tokenizer, environment)  # with its tools
    views = cross_teacher_views(config, data.prompts, prompt_teacher, modes, views)  # their own renderings
    if checkpoint is not None:  # the data a checkpoint trained on, before any model loads (its tensors stay on disk)
        _check_resume_identity(
            config,
            checkpoint,
            load_trainer_state(checkpoint, mmap=True),
            _prompt_fingerprint_of(data.input_ids, data.prompts),
            _routing_fingerprint_of(prompt_teacher, [e.name for e in config.teacher_entries()], views),
            console=None,  # with run.allow_config_change the note is printed once, by _resume
        )
    models = _load_models(config, checkpoint, student_tokenizer, dist, modes)
    for routed, view_ids in zip(models.teachers, views):
        routed.prompt_ids = view_ids
    _fix_rope(config, models, console if dist.is_main else None)
    _check_context(config, models, data, prompt_teacher)
    generator, rollout_model, rollout_generator = _build_engines(config, models, dist)
    startup_checks(config, models, generator, data, student_tokenizer, dist, console, prompt_teacher)
    compiled, budget = _configure_memory(config, models, dist)
    reference_scorer = _load_reference(config, models)
    optimizer, scheduler, sampler = _build_optimization(config, models, generator, len(data.prompts), dist)
    # rollout.partial / rollout.overlap; with rollout.tools the stream's samples are episodes
    make_stream = (
        RolloutStream if environment is None else episode_stream(config, models.tokenizer, environment, data.prompts)
    )
    stream, ahead = rollout_ahead(config, rollout_model, rollout_generator, make_stream)
    tr = Trainer(
        config=config,
        models=TrainModels(
            student=models.student,
            tokenizer=models.tokenizer,
            student_scorer=models.student_scorer,
            reference_scorer=reference_scorer,
            vocab_size=models.vocab_size,
            teachers=models.teachers,
            autocast_dtype=models.autocast_dtype,
            activation_budget=budget,
            compiled_layers=compiled,
        ),
        data=TrainData(prompts=data.prompts, prompt_ids=data.input_ids, sampler=sampler, prompt_teacher=prompt_teacher),
        engines=TrainEngines(
            generator, rollout_model, rollout_generator, ahead=ahead, stream=stream, environment=environment
        ),
        optimization=TrainOptimization(optimizer, scheduler),
        run=RunState(
            run_dir,
            dist=dist,
            teacher_manifest=teacher_manifest(models.teachers),
            gpu_busy=GpuBusy.open(next(models.student.parameters()).device),
        ),
    )
    resume_step = _resume(tr, checkpoint, console)
    if dist.is_main:  # rank 0 writes the run directory
        tr.run.sink = open_run(config, run_dir, config.run, resume_step=resume_step)
        write_routing_table(run_dir, routing_table(config, prompt_teacher), step=resume_step)
    return tr


def check_sizes(config: DistillConfig, dist: DistInfo) -> None:
    """The checks that need the number of processes, and the micro-batch budget against one sequence (not a config
    validator: configs built in code, like the benchmarks', leave data.max_prompt_length nominal). The other
    cross-field checks are `DistillConfig`'s validators."""
    if config.prompts_per_step % dist.world_size:
        raise ValueError(
            f"prompts_per_step={config.prompts_per_step} must be divisible by the {dist.world_size} "
            f"processes (each takes an equal slice of a step's prompts)"
        )
    if config.rollout.overlap and dist.world_size > 1:
        raise ValueError(
            "rollout.overlap=true trains on rollouts sampled one step earlier: it needs objective.tis_cap "
            f"(e.g. 2.0) to correct them, and one process (got {dist.world_size})"
        )
    if config.rollout.partial and dist.world_size > 1:
        raise ValueError(
            f"rollout.partial=true keeps in-flight samples in one process's stream: it needs one process (got "
            f"{dist.world_size})"
        )
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    batch_tokens = config.rollout.max_batch_tokens
    if batch_tokens is not None and batch_tokens < longest:
        raise ValueError(
            f"rollout.max_batch_tokens={batch_tokens} is smaller than one sequence (data.max_prompt_length + "
            f"rollout.max_new_tokens = {longest}); raise it to at least {longest}, or unset it"
        )
    if config.micro_batch_tokens < longest:
        raise ValueError(
            f"micro_batch_tokens={config.micro_batch_tokens} is smaller than one sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens = {longest}); raise it to at least {longest}"
        )


def _run_length(config: DistillConfig) -> int:
    """The run's longest sequence, prompt + response: what a length-dependent RoPE is fixed for (`fix_rope`)."""
    return config.data.max_prompt_length + config.rollout.max_new_tokens


def _check_vllm_rope(config: DistillConfig) -> None:
    """Before any model loads: a vLLM engine (rollout or teacher) of a model whose RoPE depends on the length must
    fix the table the run does (`opd.rollout.vllm_engine.rope_refusal`), or the run is refused in one line."""
    engines = [("rollout.engine=vllm", config.student, config.rollout.vllm)] if config.rollout.engine == "vllm" else []
    engines += [(f"teacher {e.name}", e, e.vllm) for e in config.teacher_entries() if e.engine == "vllm" and e.path]
    for what, spec, vllm in engines:
        path = config.student.path if spec.path == STUDENT_INIT else str(spec.path)
        check_vllm_rope(spec, vllm, _run_length(config), what, path=path)


def _fix_rope(config: DistillConfig, models: Models, console: Any) -> None:
    """One RoPE table per run: every in-process model whose RoPE depends on the sequence length (longrope, dynamic)
    is fixed to the table of the longest sequence it reads (`opd.models.fix_rope`): the run's, or a teacher's with
    a view that makes its prompts longer. Its engines, scorers and update then compute one distribution; a served
    teacher must have fixed the same (`RemoteScorer.check_rope`)."""
    length = _run_length(config)
    several = len(models.teachers) > 1
    fixes: dict[int, tuple[str, torch.nn.Module, int]] = {id(models.student): ("student", models.student, length)}
    for routed in models.teachers:
        views = routed.prompt_ids or []
        own = max([length] + [len(ids) + config.rollout.max_new_tokens for ids in views])
        module, check = routed.teacher.module, getattr(routed.teacher.scorer, "check_rope", None)
        if module is None:
            if check is not None:  # a served teacher's /info
                check(own)
            continue
        name, _, before = fixes.get(id(module), (f"teacher {routed.name}" if several else "teacher", module, own))
        fixes[id(module)] = (name, module, max(before, own))
    for name, module, longest in fixes.values():
        choice = fix_rope(module, longest)
        if choice is not None and console is not None:
            console.print(f"{name}: {choice.describe()}")


def _check_context(
    config: DistillConfig, models: Models, data: EncodedPrompts | None = None, prompt_teacher: list[int] | None = None
) -> None:
    """A rollout must fit the context of every model that reads it (`max_position_embeddings` of the student and of
    an in-process teacher): beyond it the positions are ones the models never saw, and nothing says so. A teacher
    with a view reads its own, longer prompts: the longest of those routed to it, plus rollout.max_new_tokens."""
    new = config.rollout.max_new_tokens
    longest = config.data.max_prompt_length + new
    several = len(models.teachers) > 1
    teachers = [(f"teacher {t.name}" if several else "teacher", t.teacher.module) for t in models.teachers]
    for name, module in (("student", models.student), *teachers):
        context = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        if isinstance(context, int) and new >= context:
            raise ValueError(
                f"rollout.max_new_tokens={new} is beyond the {name}'s context ({context} positions, "
                f"max_position_embeddings; with data.max_prompt_length={config.data.max_prompt_length} a "
                f"sequence is up to {longest} tokens); lower rollout.max_new_tokens below {context}"
            )
    for index, routed in enumerate(models.teachers):  # a view lengthens the teacher's prompts past the student's
        context = getattr(getattr(routed.teacher.module, "config", None), "max_position_embeddings", None)
        view_ids, mine = routed.prompt_ids, [i for i, owner in enumerate(prompt_teacher or []) if owner == index]
        if view_ids is None or routed.entry.view is None or data is None or not mine or not isinstance(context, int):
            continue
        longest = max(mine, key=lambda i: len(view_ids[i]))
        length = len(view_ids[longest])
        if length + new > context:
            raise ValueError(
                f"teacher {routed.name}'s view (view.context_key={routed.entry.view.context_key!r}) makes prompt "
                f"{data.prompts[longest].id} {length} tokens: with rollout.max_new_tokens={new} the teacher reads up "
                f"to {length + new}, beyond its context ({context} positions, max_position_embeddings); shorten "
                f"view.context_template or the context, or lower rollout.max_new_tokens"
            )


def _check_teacher_and_engine(
    config: DistillConfig, student_tokenizer: Any, console: Any, modes: dict[str, str] | None = None
) -> None:
    """The teacher's tokenizer matches the student's and it serves what the objective asks; a vLLM rollout engine is
    installed and its log-probs fit the objective; objective.top_k fits the vocabulary."""
    check_top_k(config.objective.top_k, student_tokenizer)
    for entry in config.teacher_entries():
        if entry.path == STUDENT:  # the student's own tokenizer and scorer: nothing to compare
            continue
        if (modes or {}).get(entry.name) == "cross":  # another vocabulary: what the span signal serves
            check_cross_objective(entry, config.objective)
        else:
            check_teacher_tokenizer(entry, student_tokenizer)
        check_teacher_serves(entry, config.objective)
    if config.rollout.engine != "vllm":
        return
    if not vllm_available():
        raise ValueError("rollout.engine=vllm needs the vllm package (README: vLLM); or use rollout.engine=auto")
    if config.objective.tis_cap is not None and config.rollout.top_p < 1:
        raise ValueError(
            f"objective.tis_cap needs full-vocabulary rollout log-probs, but vLLM reports them after "
            f"top-p filtering: set rollout.top_p=1 (got {config.rollout.top_p}) or rollout.engine=torch"
        )
    if console is not None and config.objective.tis_cap is None:
        console.print(
            f"rollout.engine=vllm: rollouts come from another engine than the trainer; their log-prob gap "
            f"is logged as rollout_logprob_abs_diff, and no importance weights correct it (objective."
            f"tis_cap unset, the paper's recipe); set objective.tis_cap={VLLM_TIS_CAP} to truncate them"
        )


def _tool_environment(
    config: DistillConfig, student_tokenizer: Any, console: Any, modes: dict[str, str]
) -> Environment | None:
    """rollout.tools: the environment, built before any model loads (`opd.train.episodes.rollout_environment`: the
    python tool's sandbox probed, the chat template checked), and a teacher whose vocabulary resolved to another than
    the student's refused (its episodes would be re-tokenized: not supported yet)."""
    if config.rollout.tools is None:
        return None
    cross = [name for name, mode in modes.items() if mode == "cross"]
    if cross:
        raise ValueError(
            f"rollout.tools: teacher {cross[0]} has another vocabulary than the student's (tokenizer auto resolved "
            f"to cross); a cross-vocabulary teacher does not score episodes yet: give a teacher of the student's "
            f"vocabulary"
        )
    environment = rollout_environment(config, student_tokenizer, console)
    if console is not None and environment is not None:
        described = environment.describe()
        console.print(f"rollout.tools: episodes of up to {config.rollout.max_turns} turns with {described}")
    return environment


def _load_data(
    config: DistillConfig, student_tokenizer: Any, console: Any, environment: Environment | None = None
) -> EncodedPrompts:
    """The prompt set, rendered and encoded with the student's tokenizer (with rollout.tools, with the tools each
    prompt's episode offers), and the checks that need it; the eval sets are read now too, so that a bad one fails
    before training rather than after."""
    data, advantage = config.data, config.objective.advantage
    prompts = load_prompts(
        data.path,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        id_key=data.id_key,
        split=data.split,
        limit=data.limit,
        on_missing_answer=data.on_missing_answer,
    )
    encoded = encode_prompts(
        student_tokenizer,
        prompts,
        max_prompt_length=data.max_prompt_length,
        on_overflow=data.on_overflow,
        enable_thinking=data.enable_thinking,
        template=data.template,
    )
    if environment is not None:
        encoded = encode_with_tools(config, student_tokenizer, environment, encoded)
    if console is not None and encoded.num_filtered:
        tools = "" if environment is None else f" (with the tools of rollout.tools={config.rollout.tools})"
        console.print(
            f"[yellow]{encoded.num_filtered} prompts longer than data.max_prompt_length="
            f"{data.max_prompt_length}{tools} filtered[/]"
        )
    if not encoded.prompts:
        raise ValueError(
            f"no prompts left in {data.path} after filtering by data.max_prompt_length={data.max_prompt_length}"
        )
    if config.prompts_per_step > len(encoded.prompts):
        raise ValueError(
            f"prompts_per_step={config.prompts_per_step} exceeds the {len(encoded.prompts)} prompts of "
            f"{data.path}; lower prompts_per_step"
        )
    if advantage in ("grpo", "token_reward+grpo") and any(p.answer is None for p in encoded.prompts):
        raise ValueError(
            f"objective.advantage={advantage} needs ground-truth answers; set data.answer_key to the answer column"
        )
    if advantage in ("grpo", "token_reward+grpo") and not any(
        str(answer).strip()
        for p in encoded.prompts
        for answer in (p.answer if isinstance(p.answer, list) else [p.answer or ""])
    ):
        raise ValueError(
            f"objective.advantage={advantage} needs ground-truth answers, but every answer of "
            f"{data.path} (column {data.answer_key!r}) is empty; point data.answer_key at the answers"
        )
    load_eval_sets(
        config.eval,
        student_tokenizer,
        template=data.template,  # fails now, not after training
        enable_thinking=data.enable_thinking,
        max_prompt_length=data.max_prompt_length,
    )
    return encoded


def _load_models(
    config: DistillConfig,
    checkpoint: Path | None,
    student_tokenizer: Any,
    dist: DistInfo,
    modes: dict[str, str] | None = None,
) -> Models:
    """The student (from the checkpoint when resuming), the teachers, the shared vocabulary, FSDP2 sharding, and the
    student's own scorer. Entries that name the same model share one loaded teacher; `path: student` is the student's
    own scorer (no second model)."""
    student_path = str(checkpoint) if checkpoint else config.student.path
    device = dist.device or resolve_device(config.student.device)  # under torchrun: the rank's own device
    weights_dtype, autocast_dtype = training_precision(config.student, device)
    student, tokenizer = load_model(
        student_path,
        dtype=weights_dtype,
        device=device,
        trust_remote_code=config.student.trust_remote_code,
        attn_implementation=config.student.attn_implementation,
    )
    student_rows = student.get_output_embeddings().weight.shape[0]
    vocab = check_tokenizer_compatibility(
        tokenizer, tokenizer, student_vocab_size=student_rows, teacher_vocab_size=student_rows
    )
    own_vocab = vocab
    entries = config.teacher_entries()
    crosses: dict[str, Any] = {}  # name → CrossVocab of the teachers of another vocabulary
    loaded, vocab = _load_teachers(
        config, entries, student_tokenizer, student_rows, device, dist, own_vocab, (modes or {}, crosses, student)
    )
    # ids beyond the tokenizer are embedding padding rows: never sampled, never a top-k candidate (SPEC §1)
    vocab_size = vocab.tokenizer_size
    shard_model(student, dist)  # FSDP2 (no-op for one process); the optimizer sees the sharded parameters
    with gathered(student, dist):  # the scorer checks the head once with a forward
        student_scorer = LocalScorer(
            student,
            max_tokens_per_batch=config.score_batch_tokens,
            vocab_size=vocab_size,
            through_root=dist.world_size > 1,
        )
    live = Teacher(scorer=student_scorer, module=None, vocab=own_vocab)  # the step scores it as the student's own
    teachers = [
        RoutedTeacher(entry, live if t is None else t, cross=crosses.get(entry.name))
        for entry, t in zip(entries, loaded)
    ]
    return Models(
        student=student,
        tokenizer=tokenizer,
        student_path=student_path,
        device=device,
        weights_dtype=weights_dtype,
        autocast_dtype=autocast_dtype,
        vocab_size=vocab_size,
        student_scorer=student_scorer,
        teachers=teachers,
    )


def _load_teachers(
    config: DistillConfig,
    entries: list[TeacherEntry],
    student_tokenizer: Any,
    student_rows: int,
    device: torch.device,
    dist: DistInfo,
    own_vocab: VocabInfo,
    cross: tuple[dict[str, str], dict[str, Any], Any] = ({}, {}, None),
) -> tuple[list[Teacher | None], VocabInfo]:
    """Each entry's loaded teacher (None: `path: student`, the student's own scorer), entries that name the same model
    sharing one; and the vocabulary they all share with the student. A teacher of another tokenizer size, or scorers
    that differ in scoring the student's top-k, fail in one line. `cross`: (modes by name, the dict this fills with
    each cross teacher's `CrossVocab`, the student model): a teacher of another vocabulary shares the student's."""
    modes, crosses, student = cross
    vocab = own_vocab
    loaded: list[Teacher | None] = []  # None: path: student, the student's own scorer (built below)
    by_model: dict[str, Teacher] = {}
    first_serves: bool | None = None
    for entry in entries:
        found = None
        request = TeacherRequest(
            spec=entry,
            student_tokenizer=student_tokenizer,
            student_rows=student_rows,
            student_device=device,
            world_size=dist.world_size,
            offload=bool(entry.offload),
            max_tokens_per_batch=config.score_batch_tokens,
            objective=config.objective,
            max_batch_size=config.rollout.batch_size,
        )
        if modes.get(entry.name) == "cross":
            found, crosses[entry.name] = load_cross_teacher(
                entry,
                student_tokenizer=student_tokenizer,
                student_eos_ids=eos_token_ids(student, student_tokenizer),
                request=request,
                own_vocab=own_vocab,
            )
        elif entry.path != STUDENT:
            key = model_key(entry)
            if key not in by_model:
                by_model[key] = build_teacher(request)
            found = by_model[key]
        this_vocab = own_vocab if found is None else found.vocab
        serves = LocalScorer.serves_requested_ids if found is None else found.scorer.serves_requested_ids
        if loaded and this_vocab.tokenizer_size != vocab.tokenizer_size:
            raise ValueError(
                f"teachers: {entry.name} has {this_vocab.tokenizer_size} tokens, {entries[0].name} "
                f"{vocab.tokenizer_size}; every teacher shares the student's tokenizer"
            )
        if first_serves is not None and serves != first_serves:
            raise ValueError(
                f"teachers: {entry.name} and {entries[0].name} differ in scoring the student's top-k (a vLLM "
                f"teacher scores only its own); use one kind of scorer for every teacher"
            )
        first_serves = serves if first_serves is None else first_serves
        vocab = this_vocab
        loaded.append(found)
    return loaded, vocab


def _build_engines(
    config: DistillConfig, models: Models, dist: DistInfo
) -> tuple[Generator, torch.nn.Module | None, Generator | None]:
    """The rollout engine over the student, and with rollout.overlap the snapshot and engine that generate one step
    ahead. Under FSDP every engine runs from full weights: the in-process ones (torch, static) read the student's
    unsharded parameters inside `gathered` (opd_step), vLLM gets `all_full_weights` at each sync."""
    student, tokenizer = models.student, models.tokenizer
    generator = make_generator(
        student,
        tokenizer,
        max_batch_size=config.rollout.batch_size,
        vocab_size=models.vocab_size,
        max_batch_tokens=config.rollout.max_batch_tokens,
        engine=config.rollout.engine,
        **_vllm_engine_arguments(config, models, dist),
        **_static_engine_arguments(config, models, dist),
    )
    rollout_model = rollout_generator = None
    if config.rollout.overlap:  # a snapshot the background rollouts read while the student is updated
        rollout_model, rollout_generator = overlap_generator(
            student, tokenizer, config, models.vocab_size, models.autocast_dtype
        )
    return generator, rollout_model, rollout_generator


def _static_engine_arguments(config: DistillConfig, models: Models, dist: DistInfo) -> dict:
    """make_generator's extra arguments for the static engine: rollout.compiled_prefill, refused in one line where it
    could not act (another engine, layers that will not be compiled, attention that does not pack prompts)."""
    if not config.rollout.compiled_prefill:
        return {}
    engine = resolve_engine(config.rollout.engine, models.student)
    attention = getattr(models.student.config, "_attn_implementation", None)
    why = None
    if engine != "static":
        why = f"the rollout engine is {engine!r} (rollout.engine={config.rollout.engine})"
    elif not _compiles_layers(config, models, dist):
        why = f"the student's layers are not compiled (compile={config.compile}, device {models.device.type})"
    elif attention != varlen_attention.ATTENTION:
        why = f"the student's attention is {attention!r}"
    if why is not None:
        raise ValueError(
            f"rollout.compiled_prefill=true needs the static engine, compiled layers and {varlen_attention.ATTENTION} "
            f"attention (a GPU): {why}; set rollout.compiled_prefill=false"
        )
    return {"compiled_prefill": True}


def _vllm_engine_arguments(config: DistillConfig, models: Models, dist: DistInfo) -> dict:
    """make_generator's extra arguments for rollout.engine=vllm: the path vLLM loads, its options, and under torchrun
    the full weights every rank's engine is synced with."""
    if config.rollout.engine != "vllm":
        return {}
    options = EngineOptions.from_config(
        config.rollout.vllm, dtype=config.student.dtype, trust_remote_code=config.student.trust_remote_code
    )
    arguments: dict[str, Any] = dict(model_path=models.student_path, engine_options=options)
    if dist.world_size > 1:
        arguments["weights_fn"] = lambda: all_full_weights(models.student, dist)
    return arguments


def _compiles_layers(config: DistillConfig, models: Models, dist: DistInfo) -> bool:
    """Whether `_configure_memory` compiles the student's layers: `compile` true, or unset on CUDA in one process
    (FSDP2 + compile is untested: only when asked for)."""
    if dist.world_size > 1 and not config.compile:
        return False
    return bool(config.compile) or (config.compile is None and models.device.type == "cuda")


def _configure_memory(config: DistillConfig, models: Models, dist: DistInfo) -> tuple[bool, float | None]:
    """Compiled layers and activation checkpointing; returns whether the student's layers are compiled and the
    selective-checkpointing budget (None: off).
    Checkpointing is full (HF, per layer) when asked for; by default on CUDA selective inside the compiled layers
    (docs/performance.md: the update's speed and memory under each)."""
    compiled = False
    if _compiles_layers(config, models, dist):
        compiled = compile_layers(models.student, config.compile)
        modules = {id(t.teacher.module): t.teacher.module for t in models.teachers if t.teacher.module is not None}
        for module in modules.values():  # an offloaded teacher runs only on the GPU too (`on_device`)
            compile_layers(module, config.compile)
    auto_full = config.gradient_checkpointing is None and models.device.type == "cuda" and not compiled
    if config.gradient_checkpointing or auto_full:
        models.student.gradient_checkpointing_enable()
    elif config.gradient_checkpointing is None and compiled:
        return compiled, config.activation_budget
    return compiled, None


def _load_reference(config: DistillConfig, models: Models) -> LocalScorer | None:
    """A frozen copy of the initial student, only when a KL term asks for it (objective.kl_coef)."""
    if not config.objective.kl_coef:
        return None
    reference, _ = load_model(
        config.student.path,
        dtype=models.autocast_dtype or models.weights_dtype,
        device=models.device,
        trust_remote_code=config.student.trust_remote_code,
        attn_implementation=config.student.attn_implementation,
    )
    reference.requires_grad_(False)
    fix_rope(reference, _run_length(config))  # the student's own table
    return LocalScorer(reference, max_tokens_per_batch=config.score_batch_tokens, vocab_size=models.vocab_size)


def _build_optimization(
    config: DistillConfig, models: Models, generator: Generator, num_prompts: int, dist: DistInfo
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, PromptSampler]:
    """The optimizer, the LR schedule and the prompt sampler — after checking that one rollout fits next to the
    models and the optimizer state."""
    student = models.student
    optimizer = build_optimizer(student.parameters(), config.optim)
    # One rollout must fit next to the models and the optimizer state, which AdamW allocates at its first step (two
    # moments per trainable parameter of this rank's shard, counted at the parameters' size): fail now, before any
    # data reaches the GPU.
    with autocast(models.device, models.autocast_dtype):
        check_generation_fits(
            generator,
            prompt_tokens=config.data.max_prompt_length,
            new_tokens=config.rollout.max_new_tokens,
            reserve_bytes=adamw_state_bytes(student.parameters()) + gathered_bytes(student, dist),
            names=("data.max_prompt_length", "rollout.max_new_tokens"),
        )
    scheduler = build_scheduler(optimizer, config.run.steps, config.optim)
    sampler = PromptSampler(num_prompts, config.prompts_per_step, seed=config.run.seed)
    return optimizer, scheduler, sampler


def _resume(tr: Trainer, checkpoint: Path | None, console: Any) -> int | None:
    """Restore the optimizer, schedule, sampler, counters and (rollout.overlap) the rollouts generated ahead from
    `checkpoint`; returns the step resumed at, None for a fresh run."""
    if checkpoint is None:
        return None
    state = restore_trainer_state(
        checkpoint,
        _FullStateOptimizer(tr.models.student, tr.optimization.optimizer, tr.run.dist),
        tr.optimization.scheduler,
        tr.data.sampler,
        optim=tr.config.optim,
        torch_optimizer=tr.optimization.optimizer,
        console=console,
    )
    _check_resume_identity(tr.config, checkpoint, state, _prompt_fingerprint(tr), _routing_fingerprint(tr), console)
    check_teacher_manifest(state.get("teachers"), tr.run.teacher_manifest, checkpoint)
    tr.run.step, tr.run.skipped_steps, tr.run.history = state["step"], state["skipped_steps"], state["history"]
    if tr.engines.ahead is not None:  # the rollouts generated for the next step, from weights no longer saved
        tr.engines.ahead.load_state_dict(state.get("pending_rollouts"))
    if tr.engines.stream is not None:  # the in-flight samples (rollout.partial): their tokens, log-probs and versions
        tr.engines.stream.load_state_dict(state.get("partial_stream"))
    if console is not None:
        console.print(f"resumed from {checkpoint} (step {tr.run.step}){_world_size_change(state, tr.run.dist)}")
    return tr.run.step


def _check_resume_identity(
    config: DistillConfig, checkpoint: Path, state: dict, prompts: str, routing: str, console: Any
) -> None:
    """The data a checkpoint trained on against this run's: the prompt set (`_prompt_fingerprint`) and what routes
    and views read from it (`_routing_fingerprint`); each a one-line refusal, or a note with run.allow_config_change."""
    check_data_fingerprint(
        state,
        prompts,
        what=f"the prompt set data.path={config.data.path}",
        run=config.run,
        checkpoint=checkpoint,
        console=console,
    )
    check_data_fingerprint(
        state,
        routing,
        what=f"the teachers' routing or views over data.path={config.data.path} (each prompt's teacher, from "
        f"its route column, and the context its view adds)",
        run=config.run,
        checkpoint=checkpoint,
        console=console,
        key="routing_fingerprint",
        consequence="the steps after it would train under other teachers or contexts than the steps before",
    )


def _prompt_fingerprint(tr: Trainer) -> str:
    return _prompt_fingerprint_of(tr.data.prompt_ids, tr.data.prompts)


def _prompt_fingerprint_of(prompt_ids: list[list[int]], prompts: list[Any]) -> str:
    """The prompt set as training sees it: each prompt's token ids and answer (`data_fingerprint`)."""
    return cached_fingerprint(prompt_ids, lambda: ((ids, prompt.answer) for ids, prompt in zip(prompt_ids, prompts)))


def _routing_fingerprint(tr: Trainer) -> str:
    teachers = tr.models.teachers
    return _routing_fingerprint_of(tr.data.prompt_teacher, [t.name for t in teachers], [t.prompt_ids for t in teachers])


def _routing_fingerprint_of(prompt_teacher: list[int], names: list[str], views: list[list[list[int]] | None]) -> str:
    """What routes and views read from the prompt set, as training uses it: each prompt's teacher (its name) and,
    with a view, the prompt's token ids as that teacher sees them (`data_fingerprint`)."""

    def rows():
        for index, owner in enumerate(prompt_teacher):
            view_ids = views[owner]
            yield (view_ids[index] if view_ids is not None else []), names[owner]

    return cached_fingerprint(prompt_teacher, rows)


@dataclass
class _FullStateOptimizer:
    """What `restore_trainer_state` loads the optimizer state through: under FSDP the checkpoint holds the full,
    name-keyed state (`full_optimizer_state_dict`); with one process this is `optimizer.load_state_dict`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dist: DistInfo

    def load_state_dict(self, state: dict) -> None:
        load_full_optimizer_state_dict(self.model, self.optimizer, state, self.dist)


def _world_size_change(state: dict, dist: DistInfo) -> str:
    """A note when a checkpoint resumes at another world size than it was saved at (allowed: the global batches, the
    optimizer state and the schedule are the same; only sums over ranks regroup, at float rounding level)."""
    saved = state.get("world_size")  # absent in checkpoints written before it was recorded
    if saved is None or saved == dist.world_size:
        return ""
    return (
        f"; saved by {saved} process{'es' * (saved > 1)}, resumed by {dist.world_size}: the same global batches, "
        f"sums over ranks regrouped (results differ from an uninterrupted run at float rounding level; sampled "
        f"rollouts differ too, each rank drawing with its own seed)"
    )
