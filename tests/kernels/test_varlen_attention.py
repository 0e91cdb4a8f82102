"""`opd.kernels.varlen_attention` (packed causal attention) against its torch reference, on CPU through Triton's
interpreter (conftest sets TRITON_INTERPRET=1 without CUDA). On a GPU the compiled kernels are checked by
`benchmarks/check_cuda.py`. Skipped when Triton is not installed."""

from __future__ import annotations

import pytest
import torch

from opd import kernels

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu")), reason="Triton is not installed")


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
