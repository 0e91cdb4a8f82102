"""`StaticGenerator`: the `Generator` contract with a static KV cache, continuous batching and a decode step replayed
as one CUDA graph.

Why: at RL batch sizes decoding a small model is bound by launching kernels from Python, not by the GPU. One
captured graph per step, compiled layer halves and sampling, fused weights and one attention kernel cut the kernels
per step, and a finished row's slot is refilled with the next pending sample so that long tails leave no row idle.
How a call runs, the Gumbel-max sampling and the determinism contract (bit-exact for a fixed row count R; pin R
with max_batch_size / max_batch_tokens): docs/design.md, "opd.rollout.static_engine".

Scope: the Llama layout and the families that are it plus features the step computes: Qwen2 (qkv bias), Qwen3 (q/k
norm over heads), sliding windows per layer (Mistral, Ministral, Qwen2's, Phi-3), Phi-3 (fused qkv and gate/up,
partial rotary), Qwen3-MoE (top-k routed experts, `_mlp`), Granite (embedding, residual and attention multipliers,
logit scaling), SmolLM3 (NoPE layers), OLMo 2 (norms after the branches) and Gemma 2 / 3 (norms on both sides of
each branch over 1 + w, scaled embeddings, GELU-tanh gates, Gemma 2's attention and logit soft-caps, Gemma 3's
RoPE table per layer type). Not GPT-OSS (attention sinks, its own experts). Anything else raises (engine
"auto" then picks `TorchGenerator`, saying why); graphs and compilation on CUDA only. Omitted: a paged cache,
speculative decoding, shared-prefix (cascade) attention, and `flex_attention`'s decoding path (tried: slower than
SDPA, and its graph capture failed at larger batches).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

from opd.kernels import decode_attention as triton_attention
from opd.rollout import memory
from opd.rollout.base import GenerationOutput, SamplingParams, StopRule
from opd.rollout.hf_model import (
    HFModel,
    batch_checks,
    cached_kv,
    check_arguments,
    check_request,
    generation_mode,
    seeded_generator,
    special_ids,
)
from opd.rollout.sampling import filter_logits
from opd.scoring import recompile_limit_at_least

# Llama's layout; Mistral and Ministral are it plus a sliding window (`_layer_windows`, also Qwen2's); Granite is it
# plus four multipliers, SmolLM3 plus layers without RoPE, OLMo 2 with its norms after each branch, Gemma 2/3 with
# norms on both sides of each branch (`_Layout`)
_GEMMA = ("gemma2", "gemma3_text")
_SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "ministral", "phi3", "granite", "smollm3", "olmo2")
_SUPPORTED += _GEMMA


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as the HF Llama/Qwen modules compute it (float32 statistics, weight applied after the cast)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_weight_first(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as OLMo 2's modules compute it: the weight multiplies the float32 normed values, then the cast."""
    h = x.to(torch.float32)
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _project(
    h_RD: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], sizes: list[int]
) -> Sequence[torch.Tensor]:
    """Projections of h sharing an input: one GEMM whose output is split into `sizes` when `weights` is one fused
    matrix, else one GEMM per weight. [R, D] → one [R, size] per projection. h is cast to the weights' dtype first
    (a float32 residual stream into bf16 step weights, as autocast casts it; a no-op otherwise)."""
    h_RD = h_RD.to(weights[0].dtype)
    if len(weights) == 1:
        return F.linear(h_RD, weights[0], biases[0]).split(sizes, dim=-1)
    return [F.linear(h_RD, w, b) for w, b in zip(weights, biases)]


def _attn_in(
    h_RD,
    w_qkv,
    b_qkv,
    qn_w,
    kn_w,
    eps,
    cos_R1D,
    sin_R1D,
    heads: int,
    kv_heads: int,
    dh: int,
    rope: bool = True,
    post_norm: bool = False,
    weight_first: bool = False,
):
    """q/k/v projections, q/k-norm (per head; post_norm: OLMo 2's over the whole projection; weight_first: Gemma's
    per-head norms, `_rms_weight_first` with their (1 + w)) and RoPE (rope=False: a NoPE layer) for one normed token
    per row: [R, D] → q [R, H, Dh], k and v [R, Hkv, Dh]. The caller writes k
    and v into the cache: inside a compiled function the in-place write to the whole cache tensor measured slower
    than two separate small copy kernels (docs/performance.md)."""
    rows = h_RD.shape[0]
    q, k, v = _project(h_RD, w_qkv, b_qkv, [heads * dh, kv_heads * dh, kv_heads * dh])
    if post_norm and qn_w is not None:
        q, k = _rms_weight_first(q, qn_w, eps), _rms_weight_first(k, kn_w, eps)
    q, k, v = q.reshape(rows, heads, dh), k.reshape(rows, kv_heads, dh), v.reshape(rows, kv_heads, dh)
    if qn_w is not None and not post_norm:
        norm = _rms_weight_first if weight_first else _rms
        q, k = norm(q, qn_w, eps), norm(k, kn_w, eps)
    if not rope:
        return q, k, v
    rotary = cos_R1D.shape[-1]
    if rotary < dh:  # partial rotary (Phi-3's partial_rotary_factor): the first `rotary` dims of each head
        q = torch.cat((_rotate(q[..., :rotary], cos_R1D, sin_R1D), q[..., rotary:]), dim=-1)
        k = torch.cat((_rotate(k[..., :rotary], cos_R1D, sin_R1D), k[..., rotary:]), dim=-1)
        return q, k, v
    return _rotate(q, cos_R1D, sin_R1D), _rotate(k, cos_R1D, sin_R1D), v


def _attn_out(
    x_RD,
    attn_RE,
    wo,
    bo,
    ln_w,
    eps,
    w_gu,
    b_gu,
    wd,
    bd,
    next_ln_w,
    next_eps,
    residual_scale: float = 1.0,
    post_norm: bool = False,
    moe: tuple | None = None,
    sandwich: tuple | None = None,
    gelu: bool = False,
):
    """o-projection + residual, post-attention norm, SiLU-gated MLP + residual, then the next layer's input norm (the
    final norm after the last layer), so that the residual add and that norm fuse: [R, D] → (x [R, D], normed x).
    residual_scale: Granite's residual multiplier, applied to each branch before its add (as HF does).
    post_norm (OLMo 2): ln_w / next_ln_w are the norms of the attention and MLP outputs, each before its residual
    add, and a layer's input is x itself (→ (x, x)); the model's final norm follows the last layer separately.
    moe: a mixture-of-experts MLP (`_mlp`).
    sandwich (Gemma 2/3): (pre-MLP norm, post-MLP norm) weights; ln_w is then the norm of the attention's output
    before its residual add, and every norm is `_rms_weight_first` over (1 + w). gelu: the MLP's gate is GELU (tanh
    approximation) instead of SiLU."""
    if sandwich is not None:
        pre_ff_w, post_ff_w = sandwich
        x_RD = _residual_add(x_RD, _rms_weight_first(F.linear(attn_RE.to(wo.dtype), wo, bo), ln_w, eps))
        h_RD = _rms_weight_first(x_RD, pre_ff_w, eps)
        x_RD = _residual_add(x_RD, _rms_weight_first(_mlp(h_RD, w_gu, b_gu, wd, bd, moe, gelu), post_ff_w, eps))
        return x_RD, _rms_weight_first(x_RD, next_ln_w, next_eps)
    if post_norm:
        x_RD = _residual_add(x_RD, _rms_weight_first(F.linear(attn_RE.to(wo.dtype), wo, bo), ln_w, eps))
        x_RD = _residual_add(x_RD, _rms_weight_first(_mlp(x_RD, w_gu, b_gu, wd, bd, moe), next_ln_w, next_eps))
        return x_RD, x_RD
    x_RD = _residual_add(x_RD, _scaled(F.linear(attn_RE.to(wo.dtype), wo, bo), residual_scale))
    h_RD = _rms(x_RD, ln_w, eps)
    x_RD = _residual_add(x_RD, _scaled(_mlp(h_RD, w_gu, b_gu, wd, bd, moe, gelu), residual_scale))
    return x_RD, _rms(x_RD, next_ln_w, next_eps)


