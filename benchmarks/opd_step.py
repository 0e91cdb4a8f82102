"""The whole OPD step: our `opd.train.opd.opd_step` against a faithful re-creation of TRL's GKD on-policy loop.

    python benchmarks/opd_step.py --shape qwen3-0.6b --teacher-shape qwen3-1.7b --prompts 8 --n 4 --new-tokens 256
    python benchmarks/opd_step.py --shape tiny --teacher-shape tiny --device cpu --prompts 2 --n 2 --new-tokens 8

Ours: a `Trainer` assembled like `opd.train.opd.setup` builds it (same optimizer, scheduler, sampler, scorers,
precision: float32 student weights + bf16 autocast on CUDA, bf16 teacher), from in-memory random-weight models and
a stand-in tokenizer (no files), with the default objective (top-16 `only_stu`, token-reward advantages, PPO-clip
loss); one row per generation engine (`--engines`). As `opd distill` sets a GPU up: the decoder layers of both models
under `torch.compile` and selective activation checkpointing of the student (`--compile`, `--ckpt`).

TRL GKD (`trl/experimental/gkd/gkd_trainer.py`, lmbda = 1: always on-policy; beta = 1: reverse KL; seq_kd off),
re-created because TRL is not installed here: `student.generate(do_sample=True, top_k=0, temperature=1)` →
labels = generated ids with pad → -100 → student forward with grad and teacher forward without, full-vocabulary
logits → `generalized_jsd_loss` (copied: log_softmax of both, `F.kl_div(teacher_lp, student_lp, log_target=True)`,
masked, divided by the token count) → backward → grad-norm clip 1.0 → AdamW step. The batch is the same B = prompts ×
n sequences in one micro-batch (`per_device_train_batch_size = B`, the fastest TRL setting; smaller micro-batches with
accumulation would generate in smaller batches and be slower still), eager, without gradient checkpointing (TRL's
defaults).

tokens/s = generated response tokens of the step / wall time of the step (one warm-up step, then `--repeat` timed).
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SHAPES, TOKENIZER_SIZE, Report, attention_name, base_parser, build_model, eos_id, measure, pad_id, resolve_device,
    speedups,
)


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


def build_trainer(args, student, teacher, prompt_ids, engine: str, run_dir: Path, autocast_dtype):
    from opd.config import DataSpec, DistillConfig, ModelSpec, RunSpec, SamplingSpec, TeacherSpec
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator
    from opd.teacher.local import LocalScorer
    from opd.train.opd import Trainer
    from opd.train.optim import build_optimizer, build_scheduler
    from opd.train.sampler import PromptSampler
    from opd.types import Prompt

    config = DistillConfig(
        student=ModelSpec(path=f"random:{args.shape}"), teacher=TeacherSpec(path=f"random:{args.teacher_shape}"),
        data=DataSpec(path="random", answer_key=None),
        rollout=SamplingSpec(n=args.n, max_new_tokens=args.new_tokens, batch_size=args.prompts * args.n),
        run=RunSpec(out_dir=str(run_dir), name="bench", samples_per_step=0, steps=1000, report=False),
        prompts_per_step=args.prompts, micro_batch_tokens=args.micro_batch_tokens,
        score_batch_tokens=args.score_batch_tokens,
    )
    vocab = TOKENIZER_SIZE[args.shape]
    common = dict(eos_token_ids=[eos_id(args.shape)], pad_token_id=pad_id(args.shape), vocab_size=vocab,
                  max_batch_size=config.rollout.batch_size)
    generator = TorchGenerator(student, **common) if engine == "torch_engine" else StaticGenerator(student, **common)
    optimizer = build_optimizer(student.parameters(), config.optim)
    prompts = [Prompt(id=str(i), messages=[{"role": "user", "content": ""}]) for i in range(len(prompt_ids))]
    return Trainer(
        config=config, run_dir=run_dir, student=student, tokenizer=IdTokenizer(pad_id(args.shape), eos_id(args.shape)),
        prompts=prompts, prompt_ids=prompt_ids, generator=generator,
        student_scorer=LocalScorer(student, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab),
        teacher=teacher,
        teacher_scorer=LocalScorer(teacher, max_tokens_per_batch=config.score_batch_tokens, vocab_size=vocab),
        reference_scorer=None, vocab_size=vocab, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, config.run.steps, config.optim),
        sampler=PromptSampler(len(prompt_ids), config.prompts_per_step, seed=0), sink=None,
        autocast_dtype=autocast_dtype,
    )


def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0):
    """TRL's `GKDTrainer.generalized_jsd_loss` (reduction "batchmean"), the beta ∈ {0, 1} branches, as written there."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        raise NotImplementedError("only beta 0 / 1 are re-created here")
    mask = labels != -100
    jsd = jsd[mask]
    return jsd.sum() / mask.sum()


