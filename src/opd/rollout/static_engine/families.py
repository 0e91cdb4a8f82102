"""What each supported family's modules hold and how the step reads them: the supported model types and why another
model is refused (`unsupported_reason`), the per-family layout switches (`_Layout`), each layer's sliding window,
the module readers (q/k/v and gate/up projections, norms, activations, RoPE), and the step weights of one layer
(`_Layer`, `_projection_weights`).

Shapes (docs/design.md, "Shape letters"): R rows of the engine call, A key/value heads, S cache slots, F head dimension.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

# A Hugging Face causal LM or one of its modules, read by attribute: its parts (get_decoder(), layers, self_attn,
# config, ...) are set at run time, which mypy cannot see through `torch.nn.Module.__getattr__`
HFModule = Any

# Llama's layout; Mistral and Ministral are it plus a sliding window (`_layer_windows`, also Qwen2's); Granite is it
# plus four multipliers, SmolLM3 plus layers without RoPE, OLMo 2 with its norms after each branch, Gemma 2/3 with
# norms on both sides of each branch (`_Layout`)
_GEMMA = ("gemma2", "gemma3_text")
_SUPPORTED: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "ministral",
    "phi3",
    "granite",
    "smollm3",
    "olmo2",
)
_SUPPORTED += _GEMMA


@dataclass(frozen=True)
class _Layout:
    """What the families beyond Llama's plain layout change in the step: Granite's multipliers of the embeddings,
    the residual branches and (as a divisor) the logits; SmolLM3's layers without RoPE (`no_rope_layers[i] == 0`).
    Attention's own scale (Granite's attention_multiplier) is the module's `scaling`, which the step reads anyway.
    post_norm: OLMo 2's layers, which norm each branch's output instead of its input (no input norms; q/k norm over
    the whole projection). sandwich: Gemma 2/3's layers, with norms before and after each branch, every norm over
    (1 + w) with the weight applied before the cast (`_rms_weight_first`), scaled embeddings (the embedding module's
    `embed_scale`, read by `_Run`), a GELU-tanh gate, and soft-capping of the attention scores and of the final
    logits (Gemma 2's attn_logit_softcapping / final_logit_softcapping; None: none)."""

    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    rope_layers: tuple[bool, ...] | None = None  # None: every layer
    post_norm: bool = False
    sandwich: bool = False
    attn_softcap: float | None = None
    logits_softcap: float | None = None

    @classmethod
    def of(cls, config: Any) -> _Layout:
        no_rope = getattr(config, "no_rope_layers", None) if config.model_type == "smollm3" else None
        return cls(
            embedding_scale=float(getattr(config, "embedding_multiplier", 1.0) or 1.0),
            residual_scale=float(getattr(config, "residual_multiplier", 1.0) or 1.0),
            logits_divisor=float(getattr(config, "logits_scaling", 1.0) or 1.0),
            rope_layers=None if no_rope is None else tuple(bool(flag) for flag in no_rope),
            post_norm=config.model_type == "olmo2",
            sandwich=config.model_type in _GEMMA,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) or None,
            logits_softcap=getattr(config, "final_logit_softcapping", None) or None,
        )


def _layer_windows(model: HFModule) -> list[int | None]:
    """Each decoder layer's sliding window (a query at position p attends to positions (p - W, p], transformers'
    `sliding_window_overlay`), None for full attention: the attention module's own `sliding_window` where it has one
    (Qwen2, Ministral: per layer type), else the config's for every layer (Mistral v0.1), as their masks apply it."""
    config = model.config
    windows = []
    for layer in model.get_decoder().layers:
        attention = layer.self_attn
        window = getattr(attention, "sliding_window", getattr(config, "sliding_window", None))
        windows.append(None if window is None else int(window))
    return windows


@overload
def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor: ...
@overload
def _cast(tensor: None, dtype: torch.dtype | None) -> None: ...
def _cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """tensor in dtype: itself when it already is (or dtype is None), else a copy."""
    return tensor if tensor is None or dtype is None else tensor.to(dtype)


def _projection_weights(linears: Sequence[torch.nn.Linear], dtype: torch.dtype | None) -> tuple[tuple, tuple]:
    """(weights, biases) of Linear layers sharing an input, as `_project` takes them: the modules' own tensors, one
    per layer (dtype None), or one row-wise concatenation in dtype (a copy; a missing bias becomes zeros)."""
    weights, biases = tuple(m.weight for m in linears), tuple(m.bias for m in linears)
    if dtype is None:
        return weights, biases
    fused_weight = torch.cat([w.to(dtype) for w in weights])
    if all(b is None for b in biases):
        return (fused_weight,), (None,)
    fused_bias = torch.cat(
        [w.new_zeros(w.shape[0], dtype=dtype) if b is None else b.to(dtype) for w, b in zip(weights, biases)]
    )
    return (fused_weight,), (fused_bias,)


def _head_dim(model: HFModule) -> int:
    attention = model.get_decoder().layers[0].self_attn
    return attention.o_proj.weight.shape[1] // model.config.num_attention_heads


def _qkv(attention: HFModule) -> tuple[torch.nn.Linear, ...]:
    """The q, k, v projections, or Phi-3's one fused qkv_proj (rows in that order)."""
    if hasattr(attention, "qkv_proj"):
        return (attention.qkv_proj,)
    return attention.q_proj, attention.k_proj, attention.v_proj


