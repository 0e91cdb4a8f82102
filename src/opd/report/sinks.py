"""Where per-step metrics go: `metrics.jsonl` always (appended, flushed, resumable); TensorBoard and W&B when
asked for. Values arrive as plain floats: the trainer syncs once per step, not per metric."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from opd.io import append_jsonl, read_step_records, repair_jsonl, write_jsonl


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        repair_jsonl(self.path)
        if resume_step is not None and self.path.exists():
            # drop lines of steps after the checkpoint we resume from: they will be recomputed
            # (every line an object with a step number, else one line naming the file: damage is never kept)
            kept = [r for _, r in read_step_records(self.path) if r["step"] <= resume_step]
            write_jsonl(self.path, kept)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "run.tensorboard=true needs the tensorboard package: pip install tensorboard"
                ) from None
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("run.wandb_project needs the wandb package: pip install wandb") from None
            self._wandb = wandb.init(project=wandb_project, name=Path(run_dir).name, config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        append_jsonl(self.path, [record])
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def progress_bar(console: Any):
    """The one progress-bar layout of every long command (eval, distill, sft, rollout)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
