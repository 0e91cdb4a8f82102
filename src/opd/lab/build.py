"""`opd lab build`: retrain the lab teacher and student from a seed, through `opd sft`, and write their manifest.

Steps, all through the project's own components:
1. SFT data: `make_problems(**SFT_SET)` (60 000 train-split problems) with forward-style solutions, written as chat
   JSONL (`{"messages": [user, assistant]}`) — `data/sft_forward.jsonl` in the output directory;
2. per model, a random-init Qwen3 (`lab_model_config`; tied embeddings, the lab tokenizer's 34 ids) saved with
   `save_pretrained` next to the lab tokenizer, then `opd.train.sft.sft` (batch 64, AdamW lr 1e-3, betas
   (0.9, 0.98), no weight decay, linear warmup then cosine to 10%), its last checkpoint copied to `<out>/<name>`;
3. `opd eval` (greedy, n = 1, 64 new tokens) of each model on the lab test set; `<out>/manifest.json` records
   config, parameter count, training recipe and measured accuracy.

The shipped models (`opd/lab/assets`) were made with the same recipe by the lab prototype on one GPU (teacher: 6000
steps; student: step 500 of a 700-step schedule) and then imported into the 34-token tokenizer by keeping the
embedding rows of the tokens it kept (see assets/manifest.json). Budgets are options: `teacher_steps`,
`student_steps`, `eval_limit`; a full teacher build takes hours on a CPU (see docs/lab.md for the measured rate).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from opd.io import give_umask_modes

TEACHER_ARCH: dict[str, int] = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512}
STUDENT_ARCH: dict[str, int] = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 384}
SFT_RECIPE: dict[str, Any] = {
    "examples_per_step": 64, "optim": {"lr": 1e-3, "betas": [0.9, 0.98], "weight_decay": 0.0, "schedule": "cosine",
                                       "min_lr_ratio": 0.1, "grad_clip": 1.0},
    "data": {"max_length": 128}, "micro_batch_tokens": 8192,
}
"""The SFT settings of both models (the prototype's: warmup min(100, steps/10), cosine to 10% of lr)."""
TEACHER_STEPS = 6000
STUDENT_STEPS = 500
REWRITE_TEACHER: dict[str, Any] = {
    "arch": TEACHER_ARCH, "style": "rewrite", "init": "the forward teacher", "steps": 4000,
    "examples_per_step": 256, "lr": 1e-3, "eval_max_new_tokens": 128,
}
"""The rewrite-style teacher (the `style` replication's mismatched teacher): the forward teacher fine-tuned with its
own SFT recipe (lr 1e-3, warmup 100, cosine to 10 %) on rewrite-style solutions of the same 60 000 problems, up to
4000 steps × 256 — or as many as a time budget allows (the shipped one: see assets/manifest.json). Starting from the
forward teacher it only has to learn the new solution layout, not arithmetic: the fewest steps to a ≥ 95 % teacher.
The longest rewrite example is 122 tokens (under the recipe's 128); answers reach 83 tokens, so it is measured with
128 new tokens."""
MODELS: tuple[str, ...] = ("teacher", "student", "rewrite_teacher")
"""What `build` can train (`only=`); the directory names under the output and in the shipped assets."""


def lab_model_config(arch: dict[str, int], tokenizer: Any):
    """A Qwen3 config for the lab tokenizer: tied embeddings, head_dim = hidden / heads, 256 positions."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), num_key_value_heads=arch["num_attention_heads"],
        head_dim=arch["hidden_size"] // arch["num_attention_heads"], max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, rope_theta=10000.0, **arch,
    )


def init_model(arch: dict[str, int], out_dir: str | Path, *, seed: int) -> Path:
    """A random-init lab model (seeded) saved with save_pretrained, with the lab tokenizer and generation config."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from opd.lab.tokenizer import build_lab_tokenizer

    tokenizer = build_lab_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(lab_model_config(arch, tokenizer))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    give_umask_modes(out_dir)  # safetensors writes its files 0600
    return out_dir


def write_sft_data(path: str | Path, *, style: str = "forward", n: int | None = None) -> Path:
    """The SFT set (`SFT_SET` problems, `style` solutions) as chat JSONL, written atomically."""
    from opd.io import write_jsonl
    from opd.lab import SFT_SET
    from opd.lab.task import make_problems, to_sft_examples

    spec = dict(SFT_SET, n=n or SFT_SET["n"])
    write_jsonl(path, to_sft_examples(make_problems(**spec), style=style))
    return Path(path)


def n_params(path: str | Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(path)).parameters())


