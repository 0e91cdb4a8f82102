"""The resources group of `opd check`: `memory` (weights, gradients, AdamW state, the generation KV cache and update
activations at the configured lengths, against what is free on each device) and `step_time` (a measured mini-step
scaled to the configured batch).

Omitted on purpose: a memory model of FSDP sharding (one process per device is estimated).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from opd.check.report import CheckResult, Status
from opd.config import DistillConfig
from opd.objectives.diagnostics import diagnostic_top_k
from opd.rollout import SamplingParams
from opd.rollout.batch import build_rollouts
from opd.scoring import CHUNK_BYTES
from opd.train.common import autocast, timed
from opd.train.sft import forward_backward


def _vocab(model: torch.nn.Module) -> int:
    return cast(Any, model).get_output_embeddings().weight.shape[0]


def _param_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    return sum(p.numel() * (size or p.element_size()) for p in model.parameters())


def estimate_memory(
    config: DistillConfig,
    student: torch.nn.Module,
    teacher: torch.nn.Module | None,
    *,
    compute_dtype: torch.dtype,
    weights_dtype: torch.dtype | None = None,
    teachers: Sequence[tuple[str, torch.nn.Module, bool]] | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes per device the run needs, by part. Rules (coarse on purpose; docs/performance.md says how close):
    student weights, gradients (weights' dtype) and AdamW state (2 tensors of the weights' dtype);
    generation KV cache: rows × (max_prompt_length + max_new_tokens) × layers × 2 × kv_heads × head_dim at the
    compute dtype, rows = min(rollout.batch_size, prompts_per_step × n);
    update activations of one micro-batch: micro_batch_tokens × (12 · hidden + 3 · intermediate) values per layer,
    or with gradient checkpointing hidden per layer plus one layer's full set;
    the chunked head's float32 temporaries (`opd.scoring.CHUNK_BYTES`, or tokens × vocab when smaller) once per
    model that scores;
    teacher weights (on CPU when teacher_offload) and its no-grad scoring activations (score_batch_tokens × 4 ·
    hidden values). `teachers`: every in-process teacher of a run with several, as (name, module, offloaded): each
    one's weights where they live (`teacher_weights[name]`), and the scoring activations of the largest where they
    score (teachers score one after another); None: `teacher` alone, offloaded when teacher_offload."""

    def shape(model: torch.nn.Module) -> dict[str, int]:
        c: Any = model.config
        heads = c.num_attention_heads
        return {
            "layers": c.num_hidden_layers,
            "hidden": c.hidden_size,
            "inter": getattr(c, "intermediate_size", 4 * c.hidden_size),
            "kv": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
        }

    cb = torch.empty((), dtype=compute_dtype).element_size()
    s = shape(student)
    weights = _param_bytes(student, weights_dtype)  # training keeps weights_dtype master weights (fp32 with autocast)
    rows = min(config.rollout.batch_size, config.prompts_per_step * config.rollout.n)
    length = config.data.max_prompt_length + config.rollout.max_new_tokens
    per_token_layer = 12 * s["hidden"] + 3 * s["inter"]
    checkpointing = config.gradient_checkpointing is not False and next(student.parameters()).device.type == "cuda"
    act_values = (s["hidden"] * s["layers"] + per_token_layer) if checkpointing else per_token_layer * s["layers"]
    student_parts = {
        "student_weights": weights,
        "student_gradients": weights,
        "adamw_state": 2 * weights,
        "kv_cache": rows * length * s["layers"] * 2 * s["kv"] * s["head_dim"] * cb,
        "update_activations": config.micro_batch_tokens * act_values * cb,
        "student_head_chunk": min(CHUNK_BYTES, config.micro_batch_tokens * _vocab(student) * 4),
    }
    devices: dict[str, dict[str, int]] = {str(next(student.parameters()).device): student_parts}
    if teachers is None:
        teachers = [] if teacher is None else [("teacher", teacher, config.teacher_offload)]
    for name, module, offloaded in teachers:
        # offloaded: weights on CPU; while scoring they visit the student's device (not counted)
        weights_at = "cpu" if offloaded else str(next(module.parameters()).device)
        scores_at = str(next(student.parameters()).device) if offloaded else weights_at
        key = "teacher_weights" if len(teachers) == 1 else f"teacher_weights[{name}]"
        devices.setdefault(weights_at, {})[key] = _param_bytes(module)
        scoring = devices.setdefault(scores_at, {})
        for part, size in (
            ("teacher_activations", config.score_batch_tokens * 4 * shape(module)["hidden"] * cb),
            ("teacher_head_chunk", min(CHUNK_BYTES, config.score_batch_tokens * _vocab(module) * 4)),
        ):
            scoring[part] = max(scoring.get(part, 0), size)
    return devices


