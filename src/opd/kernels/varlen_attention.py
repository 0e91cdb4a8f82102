"""Packed causal attention for Hugging Face models: rows concatenated into one sequence, each attending only within
itself, with no padding and no `[S, S]` mask.

`ATTENTION` ("opd_varlen") is a transformers attention implementation (`register` adds it; `opd.models.load_model`
picks it on CUDA). Packed forwards (those passing `cu_seq_lens_q` / `max_length_q`, see `packed_kwargs`) run torch's
FlashAttention varlen kernel on CUDA in bf16/fp16, elsewhere one SDPA call per row (the reference); every other
forward runs transformers' SDPA path unchanged. Sliding windows are exact on both paths (the kernel's `window_size`
where this torch has it, a banded causal mask in the reference; a window ≥ the longest row counts as none).
Attention sinks and logit soft-capping are not computed: `refusal` names them so the loader keeps such models off
`ATTENTION`, and `attention_forward` raises on them rather than drop them. Omitted: SDPA over packed rows (a dense
`[1, 1, S, S]` mask, S² work and memory) and flex attention (much slower outside `torch.compile`, which is how the
HF prefill of generation runs it; docs/design.md, "opd.kernels.varlen_attention").
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "opd_varlen"

try:  # resolved once here, not inside the compiled layers
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMETERS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # torch < 2.10
    _varlen_attn, _VARLEN_PARAMETERS = None, frozenset()


def kernel_windows() -> bool:
    """Whether this torch's varlen kernel takes a sliding window (`window_size`, torch ≥ 2.11)."""
    return "window_size" in _VARLEN_PARAMETERS


def binding_window(config: Any) -> int | None:
    """The sliding window some layer of a model with `config` applies to sequences it can take, else None (a window
    ≥ `max_position_embeddings` never binds: Phi-3's 262,144; layer_types without a "sliding_attention" layer)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    longest = getattr(config, "max_position_embeddings", None)
    return None if longest is not None and window >= longest else int(window)


def refusal(model: torch.nn.Module, device: torch.device | None = None) -> str | None:
    """Why `ATTENTION` cannot compute `model`'s attention exactly (one phrase naming the feature), or None.
    device: where packed rows would run; the kernel path there must take `binding_window`'s window."""
    config = model.config
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return "its attention sinks (the `sinks` parameter) are not in the varlen kernel"
    if getattr(config, "attn_logit_softcapping", None):
        cap = config.attn_logit_softcapping
        return f"its attention logit soft-capping (attn_logit_softcapping={cap}) is not computed"
    window = binding_window(config)
    if window is not None and device is not None and kernel_available(device) and not kernel_windows():
        return (
            f"its sliding window ({window} tokens) is not in this torch's varlen kernel "
            f"(torch {torch.__version__}; window_size needs ≥ 2.11)"
        )
    return None


def kernel_available(device: torch.device) -> bool:
    """Whether packed rows on `device` run the FlashAttention varlen kernel (else the per-row SDPA loop)."""
    return device.type == "cuda" and _varlen_attn is not None


def packed_kwargs(lengths_b: torch.Tensor, max_length: int | None = None) -> dict:
    """Forward kwargs that make an `ATTENTION` model treat its `[1, Σ lengths]` input as rows of `lengths_b` tokens
    (`max_length`: their maximum when the caller has it on the host already).

    `attention_mask` is an empty 4D placeholder: transformers passes a 4D mask through untouched, so it builds no
    `[S, S]` mask for the packed sequence, and any attention other than `ATTENTION` fails on it instead of silently
    attending across rows."""
    cu_seq_lens = torch.nn.functional.pad(torch.cumsum(lengths_b, 0, dtype=torch.int32), (1, 0))
    longest = int(lengths_b.max()) if max_length is None else max_length
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
        "attention_mask": torch.ones(1, 1, 0, 0, dtype=torch.bool, device=lengths_b.device),
    }


