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
    "arch": TEACHER_ARCH, "style": "rewrite", "init": "random (the forward teacher's seed)", "steps": 4000,
    "examples_per_step": 128, "lr": 1e-3, "eval_max_new_tokens": 128,
}
"""The rewrite-style teacher (the `style` replication's mismatched teacher): the forward teacher's architecture,
seed, problems and SFT recipe, with rewrite-style solutions; 4000 steps × 128 (the forward teacher: 6000 × 64),
since a rewrite solution is longer and harder (the longest example is 122 tokens, under the recipe's 128). Its
answers reach 83 tokens, so it is measured with 128 new tokens."""
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
    answers need max_new_tokens ≈ 128)."""
    from opd.config import EvalConfig, ModelSpec
    from opd.eval.evaluate import evaluate
    from opd.lab import test_set_path
    from opd.lab.demo import accuracy

    config = EvalConfig(model=ModelSpec(path=str(model_path), device=device, dtype="fp32"),
                        benchmarks=[str(test_set_path())], n=1, temperature=0.0, max_new_tokens=max_new_tokens, batch_size=300,
                        limit=limit, out=str(out))
    return accuracy(evaluate(config, console=console))


def finetune(model_path: str | Path, data: str | Path, work_dir: Path, run_name: str, final: Path, *, steps: int,
             seed: int = 0, examples_per_step: int = SFT_RECIPE["examples_per_step"], lr: float | None = None,
             warmup_steps: int | None = None, max_length: int = SFT_RECIPE["data"]["max_length"],
             device: str = "cpu", overrides: list[str] | None = None, console: Any = None) -> Path:
    """`opd sft` of `model_path` on chat JSONL `data` with `SFT_RECIPE` (lr, batch, warmup changeable) for `steps`
    steps in `work_dir/run_name`; its last checkpoint is copied to `final` (replacing it). Returns the SFT run dir.

    device: where it trains (fp32 either way). On CUDA a step is one micro-batch (micro_batch_tokens = the whole
    padded batch): the same loss and gradient up to float summation order, without a kernel launch per 8192 tokens."""
    from opd.config import build_config
    from opd.train.checkpoint import latest_checkpoint
    from opd.train.sft import SFTConfig, sft

    options = {
        "model.path": str(model_path), "model.device": device, "model.dtype": "fp32", "data.path": [str(data)],
        "run.steps": steps, "run.seed": seed, "run.out_dir": str(work_dir), "run.name": run_name,
        "run.save_every": 0, "run.keep_last": 1, "examples_per_step": examples_per_step,
        "micro_batch_tokens": (SFT_RECIPE["micro_batch_tokens"] if device == "cpu"
                               else max(SFT_RECIPE["micro_batch_tokens"], examples_per_step * max_length)),
        "data.max_length": max_length,
        **{f"optim.{k}": v for k, v in SFT_RECIPE["optim"].items()},
        "optim.warmup_steps": max(1, min(100, steps // 10)) if warmup_steps is None else warmup_steps,
        **({"optim.lr": lr} if lr is not None else {}),
    }
    run_dir = sft(build_config(SFTConfig, options=options, overrides=overrides), console=console)
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(latest_checkpoint(run_dir), final,
                    ignore=shutil.ignore_patterns("trainer_state*", "COMPLETE", "*.pt"))
    return run_dir


def train_model(name: str, arch: dict[str, int], data: Path, out_dir: Path, *, steps: int, seed: int,
                examples_per_step: int = SFT_RECIPE["examples_per_step"], lr: float | None = None,
                device: str = "cpu", overrides: list[str] | None = None, console: Any = None) -> dict[str, Any]:
    """Random init + `opd sft` for `steps` steps; the last checkpoint becomes `<out_dir>/<name>`. Returns its record."""
    init_dir = init_model(arch, out_dir / "work" / f"{name}_init", seed=seed)
    start = time.perf_counter()
    run_dir = finetune(init_dir, data, out_dir / "work", f"{name}_sft", out_dir / name, steps=steps, seed=seed,
                       examples_per_step=examples_per_step, lr=lr, device=device, overrides=overrides,
                       console=console)
    seconds = time.perf_counter() - start
    recipe = {**SFT_RECIPE, "examples_per_step": examples_per_step,
              "optim": {**SFT_RECIPE["optim"], **({"lr": lr} if lr is not None else {})}}
    return {"path": name, "arch": "Qwen3ForCausalLM", **arch, "params": n_params(out_dir / name), "seed": seed,
            "training": {"recipe": "opd sft from random init", "steps": steps, **recipe, "sft_data": str(data.name),
                         "warmup_steps": max(1, min(100, steps // 10)), "device": device, "run_dir": str(run_dir),
                         "wall_s": round(seconds, 1), "s_per_step": round(seconds / steps, 3),
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
    threads: int | None = 1,
    console: Any = None,
) -> Path:
    """Retrain the lab models into `out_dir` (teacher/, student/, rewrite_teacher/, data/, work/, manifest.json);
    return the manifest path. Reduce the budget with `teacher_steps`, `student_steps`, `rewrite_teacher_steps`
    (and `rewrite_teacher_batch` examples per step),
    `sft_examples` (size of the SFT set) and `eval_limit` (test problems measured); `only` trains a subset of
    MODELS; `device` is where they train and are measured (cpu, cuda, cuda:N)."""
    import torch
    from rich.console import Console

    from opd.io import atomic_write_json
    from opd.lab import SFT_SET, TEST_SET

    names = list(only or MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ValueError(f"only: unknown lab model(s) {unknown or names}; choose from {', '.join(MODELS)}")
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
        record = train_model(name, arch, data, out_dir, steps=steps, seed=model_seed, examples_per_step=per_step,
                             lr=lr, device=device, console=console)
        record["style"] = style
        record["test_accuracy"] = measure(out_dir / name, out_dir / "work" / f"{name}_eval", limit=eval_limit,
                                          max_new_tokens=tokens, device=device, console=console)
        record["test_eval"] = {"metric": "avg@1", "n": 1, "temperature": 0.0, "max_new_tokens": tokens,
                               "limit": eval_limit, "machinery": "opd.eval.evaluate (opd eval)"}
        models[name] = record
        console.print(f"{name}: test accuracy {record['test_accuracy']:.3f}")
    manifest = {
        "built_by": "opd lab build", "seed": seed, "threads": torch.get_num_threads(), "device": device,
        "sft_set": {**SFT_SET, "n": sft_examples or SFT_SET["n"]},
        "test_set": TEST_SET, "models": models,
    }
    path = out_dir / "manifest.json"
    atomic_write_json(path, json.loads(json.dumps(manifest, default=list)))
    console.print(f"manifest: {path}")
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
    return out_dir
