"""The state of an `opd distill` run: the loaded models (`Models`, what the recipe's setup derives from the config),
the `Trainer` every OPD step acts on (`opd.train.step`), and the records a step passes from phase to phase (`Batch`,
`Scores`, `Update`, `EngineCounts`). State only, no construction: the recipe builds the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opd.config import DistillConfig
from opd.report.gpu_busy import GpuBusy
from opd.report.sinks import MetricsSink
from opd.rollout.base import Generator
from opd.rollout.episodes import EpisodeOutput
from opd.teacher.base import TeacherScorer
from opd.teacher.local import LocalScorer
from opd.teacher.registry import RoutedTeacher
from opd.tools.environments import Environment
from opd.train.distributed import SINGLE, DistInfo
from opd.train.overlap import AheadGenerator, AheadStream, PendingRollouts
from opd.train.sampler import PromptSampler
from opd.train.stream import RolloutStream, StreamBatch
from opd.types import Prompt, Rollouts, TokenScores

__all__ = [
    "Batch",
    "EngineCounts",
    "Models",
    "RunState",
    "Scores",
    "TrainData",
    "TrainEngines",
    "TrainModels",
    "TrainOptimization",
    "Trainer",
    "Update",
]


@dataclass
class Models:
    """The loaded models and what setup derived from them."""

    student: Any  # sharded by FSDP2 under torchrun
    tokenizer: Any  # loaded with the student's weights (a checkpoint's on resume)
    student_path: str  # what the weights were loaded from: the model, or the checkpoint resumed
    device: torch.device
    weights_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    vocab_size: int  # the tokenizer's size: ids beyond it are embedding padding rows (SPEC §1)
    student_scorer: LocalScorer
    teachers: list[RoutedTeacher]  # every teacher (config.teacher_entries()): a list of one for `teacher:`


@dataclass
class TrainModels:
    """The models a step runs and how: the student, its scorers (its own, a frozen reference's, every teacher's)."""

    student: torch.nn.Module
    tokenizer: Any  # a Hugging Face tokenizer: pad_token_id, decode, convert_ids_to_tokens
    student_scorer: TeacherScorer  # the student's own no-grad scores (`opd.teacher.local.LocalScorer`)
    reference_scorer: TeacherScorer | None  # a frozen copy of the initial student, only with objective.kl_coef
    vocab_size: int
    # the run's teachers (`teachers:`; a list of one for `teacher:`; none for GRPO): each scores the rows of the
    # prompts routed to it (`TrainData.prompt_teacher`)
    teachers: list[RoutedTeacher] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None
    activation_budget: float | None = None  # selective checkpointing of compiled layers (opd.models.activation_budget)
    compiled_layers: bool = False  # the student's layers run compiled: `warm_up` first, `compile/*` metrics per step


@dataclass
class TrainData:
    """The prompt set as training sees it, the sampler over it and every prompt's teacher."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    sampler: PromptSampler
    prompt_teacher: list[int] = field(default_factory=list)  # the index into `teachers` of every prompt's teacher


@dataclass
class TrainEngines:
    """The rollout engines: the step's own, and with rollout.overlap a snapshot of the student and the engine over
    it (`opd.train.overlap.overlap_generator`), wrapped into `ahead`, which generates the next step's rollouts while
    this step scores and updates; with rollout.partial the stream of in-flight samples (`ahead` then an
    `AheadStream` that builds the stream's next batch). The recipe builds both (`opd.train.overlap.rollout_ahead`)."""

    generator: Generator
    rollout_model: torch.nn.Module | None = None
    rollout_generator: Generator | None = None
    ahead: AheadGenerator | AheadStream | None = None
    stream: RolloutStream | None = None
    environment: Environment | None = None  # rollout.tools: every rollout is an episode with it (opd.train.episodes)


@dataclass
class TrainOptimization:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class RunState:
    """Where the run writes and how far it is: the counters a checkpoint carries, the sink, the process group."""

    run_dir: Path
    sink: MetricsSink | None = None  # rank 0's, opened by setup; None on the other ranks
    dist: DistInfo = SINGLE  # this process's rank / world size (torchrun); SINGLE without torchrun
    step: int = 0
    skipped_steps: int = 0
    history: list[dict] = field(default_factory=list)
    teacher_manifest: list[dict] = field(default_factory=list)  # what checkpoints record of the teachers
    # benchmarks: a list → each step appends CUDA memory (allocated / peak since the last mark, GiB) after each phase
    memory_trace: list | None = None
    gpu_busy: GpuBusy | None = None  # CUDA with NVML: the device's utilization over each step (`gpu/busy_frac`)


