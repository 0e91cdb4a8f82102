"""`StaticGenerator`'s rows (tiny CPU models): rows rounded up a small fixed ladder with greedy outputs kept, per-sample
lengths and `stop_when`, and the memory sizing (slots from the free memory, capped rows, sequences that cannot fit,
decode warm-ups)."""

import pytest
import torch

from helpers import EOS_ID, PAD_ID, compile_decode_on_cpu, make_tiny_model
from helpers_static_engine import PROMPTS, TAIL_CAPS, TAIL_PROMPTS, engines, eos_biased, max_abs_diff, random_prompts
from opd.rollout import SamplingParams, memory, static_engine
from opd.rollout.static_engine import StaticGenerator, _round_rows
from opd.rollout.torch_engine import TorchGenerator
from opd.train.step import compiled_graphs, engine_warm_up_rows

# ------------------------------------------------------------------------------------------------ rounded rows


@pytest.mark.parametrize("max_batch_size", [1, 5, 16, 40, 64, 100, 256])
def test_rounded_rows_climb_a_small_fixed_ladder(max_batch_size):
    """Every sample count in 1..300 → the least rung of 1, 2, 4, 8, 16, 32, 48, ... (or max_batch_size) that holds
    it, never above max_batch_size: a few row counts in all, however the counts vary."""
    rungs = (1, 2, 4, 8, *range(16, max_batch_size + 1, 16), max_batch_size)
    ladder = sorted({rung for rung in rungs if rung <= max_batch_size})
    results = set()
    for samples in range(1, 301):
        rows = _round_rows(samples, max_batch_size)
        assert rows == min([rung for rung in ladder if rung >= samples], default=max_batch_size), samples
        assert min(samples, max_batch_size) <= rows <= max_batch_size and rows in ladder
        results.add(rows)
    assert results == set(ladder) and len(results) <= 4 + max_batch_size // 16 + 1


def _rounding_call(model, round_rows, prompts, params, **kwargs):
    static = StaticGenerator(
        model,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        kv_bucket=16,
        sync_interval=4,
        round_rows=round_rows,
        **kwargs,
    )
    return static.generate(prompts, params), static.stats


@pytest.mark.parametrize("prompts, n, rows", [(5, 1, 8), (3, 3, 16), (16, 1, 16), (20, 1, 32)])
def test_rounded_rows_keep_greedy_outputs(prompts, n, rows):
    """The rows beyond the samples stay empty slots: greedy tokens are those of the call on exactly its samples'
    rows; log-probs agree to 1e-5 (float32 GEMMs over another row count may sum in another order)."""
    model = eos_biased("qwen3")
    params = SamplingParams(n=n, temperature=0, max_new_tokens=30, return_logprobs=True)
    batch = random_prompts(prompts, seed=4)
    (rounded, rounded_stats), (exact, exact_stats) = (_rounding_call(model, on, batch, params) for on in (True, False))
    assert rounded_stats["rows"] == rows and exact_stats["rows"] == prompts * n
    assert rounded.response_ids == exact.response_ids and rounded.finish_reasons == exact.finish_reasons
    assert max_abs_diff(rounded.logprobs, exact.logprobs) < 1e-5


def test_rounded_rows_keep_greedy_outputs_over_partial_continuations():
    """As `opd.train.stream.RolloutStream` continues a partial rollout: each call sends one prefix per sample still
    running (a varying count) for a segment of tokens. Rounded, the calls run on a few ladder rungs; the greedy
    responses are the exact rows' token for token."""
    model = eos_biased("qwen3")
    prompts = random_prompts(40, seed=5)
    segment, cap = 4, 24

    def stream(round_rows):
        static = StaticGenerator(
            model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=16, sync_interval=2, round_rows=round_rows
        )
        tokens, running, rows = [[] for _ in prompts], list(range(len(prompts))), []
        while running:
            params = SamplingParams(
                temperature=0, max_new_tokens=min(segment, max(cap - len(tokens[i]) for i in running))
            )
            out = static.generate([prompts[i] + tokens[i] for i in running], params)
            rows.append((len(running), static.stats["rows"]))
            still = []
            for i, ids, reason in zip(running, out.response_ids, out.finish_reasons):
                tokens[i] += ids[: cap - len(tokens[i])]
                if reason != "stop" and len(tokens[i]) < cap:
                    still.append(i)
            running = still
        return tokens, rows

    (rounded, rounded_rows), (exact, exact_rows) = stream(True), stream(False)
    assert rounded == exact
    counts = [samples for samples, _ in exact_rows]
    assert len(set(counts)) >= 4 and all(samples == rows for samples, rows in exact_rows)
    assert [rows for _, rows in rounded_rows] == [_round_rows(samples, 64) for samples in counts]
    assert len({rows for _, rows in rounded_rows}) < len(set(counts))


