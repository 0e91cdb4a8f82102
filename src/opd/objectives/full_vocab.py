"""Exact full-vocabulary divergences between the student and the teacher (SPEC §4, "Full-vocabulary objectives"),
computed chunk by chunk from the two models' final hidden states and output heads: no `[N, V]` tensor for all
positions ever exists, forward or backward (the `opd.scoring.CHUNK_BYTES` budget holds for a chunk's buffers).

Notation: `N` positions, `D` / `E` the student's / teacher's hidden size, `V` the shared vocabulary range, `C`
positions per chunk; p = softmax(z_S), q = softmax(z_T), s = log p, t = log q, logits as the heads compute them
(`opd.scoring.head_transform`: `softcap(scale · (h Wᵀ + b)) / τ`, matmul in the model's dtype, the rest in float32).

    reverse_kl   KL(p ‖ q) = Σ p (s − t)                     dL/dz_S = p ⊙ (s − t − KL)
    forward_kl   KL(q ‖ p) = Σ q (t − s)                     dL/dz_S = p − q
    jsd (β)      β KL(q ‖ m) + (1−β) KL(p ‖ m), m = βq+(1−β)p  dL/dz_S = p ⊙ (a − Σ p a), a = (1−β)(s − log m)
                 (β = 0 is forward_kl, β = 1 reverse_kl, as `opd.objectives.losses.jsd` and trl)

then times dz/draw = scale / τ_S · (1 − tanh²) (soft-capping). The teacher is a constant: no gradient reaches it.
Forward keeps nothing but the inputs; backward recomputes each chunk's two logit blocks (one more head matmul per
chunk and model, the price of never holding `[N, V]`).

On CUDA each chunk's two head matmuls run in the model dtype and everything after them (the transforms, both
log-softmaxes, the divergence and its gradient) in one compiled function per direction (`_value_chunk`,
`_grad_chunk`, through `opd.scoring.run_chunk`: the same row buckets and warm-up as the top-k path), so the
`[C, V]` float32 temporaries are fused instead of written and read back; elsewhere (CPU, float64) the same
functions run eagerly.
"""

from __future__ import annotations

import math
from typing import Literal, cast

import torch

from opd.scoring import CHUNK_BYTES, OutputHead, add_outer, head_transform, run_chunk

Divergence = Literal["reverse_kl", "forward_kl", "jsd"]
DIVERGENCES: tuple[str, ...] = ("reverse_kl", "forward_kl", "jsd")

_TEMPS = 12  # float32 [C, V] buffers a chunk may hold at once: ~9 measured in backward (both raw and transformed
# logits, s, t, p, q or m, a, g), plus margin (tests/objectives/test_full_vocab.py's peak-memory test)


