"""Chunked scoring == the naive full-vocabulary computation (opd.scoring), and the local scorer == the model's own
logits (opd.teacher.local), packed == padded, plus peak-memory checks on a 151936-token vocabulary.

The compiled path (CUDA only by default) is covered on CPU by running its plumbing (padding, buckets, whole-chunk
calls) with an identity `torch.compile`, its fallback with a failing one, and real inductor only with OPD_SLOW_TESTS=1.
"""

from __future__ import annotations

import ctypes
import os
import warnings

import pytest
import torch

import opd.scoring as scoring
from helpers import make_rollouts
from opd.forward import check_output_head, output_head, split_by_token_budget
from opd.kernels import varlen_attention
from opd.scoring import OutputHead, candidate_logprobs, candidate_logprobs_and_entropy, default_chunk_size, score_hidden
from opd.teacher import LocalScorer, TeacherScorer, forward_hidden
from opd.types import Rollouts

# ---------------------------------------------------------------------------------------------------------------
# naive references


def naive_logprobs(hidden_ND, head: OutputHead, temperature: float, vocab_size: int | None) -> torch.Tensor:
    """[N, V_model] float64 log-probs from the full logits; padding rows (≥ vocab_size) masked to -inf."""
    z = (
        torch.nn.functional.linear(
            hidden_ND.double(), head.weight.double(), None if head.bias is None else head.bias.double()
        )
        * head.logit_scale
    )
    if head.softcap is not None:
        z = head.softcap * torch.tanh(z / head.softcap)
    z = z / temperature
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(z.shape[1]) >= vocab_size, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def naive_entropy(lp_NV: torch.Tensor) -> torch.Tensor:
    p = lp_NV.exp()
    return -(p * torch.where(p > 0, lp_NV, torch.zeros_like(lp_NV))).sum(-1)


def make_head(
    v_model: int, d: int, *, bias=False, scale=1.0, softcap=None, pad_from=None, dtype=torch.float32, seed=0
) -> OutputHead:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v_model, d, generator=g, dtype=dtype)
    if pad_from is not None:
        weight[pad_from:] *= 50  # padding rows with huge logits: they would win every top-k if not excluded
    b = torch.randn(v_model, generator=g, dtype=dtype) if bias else None
    return OutputHead(weight, b, scale, softcap)


HEAD_VARIANTS = [
    dict(),
    dict(bias=True),
    dict(scale=0.25, softcap=3.0),
    dict(bias=True, scale=2.0, softcap=5.0),
    dict(scale=-0.5, softcap=3.0),  # z decreasing in the raw logits: top-k must take the smallest raw values
]

# ---------------------------------------------------------------------------------------------------------------
# score_hidden


@pytest.mark.parametrize("variant", HEAD_VARIANTS)
@pytest.mark.parametrize("vocab_size", [None, 53])
@pytest.mark.parametrize("topk_piece", [512, 4])
def test_score_hidden_matches_naive(variant, vocab_size, topk_piece, monkeypatch):
    monkeypatch.setattr(scoring, "_TOPK_PIECE", topk_piece)  # 512: one piece, plain topk; 4: the two-stage top-k
    n, d, v_model, k, r, temperature = 23, 16, 61, 7, 5, 0.7
    head = make_head(v_model, d, pad_from=vocab_size, **variant)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, d, generator=g)
    v_used = vocab_size or v_model
    targets = torch.randint(0, v_used, (n,), generator=g)
    requested = torch.randint(0, v_used, (n, r), generator=g)

    out = score_hidden(
        hidden,
        head,
        targets_N=targets,
        top_k=k,
        requested_ids_NQ=requested,
        temperature=temperature,
        vocab_size=vocab_size,
        with_entropy=True,
        chunk_size=5,
    )
    lp = naive_logprobs(hidden, head, temperature, vocab_size)
    ref_vals, ref_ids = lp.topk(k, dim=-1)

    assert out.sampled_logprobs.dtype == torch.float32 and out.sampled_logprobs.shape == (n,)
    torch.testing.assert_close(out.sampled_logprobs.double(), lp.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
    assert torch.equal(out.topk_ids.sort(-1).values, ref_ids.sort(-1).values)  # identical sets
    torch.testing.assert_close(out.topk_logprobs.double(), ref_vals, atol=1e-5, rtol=0)  # descending, same values
    assert int(out.topk_ids.max()) < v_used
    torch.testing.assert_close(out.requested_logprobs.double(), lp.gather(1, requested), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), naive_entropy(lp), atol=1e-5, rtol=0)