def test_rows_are_rounded_by_default_exactly_when_the_step_compiles(monkeypatch):
    """None: on where the compiled step runs (CUDA, compile not False), so a CPU call keeps its exact rows and its
    sampled draws bit for bit."""
    model = make_tiny_model("qwen3")
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=3, return_logprobs=True)
    batch = random_prompts(5, seed=6)
    (default, default_stats), (exact, _) = (_rounding_call(model, on, batch, params) for on in (None, False))
    assert default_stats["rows"] == 5
    assert default.response_ids == exact.response_ids and default.logprobs == exact.logprobs
    # the rule on a (pretended) CUDA device: only the plan is read, no step runs
    monkeypatch.setattr(StaticGenerator, "device", property(lambda self: torch.device("cuda")))
    for compile, round_rows, rows in (
        (None, None, 8),
        (True, None, 8),
        (False, None, 5),
        (False, True, 8),
        (None, False, 5),
    ):
        static = StaticGenerator(
            model,
            eos_token_ids=[EOS_ID],
            pad_token_id=PAD_ID,
            compile=compile,
            round_rows=round_rows,
            free_memory=lambda device: None,
        )
        assert static.plan_rows(5, 8, 12, torch.float32) == rows, (compile, round_rows)


def test_per_sample_lengths_are_honoured_and_checked():
    model = make_tiny_model("qwen3")
    caps = [3, 9, 1, 6, 2, 9]
    params = SamplingParams(n=2, max_new_tokens=9, seed=0, stop_at_eos=False, return_logprobs=True)
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=3)
    out = static.generate(PROMPTS, params, max_new_tokens_per_sample=caps)
    assert [len(ids) for ids in out.response_ids] == caps == [len(lps) for lps in out.logprobs]
    with pytest.raises(ValueError, match=r"entries must be in \[1, max_new_tokens=9\], got 10"):
        static.generate(PROMPTS, params, max_new_tokens_per_sample=[10] * 6)
    with pytest.raises(ValueError, match=r"has 2 entries; it needs one per sample \(3 prompts × n=2 = 6"):
        static.generate(PROMPTS, params, max_new_tokens_per_sample=[1, 2])


@pytest.mark.parametrize("kind", ["static", "torch"])
def test_stop_when_ends_the_call_with_what_each_sample_has_so_far(kind):
    """`stop_when` (the partial-rollout stream's early stop): asked with each sample's finish reason once samples
    have ended, True ends the call: the ended samples are those of the whole call, the samples decoding return a
    prefix of what they would have made, those waiting nothing, all "length". Greedy, two rows, per-sample lengths."""
    model = make_tiny_model("qwen3")
    prompts = random_prompts(3, seed=2)
    caps = [2, 9, 3, 12, 4, 10]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, stop_at_eos=False, return_logprobs=True)
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=2, sync_interval=1)
    engine = StaticGenerator(model, **common) if kind == "static" else TorchGenerator(model, **common)
    full = engine.generate(prompts, params, max_new_tokens_per_sample=caps)
    asked: list[list] = []

    def two_ended(finished):
        asked.append(list(finished))
        return sum(reason is not None for reason in finished) >= 2

    out = engine.generate(prompts, params, max_new_tokens_per_sample=caps, stop_when=two_ended)
    last = asked[-1]
    assert sum(reason is not None for reason in last) == 2 and set(last) <= {None, "length"}
    assert all(sum(r is not None for r in a) < 2 for a in asked[:-1])  # asked until it said stop, not after
    assert out.finish_reasons == ["length"] * 6
    for i, (ids, lps, want) in enumerate(zip(out.response_ids, out.logprobs, full.response_ids)):
        assert ids == want[: len(ids)] and len(lps) == len(ids)
        assert (len(ids) == len(want)) == (last[i] is not None), i
    assert sum(map(len, out.response_ids)) < sum(map(len, full.response_ids))
    assert [] in out.response_ids  # samples still waiting when the call ended
    if kind == "static":
        assert engine.stats["cut"] == 4


