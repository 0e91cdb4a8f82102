"""`StaticGenerator` against `TorchGenerator` and the model's exact distribution, on tiny CPU models (eager decode
step: the CUDA graphs and compilation are exercised by `benchmarks/check_cuda.py` and `benchmarks/rollout.py` on a
GPU): every decode path, continuous batching (slots refilled as rows finish), its determinism, the memory sizing."""

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, compile_decode_on_cpu, make_tiny_model
from opd.kernels import decode_attention as triton_attention
from opd.rollout import Generator, SamplingParams, memory, static_engine
from opd.rollout.sampling import filter_logits
from opd.rollout.static_engine import StaticGenerator, _round_rows, _sample, unsupported_reason
from opd.rollout.torch_engine import TorchGenerator
from opd.train.step import compiled_graphs

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def engines(model, **kwargs):
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, **kwargs)
    return TorchGenerator(model, **common), StaticGenerator(model, kv_bucket=16, **common)


def tiny_llama_with_biases(**kwargs):
    """A tiny Llama with random biases on every projection (attention_bias, mlp_bias) and one kv head for four query
    heads (grouped-query attention with G = 4)."""
    config = make_tiny_model("llama", **kwargs).config
    config.attention_bias = config.mlp_bias = True
    config.num_key_value_heads = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):  # HF initialises biases to zero, which would test nothing
                    parameter.normal_(0, 0.3)
    return model.float().eval()


def _max_abs_diff(logprobs_a, logprobs_b):
    return max((abs(a - b) for row_a, row_b in zip(logprobs_a, logprobs_b) for a, b in zip(row_a, row_b)), default=0)


MODELS = {
    "qwen3": lambda **kwargs: make_tiny_model("qwen3", **kwargs),
    "qwen3_tied": lambda **kwargs: make_tiny_model("qwen3", tie_word_embeddings=True, **kwargs),
    "llama_biases_gqa": tiny_llama_with_biases,
}


# The Triton kernel runs interpreted here (~1 s a step): on the GQA model both weight layouts, on Qwen3 the fused one.
DECODE_PATHS = [(m, f, a) for m in MODELS for f in (True, False) for a in ("sdpa", "matmul")] + [
    pytest.param(*path, marks=pytest.mark.slow)  # the interpreted Triton kernel: seconds a case
    for path in (("llama_biases_gqa", True, "triton"), ("llama_biases_gqa", False, "triton"), ("qwen3", True, "triton"))
]


@pytest.mark.parametrize("model_name, fuse_weights, attention", DECODE_PATHS)
def test_every_decode_path_matches_torch_generator_in_float32(model_name, fuse_weights, attention):
    if attention == "triton" and not triton_attention.available(torch.device("cpu")):
        pytest.skip("Triton is not installed")
    # The kernel's least head size is 16 (one tensor-core tile): 64 / 4 heads for its cases.
    model = MODELS[model_name](**({"hidden_size": 64} if attention == "triton" else {}))
    reference = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    # 4 rows for 6 samples: the last two are placed into freed slots (refills) by every path
    static = StaticGenerator(
        model,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        kv_bucket=16,
        fuse_weights=fuse_weights,
        attention=attention,
        max_batch_size=4,
        sync_interval=8,
    )
    # (the interpreted Triton kernel costs ~1 s a step here: fewer steps)
    params = SamplingParams(
        n=2, temperature=0, max_new_tokens=16 if attention == "triton" else 40, return_logprobs=True
    )
    want, got = reference.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert got.response_ids == want.response_ids
    assert got.finish_reasons == want.finish_reasons
    assert static.stats["refills"] == 2
    # float32 on both sides; the two paths sum attention and GEMMs in another order (1e-6-level differences)
    assert _max_abs_diff(got.logprobs, want.logprobs) < 1e-5