def test_score_hidden_default_chunk_bf16_and_options():
    head = make_head(50, 8, dtype=torch.bfloat16)
    hidden = torch.randn(9, 8, dtype=torch.bfloat16)
    targets = torch.randint(0, 50, (9,))
    out = score_hidden(hidden, head.weight, targets_N=targets)  # bare weight, default chunk, no extras
    assert out.topk_ids is None and out.entropy is None and out.requested_logprobs is None
    assert out.sampled_logprobs.dtype == torch.float32
    # logits rounded to bf16 by the matmul (as lm_head does), then float32: the reference does the same
    z = (hidden @ head.weight.T).float()
    torch.testing.assert_close(out.sampled_logprobs, z.log_softmax(-1).gather(1, targets[:, None])[:, 0])


def test_score_hidden_empty_and_errors():
    head = make_head(20, 4)
    out = score_hidden(
        torch.zeros(0, 4),
        head,
        targets_N=torch.zeros(0, dtype=torch.long),
        top_k=3,
        requested_ids_NQ=torch.zeros(0, 2, dtype=torch.long),
        with_entropy=True,
    )
    assert out.sampled_logprobs.shape == (0,) and out.topk_ids.shape == (0, 3)
    assert out.requested_logprobs.shape == (0, 2) and out.entropy.shape == (0,)
    with pytest.raises(ValueError, match="targets_N"):
        score_hidden(torch.zeros(2, 4), head, targets_N=torch.tensor([0, 18]), vocab_size=18)
    with pytest.raises(ValueError, match="vocab_size"):
        score_hidden(torch.zeros(2, 4), head, targets_N=torch.tensor([0, 1]), vocab_size=21)
    with pytest.raises(ValueError, match="temperature"):
        score_hidden(torch.zeros(2, 4), head, targets_N=torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        score_hidden(torch.zeros(2, 4), head, targets_N=torch.tensor([0, 1]), top_k=21)


# ---------------------------------------------------------------------------------------------------------------
# candidate_logprobs (with autograd)


def _candidate_case(variant, vocab_size, dtype, seed=2):
    n, d, v_model, j = 19, 12, 41, 6
    head = make_head(v_model, d, pad_from=vocab_size, dtype=dtype, **variant)
    head = OutputHead(
        head.weight.requires_grad_(),
        None if head.bias is None else head.bias.requires_grad_(),
        head.logit_scale,
        head.softcap,
    )
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    ids = torch.randint(0, vocab_size or v_model, (n, j), generator=g)
    ids[:, -1] = ids[:, 0]  # duplicate slots (union strategies repeat ids): their gradients must add up
    g_lp = torch.randn(n, j, generator=g, dtype=torch.float64)
    g_h = torch.randn(n, generator=g, dtype=torch.float64)
    return head, hidden, ids, g_lp, g_h


def _grads(loss, head, hidden):
    params = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("variant", HEAD_VARIANTS)
@pytest.mark.parametrize("vocab_size", [None, 35])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_candidate_logprobs_values_and_grads(variant, vocab_size, with_entropy):
    temperature = 0.8
    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        head, hidden, ids, g_lp, g_h = _candidate_case(variant, vocab_size, dtype)
        if with_entropy:
            lp, ent = candidate_logprobs_and_entropy(
                hidden, head, ids, temperature=temperature, vocab_size=vocab_size, chunk_size=4
            )
            loss = (lp.double() * g_lp).sum() + (ent.double() * g_h).sum()
        else:
            lp = candidate_logprobs(hidden, head, ids, temperature=temperature, vocab_size=vocab_size, chunk_size=4)
            loss = (lp.double() * g_lp).sum()
        ours = _grads(loss, head, hidden)

        # reference: autograd through the naive float64 computation of the same float64-cast inputs
        ref_head = OutputHead(
            head.weight.detach().double().requires_grad_(),
            None if head.bias is None else head.bias.detach().double().requires_grad_(),
            head.logit_scale,
            head.softcap,
        )
        ref_hidden = hidden.detach().double().requires_grad_()
        ref_lp_full = naive_logprobs(ref_hidden, ref_head, temperature, vocab_size)
        ref_lp = ref_lp_full.gather(1, ids)
        ref_loss = (ref_lp * g_lp).sum()
        if with_entropy:
            ref_ent = naive_entropy(ref_lp_full)
            ref_loss = ref_loss + (ref_ent * g_h).sum()
            torch.testing.assert_close(ent.double(), ref_ent, atol=atol, rtol=0)
        torch.testing.assert_close(lp.double(), ref_lp, atol=atol, rtol=0)
        refs = _grads(ref_loss, ref_head, ref_hidden)
        for got, want in zip(ours, refs):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
        if vocab_size is not None:
            assert ours[1][vocab_size:].abs().max() == 0  # padding rows get no gradient


def test_candidate_logprobs_gradcheck_and_empty():
    head, hidden, ids, _, _ = _candidate_case(dict(bias=True, scale=0.5, softcap=4.0), 30, torch.float64)
    hidden_s, w_s, b_s, ids_s = hidden[:5].detach().requires_grad_(), head.weight, head.bias, ids[:5]

    def f(h, w, b):
        return candidate_logprobs_and_entropy(
            h, OutputHead(w, b, 0.5, 4.0), ids_s, temperature=1.3, vocab_size=30, chunk_size=2
        )

    assert torch.autograd.gradcheck(f, (hidden_s, w_s, b_s))
    empty = torch.zeros(0, 12, dtype=torch.float64, requires_grad=True)
    lp = candidate_logprobs(empty, head, torch.zeros(0, 3, dtype=torch.long))
    assert lp.shape == (0, 3)
    lp.sum().backward()
    assert empty.grad.shape == (0, 12)


def test_candidate_logprobs_bf16_runs():
    head = make_head(50, 8, dtype=torch.bfloat16)
    weight = head.weight.requires_grad_()
    hidden = torch.randn(7, 8, dtype=torch.bfloat16, requires_grad=True)
    lp = candidate_logprobs(hidden, weight, torch.randint(0, 50, (7, 3)), chunk_size=3)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(hidden.grad.float()).all()


# ---------------------------------------------------------------------------------------------------------------
# chunk sizes, bf16 model dtype, the compile switch


SCORE_FIELDS = ("sampled_logprobs", "topk_logprobs", "entropy", "requested_logprobs")


def _score_and_grads(head: OutputHead, hidden, targets, requested, ids, chunk_size, temperature=0.8, top_k=8):
    """score_hidden's outputs and candidate_logprobs_and_entropy's values and gradients (hidden, weight, bias)."""
    s = score_hidden(
        hidden,
        head,
        targets_N=targets,
        top_k=top_k,
        requested_ids_NQ=requested,
        temperature=temperature,
        with_entropy=True,
        chunk_size=chunk_size,
    )
    weight = head.weight.detach().clone().requires_grad_()
    bias = None if head.bias is None else head.bias.detach().clone().requires_grad_()
    h = hidden.detach().clone().requires_grad_()
    lp, ent = candidate_logprobs_and_entropy(
        h, OutputHead(weight, bias, head.logit_scale, head.softcap), ids, temperature=temperature, chunk_size=chunk_size
    )
    g = torch.Generator().manual_seed(9)
    (lp * torch.randn(lp.shape, generator=g)).sum().add((ent * torch.randn(ent.shape, generator=g)).sum()).backward()
    grads = (h.grad, weight.grad) + (() if bias is None else (bias.grad,))
    return s, (lp, ent) + grads


def _case(n, v, d, dtype, seed=0, variant=None):
    head = make_head(v, d, dtype=dtype, seed=seed, **(variant or {}))
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(n, d, generator=g, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    requested = torch.randint(0, v, (n, 5), generator=g)
    ids = torch.randint(0, v, (n, 4), generator=g)
    ids[:, -1] = ids[:, 0]  # a duplicate slot
    return head, hidden, targets, requested, ids


def _assert_same(a, b, atol=1e-5):
    """Scores and gradients of two runs. The default atol is for different code paths (chunk sizes, padded compiled
    chunks vs eager row slices): float32 sums in another order, measured ≤ 5e-7 on log-probs of magnitude < 8, so
    1e-5 is ~20 ulp there yet far below any real error. atol=0 only for the same computation replayed. Top-k ids are
    compared exactly either way: in these fixed cases adjacent top-k log-probs are ≥ 3e-5 apart (60× the path
    difference), so their order is the same on any machine."""
    (sa, ga), (sb, gb) = a, b
    for field in SCORE_FIELDS:
        torch.testing.assert_close(getattr(sa, field), getattr(sb, field), atol=atol, rtol=0)
    assert torch.equal(sa.topk_ids, sb.topk_ids)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=atol, rtol=atol)


@pytest.mark.parametrize("variant", [dict(), dict(bias=True, scale=0.5, softcap=4.0)])
def test_results_identical_across_chunk_sizes(variant):
    case = _case(40, 300, 16, torch.float32, variant=variant)
    ref = _score_and_grads(*case, chunk_size=None)  # default: one chunk here
    for chunk in (1, 7):
        _assert_same(_score_and_grads(*case, chunk_size=chunk), ref)


def test_bf16_model_dtype_matches_dense_reference():
    """bf16 hidden and weight (the GPU case, on CPU): log-probs as `log_softmax((h @ W.T).float())`, gradients as
    autograd through that dense reference. Scaled hidden states make many positions confident (p ≈ 1 at the argmax,
    which is a candidate), where a bf16 scatter-add of the one-hot term would lose (1 - p)·g to cancellation."""
    n, v, d, k = 40, 300, 32, 8
    head, hidden, targets, requested, ids = _case(n, v, d, torch.bfloat16, seed=3)
    hidden = hidden * 2
    ref_lp = (hidden @ head.weight.T).float().log_softmax(-1)
    assert (ref_lp.amax(-1).exp() > 0.9).sum() >= 5  # confident positions exist
    ids[:, 1] = ref_lp.argmax(-1)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)

    # dense reference, with autograd
    h_ref, w_ref = hidden.clone().requires_grad_(), head.weight.clone().requires_grad_()
    lp_full = (h_ref @ w_ref.T).float().log_softmax(-1)
    ent_ref = -(lp_full.exp() * lp_full).sum(-1)
    ((lp_full.gather(1, ids) * g_lp).sum() + (ent_ref * g_ent).sum()).backward()

    for chunk in (1, 7, None):
        s = score_hidden(
            hidden,
            head.weight,
            targets_N=targets,
            top_k=k,
            requested_ids_NQ=requested,
            with_entropy=True,
            chunk_size=chunk,
        )
        # 1e-4, not float32's 1e-6: the bf16 matmul rounds its output to bf16, and a chunk's other shape (or another
        # CPU: with/without AVX-512) may pick a kernel that sums in another order and rounds a logit z_j to its
        # neighbour, moving every log-prob of the row by ≈ p_j · ulp(z_j) (2.5e-5 seen on one machine, 0 on another)
        torch.testing.assert_close(s.sampled_logprobs, ref_lp.gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=0)
        torch.testing.assert_close(s.requested_logprobs, ref_lp.gather(1, requested), atol=1e-4, rtol=0)
        torch.testing.assert_close(s.entropy, ent_ref.detach(), atol=1e-4, rtol=0)
        ref_vals = ref_lp.topk(k, dim=-1).values
        torch.testing.assert_close(s.topk_logprobs, ref_vals, atol=1e-4, rtol=0)
        # same ids up to ties: each id's reference log-prob is the reported one
        torch.testing.assert_close(ref_lp.gather(1, s.topk_ids), s.topk_logprobs, atol=1e-4, rtol=0)

        h, w = hidden.clone().requires_grad_(), head.weight.clone().requires_grad_()
        lp, ent = candidate_logprobs_and_entropy(h, w, ids, chunk_size=chunk)
        torch.testing.assert_close(lp, lp_full.gather(1, ids).detach(), atol=1e-4, rtol=0)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        for got, want in ((h.grad, h_ref.grad), (w.grad, w_ref.grad)):
            assert got.dtype == torch.bfloat16
            rel = (got.double() - want.double()).norm() / want.double().norm()
            assert rel < 1e-2, f"chunk {chunk}: relative gradient error {rel:.2e}"


