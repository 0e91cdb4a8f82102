"""The whole OPD step: our `opd.train.step.opd_step` against real TRL 1.16 (`DistillationTrainer`, `GKDTrainer`).

    python benchmarks/opd_step.py                      # 0.6B student, 1.7B teacher, 8 prompts × 4, ≤ 256 new tokens
    python benchmarks/opd_step.py --variants default,lean,lean_offload --skip-trl     # the lean options
    python benchmarks/opd_step.py --paper              # 1.7B ← 4B, 64 prompts × 4, ragged lengths, against the bound
    python benchmarks/opd_step.py --shape tiny --teacher-shape tiny --device cpu --prompts 2 --n 2 --new-tokens 8

Ours (`--variants`, one row each): a `Trainer` assembled like `opd.recipes.distill.setup` builds it (same optimizer,
scheduler, sampler, scorers, precision: float32 student weights + bf16 autocast on CUDA, bf16 teacher), from
in-memory random-weight models and a stand-in tokenizer (no files), the default objective (top-16 `only_stu`,
token-reward advantages, PPO-clip), and as `opd distill` sets a GPU up: compiled decoder layers of both models,
selective activation checkpointing (`--compile`, `--ckpt`). Variants (`VARIANTS`): `default` (the config defaults:
fp32 AdamW state, fused on CUDA), `foreach` (torch's foreach AdamW: the previous default), `bf16_state`
(`optim.state_dtype=bf16`), `micro4k` (`micro_batch_tokens=4096`), `ckpt_on` (full per-layer checkpointing),
`offload` (`teacher_offload`), `lean` (bf16 state + micro4k), `lean_offload`, `lean_offload_8k`, `overlap`
(`rollout.overlap` with `objective.tis_cap=2`), `partial` (`rollout.partial`, `max_staleness=1`, `tis_cap=2`),
`partial_overlap` (both: the stream's next batch built in the background), `partial_early_stop` (`partial` with
`rollout.partial_early_stop`), `partial_s2` and `partial_s2_early_stop` (the same at `max_staleness=2`),
`partial_s3_early_stop` (at 3). On CUDA
each row also prints where its memory goes (the phase marks of `opd_step`).

TRL (`--trl`, one row each; its wheels are carried to the GPU machine: benchmarks/README.md): the same student and
teacher (fresh copies per row: TRL's Trainer wraps the forward of the models it is given), the same prompts as
text of a word-level tokenizer whose word `t<i>` is id i (one word, one id: the prompt is exactly the same 128 ids).
The workload is fixed for every TRL row: on-policy (GKD `lmbda=1`), reverse KL (`beta=1`, DistillationTrainer's
default; GKD's is 0.5), temperature 1, top-k 0, top-p 1, ≤ `--new-tokens`, all 32 sequences in one optimizer step,
lr 1e-6, AdamW (TrainingArguments' default `adamw_torch_fused`), grad clip 1.0. Speed settings:
- `defaults`: what TRL 1.16 does unless told otherwise: gradient checkpointing ON (every TRL config's default since
  `_BaseConfig`), bf16 autocast (float32 master weights), `per_device_train_batch_size=8` (TrainingArguments'
  default; × 4 accumulation steps = 32 sequences). DistillationTrainer generates the whole 32-sequence batch at once
  and trains in micro-batches of 8; GKD generates per micro-batch of 8, and with checkpointing on it generates
  WITHOUT a KV cache (`use_cache=False if gradient_checkpointing`, gkd_trainer.py).
- `fastest`: checkpointing off, one micro-batch of all 32 sequences (so GKD also generates all 32 at once, with a KV
  cache), bf16. Not available on the device and so not used: vLLM, Liger kernels, flash-attention 2; TRL's
  `torch_compile` was not tried.

tokens/s = generated response tokens (EOS included, padding not) summed over the timed steps / their summed wall time;
the same count for every row (ours: the response mask; DistillationTrainer: its completion mask; GKD: labels ≠ -100).
A step is one optimizer step, generation included; TRL's is timed from `on_step_begin` to `on_step_end` (the
dataloader's prompt fetch before it is not counted). peak GiB: CUDA allocated bytes, models and optimizer state
included, from the start of the row's first step.

`--profile`: after the timed steps, one more step (not timed) with its scoring and its update under torch.profiler:
each phase's wall seconds against its kernel seconds (far below the wall: the host sets the pace) and its top
kernels, printed after the table and kept in the JSON (`profile`). The rollout is left out: its thousands of
decode steps are CUDA-graph replays, which `rollout.py` measures.

`--paper`: student qwen3-1.7b, teacher qwen3-4b, 64 prompts × 4, responses ragged: each row is forced to end at a
length drawn from `--lengths` (default lognormal mean 1,500, cap 7,168) through the engines' own per-sample lengths
(`max_new_tokens_per_sample`; with continuous batching a finished row's slot is refilled at once), `--rollout-rows`
slots at a time (None: as many as fit in memory). Prints the phase times, tokens/s, peak memory and the physical
bound of the step (`common.opd_step_bound`) with the ratio step / bound.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    SHAPES,
    TOKENIZER_SIZE,
    Report,
    attention_name,
    base_parser,
    build_model,
    eos_id,
    forced_stop_rule,
    kv_bytes_per_token,
    markdown_table,
    measure,
    opd_step_bound,
    pad_id,
    param_count,
    parse_lengths,
    peak_gib,
    peaks,
    profiled,
    reset_memory,
    resolve_device,
    sync,
)

VARIANTS: dict[str, dict] = {
    "default": {},
    "foreach": {"fused": False},
    "bf16_state": {"state_dtype": "bf16"},
    "micro4k": {"micro_batch_tokens": 4096},
    "ckpt_on": {"ckpt": "on"},
    "offload": {"teacher_offload": True},
    "lean": {"state_dtype": "bf16", "micro_batch_tokens": 4096},
    "lean_offload": {"state_dtype": "bf16", "micro_batch_tokens": 4096, "teacher_offload": True},
    "lean_offload_8k": {"state_dtype": "bf16", "micro_batch_tokens": 8192, "teacher_offload": True},
    "overlap": {"overlap": True},
    "partial": {"partial": True},
    "partial_overlap": {"partial": True, "overlap": True},
    "partial_early_stop": {"partial": True, "early_stop": True},
    "partial_s2": {"partial": True, "max_staleness": 2},
    "partial_s2_early_stop": {"partial": True, "max_staleness": 2, "early_stop": True},
    "partial_s3_early_stop": {"partial": True, "max_staleness": 3, "early_stop": True},
    # two teachers of --teacher-shape (their own random weights), prompts routed alternately, both kept in pinned
    # host memory and moved in only while they score (`teachers:` with `offload: true`)
    "two_teachers_offload": {"teachers": 2, "teacher_offload": True},
}
TRL_ROWS = ("distill:defaults", "distill:fastest", "gkd:defaults", "gkd:fastest")
GIB = 2**30


class IdTokenizer:
    """Stands in for a tokenizer where `opd_step` only needs ids: pad id, and decoding for its sample log."""

    def __init__(self, pad: int, eos: int):
        self.pad_token_id, self.eos_token_id = pad, eos

    def batch_decode(self, sequences, skip_special_tokens: bool = True):
        return [" ".join(map(str, ids)) for ids in sequences]

    def decode(self, ids, **_):
        return " ".join(map(str, ids))

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]


class BenchGenerator:
    """Wraps an engine: records the response lengths of its last call and, with `lengths` (a `LengthDist`), forces
    every row to end at a drawn length (benchmark-only; see the module docstring), its last token made EOS ("stop";
    a row drawn at the cap `cap` is "length", as a truncated one). A sample continued over several calls
    (rollout.partial: the prompt plus its tokens so far) keeps the length drawn at its first call."""

    def __init__(self, inner, *, eos: int, cap: int, lengths=None):
        self.inner, self.eos, self.cap, self.lengths = inner, eos, cap, lengths
        self.last_lengths: list[int] = []
        # a continued sample's prefix → the tokens it has still to make, and whether it then stops (below the cap)
        self._left: dict[tuple[int, ...], tuple[int, bool]] = {}

    def sync_weights(self) -> None:
        self.inner.sync_weights()

    def release(self) -> None:
        self.inner.release()

    def close(self) -> None:
        self.inner.close()

    def check_fits(self, *args, **kwargs) -> None:
        self.inner.check_fits(*args, **kwargs)

    def generate(self, prompt_ids, params, *, max_new_tokens_per_sample=None, stop_when=None):
        from opd.rollout import GenerationOutput

        if self.lengths is None:
            out = self.inner.generate(
                prompt_ids, params, max_new_tokens_per_sample=max_new_tokens_per_sample, stop_when=stop_when
            )
            self.last_lengths = [len(r) for r in out.response_ids]
            return out
        n = params.n
        prefixes = [tuple(prompt) for prompt in prompt_ids for _ in range(n)]
        fresh = self.lengths.sample(len(prefixes), params.seed or 0)
        left = [self._left.pop(key, (min(total, self.cap), total < self.cap)) for key, total in zip(prefixes, fresh)]
        caps = max_new_tokens_per_sample or [params.max_new_tokens] * len(prefixes)
        drawn = [min(length, cap) for (length, _), cap in zip(left, caps)]
        # the engine ends each row at its drawn length (continuous batching refills the slot); EOS off so random
        # weights never end a row early, then the last token of every row that ends below the cap is made EOS
        # stop_when (rollout.partial_early_stop) sees the reasons this wrapper will report: a row the engine ended at
        # its drawn length that stops there is "stop"
        rule = forced_stop_rule(
            stop_when, [length == left[row][0] and left[row][1] for row, length in enumerate(drawn)]
        )
        out = self.inner.generate(
            prompt_ids,
            dataclasses.replace(params, stop_at_eos=False),
            max_new_tokens_per_sample=drawn,
            stop_when=rule,
        )
        ids, lps, reasons = [], [], []
        for row, length in enumerate(drawn):
            response = out.response_ids[row][:length]
            length = len(response)  # below the drawn length when stop_when cut the call
            to_make, stops = left[row]
            stopped = length == to_make and stops
            if length < to_make:  # cut by the call's max_new_tokens: a later call continues this prefix
                self._left[prefixes[row] + tuple(response)] = (to_make - length, stops)
            if stopped:
                response[-1] = self.eos
            ids.append(response)
            lps.append(out.logprobs[row][:length] if out.logprobs is not None else None)
            reasons.append("stop" if stopped else "length")
        self.last_lengths = [len(r) for r in ids]
        return GenerationOutput(
            response_ids=ids,
            finish_reasons=reasons,
            group_ids=[p for p in range(len(prompt_ids)) for _ in range(n)],
            logprobs=lps if params.return_logprobs else None,
        )


def trained_lengths(tr) -> tuple[dict, object]:
    """Where the response lengths of the rows a step trains come from, for its bound: with rollout.overlap the batch
    generated during the previous step (`tr.pending_rollouts`); with rollout.partial the stream's batch (its
    `next_batch` wrapped for the step, the first call's batch recorded; the caller deletes the wrapper); else the
    engine's last call (the caller's fallback). Returns the dict that gets "lengths" and the wrapped stream or None."""
    pending, trained = tr.pending_rollouts, {}
    if pending is not None:
        trained["lengths"] = [len(r) for r in pending.output.response_ids]
        return trained, None
    if tr.engines.stream is None:
        return trained, None
    stream, next_batch = tr.engines.stream, tr.engines.stream.next_batch

    def recorded(*args, **kwargs):
        batch = next_batch(*args, **kwargs)
        trained.setdefault("lengths", [len(r) for r in batch.output.response_ids])
        return batch

    stream.next_batch = recorded
    return trained, stream


def _engine(model, engine: str, args, rows: int, background: bool = False):
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    vocab = TOKENIZER_SIZE[args.shape]
    common = dict(
        eos_token_ids=[eos_id(args.shape)], pad_token_id=pad_id(args.shape), vocab_size=vocab, max_batch_size=rows
    )
    # background (rollout.overlap): uncompiled decode functions, as `opd.train.overlap.overlap_generator` builds them
    static = dict(compile=False) if background else {}
    inner = TorchGenerator(model, **common) if engine == "torch_engine" else StaticGenerator(model, **common, **static)
    lengths = parse_lengths(args.lengths) if args.lengths else None
    return BenchGenerator(inner, eos=eos_id(args.shape), cap=args.new_tokens, lengths=lengths)


def build_trainer(args, student, teacher, prompt_ids, engine: str, run_dir: Path, autocast_dtype, variant: dict):
    """A `Trainer` as `opd.recipes.distill.setup` assembles it; `teacher` is one module or, for a variant with
    several teachers, a list of them (routed prompt i → teacher i mod N, as a `teachers:` config routes)."""
    from opd.config import (
        DataSpec,
        DistillConfig,
        ModelSpec,
        ObjectiveSpec,
        OptimSpec,
        RunSpec,
        SamplingSpec,
        TeacherEntry,
        TeacherRoute,
        TeacherSpec,
    )
    from opd.report.gpu_busy import GpuBusy
    from opd.teacher.local import LocalScorer
    from opd.teacher.registry import RoutedTeacher, Teacher
    from opd.train.optim import build_optimizer, build_scheduler
    from opd.train.overlap import rollout_ahead, rollout_snapshot
    from opd.train.sampler import PromptSampler
    from opd.train.state import RunState, TrainData, TrainEngines, Trainer, TrainModels, TrainOptimization
    from opd.types import Prompt

    rows = args.rollout_rows or args.prompts * args.n
    overlap, partial = bool(variant.get("overlap")), bool(variant.get("partial"))
    # partial: one step of staleness unless the variant says (with overlap, every token is sampled one step ahead)
    sampling = dict(
        overlap=overlap,
        partial=partial,
        max_staleness=variant.get("max_staleness", 1),
        partial_early_stop=bool(variant.get("early_stop")),
    )
    config = DistillConfig(
        student=ModelSpec(path=f"random:{args.shape}"),
        teacher=TeacherSpec(path=f"random:{args.teacher_shape}"),
        data=DataSpec(path="random", answer_key=None),
        rollout=SamplingSpec(n=args.n, max_new_tokens=args.new_tokens, batch_size=rows, **sampling),
        objective=ObjectiveSpec(tis_cap=2.0 if overlap or partial else None),
        optim=OptimSpec(state_dtype=variant.get("state_dtype", "fp32"), fused=variant.get("fused")),
        run=RunSpec(out_dir=str(run_dir), name="bench", samples_per_step=0, steps=1000, report=False),
        prompts_per_step=args.prompts,
        micro_batch_tokens=variant.get("micro_batch_tokens", args.micro_batch_tokens),
        score_batch_tokens=args.score_batch_tokens,
        teacher_offload=bool(variant.get("teacher_offload")),
    )
    vocab = TOKENIZER_SIZE[args.shape]
    optimizer = build_optimizer(student.parameters(), config.optim)
    prompts = [Prompt(id=str(i), messages=[{"role": "user", "content": ""}]) for i in range(len(prompt_ids))]
    modules = teacher if isinstance(teacher, list) else [teacher]
    scorers = [LocalScorer(m, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab) for m in modules]
    routed = []  # one teacher: a list of one (config.teacher_entries()), every prompt its own
    entries = config.teacher_entries()
    for i, (module, scorer) in enumerate(zip(modules, scorers)):
        entry = entries[0]
        if len(modules) > 1:
            entry = TeacherEntry(
                name=f"t{i}",
                path=f"random:{args.teacher_shape}",
                offload=config.teacher_offload,
                temperature=config.objective.teacher_temperature,
                route=TeacherRoute(data_source=[f"part{i}"]),
            )
        routed.append(RoutedTeacher(entry=entry, teacher=Teacher(scorer=scorer, module=module, vocab=None)))
    rollout_model = rollout_generator = None
    if overlap:  # as `opd.train.overlap.overlap_generator` builds them, over the benchmark's own engine
        rollout_model = rollout_snapshot(student, autocast_dtype or torch.float32)
        rollout_generator = _engine(rollout_model, engine, args, rows, background=True)
    stream, ahead = rollout_ahead(config, rollout_model, rollout_generator)
    generator = _engine(student, engine, args, rows)
    return Trainer(
        config=config,
        models=TrainModels(
            student=student,
            tokenizer=IdTokenizer(pad_id(args.shape), eos_id(args.shape)),
            student_scorer=LocalScorer(student, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab),
            reference_scorer=None,
            vocab_size=vocab,
            teachers=routed,
            autocast_dtype=autocast_dtype,
        ),
        data=TrainData(
            prompts=prompts,
            prompt_ids=prompt_ids,
            sampler=PromptSampler(len(prompt_ids), config.prompts_per_step, seed=0),
            prompt_teacher=[i % len(modules) for i in range(len(prompt_ids))],
        ),
        engines=TrainEngines(generator, rollout_model, rollout_generator, ahead=ahead, stream=stream),
        optimization=TrainOptimization(optimizer, build_scheduler(optimizer, config.run.steps, config.optim)),
        run=RunState(run_dir, gpu_busy=GpuBusy.open(next(student.parameters()).device)),
    )


# ------------------------------------------------------------------------------------------------ memory


def _cuda_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.is_cuda)


def memory_breakdown(tr, trace: list[dict], start_bytes: int) -> dict:
    """Where one step's memory goes (GiB), from `opd_step`'s phase marks of that step and the resident tensors:
    resident at the step's start = student weights + AdamW state + teacher weights (when on the GPU) + the rest
    (rollout snapshot, compiled-graph and CUDA-graph pools, caches); then each phase's peak, and the gradients (what
    the forward/backward phase left allocated, freed by the optimizer step)."""
    out = {
        "resident_gib": start_bytes / GIB,
        "student_weights_gib": _cuda_bytes(tr.models.student.parameters()) / GIB,
        "adamw_state_gib": _cuda_bytes(t for s in tr.optimization.optimizer.state.values() for t in s.values()) / GIB,
        # the first teacher's weights, as before teachers were a list
        "teacher_weights_gib": _cuda_bytes(tr.models.teachers[0].teacher.module.parameters()) / GIB
        if tr.models.teachers and tr.models.teachers[0].teacher.module is not None
        else 0.0,
    }
    out["other_resident_gib"] = (
        out["resident_gib"] - out["student_weights_gib"] - out["adamw_state_gib"] - out["teacher_weights_gib"]
    )
    marks = {m["phase"]: m for m in trace}
    for phase in ("rollout", "scoring", "forward_backward", "optimizer_step"):
        if phase in marks:
            out[f"peak_{phase}_gib"] = marks[phase]["peak_gib"]
    if "forward_backward" in marks and "scoring" in marks:
        out["grads_gib"] = marks["forward_backward"]["allocated_gib"] - marks["scoring"]["allocated_gib"]
    return out


# ------------------------------------------------------------------------------------------------ our rows


def our_row(
    args,
    student,
    teacher,
    prompt_ids,
    engine: str,
    run_dir: Path,
    autocast_dtype,
    device,
    name: str,
    ckpt: str,
    compiled: bool,
) -> dict:
    from opd.compile_cache import persisted
    from opd.train.step import compiled_graphs, opd_step, warm_up

    variant = VARIANTS[name]
    row_ckpt = variant.get("ckpt", ckpt)
    if row_ckpt == "on":
        student.gradient_checkpointing_enable()
    offload = bool(variant.get("teacher_offload"))
    teachers = [teacher] + [
        _extra_teacher(args, device, seed=args.seed + 1 + i, compiled=compiled)
        for i in range(1, variant.get("teachers", 1))
    ]
    try:
        tr = build_trainer(
            args,
            student,
            teachers if len(teachers) > 1 else teacher,
            prompt_ids,
            engine,
            run_dir,
            autocast_dtype,
            variant,
        )
        if offload:  # after the scorer's head check: a forward of the compiled layers on CPU would compile for CPU
            for module in teachers:
                module.to("cpu")
        tr.models.activation_budget = 0.5 if row_ckpt == "selective" else None
        cuda = device.type == "cuda"
        steps: list[dict] = []
        tr.models.compiled_layers = compiled
        warm_up_s = warm_up_graphs = None
        cache_counts: dict = {}
        if tr.models.compiled_layers:  # as `opd distill` does before its first step, inside the compile cache
            sync(device)
            start_warm_up = time.perf_counter()
            # the engine itself, as `opd distill`'s warm-up sees it: behind BenchGenerator its decode step went
            # uncompiled until the steps (the paper step's timed step on an H100 compiled it at 48 rows)
            bench, tr.engines.generator = tr.engines.generator, tr.engines.generator.inner
            shapes = {k: v for k, v in vars(args).items() if k not in ("out", "repeat", "warmup", "profile", "seed")}
            parts = {"benchmark": "opd_step", "engine": engine, "variant": name, "ckpt": row_ckpt, **shapes}
            try:
                with persisted(parts, device) as cache:
                    warm_up_graphs = warm_up(tr, device)
                    sync(device)
            finally:
                tr.engines.generator = bench
            warm_up_s = time.perf_counter() - start_warm_up
            cache_counts = {
                "cache_loaded": cache.loaded,
                "cache_saved": cache.saved,
                "cache_hits": cache.fx_hits,
                "cache_misses": cache.fx_misses,
                "aot_hits": cache.aot_hits,
                "aot_misses": cache.aot_misses,
            }

        def step(warm: bool = False):
            tr.run.memory_trace = [] if cuda else None
            start = torch.cuda.memory_allocated(device) if cuda else 0
            graphs_before = compiled_graphs()
            # Shorter warm-up steps (--warmup-lengths) compile the same layers and kernels. With rollout.overlap the
            # background engine makes the next step's batch: short too, unless the next step is a timed one.
            engines = [tr.engines.generator]
            if tr.engines.rollout_generator is not None and sum(s["warm"] for s in steps) + 1 < args.warmup:
                engines.append(tr.engines.rollout_generator)
            timed_lengths = [engine.lengths for engine in engines]
            if warm and args.warmup_lengths:
                for engine in engines:
                    engine.lengths = parse_lengths(args.warmup_lengths)
            trained, stream = trained_lengths(tr)
            try:
                metrics = opd_step(tr)
            finally:
                for engine, lengths in zip(engines, timed_lengths):
                    engine.lengths = lengths
                if stream is not None:
                    del stream.next_batch  # the class's method again
            tr.run.step += 1
            # the tokens trained: with overlap or partial the step's rows do not come from its last engine call
            tokens = round(metrics["response_length"] * args.prompts * args.n)
            record = {
                "tokens": tokens,
                "metrics": metrics,
                "trace": tr.run.memory_trace,
                "start": start,
                "lengths": trained.get("lengths", list(tr.engines.generator.last_lengths)),
                "warm": warm,
                "new_graphs": compiled_graphs() - graphs_before,
            }
            steps.append(record)
            return tokens

        m = measure(step, device, warmup=args.warmup, repeat=args.repeat, warmup_fn=lambda: step(warm=True))
        profiles = profile_phases(step, device) if args.profile else None
        if profiles is not None:
            steps.pop()  # the profiled step is not a timed one
        timed = [s for s in steps if not s["warm"]]
        seconds = sum(m["all_seconds"])
        last = timed[-1]
        row = {
            "variant": name,
            "ckpt": row_ckpt,
            "tokens": sum(s["tokens"] for s in timed),
            "seconds": m["seconds"],
            "tokens_per_s": sum(s["tokens"] for s in timed) / seconds,
            "warmup_s": m["first_call_seconds"],
            "step_seconds": m["all_seconds"],
            # graphs torch.compile built: in `warm_up` (compiled layers), in the warm-up steps, in the timed steps
            "warm_up_layouts_s": warm_up_s,
            "warm_up_graphs": warm_up_graphs,
            "warm_step_graphs": sum(s["new_graphs"] for s in steps if s["warm"]),
            "timed_step_graphs": sum(s["new_graphs"] for s in timed),
            **cache_counts,  # the compile cache (opd.compile_cache) over the warm-up: artefacts, inductor hits / misses
            "peak_gib": m["peak_gib"],
        }
        if cuda:  # the phase marks reset the peak counter: the row's peak is the largest phase peak
            row["peak_gib"] = max([row["peak_gib"]] + [mk["peak_gib"] for s in steps for mk in s["trace"]])
            row.update(memory_breakdown(tr, last["trace"], last["start"]))
        row.update(
            {
                k.split("/")[1] + "_s": v
                for k, v in last["metrics"].items()
                if k.startswith("time/") and k != "time/step"
            }
        )
        row.update({k: v for k, v in last["metrics"].items() if k.endswith("/token_frac")})  # several teachers
        for key in ("policy_lag", "is_weight_mean", "is_weight_max", "is_weight_capped_frac"):
            if key in last["metrics"]:
                row[key] = last["metrics"][key]
        row["last_lengths"] = last["lengths"]
        if profiles is not None:
            row["profile"] = profiles
        row["step_tokens"] = [s["tokens"] for s in steps]  # warm-up steps first
        busy = [s["metrics"]["gpu/busy_frac"] for s in timed if "gpu/busy_frac" in s["metrics"]]
        if busy:  # CUDA with NVML: the share of the timed steps' wall time a kernel ran
            row["gpu_busy"] = sum(busy) / len(busy)
        tr = None  # frees the trainer before the collect (rebound, not `del`: the closure `step` reads this name)
        gc.collect()
        return row
    finally:
        if row_ckpt == "on":
            student.gradient_checkpointing_disable()
        if offload:
            teacher.to(device)
        del teachers[1:]
        gc.collect()


def profile_phases(step, device: torch.device) -> dict[str, dict]:
    """One step with its scoring and its update each under torch.profiler (`common.profiled`): per phase the wall
    seconds, the kernel seconds (CUDA) and the table of its top kernels or ops."""
    import opd.train.step as step_module

    found: dict[str, dict] = {}
    originals = {name: getattr(step_module, name) for name in ("score_rollouts", "update_student")}

    def wrapped(name, function):
        def run(*args, **kwargs):
            out = profiled(lambda: function(*args, **kwargs), device, row_limit=15)
            found[name] = {k: v for k, v in out.items() if k != "result"}
            return out["result"]

        return run

    for name, function in originals.items():
        setattr(step_module, name, wrapped(name, function))
    try:
        step()
    finally:
        for name, function in originals.items():
            setattr(step_module, name, function)
    return found


def _extra_teacher(args, device, *, seed: int, compiled: bool):
    """Another teacher of --teacher-shape with its own random weights, built as the first one is (bf16 on CUDA)."""
    module = build_model(
        args.teacher_shape, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device, seed=seed
    ).requires_grad_(False)
    module.set_attn_implementation(attention_name(args.attn, device))
    if compiled:
        from opd.models import compile_layers

        compile_layers(module, True)
    return module


# ------------------------------------------------------------------------------------------------ TRL rows


def word_tokenizer(shape: str):
    """A tokenizer whose word `t<i>` is id i, for every id of the shape's tokenizer size; EOS and pad as the models'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TOKENIZER_SIZE[shape])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=f"t{eos_id(shape)}", pad_token=f"t{pad_id(shape)}", padding_side="left"
    )


