"""The Triton kernel (`opd.kernels`) against their torch references, on CPU through Triton's interpreter (conftest
sets TRITON_INTERPRET=1 without CUDA). On a GPU the compiled kernels are checked by `benchmarks/check_cuda.py`.
Skipped when Triton is not installed."""

from __future__ import annotations

import pytest
import torch

from opd import kernels

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu")), reason="Triton is not installed")


def reference_attention(q_RKGD, keys_RKSD, values_RKSD, start_R, last):
    """float64 softmax attention of each row's query heads over slots [start_r, last]."""
    slots_S = torch.arange(keys_RKSD.shape[2])
    valid_RS = (slots_S[None] >= start_R[:, None]) & (slots_S[None] <= last)
    scores = torch.einsum("rkgd,rksd->rkgs", q_RKGD.double(), keys_RKSD.double()) * 0.3
    scores = scores.masked_fill(~valid_RS[:, None, None], float("-inf"))
    return torch.einsum("rkgs,rksd->rkgd", scores.softmax(-1), values_RKSD.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, kv_heads, groups, head_dim, slots", [(3, 2, 2, 32, 150), (2, 1, 4, 64, 70),
                                                                     (3, 2, 1, 16, 18)])
def test_decode_attention_matches_float64_over_each_rows_slots(dtype, rows, kv_heads, groups, head_dim, slots):
    from opd.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, kv_heads, groups, head_dim, generator=g).to(dtype)
    keys, values = (torch.randn(rows, kv_heads, slots, head_dim, generator=g).to(dtype) for _ in range(2))
    start, last = torch.tensor([0, 5, 11][:rows]), slots - 3  # left-padded rows start later
    want = reference_attention(q, keys, values, start, last)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for splits in (1, 2, 4):  # 4 splits of a short row: some are empty
        got = decode_attention(q, keys, values, start, torch.tensor([last]), 0.3, splits=splits)
        assert got.shape == q.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
        # With the step's new key/value given, the kernel writes them into the cache at `last` and uses them.
        cache_k, cache_v = keys.clone(), values.clone()
        cache_k[:, :, last] = cache_v[:, :, last] = 0
        got = decode_attention(q, cache_k, cache_v, start, torch.tensor([last]), 0.3, keys[:, :, last],
                               values[:, :, last], splits=splits)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
        assert torch.equal(cache_k, keys) and torch.equal(cache_v, values)


def test_decode_attention_output_is_the_layout_the_fused_o_projection_reads():
    from opd.kernels.decode_attention import decode_attention

    q = torch.randn(2, 3, 2, 16)
    keys = values = torch.randn(2, 3, 8, 16)
    out = decode_attention(q, keys, values, torch.zeros(2, dtype=torch.long), torch.tensor([7]), 1.0)
    assert out.transpose(1, 2).is_contiguous()  # [R, G, Hkv, Dh] in memory: flattening it copies nothing
    with pytest.raises(ValueError, match="splits must be a power of two"):
        decode_attention(q, keys, values, torch.zeros(2, dtype=torch.long), torch.tensor([7]), 1.0, splits=3)
    with pytest.raises(ValueError, match="together"):
        decode_attention(q, keys, values, torch.zeros(2, dtype=torch.long), torch.tensor([7]), 1.0, keys[:, :, 0])
