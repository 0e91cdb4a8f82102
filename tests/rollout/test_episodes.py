"""Episodes on a Generator: turns, the environment's answers in the chat template, budgets and the environment mask
(a scripted model that already uses its calculator, and the torch engine on a tiny model)."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import EOS_ID, PAD_ID, make_tiny_model
from helpers_tools import ScriptedModel, make_tool_tokenizer
from opd.rollout import SamplingParams
from opd.rollout.episodes import episode_rollouts, run_episodes
from opd.rollout.torch_engine import TorchGenerator
from opd.teacher.local import LocalScorer
from opd.tools.calls import observation_ids, parse_tool_calls, tool_messages
from opd.tools.environments import Calculator, Observation

QUESTIONS = ["What is 12345 * 6789?", "What is 2 ** 20?"]


def _chat(question):
    return [{"role": "user", "content": question}]


def _uses_the_calculator(context: str) -> str:
    """Calls the calculator on the question's expression, then answers with what it said."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
    if results:
        return f"The answer is {results[-1]}."
    expression = re.findall(r"What is (.*?)\?", context)[-1]
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tool_tokenizer()


def test_an_episode_calls_the_tool_reads_the_answer_and_finishes(tokenizer):
    model = ScriptedModel(tokenizer, _uses_the_calculator)
    params = SamplingParams(n=2, max_new_tokens=400, return_logprobs=True, seed=0)
    result = run_episodes(model, tokenizer, [_chat(q) for q in QUESTIONS], [{}, {}], Calculator(), params, max_turns=4)
    out = result.output
    assert out.group_ids == [0, 0, 1, 1] and out.finish_reasons == ["stop"] * 4
    assert result.turns == [2] * 4 and result.tool_calls == [1] * 4 and result.tool_errors == [0] * 4
    assert model.calls == 2  # all episodes' turns in one call each
    tools = Calculator().start({}).tools
    for b, question in enumerate([QUESTIONS[0]] * 2 + [QUESTIONS[1]] * 2):
        answer = "83810205" if b < 2 else "1048576"
        call = _uses_the_calculator(f"What is {question.split('is ')[1]}")
        turn = parse_tool_calls(call)
        whole = tokenizer.apply_chat_template(
            [
                *_chat(question),
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": turn.calls[0].arguments}}
                ]},
                *tool_messages(turn, [Observation(answer)]),
                {"role": "assistant", "content": f"The answer is {answer}."},
            ],
            tools=tools,
            tokenize=False,
        )  # fmt: skip
        episode = tokenizer.decode(result.prompt_ids[b // 2] + out.response_ids[b])
        assert episode + "\n" == whole  # the template's text, but for the newline after the last turn
        env = [t for t, is_env in zip(out.response_ids[b], result.env_masks[b]) if is_env]
        assert env == observation_ids(tokenizer, tool_messages(turn, [Observation(answer)]), tools)
        assert out.logprobs is not None
        assert [lp for lp, is_env in zip(out.logprobs[b], result.env_masks[b]) if is_env] == [0.0] * len(env)
    metrics = result.metrics()
    assert metrics["episode/turns_mean"] == 2 and metrics["episode/tool_calls_mean"] == 1
    assert metrics["episode/repeated_prefill_tokens"] > 0


def test_rollouts_of_episodes_train_on_the_students_tokens_only(tokenizer):
    model = ScriptedModel(tokenizer, _uses_the_calculator)
    params = SamplingParams(n=1, max_new_tokens=400)
    result = run_episodes(model, tokenizer, [_chat(QUESTIONS[0])], [{}], Calculator(), params, max_turns=4)
    rollouts = episode_rollouts(result, pad_id=PAD_ID)
    env = torch.tensor(result.env_masks[0])
    width = env.shape[0]
    assert rollouts.response_mask[0, :width].tolist() == (~env).tolist()
    assert rollouts.response_ids[0, :width].tolist() == result.output.response_ids[0]
    assert rollouts.attention_mask[0].all()  # the environment's tokens are context every scorer reads
    student = rollouts.response_ids[0][rollouts.response_mask[0]].tolist()
    assert student.count(EOS_ID) == 2  # the two turns' ends; the template's turn ends are the environment's
    assert int(rollouts.response_mask.sum()) == env.logical_not().sum()


def test_a_malformed_call_is_an_observation_and_the_episode_goes_on(tokenizer):
    def clumsy(context: str) -> str:
        if "<tool_response>" in context:
            return "I could not compute it."
        return "<tool_call>{calculator: 2*3}</tool_call>"

    result = run_episodes(
        ScriptedModel(tokenizer, clumsy), tokenizer, [_chat("What is 2*3?")], [{}], Calculator(),
        SamplingParams(max_new_tokens=600), max_turns=3,
    )  # fmt: skip
    text = tokenizer.decode(result.output.response_ids[0])
    assert "error: the tool call is not valid JSON" in text and text.endswith("I could not compute it.<|im_end|>")
    assert (result.turns, result.tool_calls, result.tool_errors) == ([2], [1], [1])


def test_turn_and_token_budgets_end_an_episode_as_truncated(tokenizer):
    model = ScriptedModel(tokenizer, _uses_the_calculator)
    chats, rows = [_chat(QUESTIONS[0])], [{}]
    one_turn = run_episodes(
        model, tokenizer, chats, rows, Calculator(), SamplingParams(max_new_tokens=400), max_turns=1
    )
    assert one_turn.output.finish_reasons == ["length"] and not any(one_turn.env_masks[0])
    short_turn = run_episodes(
        model, tokenizer, chats, rows, Calculator(), SamplingParams(max_new_tokens=400), max_turns=4, max_turn_tokens=10
    )
    assert short_turn.output.finish_reasons == ["length"] and len(short_turn.output.response_ids[0]) == 10
    first_turn = len(one_turn.output.response_ids[0])
    small_episode = run_episodes(
        model, tokenizer, chats, rows, Calculator(), SamplingParams(max_new_tokens=400), max_turns=4,
        max_episode_tokens=first_turn + 5,
    )  # fmt: skip
    assert small_episode.output.finish_reasons == ["length"] and small_episode.turns == [1]
    with pytest.raises(ValueError, match="rollout.max_turns must be ≥ 1, got 0"):
        run_episodes(model, tokenizer, chats, rows, Calculator(), SamplingParams(), max_turns=0)


def test_episodes_run_on_the_torch_engine_and_reproduce_with_a_seed(tokenizer):
    engine = TorchGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    params = SamplingParams(n=2, max_new_tokens=12, seed=3, return_logprobs=True)
    runs = [
        run_episodes(engine, tokenizer, [_chat(QUESTIONS[0])], [{}], Calculator(), params, max_turns=3)
        for _ in range(2)
    ]
    assert runs[0].output.response_ids == runs[1].output.response_ids
    assert runs[0].output.response_ids[0] != runs[0].output.response_ids[1]  # one prompt, two different episodes
    assert runs[0].output.logprobs == runs[1].output.logprobs
    assert all(0 < len(r) <= 12 for r in runs[0].output.response_ids)
    assert "<tools>" in tokenizer.decode(runs[0].prompt_ids[0])


def test_a_scorer_reads_the_whole_episode_and_scores_only_the_students_tokens(tokenizer):
    model = ScriptedModel(tokenizer, _uses_the_calculator)
    result = run_episodes(
        model, tokenizer, [_chat(q) for q in QUESTIONS], [{}, {}], Calculator(), SamplingParams(max_new_tokens=400),
        max_turns=4,
    )  # fmt: skip
    rollouts = episode_rollouts(result, pad_id=PAD_ID)
    teacher = make_tiny_model("qwen3", seed=1)
    scores = LocalScorer(teacher, packing="padded").score(rollouts, top_k=0, with_entropy=False)
    for b in range(rollouts.batch_size):
        length = int(rollouts.attention_mask[b].sum())
        with torch.no_grad():
            logits = teacher(rollouts.input_ids[b : b + 1, :length]).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        positions = rollouts.response_positions()[b]
        mask = rollouts.response_mask[b]
        expected = logprobs[positions[mask], rollouts.response_ids[b][mask]]
        torch.testing.assert_close(scores.sampled_logprobs[b][mask], expected, rtol=1e-5, atol=1e-5)
        assert bool((scores.sampled_logprobs[b][~mask] == 0).all())  # the environment's tokens: no target
