"""Exact full-vocabulary divergences (opd.objectives.full_vocab) == a dense float64 reference, values and gradients
wrt the student's hidden states, weight and bias: chunk sizes that split the rows, soft-capped, scaled and
temperature-scaled heads, tied and untied embeddings, a teacher with another hidden size and more vocabulary rows.

Tolerances: float64 inputs agree to 1e-10 (only the summation order differs); float32 inputs to 1e-5 relative
(a V-term float32 sum of values near 1)."""

from __future__ import annotations

import math

import pytest
import torch

from opd.objectives.full_vocab import full_chunk_size, full_divergence
from opd.scoring import OutputHead


def dense_log_probs(hidden, head: OutputHead, temperature: float, vocab: int) -> torch.Tensor:
    z = torch.nn.functional.linear(hidden, head.weight[:vocab], None if head.bias is None else head.bias[:vocab])
    z = z * head.logit_scale
    if head.softcap is not None:
        z = head.softcap * torch.tanh(z / head.softcap)
    return torch.log_softmax(z / temperature, dim=-1)


def dense_divergence(s, t, kind: str, beta: float) -> torch.Tensor:
    p, q = s.exp(), t.exp()
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return (p * (s - t)).sum(-1)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return (q * (t - s)).sum(-1)
    m = beta * q + (1 - beta) * p
    return beta * (q * (t - m.log())).sum(-1) + (1 - beta) * (p * (s - m.log())).sum(-1)


