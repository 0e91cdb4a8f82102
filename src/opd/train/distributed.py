"""torchrun + FSDP2: one code path for 1..N processes.

    torchrun --nproc_per_node 8 -m opd.cli distill --config configs/opd_qwen3_1.7b_from_4b.yaml
    torchrun --nproc_per_node 2 -m opd.cli distill --config …  # CPU too: gloo (tests/features/test_distributed.py)

Without torchrun (no `WORLD_SIZE`) everything here is a no-op: world size 1, no process group, the model unwrapped.
With it every rank keeps its slice of the same seeded global batch and the loss divides by the global token count,
so the update equals the single-process one; generation and no-grad scoring run inside `gathered` (no collectives in
the forwards: ranks decode different lengths); checkpoints hold the full state, so N processes resume at M. In full,
with the memory per rank: docs/design.md, "opd.train.distributed". Omitted: sharding the teacher, hybrid sharding
across hosts (HSDP), FSDP mixed-precision policies (the trainer's autocast is used), CPU offload of the shards.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

# torch.distributed.fsdp and torch.distributed.checkpoint are imported inside the functions that use them: they are
# heavy to import, and a single-process run never needs them.


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits. world_size == 1 means no process group (plain single-process run)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device | None  # the rank's device under torchrun; None = the config decides (single process)
    is_main: bool


SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=None, is_main=True)

# Ranks wait for rank 0 while it evaluates or writes a checkpoint: collectives must not time out meanwhile.
_TIMEOUT = datetime.timedelta(hours=4)


def init_distributed() -> DistInfo:
    """Join the torchrun process group (gloo on CPU, nccl on CUDA) from its env vars (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT). Without torchrun, or with WORLD_SIZE=1, returns `SINGLE` and creates no process group.
    Idempotent: a second call reuses the group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=_TIMEOUT, device_id=device if device.type == "cuda" else None)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, is_main=rank == 0)


def destroy_distributed(info: DistInfo) -> None:
    """Leave the process group together: without the barrier a rank that finishes first (rank 1 while rank 0 still
    writes its results) tears down gloo's connections under its peer, which then aborts ("terminate called without
    an active exception", seen in 1 of 4-6 runs of the CPU scale test). Called on the success path only."""
    if info.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """`sys.exit(code)`, except in a torchrun worker (WORLD_SIZE > 1): there the Python exit handlers run, the streams
    are flushed, and the process ends without the interpreter's teardown. Why: the gloo process group outlives
    `destroy_process_group` (DTensor's sharding caches keep its DeviceMesh; its `pt_gloo_runloop` and `gloo_tcp_loop`
    threads still run at exit), and tearing the interpreter and C++ statics down under those threads aborted a rank in
    about 1 CPU run of 5-10 after all its work was written ("terminate called without an active exception",
    SIGABRT): a finished run's exit status said it failed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()  # what a normal exit would run: logging's flush, multiprocessing's children, ...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say on it
            pass
    os._exit(code)


def shard_model(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the root (which then owns the embeddings, final norm and head).
    No-op for world size 1. Build the optimizer *after* this: its parameters become sharded DTensors."""
    if info.world_size == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    layers = getattr(cast(Any, model).get_decoder(), "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__}: no `.layers` in its decoder to shard with FSDP2")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
    # The root keeps its parameters (embeddings, final norm, head) unsharded from forward to backward: the trainer
    # projects hidden states with the head weight *after* the model's forward (`opd.scoring`), which must be the
    # unsharded tensor, not a DTensor shard.
    fully_shard(model, reshard_after_forward=False)
    return model


def fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: torch.nn.Module, info: DistInfo):
    """Hold all of `model`'s parameters unsharded for the block (one all-gather per FSDP module on entry, none
    inside), so no-grad forwards may run any number of times on each rank without matching collectives — generation,
    scoring, rank-0-only evaluation. Every rank must enter it. No-op for world size 1."""
    modules = fsdp_modules(model) if info.world_size > 1 else []
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)  # as `shard_model` set them


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of `tensor` over ranks (a new tensor; the input is untouched). Identity for world size 1."""
    if info.world_size == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def max_over_ranks(value: int, info: DistInfo) -> int:
    if info.world_size == 1:
        return value
    out = torch.tensor([value], dtype=torch.long, device=info.device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def reduce_metrics(metrics: dict[str, Any], info: DistInfo, *, summed: tuple[str, ...] = ()) -> dict[str, Any]:
    """Combine per-rank scalar metrics: the sum over ranks for keys in `summed` (quantities already divided by a
    global count, throughputs), the mean over ranks otherwise (None/non-numeric values ignored). Means of per-rank
    token means are exact only when ranks hold equal token counts; they are for monitoring. One small gather of
    Python dicts, so ranks may even report different keys."""
    if info.world_size == 1:
        return metrics
    per_rank: list[dict] = [None] * info.world_size  # type: ignore[list-item]
    dist.all_gather_object(per_rank, metrics)
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]
        if not values:
            out[key] = metrics.get(key)
        elif key not in summed and all(v == values[0] for v in values):
            out[key] = values[0]  # the same on every rank (lr, grad norm, step counters): kept exactly, type too
        else:
            out[key] = sum(values) if key in summed else sum(values) / len(values)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (e.g. the run directory, whose default name has a timestamp)."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def gathered_bytes(model: torch.nn.Module, info: DistInfo) -> int:
    """Bytes `gathered` allocates on each rank: a full, unsharded copy of every parameter (in the parameters' dtype:
    float32 master weights take 4 bytes a parameter), next to the rank's shard. 0 for world size 1."""
    if info.world_size == 1:
        return 0
    return sum(param.numel() * param.element_size() for param in model.parameters())


def full_state_dict(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor] | None:
    """Full (unsharded) weights on CPU, on rank 0, for `save_pretrained(state_dict=…)`; an empty dict on other ranks.
    Every rank must call it (it all-gathers). None for world size 1: save the module as it is."""
    if info.world_size == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return cast(dict, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def all_full_weights(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on every rank, on the rank's device: each rank's own inference engine (vLLM) loads
    them. Every rank must call it (it all-gathers). The module's own state dict for world size 1."""
    if info.world_size == 1:
        return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return cast(dict, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False)))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    """The optimizer state: `optimizer.state_dict()` for world size 1 (unchanged format); otherwise the full,
    parameter-name-keyed state on rank 0 (empty elsewhere). Every rank must call it."""
    if info.world_size == 1:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, info: DistInfo
) -> None:
    """Inverse of `full_optimizer_state_dict`, whichever world size wrote `state`: both layouts hold the whole state,
    so a checkpoint of N processes resumes at M. The parameter-name-keyed one (N > 1) loads at any world size (each
    rank keeps its shard); the index-keyed one (N = 1) loads as it is with one process, and is keyed by parameter name
    first under FSDP."""
    named = is_name_keyed(state)
    if info.world_size == 1 and not named:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not named:
        state = name_keyed_optimizer_state(model, optimizer, state)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def is_name_keyed(state: dict) -> bool:
    """Whether an optimizer state dict names its parameters (`get_optimizer_state_dict`) rather than numbering them
    (`Optimizer.state_dict`)."""
    params = [p for group in state.get("param_groups", []) for p in group["params"]]
    return bool(params) and isinstance(params[0], str)


def name_keyed_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """`Optimizer.state_dict()` layout (parameters numbered in the order of the optimizer's groups) → the
    parameter-name-keyed layout of `get_optimizer_state_dict(full_state_dict=True)`. `optimizer` must be built the same
    way as the one that wrote `state` (`opd.train.optim.build_optimizer` over the same model: same groups, same order),
    sharded or not: parameter names do not change under `fully_shard`."""
    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = sum(len(group["params"]) for group in state["param_groups"])
    if saved != len(order):
        raise ValueError(
            f"the checkpoint's optimizer state has {saved} parameters, this model's optimizer "
            f"{len(order)}: it was written for another model"
        )
    return {
        "state": {order[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }
