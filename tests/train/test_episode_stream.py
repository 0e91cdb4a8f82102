"""`opd.train.episodes.EpisodeStream`: rollout.partial with rollout.tools, episodes carried across steps.

A scripted engine (a `GenerateFn` that writes each turn's text from the conversation, a few tokens a call) and a
stateful environment (each answer counts the calls its episode answered) show that:
- a turn spans engine calls and an episode spans steps: its tokens, the environment's answers (flagged, log-prob 0,
  the version of the call they answer), its turns and calls carry over, and the environment's state with them (the
  second call of an episode is answered "2" even when the steps between them trained other episodes);
- a tool call is answered in the call its turn ends in: between calls, so at every step's end, no episode has a
  turn with calls unanswered;
- a stream saved mid-episode and loaded into a new one (fresh environment objects, as after `--resume`) goes on
  exactly as the stream never saved: the restarted environment is brought back by replaying the episode's calls.
"""

from __future__ import annotations

import re

import pytest

from helpers_tools import make_tool_tokenizer
from opd.rollout.base import GenerationOutput
from opd.tools.calls import prompt_ids as tool_prompt_ids
from opd.tools.environments import Observation, ToolCall, function_schema
from opd.train.episodes import EpisodeStream
from opd.types import Prompt

TOOLS = [function_schema("count", "Counts this episode's calls.", {}, [])]
CALL = '<tool_call>\n{"name": "count", "arguments": {}}\n</tool_call>'


class CountEpisode:
    def __init__(self, log: list[str]) -> None:
        self.tools, self.answered, self.log = TOOLS, 0, log

    def answer(self, call: ToolCall) -> Observation:
        self.answered += 1
        return Observation(str(self.answered))

    @property
    def done(self) -> bool:
        return False

    def close(self) -> None:
        self.log.append("close")


class Counter:
    def __init__(self) -> None:
        self.log: list[str] = []

    def start(self, row) -> CountEpisode:
        self.log.append("start")
        return CountEpisode(self.log)

    def describe(self) -> dict:
        return {"name": "count"}


def _turn(context: str) -> str:
    """Two calls, then the last answer in a box."""
    answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
    return CALL if len(answers) < 2 else f"\\boxed{{{answers[-1]}}}"