def test_generation_is_unchanged_on_a_model_set_to_opd_varlen():
    """`load_model` sets opd_varlen on CUDA: generation (left-padded prefill, decode with a cache) must take its SDPA
    path exactly, in both engines, when the static engine pads its prefills (packing them is its default there)."""
    from opd.kernels import varlen_attention

    model = make_tiny_model("qwen3")
    params = SamplingParams(n=2, max_new_tokens=16, seed=5, return_logprobs=True)
    results = {}
    for attn in ("sdpa", varlen_attention.register()):
        model.set_attn_implementation(attn)
        padded = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=16, packed_prefill=False)
        results[attn] = [engine.generate(PROMPTS, params) for engine in (engines(model)[0], padded)]
    for want, got in zip(results["sdpa"], results[varlen_attention.ATTENTION]):
        assert got.response_ids == want.response_ids and got.logprobs == want.logprobs
    # packed, the float32 per-row and padded attention sum in another order: 1e-6-level log-prob differences that
    # do not move a draw here
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=16)
    assert static.packed_prefill  # the default on a model that packs
    packed = static.generate(PROMPTS, params)
    want = results["sdpa"][1]
    assert packed.response_ids == want.response_ids and _max_abs_diff(packed.logprobs, want.logprobs) < 1e-5


@pytest.mark.parametrize("rows", [3, 16])
def test_packed_prefill_gives_the_padded_prefills_greedy_outputs(rows):
    """Prompts of 1–40 tokens prefilled packed (no padding, rows attend within themselves) or left-padded: the same
    greedy tokens and, within float32 summation-order differences, the same log-probs, also for refilled slots; the
    packed forwards are cut by real tokens, the padded ones by padded tokens."""
    from opd.kernels import varlen_attention

    model = eos_biased("qwen3")
    model.set_attn_implementation(varlen_attention.register())
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=generator).tolist() for n in (1, 40, 7, 23, 2, 31)]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, return_logprobs=True)
    outputs, prefills = {}, {}
    for packed in (True, False):
        static = StaticGenerator(
            model,
            eos_token_ids=[EOS_ID],
            pad_token_id=PAD_ID,
            max_batch_size=rows,
            sync_interval=2,
            prefill_tokens=48,
            packed_prefill=packed,
        )
        outputs[packed] = static.generate(prompts, params)
        prefills[packed] = static.stats["prefills"]
    assert outputs[True].response_ids == outputs[False].response_ids
    assert outputs[True].finish_reasons == outputs[False].finish_reasons
    assert _max_abs_diff(outputs[True].logprobs, outputs[False].logprobs) < 1e-5
    for g, ids, lps in zip(outputs[True].group_ids, outputs[True].response_ids, outputs[True].logprobs):
        torch.testing.assert_close(torch.tensor(lps), _full_forward_logprobs(model, prompts[g], ids), atol=1e-5, rtol=0)
    if rows == 16:  # one placement of all six prompts: 1+2+7+23 | 31 | 40 packed; 1,2,7 | 23 | 31 | 40 padded
        assert (prefills[True], prefills[False]) == (3, 4)


def test_compiled_prefill_runs_the_compiled_layers_to_the_same_outputs():
    """Packed prefills through the layers `compile_layers` compiled (aot_eager here: the same graph capture without
    code generation) give the eager prefills' tokens and log-probs (float32 on CPU: the same kernels run), and after
    two calls' layouts (the first layer's empty cache, the later layers' filled one) they compile nothing new."""
    from torch._dynamo.utils import counters

    from opd.kernels import varlen_attention
    from opd.models import compile_layers

    model = eos_biased("qwen3")
    model.set_attn_implementation(varlen_attention.register())
    generator = torch.Generator().manual_seed(4)
    calls = [
        [torch.randint(3, TINY_VOCAB, (n,), generator=generator).tolist() for n in lengths]
        for lengths in ((5, 17, 9), (33, 2), (7, 40, 11, 6, 2), (3,), (12, 30))
    ]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8, return_logprobs=True)
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=4, prefill_tokens=48)
    eager = [StaticGenerator(model, **common).generate(prompts, params) for prompts in calls]
    torch._dynamo.reset()
    assert compile_layers(model, True, backend="aot_eager")
    try:
        engine = StaticGenerator(model, compiled_prefill=True, **common)
        graphs = []
        for prompts, want in zip(calls, eager):
            got = engine.generate(prompts, params)
            assert got.response_ids == want.response_ids and got.logprobs == want.logprobs
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] > 0 and graphs[2:] == [graphs[1]] * (len(calls) - 2)
    finally:
        torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"compiled_prefill=True: True or False, and True needs packed prefills"):
        StaticGenerator(model, packed_prefill=False, compiled_prefill=True)