def _case(dtype, *, bias, scale, softcap, tied, seed=0, n=13, d=8, e=12, v=37, v_t=40):
    """Student (hidden [n, d], head [v + 3, d]: 3 padding rows past the shared range) and teacher (hidden [n, e],
    head [v_t, e]). Tied: the hidden states are computed from the head's own weight (an input embedding lookup plus
    a leaf), so the weight's gradient arrives by both paths, as in a tied model."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v + 3, d, generator=g, dtype=dtype).requires_grad_(True)
    b = torch.randn(v + 3, generator=g, dtype=dtype).requires_grad_(True) if bias else None
    head = OutputHead(weight, b, scale, softcap)
    t_head = OutputHead(torch.randn(v_t, e, generator=g, dtype=dtype), None, 1.0 / scale, softcap)
    leaf = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_(True)
    ids = torch.randint(v, (n,), generator=g)
    hidden = leaf + 0.5 * weight[ids] if tied else leaf
    t_hidden = torch.randn(n, e, generator=g, dtype=dtype)
    return leaf, hidden, head, t_hidden, t_head


@pytest.mark.parametrize(
    "kind,beta", [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.0), ("jsd", 1.0)]
)
@pytest.mark.parametrize("chunk", [1, 5, None])
@pytest.mark.parametrize(
    "bias,scale,softcap,tied,temps",
    [(False, 1.0, None, True, (1.0, 1.0)), (True, 0.7, 3.0, False, (0.6, 1.7)), (False, 2.0, 2.5, True, (1.3, 0.8))],
)
def test_full_divergence_matches_dense_float64(kind, beta, chunk, bias, scale, softcap, tied, temps):
    leaf, hidden, head, t_hidden, t_head = _case(torch.float64, bias=bias, scale=scale, softcap=softcap, tied=tied)
    tau_s, tau_t = temps
    weights_N = torch.linspace(0.5, 1.5, hidden.shape[0], dtype=torch.float64)  # an upstream gradient per row
    ours = full_divergence(
        hidden,
        head,
        t_hidden,
        t_head,
        kind=kind,
        beta=beta,
        temperature=tau_s,
        teacher_temperature=tau_t,
        vocab_size=37,
        chunk_size=chunk,
    )
    grads = torch.autograd.grad(
        (ours * weights_N).sum(), [leaf, head.weight, *([head.bias] if bias else [])], retain_graph=True
    )
    s = dense_log_probs(hidden, head, tau_s, 37)
    t = dense_log_probs(t_hidden, t_head, tau_t, 37)
    ref = dense_divergence(s, t, kind, beta)
    ref_grads = torch.autograd.grad((ref * weights_N).sum(), [leaf, head.weight, *([head.bias] if bias else [])])
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (ours >= -1e-12).all()  # a divergence
    if not tied:  # padding rows of the student's head: no mass, no gradient
        assert grads[1][37:].abs().max() == 0


def test_full_divergence_float32_close_to_float64():
    _, hidden, head, t_hidden, t_head = _case(torch.float32, bias=True, scale=1.0, softcap=4.0, tied=False)
    ours = full_divergence(hidden, head, t_hidden, t_head, kind="jsd", beta=0.3, chunk_size=4, vocab_size=37)
    ours.sum().backward()
    as64 = OutputHead(head.weight.detach().double().requires_grad_(), head.bias.detach().double(), 1.0, 4.0)
    h64 = hidden.detach().double().requires_grad_()
    s = dense_log_probs(h64, as64, 1.0, 37)
    t = dense_log_probs(t_hidden.double(), OutputHead(t_head.weight.double(), None, 1.0, 4.0), 1.0, 37)
    ref = dense_divergence(s, t, "jsd", 0.3)
    ref.sum().backward()
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), as64.weight.grad, rtol=1e-4, atol=1e-6)


def test_zero_positions_and_equal_models():
    _, hidden, head, _, _ = _case(torch.float64, bias=False, scale=1.0, softcap=None, tied=False)
    same = full_divergence(hidden, head, hidden.detach(), OutputHead(head.weight.detach()), kind="reverse_kl")
    torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-12, rtol=0)
    empty = full_divergence(hidden[:0], head, hidden[:0].detach(), OutputHead(head.weight.detach()))
    assert empty.shape == (0,)


def test_chunk_budget():
    assert full_chunk_size(151_936) == 294
    assert full_chunk_size(151_936) * 151_936 * 4 * 12 <= 2 * (1 << 30)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kind": "kl"}, "kind must be one of"),
        ({"beta": 1.5}, "beta must be in"),
        ({"vocab_size": 41}, "vocab_size must be in"),
        ({"chunk_size": 0}, "chunk_size must be"),
        ({"temperature": 0.0}, "temperatures must be"),
    ],
)
def test_bad_arguments_refused(kwargs, match):
    _, hidden, head, t_hidden, t_head = _case(torch.float64, bias=False, scale=1.0, softcap=None, tied=False)
    with pytest.raises(ValueError, match=match):
        full_divergence(hidden, head, t_hidden, t_head, **kwargs)
    with pytest.raises(ValueError, match="teacher_hidden_NE must be"):
        full_divergence(hidden, head, t_hidden[:, :3], t_head)
    assert math.isfinite(float(full_divergence(hidden, head, t_hidden, t_head).detach().sum()))


def test_bf16_hidden_states_with_float32_weights():
    """The update's autocast gives bf16 hidden states and float32 master weights: the loss and its gradients are
    those of the bf16-rounded hidden states (to float32 rounding), and the hidden states' gradient comes back bf16."""
    _, hidden, head, t_hidden, t_head = _case(torch.float32, bias=False, scale=1.0, softcap=None, tied=False)
    h16 = hidden.detach().to(torch.bfloat16).requires_grad_()
    ours = full_divergence(h16, head, t_hidden.to(torch.bfloat16), t_head, chunk_size=4, vocab_size=37)
    (g16,) = torch.autograd.grad(ours.sum(), [h16])
    h32 = h16.detach().float().requires_grad_()
    ref = full_divergence(h32, head, t_hidden.to(torch.bfloat16).float(), t_head, chunk_size=4, vocab_size=37)
    (g32,) = torch.autograd.grad(ref.sum(), [h32])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert g16.dtype == torch.bfloat16
    torch.testing.assert_close(g16.float(), g32, rtol=1e-2, atol=1e-2)