# ------------------------------------------------------------------------------------------------ memory sizing

GIB = 2**30


def test_rows_are_sized_from_the_free_memory():
    """A fake device figure: rows = ⌊(free − margin − fixed) / per-row⌋, capped by max_batch_size and
    max_batch_tokens, rounded down to a multiple of 8 from 16 rows on; the per-row cost counts the KV slots exactly as
    allocated and the [V]-sized sampling buffers (noise and logits at least)."""
    model = make_tiny_model("qwen3", vocab_size=2048)
    total = 80 * GIB
    figure = {"free": 0}
    static = StaticGenerator(
        model,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        max_batch_size=1000,
        free_memory=lambda device: (figure["free"], total),
    )
    prompt, new = 16, 20
    cost = static.row_cost(prompt, new)
    config = model.config
    kv_per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * (32 // 4) * 4  # float32 keys + values
    assert cost.per_row["KV cache"] == kv_per_slot * (prompt + new)
    assert cost.per_row["sampling buffers"] >= 2 * 4 * 2048
    base = memory.margin_bytes(total) + cost.fixed_bytes
    for rows_fitting, planned in ((3, 3), (15, 15), (17, 16), (31, 24), (100, 96), (2000, 1000)):
        figure["free"] = base + rows_fitting * cost.row_bytes + cost.row_bytes // 2
        assert static.plan_rows(1000, prompt, new) == planned, rows_fitting
    figure["free"] = base + 21 * cost.row_bytes
    static.max_batch_tokens = 10 * (prompt + new)
    assert static.plan_rows(1000, prompt, new) == 10
    static.max_batch_tokens = None
    prompts = [list(range(1, prompt + 1))] * 4
    out = static.generate(prompts, SamplingParams(n=10, max_new_tokens=new, seed=0, stop_at_eos=False))
    assert static.stats["rows"] == 16 and static.stats["refills"] == 40 - 16  # 21 fit → 16 rows
    assert static.stats["kv_cache_bytes"] == 16 * cost.per_row["KV cache"]
    assert [len(ids) for ids in out.response_ids] == [new] * 40


def test_slots_hold_the_longest_sample_not_the_longest_prompt_with_the_largest_limit():
    """A partial-rollout continuation: the longest prefix has the fewest tokens left. A row holds max over samples of
    (prompt + its limit) slots, so that more rows fit the same memory, and the greedy outputs are the torch engine's."""
    model = make_tiny_model("qwen3")
    prompts = [list(range(1, 30)), [3, 4], [5, 6, 7]]
    caps = [2, 12, 10]
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_at_eos=False, return_logprobs=True)
    reference, _ = engines(model)
    want = reference.generate(prompts, params, max_new_tokens_per_sample=caps)
    probe = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    new_cost, old_cost = probe.row_cost(29, 12, slots=31), probe.row_cost(29, 12)
    total = 80 * GIB
    free = memory.margin_bytes(total) + new_cost.fixed_bytes + 3 * new_cost.row_bytes
    assert memory.rows_that_fit((free, total), old_cost) == 2  # sized by the longest prompt + the largest limit
    static = StaticGenerator(
        model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, free_memory=lambda device: (free, total)
    )
    got = static.generate(prompts, params, max_new_tokens_per_sample=caps)
    assert static.stats["slots_per_row"] == 31 and static.stats["rows"] == 3
    assert got.response_ids == want.response_ids
    assert max_abs_diff(got.logprobs, want.logprobs) < 1e-4


def _rounding_engine_on_a_figure() -> tuple[StaticGenerator, dict[str, int], int]:
    """A rounding engine (up to 128 rows) on a device of 80 GiB whose free bytes are `figure["free"]`."""
    figure, total = {"free": 0}, 80 * GIB
    static = StaticGenerator(
        make_tiny_model("qwen3", vocab_size=2048),
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        max_batch_size=128,
        round_rows=True,
        free_memory=lambda device: (figure["free"], total),
    )
    return static, figure, total