def test_default_chunk_size_budgets_the_matmul_dtype(monkeypatch):
    v = 151936
    assert 2000 < default_chunk_size(v, torch.bfloat16) < 5000  # ~3.5k positions of bf16 logits on a GPU
    assert default_chunk_size(v, torch.float32) == default_chunk_size(v, torch.bfloat16) // 2
    assert default_chunk_size(v) == default_chunk_size(v, torch.float32)  # the conservative default
    monkeypatch.setattr(scoring, "CHUNK_BYTES", 1 << 20)
    assert default_chunk_size(v, torch.bfloat16) == 3 and default_chunk_size(10**9, torch.float32) == 1


@pytest.fixture
def fake_compile(monkeypatch):
    """Make the compiled path run on CPU with `torch.compile` replaced by `make(fn)`; a fresh compile cache."""
    monkeypatch.setattr(scoring, "_COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(scoring, "_COMPILED", {})

    def install(make):
        monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: make(fn))

    return install


@pytest.mark.parametrize("chunk", [7, 280])  # 280: the last chunk (20 rows) is padded to a 256-row bucket
def test_compiled_path_plumbing_matches_eager(fake_compile, monkeypatch, chunk):
    calls = []

    def identity(fn):
        def run(*args):
            calls.append(args[0].shape[0])
            return fn(*args)

        return run

    fake_compile(identity)
    case = _case(300, 50, 8, torch.float32, variant=dict(bias=True, scale=0.5, softcap=4.0))
    compiled = _score_and_grads(*case, chunk_size=chunk)
    assert set(calls) == ({7} if chunk == 7 else {280, 256})  # whole chunks, the last one padded
    monkeypatch.setattr(scoring, "COMPILE", False)
    calls.clear()
    _assert_same(compiled, _score_and_grads(*case, chunk_size=chunk))  # same math; slices change sum orders
    assert not calls  # the switch turns compilation off


