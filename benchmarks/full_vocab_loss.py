"""The update's head work alone: the exact full-vocabulary divergence (`opd.objectives.full_vocab.full_divergence`,
forward + backward) against the top-16 path's (`opd.scoring.candidate_logprobs_and_entropy` at 17 ids), at the real
pair's shapes (student D = 896, teacher E = 1,536, V = 151,936) under the update's bf16 autocast with float32 master
weights. Where issue 52's step ratio goes: the whole step differs in this alone.

    python benchmarks/full_vocab_loss.py [--positions 65536] [--repeat 3] [--device cuda]

Prints one table: milliseconds per call (median of --repeat after one warm-up call that compiles), and the share of
an ideal GEMM time (the head matmuls' FLOPs at the card's dense bf16 peak, --peak-tflops). Also checks the bf16
gradients against a float64 reference on the first 512 positions (relative max error).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opd.objectives.full_vocab import full_divergence
from opd.scoring import OutputHead, candidate_logprobs_and_entropy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeat: int) -> list[float]:
    fn()  # compiles the chunk functions' buckets
    out = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=65536)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--student-dim", type=int, default=896)
    parser.add_argument("--teacher-dim", type=int, default=1536)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    n, v, d, e = args.positions, args.vocab, args.student_dim, args.teacher_dim
    weight = (torch.randn(v, d, device=device, generator=g) / d**0.5).requires_grad_()
    head = OutputHead(weight)
    t_head = OutputHead(torch.randn(v, e, device=device, generator=g, dtype=torch.bfloat16) / e**0.5)
    hidden = torch.randn(n, d, device=device, generator=g).requires_grad_()
    t_hidden = torch.randn(n, e, device=device, generator=g, dtype=torch.bfloat16)
    ids = torch.randint(v, (n, 17), device=device, generator=g)
    weights_N = torch.rand(n, device=device, generator=g)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def full() -> None:
        with autocast:
            loss = (full_divergence(hidden, head, t_hidden, t_head) * weights_N).sum()
        loss.backward()

    def topk() -> None:
        with autocast:
            lp, ent = candidate_logprobs_and_entropy(hidden, head, ids)
            loss = (lp.sum(-1) * weights_N).sum() + (ent * weights_N).sum()
        loss.backward()

    rows = []
    for name, fn, gemms in (("top-16 (17 ids + entropy)", topk, 3 * d), ("full_reverse_kl", full, 4 * d + 2 * e)):
        times = _time(fn, device, args.repeat)
        hidden.grad = weight.grad = None
        ideal = 2 * n * v * gemms / (args.peak_tflops * 1e12)
        rows.append((name, 1e3 * statistics.median(times), ideal))
    print(f"| {n} positions, V {v}, D {d}, E {e}, {device} | ms / call | ideal GEMM ms | ratio to top-16 |")
    print("| --- | --- | --- | --- |")
    for name, ms, ideal in rows:
        print(f"| {name} | {ms:.1f} | {1e3 * ideal:.1f} | {ms / rows[0][1]:.2f} |")

    m = min(512, n)  # the bf16 gradients against float64 on a slice
    h = hidden.detach()[:m].clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    with autocast:
        ours = full_divergence(h, OutputHead(w), t_hidden[:m], t_head)
    gh, gw = torch.autograd.grad((ours * weights_N[:m]).sum(), [h, w])
    h64 = h.detach().to(torch.bfloat16).double().requires_grad_()
    w64 = w.detach().to(torch.bfloat16).double().requires_grad_()
    s = (h64 @ w64.T).log_softmax(-1)
    t = (t_hidden[:m].double() @ t_head.weight.double().T).log_softmax(-1)
    ref = (s.exp() * (s - t)).sum(-1)
    rh, rw = torch.autograd.grad((ref * weights_N[:m].double()).sum(), [h64, w64])
    errors = {}
    for name, got, want in (("d hidden", gh, rh), ("d weight", gw, rw)):
        errors[name] = float((got.double() - want).abs().max() / want.abs().max())
        print(f"bf16 {name}: max |Δ| / max |ref| = {errors[name]:.2e}")
    errors["value"] = float((ours.detach().double() - ref.detach()).abs().max())
    print(f"value: max |Δ| = {errors['value']:.2e} nats")
    return {"rows": [{"name": name, "ms": ms, "ideal_ms": 1e3 * ideal} for name, ms, ideal in rows], "errors": errors}


if __name__ == "__main__":
    main()
