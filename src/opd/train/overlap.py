"""Rollout-ahead (`rollout.overlap`): step t+1's rollouts are generated during step t, in a background thread, from a
snapshot of the step-t weights (one step of policy lag, corrected by truncated importance weights).

`AheadGenerator` wraps the engine over the snapshot: `start` refreshes the snapshot from the student and starts the
next step's generation, `wait` collects it as `PendingRollouts`, `take` hands them to the next step. With
rollout.partial, `AheadStream` does the same for the rollout stream: its next batch (`RolloutStream.next_batch`) is
built in the background, its tokens versioned by the snapshot's step. Their state (the pending rollouts, generated
from weights that no checkpoint holds) travels in the trainer state, so a resume replays them exactly. Omitted: more
than one step ahead, and several processes (the config refuses both).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from opd.config import DistillConfig
from opd.rollout import GenerationOutput, SamplingParams, make_generator
from opd.rollout.base import Generator
from opd.rollout.episodes import EpisodeOutput, episodes_from_state, episodes_state_dict
from opd.rollout.static_engine import StaticGenerator
from opd.train.common import autocast
from opd.train.stream import GenerateFn, RolloutStream, StreamBatch, default_segment


@dataclass
class PendingRollouts:
    """Rollouts generated one step ahead (rollout.overlap): the global prompt indices of this rank's slice and the
    engine's output for them, generated from the weights before the previous update."""

    indices: list[int]
    output: GenerationOutput
    episodes: EpisodeOutput | None = None  # rollout.tools: the episodes `output` lays out

    def state_dict(self) -> dict:
        episodes = None if self.episodes is None else episodes_state_dict(self.episodes)
        return {"indices": self.indices, **self.output.state_dict(), "episodes": episodes}

    @classmethod
    def from_state(cls, state: dict | None) -> PendingRollouts | None:
        if not state:
            return None
        episodes = state.get("episodes")  # absent from checkpoints written before episodes ran ahead
        return cls(
            indices=list(state["indices"]),
            output=GenerationOutput.from_state(state),
            episodes=None if episodes is None else episodes_from_state(episodes),
        )


class AheadGenerator:
    """The engine over a snapshot of the student that generates the next step's rollouts while this step scores and
    updates. One generation is in flight at a time: `start` → `wait` → `take`."""

    def __init__(self, snapshot: torch.nn.Module, generator: Generator):
        self.snapshot, self.generator = snapshot, generator
        self.pending: PendingRollouts | None = None
        self._running: tuple[list[int], _Background] | None = None

    def start(
        self,
        student: torch.nn.Module,
        indices: list[int],
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        episodes: Callable[[Generator], EpisodeOutput] | None = None,
    ) -> None:
        """Copy the student's current weights into the snapshot and generate `prompt_ids` from it in the background
        (on CUDA in its own stream, ordered after the copy); with rollout.tools `episodes(generator)` runs instead
        (the episodes of these prompts, their tool calls answered in the background too)."""
        refresh_snapshot(self.snapshot, student)

        def run() -> GenerationOutput | EpisodeOutput:
            return self.generator.generate(prompt_ids, params) if episodes is None else episodes(self.generator)

        self._running = (indices, _Background(run, device, autocast_dtype))

    def wait(self) -> None:
        """Wait for the generation `start` began (re-raising its error); its rollouts become `pending`."""
        if self._running is None:
            return
        (indices, background), self._running = self._running, None
        result = background.result()
        if isinstance(result, EpisodeOutput):
            self.pending = PendingRollouts(indices=indices, output=result.output, episodes=result)
        else:
            self.pending = PendingRollouts(indices=indices, output=result)
        self.generator.release()

    def take(self) -> PendingRollouts | None:
        """The rollouts generated ahead for this step (None at the first step), no longer pending."""
        pending, self.pending = self.pending, None
        return pending

    def state_dict(self) -> dict | None:
        return None if self.pending is None else self.pending.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.pending = PendingRollouts.from_state(state)


