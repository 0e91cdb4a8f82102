"""Packed causal attention for Hugging Face models: rows concatenated into one sequence, each attending only within
itself, with no padding and no `[N, N]` mask (N: the packed tokens).

`ATTENTION` ("opd_varlen") is a transformers attention implementation (`register` adds it; `opd.models.load_model`
picks it on CUDA). Packed forwards (those passing `cu_seq_lens_q` / `max_length_q`, see `packed_kwargs`) run torch's
FlashAttention varlen kernel on CUDA in bf16/fp16, elsewhere one SDPA call per row (the reference); every other
forward runs transformers' SDPA path unchanged. Sliding windows are exact on both paths (the kernel's `window_size`
where this torch has it, a banded causal mask in the reference; a window ≥ the longest row counts as none).
Attention sinks and logit soft-capping are not computed: `refusal` names them so the loader keeps such models off
`ATTENTION`, and `attention_forward` raises on them rather than drop them. Omitted: SDPA over packed rows (a dense
`[1, 1, N, N]` mask, N² work and memory) and flex attention (outside `torch.compile`, which is how the HF prefill of
generation runs it; why: docs/design.md, "opd.kernels.varlen_attention", timings in docs/performance.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "opd_varlen"

_varlen_attn: Callable[..., Any] | None = None  # torch's varlen kernel; None before torch 2.10
_VARLEN_PARAMETERS: frozenset[str] = frozenset()
try:  # resolved once here, not inside the compiled layers
    from torch.nn.attention.varlen import varlen_attn

    _varlen_attn = varlen_attn
    _VARLEN_PARAMETERS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # torch < 2.10
    pass


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
    config: Any = model.config  # a Hugging Face model's PretrainedConfig
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


def packed_kwargs(lengths_B: torch.Tensor, max_length: int | None = None) -> dict:
    """Forward kwargs that make an `ATTENTION` model treat its `[1, Σ lengths]` input as rows of `lengths_B` tokens
    (`max_length`: their maximum when the caller has it on the host already).

    `attention_mask` is an empty 4D placeholder: transformers passes a 4D mask through untouched, so it builds no
    `[N, N]` mask for the packed sequence, and any attention other than `ATTENTION` fails on it instead of silently
    attending across rows."""
    cu_seq_lens = torch.nn.functional.pad(torch.cumsum(lengths_B, 0, dtype=torch.int32), (1, 0))
    longest = int(lengths_B.max()) if max_length is None else max_length
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
        "attention_mask": torch.ones(1, 1, 0, 0, dtype=torch.bool, device=lengths_B.device),
    }


def packed_causal_attention(
    query_NHF: torch.Tensor,
    key_NAF: torch.Tensor,
    value_NAF: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """[N, H, F] causal attention of each row `cu_seq_lens[i]:cu_seq_lens[i + 1]` over itself (N packed tokens, H
    query heads, A key/value heads, F head dim).

    query_NHF: [N, H, F]; key_NAF / value_NAF: [N, A, F] with A dividing H (grouped-query attention);
    cu_seq_lens: [rows + 1] int32 row offsets starting at 0; max_length: the longest row;
    window: each query sees its last `window` keys, itself included (transformers' `sliding_window`); None or
    ≥ max_length: all earlier keys.
    """
    if window is not None and window >= max_length:
        window = None
    if query_NHF.is_cuda and query_NHF.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # as autocast does for SDPA (float32 master weights make Qwen3's q/k norms return float32 under autocast)
        half = torch.get_autocast_dtype("cuda")
        query_NHF, key_NAF, value_NAF = query_NHF.to(half), key_NAF.to(half), value_NAF.to(half)
    if _kernel_runs(query_NHF):
        # torch 2.11+ / 2.10
        if window is not None and not kernel_windows():
            raise ValueError(
                f"{ATTENTION}: torch {torch.__version__}'s varlen kernel has no sliding window (a {window}-token "
                f"window, rows up to {max_length}); use attn_implementation='sdpa'"
            )
        left = -1 if window is None else window - 1
        causal: dict[str, Any] = {"window_size": (left, 0)} if kernel_windows() else {"is_causal": True}
        if key_NAF.shape[1] != query_NHF.shape[1] and "enable_gqa" not in _VARLEN_PARAMETERS:
            groups = query_NHF.shape[1] // key_NAF.shape[1]
            key_NAF, value_NAF = key_NAF.repeat_interleave(groups, 1), value_NAF.repeat_interleave(groups, 1)
        elif key_NAF.shape[1] != query_NHF.shape[1]:
            causal["enable_gqa"] = True
        assert _varlen_attn is not None  # _kernel_runs
        return _varlen_attn(
            query_NHF, key_NAF, value_NAF, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scale, **causal
        )
    return per_row_attention(query_NHF, key_NAF, value_NAF, cu_seq_lens, scale, window)


def _kernel_runs(query_NHF: torch.Tensor) -> bool:
    return query_NHF.is_cuda and _varlen_attn is not None and query_NHF.dtype in (torch.float16, torch.bfloat16)


def per_row_attention(
    query_NHF: torch.Tensor,
    key_NAF: torch.Tensor,
    value_NAF: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`packed_causal_attention` as one SDPA call per row: the reference, and the path off CUDA / in float32.
    A window shorter than a row is a banded causal mask (key k visible from query q when q - window < k ≤ q)."""
    bounds = cu_seq_lens.tolist()
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1)[None] for x in (query_NHF, key_NAF, value_NAF))
        mask = None
        if window is not None and window < end - start:
            offset_LL = torch.arange(end - start, device=q.device)[:, None] - torch.arange(end - start, device=q.device)
            mask = (offset_LL >= 0) & (offset_LL < window)
        rows.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )[0].transpose(0, 1)
        )
    return torch.cat(rows)


def attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers' attention-function contract: query [B, H, L, F], key/value [B, A, L, F] → ([B, L, H, F], None)."""
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
    out_NHF = packed_causal_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seq_lens,
        kwargs["max_length_q"],
        scale=scaling,
        window=kwargs.get("sliding_window"),
    )
    return out_NHF[None], None


def register() -> str:
    """Add `ATTENTION` to transformers' attention and mask registries (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    return ATTENTION
