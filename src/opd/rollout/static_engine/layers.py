"""The decode step's layer math, one normed token per row: RMSNorm (Llama's and OLMo 2's / Gemma's order), RoPE,
the q/k/v projections with q/k-norm, grouped-query attention (SDPA or the matmul reference), the o-projection and
the dense or Qwen3-MoE MLP with their residual adds. Pure functions of tensors: `engine` compiles `_attn_in` and
`_attn_out`, `run` calls them once per layer and step. What each family changes is in `families`.

Shapes (docs/design.md, "Shape letters"): R rows of the engine call, D model width, H query heads, A key/value heads,
G query heads per key/value head, F head dimension, S cache slots, I MLP intermediate width, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


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
    cos_R1F,
    sin_R1F,
    heads: int,
    kv_heads: int,
    dh: int,
    rope: bool = True,
    post_norm: bool = False,
    weight_first: bool = False,
):
    """q/k/v projections, q/k-norm (per head; post_norm: OLMo 2's over the whole projection; weight_first: Gemma's
    per-head norms, `_rms_weight_first` with their (1 + w)) and RoPE (rope=False: a NoPE layer) for one normed token
    per row: [R, D] → q [R, H, F], k and v [R, A, F]. The caller writes k
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
    rotary = cos_R1F.shape[-1]
    if rotary < dh:  # partial rotary (Phi-3's partial_rotary_factor): the first `rotary` dims of each head
        q = torch.cat((_rotate(q[..., :rotary], cos_R1F, sin_R1F), q[..., rotary:]), dim=-1)
        k = torch.cat((_rotate(k[..., :rotary], cos_R1F, sin_R1F), k[..., rotary:]), dim=-1)
        return q, k, v
    return _rotate(q, cos_R1F, sin_R1F), _rotate(k, cos_R1F, sin_R1F), v


def _attn_out(
    x_RD,
    attn_heads,
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
        x_RD = _residual_add(x_RD, _rms_weight_first(F.linear(attn_heads.to(wo.dtype), wo, bo), ln_w, eps))
        h_RD = _rms_weight_first(x_RD, pre_ff_w, eps)
        x_RD = _residual_add(x_RD, _rms_weight_first(_mlp(h_RD, w_gu, b_gu, wd, bd, moe, gelu), post_ff_w, eps))
        return x_RD, _rms_weight_first(x_RD, next_ln_w, next_eps)
    if post_norm:
        x_RD = _residual_add(x_RD, _rms_weight_first(F.linear(attn_heads.to(wo.dtype), wo, bo), ln_w, eps))
        x_RD = _residual_add(x_RD, _rms_weight_first(_mlp(x_RD, w_gu, b_gu, wd, bd, moe), next_ln_w, next_eps))
        return x_RD, x_RD
    x_RD = _residual_add(x_RD, _scaled(F.linear(attn_heads.to(wo.dtype), wo, bo), residual_scale))
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
    times the FLOPs routing needs, and faster at 64 rows: docs/performance.md). A grouped GEMM would need neither.
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


def _residual_add(x_RD: torch.Tensor, y_RD: torch.Tensor) -> torch.Tensor:
    """x + y computed in float32 and rounded once: bit-identical to a bf16/fp16 add (which computes in float32 too).
    Spelled this way because inductor rewrites `x + mm(a, b)` into `addmm(x, a, b)`, whose 2-D input costs a copy of x
    and a slower GEMM per residual add; here the add fuses into the following RMSNorm kernel instead."""
    return (x_RD.float() + y_RD.float()).to(x_RD.dtype)


def _attend_sdpa(q_RAGF, keys_RASF, values_RASF, bias_RAGS, scaling: float, softcap: float | None = None):
    """Grouped-query attention of one token per row as one SDPA call: the G query heads sharing a kv head are its
    query positions (no causal mask among them: all see the same slots). bias: 0 / -inf, q's dtype. → [R, A, G, F]
    (softcap is never set here: `_Run` picks the matmul path for soft-capped models)"""
    return F.scaled_dot_product_attention(q_RAGF, keys_RASF, values_RASF, attn_mask=bias_RAGS, scale=scaling)


def _attend_matmul(q_RAGF, keys_RASF, values_RASF, bias_RAGS, scaling: float, softcap: float | None = None):
    """`_attend_sdpa` spelled out (the reference): scores, Gemma 2's soft-cap c · tanh(s / c) when softcap is set
    (before the mask, as transformers' eager attention), float32 softmax, weighted sum of values."""
    scores_RAGS = torch.matmul(q_RAGF, keys_RASF.transpose(2, 3)) * scaling
    if softcap is not None:
        scores_RAGS = torch.tanh(scores_RAGS / softcap) * softcap
    probs_RAGS = torch.softmax(scores_RAGS + bias_RAGS, dim=-1, dtype=torch.float32).to(q_RAGF.dtype)
    return torch.matmul(probs_RAGS, values_RASF)


_ATTENTION: dict[str, Callable] = {"sdpa": _attend_sdpa, "matmul": _attend_matmul}
_ATTENTION_CHOICES = ("auto", "triton", *_ATTENTION)