def test_packed_prefill_needs_a_model_that_packs():
    with pytest.raises(
        ValueError, match="packed_prefill=True needs a model loaded with attn_implementation='opd_varlen'"
    ):
        StaticGenerator(make_tiny_model("qwen3"), packed_prefill=True)
    with pytest.raises(ValueError, match="packed_prefill must be None, True or False, got 'yes'"):
        StaticGenerator(make_tiny_model("qwen3"), packed_prefill="yes")
    assert not StaticGenerator(make_tiny_model("qwen3")).packed_prefill  # the default where the model cannot pack


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_autocast_decodes_on_cast_once_weights_with_the_float32_residual_of_autocast(kind, monkeypatch):
    """fuse_weights under autocast (float32 master weights, as in training) = the unfused step on the module's own
    tensors under autocast, bit for bit, but run without autocast (the GEMM weights are cast once per call): the
    residual stream, the embedding table and the norms stay float32 as autocast keeps them, so the engine's log-probs
    are those of the autocast forward the trainer scores with. A bf16 residual (the step of a bf16 model, which this
    path ran before) differs."""
    autocast_in_step, plain_attn_in = [], static_engine._attn_in

    def spy_attn_in(*args):
        autocast_in_step.append(torch.is_autocast_enabled("cpu"))
        return plain_attn_in(*args)

    monkeypatch.setattr(static_engine, "_attn_in", spy_attn_in)
    model = make_tiny_model(kind, tie_word_embeddings=kind == "qwen3")
    bf16_model = make_tiny_model(kind, tie_word_embeddings=kind == "qwen3")
    for parameter in bf16_model.parameters():  # parameters only: `.to(bf16)` would also round RoPE's inv_freq
        parameter.data = parameter.data.bfloat16()
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=16, max_batch_size=4)
    for params in (
        SamplingParams(n=2, temperature=0, max_new_tokens=40, return_logprobs=True),
        SamplingParams(n=4, max_new_tokens=20, seed=3, return_logprobs=True),
    ):
        outputs = {}
        for fuse_weights in (True, False):
            autocast_in_step.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs[fuse_weights] = StaticGenerator(model, fuse_weights=fuse_weights, **common).generate(
                    PROMPTS, params
                )
            assert autocast_in_step and set(autocast_in_step) == {not fuse_weights}
        fused, unfused = outputs[True], outputs[False]
        assert fused.response_ids == unfused.response_ids and fused.logprobs == unfused.logprobs
        bf16_step = StaticGenerator(bf16_model, **common)
        bf16_step.hf = StaticGenerator(model, **common).hf  # the same (autocast) prefill: compare the decode steps
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = bf16_step.generate(PROMPTS, params)
        assert _max_abs_diff([row[:1] for row in bf16.logprobs], [row[:1] for row in fused.logprobs]) == 0
        assert bf16.logprobs != fused.logprobs


def test_weights_updated_between_calls_are_seen():
    """The fused weights are rebuilt for every chunk, so an optimizer step between two calls counts."""
    model = make_tiny_model("qwen3")
    reference, static = engines(model)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12, return_logprobs=True)
    before = static.generate(PROMPTS, params)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(-1.5)
        model.model.layers[1].mlp.up_proj.weight.mul_(2.0)
    after, want = static.generate(PROMPTS, params), reference.generate(PROMPTS, params)
    assert after.logprobs != before.logprobs
    assert after.response_ids == want.response_ids
    assert _max_abs_diff(after.logprobs, want.logprobs) < 1e-5
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy picks id 0, log-prob -log V
    uniform = static.generate(PROMPTS, params)
    assert all(ids == [0] * 12 for ids in uniform.response_ids)
    assert _max_abs_diff(uniform.logprobs, [[-math.log(261)] * 12] * 6) < 1e-5


