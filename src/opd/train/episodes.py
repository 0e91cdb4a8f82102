"""Episodes in the training step (`rollout.tools`): the environment built and checked at startup, the prompts
rendered with the tools they are offered, and a step's rollouts generated as episodes (`opd.rollout.episodes`).

The rows an episode becomes (`episode_rollouts`) hold the prompt and everything after it, the environment's answers
included; their `response_mask` is True on the student's tokens only. Every scorer (the student's, each teacher's, a
reference's) therefore reads the whole episode as context and scores the student's tokens, and rewards, advantages,
the loss and the length statistics, which all read the mask, leave the environment's tokens out. GRPO's outcome
reward grades the final turn (`EpisodeOutput.final_turns`): the student's text after the environment's last answer.
A teacher with a view reads its own rendering of the prompt, with the same tools offered
(`opd.teacher.routing.teacher_views`), then the episode's tokens unchanged.

Where the environment comes from: `tool_environment` of the tool eval (`opd.eval.tools`), which probes the python
tool's sandbox before any model loads; its messages name `tools` and `--sandbox`, the eval's keys, and are given here
with distill's (`rollout.tools`, `rollout.sandbox`).

With rollout.partial the stream's samples are episodes (`EpisodeStream`): carried across steps inside a turn or
between turns with the environment's answer in place, their environments with them (replayed after a resume). On the
vLLM engine each turn re-sends the conversation, which its prefix cache holds (`VLLMGenerator.held` keeps a sleeping
engine awake over the turns).

With rollout.overlap the next step's episodes run in the background (`step_episodes`, or the stream's build).

Not here: the torch and static engines' cache continuation across turns (each turn prefills the whole conversation
again; the step logs `episode/repeated_prefill_tokens`), episodes with rollout.partial_early_stop, teachers of
another vocabulary (refused by `DistillConfig` and at startup).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, cast

import torch

from opd.config import DistillConfig
from opd.data.templates import EncodedPrompts
from opd.eval.tools import check_template, tool_environment
from opd.rollout.base import GenerationOutput, Generator, SamplingParams
from opd.rollout.episodes import (
    EpisodeOutput,
    answer_turns,
    end_turn,
    episode_rollouts,
    episode_row,
    run_episodes,
    start_prompt_ids,
)
from opd.tools.calls import ParsedTurn
from opd.tools.calls import prompt_ids as tool_prompt_ids
from opd.tools.environments import Environment, Episode, ToolCall, answer_calls
from opd.train.stream import EpisodeState, GenerateFn, RolloutStream, Sample, StreamBatch
from opd.types import Prompt, Rollouts

__all__ = [
    "EPISODE_SUMMED",
    "CountedGenerator",
    "EpisodeStream",
    "encode_with_tools",
    "episode_row",
    "episode_stream",
    "generate_episodes",
    "step_episodes",
    "rollout_environment",
]

# the episode metrics that are batch sums (`EpisodeOutput.metrics`): ranks add them up, the means are averaged
EPISODE_SUMMED = (
    "episode/tool_errors",
    "episode/sandbox_refusals",
    "episode/tool_seconds",
    "episode/repeated_prefill_tokens",
    "episode/wasted_prefill_tokens",
)


def rollout_environment(config: DistillConfig, tokenizer: Any, console: Any = None) -> Environment | None:
    """`rollout.tools` built (None without tools), before any model loads: the python tool only where
    `rollout.sandbox` holds here (probed), and a chat template that can hold tool answers. ValueError in one line
    naming the key otherwise. With sandbox=rlimits-only the console says what it means."""
    spec = config.rollout
    if spec.tools is None:
        return None
    try:
        environment = cast(Environment, tool_environment(spec))
        check_template(tokenizer, environment, str(spec.tools))
    except ValueError as e:  # the eval's keys, as distill spells them
        message = str(e).replace("sandbox=rlimits-only (--sandbox rlimits-only)", "rollout.sandbox=rlimits-only")
        raise ValueError(message if message.startswith("rollout.") else f"rollout.{message}") from None
    if spec.tools == "python" and spec.sandbox == "rlimits-only" and console is not None:
        who = "as root: it can change any file of this host" if os.geteuid() == 0 else "as this user"
        console.print(
            f"[yellow]rollout.sandbox=rlimits-only: the model's code runs with resource limits only, {who}[/]"
        )
    return environment


def _template(config: DistillConfig) -> dict[str, Any]:
    thinking = config.data.enable_thinking
    return {} if thinking is None else {"enable_thinking": thinking}


def encode_with_tools(
    config: DistillConfig, tokenizer: Any, environment: Environment, encoded: EncodedPrompts
) -> EncodedPrompts:
    """The prompts as the episodes start: rendered with the tools their episode is offered (the tool schemas the
    template writes into the system turn), those over data.max_prompt_length then dropped and counted (or refused,
    data.on_overflow=error). What a step's episodes prompt with is exactly these ids."""
    limit, kept_ids, kept = config.data.max_prompt_length, [], []
    starts = start_prompt_ids(
        tokenizer, environment, ((p.messages, episode_row(p)) for p in encoded.prompts), _template(config)
    )
    for prompt, ids in zip(encoded.prompts, starts):
        if len(ids) <= limit:
            kept_ids.append(ids)
            kept.append(prompt)
        elif config.data.on_overflow == "error":
            raise ValueError(
                f"prompt {prompt.id!r} is {len(ids)} tokens with the tools of rollout.tools={config.rollout.tools}, "
                f"over data.max_prompt_length={limit}; raise it or set data.on_overflow=filter"
            )
    if not kept:
        raise ValueError(
            f"every prompt is longer than data.max_prompt_length={limit} tokens with the tools of "
            f"rollout.tools={config.rollout.tools} offered; raise data.max_prompt_length"
        )
    return EncodedPrompts(kept_ids, kept, encoded.num_filtered + len(encoded.prompts) - len(kept))