def test_compile_failure_falls_back_to_eager_with_one_warning(fake_compile, monkeypatch):
    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler here")

        return run

    fake_compile(broken)
    case = _case(30, 50, 8, torch.float32)
    with pytest.warns(RuntimeWarning, match="opd.scoring: torch.compile of _") as record:
        fallback = _score_and_grads(*case, chunk_size=7)
    messages = [str(w.message) for w in record if "opd.scoring" in str(w.message)]
    assert len(messages) == 2 and "_forward_chunk" in messages[0] and "_grad_chunk" in messages[1]  # one per function
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        again = _score_and_grads(*case, chunk_size=7)  # no more warnings, eager from now on
    _assert_same(again, fallback, atol=0)  # the same computation (eager on the padded chunks) replayed: bit-exact
    monkeypatch.setattr(scoring, "COMPILE", False)
    eager = _score_and_grads(*case, chunk_size=7)
    # Another code path: the fallback keeps the compiled path's padding (the last chunk, 2 rows, is padded to the
    # chunk's 7), COMPILE=False does not, so the head matmul has another row count and BLAS may block it differently:
    # 4.8e-7 apart (1 ulp at |x| in [2, 4)) on a CI-like machine. Hence _assert_same's default tolerance here.
    _assert_same(fallback, eager)
    _assert_same(again, eager)