class AheadStream:
    """rollout.partial with rollout.overlap: step t+1's batch of the rollout stream, built during step t by the engine
    over a snapshot of the weights at the start of step t (its new tokens' version is t). One build in flight at a
    time: `start` → `wait` → `take`; the stream itself is only touched by the build while one is in flight."""

    def __init__(self, snapshot: torch.nn.Module, generator: Generator, stream: RolloutStream):
        self.snapshot, self.generator, self.stream = snapshot, generator, stream
        self.pending: StreamBatch | None = None
        self._running: _Background | None = None

    def start(
        self,
        student: torch.nn.Module,
        step: int,
        draw: Callable[[], list[int]],
        prompt_ids: Sequence[Sequence[int]],
        generate: GenerateFn,
        *,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        """Copy the student's current weights (those of step `step - 1`) into the snapshot and build step `step`'s
        batch from them in the background; `generate` calls this object's `generator`."""
        refresh_snapshot(self.snapshot, student)
        build = functools.partial(self.stream.next_batch, step, draw, prompt_ids, generate, version=step - 1)
        self._running = _Background(build, device, autocast_dtype)

    def wait(self) -> None:
        """Wait for the build `start` began (re-raising its error); its batch becomes `pending`."""
        if self._running is None:
            return
        background, self._running = self._running, None
        self.pending = background.result()
        self.generator.release()

    def take(self) -> StreamBatch | None:
        """The batch built ahead for this step (None at the first step), no longer pending."""
        pending, self.pending = self.pending, None
        return pending

    def state_dict(self) -> dict | None:
        return None if self.pending is None else self.pending.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.pending = StreamBatch.from_state(state)


def refresh_snapshot(snapshot: torch.nn.Module, student: torch.nn.Module) -> None:
    """The student's current weights into the snapshot (on CUDA queued before the background stream starts)."""
    with torch.no_grad():
        for source, target in zip(student.parameters(), snapshot.parameters()):
            target.copy_(source)


def overlap_generator(
    student: torch.nn.Module, tokenizer: Any, config: DistillConfig, vocab_size: int, dtype: torch.dtype | None
) -> tuple[torch.nn.Module, Generator]:
    """rollout.overlap: a frozen copy of the student in the rollout dtype (autocast's, else the weights') and the
    configured engine over it, what an `AheadGenerator` wraps (`rollout_ahead`).
    The copy's weights are refreshed from the student at the start of every step (`AheadGenerator.start`)."""
    snapshot = rollout_snapshot(student, dtype or next(student.parameters()).dtype)
    generator = make_generator(
        snapshot,
        tokenizer,
        max_batch_size=config.rollout.batch_size,
        vocab_size=vocab_size,
        engine=config.rollout.engine,
    )
    if isinstance(generator, StaticGenerator):
        # torch.compile's tracing state is process-wide: a compiled call in this background thread while the main
        # thread compiles a layer fails ("FX to symbolically trace a dynamo-optimized function"); graphs still replay
        generator.compile = False
    return snapshot, generator


def rollout_ahead(
    config: DistillConfig,
    rollout_model: torch.nn.Module | None,
    rollout_generator: Generator | None,
    make_stream: Callable[..., RolloutStream] = RolloutStream,
) -> tuple[RolloutStream | None, AheadGenerator | AheadStream | None]:
    """What the recipe builds around the step's engines: with rollout.partial the stream of in-flight samples (made by
    `make_stream`: with rollout.tools an `opd.train.episodes.EpisodeStream`), and with rollout.overlap (a snapshot
    and its engine, `overlap_generator`) the generator of the next step's rollouts, an `AheadStream` over the stream
    when there is one."""
    spec, stream = config.rollout, None
    if spec.partial:
        # a sample spans the versions it may be sampled by: with overlap its first token already lags one step
        ahead = int(rollout_model is not None)
        segment = default_segment(spec.max_new_tokens, spec.max_staleness, ahead, spec.partial_early_stop)
        stream = make_stream(
            prompts_per_step=config.prompts_per_step,
            n=spec.n,
            max_new_tokens=spec.max_new_tokens,
            segment=spec.partial_segment or segment,
            max_staleness=spec.max_staleness,
            early_stop=spec.partial_early_stop,
        )
    if rollout_model is None:
        return stream, None
    assert rollout_generator is not None  # the recipe builds both (overlap_generator)
    if stream is None:
        return None, AheadGenerator(rollout_model, rollout_generator)
    return stream, AheadStream(rollout_model, rollout_generator, stream)


def rollout_snapshot(student: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the student in `dtype`, in eval mode, that runs its own weights (a deep copy drops the layers'
    in-place compilation: `nn.Module.__getstate__`). Its parameters keep requires_grad: on CPU turning it off changes
    which kernels run, and so the rounding."""
    return copy.deepcopy(student).to(dtype).eval()


class _Background:
    """`fn()` in a thread (its own CUDA stream, ordered after the work queued so far, e.g. a weight copy); `result()`
    waits for it and re-raises its exception."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, autocast_dtype: torch.dtype | None):
        self._value, self._error = None, None
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: keep the CPU reductions' order
        stream = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))

        def run() -> None:
            torch.set_num_threads(threads)
            try:  # autocast and the current stream are per thread: set them here
                in_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
                with in_stream, autocast(device, autocast_dtype):
                    self._value = fn()
            except BaseException as error:  # noqa: BLE001 (re-raised in the training thread)
                self._error = error

        self._thread = threading.Thread(target=run, name="opd-rollout-ahead", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