def _mlp(h_RD, w_gu, b_gu, wd, bd, moe: tuple | None = None, gelu: bool = False) -> torch.Tensor:
    """The SiLU-gated (gelu: GELU-tanh-gated, Gemma's) MLP of one normed token per row: [R, D] → [R, D].
    moe = (router weight [E, D], top_k, norm_topk_prob): Qwen3-MoE's sparse block, w_gu [E, 2I, D] and wd [E, D, I]
    the experts' stacked weights; each row's top_k experts by router probability (float32 softmax), renormalised
    when norm_topk_prob, each expert's output weighted and summed. Static shapes for the CUDA graph: with fewer
    (row, slot) pairs than experts each of the top_k slots gathers its experts' weights per row (top_k · R · 3 · I · D
    weight elements copied); otherwise every expert runs over every row (E · 3 · I · D weights read once, E / top_k
    times the FLOPs routing needs; on the H200 this took a 12-layer Qwen3-30B-A3B shape at 64 rows from 1,439 to
    the tokens/s in docs/performance.md). A grouped GEMM would need neither.
    """
    if moe is None:
        gate_RI, up_RI = _project(h_RD, w_gu, b_gu, [wd.shape[1], wd.shape[1]])
        gate_RI = F.gelu(gate_RI, approximate="tanh") if gelu else F.silu(gate_RI)
        return F.linear(gate_RI * up_RI, wd, bd)
    router_ED, top_k, norm_topk = moe
    logits_RE = F.linear(h_RD.to(router_ED.dtype), router_ED)
    weight_RK, expert_RK = torch.softmax(logits_RE, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if norm_topk:
        weight_RK = weight_RK / weight_RK.sum(dim=-1, keepdim=True)
    weight_RK = weight_RK.to(logits_RE.dtype)
    rows, experts = h_RD.shape[0], w_gu.shape[0]
    out_RD = torch.zeros_like(h_RD)
    if top_k * rows >= experts:  # every expert once over all rows: fewer weight reads than the per-row gathers
        gate_ERI, up_ERI = torch.matmul(h_RD.to(w_gu.dtype)[None], w_gu.transpose(1, 2)).chunk(2, dim=-1)
        y_ERD = torch.matmul(F.silu(gate_ERI) * up_ERI, wd.transpose(1, 2))
        rows_R = torch.arange(rows, device=h_RD.device)
        for slot in range(top_k):
            y_RD = y_ERD[expert_RK[:, slot], rows_R]
            out_RD = out_RD + (y_RD * weight_RK[:, slot, None]).to(out_RD.dtype)
        return out_RD
    x_RD1 = h_RD.to(w_gu.dtype)[:, :, None]
    for slot in range(top_k):
        expert_R = expert_RK[:, slot]
        gate_RI, up_RI = torch.bmm(w_gu[expert_R], x_RD1).squeeze(-1).chunk(2, dim=-1)
        y_RD = torch.bmm(wd[expert_R], (F.silu(gate_RI) * up_RI)[:, :, None]).squeeze(-1)
        out_RD = out_RD + (y_RD * weight_RK[:, slot, None]).to(out_RD.dtype)
    return out_RD


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x * scale in x's dtype, skipped at 1 (the graphs of the families without multipliers stay as they were)."""
    return x if scale == 1.0 else x * scale


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


def _layer_windows(model: torch.nn.Module) -> list[int | None]:
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


def _residual_add(x_RD: torch.Tensor, y_RD: torch.Tensor) -> torch.Tensor:
    """x + y computed in float32 and rounded once: bit-identical to a bf16/fp16 add (which computes in float32 too).
    Spelled this way because inductor rewrites `x + mm(a, b)` into `addmm(x, a, b)`, whose 2-D input costs a copy of x
    and a slower GEMM per residual add; here the add fuses into the following RMSNorm kernel instead."""
    return (x_RD.float() + y_RD.float()).to(x_RD.dtype)


def _attend_sdpa(q_RKGD, keys_RKSD, values_RKSD, bias_RKGS, scaling: float, softcap: float | None = None):
    """Grouped-query attention of one token per row as one SDPA call: the G query heads sharing a kv head are its
    query positions (no causal mask among them: all see the same slots). bias: 0 / -inf, q's dtype. → [R, Hkv, G, Dh]
    (softcap is never set here: `_Run` picks the matmul path for soft-capped models)"""
    return F.scaled_dot_product_attention(q_RKGD, keys_RKSD, values_RKSD, attn_mask=bias_RKGS, scale=scaling)


def _attend_matmul(q_RKGD, keys_RKSD, values_RKSD, bias_RKGS, scaling: float, softcap: float | None = None):
    """`_attend_sdpa` spelled out (the reference): scores, Gemma 2's soft-cap c · tanh(s / c) when softcap is set
    (before the mask, as transformers' eager attention), float32 softmax, weighted sum of values."""
    scores_RKGS = torch.matmul(q_RKGD, keys_RKSD.transpose(2, 3)) * scaling
    if softcap is not None:
        scores_RKGS = torch.tanh(scores_RKGS / softcap) * softcap
    probs_RKGS = torch.softmax(scores_RKGS + bias_RKGS, dim=-1, dtype=torch.float32).to(q_RKGD.dtype)
    return torch.matmul(probs_RKGS, values_RKSD)


_ATTENTION: dict[str, Callable] = {"sdpa": _attend_sdpa, "matmul": _attend_matmul}
_ATTENTION_CHOICES = ("auto", "triton", *_ATTENTION)


def _sample(
    logits_RV: torch.Tensor,
    noise_RN: torch.Tensor | None,
    temperature: float,
    vocab_size: int,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row among ids < vocab_size: Gumbel-max `argmax(filter(z / τ) - log(-log u))`, which draws from
    softmax of the filtered z / τ; greedy `argmax z` at τ = 0 (noise None, top-k/top-p ignored).
    logits [R, V ≥ vocab_size], uniform noise u [R, ≥ vocab_size] → (tokens [R] long, log-probs [R] float32).
    The log-prob is log_softmax(z / τ) over ids < vocab_size at the token, before top-k/top-p filtering."""
    scaled_RN = logits_RV[:, :vocab_size].float()  # a prefix slice: column indices stay token ids
    if temperature == 0:
        tokens_R = scaled_RN.argmax(dim=-1)
    else:
        scaled_RN = scaled_RN / temperature
        filtered_RN = filter_logits(scaled_RN, top_k, top_p) if top_k > 0 or top_p < 1.0 else scaled_RN
        gumbel_RN = -torch.log(-torch.log(noise_RN[:, :vocab_size]))  # u = 0 gives -inf: never chosen, as it should
        tokens_R = _split_argmax(filtered_RN + gumbel_RN)
    logprobs_R = scaled_RN.gather(-1, tokens_R[:, None]).squeeze(-1) - _split_logsumexp(scaled_RN)
    return tokens_R, logprobs_R


_SPLIT = 64  # pieces per row of the vocabulary reductions below


def _split_rows(x_RN: torch.Tensor) -> torch.Tensor:
    """[R, N] → [R, _SPLIT, ⌈N / _SPLIT⌉], padded with -inf. The sampling reductions run over these pieces first, so
    that the argmax and the log-sum-exp fuse into one kernel over R × _SPLIT pieces rather than two over R rows of
    151k entries, which profiled faster (docs/performance.md)."""
    width = -(-x_RN.shape[-1] // _SPLIT)
    return F.pad(x_RN, (0, width * _SPLIT - x_RN.shape[-1]), value=float("-inf")).view(x_RN.shape[0], _SPLIT, width)


def _split_argmax(x_RN: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) in two stages (per piece, then over pieces): [R, N] → [R] long. (Ties may pick another maximum.)"""
    pieces_RPW = _split_rows(x_RN)
    best_RP, where_RP = pieces_RPW.max(dim=-1)
    piece_R1 = best_RP.argmax(dim=-1, keepdim=True)
    return (piece_R1 * pieces_RPW.shape[-1] + where_RP.gather(-1, piece_R1)).squeeze(-1)


def _split_logsumexp(x_RN: torch.Tensor) -> torch.Tensor:
    """x.logsumexp(-1) in two stages: [R, N] → [R]."""
    return _split_rows(x_RN).logsumexp(dim=-1).logsumexp(dim=-1)


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


def _head_dim(model: torch.nn.Module) -> int:
    attention = model.get_decoder().layers[0].self_attn
    return attention.o_proj.weight.shape[1] // model.config.num_attention_heads


def _qkv(attention: torch.nn.Module) -> tuple[torch.nn.Linear, ...]:
    """The q, k, v projections, or Phi-3's one fused qkv_proj (rows in that order)."""
    if hasattr(attention, "qkv_proj"):
        return (attention.qkv_proj,)
    return attention.q_proj, attention.k_proj, attention.v_proj


def _gate_up(mlp: torch.nn.Module) -> tuple[torch.nn.Linear, ...]:
    """The gate and up projections, or Phi-3's one fused gate_up_proj (gate rows first)."""
    if hasattr(mlp, "gate_up_proj"):
        return (mlp.gate_up_proj,)
    return mlp.gate_proj, mlp.up_proj


def _eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (`variance_epsilon` in Llama's family, `eps` in Gemma's)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """Gemma's RMSNorm weight as its forward applies it: 1 + w in float32, for `_rms_weight_first` (bit-identical)."""
    return 1.0 + norm.weight.float()


def _embedding_scale(embedding: torch.nn.Module, layout: _Layout) -> float:
    """The factor on the embedded tokens: Gemma's `embed_scale` (√hidden, rounded to the table's dtype first, as its
    forward multiplies), else the layout's (Granite's embedding multiplier, 1 for the rest)."""
    scale = getattr(embedding, "embed_scale", None)
    if scale is None:
        return layout.embedding_scale
    return float(torch.as_tensor(scale).to(embedding.weight.dtype))


def _gelu_gate(mlp: torch.nn.Module) -> bool:
    """Whether the MLP's gate is GELU with the tanh approximation (Gemma's gelu_pytorch_tanh); SiLU otherwise (the
    caller has checked it is one of the two, `_activation_reason`)."""
    return _activation(mlp) == "gelu_tanh"


def _activation(mlp: torch.nn.Module) -> str | None:
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


def _rope_by_layer_type(rotary: torch.nn.Module) -> bool:
    """Whether the rotary module computes one table per layer type (Gemma 3: `forward(x, position_ids, layer_type)`)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


# RoPE types whose cos/sin table depends on the position only; "dynamic" and "longrope" rescale it with the length of
# the sequence (transformers' `dynamic_rope_update`), which a table precomputed over every slot cannot follow
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_reason(rotary: torch.nn.Module) -> str | None:
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
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        return f"model_type {model_type!r} is not one of {', '.join(_SUPPORTED)}"
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
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
    head = model.get_output_embeddings()
    if model_type == "smollm3" and len(getattr(config, "no_rope_layers", None) or []) != config.num_hidden_layers:
        return "no_rope_layers does not give one flag per layer"
    if getattr(model, "logit_scale", None) is not None:
        return "the output head has a logit scale"
    if getattr(config, "final_logit_softcapping", None) and model_type not in _GEMMA:
        return "the output head has a soft-cap"
    if head is None or not isinstance(head, torch.nn.Linear):
        return "the output head is not a Linear layer"
    return None


_MIN_ROW_BUCKET = 4  # the smallest live-row bucket below the call's rows


def _row_buckets(rows: int) -> tuple[int, ...]:
    """The live-row buckets of a call with `rows` rows: rows itself and every power of two in [_MIN_ROW_BUCKET, rows).
    Each is one more shape for the compiled step functions (one compile per bucket and process) and its own graphs."""
    ladder = [1 << k for k in range(_MIN_ROW_BUCKET.bit_length() - 1, rows.bit_length()) if 1 << k < rows]
    return (*ladder, rows)


_ROW_STEP = 16  # from this many rows on the call-size ladder climbs by this many rows a rung


def _round_rows(samples: int, max_batch_size: int) -> int:
    """The rows of a call of `samples` samples rounded up to the fixed ladder 1, 2, 4, 8, 16, 32, 48, 64, ... (powers
    of two below _ROW_STEP, multiples of it from there), never above max_batch_size (itself always a result): a
    process whose calls send every sample count in [1, max_batch_size] meets at most 4 + max_batch_size / 16 + 1 row
    counts, so the compiled step functions stop recompiling once those are warm. The extra rows are empty slots."""
    samples = max(1, samples)
    if samples >= max_batch_size:
        return max_batch_size
    rung = 1 << (samples - 1).bit_length() if samples < _ROW_STEP else -(-samples // _ROW_STEP) * _ROW_STEP
    return min(rung, max_batch_size)


def _settle_limit(limit: int) -> int:
    """A row count capped by memory: itself below 16, else rounded down to a multiple of 8, so that calls whose
    limit differs a little run (and compile) the same shape."""
    return limit if limit < 16 else limit // 8 * 8


# [V]-sized float32 buffers per row the sampling holds at its peak (upcast logits, scaled, Gumbel noise transform,
# noisy logits, the split-reduction padding), on top of the uniform-noise buffer and the head's logits
_SAMPLING_FLOATS = 6
_FIRST_TOKEN_ROWS = 64  # first tokens of refilled rows are sampled in groups of at most this many rows
_COMPILED: tuple[Callable, Callable, Callable] | None = None  # the compiled step functions, shared by all engines


@dataclass
class _Layer:
    """One decoder layer's step arguments (`_attn_in`'s weights, `_attn_out`'s weights and next norm) and its cache."""

    attn_in: tuple
    attn_out: tuple
    rope: bool = True
    window: int | None = None  # sliding window (`_layer_windows`), None: full attention
    rope_table: str | None = None  # the layer type whose RoPE table it uses (Gemma 3), None: the one table
    keys: torch.Tensor | None = None  # [R, Hkv, S, Dh]
    values: torch.Tensor | None = None


class StaticGenerator(memory.ModuleMemory):
    """`Generator` with a static KV cache, continuous batching and CUDA-graph decode steps; the results contract of
    `TorchGenerator` (prompt-major outputs, EOS kept, log-probs before top-k/top-p filtering, seeded), see the module
    docstring for how a call runs and its determinism contract.

    eos_token_ids, pad_token_id, vocab_size: as `TorchGenerator`
    max_batch_size:   most rows (slots) decoding at once, ≥ 1
    max_batch_tokens: most KV-cache slots at once, counted as rows × (longest prompt + max_new_tokens); None = as many
                      rows as fit in the device memory free at the call (CUDA; no limit on CPU). One row always runs.
    sync_interval:    decode steps between host checks, ≥ 1: finished rows are refilled there (each check is one
                      CPU-GPU sync; a row that finishes waits up to sync_interval - 1 steps for its refill)
    kv_bucket:        with "sdpa" / "matmul" attention, decode steps attend over the cache rounded up to a multiple of
                      this many slots (one graph each); smaller buckets read less cache per step but capture more
                      graphs, ≥ 1. Unused by the Triton kernel, which reads each row's exact slots
    cuda_graphs:      capture and replay the decode step (CUDA only); None = on CUDA
    compile:          `torch.compile` the two halves of a layer and the sampling (CUDA only; the first call per row
                      count pays the compile, or `warm_up_decode` before work starts, as the trainer does); None =
                      on CUDA, falling back to the plain step with a warning if
                      compilation fails. Results agree with the uncompiled step to bf16 rounding
    fuse_weights:     True = per call, build one q/k/v and one gate/up matrix per layer and cast every weight the step
                      uses to the compute dtype once (autocast's dtype when autocast is on at generate time, else the
                      parameters'), then decode without autocast. Extra memory while a call runs: the concatenations
                      are copies, and so is o_proj with its input columns reordered to the layout SDPA writes
                      (together about 80% of the layer weights: 0.7 GB for Qwen3-0.6B in bf16); with float32
                      parameters under bf16 autocast every GEMM weight is copied once in bf16 (1.2 GB for
                      Qwen3-0.6B), while the embedding table, the norms and the residual stream stay float32 as
                      autocast keeps them (the teacher-forced forward the trainer compares log-probs with).
                      False = one GEMM per projection on the module's own tensors, under the caller's autocast
    attention:        "auto" = "triton" on CUDA when Triton is installed and the head size is a power of two in
                      [16, 256], else "sdpa"; "triton" = the split-KV kernel `opd.kernels.decode_attention` (CUDA, or
                      CPU under Triton's interpreter: the tests); "sdpa" = one masked `scaled_dot_product_attention`
                      call per layer; "matmul" = explicit matmul / float32 softmax / matmul (the reference)
    prefill_tokens:   most prompt tokens per Hugging Face prefill forward, padding included when the prompts are
                      padded (one prompt always fits), ≥ 1
    packed_prefill:   True = prefill prompts packed into one row without padding (`HFModel.prefill_packed`; needs a
                      model loaded with `opd_varlen` attention, as `opd.models.load_model` does on CUDA): no padded
                      rows and no [W, W] mask, each prompt costs its own causal attention (a stream's continued
                      samples are prefilled again at every call, from the bare prompt to thousands of tokens long).
                      False = left-padded rows under a mask. None (default) = packed when the model packs prompts
                      (`opd_varlen`), else padded. Both give the same keys, values and first tokens up to the
                      rounding of another attention kernel; packed was 9-37% faster on an H100
                      (`benchmarks/prefill.py`, docs/performance.md)
    compiled_prefill: True = packed prefills run the decoder layers compiled by `opd.models.compile_layers` (the
                      trainer's, on CUDA) as compiled, fusing the element-wise work between the GEMMs that is about
                      half of an eager prefill's CUDA time (1.56-1.72x the packed tokens/s on an H100,
                      docs/performance.md; `rollout.compiled_prefill`, whose warm-up builds the prefill's graphs
                      through `warm_up_prefill`); False (default) = eagerly, as every other call through the Hugging
                      Face model. Needs packed prefills; no effect on layers not compiled
    free_memory:      function of a device → its (free, total) bytes, or None for no limit; default
                      `opd.rollout.memory.device_memory` (the CUDA figures; None on CPU); the tests pass a fixed one
    row_buckets:      True (default) = once no sample is pending, decode steps run over the smallest live-row
                      bucket (the call's rows, or a power of two ≥ 4 below it) that holds the rows still decoding:
                      they are moved to the first rows at a host check, so that the tail of a long-tailed call costs
                      what its live rows cost (H200, warm process: 1.54× on a lognormal tail; the first call of a
                      process pays each bucket's compile and capture, docs/performance.md). False = every step runs
                      over all rows (one shape)
    round_rows:       True = a call of fewer samples than max_batch_size runs on rows rounded up to the ladder 1, 2,
                      4, 8, 16, 32, 48, ... (`_round_rows`; the rows beyond the samples stay empty slots), and a
                      binding max_batch_tokens cap is rounded down as the memory cap is: calls of varying sample
                      counts (partial rollouts continue the samples still running) meet a few row counts, each
                      compiled once per process, rather than a compile per new count and, past dynamo's recompile
                      limit, an eager step. False = min(samples, max_batch_size) rows. None (default) = True exactly
                      when the compiled step functions run (CUDA, compile not False). Either way the rows, and so the
                      live-row buckets and the shape of the sampling noise, are a function of the samples,
                      max_batch_size, max_batch_tokens, this option and the free memory: sampled draws depend on the
                      option, greedy tokens agree (up to the rounding of sums over another row count)
    attention_splits: the Triton kernel's splits per row (a power of two); None (default) = `default_splits` of
                      the rows and the cache's length (opd.kernels.decode_attention), fixed for a call's graphs

    `stats` (after each call): rows, slots per row, decode steps, refills (samples placed into a freed slot),
    prefill forwards and the prompt tokens they ran (a prompt given more than once runs once), CUDA graphs
    captured, occupancy (decoded tokens / (steps × rows)), decode steps per live-row bucket, the rows the steps ran
    over (`row_steps`) and their occupancy, KV-cache bytes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
        max_batch_size: int = 64,
        max_batch_tokens: int | None = None,
        sync_interval: int = 32,
        kv_bucket: int = 128,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        fuse_weights: bool = True,
        attention: Literal["auto", "triton", "sdpa", "matmul"] = "auto",
        prefill_tokens: int = 8192,
        free_memory: memory.MemoryFn | None = None,
        row_buckets: bool = True,
        round_rows: bool | None = None,
        attention_splits: int | None = None,
        packed_prefill: bool | None = None,
        compiled_prefill: bool = False,
    ) -> None:
        check_arguments(
            "StaticGenerator",
            [
                *batch_checks(max_batch_size, max_batch_tokens, sync_interval, vocab_size),
                ("kv_bucket", kv_bucket >= 1, "an integer ≥ 1", kv_bucket),
                ("prefill_tokens", prefill_tokens >= 1, "an integer ≥ 1", prefill_tokens),
                ("attention", attention in _ATTENTION_CHOICES, f"one of {', '.join(_ATTENTION_CHOICES)}", attention),
                ("round_rows", round_rows is None or isinstance(round_rows, bool), "None, True or False", round_rows),
                (
                    "packed_prefill",
                    packed_prefill is None or isinstance(packed_prefill, bool),
                    "None, True or False",
                    packed_prefill,
                ),
                (
                    "attention_splits",
                    attention_splits is None
                    or (
                        isinstance(attention_splits, int)
                        and attention_splits >= 1
                        and attention_splits & (attention_splits - 1) == 0
                    ),
                    "None or a power of two ≥ 1",
                    attention_splits,
                ),
            ],
        )
        self.model = model
        if attention == "triton" and not triton_attention.available(self.device):
            raise ValueError(
                f"StaticGenerator attention='triton' needs Triton and a CUDA model (device {self.device}, "
                f"Triton {'installed' if triton_attention.triton else 'not installed'}); use 'auto'"
            )
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(
                f"StaticGenerator cannot run {type(model).__name__}: {reason} (engine 'auto' or "
                "'torch' runs any causal LM)"
            )
        softcap = _Layout.of(model.config).attn_softcap
        if attention == "sdpa" and softcap is not None:
            raise ValueError(
                f"StaticGenerator attention='sdpa' cannot soft-cap attention scores "
                f"(attn_logit_softcapping={softcap}); use 'auto', 'triton' or 'matmul'"
            )
        if attention == "triton" and not triton_attention.supports(_head_dim(model)):
            raise ValueError(
                f"StaticGenerator attention='triton' needs a power-of-two head size in [16, 256], this "
                f"model's is {_head_dim(model)}; use 'auto'"
            )
        self.eos_token_ids, self.pad_token_id = special_ids(model, eos_token_ids, pad_token_id)
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.sync_interval = sync_interval
        self.kv_bucket = kv_bucket
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self.fuse_weights = fuse_weights
        self.attention = attention
        self.prefill_tokens = prefill_tokens
        self.free_memory = free_memory
        self.row_buckets = row_buckets
        self.round_rows = round_rows
        self.attention_splits = attention_splits
        self.hf = HFModel(model, pad_token_id=self.pad_token_id, vocab_size=vocab_size)
        if packed_prefill and not self.hf.packs_prompts():
            implementation = getattr(model.config, "_attn_implementation", None)
            raise ValueError(
                f"StaticGenerator packed_prefill=True needs a model loaded with attn_implementation='opd_varlen' "
                f"(opd.models.load_model's choice on CUDA), this one has {implementation!r}; use None or False"
            )
        self.packed_prefill: bool = self.hf.packs_prompts() if packed_prefill is None else packed_prefill
        if not isinstance(compiled_prefill, bool) or (compiled_prefill and not self.packed_prefill):
            raise ValueError(
                f"StaticGenerator compiled_prefill={compiled_prefill!r}: True or False, and True needs packed prefills "
                f"(a model set to opd_varlen, packed_prefill None or True); use False"
            )
        self.compiled_prefill = compiled_prefill
        self.stats: dict[str, Any] = {}
        self._compiled: tuple[Callable, Callable, Callable] | None = None

    def prefill_groups(self, lengths: Sequence[int]) -> list[list[int]]:
        """How a call cuts the distinct prompts of these lengths into prefill forwards: indices by ascending length
        (stable), a forward holding at most `prefill_tokens` tokens (packed: their sum; padded: rows × the longest),
        or one prompt alone where it is longer."""
        groups: list[list[int]] = []
        used = 0
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            group = groups[-1] if groups else None
            width = lengths[i]  # the longest so far: prompts come in ascending length
            cost = used + width if self.packed_prefill else (len(group or ()) + 1) * width
            if group is None or cost > self.prefill_tokens:
                groups.append([i])
                used = width
            else:
                group.append(i)
                used += width
        return groups

    def warm_up_prefill(self, prompt_ids: Sequence[Sequence[int]]) -> int:
        """Prefill these prompts as a call would place them (`prefill_groups`) and discard the result, so that the
        graphs of `compiled_prefill` are built before work starts (`opd.train.step.warm_up` runs it over its warm-up
        layouts). Call it under the autocast generation runs under. Returns the tokens prefilled: none unless the
        engine's prefills run compiled."""
        if not self.compiled_prefill or not prompt_ids:
            return 0
        prompts = [list(p) for p in prompt_ids]
        device = next(self.model.parameters()).device
        autocast = torch.is_autocast_enabled(device.type)
        with generation_mode(self.model, device), _prefill_autocast(device, autocast, self.compute_dtype()):
            for group in self.prefill_groups([len(p) for p in prompts]):
                self.hf.prefill_packed([prompts[i] for i in group], device, compiled=True)
        return sum(len(p) for p in prompts)

    def decode_rows(self, samples: Iterable[int]) -> list[int]:
        """The row counts this engine's decode step runs at in calls of these sample counts, largest first: each
        call's rows (`plan_rows` before its memory cap: rounded up to the ladder where calls round) and, with live-row
        buckets, the buckets below them. A call capped by the memory free at the time may meet another count
        (`capped_rows`)."""
        counts: set[int] = set()
        for count in samples:
            rows = self._asked_rows(count)
            counts.update(_row_buckets(rows) if self.row_buckets else (rows,))
        return sorted(counts, reverse=True)

    def capped_rows(
        self, samples: int, prompt_tokens: int, new_tokens: int, slots: range, *, reserve_bytes: int = 0
    ) -> list[int]:
        """The row counts, largest first, that the memory free now less reserve_bytes, or a binding max_batch_tokens,
        can cap calls of up to `samples` samples to (`plan_rows`: below the rows the samples ask for), for rows of any
        KV slot count in `slots`, after the step weights each call builds; with live-row buckets, their buckets too.
        The warm-up compiles them (`opd.train.step.decode_warm_up_rows`), so that a call sized by the memory or the
        token budget meets no new shape. A prediction: reserve_bytes is memory resident at the calls but not yet
        (optimizer state); other memory taken or freed between now and a call moves its count. Without a memory
        figure (CPU) only the token budget's counts."""
        rows = self._asked_rows(samples)
        caps = {count for n in slots if (count := self._token_capped_rows(rows, n)) < rows}  # each slot count its own
        figure = self._memory()
        if figure is not None and slots:
            dtype = self.compute_dtype()
            free = (figure[0] - reserve_bytes - self.step_weight_bytes(dtype), figure[1])
            least, most = (
                memory.rows_that_fit(free, self.row_cost(prompt_tokens, new_tokens, dtype, n)) or 0
                for n in (slots[-1], slots[0])
            )
            # fewer slots a row, more rows: every fit between
            caps.update(_settle_limit(fit) for fit in range(max(1, least), min(most, rows - 1) + 1))
        counts: set[int] = set()
        for count in caps:
            counts.update(_row_buckets(count) if self.row_buckets else (count,))
        return sorted(counts, reverse=True)

    def warm_up_decode(self, prompt: Sequence[int], params: SamplingParams, rows: Sequence[int]) -> int:
        """Compile the decode step at each row count of `rows` (from `decode_rows`) before work starts: one call of
        that many copies of `prompt`, two new tokens each, sampled as `params` says (the step's graphs depend on how
        it samples, not on the seed), so that no later call pays a compile (`opd.train.step.warm_up` runs it). Call it
        under the autocast generation runs under. Returns the calls made: none where the step does not compile."""
        if not self.compiles_decode():
            return 0
        limit = self.max_batch_size
        try:
            for count in rows:
                self.max_batch_size = count  # exactly `count` rows: a count capped by memory is off the rounding ladder
                self.generate([list(prompt)] * count, replace(params, n=1, max_new_tokens=2))
        finally:
            self.max_batch_size = limit
        return len(rows)

    def sync_weights(self) -> None:
        """Nothing to do: the step weights are rebuilt from the trainer's module at every call."""

    def release(self) -> None:
        """Nothing to do: a call's static cache, step weights and CUDA graphs are freed when it returns."""

    def close(self) -> None:
        """Nothing to do: the module is the caller's."""

    def _step_fns(self, on_cuda: bool) -> tuple[Callable, Callable, Callable]:
        """(attn_in, attn_out, sample): compiled on CUDA unless compile=False, else the plain functions."""
        if not self._compiles(on_cuda):
            return _attn_in, _attn_out, _sample
        if self._compiled is None:
            global _COMPILED
            if _COMPILED is None:  # one set for every engine of the process: each row count compiles once
                _COMPILED = tuple(torch.compile(fn, dynamic=False) for fn in (_attn_in, _attn_out, _sample))
                # one compiled version per row count: the live-row buckets of every call size exceed dynamo's
                # default of 8, after which the step would silently run eagerly
                for name, value in recompile_limit_at_least(64).items():
                    setattr(torch._dynamo.config, name, value)
            self._compiled = _COMPILED
        return self._compiled

    def compiles_decode(self) -> bool:
        """Whether the decode step runs compiled on this engine's device (`compile`; CUDA only)."""
        return self._compiles(self.device.type == "cuda")

    def _compiles(self, on_cuda: bool) -> bool:
        """Whether the decode step runs compiled: on CUDA unless compile=False."""
        return on_cuda and self.compile is not False

    def _asked_rows(self, samples: int) -> int:
        """The rows a call of `samples` samples asks for before any cap: max_batch_size, or fewer for fewer samples
        (rounded up to the ladder of `_round_rows` when calls round)."""
        if self._rounds_rows():
            return _round_rows(samples, self.max_batch_size)
        return min(self.max_batch_size, max(1, samples))

    def _token_capped_rows(self, rows: int, slots: int) -> int:
        """`rows` under max_batch_tokens for rows of `slots` KV slots: where it binds, the rows it holds (rounded down
        as the memory cap is, `_settle_limit`, when calls round); else `rows`."""
        if self.max_batch_tokens is None or (limit := max(1, self.max_batch_tokens // slots)) >= rows:
            return rows
        return _settle_limit(limit) if self._rounds_rows() else limit

    def _rounds_rows(self) -> bool:
        """Whether calls round their rows (`round_rows`; None: when the step compiles)."""
        if self.round_rows is not None:
            return self.round_rows
        return self._compiles(self.device.type == "cuda")

    # ------------------------------------------------------------------ memory

    def compute_dtype(self) -> torch.dtype:
        """The dtype the step's GEMMs and the cache use: autocast's when the caller enabled it, else the parameters'."""
        device = self.device
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.model.get_decoder().layers[0].self_attn.o_proj.weight.dtype

    def row_cost(
        self, prompt_tokens: int, new_tokens: int, dtype: torch.dtype | None = None, slots: int | None = None
    ) -> memory.RowCost:
        """What one row of a call with this longest prompt and max_new_tokens holds: its KV slots (`slots`, default
        prompt_tokens + new_tokens), the [V]-sized sampling buffers (the head's logits, the uniform noise, the
        sampling's float32 temporaries at V = the whole vocabulary: 3.9 MB a row at Qwen3's 151,936), the decode
        step's activations and its output columns; plus what the call holds once (one prefill forward of
        `prefill_tokens`, first-token sampling, the RoPE table)."""
        config = self.model.config
        dtype = dtype or self.compute_dtype()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, _head_dim(self.model)
        hidden, inner = config.hidden_size, config.intermediate_size
        vocab_rows = self.model.get_output_embeddings().weight.shape[0]
        vocab = min(self.vocab_size or vocab_rows, vocab_rows)
        kv = memory.kv_bytes_per_token(config, dtype)
        slots = prompt_tokens + new_tokens if slots is None else slots
        sampling = vocab_rows * dtype.itemsize + 4 * vocab * (1 + _SAMPLING_FLOATS)
        prefill = max(self.prefill_tokens, prompt_tokens) * memory.prefill_bytes_per_token(config, torch.float32)
        return memory.RowCost(
            per_row={
                "KV cache": kv * slots,
                "sampling buffers": sampling,
                "decode activations": 4 * (8 * hidden + 4 * inner + 2 * (heads + 2 * kv_heads) * head_dim),
                "outputs": 12 * (new_tokens + 1),
            },
            fixed={"prefill": prefill + _FIRST_TOKEN_ROWS * sampling, "RoPE table": 8 * slots * head_dim},
            per_slot=kv + 12 + 8 * head_dim,
        )

    def step_weight_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the weight copies a call builds (`fuse_weights`): q/k/v and gate/up concatenations, o_proj
        reordered when query heads are grouped, and every other GEMM weight not already in the compute dtype."""
        if not self.fuse_weights:
            return 0
        dtype = dtype or self.compute_dtype()
        body, head = self.model.get_decoder(), self.model.get_output_embeddings()
        grouped = self.model.config.num_attention_heads != self.model.config.num_key_value_heads
        total = 0
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            total += sum(m.weight.numel() for m in _qkv(attn))
            total += attn.o_proj.weight.numel() if grouped or attn.o_proj.weight.dtype != dtype else 0
            if hasattr(mlp, "experts"):  # the stacked experts are copied only into another dtype
                experts = (mlp.experts.gate_up_proj, mlp.experts.down_proj)
                total += sum(w.numel() for w in experts if w.dtype != dtype)
                continue
            total += sum(m.weight.numel() for m in _gate_up(mlp))
            total += mlp.down_proj.weight.numel() if mlp.down_proj.weight.dtype != dtype else 0
        total += head.weight.numel() if head.weight.dtype != dtype else 0  # the embedding table is not copied
        return total * dtype.itemsize

    def check_fits(
        self,
        prompt_tokens: int,
        new_tokens: int,
        *,
        reserve_bytes: int = 0,
        names: tuple[str, str] = ("prompt length", "max_new_tokens"),
    ) -> None:
        """Raise ValueError (one line, saying what would fit) when not even one row of prompt_tokens + new_tokens
        fits in the device memory free now, less reserve_bytes (memory taken before the first call, e.g. optimizer
        state) and the step weights the call will build. Call it under the autocast generate will run under."""
        dtype, free = self.compute_dtype(), self._memory()
        if free is None:
            return
        memory.check_one_row_fits(
            free,
            self.row_cost(prompt_tokens, new_tokens, dtype),
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            slots=prompt_tokens + new_tokens,
            reserve_bytes=reserve_bytes + self.step_weight_bytes(dtype),
            where=f" on {self.device}",
            names=names,
        )

    def plan_rows(
        self,
        samples: int,
        prompt_tokens: int,
        new_tokens: int,
        dtype: torch.dtype | None = None,
        slots: int | None = None,
    ) -> int:
        """Rows of a call with `samples` samples: max_batch_size, capped by the samples (rounded up to the ladder of
        `_round_rows` when `round_rows` is on), by max_batch_tokens and by `opd.rollout.memory.rows_that_fit` on the
        memory free now. Memory-limited counts of 16 or more are rounded down to a multiple of 8 (`_settle_limit`;
        with `round_rows` on, a binding max_batch_tokens cap too), so that calls whose free memory differs a little
        run (and compile) the same shape. slots: KV slots per row (default prompt_tokens + new_tokens)."""
        slots = prompt_tokens + new_tokens if slots is None else slots
        rows = self._token_capped_rows(self._asked_rows(samples), slots)
        free = self._memory()
        cost = self.row_cost(prompt_tokens, new_tokens, dtype, slots)
        fit = memory.rows_that_fit(free, cost)
        if fit is not None and fit < rows:
            if fit < 1:
                memory.check_one_row_fits(
                    free,
                    cost,
                    prompt_tokens=prompt_tokens,
                    new_tokens=new_tokens,
                    slots=slots,
                    where=f" on {self.device}",
                )
            rows = _settle_limit(fit)
        return rows

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens_per_sample: Sequence[int] | None = None,
        stop_when: StopRule | None = None,
    ) -> GenerationOutput:
        """n samples for each of P prompts, prompt-major (see `GenerationOutput`). max_new_tokens_per_sample: one
        length limit per sample (prompt-major, each in [1, params.max_new_tokens]); a sample reaching it ends with
        finish reason "length" (benchmarks use it to force long-tailed lengths identically in every engine).
        stop_when: asked after each sync interval in which samples ended (`opd.rollout.base.StopRule`)."""
        caps = check_request(prompt_ids, params, self.eos_token_ids, max_new_tokens_per_sample)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[str] = []
        self.stats = {}  # a call without prompts decodes nothing
        if prompt_ids:
            generator = seeded_generator(params.seed, self.device)
            with generation_mode(self.model, self.device):
                run = _Run(self, [list(p) for p in prompt_ids], params, caps, generator, stop_when)
                responses, logprobs, reasons = run.run()
            self.stats = run.stats
        return GenerationOutput(
            response_ids=responses,
            finish_reasons=reasons,
            group_ids=[p for p in range(len(prompt_ids)) for _ in range(params.n)],
            logprobs=logprobs if params.return_logprobs else None,
        )


def _prefill_autocast(device: torch.device, enabled: bool, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The caller's autocast for the Hugging Face prefill, with its weight cache off: cached casts would keep a
    second copy of every float32 weight for the rest of the call."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


class _Run:
    """The state of one call: step weights, slots (static cache and device-side row state), the samples still
    pending, the decode step and its graphs."""

    def __init__(
        self,
        engine: StaticGenerator,
        prompts: list[list[int]],
        params: SamplingParams,
        caps: list[int],
        generator: torch.Generator,
        stop_when: StopRule | None = None,
    ):
        self.engine, self.params, self.generator, self.stop_when = engine, params, generator, stop_when
        model = engine.model
        self.device = device = engine.device
        body, head = model.get_decoder(), model.get_output_embeddings()
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        kernel_ok = triton_attention.available(device) and triton_attention.supports(_head_dim(model))
        # SDPA has no soft-cap: soft-capped models (Gemma 2) take the matmul path off the Triton kernel
        self.layout = _Layout.of(config)
        fallback = "matmul" if self.layout.attn_softcap is not None else "sdpa"
        auto = "triton" if kernel_ok and device.type == "cuda" else fallback
        self.attention = auto if engine.attention == "auto" else engine.attention
        self.attend = _ATTENTION.get(self.attention)  # None: the Triton kernel

        self.autocast = torch.is_autocast_enabled(device.type)
        self.dtype = dtype = engine.compute_dtype()
        self.fused = engine.fuse_weights
        shadow = dtype if self.fused else None  # None: the module's own tensors

        # Step weights, read now so that a call sees the latest optimizer step (before sizing: they take memory).
        # GEMM weights in the compute dtype; the embedding table and the norms keep the parameters' dtype, and so does
        # the residual stream: float32 under autocast (as autocast computes the teacher-forced forward), the model's
        # dtype otherwise.
        self._read_step_weights(model, shadow)

        # The samples and the slots: each slot holds one sample's prompt at [0, L) and its tokens after it.
        self.prompts, self.caps = prompts, caps
        # a prompt given twice is prefilled once (a stream's samples that have no tokens yet come one prefix each)
        first: dict[tuple[int, ...], int] = {}
        canonical = [first.setdefault(tuple(prompt), p) for p, prompt in enumerate(prompts)]
        self.sample_prompt = [c for c in canonical for _ in range(params.n)]
        self.width, self.steps = max(len(p) for p in prompts), max(caps)
        # slots: the longest sample, its prompt and its own limit (a stream's longest continued prefix has a short
        # limit left); the last sampled token is never fed back, so one spare
        self.capacity = max(len(prompts[p]) + cap for p, cap in zip(self.sample_prompt, caps))
        self.rows = rows = engine.plan_rows(len(caps), self.width, self.steps, dtype, slots=self.capacity)
        head_dim = _head_dim(model)
        for layer in self.layers:
            # zeros, not empty: the SDPA path reads whole buckets (masked slots must hold finite values)
            layer.keys = torch.zeros(rows, self.kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
            layer.values = torch.zeros_like(layer.keys)

        # RoPE tables over every slot position, computed by the model's own rotary module (float32, cast per step):
        # one, or one per layer type where the module takes it (Gemma 3: its sliding and full layers' bases).
        positions_1S = torch.arange(self.capacity, device=device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        self.rope_SD: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for table in dict.fromkeys(layer.rope_table for layer in self.layers):
            cos_1SD, sin_1SD = body.rotary_emb(probe, positions_1S, *([] if table is None else [table]))
            self.rope_SD[table] = (cos_1SD[0].float(), sin_1SD[0].float())

        # Device-side row state: static buffers the graphs read and write, refilled in place between replays.
        long = dict(dtype=torch.long, device=device)
        self.rows_R = torch.arange(rows, device=device)
        self.zeros_R = torch.zeros(rows, **long)  # every row's first slot (prompts start at slot 0)
        self.slots_S = torch.arange(self.capacity, device=device)
        self.position_R = torch.zeros(rows, **long)  # slot = RoPE position of the next fed token
        self.tokens_R = torch.zeros(rows, **long)  # the next fed token
        self.lengths_R = torch.zeros(rows, **long)  # tokens sampled so far = the output column the next one takes
        self.limit_R = torch.ones(rows, **long)  # the row's length limit
        self.alive_R = torch.zeros(rows, dtype=torch.bool, device=device)  # holds a sample still decoding
        self.stopped_R = torch.zeros(rows, dtype=torch.bool, device=device)  # its sample ended on an EOS
        # one spare column: rows that are not alive write their (discarded) token there
        self.out_ids_RT = torch.full((rows, self.steps + 1), engine.pad_token_id, **long)
        self.out_lps_RT = torch.zeros((rows, self.steps + 1), dtype=torch.float32, device=device)
        self.eos_E = torch.as_tensor(engine.eos_token_ids or [-1], **long)
        vocab_rows = head.weight.shape[0]
        self.vocab = min(engine.vocab_size or vocab_rows, vocab_rows)  # sampled ids are < vocab
        self.noise_RN = None if params.temperature == 0 else torch.zeros(rows, self.vocab, device=device)

        # Host-side bookkeeping (no sync needed to read it).
        self.slot_sample: list[int | None] = [None] * rows  # sample index held by each slot
        self.slot_position = [0] * rows  # bound on the slot's next fed position
        self.slot_last = [0] * rows  # the last position its sample can feed
        self.pending = 0  # next sample index to place
        self.results: list[tuple[list[int], list[float], str] | None] = [None] * len(caps)
        self.counters = {
            "decode_steps": 0,
            "refills": 0,
            "prefills": 0,
            "prefilled_tokens": 0,
            "graphs": 0,
            "decoded_tokens": 0,
            "cut": 0,
        }
        self.live = rows  # decode steps run over rows [0, live): the live-row bucket (`_shrink`)
        self.buckets = _row_buckets(rows) if engine.row_buckets else (rows,)
        self.bucket_steps: dict[int, int] = {}  # decode steps run at each bucket

    def _read_step_weights(self, model: torch.nn.Module, shadow: torch.dtype | None) -> None:
        """The step's weights (`_Layer` per decoder layer, norms, embedding, head, RoPE-table keys) from the module."""
        body, head = model.get_decoder(), model.get_output_embeddings()
        layout = self.layout
        # layer i's next norm: i + 1 (post-norm layers: the norm of the MLP's output, the final norm on its own)
        if layout.post_norm:
            input_norms = [None] + [layer.post_feedforward_layernorm for layer in body.layers]
        else:
            input_norms = [layer.input_layernorm for layer in body.layers] + [body.norm]
        norm = _norm_weight if layout.sandwich else (lambda module: module.weight)
        self.first_norm = None if layout.post_norm else (norm(input_norms[0]), _eps(input_norms[0]))
        self.final_norm = (body.norm.weight, _eps(body.norm)) if layout.post_norm else None
        self.embed_VD = body.embed_tokens.weight
        self.embedding_scale = _embedding_scale(body.embed_tokens, layout)
        self.head_w, self.head_b = _cast(head.weight, shadow), _cast(head.bias, shadow)
        rope_layers = layout.rope_layers or (True,) * len(body.layers)
        windows = _layer_windows(model)
        gelu = _gelu_gate(body.layers[0].mlp)
        self.layers: list[_Layer] = []
        for i, layer in enumerate(body.layers):
            attn, mlp, post, following = layer.self_attn, layer.mlp, layer.post_attention_layernorm, input_norms[i + 1]
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            # q/k-norm's eps: the input norm's (Qwen3: the same rms_norm_eps), OLMo 2's and Gemma's own norms
            norm_eps = _eps(qn or post) if layout.post_norm or layout.sandwich else _eps(input_norms[i])
            w_qkv, b_qkv = _projection_weights(_qkv(attn), shadow)
            moe = None
            if hasattr(mlp, "experts"):  # Qwen3-MoE's sparse block (`_mlp`)
                moe = (mlp.gate.weight, mlp.gate.top_k, mlp.gate.norm_topk_prob)
                w_gu, b_gu = _cast(mlp.experts.gate_up_proj, shadow), None
                w_down, b_down = _cast(mlp.experts.down_proj, shadow), None
            else:
                w_gu, b_gu = _projection_weights(_gate_up(mlp), shadow)
                w_down, b_down = _cast(mlp.down_proj.weight, shadow), _cast(mlp.down_proj.bias, shadow)
            ins = (
                w_qkv,
                b_qkv,
                None if qn is None else norm(qn),
                None if kn is None else norm(kn),
                norm_eps,
            )
            w_o = _cast(attn.o_proj.weight, shadow)
            if shadow is not None:  # input columns in (G, Hkv) head order, see `_decode_step` (a copy when G > 1)
                w_o = w_o.unflatten(1, (self.kv_heads, self.heads // self.kv_heads, -1)).transpose(1, 2).flatten(1)
            sandwich = None
            if layout.sandwich:
                sandwich = (
                    _norm_weight(layer.pre_feedforward_layernorm),
                    _norm_weight(layer.post_feedforward_layernorm),
                )
            outs = (
                w_o,
                _cast(attn.o_proj.bias, shadow),
                norm(post),
                _eps(post),
                w_gu,
                b_gu,
                w_down,
                b_down,
                norm(following),
                _eps(following),
            )
            outs = (*outs, layout.residual_scale, layout.post_norm, moe, sandwich, gelu)
            table = getattr(attn, "layer_type", None) if _rope_by_layer_type(body.rotary_emb) else None
            self.layers.append(_Layer(ins, outs, rope=rope_layers[i], window=windows[i], rope_table=table))
            self.scaling = attn.scaling

    @property
    def stats(self) -> dict[str, Any]:
        steps = self.counters["decode_steps"]
        occupancy = self.counters["decoded_tokens"] / (steps * self.rows) if steps else None
        row_steps = sum(b * n for b, n in self.bucket_steps.items())
        return {
            "rows": self.rows,
            "slots_per_row": self.capacity,
            "attention": self.attention,
            **self.counters,
            "occupancy": occupancy,
            "bucket_steps": dict(sorted(self.bucket_steps.items(), reverse=True)),
            "row_steps": row_steps,  # Σ bucket × its decode steps: the rows the decode steps ran over
            "bucket_occupancy": self.counters["decoded_tokens"] / row_steps if row_steps else None,
            "kv_cache_bytes": sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers),
        }

    # ------------------------------------------------------------------ filling slots

    def _admit(self, free: list[int]) -> None:
        """Place pending samples into the free slots (ascending), prefill their prompts (once per prompt and
        refill), sample their first tokens; samples that end at once are harvested and their slots reused."""
        free = sorted(free)
        while free and self.pending < len(self.caps):
            take = min(len(free), len(self.caps) - self.pending)
            samples = list(range(self.pending, self.pending + take))
            slots, free = free[:take], free[take:]
            if self.counters["prefills"]:
                self.counters["refills"] += take
            self.pending += take
            # distinct prompts by length (stable), cut into forwards of ≤ prefill_tokens tokens (padded ones when
            # padded: neighbours in length pad little; a stream's continued samples range from the bare prompt to
            # max_new_tokens longer)
            distinct = list(dict.fromkeys(self.sample_prompt[s] for s in samples))
            lengths = [len(self.prompts[p]) for p in distinct]
            groups = [[distinct[i] for i in group] for group in self.engine.prefill_groups(lengths)]
            placed = dict(zip(samples, slots))
            for group in groups:
                in_group = set(group)
                members = [s for s in samples if self.sample_prompt[s] in in_group]
                self._place(group, members, [placed[s] for s in members])
            ended = [slot for slot, alive in zip(slots, self.alive_R[torch.as_tensor(slots)].tolist()) if not alive]
            if ended:  # host sync above; samples that ended on their first token free their slot again
                self._harvest(ended)
                free = sorted(free + ended)

    def _place(self, group: list[int], samples: list[int], slots: list[int]) -> None:
        """One prefill of the prompts in `group`; copy each sample's prompt keys/values to slots [0, L) of its slot
        and sample its first token from the prefill logits."""
        device, engine, params = self.device, self.engine, self.params
        prompts = [self.prompts[p] for p in group]
        with _prefill_autocast(self.device, self.autocast, self.dtype):
            if engine.packed_prefill:
                cache, starts, logits_PV = engine.hf.prefill_packed(prompts, device, compiled=engine.compiled_prefill)
            else:
                cache, _, logits_PV = engine.hf.prefill(prompts, device, full_cache=True)
        self.counters["prefills"] += 1
        self.counters["prefilled_tokens"] += sum(len(p) for p in prompts)
        width = max(len(p) for p in prompts)
        index = {p: i for i, p in enumerate(group)}
        source_g = torch.as_tensor([index[self.sample_prompt[s]] for s in samples], device=device)
        lengths = [len(self.prompts[self.sample_prompt[s]]) for s in samples]
        lengths_g = torch.as_tensor(lengths, device=device)
        slots_g = torch.as_tensor(slots, device=device)
        # Slot j of a sample takes its prompt's position j: in a packed prefill at its prompt's start + j, in a
        # left-padded one at j + (W - L) of its prompt's row. Slots ≥ L take a clamped copy, overwritten by decode
        # tokens before any step reads them.
        slot_W = torch.arange(width, device=device)
        if engine.packed_prefill:
            starts_g = torch.as_tensor(starts, device=device)[source_g]
            from_gW = starts_g[:, None] + torch.minimum(slot_W[None], lengths_g[:, None] - 1)
            row_g = torch.zeros_like(source_g)  # the cache's one packed row
        else:
            from_gW = (slot_W[None] + (width - lengths_g)[:, None]).clamp(max=width - 1)
            row_g = source_g
        for i, layer in enumerate(self.layers):
            keys_PKWD, values_PKWD = cached_kv(cache, i)
            layer.keys[slots_g, :, :width] = keys_PKWD[row_g[:, None], :, from_gW].transpose(1, 2).to(self.dtype)
            layer.values[slots_g, :, :width] = values_PKWD[row_g[:, None], :, from_gW].transpose(1, 2).to(self.dtype)
        del cache
        caps_g = torch.as_tensor([self.caps[s] for s in samples], device=device)
        for lo in range(0, len(samples), _FIRST_TOKEN_ROWS):
            part = slice(lo, lo + _FIRST_TOKEN_ROWS)
            logits_gV = logits_PV[source_g[part]]
            noise_gN = None
            if params.temperature != 0:
                noise_gN = torch.empty(logits_gV.shape[0], self.vocab, device=device).uniform_(generator=self.generator)
            tokens_g, logprobs_g = _sample(
                logits_gV, noise_gN, params.temperature, self.vocab, params.top_k, params.top_p
            )
            rows_g = slots_g[part]
            stopped_g = (
                (tokens_g[:, None] == self.eos_E[None]).any(-1)
                if params.stop_at_eos
                else torch.zeros_like(tokens_g, dtype=torch.bool)
            )
            self.tokens_R[rows_g] = tokens_g
            self.position_R[rows_g] = lengths_g[part]
            self.lengths_R[rows_g] = 1
            self.limit_R[rows_g] = caps_g[part]
            self.out_ids_RT[rows_g, 0] = tokens_g
            self.out_lps_RT[rows_g, 0] = logprobs_g
            self.stopped_R[rows_g] = stopped_g
            self.alive_R[rows_g] = ~stopped_g & (caps_g[part] > 1)
        for sample, slot, length in zip(samples, slots, lengths):
            self.slot_sample[slot] = sample
            self.slot_position[slot] = length
            self.slot_last[slot] = length + max(self.caps[sample] - 2, 0)

    def _cut(self) -> None:
        """End the call now (`stop_when`): the samples decoding return their tokens so far, those waiting none, all
        with reason "length"; no slot is occupied afterwards, so the decode loop ends."""
        occupied = [r for r in range(self.rows) if self.slot_sample[r] is not None]
        self.counters["cut"] = len(occupied) + len(self.caps) - self.pending
        if occupied:  # all alive: the rows that ended were harvested
            self._harvest(occupied)
        for sample in range(self.pending, len(self.caps)):
            self.results[sample] = ([], [], "length")
        self.pending = len(self.caps)

    def _harvest(self, slots: list[int]) -> None:
        """Copy the finished samples of these slots to the results (one device-to-host copy) and free the slots."""
        index = torch.as_tensor(slots, device=self.device)
        lengths, stopped = self.lengths_R[index].tolist(), self.stopped_R[index].tolist()
        longest = max(lengths)
        ids_rows = self.out_ids_RT[index, :longest].tolist()
        lps_rows = self.out_lps_RT[index, :longest].tolist() if self.params.return_logprobs else [[] for _ in slots]
        for slot, n, done, ids, lps in zip(slots, lengths, stopped, ids_rows, lps_rows):
            self.results[self.slot_sample[slot]] = (ids[:n], lps[:n], "stop" if done else "length")
            self.slot_sample[slot] = None
            self.slot_position[slot] = self.slot_last[slot] = 0
        # An empty slot keeps computing (static shapes) until it is refilled: at position 0 its attention reads one
        # slot instead of its last sample's whole sequence (the tail of a long-tailed call runs mostly empty slots).
        self.position_R[index] = 0

    # ------------------------------------------------------------------ one step

    def _record(self, tokens_R: torch.Tensor, logprobs_R: torch.Tensor, rows: int) -> None:
        """Write each alive row's sampled token and log-prob at its own column, then advance lengths, finished rows
        and positions of the first `rows` rows; no host sync. Rows not alive write into the spare column and do not
        move."""
        alive_R, lengths_R, stopped_R = self.alive_R[:rows], self.lengths_R[:rows], self.stopped_R[:rows]
        column_R = torch.where(alive_R, lengths_R, self.steps)[:, None]
        self.out_ids_RT[:rows].scatter_(1, column_R, tokens_R[:, None])
        self.out_lps_RT[:rows].scatter_(1, column_R, logprobs_R[:, None])
        lengths_R.add_(alive_R.long())
        if self.params.stop_at_eos:
            stopped_R.logical_or_(alive_R & (tokens_R[:, None] == self.eos_E[None]).any(-1))
        alive_R.logical_and_(~stopped_R & (lengths_R < self.limit_R[:rows]))
        self.position_R[:rows].add_(alive_R.long())
        self.tokens_R[:rows].copy_(tokens_R)

    def _decode_step(self, span: int, fns: tuple[Callable, Callable, Callable], rows: int) -> None:
        """Feed tokens_R at each of the first `rows` rows' position_R, attending over the first `span` slots;
        sample; record. (Views of the first rows: the live-row bucket, see `_shrink`.)"""
        attn_in, attn_out, sample = fns
        params = self.params
        heads, kv_heads = self.heads, self.kv_heads
        post_norm = self.layout.post_norm
        position_R, rows_R = self.position_R[:rows], self.rows_R[:rows]
        sandwich = self.layout.sandwich
        x_RD = _scaled(F.embedding(self.tokens_R[:rows], self.embed_VD), self.embedding_scale)
        if self.first_norm is not None:
            h_RD = (_rms_weight_first if sandwich else _rms)(x_RD, *self.first_norm)
        else:
            h_RD = x_RD
        rope = {
            table: (cos_SD[position_R][:, None].to(x_RD.dtype), sin_SD[position_R][:, None].to(x_RD.dtype))
            for table, (cos_SD, sin_SD) in self.rope_SD.items()
        }
        triton_kernel = self.attend is None  # reads slots [start_R, position_R] itself: no mask
        # Per window (None: full attention; a sliding window W reads slots (position - W, position]): the Triton
        # kernel's first slot, or one mask for every layer of that window. SDPA's memory-efficient kernel wants the
        # mask in q's dtype with every dimension (expand is a view).
        starts: dict[int | None, torch.Tensor] = {}
        biases: dict[int | None, torch.Tensor] = {}
        for window in dict.fromkeys(layer.window for layer in self.layers):
            first_R = self.zeros_R[:rows] if window is None else (position_R - (window - 1)).clamp(min=0)
            if triton_kernel:
                starts[window] = first_R
                continue
            slots_1S = self.slots_S[None, :span]
            valid_RS = (slots_1S <= position_R[:, None]) & (slots_1S >= first_R[:, None])
            biases[window] = (
                torch.zeros(valid_RS.shape, dtype=self.dtype, device=self.device)
                .masked_fill_(~valid_RS, float("-inf"))[:, None, None]
                .expand(rows, kv_heads, heads // kv_heads, span)
            )
        for layer in self.layers:
            keys_RKSD, values_RKSD = layer.keys[:rows], layer.values[:rows]
            cos_R1D, sin_R1D = rope[layer.rope_table]
            q_RHD, k_RKD, v_RKD = attn_in(
                h_RD,
                *layer.attn_in,
                cos_R1D,
                sin_R1D,
                heads,
                kv_heads,
                layer.keys.shape[-1],
                layer.rope,
                post_norm,
                sandwich,
            )
            # Grouped-query attention without repeating the cache: query head h uses kv head h // (heads / kv_heads).
            # Under autocast q/k-norm and RoPE return float32 (float32 norm weights): attention runs in the compute
            # dtype, as autocast runs SDPA, the new token's k/v rounded like the cached ones.
            q_RKGD = q_RHD.to(self.dtype).reshape(rows, kv_heads, heads // kv_heads, -1)
            k_RKD, v_RKD = k_RKD.to(self.dtype), v_RKD.to(self.dtype)
            if triton_kernel:  # the kernel also writes k and v into the cache at position_R
                attn_RKGD = triton_attention.decode_attention(
                    q_RKGD,
                    keys_RKSD,
                    values_RKSD,
                    starts[layer.window],
                    position_R,
                    self.scaling,
                    k_RKD,
                    v_RKD,
                    splits=self.engine.attention_splits,
                    softcap=self.layout.attn_softcap,
                )
            else:
                keys_RKSD[rows_R, :, position_R] = k_RKD
                values_RKSD[rows_R, :, position_R] = v_RKD
                attn_RKGD = self.attend(
                    q_RKGD,
                    keys_RKSD[:, :, :span],
                    values_RKSD[:, :, :span],
                    biases[layer.window],
                    self.scaling,
                    self.layout.attn_softcap,
                )
            # SDPA's memory-efficient kernel (and the Triton kernel) writes [R, G, Hkv, Dh] and returns a transposed
            # view: flattened in that order it needs no copy (fused o-proj columns are permuted to match); the
            # module's own o-proj needs (Hkv, G) order.
            if self.fused:
                attn_RE = attn_RKGD.transpose(1, 2).reshape(rows, -1)
            else:
                attn_RE = attn_RKGD.reshape(rows, -1)
            x_RD, h_RD = attn_out(x_RD, attn_RE, *layer.attn_out)
        if self.final_norm is not None:
            h_RD = _rms_weight_first(x_RD, *self.final_norm)
        logits_RV = F.linear(h_RD.to(self.head_w.dtype), self.head_w, self.head_b)
        if self.layout.logits_divisor != 1.0:
            logits_RV = logits_RV / self.layout.logits_divisor
        if self.layout.logits_softcap is not None:  # Gemma 2's final soft-cap, in the head's dtype as transformers
            logits_RV = torch.tanh(logits_RV / self.layout.logits_softcap) * self.layout.logits_softcap
        noise_RN = None if self.noise_RN is None else self.noise_RN[:rows]
        tokens_R, logprobs_R = sample(logits_RV, noise_RN, params.temperature, self.vocab, params.top_k, params.top_p)
        self._record(tokens_R, logprobs_R, rows)

    # ------------------------------------------------------------------ the loop

    def _span(self) -> int:
        """Slots the next `sync_interval` steps attend over: every occupied row's last position in the interval + 1,
        rounded up to kv_bucket (the whole cache for the Triton kernel, which reads each row's length on the device:
        one graph for the call)."""
        if self.attend is None:
            return self.capacity
        interval = self.engine.sync_interval
        needed = 1 + max(
            min(self.slot_position[r] + interval - 1, self.slot_last[r])
            for r in range(self.rows)
            if self.slot_sample[r] is not None
        )
        bucket = self.engine.kv_bucket
        return min(self.capacity, -(-needed // bucket) * bucket)

    def _shrink(self) -> None:
        """With no sample pending, move the occupied slots to the first rows of the smallest bucket that holds them
        (`_row_buckets`) when that is smaller than the current one, so that decode steps run over those rows only: the
        row state, the output columns and the cache rows move with their samples (one copy each, at most once per
        bucket). Rows in [occupied, bucket) are empty; rows ≥ the bucket are never read again."""
        if self.pending < len(self.caps):  # the common case: samples still to place, so no list work at all
            return
        occupied = [r for r in range(self.live) if self.slot_sample[r] is not None]
        bucket = min(b for b in self.buckets if b >= len(occupied))
        if bucket >= self.live:
            return
        n, source = len(occupied), torch.as_tensor(occupied, device=self.device)
        tensors = [self.position_R, self.tokens_R, self.lengths_R, self.limit_R, self.alive_R, self.stopped_R]
        tensors += [self.out_ids_RT, self.out_lps_RT]
        tensors += [t for layer in self.layers for t in (layer.keys, layer.values)]
        for tensor in tensors:
            tensor[:n] = tensor[source]  # advanced indexing copies first: no overlap between source and target
        self.alive_R[n : self.live] = False
        self.position_R[n : self.live] = 0  # an empty row reads one slot (see `_harvest`)
        for name in ("slot_sample", "slot_position", "slot_last"):
            column = getattr(self, name)
            moved = [column[r] for r in occupied]
            column[: self.live] = moved + [None if name == "slot_sample" else 0] * (self.live - n)
        self.live = bucket

    def _capture(self, span: int, fns, pool) -> Any:
        """A CUDA graph of the decode step over `span` slots and the first `live` rows. Warm-up runs change the row
        state, so it is saved and restored (their cache and output writes land where the replayed step writes again)."""
        state = [self.position_R, self.tokens_R, self.lengths_R, self.alive_R, self.stopped_R]
        saved = [s.clone() for s in state]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiled functions compile on their first call, outside the capture
                    self._decode_step(span, fns, self.live)
                    for s, v in zip(state, saved):
                        s.copy_(v)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: with rollout.overlap this capture runs in a background thread while the main thread
            # scores and updates; the default ("global") mode makes the main thread's allocations fail the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._decode_step(span, fns, self.live)
        finally:
            for s, v in zip(state, saved):
                s.copy_(v)
        self.counters["graphs"] += 1
        return graph

    def run(self) -> tuple[list[list[int]], list[list[float]], list[str]]:
        engine = self.engine
        on_cuda = self.device.type == "cuda"
        fns = engine._step_fns(on_cuda)
        use_graphs = on_cuda and engine.cuda_graphs is not False
        # Fused weights are already in the compute dtype: decode without autocast. Otherwise under the caller's
        # autocast, with its weight cache off while capturing (cached casts would be freed after the capture); warm-up
        # runs and captures share this state so that compiled functions are not recompiled during a capture.
        amp = dict(
            device_type=self.device.type,
            dtype=torch.get_autocast_dtype(self.device.type),
            enabled=self.autocast and not self.fused,
            cache_enabled=not use_graphs,
        )
        graphs: dict[tuple[int, int], Any] = {}  # (rows, span) → graph
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._admit(list(range(self.rows)))
        while any(s is not None for s in self.slot_sample):
            if engine.row_buckets:
                self._shrink()
            span = self._span()
            key = (self.live, span)
            with torch.autocast(**amp):
                if use_graphs and key not in graphs:
                    try:
                        graphs[key] = self._capture(span, fns, pool)
                    except Exception as error:  # compile=None: a failing torch.compile falls back to the plain step
                        if engine.compile is not None or fns[0] is _attn_in:
                            raise
                        warnings.warn(
                            f"StaticGenerator: torch.compile of the decode step failed "
                            f"({type(error).__name__}: {error}); decoding without it",
                            RuntimeWarning,
                            stacklevel=3,
                        )
                        engine._compiled = fns = (_attn_in, _attn_out, _sample)
                        graphs = {key: self._capture(span, fns, pool)}
                for _ in range(engine.sync_interval):
                    if self.noise_RN is not None:  # uniforms for the rows the step runs over only
                        self.noise_RN[: self.live].uniform_(generator=self.generator)
                    if use_graphs:
                        graphs[key].replay()
                    else:
                        self._decode_step(span, fns, self.live)
            self.counters["decode_steps"] += engine.sync_interval
            self.bucket_steps[self.live] = self.bucket_steps.get(self.live, 0) + engine.sync_interval
            alive = self.alive_R.tolist()  # host sync: which rows finished
            ended = [r for r in range(self.rows) if self.slot_sample[r] is not None and not alive[r]]
            for r in range(self.rows):
                self.slot_position[r] = min(self.slot_position[r] + engine.sync_interval, self.slot_last[r])
            if ended:
                self._harvest(ended)
                # asked before the refill: a sample placed now would come back cut at its first token, its prefill
                # spent for nothing
                if self.stop_when is not None and self.stop_when([None if r is None else r[2] for r in self.results]):
                    self._cut()
                else:
                    self._admit(ended)
        self.counters["decoded_tokens"] = sum(len(ids) - 1 for ids, _, _ in self.results if ids)
        responses, logprobs, reasons = (list(column) for column in zip(*self.results))
        return responses, logprobs, reasons
