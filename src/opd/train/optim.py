"""Optimizer and learning-rate schedule shared by `opd distill` and `opd sft`."""

from __future__ import annotations

import math

import torch

from opd.config import OptimSpec


def build_optimizer(params, spec: OptimSpec) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on biases and norm weights (1-D tensors)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps)


def lr_multiplier(step: int, total_steps: int, spec: OptimSpec) -> float:
    """Factor on the peak lr at optimizer step `step` (0-based): linear warmup, then constant / cosine / linear
    decay to `min_lr_ratio` at `total_steps`."""
    if spec.warmup_steps and step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    span = max(1, total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    if spec.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, spec: OptimSpec):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, spec))


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, max_norm: float) -> tuple[torch.Tensor, bool]:
    """Clip the global grad norm, then step — unless the norm is not finite, in which case the update is skipped
    (gradients dropped) so one bad batch cannot destroy the weights. Returns (grad norm before clipping, stepped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    stepped = bool(torch.isfinite(grad_norm))  # the one host sync of the update
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm.detach(), stepped