def full_chunk_size(vocab_size: int, compute_dtype: torch.dtype = torch.float32) -> int:
    """Positions per chunk so that a chunk's `_TEMPS` compute-dtype `[C, V]` buffers stay within 2 × `CHUNK_BYTES`,
    the peak `opd.scoring` allows a chunk (294 positions for V = 151,936 in float32)."""
    return max(1, 2 * CHUNK_BYTES // (_TEMPS * compute_dtype.itemsize * max(1, vocab_size)))


def _chunk_value_and_grad(s_CV, t_CV, kind: str, beta: float, want_grad: bool):
    """(divergence [C], dL/dz_S [C, V] or None) from the two log-prob blocks."""
    p_CV = s_CV.exp()
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    if kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "reverse_kl":
        a_CV = s_CV - t_CV
        value_C = (p_CV * a_CV).sum(-1)
        grad = p_CV * (a_CV - value_C[:, None]) if want_grad else None
    elif kind == "forward_kl":
        q_CV = t_CV.exp()
        value_C = (q_CV * (t_CV - s_CV)).sum(-1)
        grad = p_CV - q_CV if want_grad else None
    else:
        log_m_CV = torch.logaddexp(t_CV + math.log(beta), s_CV + math.log1p(-beta))
        q_CV = t_CV.exp()
        value_C = beta * (q_CV * (t_CV - log_m_CV)).sum(-1) + (1 - beta) * (p_CV * (s_CV - log_m_CV)).sum(-1)
        grad = None
        if want_grad:
            a_CV = (1 - beta) * (s_CV - log_m_CV)
            grad = p_CV * (a_CV - (p_CV * a_CV).sum(-1, keepdim=True))
    return value_C, grad


def _raw(hidden_CD: torch.Tensor, head: OutputHead) -> torch.Tensor:
    """The head's raw logits [C, V] of one chunk, in the matmul's dtype (the model's, or autocast's)."""
    if hidden_CD.dtype != head.weight.dtype and not torch.is_autocast_enabled(hidden_CD.device.type):
        hidden_CD = hidden_CD.to(head.weight.dtype)  # e.g. bf16 hidden states of an autocast forward, fp32 weights
    return torch.nn.functional.linear(hidden_CD, head.weight, head.bias)


def _value_chunk(raw_s_CV, raw_t_CV, scale_s, softcap_s, tau_s, scale_t, softcap_t, tau_t, kind, beta):
    """[C] divergence of one chunk from the two heads' raw logits (pure, row-wise: compiled on CUDA)."""
    s_CV = torch.log_softmax(head_transform(raw_s_CV, scale_s, softcap_s, tau_s), dim=-1)
    t_CV = torch.log_softmax(head_transform(raw_t_CV, scale_t, softcap_t, tau_t), dim=-1).to(s_CV.dtype)
    return _chunk_value_and_grad(s_CV, t_CV, kind, beta, False)[0]


def _grad_chunk(raw_s_CV, raw_t_CV, grad_C, scale_s, softcap_s, tau_s, scale_t, softcap_t, tau_t, kind, beta):
    """dL/draw_S [C, V] of one chunk times the incoming `grad_C`, computed in the compute dtype and returned in the raw
    logits' (the head matmul's: bf16 under autocast, so that the two gradient GEMMs run on bf16 tensor cores, as
    `opd.scoring`'s top-k backward does) (pure, row-wise)."""
    z_CV = head_transform(raw_s_CV, scale_s, softcap_s, tau_s)
    s_CV = torch.log_softmax(z_CV, dim=-1)
    t_CV = torch.log_softmax(head_transform(raw_t_CV, scale_t, softcap_t, tau_t), dim=-1).to(s_CV.dtype)
    g_CV = cast(torch.Tensor, _chunk_value_and_grad(s_CV, t_CV, kind, beta, True)[1])
    chain: torch.Tensor | float = scale_s / tau_s
    if softcap_s is not None:  # d(c·tanh(x/c))/dx = 1 − tanh², tanh = capped / c, capped = z · τ
        chain = (1 - (z_CV * (tau_s / softcap_s)) ** 2) * chain
    return (g_CV * chain * grad_C[:, None].to(g_CV.dtype)).to(raw_s_CV.dtype)


def _consts(params: dict, teacher_head: OutputHead) -> tuple:
    return (
        params["scale"], params["softcap"], params["tau_s"], float(teacher_head.logit_scale), teacher_head.softcap,
        params["tau_t"], params["kind"], params["beta"],
    )  # fmt: skip


class _FullDivergence(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward then recomputes under the forward's autocast state
    def forward(ctx, hidden_ND, weight_VD, bias_V, teacher_hidden_NE, teacher_head, params):
        student_head = OutputHead(weight_VD, bias_V, params["scale"], params["softcap"])
        n_pos, chunk = hidden_ND.shape[0], params["chunk"]
        dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
        out_N = torch.zeros(n_pos, dtype=dtype, device=hidden_ND.device)
        consts = _consts(params, teacher_head)
        for a in range(0, n_pos, chunk):
            b = min(a + chunk, n_pos)
            rows = (_raw(hidden_ND[a:b], student_head), _raw(teacher_hidden_NE[a:b], teacher_head))
            out_N[a:b] = run_chunk(_value_chunk, rows, consts, chunk=chunk)
            del rows
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, teacher_hidden_NE)
        ctx.teacher_head, ctx.params = teacher_head, params
        return out_N

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_N):
        hidden_ND, weight_VD, bias_V, teacher_hidden_NE = ctx.saved_tensors
        params, teacher_head = ctx.params, ctx.teacher_head
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        student_head = OutputHead(weight_VD, bias_V, params["scale"], params["softcap"])
        acc_dtype = torch.promote_types(weight_VD.dtype, torch.float32)
        grad_h_ND = torch.zeros_like(hidden_ND) if need_h else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc_dtype, device=weight_VD.device) if need_w else None
        grad_b_V = torch.zeros(weight_VD.shape[0], dtype=acc_dtype, device=weight_VD.device) if need_b else None
        n_pos, chunk = hidden_ND.shape[0], params["chunk"]
        consts = _consts(params, teacher_head)
        # The gradient GEMMs run in the raw logits' dtype (the model's, or autocast's: W and h cast once here, as
        # autocast would per call) with autocast off, accumulating in float32: a float32 GEMM of [V, C] × [C, D] per
        # chunk and model was most of this backward's time on an H100.
        mm_dtype = None
        for a in range(0, n_pos, chunk):
            b = min(a + chunk, n_pos)
            rows = (_raw(hidden_ND[a:b], student_head), _raw(teacher_hidden_NE[a:b], teacher_head), grad_N[a:b])
            g_CV = run_chunk(_grad_chunk, rows, consts, chunk=chunk)  # dL/draw, in the raw logits' dtype
            del rows
            if mm_dtype is None:
                mm_dtype = g_CV.dtype
                weight_mm, hidden_mm = weight_VD.to(mm_dtype), hidden_ND.to(mm_dtype)
            with torch.autocast(device_type=hidden_ND.device.type, enabled=False):
                if grad_h_ND is not None:
                    grad_h_ND[a:b] = (g_CV @ weight_mm).to(hidden_ND.dtype)
                if grad_w_VD is not None:
                    add_outer(grad_w_VD, g_CV, hidden_mm[a:b], slice_of_chunk=False)
                if grad_b_V is not None:
                    grad_b_V += g_CV.sum(0, dtype=acc_dtype)
            del g_CV
        if grad_w_VD is not None:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        if grad_b_V is not None:
            grad_b_V = grad_b_V.to(bias_V.dtype)
        return grad_h_ND, grad_w_VD, grad_b_V, None, None, None