def _engine(tokenizer, seen: list[int], turn=_turn):
    """A GenerateFn: each row goes on with its current turn's scripted text (the part after the context's last
    assistant header), at most max_new_tokens of it, log-prob -1 a token."""

    def generate(prefixes, n, max_new_tokens, call, stop_when, caps):
        assert n == 1 and caps is None and stop_when is None
        seen.append(len(prefixes))
        responses, reasons = [], []
        for prefix in prefixes:
            text = tokenizer.decode(list(prefix))
            head, _, partial = text.rpartition("<|im_start|>assistant\n")
            whole = tokenizer(turn(head) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            done = len(tokenizer(partial, add_special_tokens=False)["input_ids"])
            rest = whole[done:]
            responses.append(rest[:max_new_tokens])
            reasons.append("stop" if len(rest) <= max_new_tokens else "length")
        return GenerationOutput(responses, reasons, list(range(len(responses))), [[-1.0] * len(r) for r in responses])

    return generate


def _stream(tokenizer, prompts, environment, **options) -> EpisodeStream:
    return EpisodeStream(
        environment=environment,
        tokenizer=tokenizer,
        prompts=prompts,
        max_turns=4,
        max_turn_tokens=None,
        prompts_per_step=1,
        n=2,
        max_new_tokens=400,
        segment=24,
        max_staleness=3,
        **options,
    )


def _world():
    tokenizer = make_tool_tokenizer()
    prompts = [Prompt(str(i), [{"role": "user", "content": f"Count {i}."}]) for i in range(6)]
    ids = [tool_prompt_ids(tokenizer, p.messages, TOOLS) for p in prompts]
    draws = iter(range(100))
    return tokenizer, prompts, ids, lambda: [next(draws) % len(prompts)]


def _run(stream, steps, start, ids, draw, tokenizer, seen):
    batches = []
    for step in range(start, start + steps):
        batch = stream.next_batch(step, draw, ids, _engine(tokenizer, seen))
        batches.append(batch)
        for sample in stream.samples:  # between steps: no turn with calls left unanswered
            state = sample.episode
            assert state is not None
            if sample.finish is None and state.turn_tokens == 0 and sample.tokens:
                assert state.env_mask[-1]  # the turn that ended was answered
    return batches


def test_episodes_carry_over_steps_with_their_answers_and_the_environments_state():
    tokenizer, prompts, ids, draw = _world()
    seen: list[int] = []
    environment = Counter()
    stream = _stream(tokenizer, prompts, environment)
    batches = _run(stream, 6, 0, ids, draw, tokenizer, seen)
    carried = [b for b in batches if any(len(set(v)) > 1 for v in b.versions)]
    assert carried, "no episode spanned two steps"
    for batch in batches:
        episodes = batch.episodes
        assert episodes is not None
        for row, (tokens, mask) in enumerate(zip(episodes.output.response_ids, episodes.env_masks)):
            text = tokenizer.decode(tokens)
            assert text.endswith("\\boxed{2}<|im_end|>"), text  # the second call was answered 2: state kept
            assert episodes.turns[row] == 3 and episodes.tool_calls[row] == 2 and episodes.tool_errors[row] == 0
            assert len(mask) == len(tokens) and 0 < sum(mask) < len(mask)
            logprobs = episodes.output.logprobs
            assert logprobs is not None
            assert all((lp == 0.0) == is_env for lp, is_env in zip(logprobs[row], mask))
            env_text = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
            assert env_text.count("<tool_response>") == 2
    assert environment.log.count("start") == environment.log.count("close") + len(stream.live)


def test_a_stream_loaded_mid_episode_goes_on_as_if_never_saved():
    tokenizer, prompts, ids, draw = _world()
    straight = _run(_stream(tokenizer, prompts, Counter()), 6, 0, ids, draw, tokenizer, [])

    tokenizer, prompts, ids, draw = _world()
    first = _stream(tokenizer, prompts, Counter())
    before = _run(first, 4, 0, ids, draw, tokenizer, [])
    state = first.state_dict()
    assert any(s["finish"] is None and any(s["episode"]["env_mask"]) for s in state["samples"])  # carried answered
    environment = Counter()
    resumed = _stream(tokenizer, prompts, environment)  # new environment objects: the episodes' state is replayed
    resumed.load_state_dict(state)
    after = _run(resumed, 2, 4, ids, draw, tokenizer, [])
    assert environment.log.count("start") > 0
    for a, b in zip(straight, before + after, strict=True):
        assert a.indices == b.indices and a.versions == b.versions
        assert a.output.response_ids == b.output.response_ids and a.output.logprobs == b.output.logprobs
        assert a.episodes is not None and b.episodes is not None
        assert a.episodes.env_masks == b.episodes.env_masks and a.episodes.turns == b.episodes.turns


def test_an_episode_offered_other_tools_than_setup_rendered_is_refused_in_one_line():
    """The same line as the plain step's (`opd.train.episodes.check_started_as_rendered`)."""

    class Changed(Counter):
        def start(self, row) -> CountEpisode:
            episode = super().start(row)
            episode.tools = [*TOOLS, function_schema("other", "Another tool.", {}, [])]
            return episode

    tokenizer, prompts, ids, draw = _world()
    with pytest.raises(ValueError) as refused:
        _stream(tokenizer, prompts, Changed()).next_batch(0, draw, ids, _engine(tokenizer, []))
    assert str(refused.value) == (
        "rollout.tools=count: the episode of prompt '0' started from other ids than setup rendered (the environment "
        "offered other tools); an environment's tools must be fixed per row"
    )


PYTHON = [function_schema("python", "Counts this episode's calls.", {"code": {"type": "string"}}, ["code"])]
BLOCK = "Counting.\n```python\nprint(1)\n```"


class PythonCounter(Counter):
    def start(self, row) -> CountEpisode:
        episode = super().start(row)
        episode.tools = PYTHON
        return episode


def _markdown_turn(context: str) -> str:
    """Two python blocks, then the last answer in a box."""
    answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
    return BLOCK if len(answers) < 2 else f"\\boxed{{{answers[-1]}}}"


def test_markdown_turns_are_calls_across_steps_as_hermes_ones():
    tokenizer, prompts, _, draw = _world()
    ids = [tool_prompt_ids(tokenizer, p.messages, PYTHON) for p in prompts]
    seen: list[int] = []
    stream = _stream(tokenizer, prompts, PythonCounter(), tool_format="markdown")
    for step in range(3):
        episodes = stream.next_batch(step, draw, ids, _engine(tokenizer, seen, _markdown_turn)).episodes
        assert episodes is not None
        for row, (tokens, mask) in enumerate(zip(episodes.output.response_ids, episodes.env_masks)):
            student = tokenizer.decode([t for t, m in zip(tokens, mask) if not m])
            assert student.count(BLOCK + "<|im_end|>") == 2 and student.endswith("\\boxed{2}<|im_end|>")
            assert episodes.turns[row] == 3 and episodes.tool_calls[row] == 2 and episodes.tool_errors[row] == 0
    stream.close()
