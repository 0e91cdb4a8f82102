"""The Triton kernel (`opd.kernels`) against their torch references, on CPU through Triton's interpreter (conftest
sets TRITON_INTERPRET=1 without CUDA). On a GPU the compiled kernels are checked by `benchmarks/check_cuda.py`.
Skipped when Triton is not installed."""

from __future__ import annotations

import pytest
import torch

from opd import kernels

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu")), reason="Triton is not installed")


def reference_attention(q_RKGD, keys_RKSD, values_RKSD, start_R, last_R, softcap=None):
    """float64 softmax attention of each row's query heads over slots [start_r, last_r] (scores soft-capped
    c · tanh(s / c) first when softcap is set)."""
    slots_S = torch.arange(keys_RKSD.shape[2])
    valid_RS = (slots_S[None] >= start_R[:, None]) & (slots_S[None] <= last_R[:, None])
    scores = torch.einsum("rkgd,rksd->rkgs", q_RKGD.double(), keys_RKSD.double()) * 0.3
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid_RS[:, None, None], float("-inf"))
    return torch.einsum("rkgs,rksd->rkgd", scores.softmax(-1), values_RKSD.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, kv_heads, groups, head_dim, slots", [(3, 2, 2, 32, 150), (2, 1, 4, 64, 70), (3, 2, 1, 16, 18)]
)
def test_decode_attention_matches_float64_over_each_rows_slots(dtype, rows, kv_heads, groups, head_dim, slots):
    from opd.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, kv_heads, groups, head_dim, generator=g).to(dtype)
    keys, values = (torch.randn(rows, kv_heads, slots, head_dim, generator=g).to(dtype) for _ in range(2))
    # rows start at different slots (left padding) and end at different slots (refilled rows of continuous batching)
    start = torch.tensor([0, 5, 11][:rows])
    last = torch.tensor([slots - 3, 12, slots - 1][:rows])
    want = reference_attention(q, keys, values, start, last)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows_R = torch.arange(rows)
    for splits in (1, 2, 4):  # 4 splits of a short row: some are empty
        got = decode_attention(q, keys, values, start, last, 0.3, splits=splits)
        assert got.shape == q.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
        # With the step's new key/value given, the kernel writes them into the cache at each row's `last` and uses
        # them; no other slot changes.
        cache_k, cache_v = keys.clone(), values.clone()
        cache_k[rows_R, :, last] = cache_v[rows_R, :, last] = 0
        got = decode_attention(
            q, cache_k, cache_v, start, last, 0.3, keys[rows_R, :, last], values[rows_R, :, last], splits=splits
        )
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
        assert torch.equal(cache_k, keys) and torch.equal(cache_v, values)


def test_split_count_fills_the_multiprocessors_and_cuts_long_caches():
    """Splits: the fewest (a power of two, ≤ 16) giving each of 132 multiprocessors a program, and at least one per
    SPLIT_SLOTS (2,048) slots of the cache, so that one long row among short ones does not set the kernel's end."""
    from opd.kernels.decode_attention import split_count

    assert split_count(160, 8, 132) == 1 == split_count(160, 8, 132, slots=1828)  # equal rows of ~1,700: as before
    assert split_count(160, 8, 132, slots=7296) == 4  # a 7,168-token cap: 4 pieces of ≤ 2,048 slots
    assert split_count(8, 8, 132) == 4 and split_count(8, 8, 132, slots=7296) == 4  # few rows: the first rule
    assert split_count(1, 1, 132, slots=40_000) == 16 == split_count(64, 8, 132, slots=40_000)  # at most 16


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_attention_soft_caps_the_scores_as_gemma_2(splits):
    """softcap · tanh(score / softcap) before the softmax, on the cache's slots and on the step's new key; a cap that
    binds (scores of ±5 against a cap of 1) changes the output, so the comparison can fail."""
    from opd.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(1)
    q = 3 * torch.randn(2, 2, 2, 16, generator=g)
    keys, values = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    start, last = torch.tensor([0, 6]), torch.tensor([39, 20])
    want = reference_attention(q, keys, values, start, last, softcap=1.0)
    assert (want - reference_attention(q, keys, values, start, last)).abs().max() > 0.1
    rows_R = torch.arange(2)
    for new in (None, (keys[rows_R, :, last], values[rows_R, :, last])):
        got = decode_attention(
            q, keys.clone(), values.clone(), start, last, 0.3, *(new or ()), splits=splits, softcap=1.0
        )
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_decode_attention_output_is_the_layout_the_fused_o_projection_reads():
    from opd.kernels.decode_attention import decode_attention

    q = torch.randn(2, 3, 2, 16)
    keys = values = torch.randn(2, 3, 8, 16)
    start, last = torch.zeros(2, dtype=torch.long), torch.tensor([7, 3])
    out = decode_attention(q, keys, values, start, last, 1.0)
    assert out.transpose(1, 2).is_contiguous()  # [R, G, Hkv, Dh] in memory: flattening it copies nothing
    with pytest.raises(ValueError, match="splits must be a power of two"):
        decode_attention(q, keys, values, start, last, 1.0, splits=3)
    with pytest.raises(ValueError, match="together"):
        decode_attention(q, keys, values, start, last, 1.0, keys[:, :, 0])
    with pytest.raises(ValueError, match=r"one start and one last slot per row \(2\)"):
        decode_attention(q, keys, values, start, torch.tensor([7]), 1.0)