@pytest.mark.parametrize("columns", [10, 151669])
def test_sampling_reductions_in_pieces_equal_the_plain_ones(columns):
    x = torch.randn(5, columns, generator=torch.Generator().manual_seed(0))
    x[0, 1:] = float("-inf")  # one finite entry: the padding must not win
    assert torch.equal(static_engine._split_argmax(x), x.argmax(-1))
    torch.testing.assert_close(static_engine._split_logsumexp(x), x.logsumexp(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_sample_draws_below_vocab_size_and_reports_unfiltered_logprobs(temperature):
    """`_sample` on logits with padding columns past vocab_size (which would win the argmax) and top-k 3."""
    generator = torch.Generator().manual_seed(0)
    logits_RV = torch.randn(1, 12, generator=generator).expand(500, 12).contiguous()  # one row, 500 draws
    logits_RV[:, 10:] = 100.0
    noise_RN = torch.rand(500, 10, generator=generator)
    tokens_R, logprobs_R = _sample(logits_RV, noise_RN if temperature else None, temperature, 10, 3, 1.0)
    scaled_RV = logits_RV[:, :10] / (temperature or 1.0)
    assert tokens_R.max() < 10
    allowed = set(scaled_RV[0].topk(3).indices.tolist()) if temperature else {int(scaled_RV[0].argmax())}
    assert set(tokens_R.tolist()) == allowed  # 500 draws from 3 comparable tokens: each appears
    want_R = scaled_RV.log_softmax(-1).gather(-1, tokens_R[:, None]).squeeze(-1)
    assert torch.allclose(logprobs_R, want_R, atol=1e-6)


def test_greedy_with_a_vocab_limit_matches_torch_generator():
    model = make_tiny_model("llama")
    params = SamplingParams(n=1, temperature=0, max_new_tokens=20, return_logprobs=True)
    unlimited = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID).generate(PROMPTS, params)
    assert max(max(ids) for ids in unlimited.response_ids) >= 100  # the limit below changes the argmax
    reference, static = engines(model, vocab_size=100)
    want, got = reference.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert max(max(ids) for ids in got.response_ids) < 100
    assert got.response_ids == want.response_ids
    assert _max_abs_diff(got.logprobs, want.logprobs) < 1e-5


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_matches_torch_generator(kind):
    reference, static = engines(make_tiny_model(kind))
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, return_logprobs=True)
    want, got = reference.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert isinstance(static, Generator)
    assert got.response_ids == want.response_ids
    assert got.finish_reasons == want.finish_reasons
    assert got.group_ids == want.group_ids
    for lps_want, lps_got in zip(want.logprobs, got.logprobs):
        assert torch.allclose(torch.tensor(lps_got), torch.tensor(lps_want), atol=1e-4)


def test_greedy_stops_at_eos_keeps_it_and_matches_in_small_chunks():
    reference, static = engines(make_tiny_model("qwen3"), max_batch_size=3)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40)
    want, got = reference.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert got.response_ids == want.response_ids
    stopped = [ids for ids, reason in zip(got.response_ids, got.finish_reasons) if reason == "stop"]
    assert stopped and all(ids[-1] == EOS_ID and EOS_ID not in ids[:-1] for ids in stopped)


def _next_token_probs(model, prompt, temperature=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return (logits / temperature).softmax(-1)


def _total_variation(tokens, probs):
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).float()
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_frequencies_match_the_model(temperature):
    """Gumbel-max draws from softmax(z / τ): with 20000 draws the total-variation distance to the exact distribution
    stays near its sampling noise (≈ 0.045 for this flat 261-token distribution), as TorchGenerator's does."""
    model = make_tiny_model("qwen3", initializer_range=0.05)  # a flat distribution: many tokens matter
    probs = _next_token_probs(model, PROMPTS[0], temperature)
    params = SamplingParams(n=20000, temperature=temperature, max_new_tokens=1, seed=3, stop_at_eos=False)
    reference, static = engines(model, max_batch_size=20000)
    tv_static = _total_variation([r[0] for r in static.generate([PROMPTS[0]], params).response_ids], probs)
    tv_reference = _total_variation([r[0] for r in reference.generate([PROMPTS[0]], params).response_ids], probs)
    assert tv_static < 0.07 and tv_reference < 0.07, (tv_static, tv_reference)