def free_memory(device: str) -> tuple[int, int]:
    """(free bytes, bytes this process already holds there): CUDA from the driver (plus torch's reusable cache) and
    torch's allocation; CPU from /proc/meminfo's MemAvailable (or sysconf) and 0 (loaded weights are counted by the
    caller)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return free + cached, torch.cuda.memory_allocated(dev)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, 0
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), 0


def check_memory(
    needs: dict[str, dict[str, int]], *, loaded: dict[str, int] | None = None, free: dict[str, int] | None = None
) -> CheckResult:
    """Compare each device's estimate (`estimate_memory`) minus what is already loaded there with what is free
    (`free_memory`, or `free` given per device). Fail when a device lacks room, warn above 85 % of free."""
    lines, worst = [], 0.0
    for device, parts in needs.items():
        have, held = (free or {}).get(device), 0
        if have is None:
            have, held = free_memory(device)
        already = (loaded or {}).get(device, 0) if held == 0 else held
        total = sum(parts.values())
        more = max(0, total - already)
        worst = max(worst, more / max(have, 1))
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"{device}: needs ~{_gib(total)} ({', '.join(f'{k} {_gib(v)}' for k, v in top)}), "
            f"{_gib(already)} already loaded, {_gib(have)} free"
        )
    detail = "; ".join(lines)
    fix = (
        "lower rollout.batch_size / micro_batch_tokens / score_batch_tokens, enable gradient_checkpointing, "
        "teacher_offload, or put the teacher on another GPU (teacher.device=cuda:1)"
    )
    status: Status = "fail" if worst > 1 else "warn" if worst > 0.85 else "pass"
    return CheckResult("memory", status, round(worst, 3), detail, "" if status == "pass" else fix, hard=True)


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def mini_step(
    config: DistillConfig,
    *,
    generator: Any,
    student: torch.nn.Module,
    student_scorer: Any,
    teacher_scorer: Any,
    prompt_ids: Sequence[Sequence[int]],
    pad_id: int,
    vocab_size: int,
    autocast_dtype: torch.dtype | None,
    prompts: int = 2,
) -> dict[str, float]:
    """Seconds of each phase of one OPD step on `prompts` prompts × rollout.n (rollout, student and teacher scoring,
    a forward/backward of the student through `opd.train.sft.forward_backward`, whose cost is the update's; the
    gradients are dropped). Changes no weights, optimizer or global RNG state."""
    cfg, timings = config, cast(dict[str, float], {})
    device = next(student.parameters()).device
    ids = [list(x) for x in prompt_ids[:prompts]]
    k = diagnostic_top_k(cfg.objective.top_k)
    with timed(timings, "rollout"), autocast(device, autocast_dtype):
        params = SamplingParams(
            n=cfg.rollout.n,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.run.seed,
        )
        rollouts = build_rollouts(ids, generator.generate(ids, params), pad_id=pad_id, device=device)
    with timed(timings, "student"), autocast(device, autocast_dtype):
        scores = student_scorer.score(rollouts, top_k=k, temperature=cfg.rollout.temperature)
    if teacher_scorer is not None:
        with timed(timings, "teacher"):
            serves_ids = teacher_scorer.serves_requested_ids  # vLLM: only its own top-k
            teacher_scorer.score(
                rollouts,
                top_k=k,
                requested_ids=scores.topk_ids if serves_ids else None,
                temperature=cfg.objective.teacher_temperature,
            )
    # On CUDA the timed backward recomputes activations (as the run will: full or selective checkpointing), so the
    # mini-step never needs more memory than training; on CPU the run does not checkpoint either.
    checkpoint = device.type == "cuda" and not getattr(student, "is_gradient_checkpointing", True)
    if checkpoint:
        cast(Any, student).gradient_checkpointing_enable()
    try:
        with timed(timings, "update"):
            forward_backward(
                student,
                rollouts,
                micro_batch_tokens=max(cfg.micro_batch_tokens, 1),
                packed=False,
                autocast_dtype=autocast_dtype,
                vocab_size=vocab_size,
            )
    finally:
        student.zero_grad(set_to_none=True)
        if checkpoint:
            cast(Any, student).gradient_checkpointing_disable()
    timings["sequences"] = rollouts.batch_size
    timings["response_tokens"] = int(rollouts.response_mask.sum())
    return timings


def check_step_time(config: DistillConfig, timings: dict[str, float]) -> CheckResult:
    """Rule: each phase scales linearly with the sequences of a step (prompts_per_step × n) — an upper bound where
    batching is free (GPU decode below its bandwidth limit) and about right on CPU; the mini-step runs uncompiled,
    so compiled layers and CUDA graphs make the real step faster."""
    phases = {k: v for k, v in timings.items() if k in ("rollout", "student", "teacher", "update")}
    scale = config.prompts_per_step * config.rollout.n / max(1, timings["sequences"])
    per_step = sum(phases.values()) * scale
    detail = (
        f"{per_step:.2f} s/step ≈ {per_step * config.run.steps / 3600:.2f} h for {config.run.steps} steps, "
        f"from a mini-step of {int(timings['sequences'])} sequences ({int(timings['response_tokens'])} tokens: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
        + f") × {scale:g}"
    )
    return CheckResult("step_time", "pass", round(per_step, 3), detail)


def loaded_bytes(*models: torch.nn.Module | None) -> dict[str, int]:
    """Bytes of the weights already loaded per device (`check_memory`'s `loaded`), models of None left out."""
    out: dict[str, int] = {}
    for model in models:
        if model is not None:
            device = str(next(model.parameters()).device)
            out[device] = out.get(device, 0) + _param_bytes(model)
    return out