def test_autocast_gradients_in_bf16_close_to_float64():
    """Under bf16 autocast (float32 master weights, as the update runs) the gradient GEMMs take the chunk's gradient
    in bf16 with float32 accumulation, as opd.scoring's top-k backward does: the weight's and the hidden states'
    gradients stay within bf16 rounding (2^-8 relative, a few of them summed) of a float64 reference taken at the
    same bf16-rounded logits' inputs; the weight's gradient stays float32."""
    leaf, hidden, head, t_hidden, t_head = _case(torch.float32, bias=True, scale=1.0, softcap=None, tied=False, n=64)
    weights_N = torch.linspace(0.5, 1.5, hidden.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = full_divergence(hidden, head, t_hidden, t_head, vocab_size=37, chunk_size=16)
    grads = torch.autograd.grad((ours * weights_N).sum(), [leaf, head.weight, head.bias])
    assert grads[1].dtype == torch.float32
    h64 = leaf.detach().to(torch.bfloat16).double().requires_grad_()
    w64 = head.weight.detach().to(torch.bfloat16).double().requires_grad_()
    b64 = head.bias.detach().to(torch.bfloat16).double().requires_grad_()
    s = dense_log_probs(h64, OutputHead(w64, b64), 1.0, 37)
    t = dense_log_probs(
        t_hidden.to(torch.bfloat16).double(), OutputHead(t_head.weight.to(torch.bfloat16).double()), 1.0, 37
    )
    ref_grads = torch.autograd.grad(
        (dense_divergence(s, t, "reverse_kl", 0.5) * weights_N.double()).sum(), [h64, w64, b64]
    )
    for got, want in zip(grads, ref_grads):
        scale = float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= 3e-2 * scale, (got, want)


BUDGET_MIB = 128


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.slow
def test_peak_memory_within_the_chunk_budget(monkeypatch):
    """Forward + backward of 256 positions at V = 151,936 (float32, CPU, 8 chunks): the peak resident growth stays
    within twice the chunk budget plus the weight's gradient, a bound that does not grow with N (at N = 1,024 one
    `[N, V]` float32 tensor alone is 593 MiB, the two models' 1,187 MiB). Measured as tests/test_scoring.py's
    `rss_peak` does (VmHWM reset, glibc's mmap threshold pinned so that freed chunk buffers are returned)."""
    import ctypes

    import opd.objectives.full_vocab as full_vocab

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        pinned = ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    except (OSError, AttributeError):
        pinned = 0
    if not pinned:
        pytest.skip("needs Linux /proc/self/clear_refs and glibc's mallopt")
    monkeypatch.setattr(full_vocab, "CHUNK_BYTES", BUDGET_MIB << 20)
    V, N, D, E = 151936, 256, 64, 48
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    t_head = OutputHead(torch.randn(V, E, generator=g) * 0.3, None, 1.0, 30.0)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    t_hidden = torch.randn(N, E, generator=g)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before_kib = _rss_kib("VmRSS")
    loss = full_divergence(hidden, OutputHead(weight), t_hidden, t_head, kind="jsd", beta=0.5)
    loss.sum().backward()
    growth_mib = (_rss_kib("VmHWM") - before_kib) / 1024
    assert torch.isfinite(weight.grad).all() and torch.isfinite(hidden.grad).all()
    grad_w_mib = V * D * 4 / 2**20  # 37 MiB
    print(f"\npeak RSS growth, full JSD forward + backward of {N} positions, V={V}: {growth_mib:.0f} MiB")
    assert growth_mib < 2 * BUDGET_MIB + grad_w_mib + 40


@pytest.mark.parametrize("kind,beta,softcap", [("reverse_kl", 0.5, None), ("jsd", 0.3, 4.0)])
def test_the_compiled_chunks_equal_the_dense_reference(monkeypatch, kind, beta, softcap):
    """The CUDA path on the CPU: each chunk's functions through dynamo (aot_eager: the graphs inductor would get),
    the last chunk's rows padded to their bucket; float32 against float64, the tolerance of the eager float32 test."""
    from opd import scoring
    from opd.objectives import full_vocab

    monkeypatch.setattr(scoring, "_COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(scoring, "_COMPILED", {})
    monkeypatch.setattr(scoring, "_MET", {})
    monkeypatch.setattr(scoring, "_MIN_BUCKET", 4)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, **{**kwargs, "backend": "aot_eager"}))
    _, hidden, head, t_hidden, t_head = _case(torch.float32, bias=True, scale=1.0, softcap=softcap, tied=False)
    ours = full_divergence(hidden, head, t_hidden, t_head, kind=kind, beta=beta, chunk_size=8, vocab_size=37)
    ours.sum().backward()
    met = {(fn.__name__, rows) for (fn, _, _), counts in scoring._MET.items() for rows in counts}
    assert met == {("_value_chunk", 8), ("_grad_chunk", 8)}  # 13 rows: a chunk of 8, then 5 padded to 8
    assert all(scoring._COMPILED[f] is not None for f in (full_vocab._value_chunk, full_vocab._grad_chunk))
    as64 = OutputHead(head.weight.detach().double().requires_grad_(), head.bias.detach().double(), 1.0, softcap)
    h64 = hidden.detach().double().requires_grad_()
    s = dense_log_probs(h64, as64, 1.0, 37)
    t = dense_log_probs(t_hidden.double(), OutputHead(t_head.weight.double(), None, 1.0, softcap), 1.0, 37)
    ref = dense_divergence(s, t, kind, beta)
    ref.sum().backward()
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), as64.weight.grad, rtol=1e-4, atol=1e-6)
