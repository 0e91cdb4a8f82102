"""Optimizer and learning-rate schedule shared by `opd distill` and `opd sft`.

AdamW's state is 8 bytes a parameter in float32 (two moments) on top of the float32 master weights and gradients:
16 bytes a parameter in all, the largest resident item of a step at the sizes measured (docs/performance.md). Two
ways to shrink what it costs, neither changing the update rule:
- `optim.fused` (default on CUDA): torch's fused AdamW kernel. The foreach implementation allocates a temporary the
  size of every parameter (the `sqrt(v)` denominators, 4 bytes a parameter) at every step; the fused kernel none.
- `optim.state_dtype: bf16`: `AdamW16` below, both moments in bfloat16 (4 bytes a parameter instead of 8).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from opd.config import OptimSpec
from opd.seeds import derive_seed

_CHUNK = 1 << 24  # elements per piece of a parameter in `AdamW16` (bounds its float32 temporaries to ~256 MB)


def build_optimizer(params, spec: OptimSpec) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; no weight decay on biases and norm weights (1-D tensors).
    `spec.state_dtype` picks the moments' storage (`AdamW16` for bf16), `spec.fused` torch's fused kernel."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (float(spec.betas[0]), float(spec.betas[1]))
    if spec.state_dtype == "bf16":
        return AdamW16(groups, lr=spec.lr, betas=betas, eps=spec.eps)
    fused = spec.fused if spec.fused is not None else _fused_by_default(params)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, eps=spec.eps, fused=fused or None)


def _fused_by_default(params: list[torch.Tensor]) -> bool:
    """Fused on CUDA for plain tensors; FSDP's sharded DTensors and CPU keep torch's default (foreach)."""
    from torch.distributed.tensor import DTensor  # heavy to import: only when an optimizer is built

    return bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)


class AdamW16(torch.optim.Optimizer):
    """AdamW with both moments stored in bfloat16; the parameters (float32 master weights) are updated in place.

    The update is torch's AdamW formula (decoupled weight decay, bias-corrected moments), computed in float32 from
    the stored moments, one piece of a parameter at a time (≤ 2^24 elements: bounded temporaries). Only the storage
    of the moments rounds:
    - exp_avg to nearest: with β1 = 0.9 a step replaces a tenth of it, far more than bfloat16's relative spacing
      (2^-8 to 2^-7), so rounding errors decay by 0.9 a step instead of adding up.
    - exp_avg_sq stochastically: with β2 = 0.999 a step changes it by ~0.1%, less than half a bfloat16 spacing, so
      round-to-nearest would freeze it wherever g² stays within a few times v (tests/train/test_optim.py shows it);
      stochastic rounding keeps its expectation exact. The dither comes from a generator seeded with (step,
      parameter index, piece): deterministic, and nothing extra to checkpoint.
    State per parameter: `step` (float32 scalar, as torch's), `exp_avg`, `exp_avg_sq` (bfloat16, the parameter's
    shape). Sharded (FSDP) parameters are updated shard by shard.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        for name, ok, value in (
            ("lr", lr >= 0, lr),
            ("eps", eps >= 0, eps),
            ("weight_decay", weight_decay >= 0, weight_decay),
            ("betas[0]", 0 <= betas[0] < 1, betas[0]),
            ("betas[1]", 0 <= betas[1] < 1, betas[1]),
        ):
            if not ok:
                raise ValueError(f"AdamW16 {name} must be ≥ 0 (betas in [0, 1)), got {value!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every state tensor to its parameter's dtype; the moments go back to bfloat16 (exact:
        they were bfloat16 when saved)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"])
                step_size = lr / (1 - beta1**step)
                bias_correction2_sqrt = math.sqrt(1 - beta2**step)
                pieces = zip(*(_pieces(_local(t)) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])))
                for piece, (p_N, g_N, m_N, v_N) in enumerate(pieces):
                    g = g_N.float()
                    m = m_N.float().lerp_(g, 1 - beta1)
                    v = v_N.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
                    p32 = p_N if p_N.dtype == torch.float32 else p_N.float()
                    p32.mul_(1 - lr * decay).addcdiv_(m, denom, value=-step_size)
                    if p32 is not p_N:
                        p_N.copy_(p32)
                    m_N.copy_(m)
                    store_bf16_stochastic(v_N, v, seed=derive_seed(step, step=index, salt=piece, bits=62))
        return loss


