"""Episodes continued in the engine's cache (`Continues` sessions of the torch and static engines): a later turn
prefills only what was appended, and gives what prefilling the whole conversation again gives.

A tiny student trained to call the calculator twice and then answer runs real multi-turn episodes (the calculator's
answers in its context). Each engine runs them once through its session and once as a plain `Generator` (the same
engine, its `session` hidden: every turn prefills the whole conversation), and:

- the tokens are the same and the log-probs agree within 1e-4 (float32 on CPU: the held keys/values were computed
  by decode steps, the re-prefilled ones by one forward over the context, so they differ by float32 rounding, about
  1e-6 here; a token could only differ if a draw fell within that distance of a boundary);
- the engine's forwards (counted by a hook on the model: the tokens each prefill feeds) read each prompt once and
  then only the appended tokens, which also fails if a session drops a cache between turns;
- a rerun on the same path is the same bit for bit; each episode's cache is freed when it ends.
"""

from __future__ import annotations

import pytest

from helpers import EOS_ID, PAD_ID, make_tiny_model
from helpers_tools import calculator_call, make_tool_tokenizer, sft
from opd.rollout import SamplingParams
from opd.rollout.base import Continues
from opd.rollout.episodes import run_episodes
from opd.rollout.static_engine import StaticGenerator
from opd.rollout.torch_engine import TorchGenerator
from opd.tools.calls import observation_ids, parse_tool_calls, prompt_ids, tool_messages
from opd.tools.environments import Calculator, Observation

QUESTIONS = [(3, 7), (12, 34)]
LOGPROB_TOLERANCE = 1e-4