@dataclass
class Trainer:
    """Everything a step needs, built once by the recipe's `setup`, in five groups (`tr.models.student`,
    `tr.run.step`). State only: `opd.train.step` acts on it."""

    config: DistillConfig
    models: TrainModels
    data: TrainData
    engines: TrainEngines
    optimization: TrainOptimization
    run: RunState

    @property
    def pending_rollouts(self) -> PendingRollouts | StreamBatch | None:
        """What was generated ahead for the next step (rollout.overlap); the checkpoint carries it."""
        return None if self.engines.ahead is None else self.engines.ahead.pending


@dataclass
class EngineCounts:
    """The static engine's decode work summed over a step's calls (`StaticGenerator.stats` after each): decode steps,
    the rows they ran over (`row_steps`), tokens decoded, and the widest call's rows (`call_rows`); the vLLM engine's
    prompt tokens read from its prefix cache (`VLLMGenerator.stats`: an episode's later turns re-send the
    conversation so far) and those it prefilled."""

    decode_steps: int = 0
    row_steps: int = 0
    decoded_tokens: int = 0
    call_rows: int = 0
    cached_tokens: int | None = None  # None: no call reported its prefix cache
    prefilled_tokens: int = 0

    def add(self, generator: Generator) -> None:
        stats = getattr(generator, "stats", None) or {}
        if "cached_tokens" in stats:  # a VLLMGenerator
            self.cached_tokens = (self.cached_tokens or 0) + stats["cached_tokens"]
            self.prefilled_tokens += stats["prefilled_tokens"]
        if "row_steps" in stats:  # a StaticGenerator that has run a call
            self.decode_steps += stats["decode_steps"]
            self.row_steps += stats["row_steps"]
            self.decoded_tokens += stats["decoded_tokens"]
            self.call_rows = max(self.call_rows, stats["rows"])

    def metrics(self) -> dict[str, float]:
        """`rollout/decode_steps`, `rollout/live_rows` (the rows a decode step ran over, on average),
        `rollout/row_occupancy` (the share of those rows that decoded a token) and `rollout/call_rows` (the rows of the
        step's widest call: the count a memory or token cap gave it, which names the shape a compile in the step met),
        empty before any decode step; `rollout/prefix_cached_tokens` and `rollout/prefilled_tokens` where the engine
        reports its prefix cache (vLLM)."""
        cache: dict[str, float] = (
            {}
            if self.cached_tokens is None
            else {"rollout/prefix_cached_tokens": self.cached_tokens, "rollout/prefilled_tokens": self.prefilled_tokens}
        )
        if not self.decode_steps:
            return cache
        return cache | {
            "rollout/decode_steps": self.decode_steps,
            "rollout/live_rows": self.row_steps / self.decode_steps,
            "rollout/row_occupancy": self.decoded_tokens / self.row_steps,  # ≥ decode_steps ≥ 1 here
            "rollout/call_rows": self.call_rows,
        }


@dataclass
class Batch:
    """This rank's rollouts of one step: the global indices of its prompts and the student's samples of them."""

    indices: list[int]
    rollouts: Rollouts
    # optimizer steps between the sampling policy and the current one (1: generated ahead; partial: the oldest token's)
    policy_lag: int
    versions_BT: torch.Tensor | None = None  # rollout.partial: per token, the step whose weights sampled it
    stream_metrics: dict = field(default_factory=dict)  # rollout.partial: partial/calls, partial/dropped, ...
    engine_counts: EngineCounts | None = None  # the static engine's decode work in this step's foreground calls
    episodes: EpisodeOutput | None = None  # rollout.tools: the episodes the rows are (final turns, tool figures)


@dataclass
class Scores:
    """What the models say about a batch's tokens, and the rollouts' grades."""

    student: TokenScores  # the behaviour policy, no grad: sampled log-probs, top-k support, entropy
    reference_BT: torch.Tensor | None  # a frozen reference's sampled-token log-probs (objective.kl_coef)
    teacher: TokenScores | None  # sampled token, its own top-k, log-probs at the student's top-k
    student_at_teacher_BTK: torch.Tensor | None  # s at the teacher's top-k (strategies with teacher slots)
    texts: list[str]
    correct: list[bool] | None  # None when the prompts carry no answers
    teacher_hidden_BTE: torch.Tensor | None = None  # the teacher's hidden states (a full-vocabulary objective)
    exact_kl_BT: torch.Tensor | None = None  # the exact per-position KL(p‖q) (objective.token_reward full_*)
    teacher_answer: dict[str, float] | None = None  # teacher/bytes_per_token and teacher/head_bytes


@dataclass
class Update:
    grad_norm: torch.Tensor  # before clipping
    loss_metrics: list[dict]  # per real micro-batch, detached
    lr: float = 0.0  # the lr this update used (read before the schedule stepped)