def _gate_up(mlp: HFModule) -> tuple[torch.nn.Linear, ...]:
    """The gate and up projections, or Phi-3's one fused gate_up_proj (gate rows first)."""
    if hasattr(mlp, "gate_up_proj"):
        return (mlp.gate_up_proj,)
    return mlp.gate_proj, mlp.up_proj


def _eps(norm: HFModule) -> float:
    """An RMSNorm module's epsilon (`variance_epsilon` in Llama's family, `eps` in Gemma's)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _norm_weight(norm: HFModule) -> torch.Tensor:
    """Gemma's RMSNorm weight as its forward applies it: 1 + w in float32, for `_rms_weight_first` (bit-identical)."""
    return 1.0 + norm.weight.float()


def _embedding_scale(embedding: HFModule, layout: _Layout) -> float:
    """The factor on the embedded tokens: Gemma's `embed_scale` (√hidden, rounded to the table's dtype first, as its
    forward multiplies), else the layout's (Granite's embedding multiplier, 1 for the rest)."""
    scale = getattr(embedding, "embed_scale", None)
    if scale is None:
        return layout.embedding_scale
    return float(torch.as_tensor(scale).to(embedding.weight.dtype))


def _gelu_gate(mlp: HFModule) -> bool:
    """Whether the MLP's gate is GELU with the tanh approximation (Gemma's gelu_pytorch_tanh); SiLU otherwise (the
    caller has checked it is one of the two, `_activation_reason`)."""
    return _activation(mlp) == "gelu_tanh"


def _activation(mlp: HFModule) -> str | None:
    """The gate activation of a dense or MoE MLP module: "silu", "gelu_tanh", or None for anything else."""
    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))  # Phi-3: activation_fn
    if act is None and hasattr(mlp, "experts"):
        act = getattr(mlp.experts, "act_fn", None)
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    inner = getattr(act, "act", None)  # transformers' GELUTanh: functools.partial(gelu, approximate="tanh")
    if (
        type(act).__name__ in ("GELUTanh", "PytorchGELUTanh")
        and getattr(inner, "keywords", {}).get("approximate", "tanh") == "tanh"
    ):
        return "gelu_tanh"
    if isinstance(act, torch.nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


def _rope_by_layer_type(rotary: HFModule) -> bool:
    """Whether the rotary module computes one table per layer type (Gemma 3: `forward(x, position_ids, layer_type)`)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


# RoPE types whose cos/sin table depends on the position only; "dynamic" and "longrope" rescale it with the length of
# the sequence (transformers' `dynamic_rope_update`), which a table precomputed over every slot cannot follow
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_reason(rotary: HFModule) -> str | None:
    """Why the rotary module's table cannot be precomputed once for every position, or None."""
    rope_type = getattr(rotary, "rope_type", "default")
    for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
        if kind in _LENGTH_DEPENDENT_ROPE or "dynamic" in str(kind):
            return f"rope_type {kind!r} changes cos/sin with the sequence length"
        if kind not in _STATIC_ROPE:
            return f"rope_type {kind!r} is not one of {', '.join(_STATIC_ROPE)}"
    return None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `StaticGenerator` cannot run `model` with its own decode step, or None when it can."""
    lm: HFModule = model
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        return f"model_type {model_type!r} is not one of {', '.join(_SUPPORTED)}"
    body = lm.get_decoder() if hasattr(model, "get_decoder") else None
    mlps = [layer.mlp for layer in getattr(body, "layers", [])]
    acts = [_activation(mlp) for mlp in mlps]
    if None in acts or len(set(acts)) > 1:
        odd = mlps[acts.index(None)] if None in acts else mlps[acts.index(acts[-1])]
        act = getattr(odd, "act_fn", getattr(odd, "activation_fn", None))
        return f"the MLP's activation ({type(act).__name__}) is not SiLU or GELU-tanh, the same in every layer"
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None or not hasattr(body, "layers") or not hasattr(body, "norm"):
        return "the decoder has no rotary_emb / layers / norm"
    rope_reason = _rope_reason(rotary)
    if rope_reason is not None:
        return rope_reason
    head = lm.get_output_embeddings()
    if model_type == "smollm3" and len(getattr(config, "no_rope_layers", None) or []) != config.num_hidden_layers:
        return "no_rope_layers does not give one flag per layer"
    if getattr(model, "logit_scale", None) is not None:
        return "the output head has a logit scale"
    if getattr(config, "final_logit_softcapping", None) and model_type not in _GEMMA:
        return "the output head has a soft-cap"
    if head is None or not isinstance(head, torch.nn.Linear):
        return "the output head is not a Linear layer"
    return None


@dataclass
class _Layer:
    """One decoder layer's step arguments (`_attn_in`'s weights, `_attn_out`'s weights and next norm) and its cache."""

    attn_in: tuple
    attn_out: tuple
    rope: bool = True
    window: int | None = None  # sliding window (`_layer_windows`), None: full attention
    rope_table: str | None = None  # the layer type whose RoPE table it uses (Gemma 3), None: the one table
    keys: torch.Tensor | None = None  # [R, A, S, F]
    values: torch.Tensor | None = None

    def cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), each [R, A, S, F]: allocated when the call is sized (`_Run._size_slots`), before any use."""
        assert self.keys is not None and self.values is not None, "the cache is allocated when the call is sized"
        return self.keys, self.values