class CountedGenerator:
    """`generator` whose every `generate` call is followed by `after(generator)` (the step's `EngineCounts.add`: an
    episode makes one engine call per turn)."""

    def __init__(self, generator: Generator, after: Any) -> None:
        self.generator, self.after = generator, after

    def generate(self, prompt_ids: Any, params: SamplingParams, **options: Any) -> GenerationOutput:
        output = self.generator.generate(prompt_ids, params, **options)
        self.after(self.generator)
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)


def generate_episodes(
    config: DistillConfig,
    generator: Generator,
    tokenizer: Any,
    environment: Environment,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    params: SamplingParams,
    device: torch.device | str | None = None,
) -> tuple[Rollouts, EpisodeOutput]:
    """`params.n` episodes per prompt as the step's `Rollouts` (the environment's tokens out of `response_mask`)
    and the episodes themselves (their metrics, final turns). `prompt_ids` are `encode_with_tools`' ids of these
    prompts: an episode that starts from other ids (an environment whose tools changed since setup) is an error."""
    episodes = step_episodes(config, generator, tokenizer, environment, prompts, prompt_ids, params)
    return episode_rollouts(episodes, pad_id=tokenizer.pad_token_id, device=device), episodes


def step_episodes(
    config: DistillConfig,
    generator: Generator,
    tokenizer: Any,
    environment: Environment,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    params: SamplingParams,
) -> EpisodeOutput:
    """The episodes of `generate_episodes` (also what rollout.overlap generates ahead, in the background)."""
    spec = config.rollout
    # a vLLM engine that sleeps between calls (`VLLMGenerator.held`) stays awake over the turns: its prefix cache holds
    # the conversations so far, which each turn re-sends
    held = getattr(generator, "held", None)
    with held() if held is not None else nullcontext():
        episodes = run_episodes(
            generator,
            tokenizer,
            [p.messages for p in prompts],
            [episode_row(p) for p in prompts],
            environment,
            params,
            max_turns=spec.max_turns,
            max_episode_tokens=spec.max_episode_tokens,
            max_turn_tokens=spec.max_turn_tokens,
            tool_workers=spec.tool_workers,
            tool_timeout_s=spec.tool_timeout_s,
            template=_template(config),
            tool_format=spec.tool_format,
        )
    for prompt, started, rendered in zip(prompts, episodes.prompt_ids, prompt_ids):
        check_started_as_rendered(environment, prompt, started, rendered)
    return episodes


def check_started_as_rendered(
    environment: Environment, prompt: Prompt, started: Sequence[int], rendered: Sequence[int]
) -> None:
    """An episode must start from the ids setup rendered for its prompt (`encode_with_tools`): other ids mean the
    environment offered other tools since, which is refused in one line (both the plain step and `EpisodeStream`)."""
    if list(started) != list(rendered):
        raise ValueError(
            f"rollout.tools={environment.describe().get('name')}: the episode of prompt {prompt.id!r} started from "
            f"other ids than setup rendered (the environment offered other tools); an environment's tools must be "
            f"fixed per row"
        )