def packed_causal_attention(
    query_SHD: torch.Tensor,
    key_SKD: torch.Tensor,
    value_SKD: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """[S, H, D] causal attention of each row `cu_seq_lens[i]:cu_seq_lens[i + 1]` over itself.

    query_SHD: [S, H, D]; key_SKD / value_SKD: [S, K, D] with K dividing H (grouped-query attention);
    cu_seq_lens: [rows + 1] int32 row offsets starting at 0; max_length: the longest row;
    window: each query sees its last `window` keys, itself included (transformers' `sliding_window`); None or
    ≥ max_length: all earlier keys.
    """
    if window is not None and window >= max_length:
        window = None
    if query_SHD.is_cuda and query_SHD.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # as autocast does for SDPA (float32 master weights make Qwen3's q/k norms return float32 under autocast)
        half = torch.get_autocast_dtype("cuda")
        query_SHD, key_SKD, value_SKD = query_SHD.to(half), key_SKD.to(half), value_SKD.to(half)
    if _kernel_runs(query_SHD):
        # torch 2.11+ / 2.10
        if window is not None and not kernel_windows():
            raise ValueError(
                f"{ATTENTION}: torch {torch.__version__}'s varlen kernel has no sliding window (a {window}-token "
                f"window, rows up to {max_length}); use attn_implementation='sdpa'"
            )
        left = -1 if window is None else window - 1
        causal: dict[str, Any] = {"window_size": (left, 0)} if kernel_windows() else {"is_causal": True}
        if key_SKD.shape[1] != query_SHD.shape[1] and "enable_gqa" not in _VARLEN_PARAMETERS:
            groups = query_SHD.shape[1] // key_SKD.shape[1]
            key_SKD, value_SKD = key_SKD.repeat_interleave(groups, 1), value_SKD.repeat_interleave(groups, 1)
        elif key_SKD.shape[1] != query_SHD.shape[1]:
            causal["enable_gqa"] = True
        return _varlen_attn(
            query_SHD, key_SKD, value_SKD, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scale, **causal
        )
    return per_row_attention(query_SHD, key_SKD, value_SKD, cu_seq_lens, scale, window)


def _kernel_runs(query_SHD: torch.Tensor) -> bool:
    return query_SHD.is_cuda and _varlen_attn is not None and query_SHD.dtype in (torch.float16, torch.bfloat16)


def per_row_attention(
    query_SHD: torch.Tensor,
    key_SKD: torch.Tensor,
    value_SKD: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`packed_causal_attention` as one SDPA call per row: the reference, and the path off CUDA / in float32.
    A window shorter than a row is a banded causal mask (key k visible from query q when q - window < k ≤ q)."""
    bounds = cu_seq_lens.tolist()
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1)[None] for x in (query_SHD, key_SKD, value_SKD))
        mask = None
        if window is not None and window < end - start:
            offset_QK = torch.arange(end - start, device=q.device)[:, None] - torch.arange(end - start, device=q.device)
            mask = (offset_QK >= 0) & (offset_QK < window)
        rows.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )[0].transpose(0, 1)
        )
    return torch.cat(rows)


def attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers' attention-function contract: query [B, H, S, D], key/value [B, K, S, D] → ([B, S, H, D], None)."""
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:  # sdpa would drop them silently
        feature = "attention sinks" if kwargs.get("s_aux") is not None else "logit soft-capping"
        raise ValueError(
            f"{ATTENTION} does not compute {feature}; load this model with attn_implementation=None (transformers' "
            "choice, eager) instead"
        )
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{ATTENTION}: packed rows need one [1, S] sequence without a KV cache, got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if dropout:
        raise ValueError(f"{ATTENTION}: packed rows do not support attention dropout; use attn_implementation='sdpa'")
    out_SHD = packed_causal_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seq_lens,
        kwargs["max_length_q"],
        scale=scaling,
        window=kwargs.get("sliding_window"),
    )
    return out_SHD[None], None


def register() -> str:
    """Add `ATTENTION` to transformers' attention and mask registries (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    return ATTENTION