def trl_row(which: str, args, device, prompt_ids: list[list[int]]) -> dict:
    """One real TRL trainer (`distill` = `trl.DistillationTrainer`, `gkd` = `trl.experimental.gkd.GKDTrainer`) with
    its `defaults` or `fastest` speed settings (module docstring), run for warmup + repeat optimizer steps by its own
    `train()` loop; a callback times each step and a subclass counts the generated tokens."""
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback

    trainer_name, setting = which.split(":")
    transformers.logging.set_verbosity_error()
    cuda = device.type == "cuda"
    sequences = args.prompts * args.n
    micro = sequences if setting == "fastest" else min(8, sequences)
    if sequences % micro:
        raise ValueError(f"{sequences} sequences do not split into micro-batches of {micro}")
    student = build_model(args.shape, dtype=torch.float32, device=device, seed=args.seed)
    teacher = build_model(
        args.teacher_shape, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=args.seed + 1
    ).requires_grad_(False)
    tokenizer = word_tokenizer(args.shape)
    texts = [" ".join(f"t{i}" for i in ids) for ids in prompt_ids for _ in range(args.n)]
    counted: list[int] = []
    times: list[float] = []
    per_step: list[int] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, *_, **__):
            reset_memory(device)

        def on_step_begin(self, *_, **__):
            sync(device)
            self.start, self.counted = time.perf_counter(), len(counted)

        def on_step_end(self, *_, **__):
            sync(device)
            times.append(time.perf_counter() - self.start)
            per_step.append(sum(counted[self.counted :]))

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="opd-bench-trl-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=sequences // micro,
        max_steps=args.trl_warmup + args.trl_repeat,
        learning_rate=1e-6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1000,
        seed=args.seed,
        dataloader_num_workers=0,
        use_cpu=not cuda,
    )
    if not cuda:
        common["bf16"] = False  # our CPU rows run float32 too
    if setting == "fastest":
        common["gradient_checkpointing"] = False
    if trainer_name == "distill":
        from trl import DistillationConfig, DistillationTrainer

        class Counted(DistillationTrainer):
            def _generate_and_score_completions(self, inputs):
                out = super()._generate_and_score_completions(inputs)
                counted.append(int(out["completion_mask"].sum()))
                return out

        config = DistillationConfig(
            **common, max_completion_length=args.new_tokens, temperature=1.0, top_k=0, top_p=1.0, beta=1.0
        )
        trainer = Counted(
            model=student,
            teacher_model=teacher,
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            callbacks=[Timer()],
        )
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        class Counted(GKDTrainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = super().training_step(model, inputs, num_items_in_batch)
                counted.append(int((inputs["labels"] != -100).sum()))  # the generated completion, EOS included
                return loss

        # Prompts as ids (the collator's pre-tokenized path): one placeholder completion token, replaced on-policy.
        ids = [p for p in prompt_ids for _ in range(args.n)]
        data = Dataset.from_dict(
            {
                "prompt": texts,
                "input_ids": [p + [eos_id(args.shape)] for p in ids],
                "completion_mask": [[0] * len(p) + [1] for p in ids],
            }
        )
        config = GKDConfig(
            **common,
            max_new_tokens=args.new_tokens,
            temperature=1.0,
            lmbda=1.0,
            beta=1.0,
            max_length=args.prompt_len + args.new_tokens + 1,
        )
        trainer = Counted(
            model=student,
            teacher_model=teacher,
            args=config,
            processing_class=tokenizer,
            train_dataset=data,
            callbacks=[Timer()],
        )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its end-of-training dict of logs
    trainer.train()
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    checkpointing = bool(student.is_gradient_checkpointing)  # what TRL did with the model, not what was asked
    del trainer, student, teacher
    gc.collect()
    timed, tokens = times[args.trl_warmup :], per_step[args.trl_warmup :]
    row = {
        "setting": setting,
        "tokens": sum(tokens),
        "seconds": statistics.median(timed),
        "tokens_per_s": sum(tokens) / sum(timed),
        "step_seconds": timed,
        "warmup_s": times[0],
        "micro_batch": micro,
        "gradient_checkpointing": checkpointing,
    }
    row["peak_gib"] = peak if peak is not None else peak_gib(device)
    return row


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--teacher-shape", default="qwen3-1.7b", choices=sorted(SHAPES), help="teacher shape")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="max new tokens per sample")
    parser.add_argument(
        "--lengths",
        default=None,
        help="force each response to end at a drawn length: "
        "lognormal:mean=M,cap=C[,sigma=S] or fixed:N (common.parse_lengths); default: no forcing",
    )
    parser.add_argument(
        "--warmup-lengths",
        default=None,
        help="lengths of our warm-up steps (same forms as --lengths; default: those of the timed steps)",
    )
    parser.add_argument(
        "--rollout-rows",
        type=int,
        default=None,
        help="rows the engine decodes together (default: all of a step's sequences)",
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="our update's micro-batch budget")
    parser.add_argument("--score-batch-tokens", type=int, default=32768, help="our scoring forward budget")
    parser.add_argument("--engines", default="static_engine", help="our engines: static_engine, torch_engine")
    parser.add_argument("--variants", default="default", help=f"our rows, comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument(
        "--ckpt",
        default="auto",
        choices=["auto", "on", "off", "selective"],
        help="gradient checkpointing of our student: on (every layer), selective (compiled layers "
        "keep half their activations), off; auto: as `opd distill` (CUDA: selective when "
        "compiled, else on; CPU: off)",
    )
    parser.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile the decoder layers of our student and teacher (auto: on for CUDA)",
    )
    parser.add_argument(
        "--attn",
        default="auto",
        help="attention of our rows: auto (as `opd distill`: opd_varlen "
        "on CUDA, else sdpa), sdpa, opd_varlen; TRL rows use sdpa",
    )
    parser.add_argument("--trl", default=",".join(TRL_ROWS), help=f"TRL rows, comma-separated: {', '.join(TRL_ROWS)}")
    parser.add_argument("--skip-trl", action="store_true", help="no TRL rows")
    parser.add_argument("--trl-warmup", type=int, default=1, help="untimed TRL steps (its first compiles nothing)")
    parser.add_argument("--trl-repeat", type=int, default=2, help="timed TRL steps")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more step after the timed ones, its scoring and update under torch.profiler (module docstring)",
    )
    parser.add_argument(
        "--paper",
        action="store_true",
        help="the paper's regime: qwen3-1.7b ← qwen3-4b, 64 prompts "
        "× 4, lengths lognormal:mean=1500,cap=7168 (warm-up step: mean=200,cap=512), 64 rows per "
        "rollout chunk, one warm-up and one timed step, no TRL rows (explicit flags still win)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--paper" in argv:  # defaults of the paper regime, before the explicit flags
        argv = [
            "--shape",
            "qwen3-1.7b",
            "--teacher-shape",
            "qwen3-4b",
            "--prompts",
            "64",
            "--new-tokens",
            "7168",
            "--lengths",
            "lognormal:mean=1500,cap=7168",
            "--warmup-lengths",
            "lognormal:mean=200,cap=512",
            "--rollout-rows",
            "64",
            "--skip-trl",
            "--warmup",
            "1",
            "--repeat",
            "1",
        ] + argv
    args = parser.parse_args(argv)
    if SHAPES[args.shape]["vocab_size"] != SHAPES[args.teacher_shape]["vocab_size"]:
        raise SystemExit("--shape and --teacher-shape must share a vocabulary (tiny with tiny, qwen3 with qwen3)")
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    for spec in (args.lengths, args.warmup_lengths):
        try:
            spec and parse_lengths(spec)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    if args.warmup_lengths and not args.lengths:
        raise SystemExit("--warmup-lengths needs --lengths (the timed steps' lengths)")
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    autocast_dtype = torch.bfloat16 if cuda else None
    g = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(3, TOKENIZER_SIZE[args.shape], (args.prompts, args.prompt_len), generator=g).tolist()
    report = Report(
        "opd_step",
        args,
        device,
        shape=args.shape,
        teacher_shape=args.teacher_shape,
        sequences=args.prompts * args.n,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        lengths=args.lengths,
        precision="fp32 student + bf16 autocast, bf16 teacher" if cuda else "fp32",
    )
    run_dir = Path(tempfile.mkdtemp(prefix="opd-bench-"))

    trl_rows = [] if args.skip_trl else [r for r in args.trl.split(",") if r]
    for which in trl_rows:  # first, each with its own fresh models (freed before our rows build theirs)
        if which not in TRL_ROWS:
            raise SystemExit(f"--trl: unknown row {which!r}; choose from {', '.join(TRL_ROWS)}")
        report.run_row(f"trl_{which.replace(':', '[')}]", lambda which=which: trl_row(which, args, device, prompt_ids))

    student = build_model(args.shape, dtype=torch.float32, device=device, seed=args.seed)
    teacher = build_model(
        args.teacher_shape, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=args.seed + 1
    ).requires_grad_(False)
    attn = attention_name(args.attn, device)
    student.set_attn_implementation(attn)
    teacher.set_attn_implementation(attn)
    report.data["attn"] = attn
    compiled = args.compile == "on" or (args.compile == "auto" and cuda)
    if compiled:
        from opd.models import compile_layers

        compile_layers(student, True)
        compile_layers(teacher, True)
    ckpt = args.ckpt if args.ckpt != "auto" else ("off" if not cuda else "selective" if compiled else "on")
    flops, bandwidth = peaks(device, args)
    for engine in [e for e in args.engines.split(",") if e]:
        for name in args.variants.split(","):
            label = f"opd_step[{engine}]" if name == "default" else f"opd_step[{engine}, {name}]"

            def ours(engine=engine, name=name):
                row = our_row(
                    args, student, teacher, prompt_ids, engine, run_dir, autocast_dtype, device, name, ckpt, compiled
                )
                lengths = row.pop("last_lengths")
                if flops and bandwidth:
                    bound = opd_step_bound(
                        student_params=param_count(student),
                        teacher_params=param_count(teacher),
                        student_weight_bytes=param_count(student) * 2,
                        kv_bytes_per_token=kv_bytes_per_token(args.shape),
                        prompt_lengths=[args.prompt_len] * len(lengths),
                        response_lengths=lengths,
                        peak_flops=flops,
                        bandwidth=bandwidth,
                    )
                    row.update({f"bound_{k}": v for k, v in bound.items()}, vs_bound=row["seconds"] / bound["total_s"])
                    row["bound_tokens"] = sum(lengths)  # the response tokens the bound counts: the trained rows'
                return row

            report.run_row(label, ours)

    rows = report.data["rows"]
    trl = [r for r in rows if r["name"].startswith("trl_") and r.get("tokens_per_s")]
    fastest = max(trl, key=lambda r: r["tokens_per_s"], default=None)
    leanest = min(trl, key=lambda r: r["peak_gib"], default=None)
    for r in rows:
        if fastest and r.get("tokens_per_s"):
            r["speedup"] = r["tokens_per_s"] / fastest["tokens_per_s"]
        if leanest and r.get("peak_gib"):
            r["memory_vs_trl"] = r["peak_gib"] / leanest["peak_gib"]
    columns = [
        ("row", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("× fastest TRL", "speedup", ".1f"),
        ("step s", "seconds", ".2f"),
        ("rollout s", "rollout_s", ".2f"),
        ("rollout wait s", "rollout_wait_s", ".2f"),
        ("student s", "student_s", ".2f"),
        ("teacher s", "teacher_s", ".2f"),
        ("update s", "update_s", ".2f"),
        ("GPU busy", "gpu_busy", ".0%"),
        ("peak GiB", "peak_gib", ".1f"),
        ("memory / leanest TRL", "memory_vs_trl", ".2f"),
        ("bound s", "bound_total_s", ".3g"),
        ("step / bound", "vs_bound", ".1f"),
    ]
    notes = [
        f"student {args.shape} (random, fp32 master weights{' + bf16 autocast' if cuda else ''}), teacher "
        f"{args.teacher_shape}; {args.prompts} prompts × n={args.n} = {args.prompts * args.n} sequences, prompt "
        f"{args.prompt_len} tokens, ≤ {args.new_tokens} new tokens"
        + (f", lengths {parse_lengths(args.lengths)} forced per row" if args.lengths else "")
        + "; peak GiB includes both models' weights and the row's optimizer state"
    ]
    if fastest:
        notes.append(f"× fastest TRL: against {fastest['name']}; memory / leanest TRL: against {leanest['name']}")
    for r in rows:
        if "bound_total_s" in r:
            notes.append(
                f"{r['name']}: bound {r['bound_total_s']:.3g} s = decode {r['bound_decode_s']:.3g} + teacher "
                f"{r['bound_teacher_s']:.3g} + student {r['bound_student_s']:.3g} + update "
                f"{r['bound_update_s']:.3g}; the step took {r['vs_bound']:.2f}× that"
            )
    if any("bound_total_s" in r for r in rows):
        notes.append(
            "bound (common.opd_step_bound): decode at the memory bandwidth (weights once per sequential step "
            "+ every token's KV reads) + 2·params FLOPs of teacher and student scoring + 6·params FLOPs of the "
            "update per position, at the device's dense bf16 peak, over the rows the step trains (with "
            "rollout.partial a stream need not wait for its longest row within a step, so its decode term is the "
            "synchronous step's, not a bound of the stream's)"
        )
    memory_rows = [r for r in rows if "resident_gib" in r]
    if memory_rows:
        report.data["memory_table"] = markdown_table(
            memory_rows,
            [
                ("row", "name", ""),
                ("resident", "resident_gib", ".2f"),
                ("student w", "student_weights_gib", ".2f"),
                ("AdamW state", "adamw_state_gib", ".2f"),
                ("teacher w", "teacher_weights_gib", ".2f"),
                ("other", "other_resident_gib", ".2f"),
                ("grads", "grads_gib", ".2f"),
                ("peak rollout", "peak_rollout_gib", ".2f"),
                ("peak scoring", "peak_scoring_gib", ".2f"),
                ("peak fwd/bwd", "peak_forward_backward_gib", ".2f"),
                ("peak optim", "peak_optimizer_step_gib", ".2f"),
            ],
        )
        notes.append(
            "where the memory goes (GiB; resident = allocated at the start of the last timed step; peaks are "
            "allocated bytes within each phase of that step):\n" + report.data["memory_table"]
        )
    data = report.finish(columns, notes)
    for r in rows:
        for phase, found in r.get("profile", {}).items():
            kernel = "" if found["kernel_s"] is None else f", kernels {found['kernel_s']:.3f} s"
            print(f"\n{r['name']}: {phase} of one more step under the profiler: wall {found['wall_s']:.3f} s{kernel}")
            print(found["table"])
    return data


if __name__ == "__main__":
    main()
