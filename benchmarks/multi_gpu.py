"""Several GPUs (issue 17): the pieces `benchmarks/run_multi_gpu.sh` runs, each torchrun-aware (rank 0 prints).

    python benchmarks/multi_gpu.py run distill key=value ...      # `opd distill` (the real CLI) with greedy rollouts
    torchrun --nproc_per_node N benchmarks/multi_gpu.py run distill key=value ...
    python benchmarks/multi_gpu.py compare REF RUN ... [--initial DIR] [--atol A | --rel R]
    torchrun --nproc_per_node N benchmarks/multi_gpu.py scale --shape qwen3-0.6b --teacher-shape qwen3-1.7b --out F
    python benchmarks/multi_gpu.py table F                         # the scaling table of the rows in F so far

`run`: `python -m opd.cli …` with one test hook: the rollout engine the registry returns decodes greedily whatever
`rollout.temperature` says (the config requires a temperature > 0, and sampled rollouts necessarily differ between
world sizes: each rank samples with its own seed). Greedy rollouts depend only on the prompts and the weights, so runs
at N = 1, 2, 4, 8 on the same global batch train on the same rollouts and — the update being the same global
token-mean — end at the same weights up to float reduction order. Prints `engine: <class>` once per rank. Other
commands (`opd sft`) run unchanged.

`compare`: the newest checkpoint of each RUN against REF's: max |Δ| over all weights, the largest relative difference
of the per-step metrics that must agree (pg_loss, grad_norm, response_length), and with `--initial` how far REF moved
(max |w_REF - w_initial|: equality means something only when that is well above the tolerance). Exit 1 when a run is
outside the tolerance: `--atol` on the weights (float32 runs), or `--rel` on max |Δ| / movement (bf16 autocast runs).

`scale`: weak scaling of one OPD step (`opd.train.step.opd_step` on a `Trainer` assembled as `setup` assembles it at N
ranks: FSDP2 student, float32 master weights + bf16 autocast on CUDA, full activation checkpointing as `opd distill`
turns on for an uncompiled CUDA student, the registry's engine over the gathered weights), random-weight Qwen3 shapes
(`common.SHAPES`), `--prompts-per-rank` × N prompts per step, responses ragged with `--lengths` (forced per row, each
rank drawing its own: the imbalance between ranks is part of what is measured). The teacher is replicated (a bf16 copy
per rank) or served (`--teacher-url`: one `opd serve-teacher` on its own GPU; `--teacher-gpus` says how many GPUs the
servers take, counted in tokens/s per GPU). Per row: median step time (the slowest rank's), global response tokens/s,
tokens/s per GPU, the weak-scaling efficiency against the N = 1 row of the same setup, phase times (mean over ranks)
and per-GPU peak memory (the largest rank's, CUDA allocated bytes, with each phase's peak). The student and the
compiled layers: not compiled at any N (`opd distill` compiles under FSDP2 only when `compile=true`), so the rows
compare like with like.

Omitted: the TRL comparison (`opd_step.py` has it for one GPU); sharding the teacher; several hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    SHAPES,
    TOKENIZER_SIZE,
    attention_name,
    build_model,
    eos_id,
    markdown_table,
    pad_id,
    parse_lengths,
    resolve_device,
    sync,
)

GIB = 2**30


# ------------------------------------------------------------------------------------------------ run


class Greedy:
    """The real engine, decoding greedily whatever temperature it is asked for (the equivalence runs' only hook)."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompt_ids, params, **kwargs):
        return self.inner.generate(prompt_ids, replace(params, temperature=0.0), **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install_greedy_rollouts() -> None:
    """Wrap `opd.rollout.make_generator` (what `opd.recipes.distill.setup` calls): every engine decodes greedily."""
    import opd.rollout as rollout

    make = rollout.make_generator

    def greedy(*args, **kwargs):
        inner = make(*args, **kwargs)
        print(f"engine: {type(inner).__name__}", flush=True)
        return Greedy(inner)

    rollout.make_generator = greedy


def run_cli(argv: list[str]) -> None:
    install_greedy_rollouts()
    from opd.cli import main

    sys.argv = ["opd", *argv]
    main()


# ------------------------------------------------------------------------------------------------ compare


def _final_weights(run_dir: Path) -> tuple[dict[str, torch.Tensor], int | None]:
    """(weights of the newest verified checkpoint, the world size that wrote it)."""
    from safetensors.torch import load_file

    from opd.train.checkpoint import latest_checkpoint, load_trainer_state

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise SystemExit(f"{run_dir}: no complete checkpoint")
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights, load_trainer_state(checkpoint).get("world_size")


def _metrics(run_dir: Path) -> dict[int, dict]:
    from opd.io import read_jsonl

    path = run_dir / "metrics.jsonl"
    return {m["step"]: m for m in read_jsonl(path) if "step" in m} if path.is_file() else {}


METRICS = ("pg_loss", "grad_norm", "response_length", "loss")


def compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="multi_gpu.py compare", description="final weights of runs against REF")
    parser.add_argument("reference", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--initial", type=Path, default=None, help="the starting model directory (movement)")
    parser.add_argument("--atol", type=float, default=None, help="largest max |Δ weight| accepted")
    parser.add_argument("--rel", type=float, default=None, help="largest max |Δ weight| / movement accepted")
    args = parser.parse_args(argv)
    reference, ref_world = _final_weights(args.reference)
    movement = None
    if args.initial is not None:
        from safetensors.torch import load_file

        initial: dict[str, torch.Tensor] = {}
        for file in sorted(args.initial.glob("*.safetensors")):
            initial.update(load_file(str(file)))
        movement = max(
            float((reference[k].float() - initial[k].float()).abs().max()) for k in reference if k in initial
        )
    ref_metrics = _metrics(args.reference)
    rows, ok = [], True
    for run in args.runs:
        weights, world = _final_weights(run)
        if weights.keys() != reference.keys():
            raise SystemExit(f"{run}: other weight names than {args.reference}")
        delta = max(float((weights[k].float() - reference[k].float()).abs().max()) for k in reference)
        metrics = _metrics(run)
        rel = 0.0
        for step, m in metrics.items():
            for key in METRICS:
                a, b = m.get(key), ref_metrics.get(step, {}).get(key)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    rel = max(rel, abs(a - b) / max(abs(b), 1e-12))
        ratio = delta / movement if movement else None
        within = (args.atol is None or delta <= args.atol) and (
            args.rel is None or (ratio is not None and ratio <= args.rel)
        )
        ok &= within
        rows.append(
            {
                "run": str(run),
                "world_size": world,
                "steps": len(metrics),
                "delta": delta,
                "ratio": ratio,
                "metric_rel": rel,
                "within": "yes" if within else "NO",
            }
        )
    tolerance = (
        ", ".join(
            t
            for t in (
                args.atol is not None and f"max |Δ| ≤ {args.atol:g}",
                args.rel is not None and f"max |Δ| / movement ≤ {args.rel:g}",
            )
            if t
        )
        or "none"
    )
    print(
        f"\nreference {args.reference} (world size {ref_world}); movement max |w - w0| = "
        f"{'—' if movement is None else f'{movement:.3g}'}; tolerance: {tolerance}"
    )
    print(
        markdown_table(
            rows,
            [
                ("run", "run", ""),
                ("N", "world_size", ""),
                ("steps", "steps", ""),
                ("max |Δ weight|", "delta", ".3g"),
                ("/ movement", "ratio", ".3g"),
                ("max rel Δ metrics", "metric_rel", ".3g"),
                ("within", "within", ""),
            ],
        ),
        flush=True,
    )
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------ scale


def _max_over_ranks(value: float, info) -> float:
    if info.world_size == 1:
        return value
    import torch.distributed as dist

    out = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())


def _gather(value, info) -> list:
    if info.world_size == 1:
        return [value]
    import torch.distributed as dist

    out = [None] * info.world_size
    dist.all_gather_object(out, value)
    return out


def build_trainer(args, info, device: torch.device):
    """A `Trainer` as `opd.recipes.distill.setup` builds it at `info.world_size` ranks, over random-weight models."""
    from opd.config import DataSpec, DistillConfig, ModelSpec, RunSpec, SamplingSpec, TeacherSpec
    from opd.rollout import make_generator
    from opd.teacher.local import LocalScorer
    from opd.teacher.registry import RoutedTeacher, Teacher
    from opd.train.distributed import gathered, shard_model
    from opd.train.optim import build_optimizer, build_scheduler
    from opd.train.sampler import PromptSampler
    from opd.train.state import RunState, TrainData, TrainEngines, Trainer, TrainModels, TrainOptimization
    from opd.types import Prompt
    from opd_step import BenchGenerator, IdTokenizer

    cuda = device.type == "cuda"
    world = info.world_size
    prompts = args.prompts_per_rank * world
    vocab = TOKENIZER_SIZE[args.shape]
    attn = attention_name(args.attn, device)
    student = build_model(args.shape, dtype=torch.float32, device=device, seed=args.seed, attn_implementation=attn)
    teacher, teacher_scorer = None, None
    if args.teacher_url:
        from opd.teacher.client import RemoteScorer

        teacher_scorer = RemoteScorer(args.teacher_url.split(","))
    else:
        teacher = build_model(
            args.teacher_shape,
            dtype=torch.bfloat16 if cuda else torch.float32,
            device=device,
            seed=args.seed + 1,
            attn_implementation=attn,
        ).requires_grad_(False)
        teacher_scorer = LocalScorer(teacher, max_tokens_per_batch=args.score_batch_tokens, vocab_size=vocab)
    shard_model(student, info)  # same seed on every rank: each keeps its shard of the same weights
    if cuda:  # as `opd distill` for an uncompiled CUDA student
        student.gradient_checkpointing_enable()
    with gathered(student, info):
        student_scorer = LocalScorer(
            student, max_tokens_per_batch=args.score_batch_tokens, vocab_size=vocab, through_root=world > 1
        )
    rows = args.rollout_rows or args.prompts_per_rank * args.samples
    config = DistillConfig(
        student=ModelSpec(path=f"random:{args.shape}"),
        teacher=TeacherSpec(url=args.teacher_url)
        if args.teacher_url
        else TeacherSpec(path=f"random:{args.teacher_shape}"),
        data=DataSpec(path="random", answer_key=None),
        rollout=SamplingSpec(n=args.samples, max_new_tokens=args.new_tokens, batch_size=rows, engine=args.engine),
        run=RunSpec(out_dir="unused", name="bench", samples_per_step=0, steps=1000, report=False),
        prompts_per_step=prompts,
        micro_batch_tokens=args.micro_batch_tokens,
        score_batch_tokens=args.score_batch_tokens,
    )
    optimizer = build_optimizer(student.parameters(), config.optim)
    tokenizer = IdTokenizer(pad_id(args.shape), eos_id(args.shape))
    engine = make_generator(student, tokenizer, engine=args.engine, max_batch_size=rows, vocab_size=vocab)
    lengths = parse_lengths(args.lengths) if args.lengths else None
    g = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(3, vocab, (prompts, args.prompt_len), generator=g).tolist()
    # one teacher: a list of one (config.teacher_entries()), every prompt its own
    routed = RoutedTeacher(config.teacher_entries()[0], Teacher(scorer=teacher_scorer, module=teacher, vocab=None))
    generator = BenchGenerator(engine, eos=eos_id(args.shape), cap=args.new_tokens, lengths=lengths)
    return Trainer(
        config=config,
        models=TrainModels(
            student=student,
            tokenizer=tokenizer,
            student_scorer=student_scorer,
            reference_scorer=None,
            vocab_size=vocab,
            teachers=[routed],
            autocast_dtype=torch.bfloat16 if cuda else None,
        ),
        data=TrainData(
            prompts=[Prompt(id=str(i), messages=[{"role": "user", "content": ""}]) for i in range(prompts)],
            prompt_ids=prompt_ids,
            sampler=PromptSampler(prompts, prompts, seed=0),
            prompt_teacher=[0] * prompts,
        ),
        engines=TrainEngines(generator),
        optimization=TrainOptimization(optimizer, build_scheduler(optimizer, config.run.steps, config.optim)),
        run=RunState(Path("unused"), dist=info),
    )


def scale_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multi_gpu.py scale", description="weak scaling of one OPD step")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES), help="student shape")
    parser.add_argument("--teacher-shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="auto", help="auto, cuda, cpu (torchrun: the rank's device)")
    parser.add_argument("--prompts-per-rank", type=int, default=8, help="prompts per step per rank (weak scaling)")
    parser.add_argument(
        "--samples",
        type=int,
        default=4,
        help="samples per prompt (rollout.n; not --n, which "
        "torchrun's own parser would take as an abbreviation of its options)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024, help="max new tokens per sample")
    parser.add_argument(
        "--lengths",
        default="lognormal:mean=400,cap=1024",
        help="ragged response lengths, forced per row (common.parse_lengths); 'none' = no forcing",
    )
    parser.add_argument("--rollout-rows", type=int, default=None, help="engine rows (default: a rank's sequences)")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--score-batch-tokens", type=int, default=32768)
    parser.add_argument("--engine", default="auto", help="rollout engine (opd.rollout.registry): auto, static, torch")
    parser.add_argument("--attn", default="auto", help="auto (opd_varlen on CUDA, as opd distill), sdpa, opd_varlen")
    parser.add_argument("--teacher-url", default=None, help="served teacher(s), comma-separated; default: replicated")
    parser.add_argument(
        "--teacher-gpus",
        type=int,
        default=None,
        help="GPUs the served teacher takes (default 1 with --teacher-url, else 0)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default=None, help="row group name (default: shapes and teacher placement)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/benchmarks/multi_gpu_scale.json"),
        help="JSON file the row is added to (rows of other world sizes are kept)",
    )
    return parser


def scale(argv: list[str]) -> dict | None:
    from opd.train.distributed import destroy_distributed, init_distributed
    from opd.train.step import opd_step

    args = scale_parser().parse_args(argv)
    if args.lengths == "none":
        args.lengths = None
    if SHAPES[args.shape]["vocab_size"] != SHAPES[args.teacher_shape]["vocab_size"]:
        raise SystemExit("--shape and --teacher-shape must share a vocabulary")
    info = init_distributed()
    device = info.device or resolve_device(args.device)
    cuda = device.type == "cuda"
    if cuda and info.world_size == 1:
        torch.cuda.set_device(device.index or 0)  # `resolve_device` may say plain "cuda"
    tr = build_trainer(args, info, device)
    times, tokens, traces = [], [], []
    for index in range(args.warmup + args.repeat):
        tr.run.memory_trace = [] if cuda else None
        sync(device)
        start = time.perf_counter()
        metrics = opd_step(tr)
        sync(device)
        seconds = _max_over_ranks(time.perf_counter() - start, info)
        tr.run.step += 1
        step_tokens = sum(_gather(sum(tr.engines.generator.last_lengths), info))
        if index >= args.warmup:
            times.append(seconds)
            tokens.append(step_tokens)
            traces.append(tr.run.memory_trace or [])
    phases = {f"{k.split('/')[1]}_s": v for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
    peaks = {}
    for phase in ("rollout", "scoring", "forward_backward", "optimizer_step"):
        local = max([m["peak_gib"] for trace in traces for m in trace if m["phase"] == phase], default=None)
        per_rank = [p for p in _gather(local, info) if p is not None]
        if per_rank:
            peaks[f"peak_{phase}_gib"] = max(per_rank)
    world = info.world_size
    served = bool(args.teacher_url)
    gpus = world + (args.teacher_gpus if args.teacher_gpus is not None else int(served))
    step_s = statistics.median(times)
    row = {
        "label": args.label or f"{args.shape} ← {args.teacher_shape} ({'served' if served else 'replicated'})",
        "world_size": world,
        "gpus": gpus,
        "teacher": "served" if served else "replicated",
        "prompts_per_step": args.prompts_per_rank * world,
        "sequences": args.prompts_per_rank * world * args.samples,
        "step_s": step_s,
        "step_seconds": times,
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / sum(times),
        "lengths": args.lengths,
        "new_tokens": args.new_tokens,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        **phases,
        **peaks,
    }
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / gpus
    if peaks:
        row["peak_gib"] = max(peaks.values())
    result = None
    if info.is_main:
        result = add_row(args.out, row, argv)
    destroy_distributed(info)
    return result


def add_row(path: Path, row: dict, argv: list[str]) -> dict:
    """Add `row` to the JSON file (replacing the row of the same label and world size), print the table."""
    import datetime

    from opd.io import atomic_write_json

    data = json.loads(path.read_text()) if path.is_file() else {"benchmark": "multi_gpu_scale", "rows": []}
    row = {
        **row,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "multi_gpu.py scale " + " ".join(argv),
        "torch": torch.__version__,
    }
    data["rows"] = [r for r in data["rows"] if (r["label"], r["world_size"]) != (row["label"], row["world_size"])] + [
        row
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, data)
    print(table(data), flush=True)
    return data


def table(data: dict) -> str:
    """Markdown table of the rows, by group then world size; efficiency = tokens/s per GPU / the group's N = 1 row's."""
    rows = sorted(data["rows"], key=lambda r: (r["label"], r["world_size"]))
    base = {r["label"]: r["tokens_per_s_per_gpu"] for r in rows if r["world_size"] == 1}
    for r in rows:
        r["efficiency"] = r["tokens_per_s_per_gpu"] / base[r["label"]] if r["label"] in base else None
    return markdown_table(
        rows,
        [
            ("setup", "label", ""),
            ("N", "world_size", ""),
            ("GPUs", "gpus", ""),
            ("seqs/step", "sequences", ""),
            ("step s", "step_s", ".2f"),
            ("tokens/s", "tokens_per_s", ",.0f"),
            ("tok/s/GPU", "tokens_per_s_per_gpu", ",.0f"),
            ("efficiency", "efficiency", ".2f"),
            ("rollout s", "rollout_s", ".2f"),
            ("student s", "student_s", ".2f"),
            ("teacher s", "teacher_s", ".2f"),
            ("update s", "update_s", ".2f"),
            ("peak GiB/GPU", "peak_gib", ".1f"),
            ("peak rollout", "peak_rollout_gib", ".1f"),
            ("peak fwd/bwd", "peak_forward_backward_gib", ".1f"),
        ],
    )


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "run":
        return run_cli(rest)
    if command == "compare":
        sys.exit(compare(rest))
    if command == "scale":
        return scale(rest)
    if command == "table":
        if rest[:1] in (["-h"], ["--help"]):
            print("usage: multi_gpu.py table RESULT.json [RESULT.json …]: the table of saved scale results")
            return None
        for path in rest:
            print(table(json.loads(Path(path).read_text())))
        return None
    usage = "usage: multi_gpu.py run|compare|scale|table … (see the module docstring)"
    if command in ("-h", "--help"):
        print(usage, __doc__, sep="\n\n")
        return None
    raise SystemExit(usage)


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a `scale` rank: leave as `opd` itself does (see exit_process)
        from opd.train.distributed import exit_process

        exit_process(0)