@pytest.mark.slow
def test_decode_step_samples_the_right_distribution():
    """The second token comes from our own decode step: its marginal, Σ_c p(c) p(· | c), matches the model."""
    model = make_tiny_model("qwen3", initializer_range=0.05)
    first_V = _next_token_probs(model, PROMPTS[1])
    vocab = first_V.numel()
    with torch.no_grad():  # p(· | prompt, c) for every first token c at once
        ids_VL = torch.cat([torch.tensor(PROMPTS[1]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second_VV = model(input_ids=ids_VL).logits[:, -1].float().softmax(-1)
    marginal_V = first_V @ second_VV
    params = SamplingParams(n=20000, max_new_tokens=2, seed=5, stop_at_eos=False, return_logprobs=True)
    out = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=20000).generate(
        [PROMPTS[1]], params
    )
    assert _total_variation([r[1] for r in out.response_ids], marginal_V) < 0.07
    # reported log-probs are the model's, before any filtering
    first, second = out.response_ids[0]
    assert out.logprobs[0][1] == pytest.approx(float(second_VV[first, second].log()), abs=1e-4)


def test_top_k_top_p_and_vocab_limit_restrict_the_support():
    model = make_tiny_model("qwen3", initializer_range=0.05)
    probs = _next_token_probs(model, PROMPTS[0])
    allowed_k = set(torch.topk(probs, 5).indices.tolist())
    params = SamplingParams(n=500, top_k=5, max_new_tokens=1, seed=1, stop_at_eos=False)
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=500)
    assert {r[0] for r in static.generate([PROMPTS[0]], params).response_ids} <= allowed_k
    limited = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, vocab_size=100, max_batch_size=500)
    out = limited.generate([PROMPTS[0]], SamplingParams(n=500, max_new_tokens=3, seed=1, stop_at_eos=False))
    assert max(max(r) for r in out.response_ids) < 100
    nucleus = filter_logits(probs.log()[None], top_p=0.05)[0].isfinite().nonzero().squeeze(-1).tolist()
    top = SamplingParams(n=500, top_p=0.05, max_new_tokens=1, seed=2, stop_at_eos=False)
    assert {r[0] for r in static.generate([PROMPTS[0]], top).response_ids} <= set(nucleus) < set(range(probs.numel()))


def test_same_seed_same_samples_other_seed_differs():
    static = StaticGenerator(make_tiny_model("llama"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    params = SamplingParams(n=3, max_new_tokens=12, seed=7)
    first, again = static.generate(PROMPTS, params), static.generate(PROMPTS, params)
    other = static.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=12, seed=8))
    assert first.response_ids == again.response_ids
    assert first.response_ids != other.response_ids


def test_unsupported_models_raise():
    """No silent fallback: engine "auto" (`opd.rollout.registry`) is where unsupported layouts get TorchGenerator."""
    model = make_tiny_model("qwen3")
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()  # exact GELU: neither SiLU nor the tanh approximation
    assert "activation (GELU) is not SiLU or GELU-tanh, the same in every layer" in unsupported_reason(model)
    with pytest.raises(NotImplementedError, match=r"activation .* \(engine 'auto' or 'torch' runs any causal LM\)"):
        StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    with pytest.raises(ValueError, match="kv_bucket"):
        StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=0)
    with pytest.raises(ValueError, match="round_rows must be None, True or False, got 1"):
        StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, round_rows=1)
    for splits in (3, 0, "4"):
        with pytest.raises(ValueError, match=f"attention_splits must be None or a power of two ≥ 1, got {splits!r}"):
            StaticGenerator(
                make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, attention_splits=splits
            )
    with pytest.raises(ValueError, match="attention must be one of auto, triton, sdpa, matmul, got 'flash'"):
        StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, attention="flash")
    if triton_attention.available(torch.device("cpu")):  # head size 8 (32 / 4 heads): below the kernel's 16
        with pytest.raises(ValueError, match="power-of-two head size in \\[16, 256\\], this model's is 8"):
            StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, attention="triton")


