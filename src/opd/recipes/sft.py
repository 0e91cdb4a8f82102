"""`opd sft`: supervised fine-tuning of the student on teacher answers — the off-policy cold start before OPD.

The program: config → setup (data first, then the model, optimizer and schedule; a checkpoint restored) → the loop
(`sft_step`: a seeded, resumable sampler → micro-batches of ≤ `micro_batch_tokens` → `opd.train.sft.forward_backward`
→ clip → step; checkpoints and evals on their cadence) → the LoRA merge → the report. It also trains models from
scratch (the lab's); nothing assumes pretrained weights. `model.dtype=auto` trains fp32 master weights under a bf16
autocast on CUDA; LoRA (peft, `lora.enabled`) trains only the adapters and can merge them. Defaults, precision and
LoRA in full: docs/design.md, "opd.recipes.sft".

Omitted on purpose: multi-process training (the loss already divides by the global token count), sequence-level
loss weighting, NEFTune and other regularisers, evaluation loss on a held-out split (`opd eval` is the measure).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from rich.console import Console
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedModel

from opd.config.sft import (  # noqa: F401 (the config classes stay importable from here)
    LoraSpec,
    SFTConfig,
    SFTDataSpec,
    SFTEvalSpec,
    SFTOptimSpec,
    SFTRunSpec,
)
from opd.data.sft import SFTDataset, SFTExample, collate, load_sft_dataset
from opd.io import give_umask_modes, pid_alive
from opd.models import (
    check_model_path,
    check_tokenizer_compatibility,
    eos_token_ids,
    fix_rope,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from opd.report.sinks import progress_bar
from opd.rollout import make_generator
from opd.rundir import aside_name, claimed_run_dir, open_run, resume_checkpoint, run_directory
from opd.train.checkpoint import latest_checkpoint, save_checkpoint
from opd.train.common import (
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
    timed,
    trainer_state,
    training_precision,
)
from opd.train.optim import build_optimizer, build_scheduler, clip_and_step

if TYPE_CHECKING:
    from opd.forward import Packing
from opd.train.sampler import PromptSampler
from opd.train.sft import forward_backward, packing_is_exact

# --------------------------------------------------------------------------------------------------- config


def check_config(config: SFTConfig) -> None:
    """Checks across sections (one line each, naming the keys)."""
    if config.epochs is not None and config.run.steps is not None:
        raise ValueError(f"set either epochs ({config.epochs}) or run.steps ({config.run.steps}), not both")
    if config.micro_batch_tokens < config.data.max_length:
        raise ValueError(
            f"micro_batch_tokens={config.micro_batch_tokens} is smaller than data.max_length="
            f"{config.data.max_length}; raise it to at least {config.data.max_length}"
        )


# -------------------------------------------------------------------------------------------------- trainer


@dataclass
class SFTTrainer:
    """Everything a step needs, built once by `setup`.

    model: what trains and is saved (the HF model, or the peft model with LoRA); net: the HF causal LM that runs
    (the same module, or the peft model's base with the adapters injected); packed: whether micro-batches are packed;
    vocab_size: the tokenizer's id range (output rows beyond it are embedding padding: no mass, never sampled).
    """

    config: SFTConfig
    run_dir: Path
    model: torch.nn.Module
    net: torch.nn.Module
    tokenizer: Any
    examples: list[SFTExample]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Any
    sink: Any
    total_steps: int
    packed: bool
    autocast_dtype: torch.dtype | None
    vocab_size: int
    generator: Any = None
    step: int = 0
    skipped_steps: int = 0


def sft_step(tr: SFTTrainer) -> dict[str, float]:
    """One optimizer step on the next `examples_per_step` examples."""
    cfg = tr.config
    timings: dict[str, float] = {}
    with timed(timings, "step"):
        batch = collate([tr.examples[i] for i in tr.sampler.next_batch()], pad_id=tr.tokenizer.pad_token_id)
        tr.model.train()
        metrics = forward_backward(
            tr.net,
            batch,
            micro_batch_tokens=cfg.micro_batch_tokens,
            packed=tr.packed,
            autocast_dtype=tr.autocast_dtype,
            vocab_size=tr.vocab_size,
        )
        tr.model.eval()
        grad_norm, stepped, lr = clip_and_step(tr.model, tr.optimizer, tr.scheduler, cfg.optim.grad_clip)
    tr.skipped_steps += 0 if stepped else 1
    synced = torch.stack([metrics["loss"].float(), grad_norm.float()]).tolist()  # one transfer for both
    out = {
        "loss": synced[0],
        "grad_norm": synced[1],
        "tokens": int(metrics["tokens"]),
        "input_tokens": int(metrics["input_tokens"]),
    }
    out.update(
        lr=lr,
        skipped_steps=tr.skipped_steps,
        epoch=tr.sampler.epoch + tr.sampler.position / len(tr.examples),
        **{"time/step": timings["step"]},
    )
    out["tokens_per_second"] = out["input_tokens"] / max(timings["step"], 1e-9)
    return out


# ----------------------------------------------------------------------------------------------- the loop


def sft(config: SFTConfig, *, console: Any = None) -> Path:
    """Run `opd sft` and return the run directory."""
    console = console or Console()
    check_config(config)
    with (
        deterministic_kernels(config.run.deterministic),
        claimed_run_dir(run_directory(config.run, "sft"), config.run, "sft", console=console) as run_dir,
    ):
        tr = setup(config, run_dir, checkpoint=resume_checkpoint(run_dir, config.run, console, config), console=console)
        train(tr, console=console)
    return run_dir


def train(tr: SFTTrainer, *, console: Any) -> None:
    cfg = tr.config
    if eval_at_start(cfg.run, cfg.eval, tr.step):  # the model before training: eval/step_0
        run_eval(tr, console)
    with progress_bar(console) as progress:
        task = progress.add_task("opd sft", total=tr.total_steps, completed=tr.step)
        if (
            tr.step
            and cfg.eval.benchmarks
            and is_due(tr.step, cfg.run.eval_every, tr.total_steps)
            and eval_pending(tr.run_dir, tr.step)
        ):  # resumed from a checkpoint whose eval did not finish
            run_eval(tr, console)
        consecutive_skips = steps_run = 0
        while tr.step < tr.total_steps:
            skipped_before = tr.skipped_steps
            metrics = sft_step(tr)
            tr.step += 1
            tr.sink.log(tr.step, metrics)
            consecutive_skips = consecutive_skips + 1 if tr.skipped_steps > skipped_before else 0
            steps_run += 1
            check_skipped_steps(consecutive_skips, tr.step, cfg.optim)
            progress.update(task, advance=1, description=_console_line(tr.step, metrics))
            if is_due(tr.step, cfg.run.save_every, tr.total_steps):  # before the eval: a failing eval loses no work
                save(tr)
            if cfg.eval.benchmarks and is_due(tr.step, cfg.run.eval_every, tr.total_steps):
                run_eval(tr, console)
    if cfg.lora.enabled and cfg.lora.merge:
        # the run's own output inside its locked run directory: a rerun replaces it
        checkpoint = latest_checkpoint(tr.run_dir)
        assert checkpoint is not None  # the loop saved the last step (or the run resumed from it)
        merged = merge_lora(checkpoint, tr.run_dir / "merged", base=cfg.model.path, existing="replace")
        console.print(f"merged weights: {merged}")
    finish_run(tr.run_dir, tr.sink, report=cfg.run.report, console=console)
    check_run_trained(consecutive_skips, tr.step, steps_run)


def _examples_fingerprint(tr: SFTTrainer) -> str:
    """The training examples as the loss sees them: token ids and target masks (`data_fingerprint`)."""
    return cached_fingerprint(
        tr.examples, lambda: ((ex.input_ids, "".join("1" if t else "0" for t in ex.target_mask)) for ex in tr.examples)
    )


def _console_line(step: int, m: dict) -> str:
    return (
        f"step {step} loss {m['loss']:.4g} lr {m['lr']:.3g} |g| {m['grad_norm']:.3g} "
        f"epoch {m['epoch']:.2f} tok/s {m['tokens_per_second']:.3g}"
    )


def run_eval(tr: SFTTrainer, console: Any) -> dict | None:
    if tr.generator is None:
        tr.generator = make_generator(
            tr.net, tr.tokenizer, max_batch_size=tr.config.eval.batch_size, vocab_size=tr.vocab_size
        )
    spec = tr.config.eval
    return evaluate_in_training(
        spec,
        step=tr.step,
        run_dir=tr.run_dir,
        model_path=tr.config.model.path,
        generator=tr.generator,
        tokenizer=tr.tokenizer,
        template=spec.template,
        enable_thinking=tr.config.data.enable_thinking,
        max_prompt_length=spec.max_prompt_length,
        batch_size=spec.batch_size,
        seed=tr.config.run.seed,
        sink=tr.sink,
        console=console,
        model=tr.net,  # the weights evaluated identify the eval, not model.path
    )


def save(tr: SFTTrainer) -> Path:
    """Checkpoint: HF weights (or the LoRA adapter) + tokenizer + optimizer/scheduler/sampler/RNG state."""
    state = trainer_state(
        tr.optimizer,
        tr.scheduler,
        tr.sampler,
        skipped_steps=tr.skipped_steps,
        data_fingerprint=_examples_fingerprint(tr),
    )
    return save_checkpoint(
        tr.run_dir,
        tr.step,
        model=tr.model,
        tokenizer=tr.tokenizer,
        trainer_state=state,
        keep_last=tr.config.run.keep_last,
    )


# ---------------------------------------------------------------------------------------------------- setup


def setup(config: SFTConfig, run_dir: Path, *, checkpoint: Path | None = None, console: Any = None) -> SFTTrainer:
    """Data first (cheap, fails early), then the model, optimizer and schedule; restore a checkpoint when given.

    Phases: 1. the tokenizer, the examples and the eval sets (`_load_data`); 2. the model (`_load_net`); 3. the
    optimizer, schedule and sampler; 4. a checkpoint's state and the metrics sink; 5. a summary line
    (`_print_setup`)."""
    check_config(config)
    data = config.data
    torch.manual_seed(config.run.seed)
    tokenizer = load_tokenizer(config.model.path, trust_remote_code=config.model.trust_remote_code)
    dataset = _load_data(config, tokenizer)
    examples = dataset.examples
    total_steps = config.run.steps or math.ceil((config.epochs or 1.0) * len(examples) / config.examples_per_step)
    net, model, autocast_dtype = _load_net(config, checkpoint)
    packed = _choose_packing(net, data.packing, console)
    rows = net.get_output_embeddings().weight.shape[0]  # also checks that the tokenizer's ids fit the model
    vocab = check_tokenizer_compatibility(tokenizer, tokenizer, student_vocab_size=rows, teacher_vocab_size=rows)

    optim_spec = config.optim
    if optim_spec.warmup_steps == 0 and optim_spec.warmup_ratio > 0:
        optim_spec = optim_spec.model_copy(update={"warmup_steps": round(optim_spec.warmup_ratio * total_steps)})
    optimizer = build_optimizer(model.parameters(), optim_spec)
    scheduler = build_scheduler(optimizer, total_steps, optim_spec)
    sampler = PromptSampler(len(examples), config.examples_per_step, seed=config.run.seed)
    tr = SFTTrainer(
        config=config,
        run_dir=run_dir,
        model=model,
        net=net,
        tokenizer=tokenizer,
        examples=examples,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        sink=None,
        total_steps=total_steps,
        packed=packed,
        autocast_dtype=autocast_dtype,
        vocab_size=vocab.tokenizer_size,
    )
    if checkpoint is not None:
        state = restore_trainer_state(checkpoint, optimizer, scheduler, sampler, optim=optim_spec, console=console)
        check_data_fingerprint(
            state,
            _examples_fingerprint(tr),
            what=f"the training data data.path={', '.join(data.path)}",
            run=config.run,
            checkpoint=checkpoint,
            console=console,
        )
        tr.step, tr.skipped_steps = state["step"], state["skipped_steps"]
    tr.sink = open_run(config, run_dir, config.run, resume_step=tr.step if checkpoint is not None else None)
    if console is not None:
        _print_setup(tr, dataset, checkpoint, console)
    return tr


def _load_data(config: SFTConfig, tokenizer: Any) -> SFTDataset:
    """The SFT dataset of `config.data` (at least `examples_per_step` examples), after checking that the eval sets
    load (they fail now, not after training)."""
    data = config.data
    dataset = load_sft_dataset(
        tokenizer,
        data.path,
        format=data.format,
        limit=data.limit,
        max_length=data.max_length,
        on_overflow=data.on_overflow,
        enable_thinking=data.enable_thinking,
        system_prompt=data.system_prompt,
        end_of_turn=data.end_of_turn,
    )
    if config.examples_per_step > len(dataset.examples):
        raise ValueError(
            f"examples_per_step={config.examples_per_step} exceeds the {len(dataset.examples)} examples of "
            f"{', '.join(data.path)}; lower examples_per_step"
        )
    load_eval_sets(
        config.eval,
        tokenizer,
        template=config.eval.template,  # fails now, not after training
        enable_thinking=data.enable_thinking,
        max_prompt_length=config.eval.max_prompt_length,
    )
    return dataset


def _run_length(config: SFTConfig) -> int:
    """The run's longest sequence, what a length-dependent RoPE is fixed for (`opd.models.fix_rope`): the training
    bound `data.max_length`, or the periodic eval's prompt + response where that is longer (one model, one table)."""
    spec = config.eval
    return max(config.data.max_length, spec.max_prompt_length + spec.max_new_tokens if spec.benchmarks else 0)


def _load_net(config: SFTConfig, checkpoint: Path | None) -> tuple[Any, torch.nn.Module, torch.dtype | None]:
    """(the Hugging Face model, the model trained: it or its LoRA wrapper, the autocast dtype): loaded from the
    checkpoint when given (its adapters for LoRA), with gradient checkpointing as configured."""
    spec = config.model
    device = resolve_device(spec.device)
    weights_dtype, autocast_dtype = training_precision(spec, device)
    model_path = str(checkpoint) if checkpoint is not None and not config.lora.enabled else spec.path
    net, _ = load_model(
        model_path,
        dtype=weights_dtype,
        device=device,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    fix_rope(net, _run_length(config))
    model = _with_lora(net, config.lora, checkpoint) if config.lora.enabled else net
    if config.gradient_checkpointing:
        net.gradient_checkpointing_enable()
        if config.lora.enabled:
            net.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need a grad path
    return net, model, autocast_dtype


def _print_setup(tr: SFTTrainer, dataset: SFTDataset, checkpoint: Path | None, console: Any) -> None:
    """One line on the data and the steps (and the resume), and a warning when the end-of-turn token is no EOS id."""
    data, examples = tr.config.data, tr.examples
    targets = sum(ex.num_targets for ex in examples)
    eot = tr.tokenizer.convert_ids_to_tokens(dataset.end_of_turn_id)
    dropped = f"; {dataset.num_filtered} over max_length={data.max_length} dropped" if dataset.num_filtered else ""
    cut = f"; {dataset.num_truncated} truncated to max_length" if dataset.num_truncated else ""
    console.print(
        f"opd sft: {len(examples)} examples ({targets} target tokens), {tr.total_steps} steps of "
        f"{tr.config.examples_per_step}, {'packed' if tr.packed else 'padded'}, end of turn {eot!r}"
        f"{dropped}{cut}"
    )
    if checkpoint is not None:
        console.print(f"resumed from {checkpoint} (step {tr.step})")
    if dataset.end_of_turn_id not in eos_token_ids(tr.net, tr.tokenizer):
        console.print(
            f"[yellow]the end-of-turn token {eot!r} is not an EOS id of the model; generation will not "
            f"stop at it: add it to generation_config.eos_token_id[/]"
        )


def _with_lora(net: PreTrainedModel, spec: LoraSpec, checkpoint: Path | None) -> torch.nn.Module:
    """The peft model: fresh adapters, or the checkpoint's (trainable) for a resume."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if checkpoint is not None:
        return PeftModel.from_pretrained(net, checkpoint, is_trainable=True)
    head = net.get_output_embeddings()
    head_names = {name.rsplit(".", 1)[-1] for name, module in net.named_modules() if module is head}
    if isinstance(spec.target_modules, list) and head_names & set(spec.target_modules):
        raise ValueError(
            f"lora.target_modules may not include the output head {sorted(head_names)}: the chunked loss "
            f"projects with the head's base weight only"
        )
    lora = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft annotates it int but only divides by r: a float works
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(net, lora)


def _choose_packing(net: torch.nn.Module, packing: Packing, console: Any) -> bool:
    """Resolve `data.packing`; packing that the model does not honour exactly falls back to padding, with a note."""
    from opd.forward import uses_packing  # heavy (the Triton kernels, torch._dynamo)

    if not uses_packing(net, packing):
        return False
    if packing_is_exact(net):
        return True
    if console is not None:
        console.print(
            f"[yellow]data.packing={packing}: {type(net).__name__} lets packed examples attend to each "
            f"other; using padded micro-batches[/]"
        )
    return False


# ---------------------------------------------------------------------------------------------------- merge


def merge_lora(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    base: str | None = None,
    dtype: str = "auto",
    existing: Literal["refuse", "move", "replace"] = "refuse",
) -> Path:
    """Merge a LoRA checkpoint into its base model and write full HF weights + tokenizer to `out_dir` (atomically:
    a temp directory renamed into place), loadable by `AutoModelForCausalLM.from_pretrained` without peft.

    base:     the base model; None: `base_model_name_or_path` of the adapter config (what training started from).
    dtype:    dtype of the written weights; auto: the base model's own (the merge itself runs in fp32 on CPU).
    existing: what happens when `out_dir` is a file or a non-empty directory (an empty one is simply used):
              refuse (the default: a one-line error before anything is loaded), move (`opd merge --overwrite`: the
              old one is renamed to `<out>.old-<time>`, never deleted) or replace (the old one is deleted: only for
              a directory this program wrote itself, e.g. `<run>/merged` of the locked SFT run).
    """
    from peft import PeftConfig, PeftModel

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if not (checkpoint_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir}: no adapter_config.json; pass a LoRA checkpoint "
            f"(checkpoints/step_N of a lora.enabled run)"
        )
    if existing == "refuse" and _holds_something(out_dir):
        kind = "a file" if not out_dir.is_dir() else "a non-empty directory"
        raise ValueError(
            f"{out_dir} is {kind}; merge into a new or empty directory, or pass --overwrite to move "
            f"the existing one aside (to {out_dir.name}.old-<time>)"
        )
    recorded_base = PeftConfig.from_pretrained(str(checkpoint_dir)).base_model_name_or_path
    base = base or recorded_base
    if not base:
        raise ValueError(f"{checkpoint_dir}: the adapter config names no base model; pass base=")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(out_dir)
    save_dtype = _saved_dtype(base) if dtype == "auto" else resolve_dtype(dtype)
    model, _ = load_model(base, dtype="fp32", device="cpu")
    check_adapter_fits(checkpoint_dir, model, base=base, recorded_base=recorded_base)
    merged = PeftModel.from_pretrained(model, str(checkpoint_dir)).merge_and_unload()
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.to(save_dtype).save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(checkpoint_dir).save_pretrained(tmp)
        give_umask_modes(tmp)  # safetensors writes its files 0600
        if _holds_something(out_dir):
            if existing == "refuse":  # it appeared while we merged
                raise ValueError(f"{out_dir} was created by someone else while merging; nothing was written there")
            old = aside_name(out_dir) if existing == "move" else out_dir.parent / f".old-{out_dir.name}-{os.getpid()}"
            os.replace(out_dir, old)
            if existing == "replace":
                shutil.rmtree(old, ignore_errors=True)
            else:
                print(f"note: moved the existing {out_dir} aside to {old}", file=sys.stderr)
        os.replace(tmp, out_dir)  # onto a missing or empty directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _holds_something(path: Path) -> bool:
    """A file, a link, or a directory with entries (an empty directory holds nothing to lose)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return True
    return path.is_dir() and any(path.iterdir())


def _remove_dead_temps(out_dir: Path) -> None:
    """Temp directories `.tmp-<out name>-<pid>` that a killed merge into `out_dir` left beside it."""
    pattern = re.compile(rf"^\.(tmp|old)-{re.escape(out_dir.name)}-(\d+)$")
    for path in out_dir.parent.iterdir():
        match = pattern.match(path.name)
        if match and path.is_dir() and not pid_alive(int(match.group(2))):
            shutil.rmtree(path, ignore_errors=True)


def check_adapter_fits(
    checkpoint_dir: str | Path, model: PreTrainedModel, *, base: str, recorded_base: str | None
) -> None:
    """Refuse to merge a LoRA adapter into a base it was not trained on (one line naming both), before peft would
    either fail with a multi-line size mismatch or silently merge into a model of another architecture with the same
    module names and sizes (Llama vs Qwen3). Two checks: the architecture of the base the adapter records (when that
    model is at hand) equals `model`'s; and every adapted module exists in `model` with the adapter's in/out sizes.
    A corrupt or truncated adapter file is named too."""
    checkpoint_dir = Path(checkpoint_dir)
    wanted = model.config.model_type
    if recorded_base and str(recorded_base) != str(base):
        try:
            trained_on = AutoConfig.from_pretrained(str(recorded_base), local_files_only=True).model_type
        except (OSError, ValueError):
            trained_on = None  # the original base is not here: the size check below still runs
        if trained_on is not None and trained_on != wanted:
            raise ValueError(
                f"cannot merge {checkpoint_dir} into {base}: the adapter was trained on {recorded_base} "
                f"({trained_on}) but {base} is a {wanted} model; pass --base {recorded_base}"
            )
    path = checkpoint_dir / "adapter_model.safetensors"
    if not path.is_file():
        return  # a .bin adapter: peft checks what it can
    try:
        with safe_open(str(path), framework="pt") as adapter:
            shapes = {key: adapter.get_slice(key).get_shape() for key in adapter.keys()}
    except Exception as error:  # noqa: BLE001 - any failure to read it: a corrupt or truncated file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"cannot merge {checkpoint_dir}: adapter file {path} is corrupt or truncated ({reason}); re-save it"
        ) from None
    modules = dict(model.named_modules())
    for key, shape in sorted(shapes.items()):
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        name = key.split(".lora_")[0].removeprefix("base_model.model.")
        module = modules.get(name)
        if module is None:
            raise ValueError(
                f"cannot merge {checkpoint_dir} into {base}: the adapter adapts {name!r}, which the "
                f"{wanted} base has no module of; pass the base it was trained on (--base)"
            )
        size, have = (
            (shape[1], getattr(module, "in_features", None))
            if ".lora_A." in key
            else (shape[0], getattr(module, "out_features", None))
        )
        if have is not None and size != have:
            raise ValueError(
                f"cannot merge {checkpoint_dir} into {base}: the adapter of {name!r} is for {size} "
                f"features, the base's module has {have}; pass the base it was trained on (--base)"
            )


def _saved_dtype(name_or_path: str) -> torch.dtype:
    """The dtype a model's config.json records (what its weights were saved in); fp32 when it records none."""
    check_model_path("model", name_or_path)  # a missing base: one line, not AutoConfig's repo-id complaint
    config = AutoConfig.from_pretrained(name_or_path)
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32
