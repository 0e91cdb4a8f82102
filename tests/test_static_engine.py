"""`StaticGenerator` against `TorchGenerator` and the model's exact distribution, on tiny CPU models (eager decode
step: the CUDA graphs and compilation are exercised by `benchmarks/rollout.py` on a GPU)."""

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import EOS_ID, PAD_ID, make_tiny_model
from opd.rollout import Generator, SamplingParams, static_engine
from opd.kernels import decode_attention as triton_attention
from opd.rollout.static_engine import StaticGenerator, _sample, unsupported_reason
from opd.rollout.torch_engine import TorchGenerator, filter_logits

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


# The Triton kernel runs interpreted here (~8–18 s a case): on the GQA model both weight layouts, on Qwen3 the fused one.
DECODE_PATHS = [(m, f, a) for m in MODELS for f in (True, False) for a in ("sdpa", "matmul")] + [
    ("llama_biases_gqa", True, "triton"), ("llama_biases_gqa", False, "triton"), ("qwen3", True, "triton")]


@pytest.mark.parametrize("model_name, fuse_weights, attention", DECODE_PATHS)
def test_every_decode_path_matches_torch_generator_in_float32(model_name, fuse_weights, attention):
    if attention == "triton" and not triton_attention.available(torch.device("cpu")):
        pytest.skip("Triton is not installed")
    # The kernel's least head size is 16 (one tensor-core tile): 64 / 4 heads for its cases.
    model = MODELS[model_name](**({"hidden_size": 64} if attention == "triton" else {}))
    reference = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    static = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=16,
                             fuse_weights=fuse_weights, attention=attention)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, return_logprobs=True)
    want, got = reference.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert got.response_ids == want.response_ids
    assert got.finish_reasons == want.finish_reasons
    assert _max_abs_diff(got.logprobs, want.logprobs) < 1e-5


def test_generation_is_unchanged_on_a_model_set_to_opd_varlen():
    """`load_model` sets opd_varlen on CUDA: generation (left-padded prefill, decode with a cache) must take its SDPA
    path exactly, in both engines."""
    from opd.kernels import varlen_attention

    model = make_tiny_model("qwen3")
    params = SamplingParams(n=2, max_new_tokens=16, seed=5, return_logprobs=True)
    results = {}
    for attn in ("sdpa", varlen_attention.register()):
        model.set_attn_implementation(attn)
        results[attn] = [engine.generate(PROMPTS, params) for engine in engines(model)]
    for want, got in zip(results["sdpa"], results[varlen_attention.ATTENTION]):
        assert got.response_ids == want.response_ids and got.logprobs == want.logprobs


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_autocast_decodes_on_cast_once_weights_like_a_bf16_model(kind, monkeypatch):
    """fuse_weights under autocast = the decode step of the model with bf16 parameters, bit for bit, run without
    autocast. The prefill is shared (the HF prefill under autocast keeps a float32 residual stream, a bf16 model does
    not), so only the decode steps are compared; without fuse_weights the step runs under autocast (float32
    residual) and differs."""
    autocast_in_step, plain_attn_in = [], static_engine._attn_in

    def spy_attn_in(*args):
        autocast_in_step.append(torch.is_autocast_enabled("cpu"))
        return plain_attn_in(*args)

    monkeypatch.setattr(static_engine, "_attn_in", spy_attn_in)
    model = make_tiny_model(kind, tie_word_embeddings=kind == "qwen3")
    bf16_model = make_tiny_model(kind, tie_word_embeddings=kind == "qwen3")
    for parameter in bf16_model.parameters():  # parameters only: `.to(bf16)` would also round RoPE's inv_freq
        parameter.data = parameter.data.bfloat16()
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=16)
    bf16 = StaticGenerator(bf16_model, **common)
    for params in (SamplingParams(n=2, temperature=0, max_new_tokens=40, return_logprobs=True),
                   SamplingParams(n=4, max_new_tokens=20, seed=3, return_logprobs=True)):
        want = bf16.generate(PROMPTS, params)
        for fuse_weights in (True, False):
            autocast = StaticGenerator(model, fuse_weights=fuse_weights, **common)
            autocast._prefill = bf16._prefill
            autocast_in_step.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = autocast.generate(PROMPTS, params)
            assert autocast_in_step and set(autocast_in_step) == {not fuse_weights}
            if fuse_weights:
                assert got.response_ids == want.response_ids and got.logprobs == want.logprobs
            else:
                assert got.logprobs != want.logprobs
                assert _max_abs_diff([row[:1] for row in got.logprobs], [row[:1] for row in want.logprobs]) == 0


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
        [PROMPTS[1]], params)
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


def test_unsupported_models_raise_or_fall_back():
    model = make_tiny_model("qwen3")
    model.config.hidden_act = "gelu"  # (the built modules keep SiLU, so the model itself still runs)
    assert "hidden_act" in unsupported_reason(model)
    with pytest.raises(NotImplementedError, match="hidden_act"):
        StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    fallback = StaticGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, fallback=True)
    reference = TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    params = SamplingParams(n=2, max_new_tokens=8, seed=1)
    assert fallback.generate(PROMPTS, params).response_ids == reference.generate(PROMPTS, params).response_ids
    with pytest.raises(ValueError, match="kv_bucket"):
        StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, kv_bucket=0)
    with pytest.raises(ValueError, match="attention must be one of auto, triton, sdpa, matmul, got 'flash'"):
        StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, attention="flash")
    if triton_attention.available(torch.device("cpu")):  # head size 8 (32 / 4 heads): below the kernel's 16
        with pytest.raises(ValueError, match="power-of-two head size in \\[16, 256\\], this model's is 8"):
            StaticGenerator(make_tiny_model("qwen3"), eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, attention="triton")