# ------------------------------------------------------------------------------------------ continuous batching


def eos_biased(kind="qwen3", bias=2.0, **kwargs):
    """A tiny model whose EOS logit is raised by `bias`: greedy and sampled responses end at many different lengths
    (bias 2: greedy lengths 4–30 over random prompts; bias 3: sampled lengths spread over 1–12)."""
    model = make_tiny_model(kind, **kwargs)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(TINY_VOCAB))
    with torch.no_grad():
        model.lm_head.bias[EOS_ID] = bias
    return model


def random_prompts(count, seed=0, longest=12):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, longest, (count,), generator=g)
    ]


def _full_forward_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("rows, sync_interval", [(1, 1), (3, 1), (5, 4), (16, 32)])
def test_refilled_slots_give_torch_generators_greedy_outputs(kind, rows, sync_interval):
    """Rows end at EOS after 1–30 tokens; freed slots take the next samples (a new prompt at another position in the
    same static cache). Greedy outputs equal TorchGenerator's for every row count and check interval, and every
    reported log-prob equals a teacher-forced forward over prompt + response (float32; the tolerance covers the
    different summation order of the static step's GEMMs and attention)."""
    model = eos_biased(kind)
    prompts = random_prompts(8)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=30, return_logprobs=True)
    want = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID).generate(prompts, params)
    static = StaticGenerator(
        model,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        kv_bucket=16,
        max_batch_size=rows,
        sync_interval=sync_interval,
    )
    got = static.generate(prompts, params)
    assert got.response_ids == want.response_ids and got.finish_reasons == want.finish_reasons
    assert len({len(ids) for ids in got.response_ids}) >= 4 and {"stop", "length"} == set(got.finish_reasons)
    assert static.stats["rows"] == rows and (static.stats["refills"] > 0) == (rows < 16)
    for g, ids, lps in zip(got.group_ids, got.response_ids, got.logprobs):
        torch.testing.assert_close(torch.tensor(lps), _full_forward_logprobs(model, prompts[g], ids), atol=1e-5, rtol=0)


def test_no_row_idles_while_samples_are_pending():
    """Per-sample lengths 5, 1, 3, 2, 4, 1 in two rows, checked after every step: each slot is refilled as soon as it
    frees (sample 1 ends on its first token and hands its slot to sample 2 at once), so the schedule traced below
    takes 6 decode steps and every sample after the first two is a refill."""
    model = make_tiny_model("qwen3")
    prompts = random_prompts(6, seed=1)
    caps = [5, 1, 3, 2, 4, 1]
    params = SamplingParams(temperature=0, max_new_tokens=5, stop_at_eos=False, return_logprobs=True)
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=2, sync_interval=1)
    out = static.generate(prompts, params, max_new_tokens_per_sample=caps)
    assert [len(ids) for ids in out.response_ids] == caps and out.finish_reasons == ["length"] * 6
    # slot 0: sample 0 (steps 1-4); slot 1: sample 1 ends at once → sample 2 (steps 1-2) → 3 (step 3) → 4 (steps 4-6);
    # sample 5 takes slot 0 after step 4 and ends at once.
    assert static.stats["decode_steps"] == 6 and static.stats["refills"] == 4
    want = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID).generate(
        prompts, params, max_new_tokens_per_sample=caps
    )
    assert out.response_ids == want.response_ids and out.finish_reasons == want.finish_reasons


def test_samples_of_a_prompt_share_one_prefill():
    model = make_tiny_model("qwen3")
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=8)
    static.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(n=4, max_new_tokens=3, seed=0))
    assert static.stats["prefills"] == 1 and static.stats["refills"] == 0
    static.prefill_tokens = 8  # one 8-token prompt a forward: two prefills
    static.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(n=4, max_new_tokens=3, seed=0))
    assert static.stats["prefills"] == 2


