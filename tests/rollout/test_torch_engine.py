"""The torch generation engine (and the Rollouts it builds), on tiny random Llama / Qwen3 models (fp32, CPU) and on a
scripted model whose next token is known, so EOS timing and finished-row handling are exact. The Rollouts layout:
test_batch.py; logit filtering: test_sampling.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_tiny_model
from opd.rollout.base import Generator, SamplingParams
from opd.rollout.batch import build_rollouts
from opd.rollout.torch_engine import TorchGenerator

KINDS = ["llama", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    """One tiny model per kind for the tests that do not change weights."""
    return make_tiny_model(request.param)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Three prompts of different lengths (29, 5 and 14 tokens): one chat-templated, two raw."""
    chat = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    return [tiny_tokenizer.encode(text) for text in [chat, "Hi yo", "What is 17+25?"]]


def _cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return ids


def _full_forward_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Log-probs of `response` given `prompt` from one unpadded forward pass (no cache). → [len(response)]."""
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


def test_engine_is_a_generator(model):
    engine = TorchGenerator(model)
    assert isinstance(engine, Generator)
    assert engine.eos_token_ids == [EOS_ID, PAD_ID] and engine.pad_token_id == PAD_ID
    engine.sync_weights()  # a no-op: shares the module


def test_shapes_and_prompt_major(model, prompts):
    out = TorchGenerator(model).generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=0, return_logprobs=True))
    assert out.group_ids == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len(out.response_ids) == len(out.finish_reasons) == len(out.logprobs) == 9
    for ids, lps, reason in zip(out.response_ids, out.logprobs, out.finish_reasons):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
        assert reason == ("stop" if ids[-1] in (EOS_ID, PAD_ID) else "length")
        assert reason == "stop" or len(ids) == 6
    assert len({tuple(r) for r in out.response_ids[:3]}) > 1  # the n samples of a prompt differ


def test_greedy_equals_hf_generate(model, prompts):
    engine = TorchGenerator(model)
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    for prompt, response in zip(prompts, ours.response_ids):
        hf = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=[EOS_ID, PAD_ID],
            pad_token_id=PAD_ID,
        )
        assert response == _cut_at_eos(hf[0, len(prompt) :].tolist(), {EOS_ID, PAD_ID})


def test_left_padding_invariance(model, prompts):
    """A prompt alone, in a batch with longer and shorter prompts, and as one of n greedy samples: same output."""
    engine = TorchGenerator(model)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, stop_at_eos=False)
    batched = engine.generate(prompts, params).response_ids
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], params).response_ids
        assert batched[2 * i : 2 * i + 2] == alone and alone[0] == alone[1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.9), (0.0, 0, 1.0), (1.3, 0, 1.0)])
def test_logprobs_match_full_forward(model, prompts, temperature, top_k, top_p):
    """Reported log-probs are log_softmax(logits / T) over the full vocabulary (before top-k/top-p; T = 1 when
    greedy), matching an unpadded forward pass without cache."""
    params = SamplingParams(
        n=2,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=8,
        seed=3,
        return_logprobs=True,
        stop_at_eos=False,
    )
    out = TorchGenerator(model).generate(prompts, params)
    for g, response, lps in zip(out.group_ids, out.response_ids, out.logprobs):
        assert len(lps) == len(response) == 8
        expected = _full_forward_logprobs(model, prompts[g], response, temperature)
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)


def test_seed_determinism(model, prompts):
    engine = TorchGenerator(model)
    params = SamplingParams(n=2, max_new_tokens=8, seed=7, stop_at_eos=False)
    first = engine.generate(prompts, params).response_ids
    assert engine.generate(prompts, params).response_ids == first
    other = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=8, stop_at_eos=False)).response_ids
    assert other != first


def test_a_prompt_given_twice_is_prefilled_once(model, prompts):
    """A partial-rollout stream sends a group's fresh samples as copies of one prompt (`opd.train.stream`): they share
    one prefill, as the n samples of a prompt do, and sample exactly what n samples of it would."""
    engine = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    engine.generate([prompts[0], prompts[2], prompts[0]], SamplingParams(max_new_tokens=4))
    assert engine.stats["prefilled_tokens"] == len(prompts[0]) + len(prompts[2])  # before: 2 × len(prompts[0]) + …
    sampled = dict(max_new_tokens=6, seed=3, return_logprobs=True)
    copies = engine.generate([prompts[1]] * 3, SamplingParams(n=1, **sampled))
    grouped = engine.generate([prompts[1]], SamplingParams(n=3, **sampled))
    assert engine.stats["prefilled_tokens"] == len(prompts[1])
    assert len({tuple(ids) for ids in copies.response_ids}) > 1  # sampled rows, not one row three times
    assert copies.response_ids == grouped.response_ids and copies.logprobs == grouped.logprobs


def test_top_k_one_and_tiny_top_p_equal_greedy(model, prompts):
    engine = TorchGenerator(model)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8)).response_ids
    for params in [
        SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=1),
    ]:
        assert engine.generate(prompts, params).response_ids == greedy


def test_batching_by_size_and_tokens_keeps_greedy_outputs(model, prompts):
    params = SamplingParams(n=3, temperature=0, max_new_tokens=5)
    reference = TorchGenerator(model).generate(prompts, params)
    for engine in [TorchGenerator(model, max_batch_size=2), TorchGenerator(model, max_batch_tokens=70)]:
        out = engine.generate(prompts, params)
        assert out.response_ids == reference.response_ids and out.group_ids == reference.group_ids


def test_chunks_split_groups_only_when_needed():
    engine = TorchGenerator(make_tiny_model("llama"), max_batch_size=4)
    assert engine._chunks([5, 5, 5], SamplingParams(n=2, max_new_tokens=3)) == [[(0, 2), (1, 2)], [(2, 2)]]
    assert engine._chunks([5, 5], SamplingParams(n=6, max_new_tokens=3)) == [[(0, 4)], [(0, 2), (1, 2)], [(1, 4)]]
    # Token budget: rows × (longest prompt + max_new_tokens) ≤ 40; a lone row over budget still runs.
    budget = TorchGenerator(make_tiny_model("llama"), max_batch_tokens=40)
    assert budget._chunks([5, 15, 50], SamplingParams(n=2, max_new_tokens=5)) == [
        [(0, 2)],
        [(1, 2)],
        [(2, 1)],
        [(2, 1)],
    ]


def test_chunks_are_sized_from_the_free_memory():
    """With max_batch_tokens None the rows of a chunk are capped by what fits in the free memory (a fake figure
    here; CUDA's on a GPU); greedy outputs do not change with the chunking, and a sequence that cannot fit at all
    fails with one line saying what would."""
    from opd.rollout import memory

    model = make_tiny_model("llama")
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    params = SamplingParams(n=3, temperature=0, max_new_tokens=5)
    total = 64 * 2**30
    figure = {"free": 0}
    engine = TorchGenerator(model, max_batch_size=64, free_memory=lambda device: (figure["free"], total))
    cost = engine.row_cost(4, 5)
    figure["free"] = memory.margin_bytes(total) + 4 * cost.row_bytes + 1
    assert memory.rows_that_fit((figure["free"], total), cost) == 4
    assert engine._chunks([3, 2, 4], params, 4) == [[(0, 3), (1, 1)], [(1, 2), (2, 2)], [(2, 1)]]
    assert engine.generate(prompts, params).response_ids == TorchGenerator(model).generate(prompts, params).response_ids
    figure["free"] = memory.margin_bytes(total) + cost.row_bytes - 1
    with pytest.raises(
        ValueError,
        match=r"^generation on cpu: one sequence of 4 prompt \+ 5 new tokens needs .*; at "
        r"most max_new_tokens=4 fits after a 4-token prompt$",
    ):
        engine.generate(prompts, params)


def test_per_sample_lengths_end_rows_early(tiny_qwen3, prompts):
    """max_new_tokens_per_sample: each sample stops at its own limit ("length"), or earlier at EOS ("stop"); the
    rows that end early are dropped from the batch as finished rows are."""
    caps = [1, 7, 3, 2, 7, 5]
    params = SamplingParams(n=2, max_new_tokens=7, seed=0, stop_at_eos=False, return_logprobs=True)
    engine = TorchGenerator(tiny_qwen3, sync_interval=1, compact_fraction=0.01)
    out = engine.generate(prompts, params, max_new_tokens_per_sample=caps)
    assert [len(ids) for ids in out.response_ids] == caps and out.finish_reasons == ["length"] * 6
    for g, ids, lps in zip(out.group_ids, out.response_ids, out.logprobs):
        torch.testing.assert_close(
            torch.tensor(lps), _full_forward_logprobs(tiny_qwen3, prompts[g], ids, 1.0), atol=1e-4, rtol=0
        )
    with pytest.raises(ValueError, match=r"entries must be in \[1, max_new_tokens=7\], got 0"):
        engine.generate(prompts, params, max_new_tokens_per_sample=[0] * 6)


def test_distill_fails_at_startup_when_one_rollout_cannot_fit(tmp_path, monkeypatch):
    """`opd distill` checks in setup, before any rollout, that one sequence of data.max_prompt_length +
    rollout.max_new_tokens fits next to the models and the optimizer state to come (the free-memory figure is faked:
    CPU engines are not sized otherwise)."""
    import json

    from helpers import make_tiny_tokenizer
    from opd.config import DistillConfig, build_config
    from opd.recipes.distill import distill
    from opd.rollout import memory

    make_tiny_model("qwen3").save_pretrained(tmp_path / "student")
    make_tiny_tokenizer().save_pretrained(tmp_path / "student")
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    options = {
        "student.path": str(tmp_path / "student"),
        "data.path": str(tmp_path / "prompts.jsonl"),
        "objective.advantage": "grpo",
        "objective.top_k": 0,
        "data.answer_key": "answer",
        "data.max_prompt_length": 32,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 400,
        "micro_batch_tokens": 1024,
        "run.out_dir": str(tmp_path / "runs"),
        "run.name": "run",
        "run.steps": 1,
        "run.report": False,
    }
    config = build_config(DistillConfig, options=options)
    optimizer_bytes = 2 * sum(p.numel() * 4 for p in make_tiny_model("qwen3").parameters())
    monkeypatch.setattr(memory, "device_memory", lambda device: (memory.margin_bytes(0) + optimizer_bytes + 150_000, 0))
    with pytest.raises(
        ValueError,
        match=r"one sequence of 32 prompt \+ 400 new tokens .* will not be free.* at most "
        r"rollout.max_new_tokens=\d+ fits after a 32-token prompt$",
    ):
        distill(config)
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_certain_eos_stops_at_once(tiny_llama, prompts):
    tiny_llama.lm_head.bias = torch.nn.Parameter(torch.zeros(TINY_VOCAB))
    with torch.no_grad():
        tiny_llama.lm_head.bias[EOS_ID] = 100.0
    engine = TorchGenerator(tiny_llama)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=0, return_logprobs=True))
    assert out.response_ids == [[EOS_ID]] * 6 and out.finish_reasons == ["stop"] * 6
    assert all(abs(lps[0]) < 1e-6 for lps in out.logprobs)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=5, seed=0, stop_at_eos=False))
    assert out.response_ids == [[EOS_ID] * 5] * 3 and out.finish_reasons == ["length"] * 3


def test_sampled_eos_invariants(tiny_qwen3, prompts):
    """EOS likely (~30%/step): each response ends at its first EOS ("stop") or runs to max_new_tokens ("length")."""
    tiny_qwen3.lm_head.bias = torch.nn.Parameter(torch.zeros(TINY_VOCAB))
    with torch.no_grad():
        tiny_qwen3.lm_head.bias[EOS_ID] = 5.0
    engine = TorchGenerator(tiny_qwen3, sync_interval=1, compact_fraction=0.01)  # drop finished rows at once
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=10, seed=0, return_logprobs=True))
    eos = {EOS_ID, PAD_ID}
    for g, ids, lps, reason in zip(out.group_ids, out.response_ids, out.logprobs, out.finish_reasons):
        assert all(t not in eos for t in ids[:-1])
        assert (reason == "stop") == (ids[-1] in eos) and (reason == "stop" or len(ids) == 10)
        # Rows kept decoding correctly after others were dropped from the batch (cache, mask and positions).
        torch.testing.assert_close(
            torch.tensor(lps), _full_forward_logprobs(tiny_qwen3, prompts[g], ids, 1.0), atol=1e-4, rtol=0
        )
    assert {"stop", "length"} <= set(out.finish_reasons)
    assert len({len(ids) for ids in out.response_ids}) > 3


def test_padding_vocab_rows_never_sampled():
    model = make_tiny_model("llama", vocab_size=288)  # rows 261..287 are embedding padding
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(288))
    with torch.no_grad():
        model.lm_head.bias[TINY_VOCAB:] = 50.0  # would always win if allowed
    out = TorchGenerator(model, vocab_size=TINY_VOCAB).generate(
        [[1, 2, 3]], SamplingParams(n=4, max_new_tokens=6, seed=0)
    )
    assert all(t < TINY_VOCAB for ids in out.response_ids for t in ids)


def test_training_flag_restored_and_no_grad(tiny_llama, prompts):
    tiny_llama.train()
    TorchGenerator(tiny_llama).generate(prompts, SamplingParams(max_new_tokens=2, seed=0))
    assert tiny_llama.training and all(p.grad is None for p in tiny_llama.parameters())


def test_bad_inputs():
    engine = TorchGenerator(make_tiny_model("llama"))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="max_batch_size must be an integer ≥ 1, got 0"):
        TorchGenerator(make_tiny_model("llama"), max_batch_size=0)
    assert engine.generate([], SamplingParams()).response_ids == []


class ScriptedLM(torch.nn.Module):
    """Next token = last token + 1 (mod 16), with certainty; EOS is 10. Ignores the cache, so a prompt ending in
    token k stops after exactly 10 - k tokens (when k < 10)."""

    def __init__(self):
        super().__init__()
        self.config = LlamaConfig(num_hidden_layers=1, vocab_size=16, eos_token_id=10, pad_token_id=15)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.calls, self.width, self.last_cache, self.batch_sizes = 0, 0, None, []

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0):
        # What the engine must pass: a mask covering every token of the chunk so far, and positions that count
        # only real (unmasked) tokens.
        self.width = input_ids.shape[1] + (self.width if cache is self.last_cache else 0)
        self.last_cache = cache
        assert attention_mask.shape[1] == self.width
        assert torch.equal(position_ids[:, -1], attention_mask.sum(-1) - 1)
        self.calls += 1
        self.batch_sizes.append(input_ids.shape[0])
        logits = torch.full((*input_ids.shape, 16), -30.0)
        logits.scatter_(-1, ((input_ids + 1) % 16)[..., None], 30.0)
        return CausalLMOutputWithPast(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


@pytest.mark.parametrize(
    "sync_interval,compact_fraction,batch_sizes",
    [
        (1, 0.01, [4, 6, 4, 4, 4, 2, 2]),  # finished rows dropped as soon as seen
        (1, 1.0, [4, 8, 8, 8, 8, 8, 8]),  # dropped only when all are finished
        (3, 0.25, [4, 8, 8, 4, 4, 4, 2]),  # looked at after steps 3 and 6
        (8, 0.5, [4, 8, 8, 8, 8, 8, 8]),  # never looked at within 7 steps
    ],
)
def test_mixed_lengths_finish_exactly(sync_interval, compact_fraction, batch_sizes):
    model = ScriptedLM()
    engine = TorchGenerator(model, sync_interval=sync_interval, compact_fraction=compact_fraction)
    prompts = [[0, 8], [1, 2, 3, 4, 5], [9], [0, 11]]  # stop after 2, 5, 1 tokens; the last never reaches 10
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=7, return_logprobs=True))
    expected = [[9, 10], [6, 7, 8, 9, 10], [10], [12, 13, 14, 15, 0, 1, 2]]
    assert out.response_ids == [r for r in expected for _ in range(2)]
    assert out.finish_reasons == ["stop"] * 6 + ["length"] * 2
    assert [len(lp) for lp in out.logprobs] == [2, 2, 5, 5, 1, 1, 7, 7]
    # One prefill of the 4 distinct prompts (not 8 rows), then 6 decode steps over the rows still in the batch.
    assert model.batch_sizes == batch_sizes


def test_all_finished_ends_the_loop():
    model = ScriptedLM()
    out = TorchGenerator(model, sync_interval=1).generate([[8], [9]], SamplingParams(temperature=0, max_new_tokens=50))
    assert out.response_ids == [[9, 10], [10]] and model.calls == 2  # prefill + one decode step


def test_rollouts_logits_at_response_positions_match_engine(model, prompts):
    """End to end: one right-padded forward over Rollouts.input_ids, logits gathered at response_positions(), gives
    the log-probs the engine reported (temperature 1)."""
    out = TorchGenerator(model).generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=5, return_logprobs=True))
    r = build_rollouts(prompts, out, pad_id=PAD_ID)
    assert r.rollout_logprobs.shape == r.response_ids.shape and r.response_ids.shape[1] == max(
        map(len, out.response_ids)
    )
    with torch.no_grad():
        logits = model(r.input_ids, attention_mask=r.attention_mask.long()).logits
    positions = r.response_positions().clamp(max=r.input_ids.shape[1] - 1)
    logits_BTV = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
    logprobs = logits_BTV.log_softmax(-1).gather(-1, r.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs[r.response_mask], r.rollout_logprobs[r.response_mask], atol=1e-4, rtol=0)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a deprecated transformers property
def test_peft_wrapped_model(prompts):
    """A LoRA-wrapped student (as the trainer may hold it) generates through the wrapper; fresh LoRA is a no-op."""
    peft = pytest.importorskip("peft")
    base = make_tiny_model("llama")
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    expected = TorchGenerator(base).generate(prompts, params).response_ids
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    engine = TorchGenerator(wrapped)  # found the cache argument's name and logits_to_keep through the wrapper
    assert engine.hf.cache_kwarg == TorchGenerator(base).hf.cache_kwarg and engine.hf.has_logits_to_keep
    assert engine.generate(prompts, params).response_ids == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_engine(kind, prompts):
    """On a GPU: greedy fp32 equals the CPU result, sampled log-probs match a full forward there, bf16 runs."""
    cpu_model, gpu_model = make_tiny_model(kind), make_tiny_model(kind).cuda()
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    assert (
        TorchGenerator(gpu_model).generate(prompts, greedy).response_ids
        == TorchGenerator(cpu_model).generate(prompts, greedy).response_ids
    )
    sampled = SamplingParams(n=2, top_p=0.9, max_new_tokens=8, seed=0, return_logprobs=True, stop_at_eos=False)
    out = TorchGenerator(gpu_model).generate(prompts, sampled)
    assert TorchGenerator(gpu_model).generate(prompts, sampled).response_ids == out.response_ids
    for g, ids, lps in zip(out.group_ids, out.response_ids, out.logprobs):
        expected = _full_forward_logprobs(gpu_model, prompts[g], ids, 1.0).cpu()
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)
    out = TorchGenerator(gpu_model.bfloat16()).generate(prompts, sampled)
    assert [len(ids) for ids in out.response_ids] == [8] * 6