class EpisodeStream(RolloutStream):
    """rollout.partial with rollout.tools: the stream's samples are episodes (`opd.train.stream` for the stream's
    rules). Each engine call continues every running episode by at most `segment` tokens of its current turn (one
    row per episode, the prompt and everything after it as the prefix); a turn that ends in the call is read as
    `run_episodes` reads it, and its tool calls are answered before the next call, so that between calls, and so at
    a step's end, an episode is either inside a student turn or waiting for its next one with the environment's
    answer in place: what is carried to the next step is its tokens, the environment's among them (flagged in
    `EpisodeState.env_mask`, log-prob 0), their behaviour log-probs and versions (an environment token gets the
    version of the call whose turn it answers), and its counts. The environment's own state (python's files) lives in
    the episode object, kept across steps; after `--resume` the episode is started again from its row and the calls
    it answered replayed in order (their answers discarded: the tokens already hold what the student read).

    Budgets as `run_episodes`: `max_new_tokens` is the episode's (rollout.max_episode_tokens, else max_new_tokens),
    `max_turn_tokens` the turn's, `max_turns` the turns'. A call asks the engine for the largest limit among its rows
    and cuts each row at its own (as `run_episodes` does), so that with max_staleness = 0 (one call per turn of the
    whole budget) a step's episodes are those of a step without rollout.partial, draw for draw."""

    def __init__(
        self,
        *,
        environment: Environment,
        tokenizer: Any,
        prompts: list[Prompt],
        max_turns: int,
        max_turn_tokens: int | None,
        tool_workers: int | None = None,
        tool_timeout_s: float | None = None,
        template: dict[str, Any] | None = None,
        tool_format: str = "hermes",
        **stream: Any,
    ) -> None:
        super().__init__(**stream)
        self.environment, self.tokenizer, self.prompts = environment, tokenizer, prompts
        self.max_turns, self.tool_format = max_turns, tool_format
        self.turn_budget = self.cap if max_turn_tokens is None else min(max_turn_tokens, self.cap)
        self.tool_workers, self.tool_timeout_s, self.template = tool_workers, tool_timeout_s, dict(template or {})
        self.live: dict[tuple[int, int], Episode] = {}  # (group, slot) → its environment's episode
        self._step_tools = [0.0, 0.0]  # this step's calls: tool seconds, seconds waited for them
        self._repeated = 0
        self._prompt_ids: Sequence[Sequence[int]] = []

    def next_batch(
        self,
        step: int,
        draw: Callable[[], list[int]],
        prompt_ids: Sequence[Sequence[int]],
        generate: GenerateFn,
        version: int | None = None,
    ) -> StreamBatch:
        self._step_tools, self._repeated, self._prompt_ids = [0.0, 0.0], 0, prompt_ids
        return super().next_batch(step, draw, prompt_ids, generate, version)

    def close(self) -> None:
        """Close every in-flight episode's environment (the run ends; their state is in the checkpoint)."""
        for episode in self.live.values():
            episode.close()
        self.live.clear()

    # ------------------------------------------------------------------------------------------- the stream's hooks

    def _new_sample(self, group: int, slot: int, version: int) -> Sample:
        return Sample(group, slot, started=version, episode=EpisodeState())

    def _restart(self, sample: Sample, version: int) -> None:
        super()._restart(sample, version)
        sample.episode = EpisodeState()
        self._close((sample.group, sample.slot))

    def _close(self, key: tuple[int, int]) -> None:
        episode = self.live.pop(key, None)
        if episode is not None:
            episode.close()

    def _live(self, sample: Sample) -> Episode:
        """The sample's environment episode: started at its first call (its tools must render the prompt setup
        rendered), or after a resume started again and brought back by replaying the calls it answered."""
        key = (sample.group, sample.slot)
        if key in self.live:
            return self.live[key]
        prompt = self.prompts[self.groups[sample.group].prompt]
        episode = self.environment.start(episode_row(prompt))
        self.live[key] = episode
        state = _state(sample)
        if not state.history:
            ids = tool_prompt_ids(self.tokenizer, prompt.messages, episode.tools, **self.template)
            check_started_as_rendered(self.environment, prompt, ids, self._prompt_ids[self.groups[sample.group].prompt])
        for calls in state.history:
            answer_calls(
                [(episode, [ToolCall(c["name"], c["arguments"]) for c in calls])], timeout_s=self.tool_timeout_s
            )
        return episode

    def _continue(
        self, step: int, version: int, call: int, prompt_ids: Sequence[Sequence[int]], generate: GenerateFn
    ) -> None:
        running = self._running()
        states = [_state(s) for s in running]
        # each row's limit: the segment, what its turn and its episode have left
        limits = [
            min(self.segment, self.turn_budget - e.turn_tokens, self.cap - len(s.tokens))
            for s, e in zip(running, states)
        ]
        prefixes = [list(prompt_ids[self.groups[s.group].prompt]) + s.tokens for s in running]
        self._repeated += sum(len(p) - (len(p) if e.fresh is None else e.fresh) for p, e in zip(prefixes, states))
        out = generate(prefixes, 1, max(limits), call, None, None)
        parsed: dict[int, ParsedTurn] = {}
        for row, (sample, state) in enumerate(zip(running, states)):
            ids = list(out.response_ids[row][: limits[row]])
            cut = len(ids) < len(out.response_ids[row])
            if state.turn_tokens == 0:
                state.turns += 1  # a turn starts
            sample.tokens += ids
            sample.versions += [version] * len(ids)
            if out.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + list(out.logprobs[row][: len(ids)])
            state.env_mask += [False] * len(ids)
            state.turn_tokens += len(ids)
            state.fresh = 0
            if cut or out.finish_reasons[row] != "stop":
                if state.turn_tokens >= self.turn_budget or len(sample.tokens) >= self.cap:
                    sample.finish = "length"  # its turn's or its episode's budget ran out
                continue  # the segment ended inside the turn: the next call goes on with it
            finish, turn = end_turn(
                self.tokenizer, sample.tokens[-state.turn_tokens :], state.turns, self.max_turns, self.tool_format
            )
            state.turn_tokens = 0
            if finish is None:
                parsed[row] = turn
            else:
                sample.finish = finish
        if parsed:
            self._answer(running, states, parsed, version)

    def _answer(
        self, running: list[Sample], states: list[EpisodeState], parsed: dict[int, ParsedTurn], version: int
    ) -> None:
        """The environment's answers to the calls of the turns that ended in this call (all at once, in parallel),
        appended to their episodes as `run_episodes` appends them (`answer_turns`)."""
        order = list(parsed)
        answers, stats = answer_turns(
            self.tokenizer,
            [(self._live(running[row]), parsed[row], len(running[row].tokens)) for row in order],
            self.cap,
            tool_workers=self.tool_workers,
            tool_timeout_s=self.tool_timeout_s,
            template=self.template,
        )
        self._step_tools[0] += stats.tool_seconds
        self._step_tools[1] += stats.wall_seconds
        for row, answer in zip(order, answers):
            sample, state = running[row], states[row]
            state.calls += answer.calls
            state.errors += answer.errors
            state.refusals += answer.refusals
            state.history.append([{"name": c.name, "arguments": c.arguments} for c in parsed[row].calls])
            sample.finish = answer.finish
            if answer.finish == "length":
                continue
            sample.tokens += answer.env_ids
            sample.versions += [version] * len(answer.env_ids)
            if sample.logprobs is not None:
                sample.logprobs += [0.0] * len(answer.env_ids)
            state.env_mask += [True] * len(answer.env_ids)
            state.fresh = len(answer.env_ids)

    def _batch(
        self, indices: list[int], rows: list[Sample], group_ids: list[int], calls: int, dropped: int
    ) -> StreamBatch:
        batch = super()._batch(indices, rows, group_ids, calls, dropped)
        states = [_state(s) for s in rows]
        batch.episodes = EpisodeOutput(
            batch.output,
            [list(self._prompt_ids[i]) for i in indices],
            [list(e.env_mask) for e in states],
            [e.turns for e in states],
            [e.calls for e in states],
            [e.errors for e in states],
            self._step_tools[0],
            self._step_tools[1],
            self._repeated,
            describe=self.environment.describe(),
            sandbox_refusals=[e.refusals for e in states],
            wasted_prefill_tokens=self._repeated,  # the stream keeps no cache across calls: all it re-reads is waste
        )
        for sample in rows:  # trained: its environment is done with
            self._close((sample.group, sample.slot))
        return batch


def _state(sample: Sample) -> EpisodeState:
    assert sample.episode is not None  # every sample of an EpisodeStream is an episode
    return sample.episode


def episode_stream(config: DistillConfig, tokenizer: Any, environment: Environment, prompts: list[Prompt]) -> Any:
    """`EpisodeStream`'s arguments beyond the stream's own, from the config: a factory for `rollout_ahead`."""
    spec = config.rollout

    def make(**stream: Any) -> EpisodeStream:
        if spec.max_episode_tokens is not None:
            stream["max_new_tokens"] = spec.max_episode_tokens
        return EpisodeStream(
            environment=environment,
            tokenizer=tokenizer,
            prompts=prompts,
            max_turns=spec.max_turns,
            max_turn_tokens=spec.max_turn_tokens,
            tool_workers=spec.tool_workers,
            tool_timeout_s=spec.tool_timeout_s,
            template=_template(config),
            tool_format=spec.tool_format,
            **stream,
        )

    return make