def test_a_prompt_given_twice_is_prefilled_once():
    """A partial-rollout stream sends a call's samples one prefix each (`opd.train.stream`), so the samples of a group
    that have no tokens yet arrive as copies of one prompt: they share one prefill, as n samples of a prompt do, and
    sample exactly what n samples of it would."""
    model = make_tiny_model("qwen3")
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=8)
    static.generate([PROMPTS[0], PROMPTS[2], PROMPTS[0]], SamplingParams(max_new_tokens=4))
    assert static.stats["prefilled_tokens"] == len(PROMPTS[0]) + len(PROMPTS[2])  # before: 2 × len(PROMPTS[0]) + …
    static.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], SamplingParams(max_new_tokens=4))
    assert static.stats["prefilled_tokens"] == len(PROMPTS[0]) + len(PROMPTS[2]) + len(PROMPTS[1])

    sampled = dict(max_new_tokens=6, seed=3, return_logprobs=True)
    copies = static.generate([PROMPTS[0]] * 3, SamplingParams(n=1, **sampled))
    grouped = static.generate([PROMPTS[0]], SamplingParams(n=3, **sampled))
    assert len({tuple(ids) for ids in copies.response_ids}) > 1  # sampled rows, not one row three times
    assert copies.response_ids == grouped.response_ids and copies.logprobs == grouped.logprobs
    assert copies.group_ids == [0, 1, 2] and grouped.group_ids == [0, 0, 0]

    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0]]
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    want = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID).generate(prompts, greedy)
    assert static.generate(prompts, greedy).response_ids == want.response_ids


