"""`opd.kernels.decode_attention` (the Triton decode kernel) against float64: each row's slots, the split count,
soft-capping, and the layout the fused o-projection reads. On CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 without CUDA); on a GPU the compiled kernels are checked by `benchmarks/check_cuda.py`. Skipped
when Triton is not installed."""

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