def test_rounded_rows_stay_on_a_bounded_set_under_the_memory_and_token_caps():
    """round_rows: the memory cap applies after the rounding as without it (below 16 rows as it is, else a multiple
    of 8), and so does a binding max_batch_tokens cap, which without rounding follows every prompt length: over any
    samples, free memory and prompt lengths the calls run one of a bounded set of row counts."""
    static, figure, total = _rounding_engine_on_a_figure()
    new = 20
    bounded = {*range(1, 16), *range(16, 129, 8)}
    seen = set()
    for prompt in (4, 16, 37):
        cost = static.row_cost(prompt, new)
        for fitting in (3, 15, 17, 31, 45, 100, 1000):
            figure["free"] = memory.margin_bytes(total) + cost.fixed_bytes + fitting * cost.row_bytes + 1
            for samples in range(1, 201):
                rounded, rows = _round_rows(samples, 128), static.plan_rows(samples, prompt, new)
                assert rows == (rounded if fitting >= rounded else fitting if fitting < 16 else fitting // 8 * 8)
                seen.add(rows)
    figure["free"] = 1000 * GIB
    for batch_tokens in (2345, 3001, 4999):
        static.max_batch_tokens = batch_tokens
        for prompt in range(1, 60, 3):
            limit = min(128, batch_tokens // (prompt + new))
            rows = static.plan_rows(200, prompt, new)
            assert rows == (limit if limit < 16 else limit // 8 * 8) and rows in bounded
            seen.add(rows)
    assert seen <= bounded
    static.round_rows = False  # the exact cap: one row count per prompt length
    assert static.plan_rows(200, 37, new) == 4999 // 57 == 87


def test_capped_rows_hold_every_count_the_memory_gives_the_calls():
    """`capped_rows`: for calls whose widest row holds any slot count of a range, every row count `plan_rows` gives
    them on the memory a call sees (the figure now, less the reserved bytes and the step weights it builds) is
    predicted, live-row buckets included; the prediction needs the reserve (the test can fail)."""
    static, figure, total = _rounding_engine_on_a_figure()
    new = 20
    assert static.step_weight_bytes() > 0
    widest, slots = 37, range(4 + new, 37 + new + 1)
    uncapped = _round_rows(100, 128)
    for fitting in (5, 13, 40, 100):
        cost = static.row_cost(widest, new)
        reserve = 9 * cost.row_bytes
        at_call = memory.margin_bytes(total) + cost.fixed_bytes + fitting * cost.row_bytes + cost.row_bytes // 2
        figure["free"] = at_call
        met = {static.plan_rows(100, width, new) for width in range(4, widest + 1)} - {uncapped}
        figure["free"] = at_call + reserve + static.step_weight_bytes()
        predicted = static.capped_rows(100, widest, new, slots, reserve_bytes=reserve)
        assert predicted == sorted(predicted, reverse=True) and uncapped not in predicted
        assert met and met <= set(predicted), (fitting, met, predicted)
        assert not met <= set(static.capped_rows(100, widest, new, slots)), fitting  # without the reserve: misses
        assert all(b in predicted for count in met for b in static_engine._row_buckets(count))
    figure["free"] = 10**6 * GIB
    assert static.capped_rows(100, widest, new, slots) == []  # nothing caps: nothing to add
    static.free_memory = lambda device: None
    assert static.capped_rows(100, widest, new, slots) == []


@pytest.mark.parametrize("memory_figure", [True, False])
def test_capped_rows_hold_every_count_a_token_budget_gives_the_calls(memory_figure):
    """A binding max_batch_tokens caps each width of call to its own count (rounded down to a multiple of 8 from
    16): `capped_rows` predicts every count `plan_rows` gives calls whose widest row holds any slot count of the
    range, with or without a memory figure (the memory caps nothing here)."""
    static, figure, _ = _rounding_engine_on_a_figure()
    figure["free"] = 10**6 * GIB
    if not memory_figure:
        static.free_memory = lambda device: None
    new, widest = 20, 37
    slots = range(4 + new, widest + new + 1)
    assert static.capped_rows(100, widest, new, slots) == []  # no budget: nothing caps
    static.max_batch_tokens = 40 * 57
    met = {static.plan_rows(100, width, new) for width in range(4, widest + 1)}
    predicted = static.capped_rows(100, widest, new, slots)
    assert len(met) > 2 and met <= set(predicted), (met, predicted)
    assert all(b in predicted for count in met for b in static_engine._row_buckets(count))


def test_a_sequence_that_cannot_fit_fails_with_one_line_saying_what_fits():
    model = make_tiny_model("qwen3", vocab_size=2048)
    total = 80 * GIB
    figure = {"free": 0}
    static = StaticGenerator(
        model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, free_memory=lambda device: (figure["free"], total)
    )
    cost = static.row_cost(16, 400)
    # one byte short, with the step weights the call will build (check_fits runs before they exist)
    figure["free"] = memory.margin_bytes(total) + cost.fixed_bytes + static.step_weight_bytes() + cost.row_bytes - 1
    with pytest.raises(ValueError) as error:
        static.check_fits(16, 400, names=("data.max_prompt_length", "rollout.max_new_tokens"))
    message = str(error.value)
    assert "\n" not in message and "one sequence of 16 prompt + 400 new tokens needs" in message
    fitting = int(message.rsplit("rollout.max_new_tokens=", 1)[1].split()[0])
    assert fitting == 399  # one KV slot fewer: the per-row buffers that do not grow with the length are kept
    static.check_fits(16, fitting)
    figure["free"] -= static.step_weight_bytes()  # generate reads the figure after building them
    with pytest.raises(ValueError, match="at most max_new_tokens=399 fits after a 16-token prompt"):
        static.generate([[1] * 16], SamplingParams(max_new_tokens=400))
    with pytest.raises(ValueError, match="12.00 GiB will not be free"):
        static.check_fits(16, 10, reserve_bytes=12 * GIB)
    assert StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID).plan_rows(100, 16, 400) == 64  # CPU


def test_decode_rows_are_the_calls_rows_and_their_buckets():
    static = StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=64)
    static.round_rows = True
    assert static.decode_rows([12]) == [16, 8, 4]  # 12 samples: 16 rows, then the live-row buckets below
    assert static.decode_rows([40, 12]) == [48, 32, 16, 8, 4]
    assert static.decode_rows(range(1, 50)) == [64, 48, 32, 16, 8, 4, 2, 1]
    static.row_buckets = False
    assert static.decode_rows([40]) == [48]
    static.round_rows = False
    assert static.decode_rows([40, 200]) == [64, 40]


@pytest.mark.parametrize(("samples", "capped"), [(9, False), (64, False), (64, True)])
def test_an_episodes_later_turns_run_only_at_warmed_up_row_counts(samples, capped):
    """rollout.tools: an episode's later turn continues, in the engine's session, only the episodes that called a
    tool, so its call has any sample count from 1 to the step's. Configured as the distill step's engine (its
    max_batch_size rollout.batch_size, live-row buckets, rows rounded as where the step compiles), every such call
    runs, its live-row buckets included, at row counts the warm-up compiles for the step
    (`engine_warm_up_rows`, what `decode_warm_up_rows` returns for a step without rollout.partial): it rounds up to
    the buckets of the session's first call. Before, 2 samples ran on 2 rows and 40 on 48, never warmed up (on an
    H100 step 1 recompiled the decode step).

    capped: a memory figure that caps the calls (14 rows fit what the warm-up sizes; a session's call also reserves
    what its held caches will take, so fewer): a capped session call rounds down to its ladder. Before, it ran on
    the 5 to 13 rows that fit, counts the warm-up did not predict."""
    static = StaticGenerator(
        make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=256, round_rows=True
    )
    prompts = [[1 + i % 5, 2, 3 + i % 3, 4 + i % 7] for i in range(samples)]
    new_tokens = 3
    if capped:
        static.fuse_weights = False  # the figure below does not see the weight copies a call builds
        cost, total = static.row_cost(len(prompts[0]), new_tokens), 80 * 2**30
        room = memory.margin_bytes(total) + cost.fixed_bytes + 14 * cost.row_bytes + cost.row_bytes // 2
        static.free_memory = lambda device: (room, total)
    warm = set(
        engine_warm_up_rows(
            static,
            samples,
            stream=False,
            prompt_lengths=[len(p) for p in prompts],
            new_tokens=new_tokens,
            least_new_tokens=new_tokens,
        )
    )
    params = SamplingParams(n=1, max_new_tokens=new_tokens, seed=5)
    session = static.session()
    static.generate(prompts, params, session=session, keys=list(range(samples)))  # the first turn: every episode
    met = {}
    for k in range(1, samples + 1):  # a later turn: the first k episodes called a tool
        static.generate(prompts[:k], params, session=session, keys=list(range(k)))
        met[k] = {static.stats["rows"], *static.stats["bucket_steps"]}
    assert all(rows <= warm for rows in met.values()), {k: rows - warm for k, rows in met.items() if rows - warm}
    assert met[1] == {4}  # a call of 1 sample runs on the smallest bucket
    if capped:  # the calls ran capped: at buckets of at most the cap, none at the 14 rows predicted
        assert 14 in warm and max(max(rows) for rows in met.values()) <= 8, met
    session.close()


@pytest.mark.parametrize("warm", [True, False])
def test_a_decode_warm_up_leaves_nothing_to_compile(monkeypatch, warm):
    """`warm_up_decode` at `decode_rows` compiles the decode step at every row count a call of those samples meets,
    its live-row buckets included, so that the call compiles nothing; without it the call compiles (the test can
    fail)."""
    compile_decode_on_cpu(monkeypatch)
    torch._dynamo.reset()
    static = StaticGenerator(
        make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, sync_interval=2, kv_bucket=16
    )
    assert static.compiles_decode()
    params = SamplingParams(n=1, max_new_tokens=24, seed=3)
    prompts = [[1 + i % 5, 2, 3 + i % 3] for i in range(12)]
    limits = [2 + 2 * i for i in range(12)]  # rows end at different steps: the call walks down its buckets
    rows = static.decode_rows([len(prompts)])
    if warm:
        assert static.warm_up_decode(PROMPTS[0], params, rows) == len(rows)
    before = compiled_graphs()
    static.generate(prompts, params, max_new_tokens_per_sample=limits)
    assert sorted(static.stats["bucket_steps"], reverse=True) == rows  # the call met every count
    assert (compiled_graphs() == before) == warm, (before, compiled_graphs())


def test_a_steps_engine_counts_sum_its_calls():
    """`EngineCounts` (the trainer's rollout/decode_steps, rollout/live_rows, rollout/row_occupancy, rollout/call_rows)
    sums the calls of a step: the decode steps of both, the rows their steps ran over (live-row buckets shrink them
    below 8), and the tokens decoded after each sample's prefill, counted here from the responses; call_rows is the
    widest call's (8 then 4 rows here); a call without prompts adds nothing."""
    from opd.train.step import EngineCounts

    model = make_tiny_model("qwen3")
    static = StaticGenerator(
        model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=8, sync_interval=4, row_buckets=True
    )
    params = SamplingParams(n=4, temperature=0, max_new_tokens=60, seed=3, stop_at_eos=False)
    counts, steps, row_steps, decoded, call_rows = EngineCounts(), 0, 0, 0, []
    for prompts, caps in ((TAIL_PROMPTS, TAIL_CAPS), (TAIL_PROMPTS[:1], TAIL_CAPS[::-1][:4])):
        output = static.generate(prompts, params, max_new_tokens_per_sample=caps)
        counts.add(static)
        call_rows.append(static.stats["rows"])
        steps += static.stats["decode_steps"]
        row_steps += sum(rows * n for rows, n in static.stats["bucket_steps"].items())
        decoded += sum(len(ids) - 1 for ids in output.response_ids)
    static.generate([], params)
    counts.add(static)
    metrics = counts.metrics()
    assert metrics["rollout/decode_steps"] == steps > 0
    assert 4 <= metrics["rollout/live_rows"] == row_steps / steps < 8
    assert metrics["rollout/row_occupancy"] == decoded / row_steps
    assert call_rows == [8, 4] and metrics["rollout/call_rows"] == 8
    assert EngineCounts().metrics() == {}