# ------------------------------------------------------------------------------------------- varlen attention


def dense_packed_reference(query_SHD, key_SKD, value_SKD, lengths):
    """float64 softmax attention over the packed sequence with a block-diagonal causal mask."""
    row_S = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos_S = torch.arange(len(row_S))
    allowed_SS = (row_S[:, None] == row_S[None]) & (pos_S[:, None] >= pos_S[None])
    groups = query_SHD.shape[1] // key_SKD.shape[1]
    k, v = (x.double().repeat_interleave(groups, 1) for x in (key_SKD, value_SKD))
    scores_HSS = torch.einsum("shd,thd->hst", query_SHD.double(), k) / query_SHD.shape[-1] ** 0.5
    weights_HSS = scores_HSS.masked_fill(~allowed_SS, float("-inf")).softmax(-1)
    return torch.einsum("hst,thd->shd", weights_HSS, v)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_packed_causal_attention_confines_each_row_to_itself(heads, kv_heads):
    from opd.kernels.varlen_attention import packed_causal_attention

    lengths = [5, 1, 9, 3]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, 16, generator=generator) for h in (heads, kv_heads, kv_heads))
    cu_seq_lens = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu_seq_lens, max(lengths))
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), dense_packed_reference(q, k, v, lengths), atol=1e-5, rtol=0)


def test_varlen_model_runs_sdpa_unless_packed():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opd.forward import uses_packing
    from opd.kernels import varlen_attention

    varlen_attention.register()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config).eval()
    ids_BL = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    mask_BL = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    logits = {}
    for attn in ("sdpa", varlen_attention.ATTENTION):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            logits[attn] = model(input_ids=ids_BL, attention_mask=mask_BL).logits
    torch.testing.assert_close(logits["sdpa"], logits[varlen_attention.ATTENTION], atol=0, rtol=0)
    assert uses_packing(model)  # forward_hidden packs for it by default
    with pytest.raises(ValueError, match=r"one \[1, S\] sequence"):  # packed rows come as one sequence
        model(input_ids=ids_BL, **varlen_attention.packed_kwargs(torch.tensor([4, 2])))


@pytest.mark.parametrize("torch_api", ["window_size", "is_causal", "window_size+enable_gqa"])
def test_packed_causal_attention_calls_the_varlen_kernel_as_each_torch_version_takes_it(monkeypatch, torch_api):
    """The CUDA branch's arguments, with torch's kernel replaced by the per-row reference: causal through the
    argument this torch version has, grouped-query heads repeated unless the kernel takes enable_gqa."""
    from opd.kernels import varlen_attention

    parameters = {"scale", *torch_api.split("+")}
    calls = []

    def fake_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, **options):
        calls.append(options)
        assert set(options) <= parameters and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == 9
        assert options.get("window_size", (-1, 0)) == (-1, 0) and options.get("is_causal", True)
        assert (k.shape[1] == q.shape[1]) != options.get("enable_gqa", False)
        return varlen_attention.per_row_attention(q, k, v, cu_seq_q, scale)

    monkeypatch.setattr(varlen_attention, "_varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(varlen_attention, "_VARLEN_PARAMETERS", frozenset(parameters))
    monkeypatch.setattr(varlen_attention, "_kernel_runs", lambda query: True)
    lengths = [9, 2, 4]
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=generator) for h in (6, 2, 2))
    cu_seq_lens = torch.tensor([0, 9, 11, 15], dtype=torch.int32)
    out = varlen_attention.packed_causal_attention(q, k, v, cu_seq_lens, 9)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), dense_packed_reference(q, k, v, lengths), atol=1e-5, rtol=0)