def _chat(a, b):
    return [{"role": "user", "content": f"What is {a} * {b}?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tool_tokenizer()


@pytest.fixture(scope="module")
def tool_user(tokenizer):
    """A tiny student trained on scripted episodes: it calls the calculator on a*b, then on a+b, then answers."""
    tools = Calculator().start({}).tools
    rows = []
    for a, b in QUESTIONS:
        context = prompt_ids(tokenizer, _chat(a, b), tools)
        turns = [
            (calculator_call(f"{a} * {b}"), str(a * b)),
            (calculator_call(f"{a} + {b}"), str(a + b)),
            (f"It is {a * b}.", None),
        ]
        for text, answer in turns:
            target = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
            rows.append((list(context), target))
            if answer is not None:
                observations = tool_messages(parse_tool_calls(text), [Observation(answer)])
                context = context + target + observation_ids(tokenizer, observations, tools)
    return sft(make_tiny_model("qwen3", seed=7), rows, steps=200)


class Replain:
    """The engine as a plain `Generator`: its session hidden, every turn hands it the whole conversation."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids, params, *, stop_when=None):
        return self.engine.generate(prompt_ids, params, stop_when=stop_when)

    def sync_weights(self): ...

    def check_fits(self, prompt_tokens, new_tokens, *, reserve_bytes=0, names=("", "")): ...

    def release(self): ...

    def close(self): ...


class PrefillCounter:
    """A forward pre-hook on the model: the real tokens of every forward that is a prefill (more than one token
    a row; the torch engine's decode steps feed one, the static engine's do not call the model)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:
            self.tokens += int(kwargs["attention_mask"][:, -ids.shape[1] :].sum())

    def remove(self):
        self.handle.remove()


def _engine(kind, model):
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=3, sync_interval=4)
    if kind == "torch":
        return TorchGenerator(model, **common)
    return StaticGenerator(model, kv_bucket=64, **common)


def _episodes(generator, tokenizer, seed=0):
    params = SamplingParams(n=3, max_new_tokens=120, seed=seed, return_logprobs=True)
    chats = [_chat(a, b) for a, b in QUESTIONS]
    return run_episodes(
        generator, tokenizer, chats, [{}, {}], Calculator(), params, max_turns=4, max_episode_tokens=600
    )


def _appended(episodes, shared: bool) -> int:
    """What an appending engine prefills at the later turns: per episode going on (shared: per distinct context of a
    turn: episodes that wrote and read the same are prefilled once), the environment's answer and the token sampled
    before it (never fed)."""
    total = 0
    for turn in range(1, max(episodes.turns)):
        contexts = set()
        for b, mask in enumerate(episodes.env_masks):
            ends = [i + 1 for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
            if episodes.turns[b] > turn:  # the episode's turn-th answer ends at ends[turn - 1]
                starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
                # b // 3: its prompt (n = 3 in `_episodes`)
                context = (b // 3, tuple(episodes.output.response_ids[b][: ends[turn - 1]]) if shared else b)
                if context not in contexts:
                    contexts.add(context)
                    total += 1 + ends[turn - 1] - starts[turn - 1]
    return total


@pytest.mark.parametrize("kind", ["torch", "static"])
def test_continued_episodes_equal_reprefilled_ones_and_prefill_only_what_was_appended(kind, tokenizer, tool_user):
    engine = _engine(kind, tool_user)
    assert isinstance(engine, Continues) and not isinstance(Replain(engine), Continues)
    counter = PrefillCounter(tool_user)
    try:
        continued = _episodes(engine, tokenizer)
        continued_prefill, counter.tokens = counter.tokens, 0
        replayed = _episodes(Replain(engine), tokenizer)
        replayed_prefill = counter.tokens
    finally:
        counter.remove()
    out, ref = continued.output, replayed.output
    # real multi-turn episodes: the calculator's answers are in their contexts
    assert max(continued.turns) >= 3 and sum(continued.tool_calls) >= 4
    assert any("<tool_response>\n21\n</tool_response>" in tokenizer.decode(ids) for ids in out.response_ids)
    assert out.response_ids == ref.response_ids and out.finish_reasons == ref.finish_reasons
    assert continued.env_masks == replayed.env_masks and continued.turns == replayed.turns
    worst = max(abs(x - y) for row, other in zip(out.logprobs, ref.logprobs) for x, y in zip(row, other))
    assert worst < LOGPROB_TOLERANCE
    # the engine read each prompt once (its episodes share it), then each answer and the token sampled before it;
    # episodes that wrote and read the same are prefilled once (the static engine: once per refill placing them)
    prompts = sum(len(p) for p in continued.prompt_ids)
    fewest, most = _appended(continued, shared=True), _appended(continued, shared=False)
    assert prompts + fewest <= continued_prefill <= prompts + most < prompts + fewest + len(continued.prompt_ids[0])
    assert replayed_prefill > continued_prefill + 2 * len(continued.prompt_ids[0])
    metrics, reference = continued.metrics(), replayed.metrics()
    assert metrics["episode/repeated_prefill_tokens"] == 0
    assert reference["episode/repeated_prefill_tokens"] == reference["episode/wasted_prefill_tokens"]
    assert metrics["episode/wasted_prefill_tokens"] == reference["episode/wasted_prefill_tokens"] > 0


@pytest.mark.parametrize("kind", ["torch", "static"])
def test_a_session_that_drops_a_cache_prefills_the_context_again(kind, tool_user):
    engine = _engine(kind, tool_user)
    params = SamplingParams(n=1, max_new_tokens=8, seed=1)
    contexts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    session = engine.session()
    first = engine.generate(contexts, params, session=session, keys=[0, 1])
    assert session.prefilled_tokens == 8 and session.held_bytes > 0
    later = [c + r + [40, 41] for c, r in zip(contexts, first.response_ids)]
    engine.generate(later, params, session=session, keys=[0, 1])
    assert session.prefilled_tokens == 8 + 2 * 3  # the last sampled token and the two appended, per sequence
    session.end([0])
    dropped = engine.session()
    engine.generate(contexts, params, session=dropped, keys=[0, 1])
    dropped.end([1])  # the cache dropped between the calls: the whole context is prefilled again
    engine.generate(later, params, session=dropped, keys=[0, 1])
    assert dropped.prefilled_tokens == 8 + (len(later[1]) + 3)
    session.close()
    assert session.held_bytes == 0


def test_reruns_are_bit_exact_and_each_episode_frees_its_cache_when_it_ends(tokenizer, tool_user):
    engine = _engine("torch", tool_user)
    held_at_calls: list[tuple[object, set, set]] = []  # (session, keys held, keys going on: none at its first)

    class Watched:
        """The engine wrapped as a step's call counter wraps it (options passed on): which keys each call of a
        session holds caches for before it runs."""

        def __init__(self):
            self.sessions = []

        def generate(self, prompt_ids, params, **options):
            if options.get("session") is not None:
                session = options["session"]
                first = all(s is not session for s, _, _ in held_at_calls)
                held_at_calls.append((session, set(session.held.keys()), set() if first else set(options["keys"])))
            return engine.generate(prompt_ids, params, **options)

        def session(self):
            self.sessions.append(engine.session())
            return self.sessions[-1]

        sync_weights = check_fits = release = close = lambda *a, **k: None

    watched = Watched()
    first, second = _episodes(watched, tokenizer, seed=5), _episodes(watched, tokenizer, seed=5)
    assert first.output.response_ids == second.output.response_ids
    assert first.output.logprobs == second.output.logprobs  # bit for bit
    # every cache held at a call is an episode that goes on in it (the ended ones were freed), and every episode
    # going on holds its cache
    assert len(held_at_calls) >= 6 and any(0 < len(keys) < 6 for _, _, keys in held_at_calls)  # some ended first
    for _, held, going_on in held_at_calls:
        assert held == going_on
    assert all(s.held_bytes == 0 for s in watched.sessions)  # closed with the episodes


@pytest.mark.parametrize("kind", ["torch", "static"])
def test_a_session_call_asks_one_sample_per_distinct_key_on_its_own_engine(kind, tool_user):
    engine = _engine(kind, tool_user)
    session = engine.session()
    with pytest.raises(ValueError, match="SamplingParams.n must be 1, got 2"):
        engine.generate([[1, 2]], SamplingParams(n=2), session=session, keys=[0])
    with pytest.raises(ValueError, match="one distinct key per prompt, got 2 keys for 2"):
        engine.generate([[1, 2], [3]], SamplingParams(), session=session, keys=[0, 0])
    with pytest.raises(ValueError, match="opened by another engine"):
        engine.generate([[1, 2]], SamplingParams(), session=_engine(kind, tool_user).session(), keys=[0])


def test_the_static_engine_sizes_its_rows_with_the_caches_a_session_will_hold(tool_user):
    mib = 2**20
    engine = StaticGenerator(tool_user, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, free_memory=lambda d: None)
    cost = engine.row_cost(100, 50)
    free = 1024 * mib + int(0.04 * 8 * 1024 * mib) + cost.fixed_bytes + 10 * cost.row_bytes
    engine.free_memory = lambda device: (free, 8 * 1024 * mib)
    assert engine.plan_rows(64, 100, 50) == 10
    assert engine.plan_rows(64, 100, 50, reserve_bytes=3 * cost.row_bytes) == 7
