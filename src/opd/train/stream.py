"""Partial rollouts (`rollout.partial`): samples that outlive a step. The stream keeps the samples in flight; each step
continues them by segments of at most `rollout.partial_segment` new tokens (a continuation is a longer prompt: one
call through the configured engine), trains on `prompts_per_step` finished groups, oldest first, and carries the rest
to the next step, where later tokens come from later weights (per-token behaviour log-probs, corrected by the
objective's truncated importance weights).

Rules (docs/design.md, "opd.train.stream"):
- top-up: at the start of a step, whole sampler batches are drawn while fewer than (max_staleness + 1) batches'
  worth of samples are in flight (step 0 draws max_staleness + 1, then one a step; built ahead, one batch fewer);
- staleness: a sample whose oldest token was sampled more than max_staleness steps ago is restarted (its tokens
  discarded, counted in `dropped`); within a step, calls continue until `prompts_per_step` groups are finished and
  every sample at its last step of staleness is finished;
- early stop (rollout.partial_early_stop): a call ends as soon as the step can close by the rule above, the samples
  still decoding carrying their tokens so far (engines that cannot end a call early run it to its end);
- training: the `prompts_per_step` finished groups drawn earliest (draw step, then draw order), rows prompt-major in
  that order, samples in their slot order; every started sample is trained, dropped, or still in flight.
With max_staleness = 0 a step holds one batch and generates it in one call of the full max_new_tokens: the
synchronous step. With rollout.overlap a step's batch is built during the previous step from its weights
(`opd.train.overlap.AheadStream`): `version` (the weights' step) is then one less than `step` (the step that trains
the batch), tokens record `version`, and staleness is measured against `step`. With rollout.tools the samples are
episodes (`opd.train.episodes.EpisodeStream`: a call continues each episode's current turn, the turns that end are
answered before the next call). Omitted: several processes (the config refuses them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from opd.rollout import GenerationOutput
from opd.rollout.base import StopRule
from opd.rollout.episodes import EpisodeOutput, episodes_from_state, episodes_state_dict


@dataclass
class EpisodeState:
    """Where an in-flight episode (rollout.tools, `opd.train.episodes.EpisodeStream`) stands: one flag per token of
    its sample, True on the environment's; the tokens of its current turn so far (0 between turns); its turns, tool
    calls, errors and sandbox refusals so far; the calls answered, per turn (to bring a restarted environment back
    to where the episode left it); the tokens appended since the engine last read its context (None: all)."""

    env_mask: list[bool] = field(default_factory=list)
    turn_tokens: int = 0
    turns: int = 0
    calls: int = 0
    errors: int = 0
    refusals: int = 0
    history: list[list[dict]] = field(default_factory=list)
    fresh: int | None = None


@dataclass
class Sample:
    """One in-flight sample: its group (a drawn prompt), its slot among the group's n, the tokens so far with the
    engine's log-prob of each and the step whose weights sampled each; an episode's state (rollout.tools)."""

    group: int  # index into `RolloutStream.groups`' ids
    slot: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    versions: list[int] = field(default_factory=list)
    started: int = 0  # the step this attempt started (its first token's version)
    finish: str | None = None  # "stop" / "length" once finished
    episode: EpisodeState | None = None


@dataclass
class Group:
    id: int  # draw order (global, never reused)
    prompt: int  # the prompt's global index
    drawn: int  # the step its prompt was drawn


@dataclass
class StreamBatch:
    """The finished groups a step trains on, in row order, and what the step did."""

    indices: list[int]  # the prompts' global indices, one per group
    output: GenerationOutput  # prompt-major rows, group_ids into `indices`, log-probs concatenated across segments
    versions: list[list[int]]  # per row, per token: the step whose weights sampled it
    calls: int
    dropped: int  # restarted this step
    episodes: EpisodeOutput | None = None  # rollout.tools: the rows' episodes

    def state_dict(self) -> dict:
        return {
            "indices": self.indices,
            **self.output.state_dict(),
            "versions": self.versions,
            "calls": self.calls,
            "dropped": self.dropped,
            "episodes": None if self.episodes is None else episodes_state_dict(self.episodes),
        }

    @classmethod
    def from_state(cls, state: dict | None) -> StreamBatch | None:
        if not state:
            return None
        output = GenerationOutput.from_state(state)
        episodes = state.get("episodes")  # absent from checkpoints written before episodes streamed
        return cls(
            list(state["indices"]),
            output,
            state["versions"],
            state["calls"],
            state["dropped"],
            None if episodes is None else episodes_from_state(episodes),
        )


def in_flight_batches(max_staleness: int, ahead: int) -> int:
    """How many sampler batches the stream keeps in flight: the weight versions a newly drawn sample can still be
    sampled by before the step that must train it, max_staleness + 1 synchronously, one fewer when the batch is built
    `ahead` = 1 step early (its first tokens already lag one step)."""
    return max_staleness + 1 - ahead


def default_segment(max_new_tokens: int, max_staleness: int, ahead: int, early_stop: bool) -> int:
    """rollout.partial_segment when None: max_new_tokens spread over the versions a sample may be sampled by; with
    early stop and three versions or more, the whole max_new_tokens. There the stop rule ends each call as soon as the
    step can close, so the call needs no segment to end, and its slots stay filled from the waiting samples until
    then, where segments end a call with a tail of rows finishing theirs. With two versions every sample drawn in a
    step is at its last chance in the next and must finish there, and segments give the shorter tail. (The CPU's
    schedule count, docs/performance.md: busy slots 0.76 → 0.96 at max_staleness 2, 0.83 → 1.00 at 3, 0.64 → 0.43
    at 1.)"""
    versions = in_flight_batches(max_staleness, ahead)
    if early_stop and versions >= 3:
        return max_new_tokens
    return max(1, max_new_tokens // versions)


# generate(prompt_ids, n, max_new_tokens, call, stop_when, caps) -> the engine's output (one call, its own seed);
# caps: None, or one limit per sample (n = 1), each ≤ max_new_tokens (`max_new_tokens_per_sample`)
GenerateFn = Callable[
    [Sequence[Sequence[int]], int, int, int, "StopRule | None", "Sequence[int] | None"], GenerationOutput
]


class RolloutStream:
    def __init__(
        self,
        *,
        prompts_per_step: int,
        n: int,
        max_new_tokens: int,
        segment: int,
        max_staleness: int,
        early_stop: bool = False,
    ):
        self.prompts_per_step, self.n, self.cap = prompts_per_step, n, max_new_tokens
        self.max_staleness, self.early_stop = max_staleness, early_stop
        # with no staleness a sample cannot outlive its step: one call of the whole cap (the synchronous step)
        self.segment = max_new_tokens if max_staleness == 0 else min(segment, max_new_tokens)
        self.groups: dict[int, Group] = {}
        self.samples: list[Sample] = []
        self.next_group = 0
        self.started = self.trained = self.dropped = 0  # sample attempts: started = trained + dropped + in flight
        self.cut = 0  # samples a call ended early returned unfinished (early_stop)

    @property
    def in_flight(self) -> int:
        return len(self.samples)

    def next_batch(
        self,
        step: int,
        draw: Callable[[], list[int]],
        prompt_ids: Sequence[Sequence[int]],
        generate: GenerateFn,
        version: int | None = None,
    ) -> StreamBatch:
        """Step `step`'s batch, its new tokens sampled by the weights of step `version` (default `step`; one less
        when the batch is built ahead, during the previous step)."""
        version = step if version is None else version
        dropped = self._restart_stale(step, version)
        depth = in_flight_batches(self.max_staleness, step - version) * self.prompts_per_step * self.n
        while len(self.samples) < depth:
            for prompt in draw():
                group = Group(self.next_group, prompt, step)
                self.groups[group.id] = group
                self.next_group += 1
                self.samples += [self._new_sample(group.id, slot, version) for slot in range(self.n)]
                self.started += self.n
        calls = 0
        while self._running() and (calls == 0 or self._must_continue(step)):
            self._continue(step, version, calls, prompt_ids, generate)
            calls += 1
        return self._take(calls, dropped)

    # ------------------------------------------------------------------------------------------------- phases

    def _new_sample(self, group: int, slot: int, version: int) -> Sample:
        return Sample(group, slot, started=version)

    def _restart(self, sample: Sample, version: int) -> None:
        """A stale sample starts again: its tokens discarded."""
        sample.tokens, sample.versions, sample.finish, sample.started = [], [], None, version
        sample.logprobs = None

    def _restart_stale(self, step: int, version: int) -> int:
        dropped = 0
        for sample in self.samples:
            if sample.versions and step - sample.versions[0] > self.max_staleness:
                self._restart(sample, version)
                dropped += 1
        self.dropped += dropped
        self.started += dropped
        return dropped

    def _finished_groups(self) -> list[int]:
        unfinished = {s.group for s in self.samples if s.finish is None}
        return sorted({s.group for s in self.samples} - unfinished)

    def _running(self) -> list[Sample]:
        return [s for s in self.samples if s.finish is None]

    def _must_continue(self, step: int) -> bool:
        running = self._running()
        if not running:
            return False
        last_chance = any(step + 1 - s.started > self.max_staleness for s in running)
        return last_chance or len(self._finished_groups()) < self.prompts_per_step

    def _stop_rule(self, step: int, running: list[Sample], new: int) -> StopRule | None:
        """early_stop: the rule that ends a call as soon as the step can close (`_must_continue` false once the
        call's ended samples are counted), so that the call does not decode its segment's tail with few rows alive;
        the samples it cuts continue in a later call. None when the step could close already: the call is the step's
        one compulsory call, and runs its segment."""
        if not (self.early_stop and self._must_continue(step)):
            return None
        need = self.prompts_per_step - len(self._finished_groups())
        rows_by_group: dict[int, list[int]] = {}
        for row, sample in enumerate(running):
            rows_by_group.setdefault(sample.group, []).append(row)
        last_chance = [row for row, s in enumerate(running) if step + 1 - s.started > self.max_staleness]
        at_cap = [self.cap - len(s.tokens) <= new for s in running]  # a row at the call's limit is then finished

        def stop(finished: Sequence[str | None]) -> bool:
            done = [r == "stop" or (r == "length" and at_cap[i]) for i, r in enumerate(finished)]
            complete = sum(all(done[i] for i in rows) for rows in rows_by_group.values())
            return complete >= need and all(done[i] for i in last_chance)

        return stop

    def _continue(
        self, step: int, version: int, call: int, prompt_ids: Sequence[Sequence[int]], generate: GenerateFn
    ) -> None:
        """One engine call that adds up to `segment` tokens to every unfinished sample, sampled by the weights of step
        `version` (ended early by `_stop_rule`). Whole fresh groups in draw order go through as prompts × n (what the
        synchronous step sends); anything else as one prefix per sample."""
        running = self._running()
        new = min(self.segment, max(self.cap - len(s.tokens) for s in running))
        # each sample's own limit: it ends at max_new_tokens in the engine (no decoding past it), and the engine's
        # slots hold the longest prefix + limit of one sample, not the longest prefix + the largest limit
        limits = [min(new, self.cap - len(s.tokens)) for s in running]
        caps = None if all(limit == new for limit in limits) else limits
        stop_when = self._stop_rule(step, running, new)
        groups = [running[i].group for i in range(0, len(running), self.n)]
        fresh = len(running) % self.n == 0 and all(
            not s.tokens and s.group == groups[i // self.n] and s.slot == i % self.n for i, s in enumerate(running)
        )
        if fresh:
            out = generate([prompt_ids[self.groups[g].prompt] for g in groups], self.n, new, call, stop_when, None)
        else:
            prefixes = [list(prompt_ids[self.groups[s.group].prompt]) + s.tokens for s in running]
            out = generate(prefixes, 1, new, call, stop_when, caps)
        for row, sample in enumerate(running):
            remaining = self.cap - len(sample.tokens)
            ids, reason = out.response_ids[row], out.finish_reasons[row]
            self.cut += reason == "length" and len(ids) < limits[row]
            if len(ids) > remaining:  # an engine that ignores per-sample limits: cut at this sample's cap
                ids, reason = ids[:remaining], "length"
            sample.tokens += ids
            sample.versions += [version] * len(ids)
            if out.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + list(out.logprobs[row][: len(ids)])
            if reason == "stop" or len(sample.tokens) >= self.cap:
                sample.finish = "stop" if reason == "stop" else "length"

    def _take(self, calls: int, dropped: int) -> StreamBatch:
        chosen = self._finished_groups()[: self.prompts_per_step]  # group ids are draw order: oldest first
        position = {g: i for i, g in enumerate(chosen)}
        rows = sorted((s for s in self.samples if s.group in position), key=lambda s: (position[s.group], s.slot))
        self.samples = [s for s in self.samples if s.group not in position]
        indices = [self.groups.pop(g).prompt for g in chosen]
        self.trained += len(rows)
        return self._batch(indices, rows, [position[s.group] for s in rows], calls, dropped)

    def _batch(
        self, indices: list[int], rows: list[Sample], group_ids: list[int], calls: int, dropped: int
    ) -> StreamBatch:
        """The batch of the finished `rows` (prompt-major, `group_ids` into `indices`), taken out of the stream."""
        with_logprobs = all(s.logprobs is not None for s in rows)
        output = GenerationOutput(
            response_ids=[s.tokens for s in rows],
            finish_reasons=[s.finish or "length" for s in rows],
            group_ids=group_ids,
            logprobs=[list(s.logprobs or []) for s in rows] if with_logprobs and rows else None,
        )
        return StreamBatch(indices, output, [s.versions for s in rows], calls, dropped)

    # ------------------------------------------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        return {
            "groups": [asdict(g) for g in self.groups.values()],
            "samples": [asdict(s) for s in self.samples],
            "next_group": self.next_group,
            "started": self.started,
            "trained": self.trained,
            "dropped": self.dropped,
            "cut": self.cut,
        }

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.groups = {g["id"]: Group(**g) for g in state["groups"]}
        self.samples = [Sample(**s) for s in state["samples"]]
        for sample in self.samples:  # an episode's state comes back as the dict `asdict` wrote
            if isinstance(sample.episode, dict):
                sample.episode = EpisodeState(**sample.episode)
        self.next_group = state["next_group"]
        self.started, self.trained, self.dropped = state["started"], state["trained"], state["dropped"]
        self.cut = state.get("cut", 0)  # absent from checkpoints written before early_stop
