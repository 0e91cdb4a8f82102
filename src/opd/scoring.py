"""Log-probs, top-k, gathers and entropy over the full vocabulary, computed in chunks of positions from the final
hidden states and the output embedding, so that no `[N, V]` float32 tensor for all positions ever exists (SPEC §1).

Notation: `N` positions (already gathered: only the positions that are scored), `D` hidden size, `V` vocabulary rows
used (the shared range, see `vocab_size`), `C` positions per chunk, `K` top-k, `R` requested ids, `J` candidate ids.

The logits follow the Hugging Face heads: `z = softcap(logit_scale · (h Wᵀ + b)) / temperature`, the matmul in the
model's dtype (bf16 on GPU, as `lm_head` does) and everything after it in float32 (float64 when the inputs are
float64, which the tests use). Rows of W at or beyond `vocab_size` are vocabulary padding: they are sliced off
before the matmul, so they are never selected, carry no probability mass and get zero gradient.

Omitted on purpose: no fused/Triton kernel (a plain chunk loop is fast enough next to the model body and runs
everywhere); no per-position temperature; no sparse or quantised heads. Heads other than linear (+ bias) with a
multiplicative scale and tanh soft-capping are not representable; `opd.teacher.local.output_head` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.types import TokenScores

CHUNK_BYTES = 128 << 20
"""Default budget of one chunk's float32 logits `[C, V]`: C = CHUNK_BYTES // (4 V) (220 positions for V = 151936).
Peak extra memory of a chunk is about 2× this (the float32 logits and `exp` of them; a bf16 matmul output adds 0.5×
briefly), ~0.25 GB, whatever N is."""


@dataclass(frozen=True)
class OutputHead:
    """The vocabulary projection of a causal LM: `z = softcap(logit_scale · (h Wᵀ + b))`.

    weight:      [V_model, D] the output embedding (tied or not), in the model's dtype
    bias:        [V_model] or None
    logit_scale: multiplier applied before capping (Cohere `logit_scale`, Granite `1 / logits_scaling`); 1.0 = none
    softcap:     `final_logit_softcapping` (Gemma 2/3): z = c · tanh(z / c); None = none
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None

    def restricted(self, vocab_size: int | None) -> "OutputHead":
        """The same head over the first `vocab_size` rows only (views, no copy); None keeps all rows."""
        v_model = self.weight.shape[0]
        if vocab_size is None or vocab_size == v_model:
            return self
        if not 0 < vocab_size <= v_model:
            raise ValueError(f"vocab_size must be in [1, {v_model}] (the output embedding's rows), got {vocab_size}")
        bias = None if self.bias is None else self.bias[:vocab_size]
        return OutputHead(self.weight[:vocab_size], bias, self.logit_scale, self.softcap)


def _as_head(head: OutputHead | torch.Tensor) -> OutputHead:
    return head if isinstance(head, OutputHead) else OutputHead(head)


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk so that one chunk's float32 logits stay within `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * max(1, vocab_size)))


def _chunk_logits(hidden_CD: torch.Tensor, head: OutputHead, temperature: float) -> torch.Tensor:
    """[C, V] logits at `temperature`, a fresh tensor in the compute dtype (float32, or float64 for float64 inputs)."""
    raw_CV = torch.nn.functional.linear(hidden_CD, head.weight, head.bias)  # model dtype, like lm_head
    compute_dtype = torch.promote_types(raw_CV.dtype, torch.float32)
    # .to() returns raw_CV itself when it is already float32; it is ours, so the in-place ops below are safe.
    z_CV = raw_CV.to(compute_dtype)
    if head.logit_scale != 1.0:
        z_CV.mul_(head.logit_scale)
    if head.softcap is not None:
        z_CV.div_(head.softcap).tanh_().mul_(head.softcap)
    if temperature != 1.0:
        z_CV.div_(temperature)
    return z_CV


def _check_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    # One host sync per call; an out-of-range id would otherwise be a device-side assert (GPU) or a silent padding row.
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name} must lie in [0, {vocab_size}) (the scored vocabulary range), "
            f"got ids in [{int(ids.min())}, {int(ids.max())}]"
        )