def _chi_square(counts_a: dict, counts_b: dict) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories seen (those with fewer than 10 samples in total are
    pooled into one) and its degrees of freedom."""
    total_a, total_b = sum(counts_a.values()), sum(counts_b.values())
    keys = set(counts_a) | set(counts_b)
    rare = {k for k in keys if counts_a.get(k, 0) + counts_b.get(k, 0) < 10}
    a = {k: counts_a.get(k, 0) for k in keys - rare} | {"rare": sum(counts_a.get(k, 0) for k in rare)}
    b = {k: counts_b.get(k, 0) for k in keys - rare} | {"rare": sum(counts_b.get(k, 0) for k in rare)}
    stat, cells = 0.0, 0
    for k in a:
        n = a[k] + b[k]
        if n == 0:
            continue
        cells += 1
        for observed, total in ((a[k], total_a), (b[k], total_b)):
            expected = n * total / (total_a + total_b)
            stat += (observed - expected) ** 2 / expected
    return stat, cells - 1


def _chi_square_999(dof: int) -> float:
    """The 99.9% quantile of a chi-square with dof degrees of freedom (Wilson–Hilferty, within 1% for dof ≥ 3)."""
    z = 3.090
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _distribution(output):
    """Counts of (response length) and of (first token, second token or EOS) over the samples."""
    lengths, pairs = {}, {}
    for ids in output.response_ids:
        lengths[len(ids)] = lengths.get(len(ids), 0) + 1
        pair = (ids[0], ids[1] if len(ids) > 1 else None)
        pairs[pair] = pairs.get(pair, 0) + 1
    return lengths, pairs


@pytest.mark.slow
def test_sampling_with_refills_matches_torch_generator_and_other_row_counts():
    """2000 seeded samples of one prompt, EOS likely (lengths 1–12): the length distribution and the joint
    distribution of the first two tokens agree between TorchGenerator (all rows at once) and StaticGenerator with 64
    and with 12 rows (thousands of refills), each pair within the 99.9% quantile of a two-sample chi-square test (a
    fixed seed: the test is deterministic; with an exact sampler it fails one seed in a thousand)."""
    model = eos_biased("qwen3", bias=4.0)  # every length 1–12 has > 100 of 4000 samples, 36 token pairs ≥ 10
    params = SamplingParams(n=2000, max_new_tokens=12, seed=11)
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    reference = TorchGenerator(model, max_batch_size=2000, **common).generate([PROMPTS[1]], params)
    outputs = {}
    for rows in (64, 12):
        static = StaticGenerator(model, max_batch_size=rows, sync_interval=2, row_buckets=True, **common)
        outputs[rows] = static.generate([PROMPTS[1]], params)
        assert static.stats["refills"] == 2000 - rows
        assert len(static.stats["bucket_steps"]) >= 2  # the tail ran in smaller live-row buckets
    distributions = {name: _distribution(out) for name, out in [("torch", reference), *outputs.items()]}
    assert len(distributions["torch"][0]) == 12  # every length: refills happen at many different steps
    for a, b in (("torch", 64), ("torch", 12), (64, 12)):
        for counts_a, counts_b in zip(distributions[a], distributions[b]):
            stat, dof = _chi_square(counts_a, counts_b)
            assert dof >= 8 and stat < _chi_square_999(dof), (a, b, stat, dof)


def test_refills_are_deterministic_per_seed():
    """Same seed, prompts and rows: the same samples in the same slots, bit for bit (log-probs too); another seed
    differs; another row count keeps the prompt-major layout (its draws differ)."""
    model = eos_biased("llama", bias=3.0)
    prompts = random_prompts(5, seed=2)
    params = SamplingParams(n=3, max_new_tokens=15, seed=7, return_logprobs=True)
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=4, sync_interval=2)
    first, again = static.generate(prompts, params), static.generate(prompts, params)
    assert static.stats["refills"] > 0
    assert first.response_ids == again.response_ids and first.logprobs == again.logprobs
    assert first.response_ids != static.generate(prompts, SamplingParams(n=3, max_new_tokens=15, seed=8)).response_ids
    other_rows = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, max_batch_size=7).generate(
        prompts, params
    )
    assert other_rows.group_ids == first.group_ids and other_rows.response_ids != first.response_ids


# Long-tailed per-sample caps: once nothing is pending the tail runs in live-row buckets 8 → 4
TAIL_CAPS = [2, 40, 3, 5, 1, 33, 7, 2, 60, 4, 3, 9]
TAIL_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _tail_call(model, temperature, row_buckets, **kwargs):
    static = StaticGenerator(
        model,
        eos_token_ids=[EOS_ID],
        pad_token_id=PAD_ID,
        max_batch_size=8,
        sync_interval=4,
        row_buckets=row_buckets,
        **kwargs,
    )
    params = SamplingParams(
        n=4, temperature=temperature, max_new_tokens=60, seed=3, return_logprobs=True, stop_at_eos=False
    )
    return static.generate(TAIL_PROMPTS, params, max_new_tokens_per_sample=TAIL_CAPS), static.stats


@pytest.mark.parametrize("fuse_weights, attention", [(f, a) for f in (True, False) for a in ("sdpa", "matmul")])
def test_live_row_buckets_keep_greedy_outputs(fuse_weights, attention):
    """Greedy decoding with the tail moved into smaller row buckets gives the tokens of the all-rows step; log-probs
    agree to 1e-5 (float32: a step over fewer rows may run other GEMM kernels, whose sums round differently)."""
    model = make_tiny_model("qwen3")
    kwargs = dict(kv_bucket=16, fuse_weights=fuse_weights, attention=attention)
    (buckets, stats), (single, single_stats) = (_tail_call(model, 0, on, **kwargs) for on in (True, False))
    assert list(stats["bucket_steps"]) == [8, 4] and list(single_stats["bucket_steps"]) == [8]
    assert stats["bucket_occupancy"] > single_stats["occupancy"] == stats["occupancy"]
    assert buckets.response_ids == single.response_ids and [len(r) for r in buckets.response_ids] == TAIL_CAPS
    assert _max_abs_diff(buckets.logprobs, single.logprobs) < 1e-5


def test_live_row_buckets_are_deterministic_per_seed():
    """Sampled: the bucket sequence follows from the rows alive at each host check, so a seed replays bit for bit;
    its draws differ from the all-rows step's (fewer uniforms per step once the rows shrink)."""
    model = make_tiny_model("qwen3")
    (first, stats), (again, _) = _tail_call(model, 1.0, True), _tail_call(model, 1.0, True)
    assert len(stats["bucket_steps"]) == 2
    assert first.response_ids == again.response_ids and first.logprobs == again.logprobs
    assert [len(r) for r in first.response_ids] == TAIL_CAPS


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
    assert _max_abs_diff(rounded.logprobs, exact.logprobs) < 1e-5


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
    assert _max_abs_diff(got.logprobs, want.logprobs) < 1e-4


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