def full_divergence(
    hidden_ND: torch.Tensor,
    head: OutputHead,
    teacher_hidden_NE: torch.Tensor,
    teacher_head: OutputHead,
    *,
    kind: Divergence = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[N] exact divergence of the student from the teacher over the whole shared vocabulary, per position,
    differentiable wrt the student's `hidden_ND` and its head's weight and bias (the teacher's are constants).

    hidden_ND:         [N, D] the student's final (normed) hidden states, with grad
    head:              the student's `OutputHead` ([V_S, D]; tied or untied embedding alike)
    teacher_hidden_NE: [N, E] the teacher's final hidden states at the same positions (no grad)
    teacher_head:      the teacher's `OutputHead` ([V_T, E])
    kind, beta:        see the module docstring; beta only for jsd, in [0, 1]
    temperature:       τ_S of the student's logits; teacher_temperature τ_T of the teacher's
    vocab_size:        the shared range V ≤ min(V_S, V_T); rows beyond are padding (no mass, zero gradient).
                       None: min(V_S, V_T)
    chunk_size:        positions per chunk; None = `full_chunk_size(V)`
    Returns float32 (float64 for float64 inputs); N = 0 gives an empty tensor.
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"kind must be one of {list(DIVERGENCES)}, got {kind!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not (temperature > 0 and teacher_temperature > 0):
        raise ValueError(f"temperatures must be > 0, got {temperature} and {teacher_temperature}")
    v_s, v_t = head.weight.shape[0], teacher_head.weight.shape[0]
    v_used = min(v_s, v_t) if vocab_size is None else vocab_size
    if not 0 < v_used <= min(v_s, v_t):
        raise ValueError(f"vocab_size must be in [1, {min(v_s, v_t)}] (both heads' rows), got {vocab_size}")
    n_pos = hidden_ND.shape[0]
    if hidden_ND.ndim != 2 or hidden_ND.shape[1] != head.weight.shape[1]:
        raise ValueError(f"hidden_ND must be [N, D] with D = {head.weight.shape[1]}, got {tuple(hidden_ND.shape)}")
    if teacher_hidden_NE.shape != (n_pos, teacher_head.weight.shape[1]):
        raise ValueError(
            f"teacher_hidden_NE must be [N, E] = [{n_pos}, {teacher_head.weight.shape[1]}], "
            f"got {tuple(teacher_hidden_NE.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    student = head.restricted(v_used)
    teacher = teacher_head.restricted(v_used)
    teacher = OutputHead(
        teacher.weight.detach(),
        None if teacher.bias is None else teacher.bias.detach(),
        teacher.logit_scale,
        teacher.softcap,
    )
    compute = torch.promote_types(hidden_ND.dtype, torch.float32)
    params = {
        "scale": float(student.logit_scale),
        "softcap": student.softcap,
        "tau_s": float(temperature),
        "tau_t": float(teacher_temperature),
        "kind": kind,
        "beta": float(beta),
        "chunk": int(chunk_size or full_chunk_size(v_used, compute)),
    }
    return _FullDivergence.apply(
        hidden_ND,
        student.weight,
        student.bias,
        teacher_hidden_NE.detach().to(teacher.weight.device, teacher.weight.dtype),
        teacher,
        params,
    )
