"""`StaticGenerator` against `TorchGenerator` and the model's exact distribution, on tiny CPU models (eager decode
step: the CUDA graphs and compilation are exercised by `benchmarks/check_cuda.py` and `benchmarks/rollout.py` on a
GPU): every decode path, continuous batching (slots refilled as rows finish), its determinism. Rounded rows and the
memory sizing: test_static_engine_rows.py."""

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_tiny_model
from helpers_static_engine import PROMPTS, TAIL_CAPS, TAIL_PROMPTS, engines, eos_biased, max_abs_diff, random_prompts
from opd.kernels import decode_attention as triton_attention
from opd.rollout import Generator, SamplingParams, static_engine
from opd.rollout.sampling import filter_logits
from opd.rollout.static_engine import StaticGenerator, _sample, unsupported_reason
from opd.rollout.torch_engine import TorchGenerator


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
    assert max_abs_diff(got.logprobs, want.logprobs) < 1e-5


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
    assert packed.response_ids == want.response_ids and max_abs_diff(packed.logprobs, want.logprobs) < 1e-5


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
    assert max_abs_diff(outputs[True].logprobs, outputs[False].logprobs) < 1e-5
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
        assert max_abs_diff([row[:1] for row in bf16.logprobs], [row[:1] for row in fused.logprobs]) == 0
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
    assert max_abs_diff(after.logprobs, want.logprobs) < 1e-5
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy picks id 0, log-prob -log V
    uniform = static.generate(PROMPTS, params)
    assert all(ids == [0] * 12 for ids in uniform.response_ids)
    assert max_abs_diff(uniform.logprobs, [[-math.log(261)] * 12] * 6) < 1e-5


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
    assert max_abs_diff(got.logprobs, want.logprobs) < 1e-5


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
    assert max_abs_diff(buckets.logprobs, single.logprobs) < 1e-5


def test_live_row_buckets_are_deterministic_per_seed():
    """Sampled: the bucket sequence follows from the rows alive at each host check, so a seed replays bit for bit;
    its draws differ from the all-rows step's (fewer uniforms per step once the rows shrink)."""
    model = make_tiny_model("qwen3")
    (first, stats), (again, _) = _tail_call(model, 1.0, True), _tail_call(model, 1.0, True)
    assert len(stats["bucket_steps"]) == 2
    assert first.response_ids == again.response_ids and first.logprobs == again.logprobs
    assert [len(r) for r in first.response_ids] == TAIL_CAPS
