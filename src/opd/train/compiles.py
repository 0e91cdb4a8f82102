"""What torch.compile has built in this process: the graph count a step's `compile/*` metrics read
(`compiled_graphs`) and, after every step that compiled, what and why (`CompileLog`, `describe_compiles`); and what
keys the warm-up's artefacts in the compile cache (`warm_up_cache_parts`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from opd.train.state import Trainer

__all__ = ["CompileLog", "compiled_graphs", "describe_compiles", "warm_up_cache_parts"]


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (`compile/graphs`: a step that adds some recompiled)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class CompileLog:
    """What torch.compile built since the last `take()`: the graphs (`compiled_graphs`) and, per function dynamo
    compiled again, the guard that turned its newest cached version down (dynamo records one failed guard per cached
    version it tried, newest first, in `torch._dynamo.utils.guard_failures`). A run prints it after every step that
    compiled, so that a recompile after the warm-up says where it came from."""

    def __init__(self) -> None:
        self.graphs = compiled_graphs()
        self.failures = {code: len(reasons) for code, reasons in _guard_failures().items()}

    def take(self) -> tuple[int, list[str]]:
        """(graphs compiled since the last call, one "fn (file:line): guard" per function compiled again)."""
        graphs, recompiled = compiled_graphs(), []
        for code, reasons in list(_guard_failures().items()):
            if new := reasons[self.failures.get(code, 0) :]:
                guard = " ".join(str(new[0]).splitlines()[0].split())[:200]
                recompiled.append(f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno}): {guard}")
            self.failures[code] = len(reasons)
        added, self.graphs = graphs - self.graphs, graphs
        return added, recompiled


def describe_compiles(graphs: int, recompiled: list[str]) -> str | None:
    """`CompileLog.take`'s result in words: "N graphs; recompiled: fn (file:line): guard; ...", without the recompile
    part for graphs of functions compiled for the first time; None when nothing compiled."""
    if graphs <= 0 and not recompiled:
        return None
    return f"{graphs} graph{'s' if graphs != 1 else ''}" + (
        f"; recompiled: {'; '.join(recompiled)}" if recompiled else ""
    )


def _guard_failures() -> dict[Any, list]:
    """dynamo's failed guards per function (code object), kept since the process started or dynamo was reset."""
    return getattr(torch._dynamo.utils, "guard_failures", {})


def warm_up_cache_parts(tr: Trainer) -> dict[str, Any]:
    """The parts of the compile cache's key (`opd.compile_cache.compile_key`) for `opd.train.step.warm_up`: what its
    graphs depend on beyond the code and the machine (`opd.compile_cache.compile_key`): the
    student's architecture (not its path: a resume loads a checkpoint of the same model), the teachers, the shapes
    the warm-up's layouts derive from, the dtypes. Not the decode row counts: they follow the memory free (a resume's
    optimizer state), and torch's caches key each graph by its shapes, so a count met anew compiles and is added.
    Too much here costs a compile; too little, a larger file, never a wrong graph."""
    cfg = tr.config
    student: Any = tr.models.student
    config: Any = getattr(student, "config", None)
    architecture = config.to_dict() if hasattr(config, "to_dict") else {"class": type(student).__name__}
    architecture.pop("_name_or_path", None)  # where it was loaded from: the model, or the checkpoint resumed
    lengths = [len(ids) for ids in tr.data.prompt_ids]
    return {
        "student": architecture,
        "teachers": [entry.model_dump(mode="json") for entry in cfg.teacher_entries()],
        "weights_dtype": str(next(student.parameters()).dtype),
        "autocast_dtype": str(tr.models.autocast_dtype),
        "prompt_lengths": [min(lengths), max(lengths)] if lengths else [],
        "world": [tr.run.dist.rank, tr.run.dist.world_size],
        **cfg.model_dump(
            mode="json",
            include={
                "rollout",
                "objective",
                "prompts_per_step",
                "micro_batch_tokens",
                "score_batch_tokens",
                "teacher_offload",
                "gradient_checkpointing",
                "activation_budget",
                "compile",
            },
        ),
    }