def measure(model_path: str | Path, out: str | Path, *, limit: int | None = None, max_new_tokens: int = 64,
            device: str = "cpu", console: Any = None) -> float:
    """Greedy n=1 accuracy (avg@1) on the lab test set through `opd eval` (the demo's eval settings; rewrite-style
    answers need max_new_tokens ≈ 128), generated by the torch engine on every device (on CUDA the static engine
    would first capture CUDA graphs: seconds that a lab model's 300 answers do not need)."""
    from opd.config import EvalConfig, ModelSpec
    from opd.eval.evaluate import evaluate
    from opd.lab import test_set_path
    from opd.lab.demo import accuracy
    from opd.models import load_model
    from opd.rollout import make_generator

    config = EvalConfig(model=ModelSpec(path=str(model_path), device=device, dtype="fp32"),
                        benchmarks=[str(test_set_path())], n=1, temperature=0.0, max_new_tokens=max_new_tokens, batch_size=300,
                        limit=limit, out=str(out))
    model, tokenizer = load_model(str(model_path), dtype="fp32", device=device)
    generator = make_generator(model, tokenizer, engine="torch", max_batch_size=300)
    return accuracy(evaluate(config, generator=generator, tokenizer=tokenizer, console=console))


def rewrite_share(eval_dir: str | Path) -> float:
    """Share of the answers in an `opd eval` directory's samples.jsonl written in the rewrite style
    (`opd.lab.task.style_of`): accuracy alone cannot tell a rewrite teacher from the forward one it started as."""
    from opd.io import read_jsonl
    from opd.lab.task import style_of

    styles = [style_of(r["response"]) for r in read_jsonl(Path(eval_dir) / "samples.jsonl")]
    return styles.count("rewrite") / max(1, len(styles))


def finetune(model_path: str | Path, data: str | Path, work_dir: Path, run_name: str, final: Path, *, steps: int,
             seed: int = 0, examples_per_step: int = SFT_RECIPE["examples_per_step"], lr: float | None = None,
             warmup_steps: int | None = None, max_length: int = SFT_RECIPE["data"]["max_length"],
             device: str = "cpu", time_budget_s: float | None = None, overrides: list[str] | None = None,
             console: Any = None) -> tuple[Path, dict[str, Any]]:
    """`opd sft` of `model_path` on chat JSONL `data` with `SFT_RECIPE` (lr, batch, warmup changeable) for `steps`
    steps in `work_dir/run_name`; its last checkpoint is copied to `final` (replacing it). Returns (the SFT run dir,
    {"steps": steps trained, ...}). A rerun continues (or reuses) that SFT run (`run.resume`); other settings than it
    was started with are refused.

    device: where it trains (fp32 and padded micro-batches either way, so CPU and GPU run the same computation). On
    CUDA a step is one micro-batch (micro_batch_tokens = the whole padded batch): the same loss and gradient up to
    float summation order, without a kernel launch per 8192 tokens.
    time_budget_s: wall seconds from this call (set-up included) to the last step; see `sft_within_budget`."""
    from opd.config import build_config
    from opd.train.checkpoint import latest_checkpoint
    from opd.recipes.sft import SFTConfig, sft

    start = time.perf_counter()
    options = {
        "model.path": str(model_path), "model.device": device, "model.dtype": "fp32", "data.path": [str(data)],
        "data.packing": "padded", "run.steps": steps, "run.seed": seed, "run.out_dir": str(work_dir),
        "run.name": run_name, "run.resume": True, "run.save_every": 0 if time_budget_s is None else 500,
        "run.keep_last": 1,
        "examples_per_step": examples_per_step,
        "micro_batch_tokens": (SFT_RECIPE["micro_batch_tokens"] if device == "cpu"
                               else max(SFT_RECIPE["micro_batch_tokens"], examples_per_step * max_length)),
        "data.max_length": max_length,
        **{f"optim.{k}": v for k, v in SFT_RECIPE["optim"].items()},
        "optim.warmup_steps": max(1, min(100, steps // 10)) if warmup_steps is None else warmup_steps,
        **({"optim.lr": lr} if lr is not None else {}),
    }
    config = build_config(SFTConfig, options=options, overrides=overrides)
    if time_budget_s is None:
        run_dir, record = sft(config, console=console), {"steps": steps}
    else:
        run_dir, record = sft_within_budget(config, start + time_budget_s, console=console)
    record["micro_batch_tokens"] = config.micro_batch_tokens
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(latest_checkpoint(run_dir), final,
                    ignore=shutil.ignore_patterns("trainer_state*", "COMPLETE", "MANIFEST.json", "*.pt"))
    return run_dir, record


def sft_within_budget(config: Any, deadline: float, *, calibration_steps: int = 30, log_every: int = 100,
                      console: Any = None) -> tuple[Path, dict[str, Any]]:
    """`opd sft` that ends by `deadline` (a `time.perf_counter()` value) with a saved model whatever happens: after
    `calibration_steps` steps it measures the step rate and shortens the run to the N ≤ run.steps steps that fit
    (95 % of the time left), rebuilding the schedule for N — warmup and the first steps are those of a plain N-step
    run when warmup_steps does not depend on the step count, so `--rewrite-teacher-steps N` without a budget replays
    the same recipe. It still stops at the deadline if the rate drops (the record says so), checkpoints every
    run.save_every steps, and prints a plain progress line every `log_every` steps."""
    from opd.train.common import finish_run, run_directory
    from opd.train.optim import build_scheduler
    from opd.recipes.sft import save, setup, sft_step

    run_dir = run_directory(config.run, "sft")
    tr = setup(config, run_dir, console=console)
    planned, rate, stopped = tr.total_steps, None, "steps"
    begin = time.perf_counter()
    while tr.step < tr.total_steps:
        if time.perf_counter() >= deadline:
            stopped = "time budget"
            break
        metrics = sft_step(tr)
        tr.step += 1
        tr.sink.log(tr.step, metrics)
        if tr.step == 5:
            begin = time.perf_counter()  # the first steps warm up allocators and kernels
        if tr.step == calibration_steps and tr.step < tr.total_steps:
            rate = (time.perf_counter() - begin) / (tr.step - 5)
            fit = tr.step + int(0.95 * (deadline - time.perf_counter()) / rate)
            if fit < tr.total_steps:
                planned = tr.total_steps = max(tr.step + 1, fit)
                tr.scheduler = build_scheduler(tr.optimizer, planned, config.optim)
                for _ in range(tr.step):
                    tr.scheduler.step()
        if tr.step % log_every == 0 or tr.step == tr.total_steps:
            print(f"{run_dir.name} step {tr.step}/{tr.total_steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.3g} "
                  f"{metrics['time/step']:.3f} s/step, {deadline - time.perf_counter():.0f} s left", flush=True)
        if config.run.save_every and tr.step % config.run.save_every == 0:
            save(tr)
    save(tr)
    finish_run(run_dir, tr.sink, report=False, console=console)
    return run_dir, {"steps": tr.step, "planned_steps": planned, "max_steps": config.run.steps, "stopped_by": stopped,
                     "calibrated_s_per_step": None if rate is None else round(rate, 4)}


def train_model(name: str, arch: dict[str, int], data: Path, out_dir: Path, *, steps: int, seed: int,
                examples_per_step: int = SFT_RECIPE["examples_per_step"], lr: float | None = None,
                init: Path | None = None, device: str = "cpu", time_budget_s: float | None = None,
                overrides: list[str] | None = None, console: Any = None) -> dict[str, Any]:
    """`opd sft` for `steps` steps from a random init (`init` None) or from the model at `init`; the last checkpoint
    becomes `<out_dir>/<name>`. Returns its manifest record."""
    init_dir = init if init is not None else init_model(arch, out_dir / "work" / f"{name}_init", seed=seed)
    start = time.perf_counter()
    warmup = max(1, min(100, steps // 10))
    run_dir, trained = finetune(init_dir, data, out_dir / "work", f"{name}_sft", out_dir / name, steps=steps,
                                seed=seed, examples_per_step=examples_per_step, lr=lr, warmup_steps=warmup,
                                device=device, time_budget_s=time_budget_s, overrides=overrides, console=console)
    seconds = time.perf_counter() - start
    recipe = {**SFT_RECIPE, "examples_per_step": examples_per_step,
              "optim": {**SFT_RECIPE["optim"], "warmup_steps": warmup, **({"lr": lr} if lr is not None else {})}}
    origin = "random init" if init is None else f"the model at {init}"
    return {"path": name, "arch": "Qwen3ForCausalLM", **arch, "params": n_params(out_dir / name), "seed": seed,
            "training": {"recipe": f"opd sft from {origin}", **recipe, **trained, "sft_data": str(data.name),
                         "device": device, "run_dir": str(run_dir), "time_budget_s": time_budget_s,
                         "wall_s": round(seconds, 1), "s_per_step": round(seconds / max(1, trained["steps"]), 3),
                         "overrides": overrides or []}}


def build(
    out_dir: str | Path,
    *,
    seed: int = 0,
    teacher_steps: int = TEACHER_STEPS,
    student_steps: int = STUDENT_STEPS,
    rewrite_teacher_steps: int = REWRITE_TEACHER["steps"],
    rewrite_teacher_batch: int = REWRITE_TEACHER["examples_per_step"],
    sft_examples: int | None = None,
    eval_limit: int | None = None,
    only: list[str] | None = None,
    device: str = "cpu",
    time_budget_s: float | None = None,
    threads: int | None = 1,
    console: Any = None,
) -> Path:
    """Retrain the lab models into `out_dir` (teacher/, student/, rewrite_teacher/, data/, work/, manifest.json);
    return the manifest path. Reduce the budget with `teacher_steps`, `student_steps`, `rewrite_teacher_steps`
    (and `rewrite_teacher_batch` examples per step), `sft_examples` (size of the SFT set) and `eval_limit` (test
    problems measured); `only` trains a subset of MODELS; `device` is where they train and are measured (cpu, cuda,
    cuda:N); `time_budget_s` caps each model's SFT (set-up included) in wall seconds: it trains the steps that fit
    (`sft_within_budget`) and always saves, measures and records what it trained. The rewrite teacher starts from the
    teacher this build trains, else from the shipped one."""
    import torch
    from rich.console import Console

    from opd.io import atomic_write_json
    from opd.lab import SFT_SET, TEST_SET, teacher_path

    names = list(only or MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ValueError(f"only: unknown lab model(s) {unknown or names}; choose from {', '.join(MODELS)}")
    if time_budget_s is not None and time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be > 0 seconds, got {time_budget_s}")
    console = console or Console()
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "work").is_dir():
        raise FileExistsError(f"{out_dir} exists and was not written by `opd lab build` (no work/); "
                              f"pass a new or empty directory")
    rewrite = REWRITE_TEACHER
    plans = {  # name → (arch, steps, seed, solution style, examples per step, lr, new tokens when measured)
        "teacher": (TEACHER_ARCH, teacher_steps, seed, "forward", SFT_RECIPE["examples_per_step"], None, 64),
        "student": (STUDENT_ARCH, student_steps, seed + 1, "forward", SFT_RECIPE["examples_per_step"], None, 64),
        "rewrite_teacher": (rewrite["arch"], rewrite_teacher_steps, seed, "rewrite", rewrite_teacher_batch,
                            rewrite["lr"], rewrite["eval_max_new_tokens"]),
    }
    models = {}
    for name in names:
        arch, steps, model_seed, style, per_step, lr, tokens = plans[name]
        data = write_sft_data(out_dir / "data" / f"sft_{style}.jsonl", style=style, n=sft_examples)
        init = None
        if name == "rewrite_teacher":
            init = out_dir / "teacher" if "teacher" in models else teacher_path()
        record = train_model(name, arch, data, out_dir, steps=steps, seed=model_seed, examples_per_step=per_step,
                             lr=lr, init=init, device=device, time_budget_s=time_budget_s, console=console)
        record["style"] = style
        record["test_accuracy"] = measure(out_dir / name, out_dir / "work" / f"{name}_eval", limit=eval_limit,
                                          max_new_tokens=tokens, device=device, console=console)
        record["rewrite_style_share"] = rewrite_share(out_dir / "work" / f"{name}_eval")
        record["test_eval"] = {"metric": "avg@1", "n": 1, "temperature": 0.0, "max_new_tokens": tokens,
                               "limit": eval_limit, "engine": "torch", "machinery": "opd.eval.evaluate (opd eval)"}
        models[name] = record
        console.print(f"{name}: test accuracy {record['test_accuracy']:.3f}, rewrite-style answers "
                      f"{record['rewrite_style_share']:.3f}, after {record['training']['steps']} steps")
    manifest = {
        "built_by": "opd lab build", "seed": seed, "threads": torch.get_num_threads(), "device": device,
        "sft_set": {**SFT_SET, "n": sft_examples or SFT_SET["n"]},
        "test_set": TEST_SET, "models": models,
    }
    path = out_dir / "manifest.json"
    atomic_write_json(path, json.loads(json.dumps(manifest, default=list)))
    return path


def import_checkpoint(source: str | Path, source_tokenizer: str | Path, out_dir: str | Path) -> Path:
    """Re-home a lab checkpoint trained with another lab vocabulary onto the current lab tokenizer: keep the (tied)
    embedding rows of the tokens the current tokenizer has, by token string, in its id order. How the shipped models
    moved from the prototype's 110-token vocabulary to the 34-token one (every dropped token never occurs in lab text,
    so the logits of the kept tokens, and greedy answers, are unchanged up to their softmax normaliser)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from opd.lab.tokenizer import build_lab_tokenizer

    old = PreTrainedTokenizerFast.from_pretrained(str(source_tokenizer)).get_vocab()
    tokenizer = build_lab_tokenizer()
    missing = [t for t in tokenizer.get_vocab() if t not in old]
    if missing:
        raise ValueError(f"{source_tokenizer} lacks lab tokens {missing}; cannot import {source}")
    rows = [old[tokenizer.convert_ids_to_tokens(i)] for i in range(len(tokenizer))]
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise ValueError(f"{source}: import_checkpoint handles tied embeddings only")
    kept = model.get_input_embeddings().weight.data[rows].clone()
    model.resize_token_embeddings(len(tokenizer))
    model.get_input_embeddings().weight.data.copy_(kept)
    model.config.update({"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                         "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None})
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    give_umask_modes(out_dir)  # safetensors writes its files 0600
    return out_dir
