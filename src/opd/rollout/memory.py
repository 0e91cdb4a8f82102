"""How many sequences an in-process engine decodes at once: the device memory free when `generate` is called (after
the student, the teacher, the optimizer state and every other resident buffer), minus a safety margin and the call's
fixed buffers, divided by what one row costs. Each engine states its own costs (`RowCost`); this module holds the
rule (`rows_that_fit`, the free / margin / rows terms in docs/design.md, "opd.rollout.memory") and the one-line
error for a sequence that cannot fit at all.

Sessions (`opd.rollout.sessions`): the caches episodes hold between turns are resident, so the free figure a call
reads is already less by them; a session call also keeps back what its sequences will hold when it ends (their
context and limit, `kv_bytes_per_token` each), as the static engine's `plan_rows(reserve_bytes=...)` does.

On CPU nothing is sized (None): the host's memory is not the engine's to budget, and the tests inject a figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

GiB = 2**30
MARGIN_BYTES = 1 * GiB
MARGIN_FRACTION = 0.04

MemoryFn = Callable[[torch.device], "tuple[int, int] | None"]


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free bytes for new tensors, total bytes) of a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached_unused, total


class ModuleMemory:
    """What the in-process engines (`TorchGenerator`, `StaticGenerator`) share: they run the trainer's module
    `self.model` on its device and read the free memory there, or from `self.free_memory` (a fixed figure in tests)."""

    model: torch.nn.Module
    free_memory: Callable[[torch.device], tuple[int, int] | None] | None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of the model's device now, or None (no limit)."""
        return (self.free_memory or device_memory)(self.device)


def margin_bytes(total: int) -> int:
    return int(MARGIN_BYTES + MARGIN_FRACTION * total)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys + values of one token over every layer: 2 · layers · kv heads · head dim · bytes per element."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def prefill_bytes_per_token(config, dtype: torch.dtype) -> int:
    """What a Hugging Face prefill holds per prompt token: its `DynamicCache` entry plus one layer's activations
    (residual and normed hidden states, q/k/v, gate/up/activation) counted in float32, as under autocast."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    activations = 4 * (4 * config.hidden_size + 2 * (heads + 2 * kv_heads) * head_dim + 3 * config.intermediate_size)
    return kv_bytes_per_token(config, dtype) + activations


@dataclass(frozen=True)
class RowCost:
    """What one decoding row holds (`per_row`, bytes) and what a call holds whatever its row count (`fixed`), both
    as named parts for messages and stats. `per_slot`: the bytes of one row and the call that grow with each slot of
    the sequence (KV cache, output columns, RoPE table), so that the longest sequence that fits can be said."""

    per_row: dict[str, int]
    fixed: dict[str, int] = field(default_factory=dict)
    per_slot: int = 0

    @property
    def row_bytes(self) -> int:
        return sum(self.per_row.values())

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())


def rows_that_fit(memory: tuple[int, int] | None, cost: RowCost) -> int | None:
    """⌊(free - margin - fixed) / per_row⌋ (≥ 0), or None when the memory is unknown (no limit)."""
    if memory is None:
        return None
    free, total = memory
    return max(0, (free - margin_bytes(total) - cost.fixed_bytes) // max(1, cost.row_bytes))


def check_one_row_fits(
    memory: tuple[int, int] | None,
    cost: RowCost,
    *,
    prompt_tokens: int,
    new_tokens: int,
    slots: int,
    reserve_bytes: int = 0,
    where: str = "",
    names: tuple[str, str] = ("prompt length", "max_new_tokens"),
) -> None:
    """Raise ValueError (one line) when not even one row of prompt_tokens + new_tokens (holding `slots` KV slots)
    fits in the free memory less `reserve_bytes` (memory that will be resident by then, e.g. optimizer state not yet
    allocated). The message says the longest response that would fit after such a prompt."""
    if memory is None:
        return
    free, total = memory
    usable = free - reserve_bytes - margin_bytes(total) - cost.fixed_bytes
    if usable >= cost.row_bytes:
        return
    usable += cost.fixed_bytes  # one row: everything but the per-slot part is fixed
    fixed = cost.row_bytes + cost.fixed_bytes - cost.per_slot * slots
    fitting_slots = (usable - fixed) // cost.per_slot if cost.per_slot else 0
    fitting_new = fitting_slots - (slots - new_tokens)
    advice = (
        f"at most {names[1]}={fitting_new} fits after a {prompt_tokens}-token prompt"
        if fitting_new >= 1
        else f"not even one token fits after a {prompt_tokens}-token prompt: lower {names[0]} or free memory"
    )
    raise ValueError(
        f"generation{where}: one sequence of {prompt_tokens} prompt + {new_tokens} new tokens needs "
        f"{_size(cost.row_bytes)} ("
        + ", ".join(f"{k} {_size(v)}" for k, v in cost.per_row.items())
        + f") plus {_size(cost.fixed_bytes)} per call, but {_size(free)} are free"
        + (
            f" ({_size(reserve_bytes)} will not be free: optimizer state and buffers not allocated yet)"
            if reserve_bytes
            else ""
        )
        + f" and {_size(margin_bytes(total))} are kept as margin; {advice}"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB / 100 else f"{nbytes / 2**20:.2f} MiB"