def _check_common(hidden_ND: torch.Tensor, head: OutputHead, temperature: float) -> None:
    if hidden_ND.ndim != 2 or hidden_ND.shape[1] != head.weight.shape[1]:
        raise ValueError(f"hidden must be [N, D] with D = {head.weight.shape[1]}, got {tuple(hidden_ND.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


@torch.no_grad()
def score_hidden(
    hidden_ND: torch.Tensor,
    head: OutputHead | torch.Tensor,
    *,
    targets_N: torch.Tensor,
    top_k: int = 0,
    requested_ids_NR: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> TokenScores:
    """Full-vocabulary log-probs at N positions, without gradient, chunk by chunk.

    hidden_ND:        [N, D] final (normed) hidden states, model dtype
    head:             `OutputHead`, or a bare `[V_model, D]` output-embedding weight
    targets_N:        [N] long, the token whose log-prob is wanted (the sampled token)
    top_k:            K ≥ 0; 0 = no top-k
    requested_ids_NR: [N, R] long or None, extra ids whose log-probs are wanted (e.g. the student's top-k)
    vocab_size:       scored range; rows ≥ it are padding (never selected, no mass). None = all rows
    chunk_size:       positions per chunk; None = `default_chunk_size(vocab_size)`

    Returns a `TokenScores` whose tensors are flat, `[N, ...]` instead of `[B, T, ...]`: sampled_logprobs [N],
    topk_ids [N, K] / topk_logprobs [N, K] descending (None when K = 0), entropy [N] (None unless asked),
    requested_logprobs [N, R] (None unless asked); float32 (float64 for float64 inputs). N = 0 gives empty tensors.
    """
    head = _as_head(head).restricted(vocab_size)
    _check_common(hidden_ND, head, temperature)
    n_pos, v_used = hidden_ND.shape[0], head.weight.shape[0]
    if not 0 <= top_k <= v_used:
        raise ValueError(f"top_k must be in [0, {v_used}], got {top_k}")
    _check_ids(targets_N, v_used, "targets_N")
    if requested_ids_NR is not None:
        _check_ids(requested_ids_NR, v_used, "requested_ids_NR")
    chunk = chunk_size or default_chunk_size(v_used)

    dev = hidden_ND.device
    dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
    sampled_N = torch.zeros(n_pos, dtype=dtype, device=dev)
    topk_ids_NK = torch.zeros(n_pos, top_k, dtype=torch.long, device=dev) if top_k else None
    topk_lp_NK = torch.zeros(n_pos, top_k, dtype=dtype, device=dev) if top_k else None
    entropy_N = torch.zeros(n_pos, dtype=dtype, device=dev) if with_entropy else None
    requested_NR = None
    if requested_ids_NR is not None:
        requested_NR = torch.zeros(requested_ids_NR.shape, dtype=dtype, device=dev)

    for s in range(0, n_pos, chunk):
        e = min(s + chunk, n_pos)
        # Shift by the row max in place (x = z - max ≤ 0); log p = x - log S with S = Σ exp(x) ∈ [1, V].
        # Ordered so that at most two [C, V] buffers live at once: x, and exp(x) only when the entropy needs both.
        x_CV = _chunk_logits(hidden_ND[s:e], head, temperature)
        x_CV.sub_(x_CV.amax(dim=-1, keepdim=True))
        sampled_N[s:e] = x_CV.gather(1, targets_N[s:e, None]).squeeze(1)
        if top_k:
            values_CK, ids_CK = x_CV.topk(top_k, dim=-1)  # sorted, descending
            topk_ids_NK[s:e] = ids_CK
            topk_lp_NK[s:e] = values_CK
        if requested_NR is not None:
            requested_NR[s:e] = x_CV.gather(1, requested_ids_NR[s:e])
        if with_entropy:
            # H = log S - Σ exp(x) x / S: two non-negative terms, so no cancellation.
            exp_CV = x_CV.exp()
            sum_C = exp_CV.sum(-1)
            log_sum_C = sum_C.log()
            entropy_N[s:e] = log_sum_C - torch.einsum("cv,cv->c", exp_CV, x_CV) / sum_C
            del exp_CV
        else:
            log_sum_C = x_CV.exp_().sum(-1).log()
        sampled_N[s:e] -= log_sum_C
        if top_k:
            topk_lp_NK[s:e] -= log_sum_C[:, None]
        if requested_NR is not None:
            requested_NR[s:e] -= log_sum_C[:, None]
    return TokenScores(sampled_N, topk_ids_NK, topk_lp_NK, entropy_N, requested_NR)


class _CandidateLogprobs(torch.autograd.Function):
    """log_softmax(z)[ids] (and optionally the entropy) with a backward that recomputes each chunk's logits.

    Memory: forward keeps only `lse` [N] (and H [N]) besides the inputs; backward rebuilds one chunk's `[C, V]`
    logits at a time, so peak extra memory is a few `[C, V]` float32 buffers plus a float32 `[V, D]` accumulator
    for the weight gradient (only when the weight needs one), never `[N, V]`. The price is one extra head matmul
    per chunk (4 instead of 3 for forward + backward), small next to the model body.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward then recomputes under the forward's autocast state
    def forward(ctx, hidden_ND, weight_VD, bias_V, ids_NJ, logit_scale, softcap, temperature, chunk, with_entropy):
        head = OutputHead(weight_VD, bias_V, logit_scale, softcap)
        n_pos = hidden_ND.shape[0]
        dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
        lp_NJ = torch.zeros(ids_NJ.shape, dtype=dtype, device=hidden_ND.device)
        lse_N = torch.zeros(n_pos, dtype=dtype, device=hidden_ND.device)
        entropy_N = torch.zeros(n_pos if with_entropy else 0, dtype=dtype, device=hidden_ND.device)
        for s in range(0, n_pos, chunk):
            e = min(s + chunk, n_pos)
            # as in score_hidden: x = z - max in place, log p = x - log S, H = log S - Σ exp(x) x / S
            x_CV = _chunk_logits(hidden_ND[s:e], head, temperature)
            max_C1 = x_CV.amax(dim=-1, keepdim=True)
            x_CV.sub_(max_C1)
            lp_NJ[s:e] = x_CV.gather(1, ids_NJ[s:e])
            if with_entropy:
                exp_CV = x_CV.exp()
                sum_C1 = exp_CV.sum(-1, keepdim=True)
                entropy_N[s:e] = sum_C1.log().squeeze(1) - torch.einsum("cv,cv->c", exp_CV, x_CV) / sum_C1.squeeze(1)
                del exp_CV
            else:
                sum_C1 = x_CV.exp_().sum(-1, keepdim=True)
            lse_C1 = max_C1 + sum_C1.log()
            lse_N[s:e] = lse_C1.squeeze(1)
            lp_NJ[s:e] -= sum_C1.log()
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, ids_NJ, lse_N, entropy_N)
        ctx.params = (logit_scale, softcap, temperature, chunk, with_entropy)
        ctx.set_materialize_grads(False)  # an unused output's grad arrives as None: skip its term
        return lp_NJ, entropy_N

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_lp_NJ, grad_entropy_N):
        hidden_ND, weight_VD, bias_V, ids_NJ, lse_N, entropy_N = ctx.saved_tensors
        logit_scale, softcap, temperature, chunk, with_entropy = ctx.params
        head = OutputHead(weight_VD, bias_V, logit_scale, softcap)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not with_entropy:
            grad_entropy_N = None
        n_pos = hidden_ND.shape[0]
        grad_h_ND = torch.zeros_like(hidden_ND) if need_h else None
        # float32 accumulators: summing per-chunk bf16 products in bf16 would lose the small chunks' contributions.
        acc_dtype = torch.promote_types(weight_VD.dtype, torch.float32)
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc_dtype, device=weight_VD.device) if need_w else None
        grad_b_V = torch.zeros(weight_VD.shape[0], dtype=acc_dtype, device=weight_VD.device) if need_b else None
        if grad_lp_NJ is None and grad_entropy_N is None:
            return (grad_h_ND, grad_w_VD, grad_b_V) + (None,) * 6

        for s in range(0, n_pos, chunk):
            e = min(s + chunk, n_pos)
            z_CV = _chunk_logits(hidden_ND[s:e], head, temperature)
            if softcap is not None:
                # d(c·tanh(x/c))/dx = 1 - tanh² = 1 - (capped / c)², and capped = z · temperature.
                cap_grad_CV = 1 - (z_CV * (temperature / softcap)) ** 2
            logp_CV = z_CV.sub_(lse_N[s:e, None])
            p_CV = logp_CV.exp()
            # dL/dz = Σ_j g_j (e_{id_j} - p) + g_H · (-p (log p + H))
            #       = p · (-Σ_j g_j - g_H (log p + H)) + scatter(g_j)
            coeff_C1 = torch.zeros_like(lse_N[s:e, None])
            if grad_lp_NJ is not None:
                coeff_C1 = -grad_lp_NJ[s:e].sum(1, keepdim=True).to(coeff_C1.dtype)
            if grad_entropy_N is not None:
                g_h_C1 = grad_entropy_N[s:e, None].to(coeff_C1.dtype)
                g_CV = logp_CV.add_(entropy_N[s:e, None]).mul_(-g_h_C1).add_(coeff_C1).mul_(p_CV)
            else:
                g_CV = p_CV.mul_(coeff_C1)
            if grad_lp_NJ is not None:
                g_CV.scatter_add_(1, ids_NJ[s:e], grad_lp_NJ[s:e].to(g_CV.dtype))
            # back through temperature, soft-cap and scale to the raw head output
            g_CV.mul_(logit_scale / temperature)
            if softcap is not None:
                g_CV.mul_(cap_grad_CV)
            if need_b:
                grad_b_V += g_CV.sum(0)
            g_raw_CV = g_CV.to(weight_VD.dtype)  # the matmul backward runs in the model dtype, as autograd would
            if need_h:
                grad_h_ND[s:e] = g_raw_CV @ weight_VD
            if need_w:
                grad_w_VD += (g_raw_CV.T @ hidden_ND[s:e]).to(acc_dtype)
        if need_w:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        if need_b:
            grad_b_V = grad_b_V.to(bias_V.dtype)
        return grad_h_ND, grad_w_VD, grad_b_V, None, None, None, None, None, None


def _candidate(hidden_ND, head, ids_NJ, temperature, vocab_size, chunk_size, with_entropy):
    head = _as_head(head).restricted(vocab_size)
    _check_common(hidden_ND, head, temperature)
    if ids_NJ.ndim != 2 or ids_NJ.shape[0] != hidden_ND.shape[0]:
        raise ValueError(f"ids must be [N, J] with N = {hidden_ND.shape[0]}, got {tuple(ids_NJ.shape)}")
    _check_ids(ids_NJ, head.weight.shape[0], "ids_NJ")
    chunk = chunk_size or default_chunk_size(head.weight.shape[0])
    return _CandidateLogprobs.apply(
        hidden_ND, head.weight, head.bias, ids_NJ, float(head.logit_scale), head.softcap, float(temperature),
        int(chunk), with_entropy,
    )


def candidate_logprobs(
    hidden_ND: torch.Tensor,
    head: OutputHead | torch.Tensor,
    ids_NJ: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[N, J] full-vocabulary log-probs `log_softmax(z / temperature)[ids]`, differentiable wrt `hidden_ND` and the
    head's weight and bias (for the training loss).

    hidden_ND: [N, D] final hidden states (with grad), ids_NJ: [N, J] long in [0, vocab_size).
    Memory: never keeps `[N, V]` for backward; each chunk's logits are recomputed in backward (see
    `_CandidateLogprobs`). Returns float32 (float64 for float64 inputs); N = 0 gives `[0, J]`.
    """
    lp_NJ, _ = _candidate(hidden_ND, head, ids_NJ, temperature, vocab_size, chunk_size, False)
    return lp_NJ


def candidate_logprobs_and_entropy(
    hidden_ND: torch.Tensor,
    head: OutputHead | torch.Tensor,
    ids_NJ: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`candidate_logprobs` plus the full-vocabulary entropy `[N]` (for an entropy bonus), both differentiable,
    from one pass over the vocabulary per chunk (dH/dz = -p (log p + H))."""
    return _candidate(hidden_ND, head, ids_NJ, temperature, vocab_size, chunk_size, True)