def trl_gkd_step(student, teacher, prompt_ids_BP, optimizer, *, pad: int, eos: int, new_tokens: int, autocast_dtype):
    """One TRL GKD training step (lmbda = 1, beta = 1), as `GKDTrainer.training_step` + `compute_loss` run it."""
    from transformers import GenerationConfig

    device = prompt_ids_BP.device
    amp = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    config = GenerationConfig(max_new_tokens=new_tokens, temperature=1.0, do_sample=True, top_k=0, use_cache=True,
                              pad_token_id=pad, eos_token_id=eos)
    with amp:  # unwrap_model_for_generation: the student generates, in train mode (dropout is 0 in Qwen3)
        generated = student.generate(input_ids=prompt_ids_BP, attention_mask=torch.ones_like(prompt_ids_BP),
                                     generation_config=config)
    attention = torch.ones_like(generated)
    labels = generated.clone()
    labels[labels == pad] = -100
    attention[generated == pad] = 0
    prompt_len = prompt_ids_BP.shape[1]
    student.train()
    with amp:
        student_logits = student(input_ids=generated, attention_mask=attention).logits
        teacher.eval()
        with torch.no_grad():
            teacher_logits = teacher(input_ids=generated, attention_mask=attention).logits
        loss = generalized_jsd_loss(student_logits[:, prompt_len - 1:-1], teacher_logits[:, prompt_len - 1:-1],
                                    labels[:, prompt_len:], beta=1.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return int((labels[:, prompt_len:] != -100).sum())


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--teacher-shape", default="qwen3-1.7b", choices=sorted(SHAPES), help="teacher shape")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="max new tokens per sample")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="our update's micro-batch budget")
    parser.add_argument("--score-batch-tokens", type=int, default=32768, help="our scoring forward budget")
    parser.add_argument("--engines", default="static_engine", help="our rows: static_engine, torch_engine")
    parser.add_argument("--ckpt", default="auto", choices=["auto", "on", "off", "selective"],
                        help="gradient checkpointing of our student: on (every layer), selective (compiled layers "
                             "keep half their activations), off; auto: as `opd distill` (CUDA: selective when "
                             "compiled, else on; CPU: off)")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="torch.compile the decoder layers of our student and teacher (auto: on for CUDA)")
    parser.add_argument("--attn", default="auto", help="attention of our rows: auto (as `opd distill`: opd_varlen "
                                                       "on CUDA, else sdpa), sdpa, opd_varlen; the TRL row uses sdpa")
    parser.add_argument("--skip-trl", action="store_true", help="leave the TRL GKD row out")
    args = parser.parse_args(argv)
    if SHAPES[args.shape]["vocab_size"] != SHAPES[args.teacher_shape]["vocab_size"]:
        raise SystemExit("--shape and --teacher-shape must share a vocabulary (tiny with tiny, qwen3 with qwen3)")
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    autocast_dtype = torch.bfloat16 if cuda else None
    student = build_model(args.shape, dtype=torch.float32, device=device, seed=args.seed)
    teacher = build_model(args.teacher_shape, dtype=torch.bfloat16 if cuda else torch.float32, device=device,
                          seed=args.seed + 1).requires_grad_(False)
    g = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(3, TOKENIZER_SIZE[args.shape], (args.prompts, args.prompt_len), generator=g)
    report = Report("opd_step", args, device, shape=args.shape, teacher_shape=args.teacher_shape,
                    sequences=args.prompts * args.n, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    precision="fp32 student + bf16 autocast, bf16 teacher" if cuda else "fp32")
    run_dir = Path(tempfile.mkdtemp(prefix="opd-bench-"))

    if not args.skip_trl:
        def trl():
            optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)
            batch_BP = prompt_ids.repeat_interleave(args.n, dim=0).to(device)
            step = lambda: trl_gkd_step(student, teacher, batch_BP, optimizer, pad=pad_id(args.shape),  # noqa: E731
                                        eos=eos_id(args.shape), new_tokens=args.new_tokens,
                                        autocast_dtype=autocast_dtype)
            with torch.compiler.set_stance("force_eager"):
                m = measure(step, device, warmup=args.warmup, repeat=args.repeat)
            del optimizer
            return {"tokens": m["result"], "seconds": m["seconds"], "tokens_per_s": m["result"] / m["seconds"],
                    "peak_gib": m["peak_gib"], "warmup_s": m["first_call_seconds"], "step_seconds": m["all_seconds"]}

        report.run_row("trl_gkd_recreated", trl)
    # our rows run as `opd distill` sets the models up on this device (the TRL row above ran before, eagerly)
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
    if ckpt == "on":
        student.gradient_checkpointing_enable()
    budget = 0.5 if ckpt == "selective" else None
    for engine in [e for e in args.engines.split(",") if e]:
        def ours(engine=engine):
            from opd.train.opd import opd_step

            tr = build_trainer(args, student, teacher, prompt_ids.tolist(), engine, run_dir, autocast_dtype)
            tr.activation_budget = budget
            metrics = {}

            def step():
                metrics.clear()
                metrics.update(opd_step(tr))
                tr.step += 1
                return metrics["response_length"] * args.prompts * args.n

            m = measure(step, device, warmup=args.warmup, repeat=args.repeat)
            row = {"ckpt": ckpt, "tokens": m["result"], "seconds": m["seconds"], "tokens_per_s": m["result"] / m["seconds"],
                   "peak_gib": m["peak_gib"], "warmup_s": m["first_call_seconds"], "step_seconds": m["all_seconds"]}
            row.update({k.split("/")[1] + "_s": v for k, v in metrics.items()
                        if k.startswith("time/") and k != "time/step"})
            del tr
            gc.collect()
            return row

        report.run_row(f"opd_step[{engine}]", ours)

    speedups(report.data["rows"], "trl_gkd_recreated")
    rows = report.data["rows"]
    trl_peak = next((r.get("peak_gib") for r in rows if r["name"] == "trl_gkd_recreated"), None)
    for r in rows:
        if trl_peak and r.get("peak_gib"):
            r["memory_vs_trl"] = r["peak_gib"] / trl_peak
    columns = [("row", "name", ""), ("tokens/s", "tokens_per_s", ",.0f"), ("× TRL", "speedup", ".1f"),
               ("step s", "seconds", ".2f"), ("rollout s", "rollout_s", ".2f"), ("student s", "student_s", ".2f"),
               ("teacher s", "teacher_s", ".2f"), ("update s", "update_s", ".2f"), ("peak GiB", "peak_gib", ".1f"),
               ("memory / TRL", "memory_vs_trl", ".2f")]
    notes = [f"student {args.shape} (random, fp32 master weights{' + bf16 autocast' if cuda else ''}), teacher "
             f"{args.teacher_shape}; {args.prompts} prompts × n={args.n} = {args.prompts * args.n} sequences, prompt "
             f"{args.prompt_len} tokens, ≤ {args.new_tokens} new tokens; peak GiB includes both models' weights and "
             "the row's optimizer state"]
    return report.finish(columns, notes)


if __name__ == "__main__":
    main()