@pytest.mark.skipif(os.environ.get("OPD_SLOW_TESTS") != "1", reason="inductor on CPU takes ~40 s; OPD_SLOW_TESTS=1")
def test_real_compile_on_cpu_matches_eager(monkeypatch):
    monkeypatch.setattr(scoring, "_COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(scoring, "_COMPILED", {})
    case = _case(50, 300, 16, torch.float32, variant=dict(bias=True, scale=0.5, softcap=3.0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="opd.scoring")  # a fallback would fail the test
        compiled = _score_and_grads(*case, chunk_size=20)
    assert all(scoring._COMPILED.get(f) for f in (scoring._forward_chunk, scoring._grad_chunk))
    monkeypatch.setattr(scoring, "COMPILE", False)
    _assert_same(compiled, _score_and_grads(*case, chunk_size=20))


# ---------------------------------------------------------------------------------------------------------------
# local scorer on tiny HF models


def tiny_model(kind: str, attn: str, *, vocab=67, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, tie_word_embeddings=True))
    if attn == varlen_attention.ATTENTION:
        varlen_attention.register()
    model.config._attn_implementation = attn
    return model.float().eval()


PROMPTS, RESPONSES, T = [5, 3, 9, 4, 6], [7, 10, 0, 1, 4], 10


def reference_scores(model, ro: Rollouts, temperature, vocab_size):
    """Full-vocabulary log-probs [B, T, V] from the model's own logits (padded batch), float64."""
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask.long()).logits.double()
    pos = ro.response_positions().clamp(max=ro.input_ids.shape[1] - 1)
    z = logits[torch.arange(ro.batch_size)[:, None], pos] / temperature
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(z.shape[-1]) >= vocab_size, float("-inf"))
    return torch.log_softmax(z, -1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "opd_varlen"])
