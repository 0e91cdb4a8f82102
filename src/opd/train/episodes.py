"""Episodes in the training step (`rollout.tools`): the environment built and checked at startup, the prompts
rendered with the tools they are offered, and a step's rollouts generated as episodes (`opd.rollout.episodes`).

The rows an episode becomes (`episode_rollouts`) hold the prompt and everything after it, the environment's answers
included; their `response_mask` is True on the student's tokens only. Every scorer (the student's, each teacher's, a
reference's) therefore reads the whole episode as context and scores the student's tokens, and rewards, advantages,
the loss and the length statistics, which all read the mask, leave the environment's tokens out. GRPO's outcome
reward grades the final turn (`EpisodeOutput.final_turns`): the student's text after the environment's last answer.

Where the environment comes from: `tool_environment` of the tool eval (`opd.eval.tools`), which probes the python
tool's sandbox before any model loads; its messages name `tools` and `--sandbox`, the eval's keys, and are given here
with distill's (`rollout.tools`, `rollout.sandbox`).

Not here: the engines' cache continuation across turns (each turn prefills the whole conversation again; the step
logs `episode/repeated_prefill_tokens`; on the vLLM engine its prefix cache holds what the turns re-send), episodes with
rollout.partial / rollout.overlap, teachers with a view or another vocabulary (refused by `DistillConfig`).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, cast

import torch

from opd.config import DistillConfig
from opd.data.templates import EncodedPrompts
from opd.eval.tools import check_template, tool_environment
from opd.rollout.base import GenerationOutput, Generator, SamplingParams
from opd.rollout.episodes import EpisodeOutput, episode_rollouts, run_episodes
from opd.tools.calls import prompt_ids as tool_prompt_ids
from opd.tools.environments import Environment
from opd.types import Prompt, Rollouts

__all__ = [
    "EPISODE_SUMMED",
    "CountedGenerator",
    "encode_with_tools",
    "episode_row",
    "generate_episodes",
    "rollout_environment",
]

# the episode metrics that are batch sums (`EpisodeOutput.metrics`): ranks add them up, the means are averaged
EPISODE_SUMMED = (
    "episode/tool_errors",
    "episode/sandbox_refusals",
    "episode/tool_seconds",
    "episode/repeated_prefill_tokens",
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


def episode_row(prompt: Prompt) -> dict[str, Any]:
    """The row an episode starts from: the prompt's columns (`meta`), its id, source and answer."""
    return {**prompt.meta, "id": prompt.id, "source": prompt.source, "answer": prompt.answer}


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
    for prompt in encoded.prompts:
        episode = environment.start(episode_row(prompt))
        try:
            ids = tool_prompt_ids(tokenizer, prompt.messages, episode.tools, **_template(config))
        finally:
            episode.close()
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
        )
    for index, (started, expected) in enumerate(zip(episodes.prompt_ids, prompt_ids)):
        if list(started) != list(expected):
            raise ValueError(
                f"rollout.tools={spec.tools}: the episode of prompt {prompts[index].id!r} started from other ids than "
                f"setup rendered (the environment offered other tools); an environment's tools must be fixed per row"
            )
    return episode_rollouts(episodes, pad_id=tokenizer.pad_token_id, device=device), episodes