def store_bf16_stochastic(out_N: torch.Tensor, x_N: torch.Tensor, *, seed: int) -> torch.Tensor:
    """Write float32 `x_N` into bfloat16 `out_N`, rounding each value up or down at random with the probabilities
    that make the result unbiased: add 16 uniform random bits below bfloat16's mantissa, then truncate them. (The
    float32 → bfloat16 copy of a value whose low 16 bits are zero is exact.) For finite values; `x_N` is reused."""
    generator = torch.Generator(device=x_N.device).manual_seed(seed)
    bits = x_N.view(torch.int32)
    noise = torch.empty_like(bits).random_(0, 1 << 16, generator=generator)
    bits.add_(noise).bitwise_and_(-65536)
    return out_N.copy_(bits.view(torch.float32))


def adamw_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes AdamW's two moments take for these parameters' trainable ones (this rank's shards), counted at the
    parameters' size: memory that is resident from the optimizer's first step on, not before."""
    return 2 * sum(_local(p).numel() * _local(p).element_size() for p in params if p.requires_grad)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP DTensor (elementwise updates act shard by shard); other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Flat views of ≤ _CHUNK elements (a non-contiguous tensor whole: its views are what gets written)."""
    if not tensor.is_contiguous():
        return [tensor]
    return list(tensor.view(-1).split(_CHUNK))


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


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, max_norm: float
) -> tuple[torch.Tensor, bool, float]:
    """Clip the global grad norm, then step — unless the norm is not finite, in which case the update is skipped
    (gradients dropped) so one bad batch cannot destroy the weights. Returns (grad norm before clipping, stepped, the
    lr this step used — the one to log: the schedule has moved on to the next step's when this returns)."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    stepped = bool(torch.isfinite(grad_norm))  # the one host sync of the update
    lr = optimizer.param_groups[0]["lr"]  # this step's, before the schedule moves on
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm.detach(), stepped, lr


def apply_optim_settings(optimizer: torch.optim.Optimizer, scheduler, spec: OptimSpec) -> list[str]:
    """Make a restored optimizer and schedule run with `spec` (a resume with `--allow-config-change optim.lr=…`):
    the peak lr (every group's `initial_lr`, the scheduler's `base_lrs` and the current lr, recomputed from the
    schedule at its restored position), betas, eps and the weight decay of the decayed group (the first; biases and
    norms stay at 0). Values equal to the restored ones are left untouched (the default path stays bit-identical).
    Returns what changed, `name: old → new`."""
    changed: list[str] = []

    def put(group: dict, key: str, value: Any, label: str) -> None:
        if group.get(key) != value:
            changed.append(f"optim.{label}: {group.get(key)!r} → {value!r}")
            group[key] = value

    groups = optimizer.param_groups
    for index, group in enumerate(groups):
        put(group, "betas", tuple(spec.betas), "betas")
        put(group, "eps", spec.eps, "eps")
        if index == 0:
            put(group, "weight_decay", spec.weight_decay, "weight_decay")
    base_lrs = getattr(scheduler, "base_lrs", None)
    if base_lrs is not None and any(base != spec.lr for base in base_lrs):
        changed.append(f"optim.lr: {base_lrs[0]!r} → {spec.lr!r}")
        scheduler.base_lrs = [spec.lr for _ in base_lrs]
        for group in groups:
            group["initial_lr"] = spec.lr
    if base_lrs is not None and hasattr(scheduler, "lr_lambdas"):  # the current lr of the (possibly new) schedule
        for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            lr = base * factor(scheduler.last_epoch)
            if group["lr"] != lr:
                group["lr"] = lr
                scheduler._last_lr = [g["lr"] for g in groups]
    # names without duplicates (every group reports the same betas / eps change)
    return list(dict.fromkeys(changed))