def test_local_scorer_matches_model_logits_packed_and_padded(kind, attn):
    model = tiny_model(kind, attn)
    vocab_size, k, r, temperature = 61, 5, 4, 0.9
    ro = make_rollouts(PROMPTS, RESPONSES, T, vocab_size)
    requested = torch.randint(0, vocab_size, (len(PROMPTS), T, r), generator=torch.Generator().manual_seed(3))
    lp_ref = reference_scores(model, ro, temperature, vocab_size)
    mask = ro.response_mask

    results = {}
    for packing, budget in (("padded", 10_000), ("packed", 10_000), ("padded", 20), ("packed", 20)):
        scorer = LocalScorer(model, vocab_size=vocab_size, packing=packing, max_tokens_per_batch=budget, chunk_size=7)
        results[packing, budget] = s = scorer.score(ro, top_k=k, requested_ids=requested, temperature=temperature)
        assert s.sampled_logprobs.shape == (5, T) and s.topk_ids.shape == (5, T, k)
        assert s.requested_logprobs.shape == (5, T, r) and s.entropy.shape == (5, T)
        for x in (s.sampled_logprobs, s.topk_logprobs, s.entropy, s.requested_logprobs, s.topk_ids):
            assert (x[~mask] == 0).all()  # zeros at masked positions
        sampled = lp_ref.gather(-1, ro.response_ids[..., None])[..., 0]
        torch.testing.assert_close(s.sampled_logprobs[mask].double(), sampled[mask], atol=1e-5, rtol=0)
        vals, ids = lp_ref.topk(k, dim=-1)
        assert torch.equal(s.topk_ids[mask].sort(-1).values, ids[mask].sort(-1).values)
        torch.testing.assert_close(s.topk_logprobs[mask].double(), vals[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            s.requested_logprobs[mask].double(), lp_ref.gather(-1, requested)[mask], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(s.entropy[mask].double(), naive_entropy(lp_ref)[mask], atol=1e-5, rtol=0)

    base = results["padded", 10_000]
    for other in results.values():  # packed == padded, micro-batched == whole
        for field in ("sampled_logprobs", "topk_logprobs", "entropy", "requested_logprobs"):
            torch.testing.assert_close(getattr(other, field), getattr(base, field), atol=1e-5, rtol=0)


def test_local_scorer_protocol_modes_and_options():
    model = tiny_model("llama", "sdpa").train()
    scorer = LocalScorer(model)
    assert isinstance(scorer, TeacherScorer)
    ro = make_rollouts(PROMPTS, RESPONSES, T, 67)
    s = scorer.score(ro, top_k=0, with_entropy=False)
    assert model.training  # mode restored
    assert s.topk_ids is None and s.topk_logprobs is None and s.entropy is None and s.requested_logprobs is None
    # everything masked: no forward at all, all zeros
    empty = make_rollouts(PROMPTS, [0] * 5, T, 67)
    e = scorer.score(empty, top_k=3)
    assert (e.sampled_logprobs == 0).all() and (e.topk_ids == 0).all() and e.topk_ids.shape == (5, T, 3)
    with pytest.raises(ValueError, match="packing"):
        LocalScorer(model, packing="sometimes")


@pytest.mark.parametrize("attn", ["sdpa", "opd_varlen"])
def test_forward_hidden_grad_matches_full_model_backward(attn):
    """The trainer's grad pass: forward_hidden (packed and through the root) + candidate_logprobs gives the same
    values and parameter gradients as autograd through the model's full logits."""
    temperature = 0.7
    ro = make_rollouts(PROMPTS, RESPONSES, T, 67, seed=5)
    mask = ro.response_mask
    j = 3
    ids_BTJ = torch.randint(0, 67, (5, T, j), generator=torch.Generator().manual_seed(4))
    ids_BTJ[..., 0] = ro.response_ids
    g_BTJ = torch.randn(5, T, j, generator=torch.Generator().manual_seed(6)) * mask[..., None]

    model = tiny_model("qwen3", attn)
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask.long()).logits
    pos = ro.response_positions().clamp(max=ro.input_ids.shape[1] - 1)
    lp_full = torch.log_softmax(logits[torch.arange(5)[:, None], pos].float() / temperature, -1)
    ref_lp = lp_full.gather(-1, ids_BTJ)
    (ref_lp * g_BTJ).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    for packing, through_root in (("padded", False), ("packed", False), ("packed", True)):
        model.zero_grad()
        part = forward_hidden(model, ro, packing=packing, through_root=through_root)
        assert part.hidden_ND.shape == (int(mask.sum()), 32)
        lp_NJ = candidate_logprobs(
            part.hidden_ND, output_head(model), ids_BTJ[part.rows_N, part.cols_N], temperature=temperature, chunk_size=8
        )
        lp_BTJ = part.to_grid(lp_NJ)
        torch.testing.assert_close(lp_BTJ[mask], ref_lp[mask].detach(), atol=1e-5, rtol=0)
        (lp_BTJ * g_BTJ).sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_output_head_softcap_model_and_check():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    model = Gemma2ForCausalLM(config).float().eval()
    model.config._attn_implementation = "eager"
    head = output_head(model)
    assert head.softcap == 0.5
    check_output_head(model)  # the cap is reproduced
    with pytest.raises(NotImplementedError, match="post-processing"):
        check_output_head(model, OutputHead(head.weight, None, 1.0, None))  # a head that ignores the cap
    ro = make_rollouts([4, 2], [3, 5], 5, 50)
    s = LocalScorer(model, packing="padded").score(ro, top_k=4)
    lp_ref = reference_scores(model, ro, 1.0, None)
    sampled = lp_ref.gather(-1, ro.response_ids[..., None])[..., 0]
    m = ro.response_mask
    torch.testing.assert_close(s.sampled_logprobs[m].double(), sampled[m], atol=1e-5, rtol=0)


def test_split_by_token_budget():
    lengths = torch.tensor([5, 0, 9, 3, 4])
    padded = split_by_token_budget(lengths, 10, padded=True)
    assert [g.tolist() for g in padded] == [[2], [0, 4], [3]]  # sorted by length; 2 × 5 ≤ 10 but 3 × 5 > 10
    packed = split_by_token_budget(lengths, 10, padded=False)
    assert [g.tolist() for g in packed] == [[0], [2], [3, 4]]
    assert split_by_token_budget(torch.tensor([0, 0]), 10, padded=False) == []


# ---------------------------------------------------------------------------------------------------------------
# memory: a 151936-token vocabulary, 8 × 256 response positions; a [B, T, V] float32 tensor would be ≈ 1.19 GiB.
# The default budget (1 GiB of model-dtype logits, sized for bf16 on a GPU) would make one float32 CPU chunk almost
# as big as that, so these tests set a 128 MiB budget and check the stated bound: the logits chunk plus at most one
# more buffer of its size, i.e. growth < 2 × budget (+ a little for the model's activations and the outputs).

BUDGET_MIB = 128


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@pytest.fixture
def rss_peak(monkeypatch):
    """Peak resident memory growth, measured in-process: writing 5 to /proc/self/clear_refs resets the kernel's
    peak-RSS counter (VmHWM) to the current RSS. Big buffers must be mmap'd and returned on free for this to see
    them: glibc's adaptive threshold would serve frees-then-allocs below 32 MiB (the eager row slices) from a heap
    that keeps its pages, so it is pinned at 1 MiB (one mallopt call; the process's other allocations only move)."""
    try:
        _reset_peak()
        pinned = ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pinned = 0
    if not pinned:
        pytest.skip("needs Linux /proc/self/clear_refs and glibc's mallopt")
    monkeypatch.setattr(scoring, "CHUNK_BYTES", BUDGET_MIB << 20)

    def measure(fn):
        _reset_peak()
        before_kib = _rss_kib("VmRSS")
        out = fn()
        return out, (_rss_kib("VmHWM") - before_kib) / 1024

    return measure


@pytest.mark.slow
def test_peak_memory_far_below_full_logits(rss_peak):
    """The local scorer (a float32 model on CPU: float32 logits) with top-k, requested ids and entropy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    V, shared, B, P, T_ = 151936, 151669, 8, 16, 256
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    ids = torch.randint(0, shared, (B, P + T_))
    ro = Rollouts(
        ids,
        torch.ones(B, P + T_, dtype=torch.bool),
        torch.full((B,), P),
        ids[:, P:].clone(),
        torch.ones(B, T_, dtype=torch.bool),
        torch.arange(B),
        torch.zeros(B, dtype=torch.bool),
    )
    requested = torch.randint(0, shared, (B, T_, 16))
    scorer = LocalScorer(model.eval(), vocab_size=shared)

    s, growth_mib = rss_peak(lambda: scorer.score(ro, top_k=16, requested_ids=requested, with_entropy=True))

    assert torch.isfinite(s.entropy).all() and s.topk_ids.shape == (B, T_, 16)
    full_logits_mib = B * T_ * V * 4 / 2**20  # 1187 MiB
    print(
        f"\npeak RSS growth while scoring {B}x{T_} positions, V={V}: {growth_mib:.0f} MiB "
        f"([B,T,V] float32 = {full_logits_mib:.0f} MiB; chunk logits budget {BUDGET_MIB} MiB)"
    )
    assert growth_mib < 2 * BUDGET_MIB + 40


@pytest.mark.slow
def test_peak_memory_candidate_backward(rss_peak):
    """candidate_logprobs_and_entropy forward + backward on float32 (CPU): besides the chunk bound, the weight's
    gradient `[V, D]` (the float32 accumulator is the gradient itself here)."""
    V, N, D = 151936, 1024, 64
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    ids = torch.randint(0, V, (N, 16), generator=g)

    def run():
        lp, ent = candidate_logprobs_and_entropy(hidden, weight, ids)
        (lp.sum() + ent.sum()).backward()
        return lp

    lp, growth_mib = rss_peak(run)
    assert torch.isfinite(weight.grad).all() and lp.shape == (N, 16)
    grad_w_mib = V * D * 4 / 2**20  # 37 MiB
    print(
        f"\npeak RSS growth, candidate forward + backward of {N} positions, V={V}: {growth_mib:.0f} MiB "
        f"(chunk logits budget {BUDGET_MIB} MiB, weight gradient {grad_w_mib:.0f} MiB)"
    )
    assert growth_mib < 2 * BUDGET_MIB + grad_w_mib + 40


def test_auto_packing_packs_only_batches_with_padding_to_save(monkeypatch):
    model = tiny_model("qwen3", varlen_attention.ATTENTION)
    packed_calls = []
    reference = varlen_attention.packed_causal_attention
    monkeypatch.setattr(
        varlen_attention,
        "packed_causal_attention",
        lambda *args, **kwargs: packed_calls.append(args[0].shape[0]) or reference(*args, **kwargs),
    )
    equal = make_rollouts([4, 4, 4], [6, 6, 6], 6, 67)
    ragged = make_rollouts([4, 4, 4], [6, 1, 2], 6, 67)
    for rollouts, packs in ((equal, False), (ragged, True)):
        packed_calls.clear()
        auto = forward_hidden(model, rollouts).hidden_ND
        assert bool(packed_calls) == packs
        torch.testing.assert_close(auto, forward_hidden(model, rollouts, packing="padded").hidden_ND, atol=1e-5, rtol=0)
    assert packed_calls == [9 + 4 + 5] * 2  # one call per layer; a row needs its prompt + response - 1 tokens
