"""Episodes: rollouts as conversations with an environment, on any `Generator`.

A turn is one generation call for every episode still running: the student writes until its end-of-turn token or
its turn budget; a turn without a tool call ends the episode, one with calls gets the environment's answers (all
episodes' calls at once, `opd.tools.environments.answer_calls`), rendered by the chat template
(`opd.tools.calls.observation_ids`), appended to the episode, and the next turn starts. An episode also ends at
`max_turns`, at its token budget (`max_episode_tokens`: student and environment tokens after the prompt) and when the
environment says it is done. The result is one response per episode, the student's and the environment's tokens in
order, with `env_masks` marking the environment's: `episode_rollouts` lays it out as `Rollouts` whose
`response_mask` leaves them out, so rewards, advantages, the loss and length statistics see the student's tokens only
while every scorer reads the whole episode as context.

Continuation: on an engine with sessions (`opd.rollout.base.Continues`: the torch and static engines) each episode
is a sequence of one session, keyed by its index: the engine keeps its cache while the environment answers and the
next turn prefills only what was appended (the last sampled token, never fed, and the environment's answer with the
template's turn tokens); an episode's cache is freed when it ends, and the session's when the episodes return. The
turns go through the generator's `generate` (`session=`, `keys=`), so a wrapper that passes options on sees them.
Results equal those of the re-prefill path (the same rows and random draws) up to floating-point rounding (see
`Session`); the same calls on the same path give the same outputs bit for bit. Other engines (vLLM, whose prefix
cache reuses the context itself) get the whole conversation at every turn. Two figures tell the difference:

- `repeated_prefill_tokens`: context tokens the engine prefilled again at later turns though it had read them
  before. With a session it is measured: the engine's prefilled tokens (`Session.prefilled_tokens`, counted where
  its forwards run) less those appended since its last read; 0 when every cache is kept. Without one, the whole
  context handed again (all of `wasted_prefill_tokens`; vLLM's prefix cache may skip part of it).
- `wasted_prefill_tokens`: what an engine without continuation prefills again: at each later turn, the tokens of
  each episode's context the engine had fed before (everything but the last sampled token and the answer). The
  same on every engine, so runs compare by it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from opd.rollout.base import Continues, GenerationOutput, Generator, SamplingParams, Session
from opd.rollout.batch import build_rollouts
from opd.seeds import derive_seed
from opd.tools.calls import ParsedTurn, observation_ids, parse_turn, prompt_ids, tool_messages
from opd.tools.environments import CallStats, Environment, Episode, answer_calls
from opd.types import Prompt, Rollouts


@dataclass
class EpisodeOutput:
    """P prompts × n episodes, prompt-major as `GenerationOutput`.

    output:        response_ids: everything after the prompt (the student's turns and the environment's answers);
                   finish_reasons: "stop" (the student answered without a call, or the environment ended it) or
                   "length" (a budget or `max_turns` ran out); logprobs 0 on the environment's tokens
    prompt_ids:    per prompt, its ids with the tools offered (the rows' prompt in `episode_rollouts`)
    env_masks:     per episode, one bool per response token, True on the environment's
    turns, tool_calls, tool_errors: per episode (a malformed call counts as a call and an error)
    sandbox_refusals: per episode, the calls the sandbox refused or stopped (`Observation.refused`)
    tool_seconds:  the calls' summed wall time; tool_wall_seconds: the time the batch waited for them
    repeated_prefill_tokens: context tokens the engine prefilled again at later turns (0 with continuation)
    wasted_prefill_tokens: those an engine without continuation prefills again (see the module docstring)
    """

    output: GenerationOutput
    prompt_ids: list[list[int]]
    env_masks: list[list[bool]]
    turns: list[int]
    tool_calls: list[int]
    tool_errors: list[int]
    tool_seconds: float = 0.0
    tool_wall_seconds: float = 0.0
    repeated_prefill_tokens: int = 0
    describe: dict[str, Any] = field(default_factory=dict)
    sandbox_refusals: list[int] = field(default_factory=list)
    wasted_prefill_tokens: int = 0

    def final_turns(self) -> list[list[int]]:
        """Each episode's final turn: its tokens after the environment's last answer (what is graded)."""
        turns = []
        for ids, mask in zip(self.output.response_ids, self.env_masks):
            last_env = max((i for i, is_env in enumerate(mask) if is_env), default=-1)
            turns.append(list(ids[last_env + 1 :]))
        return turns

    def metrics(self) -> dict[str, float]:
        """Per-step figures: means per episode, sums for the batch."""
        count = max(1, len(self.turns))
        student = sum(m.count(False) for m in self.env_masks)
        return {
            "episode/turns_mean": sum(self.turns) / count,
            "episode/tool_calls_mean": sum(self.tool_calls) / count,
            "episode/tool_errors": float(sum(self.tool_errors)),
            "episode/sandbox_refusals": float(sum(self.sandbox_refusals)),
            "episode/tool_seconds": self.tool_seconds,
            "episode/tool_wall_seconds": self.tool_wall_seconds,
            "episode/student_tokens_mean": student / count,
            "episode/env_tokens_mean": sum(m.count(True) for m in self.env_masks) / count,
            "episode/repeated_prefill_tokens": float(self.repeated_prefill_tokens),
            "episode/wasted_prefill_tokens": float(self.wasted_prefill_tokens),
        }


def episode_row(prompt: Prompt) -> dict[str, Any]:
    """The row an episode starts from: the prompt's columns (`meta`), its id, source and answer."""
    return {**prompt.meta, "id": prompt.id, "source": prompt.source, "answer": prompt.answer}


def start_prompt_ids(
    tokenizer: Any,
    environment: Environment,
    prompts: Iterable[tuple[list[dict[str, Any]], Mapping[str, Any]]],
    template: Mapping[str, Any],
) -> Iterator[list[int]]:
    """Each prompt's ids as its episode starts (`(messages, row)`): an episode started from its row, the chat
    rendered with the tools it is offered (`opd.tools.calls.prompt_ids`, `template` its extra arguments), and the
    episode closed again (before the ids are handed on). One prompt at a time, as they are asked for."""
    for messages, row in prompts:
        episode = environment.start(row)
        try:
            ids = prompt_ids(tokenizer, messages, episode.tools, **template)
        finally:
            episode.close()
        yield ids


def end_turn(
    tokenizer: Any, ids: Sequence[int], turns: int, max_turns: int, tool_format: str = "hermes"
) -> tuple[str | None, ParsedTurn]:
    """A student turn that ended on its own (end-of-turn token, within its budget), read: its tool calls, and how the
    episode goes on: "stop" (no call: the student answered), "length" (calls, but this was turn `max_turns`, so none
    is left to read their answers) or None (calls to answer, `answer_turns`). `turns`: the episode's turns so far,
    this one included; `tool_format`: how calls are written (`opd.tools.calls.PARSERS`)."""
    parsed = parse_turn(tokenizer.decode(list(ids), skip_special_tokens=True), tool_format)
    if not parsed.items:
        return "stop", parsed
    if turns == max_turns:
        return "length", parsed  # calls the episode has no turn left to read
    return None, parsed


@dataclass
class TurnAnswer:
    """The environment's answer to one episode's turn (`answer_turns`).

    env_ids:  the answer's tokens as the chat template renders them, to append to the episode (none when
              finish="length": they would not fit its budget)
    finish:   "length" (the answer does not fit: the episode ends before it), "stop" (the environment ended the
              episode: it ends after the answer) or None (the next turn starts)
    calls, errors, refusals: the turn's counts (a malformed call counts as a call and an error)
    """

    env_ids: list[int]
    finish: str | None
    calls: int
    errors: int
    refusals: int


def answer_turns(
    tokenizer: Any,
    pending: Sequence[tuple[Episode, ParsedTurn, int]],
    episode_budget: int,
    *,
    tool_workers: int | None,
    tool_timeout_s: float | None,
    template: Mapping[str, Any],
) -> tuple[list[TurnAnswer], CallStats]:
    """Every pending turn's calls answered (`(episode, turn, tokens)`: the episode's environment, its turn's calls,
    its tokens after the prompt so far), all episodes at once (`answer_calls`), each answer rendered by the chat
    template and checked against `episode_budget` (an answer that would reach it ends the episode instead)."""
    answers, stats = answer_calls(
        [(episode, turn.calls) for episode, turn, _ in pending], max_workers=tool_workers, timeout_s=tool_timeout_s
    )
    results = []
    for (episode, turn, length), observations in zip(pending, answers):
        env_ids = observation_ids(tokenizer, tool_messages(turn, observations), episode.tools, **template)
        if length + len(env_ids) >= episode_budget:
            finish: str | None = "length"
            env_ids = []
        else:
            finish = "stop" if any(o.done for o in observations) or episode.done else None
        results.append(
            TurnAnswer(
                env_ids,
                finish,
                calls=len(turn.items),
                errors=len(turn.errors) + sum(o.error for o in observations),
                refusals=sum(o.refused for o in observations),
            )
        )
    return results, stats


def run_episodes(
    generator: Generator,
    tokenizer: Any,
    messages: Sequence[list[dict[str, Any]]],
    rows: Sequence[Mapping[str, Any]],
    environment: Environment,
    params: SamplingParams,
    *,
    max_turns: int,
    max_episode_tokens: int | None = None,
    max_turn_tokens: int | None = None,
    tool_workers: int | None = None,
    tool_timeout_s: float | None = None,
    template: Mapping[str, Any] | None = None,
    tool_format: str = "hermes",
) -> EpisodeOutput:
    """`params.n` episodes for each prompt (`messages[p]`, a chat, and `rows[p]`, the row the environment starts
    from). Budgets: `max_turn_tokens` per turn and `max_episode_tokens` per episode, both `params.max_new_tokens` by
    default; `max_turns` ≥ 1 generation turns. Each turn's seed is derived from `params.seed` (turn 0 uses it as
    is). `template`: extra arguments of `apply_chat_template` (e.g. enable_thinking). `tool_format`: how the student
    writes its calls (`opd.tools.calls.PARSERS`: hermes `<tool_call>` JSON, markdown code blocks). An engine with
    sessions (`Continues`) continues each episode's cache across turns (the module docstring)."""
    if max_turns < 1:
        raise ValueError(f"rollout.max_turns must be ≥ 1, got {max_turns!r}")
    if len(messages) != len(rows):
        raise ValueError(f"{len(messages)} prompts but {len(rows)} rows; they must match")
    episode_budget = params.max_new_tokens if max_episode_tokens is None else max_episode_tokens
    turn_budget = params.max_new_tokens if max_turn_tokens is None else max_turn_tokens
    for name, value in (("max_episode_tokens", episode_budget), ("max_turn_tokens", turn_budget)):
        if value < 1:
            raise ValueError(f"rollout.{name} must be ≥ 1, got {value!r}")
    template = dict(template or {})
    n = params.n
    episodes: list[Episode] = [environment.start(rows[p]) for p in range(len(messages)) for _ in range(n)]
    continues = generator if isinstance(generator, Continues) else None
    session = None if continues is None else continues.session()
    try:
        return _run(
            generator, continues, session, tokenizer, messages, episodes, params, n, max_turns, episode_budget,
            turn_budget, tool_workers, tool_timeout_s, template, environment.describe(), tool_format,
        )  # fmt: skip
    finally:
        if session is not None:
            session.close()
        for episode in episodes:
            episode.close()


def _run(
    generator: Generator,
    continues: Continues | None,
    session: Session | None,
    tokenizer: Any,
    messages: Sequence[list[dict[str, Any]]],
    episodes: list[Episode],
    params: SamplingParams,
    n: int,
    max_turns: int,
    episode_budget: int,
    turn_budget: int,
    tool_workers: int | None,
    tool_timeout_s: float | None,
    template: dict[str, Any],
    describe: dict[str, Any],
    tool_format: str,
) -> EpisodeOutput:
    prompts = [prompt_ids(tokenizer, messages[p], episodes[p * n].tools, **template) for p in range(len(messages))]
    for b, episode in enumerate(episodes):
        if b % n and prompt_ids(tokenizer, messages[b // n], episode.tools, **template) != prompts[b // n]:
            raise ValueError(f"the environment offered different tools to the episodes of prompt {b // n}")
    B = len(episodes)
    contexts = [list(prompts[b // n]) for b in range(B)]
    response: list[list[int]] = [[] for _ in range(B)]
    env_mask: list[list[bool]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    finish: list[str | None] = [None] * B
    turns, calls, errors, refusals = [0] * B, [0] * B, [0] * B, [0] * B
    tool_seconds = tool_wall = 0.0
    repeated = wasted = 0
    unread = [0] * B  # at later turns: tokens of the context the engine has not fed (last sampled token + answer)

    def end_finished() -> None:  # the episodes that ended free their caches now, not when all have
        if session is not None:
            session.end([b for b in range(B) if finish[b] is not None])

    for turn in range(max_turns):
        active = [b for b in range(B) if finish[b] is None]
        if not active:
            break
        budgets = [min(turn_budget, episode_budget - len(response[b])) for b in active]
        seed = params.seed if turn == 0 or params.seed is None else derive_seed(params.seed, call=turn)
        turn_params = replace(params, n=1, max_new_tokens=max(budgets), seed=seed)
        read_before = sum(len(contexts[b]) - unread[b] for b in active) if turn else 0
        wasted += read_before
        if continues is None or session is None:
            repeated += read_before
            out = generator.generate([contexts[b] for b in active], turn_params)
        else:
            before = session.prefilled_tokens
            out = continues.generate([contexts[b] for b in active], turn_params, session=session, keys=active)
            if turn:
                repeated += max(0, session.prefilled_tokens - before - sum(unread[b] for b in active))
        parsed: dict[int, ParsedTurn] = {}
        for i, b in enumerate(active):
            ids = list(out.response_ids[i][: budgets[i]])
            lps = list(out.logprobs[i][: budgets[i]]) if out.logprobs is not None else [0.0] * len(ids)
            response[b] += ids
            env_mask[b] += [False] * len(ids)
            logprobs[b] += lps
            contexts[b] += ids
            unread[b] = 1  # the last sampled token: the engine never fed it
            turns[b] += 1
            if len(ids) < len(out.response_ids[i]) or out.finish_reasons[i] != "stop":
                finish[b] = "length"
                continue
            finish[b], turn_text = end_turn(tokenizer, ids, turns[b], max_turns, tool_format)
            if finish[b] is None:
                parsed[b] = turn_text
        end_finished()
        if not parsed:
            continue
        order = list(parsed)
        answers, stats = answer_turns(
            tokenizer, [(episodes[b], parsed[b], len(response[b])) for b in order], episode_budget,
            tool_workers=tool_workers, tool_timeout_s=tool_timeout_s, template=template,
        )  # fmt: skip
        tool_seconds += stats.tool_seconds
        tool_wall += stats.wall_seconds
        for b, answer in zip(order, answers):
            calls[b] += answer.calls
            errors[b] += answer.errors
            refusals[b] += answer.refusals
            finish[b] = answer.finish
            if answer.finish == "length":
                continue
            response[b] += answer.env_ids
            env_mask[b] += [True] * len(answer.env_ids)
            logprobs[b] += [0.0] * len(answer.env_ids)
            contexts[b] += answer.env_ids
            unread[b] += len(answer.env_ids)
        end_finished()
    output = GenerationOutput(
        response_ids=response,
        finish_reasons=[reason or "length" for reason in finish],
        group_ids=[b // n for b in range(B)],
        logprobs=logprobs if params.return_logprobs else None,
    )
    return EpisodeOutput(
        output, prompts, env_mask, turns, calls, errors, tool_seconds, tool_wall, repeated, describe=describe,
        sandbox_refusals=refusals, wasted_prefill_tokens=wasted,
    )  # fmt: skip


def episode_rollouts(episodes: EpisodeOutput, *, pad_id: int, device: torch.device | str | None = None) -> Rollouts:
    """The episodes as `Rollouts`: each row is prompt + the whole episode, and `response_mask` is True on the
    student's tokens only (the environment's are context: they are scored as input, never as targets)."""
    rollouts = build_rollouts(episodes.prompt_ids, episodes.output, pad_id=pad_id)
    steps = rollouts.response_mask.shape[1]
    env_BT = torch.zeros((len(episodes.env_masks), steps), dtype=torch.bool)
    for b, mask in enumerate(episodes.env_masks):
        env_BT[b, : len(mask)] = torch.as_tensor(mask, dtype=torch.bool)
    rollouts.response_mask = rollouts.response_mask & ~env_BT
    return rollouts.to(device) if device is not None else rollouts


def episodes_state_dict(episodes: EpisodeOutput) -> dict[str, Any]:
    """The episodes as plain data, for a trainer state that holds episodes generated ahead (rollout.overlap);
    `episodes_from_state` reads it back."""
    return {
        **episodes.output.state_dict(),
        "prompt_ids": episodes.prompt_ids,
        "env_masks": episodes.env_masks,
        "turns": episodes.turns,
        "tool_calls": episodes.tool_calls,
        "tool_errors": episodes.tool_errors,
        "tool_seconds": episodes.tool_seconds,
        "tool_wall_seconds": episodes.tool_wall_seconds,
        "repeated_prefill_tokens": episodes.repeated_prefill_tokens,
        "wasted_prefill_tokens": episodes.wasted_prefill_tokens,
        "describe": episodes.describe,
        "sandbox_refusals": episodes.sandbox_refusals,
    }


def episodes_from_state(state: Mapping[str, Any]) -> EpisodeOutput:
    """The episodes `episodes_state_dict` wrote."""
    return EpisodeOutput(
        GenerationOutput.from_state(dict(state)),
        [list(p) for p in state["prompt_ids"]],
        [list(m) for m in state["env_masks"]],
        list(state["turns"]),
        list(state["tool_calls"]),
        list(state["tool_errors"]),
        state["tool_seconds"],
        state["tool_wall_seconds"],
        state["repeated_prefill_tokens"],
        describe=dict(state["describe"]),
        sandbox_refusals=list(state["sandbox_refusals"]),
        wasted_prefill_tokens=state["wasted_prefill_tokens"],
    )
