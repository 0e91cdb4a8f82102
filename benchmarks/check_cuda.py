"""Correctness of the CUDA-only fast paths against the simple ones, run on a GPU (the CPU test suite cannot reach
them: CUDA graphs, `torch.compile` on CUDA, bf16 tensor-core matmuls).

    python benchmarks/check_cuda.py            # prints a table, exits 1 if any check fails, writes --out JSON

Checks (float32 with TF32 off unless the row says bf16; tolerances in the table):
- static_greedy[*]:   `StaticGenerator` (graphs + compile, each attention / weight layout) greedy tokens equal
                      `TorchGenerator`'s, reported log-probs equal a teacher-forced forward's, with 10 rows for 24
                      samples of per-sample lengths 1–150 (continuous batching: freed slots refilled), one CUDA graph
                      for the whole call on the Triton path
- decode_attention:   the Triton split-KV decode kernel (bf16, Qwen3 head shapes, per-row start and end slots, 1–16
                      splits, inside a CUDA graph as the decode step runs it) against a float64 reference
- static_packed:      `StaticGenerator` prefilling packed (a model set to opd_varlen): float32 greedy tokens equal
                      `TorchGenerator`'s and log-probs a teacher-forced forward's (per-row attention); under bf16
                      autocast (FlashAttention varlen prefill) packed against padded prefills as static_autocast
                      compares its two steps, and both against a teacher-forced forward
- gpu_busy:           `opd.report.gpu_busy.GpuBusy` (NVML's utilization samples, the trainer's `gpu/busy_frac`):
                      over 2 s of back-to-back matmuls ≥ 0.9, over 2 s of host sleep ≤ 0.1
- static_memory:      with a ballast tensor leaving the safety margin, one call's fixed cost and 32 rows free,
                      `StaticGenerator` sizes its rows from the free memory
                      (fewer than max_batch_size) and the call's peak allocation stays inside what was free
- full_vocab_topk:    `score_hidden`'s two-stage top-k (compiled) at Qwen3's vocabulary (151,669 of 151,936 rows,
                      float32, 3 chunks, scale ±1) against a float64 topk: same log-probs, ids that hold them
- static_sampling:    token frequencies of 16,384 samples at the first two steps match the model's exact distribution
                      (total variation within sampling noise)
- static_autocast:    float32 master weights generated under bf16 autocast (as in training): the fused step (float32
                      residual, bf16 GEMM weights cast once) gives the unfused autocast step's tokens and log-probs
                      within bf16 rounding, and both match a teacher-forced forward under autocast
- score_hidden[*]:    chunked log-probs / top-k / requested ids / entropy (compiled per-chunk reductions) against a
                      dense float64 reference from the same logits
- candidate_grads:    `candidate_logprobs_and_entropy` values and gradients (hidden, weight) against float64 autograd
- compiled_layers:    `compile_layers` forward equals the eager forward; with gradient checkpointing the gradients too
- packed_flex:        rows packed into one sequence (`packing="packed"`, flex attention, ragged lengths) give the
                      padded sdpa batch's scores and gradients
- packed_varlen:      `opd.kernels.varlen_attention` (FlashAttention varlen, bf16, Qwen3 head shapes, ragged rows)
                      against float64 block-diagonal attention, values and gradients; then a model set to opd_varlen
                      with compiled layers under bf16 autocast (as the trainer runs it) against the padded sdpa batch
- families[*]:        per model family of benchmarks/families.py (README "Model families") whose attention packing
                      can compute: `LocalScorer` scores (sampled / top-k log-probs, entropy) of ragged rows packed
                      (opd_varlen, sliding windows binding) against the padded sdpa batch, bf16 autocast, ≤ 5e-2;
                      families packing refuses (soft-capping, sinks) print SKIP with the reason
- families_static[*]: per family the static engine accepts (compiled step, CUDA graphs), fp32 greedy against
                      `TorchGenerator`: rows differing 0, log-probs ≤ 1e-4; the others print SKIP with the reason
- static_windows[*]:  sliding windows that bind (Mistral, Qwen2's per layer, Phi-3 with partial rotary, Gemma 2
                      with a binding soft-cap, Gemma 3) through the Triton kernel and SDPA (matmul for Gemma 2),
                      with refills, graphs and live-row buckets: as families_static
- families_distill[*]: per family a 2-step `opd distill` on CUDA (student and teacher of the family, tests/helpers.py's
                      tiny tokenizer, prompts of different lengths, rows ending at different lengths) with its
                      defaults except compile=false unless --compile-layers (then its warm-up compiles per family):
                      both steps logged, loss and gradient norm finite (its startup lines name the attention and
                      rollout engine chosen)
- deterministic:      opt-in (`--only deterministic`): `run.deterministic` through the CLI, a run against 2 steps +
                      its resume, bit for bit (learning metrics of every step, final weights); the same run without
                      it beside; then deterministic_sampling
- deterministic_sampling: opt-in: eager cumsum and the compiled top-p filter (real vocabulary) repeated in
                      deterministic mode (~1 min)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model

ROWS: list[dict] = []
COMPILE_LAYERS = False  # families_distill's `compile` (--compile-layers: the default on CUDA, a compile per family)


def check(name: str, value: float, tol: float, note: str = "") -> None:
    ROWS.append({"check": name, "value": value, "tol": tol, "ok": bool(value <= tol), "note": note})
    print(f"{'PASS' if value <= tol else 'FAIL'}  {name}: {value:.3g} (≤ {tol:g}) {note}", flush=True)


def guarded(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception as error:
            traceback.print_exc()
            ROWS.append({"check": fn.__name__, "ok": False, "error": f"{type(error).__name__}: {error}"[:300]})
            print(f"FAIL  {fn.__name__}: {type(error).__name__}: {error}", flush=True)

    return run


def tiny(dtype=torch.float32, seed=0):
    return build_model("tiny", dtype=dtype, device=torch.device("cuda"), seed=seed)


def teacher_forced(model, prompts, output, reduce="max"):
    from opd.rollout.batch import build_rollouts
    from opd.teacher.local import LocalScorer

    rollouts = build_rollouts(prompts, output, pad_id=1, device=torch.device("cuda"))
    scores = LocalScorer(model, check_head=False, vocab_size=500).score(rollouts, top_k=0, with_entropy=False)
    diff = (scores.sampled_logprobs - rollouts.rollout_logprobs).abs()[rollouts.response_mask]
    return float(diff.max() if reduce == "max" else diff.mean())


@guarded
def static_greedy():
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    model = tiny()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (12,), generator=g)]
    caps = torch.randint(1, 151, (24,), generator=g).tolist()  # rows end at different steps: slots are refilled
    common = dict(eos_token_ids=[2], pad_token_id=1, vocab_size=500)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=150, stop_at_eos=True, return_logprobs=True, seed=0)
    reference = TorchGenerator(model, max_batch_size=24, **common).generate(
        prompts, params, max_new_tokens_per_sample=caps
    )
    for options in (
        dict(),
        dict(attention="sdpa"),
        dict(attention="matmul"),
        dict(fuse_weights=False),
        dict(compile=False),
        dict(attention_splits=1),
        dict(attention_splits=16),
    ):
        label = ",".join(f"{k}={v}" for k, v in options.items()) or "default"
        engine = StaticGenerator(
            model, cuda_graphs=True, max_batch_size=10, sync_interval=8, row_buckets=True, **common, **options
        )
        output = engine.generate(prompts, params, max_new_tokens_per_sample=caps)
        mismatched = sum(a != b for a, b in zip(output.response_ids, reference.response_ids))
        check(
            f"static_greedy[{label}] rows differing from TorchGenerator",
            mismatched,
            0,
            f"({engine.stats['refills']} refills)",
        )
        check(f"static_greedy[{label}] max |log-prob - teacher-forced|", teacher_forced(model, prompts, output), 1e-4)
        if not options or options == dict(compile=False):
            # one graph per live-row bucket the call ran (the Triton kernel reads every row's slots: one span)
            buckets = len(engine.stats["bucket_steps"])
            check(f"static_greedy[{label}] CUDA graphs - live-row buckets", engine.stats["graphs"] - buckets, 0)


@guarded
def static_rows_and_stop():
    """The compiled engine's row ladder (`round_rows`, on by default on CUDA) and stop rule (`stop_when`, the partial
    stream's early stop), fp32 greedy: calls of 1..40 samples give TorchGenerator's outputs with rounded rows and
    meet only the ladder's row counts; a call ended by a stop rule returns prefixes of the uncut call's outputs."""
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    model = tiny()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (40,), generator=g)]
    caps = torch.randint(1, 65, (40,), generator=g).tolist()
    common = dict(eos_token_ids=[2], pad_token_id=1, vocab_size=500)
    params = SamplingParams(temperature=0.0, max_new_tokens=64, stop_at_eos=True, return_logprobs=True, seed=0)
    engine = StaticGenerator(model, cuda_graphs=True, max_batch_size=64, sync_interval=8, **common)
    reference = TorchGenerator(model, max_batch_size=40, **common)
    differing, rows = 0, set()
    for count in (1, 3, 5, 9, 17, 23, 33, 40):
        want = reference.generate(prompts[:count], params, max_new_tokens_per_sample=caps[:count])
        got = engine.generate(prompts[:count], params, max_new_tokens_per_sample=caps[:count])
        differing += sum(a != b for a, b in zip(got.response_ids, want.response_ids))
        rows.add(engine.stats["rows"])
    check("static_rows_and_stop rows differing from TorchGenerator (round_rows)", differing, 0)
    check(
        "static_rows_and_stop row counts off the ladder", len(rows - {1, 4, 8, 16, 32, 48}), 0, f"(rows {sorted(rows)})"
    )
    full = engine.generate(prompts, params, max_new_tokens_per_sample=caps)
    cut = engine.generate(
        prompts, params, max_new_tokens_per_sample=caps, stop_when=lambda f: sum(r is not None for r in f) >= 10
    )
    not_prefix = sum(a != b[: len(a)] for a, b in zip(cut.response_ids, full.response_ids))
    check(
        "static_rows_and_stop cut rows not a prefix of the uncut call's", not_prefix, 0, f"({engine.stats['cut']} cut)"
    )
    check("static_rows_and_stop cut samples", float(engine.stats["cut"] == 0), 0)


@guarded
def decode_attention():
    from opd.kernels.decode_attention import decode_attention as attend
    from opd.rollout.static_engine import _attend_matmul

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, kv_heads, groups, capacity in ((64, 8, 2, 640), (5, 8, 4, 1300), (256, 8, 2, 200)):
        q = torch.randn(rows, kv_heads, groups, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        keys, values = (
            torch.randn(rows, kv_heads, capacity, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)
        )
        start = torch.randint(0, capacity // 3, (rows,), device="cuda", generator=g)
        worst = 0.0
        # every row ends at the same slot, then (continuous batching) at its own slot anywhere after its start
        ragged = start + (torch.rand(rows, device="cuda", generator=g) * (capacity - start)).long()
        for last_R in (torch.full((rows,), capacity // 3, device="cuda"), ragged.clamp(max=capacity - 1)):
            slots = torch.arange(capacity, device="cuda")
            valid = (slots[None] >= start[:, None]) & (slots[None] <= last_R[:, None])
            bias = torch.zeros(rows, capacity, device="cuda", dtype=torch.float64).masked_fill(~valid, float("-inf"))
            want = _attend_matmul(
                q.double(),
                keys.double(),
                values.double(),
                bias[:, None, None].expand(rows, kv_heads, groups, capacity),
                0.088,
            )
            for splits in (None, 1, 2, 4, 16):
                attend(q, keys, values, start, last_R, 0.088, splits=splits)  # compile outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    got = attend(q, keys, values, start, last_R, 0.088, splits=splits)
                graph.replay()
                torch.cuda.synchronize()
                worst = max(worst, float((got.double() - want).abs().max()))
        check(
            f"decode_attention[{rows}x{kv_heads}x{groups}, {capacity} slots] max |Δ| vs float64",
            worst,
            2e-2,
            "(bf16 output rounding)",
        )


@guarded
def full_vocab_topk():
    from opd.scoring import OutputHead, score_hidden

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4000, 256, device="cuda", generator=g)  # float32, TF32 off: the reference's logits agree
    weight = torch.randn(151936, 256, device="cuda", generator=g) / 16
    for scale in (1.0, -1.0):  # -1: z decreasing in the raw logits, the top-k takes the smallest
        got = score_hidden(
            hidden,
            OutputHead(weight, None, scale),
            targets_N=torch.zeros_like(hidden[:, 0]).long(),
            top_k=16,
            vocab_size=151669,
        )
        lp = ((hidden.double() @ weight[:151669].double().T) * scale).log_softmax(-1)
        check(
            f"full_vocab_topk[scale={scale}] max |top-k log-prob Δ| vs float64 topk",
            float((got.topk_logprobs.double() - lp.topk(16, dim=-1).values).abs().max()),
            1e-4,
        )
        check(
            f"full_vocab_topk[scale={scale}] max |log-prob at our ids - ours|",
            float((lp.gather(1, got.topk_ids) - got.topk_logprobs.double()).abs().max()),
            1e-4,
        )


@guarded
def static_sampling():
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator

    model = build_model("tiny", dtype=torch.float32, device=torch.device("cuda"), seed=3)
    with torch.no_grad():  # a peaked but not degenerate distribution over 500 tokens
        model.lm_head.weight.mul_(20.0)
    prompt = [5, 6, 7]
    rows = 16384
    engine = StaticGenerator(model, eos_token_ids=[2], pad_token_id=1, vocab_size=500, max_batch_size=rows)
    out = engine.generate(
        [prompt], SamplingParams(n=rows, temperature=1.0, max_new_tokens=2, stop_at_eos=False, seed=1)
    )
    first = torch.tensor([r[0] for r in out.response_ids])
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1, :500].double()
        probs = logits.softmax(-1).cpu()
    freq = torch.bincount(first, minlength=500).double() / rows
    tv = 0.5 * float((freq - probs).abs().sum())
    # expected TV of an exact sampler ≈ Σ sqrt(p (1-p) / (2π rows)); allow 3× that
    noise = float((probs * (1 - probs) / (2 * torch.pi * rows)).sqrt().sum())
    check("static_sampling TV(first-token freq, exact)", tv, 3 * noise, f"(noise level {noise:.3g})")
    # second token: condition on the most frequent first token
    top = int(freq.argmax())
    second = torch.tensor([r[1] for r in out.response_ids if r[0] == top])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [top]], device="cuda")).logits[0, -1, :500].double()
        probs2 = logits.softmax(-1).cpu()
    freq2 = torch.bincount(second, minlength=500).double() / len(second)
    noise2 = float((probs2 * (1 - probs2) / (2 * torch.pi * len(second))).sqrt().sum())
    check(
        "static_sampling TV(second-token freq | top first)",
        0.5 * float((freq2 - probs2).abs().sum()),
        3 * noise2,
        f"({len(second)} samples)",
    )


@guarded
def static_autocast():
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator

    master = tiny(torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (20,), generator=g).tolist() for _ in range(8)]
    common = dict(eos_token_ids=[2], pad_token_id=1, vocab_size=500, max_batch_size=8)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40, stop_at_eos=False, return_logprobs=True, seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = StaticGenerator(master, **common).generate(prompts, params)
        unfused = StaticGenerator(master, fuse_weights=False, **common).generate(prompts, params)
        forced = teacher_forced(master, prompts, fused, reduce="mean")
    same = sum(x == y for x, y in zip(fused.response_ids, unfused.response_ids)) / len(prompts)
    check(
        "static_autocast greedy rows equal (fused vs unfused step under autocast), 1 - rate",
        1 - same,
        0.25,
        "(compiled bf16 kernels round differently)",
    )
    err = max(abs(x[0] - y[0]) for x, y in zip(fused.logprobs, unfused.logprobs))
    check("static_autocast first-token log-prob |Δ| (fused vs unfused)", err, 1e-2)
    check("static_autocast mean |log-prob - teacher-forced under autocast|", forced, 1e-2)


@guarded
def static_packed():
    from opd.kernels import varlen_attention
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    model = tiny(torch.float32)
    model.set_attn_implementation(varlen_attention.register())
    g = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 300, (12,), generator=g)
    ]
    caps = torch.randint(1, 101, (24,), generator=g).tolist()
    common = dict(eos_token_ids=[2], pad_token_id=1, vocab_size=500)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=100, stop_at_eos=True, return_logprobs=True, seed=0)
    reference = TorchGenerator(model, max_batch_size=24, **common).generate(
        prompts, params, max_new_tokens_per_sample=caps
    )
    engine = StaticGenerator(model, max_batch_size=10, sync_interval=8, prefill_tokens=512, **common)
    output = engine.generate(prompts, params, max_new_tokens_per_sample=caps)
    mismatched = sum(a != b for a, b in zip(output.response_ids, reference.response_ids))
    check(
        "static_packed rows differing from TorchGenerator (float32)", mismatched, 0, f"(packed {engine.packed_prefill})"
    )
    check("static_packed max |log-prob - teacher-forced| (float32)", teacher_forced(model, prompts, output), 1e-4)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40, stop_at_eos=False, return_logprobs=True, seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outputs = {
            packed: StaticGenerator(model, max_batch_size=12, packed_prefill=packed, **common).generate(prompts, params)
            for packed in (True, False)
        }
        forced = max(teacher_forced(model, prompts, outputs[packed], reduce="mean") for packed in (True, False))
    same = sum(x == y for x, y in zip(outputs[True].response_ids, outputs[False].response_ids)) / len(prompts)
    check("static_packed greedy rows equal (packed vs padded under autocast), 1 - rate", 1 - same, 0.25)
    err = max(abs(x[0] - y[0]) for x, y in zip(outputs[True].logprobs, outputs[False].logprobs))
    check("static_packed first-token log-prob |Δ| (packed vs padded under autocast)", err, 1e-2)
    check("static_packed mean |log-prob - teacher-forced under autocast| (worse of the two)", forced, 1e-2)
    # the same packed prefills through the layers compiled by compile_layers (inductor): compiled_prefill=True
    from opd.models import compile_layers

    compile_layers(model, True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        engine = StaticGenerator(model, max_batch_size=12, compiled_prefill=True, **common)
        compiled = engine.generate(prompts, params)
    same = sum(x == y for x, y in zip(compiled.response_ids, outputs[True].response_ids)) / len(prompts)
    check("static_packed greedy rows equal (compiled vs eager packed prefill), 1 - rate", 1 - same, 0.25)
    err = max(abs(x[0] - y[0]) for x, y in zip(compiled.logprobs, outputs[True].logprobs))
    check("static_packed first-token log-prob |Δ| (compiled vs eager packed prefill)", err, 1e-2)


@guarded
def gpu_busy():
    import time

    from opd.report.gpu_busy import GpuBusy

    busy = GpuBusy.open(torch.device("cuda"))
    check("gpu_busy NVML sampler opened (0 = yes)", float(busy is None), 0.0, "(needs pynvml: nvidia-ml-py)")
    if busy is None:
        return
    x = torch.randn(4096, 4096, device="cuda")
    busy.mark()
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:
        for _ in range(20):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
    loaded = busy.fraction()
    time.sleep(2.0)
    idle = busy.fraction()
    check("gpu_busy 1 - fraction over 2 s of matmuls", 1.0 if loaded is None else 1.0 - loaded, 0.1)
    check("gpu_busy fraction over 2 s of sleep", 1.0 if idle is None else idle, 0.1)


@guarded
def static_memory():
    from opd.rollout import SamplingParams, memory
    from opd.rollout.static_engine import StaticGenerator

    model = build_model("qwen3-0.6b", dtype=torch.bfloat16, device=torch.device("cuda"))
    engine = StaticGenerator(model, eos_token_ids=[151645], pad_token_id=151643, vocab_size=151669, max_batch_size=64)
    torch.cuda.empty_cache()
    free, total = memory.device_memory(torch.device("cuda"))
    # leave the margin, what a call holds once (prefill, first-token sampling, RoPE table), the step weights it builds
    # and 32 rows of (128 + 96) slots (the call's longest cap sets the slots): 64 rows must not fit
    cost = engine.row_cost(128, 96, torch.bfloat16)
    leave = (
        memory.margin_bytes(total) + cost.fixed_bytes + engine.step_weight_bytes(torch.bfloat16) + 32 * cost.row_bytes
    )
    ballast = torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda")
    free, _ = memory.device_memory(torch.device("cuda"))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 151669, (64, 128), generator=g).tolist()
    caps = torch.randint(16, 97, (64,), generator=g).tolist()  # short calls; slots per row: 128 + max(caps)
    out = engine.generate(
        prompts, SamplingParams(max_new_tokens=2048, stop_at_eos=False, seed=0), max_new_tokens_per_sample=caps
    )
    used = torch.cuda.max_memory_allocated() - base
    check(
        "static_memory rows not limited by the memory (1 = not)",
        float(engine.stats["rows"] >= 64),
        0,
        f"({engine.stats['rows']} rows of {engine.stats['slots_per_row']} slots, {engine.stats['refills']} refills)",
    )
    check(
        "static_memory peak allocation / (free - margin)",
        used / (free - memory.margin_bytes(total)),
        1.0,
        f"(peak {used / 2**30:.2f} GiB, free {free / 2**30:.2f} GiB)",
    )
    check("static_memory samples with the wrong length", sum(len(r) != c for r, c in zip(out.response_ids, caps)), 0)
    del ballast


def dense_reference(z_NV: torch.Tensor, targets, requested, k):
    lp = z_NV.double().log_softmax(-1)
    return (lp.gather(1, targets[:, None])[:, 0], lp.topk(k, -1), lp.gather(1, requested), -(lp.exp() * lp).sum(-1))


@guarded
def score_hidden_checks():
    from opd.scoring import score_hidden

    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v_model, v = 5000, 256, 4160, 4100
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-4)):
        hidden = torch.randn(n, d, device="cuda", generator=g).to(dtype)
        weight = (torch.randn(v_model, d, device="cuda", generator=g) / d**0.5).to(dtype)
        targets = torch.randint(0, v, (n,), device="cuda", generator=g)
        requested = torch.randint(0, v, (n, 16), device="cuda", generator=g)
        got = score_hidden(
            hidden, weight, targets_N=targets, top_k=16, requested_ids_NQ=requested, vocab_size=v, with_entropy=True
        )
        # reference from the same logits the model dtype gives (a bf16 matmul rounds them to bf16)
        z = (hidden @ weight[:v].T) if dtype == torch.bfloat16 else (hidden.double() @ weight[:v].double().T)
        sampled, (topk_lp, topk_ids), req, entropy = dense_reference(z, targets, requested, 16)
        err = max(
            float((got.sampled_logprobs.double() - sampled).abs().max()),
            float((got.topk_logprobs.double() - topk_lp).abs().max()),
            float((got.requested_logprobs.double() - req).abs().max()),
            float((got.entropy.double() - entropy).abs().max()),
        )
        check(f"score_hidden[{str(dtype)[6:]}] max |Δ| vs float64 dense", err, tol)
        if dtype == torch.float32:  # bf16 logits tie often: there the values above are the check
            agree = float((got.topk_ids == topk_ids).float().mean())
            check(f"score_hidden[{str(dtype)[6:]}] 1 - top-k id agreement", 1 - agree, 0)


@guarded
def candidate_grads():
    from opd.scoring import candidate_logprobs_and_entropy

    g = torch.Generator(device="cuda").manual_seed(1)
    n, d, v_model, v = 3000, 128, 2112, 2100
    hidden = torch.randn(n, d, device="cuda", generator=g, requires_grad=True)
    weight = (torch.randn(v_model, d, device="cuda", generator=g) / d**0.5).requires_grad_(True)
    ids = torch.randint(0, v, (n, 16), device="cuda", generator=g)
    coef_lp = torch.randn(n, 16, device="cuda", generator=g)
    coef_h = torch.randn(n, device="cuda", generator=g)
    lp, ent = candidate_logprobs_and_entropy(hidden, weight, ids, vocab_size=v)
    ((lp * coef_lp).sum() + (ent * coef_h).sum()).backward()
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    lp_ref = (h64 @ w64[:v].T).log_softmax(-1)
    ent_ref = -(lp_ref.exp() * lp_ref).sum(-1)
    ((lp_ref.gather(1, ids) * coef_lp.double()).sum() + (ent_ref * coef_h.double()).sum()).backward()
    check("candidate log-prob max |Δ| vs float64", float((lp.double() - lp_ref.gather(1, ids)).abs().max()), 1e-4)
    check("candidate entropy max |Δ| vs float64", float((ent.double() - ent_ref).abs().max()), 1e-4)
    for name, a, b in (("hidden", hidden.grad, h64.grad), ("weight", weight.grad, w64.grad)):
        rel = float((a.double() - b).norm() / b.norm())
        check(f"candidate grad[{name}] ‖Δ‖/‖g‖ vs float64", rel, 1e-4)


@guarded
def compiled_layers():
    from opd.forward import forward_hidden
    from opd.models import compile_layers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import random_rollouts

    eager, compiled = tiny(), tiny()
    compile_layers(compiled, True)
    compiled.gradient_checkpointing_enable()
    rollouts = random_rollouts(6, 9, 23, 500, torch.device("cuda"), 0, 1)
    rollouts.response_mask[::2, 15:] = False  # ragged lengths: padded batches with an attention mask
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.train()
        hidden = forward_hidden(model, rollouts)
        (hidden.hidden_ND.square().mean()).backward()
        out[name] = (hidden.hidden_ND.detach(), model.model.layers[0].mlp.down_proj.weight.grad)
    check("compiled_layers forward max |Δ|", float((out["eager"][0] - out["compiled"][0]).abs().max()), 1e-4)
    g_e, g_c = out["eager"][1], out["compiled"][1]
    check("compiled_layers (+ checkpointing) grad ‖Δ‖/‖g‖", float((g_e - g_c).norm() / g_e.norm()), 1e-4)


@guarded
def packed_flex():
    from common import random_rollouts
    from opd.forward import forward_hidden
    from opd.teacher.local import LocalScorer

    cuda = torch.device("cuda")
    padded = tiny()
    packed = build_model("tiny", dtype=torch.float32, device=cuda, seed=0, attn_implementation="flex_attention")
    rollouts = random_rollouts(6, 9, 23, 500, cuda, 0, 1)
    rollouts.response_mask[::2, 15:] = False  # ragged: half the rows need 8 fewer tokens
    a = LocalScorer(padded, vocab_size=500, packing="padded").score(rollouts, top_k=8)
    b = LocalScorer(packed, vocab_size=500, packing="packed").score(rollouts, top_k=8)
    err = max(
        float((x - y).abs().max())
        for x, y in (
            (a.sampled_logprobs, b.sampled_logprobs),
            (a.topk_logprobs, b.topk_logprobs),
            (a.entropy, b.entropy),
        )
    )
    check("packed_flex scores max |Δ| vs padded sdpa", err, 1e-4)
    grads = []
    for model, packing in ((padded, "padded"), (packed, "packed")):
        model.train()
        forward_hidden(model, rollouts, packing=packing).hidden_ND.square().mean().backward()
        grads.append(model.model.layers[0].mlp.down_proj.weight.grad)
    check("packed_flex grad ‖Δ‖/‖g‖ vs padded sdpa", float((grads[0] - grads[1]).norm() / grads[0].norm()), 1e-4)


@guarded
def packed_varlen():
    from common import random_rollouts
    from opd.forward import forward_hidden
    from opd.kernels import varlen_attention
    from opd.models import compile_layers
    from opd.teacher.local import LocalScorer

    cuda = torch.device("cuda")
    lengths = [640, 1, 377, 129, 512, 64]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), h, 128, generator=generator).to(cuda, torch.bfloat16).requires_grad_()
        for h in (16, 8, 8)
    )
    cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=cuda)
    out = varlen_attention.packed_causal_attention(q, k, v, cu_seq_lens, max(lengths))
    row_S = torch.repeat_interleave(torch.arange(len(lengths), device=cuda), torch.tensor(lengths, device=cuda))
    pos_S = torch.arange(len(row_S), device=cuda)
    allowed_SS = (row_S[:, None] == row_S[None]) & (pos_S[:, None] >= pos_S[None])
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    scores_HSS = torch.einsum("shd,thd->hst", q64, k64.repeat_interleave(2, 1)) / 128**0.5
    ref = torch.einsum(
        "hst,thd->shd", scores_HSS.masked_fill(~allowed_SS, float("-inf")).softmax(-1), v64.repeat_interleave(2, 1)
    )
    check("packed_varlen kernel max |Δ| vs float64", float((out.double() - ref).abs().max()), 2e-2)
    grad_out = torch.randn_like(ref)
    out.backward(grad_out.to(out.dtype))
    ref.backward(grad_out)
    grad_err = max(float((a.grad.double() - b.grad).norm() / b.grad.norm()) for a, b in ((q, q64), (k, k64), (v, v64)))
    check("packed_varlen kernel grad ‖Δ‖/‖g‖ vs float64", grad_err, 2e-2)

    padded = tiny()
    packed = build_model(
        "tiny", dtype=torch.float32, device=cuda, seed=0, attn_implementation=varlen_attention.ATTENTION
    )
    compile_layers(packed, True)
    rollouts = random_rollouts(6, 9, 23, 500, cuda, 0, 1)
    rollouts.response_mask[::2, 15:] = False  # ragged: half the rows need 8 fewer tokens
    results, grads = [], []
    for model, packing in ((padded, "padded"), (packed, "packed")):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(LocalScorer(model, vocab_size=500, packing=packing).score(rollouts, top_k=8))
            model.train()
            forward_hidden(model, rollouts, packing=packing).hidden_ND.float().square().mean().backward()
        grads.append(model.model.layers[0].mlp.down_proj.weight.grad)
    a, b = results
    err = max(
        float((x - y).abs().max())
        for x, y in (
            (a.sampled_logprobs, b.sampled_logprobs),
            (a.topk_logprobs, b.topk_logprobs),
            (a.entropy, b.entropy),
        )
    )
    check("packed_varlen model scores (compiled, autocast) max |Δ| vs padded sdpa", err, 5e-2)
    check(
        "packed_varlen model grad ‖Δ‖/‖g‖ vs padded sdpa", float((grads[0] - grads[1]).norm() / grads[0].norm()), 2e-2
    )


# bf16 autocast over float32 weights, as the trainer scores: the same tolerance as packed_varlen's model check
FAMILY_TOL = 5e-2


@guarded
def families():
    import copy

    from common import random_rollouts
    from families import RELEASED, TINY_VOCAB, family
    from opd.kernels import varlen_attention
    from opd.teacher.local import LocalScorer

    cuda = torch.device("cuda")
    varlen_attention.register()
    for name, key in RELEASED.items():
        padded = family(key).to(cuda)
        reason = varlen_attention.refusal(padded, cuda)
        if reason is not None:
            print(f"SKIP  families[{name}]: packed attention refused: {reason}", flush=True)
            continue
        packed = copy.deepcopy(padded)
        packed.set_attn_implementation(varlen_attention.ATTENTION)
        padded.set_attn_implementation("sdpa")
        rollouts = random_rollouts(6, 9, 23, TINY_VOCAB, cuda, 0, 1)
        rollouts.response_mask[::2, 15:] = False  # ragged rows, each longer than the families' window of 4
        results = []
        for model, packing in ((padded, "padded"), (packed, "packed")):
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                results.append(LocalScorer(model, vocab_size=TINY_VOCAB, packing=packing).score(rollouts, top_k=8))
        a, b = results
        err = max(
            float((x - y).abs().max())
            for x, y in (
                (a.sampled_logprobs, b.sampled_logprobs),
                (a.topk_logprobs, b.topk_logprobs),
                (a.entropy, b.entropy),
            )
        )
        check(f"families[{name}] packed vs padded scores (bf16 autocast) max |Δ|", err, FAMILY_TOL)


@guarded
def families_static():
    """The static engine (compiled, CUDA graphs) against the torch engine on every family it accepts, fp32 greedy."""
    from families import EOS_ID, PAD_ID, RELEASED, family
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator, unsupported_reason
    from opd.rollout.torch_engine import TorchGenerator

    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, return_logprobs=True)
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    for name, key in RELEASED.items():
        model = family(key).cuda()
        reason = unsupported_reason(model)
        if reason is not None:
            print(f"SKIP  families_static[{name}]: {reason}", flush=True)
            continue
        want = TorchGenerator(model, **common).generate(prompts, params)
        got = StaticGenerator(model, cuda_graphs=True, **common).generate(prompts, params)
        check(
            f"families_static[{name}] rows differing from TorchGenerator",
            sum(a != b for a, b in zip(got.response_ids, want.response_ids)),
            0,
        )
        err = max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(got.logprobs, want.logprobs))
        check(f"families_static[{name}] max |Δ log-prob| vs TorchGenerator", err, 1e-4)


@guarded
def static_windows():
    """The static engine's sliding windows through the Triton kernel (head sizes 16 and 32) and SDPA, windows of 16
    binding on rows up to 140 tokens, refills and graphs, with and without live-row buckets, fp32 greedy."""
    import transformers

    from families import EOS_ID, PAD_ID, TINY_CONFIG
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    configs = {
        "Mistral": dict(sliding_window=16),
        "Qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1, hidden_size=128),
        "Phi3": dict(sliding_window=16, partial_rotary_factor=0.5),
        # Gemma 2 with a soft-cap that binds (the matmul path stands in for SDPA, which has none); Gemma 3's two RoPE
        # tables and alternating windows
        # eager: what `opd.models.load_model` picks for soft-capped models (SDPA has no soft-cap)
        "Gemma2": dict(sliding_window=16, head_dim=16, attn_logit_softcapping=1.0, attn_implementation="eager"),
        "Gemma3Text": dict(sliding_window=16, head_dim=16, layer_types=["sliding_attention", "full_attention"]),
    }
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=100, return_logprobs=True, seed=0)
    for family_name, extra in configs.items():
        torch.manual_seed(0)
        config = getattr(transformers, f"{family_name}Config")(**{**TINY_CONFIG, "hidden_size": 64, **extra})
        model_class = "Gemma3ForCausalLM" if family_name == "Gemma3Text" else f"{family_name}ForCausalLM"
        model = getattr(transformers, model_class)(config).eval().cuda()
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (12,), generator=g)
        ]
        caps = torch.randint(1, 101, (24,), generator=g).tolist()
        want = TorchGenerator(model, max_batch_size=24, **common).generate(
            prompts, params, max_new_tokens_per_sample=caps
        )
        reference = "matmul" if family_name == "Gemma2" else "sdpa"
        for options in ({}, {"attention": reference}, {"row_buckets": True}):
            label = ",".join(f"{k}={v}" for k, v in options.items()) or "default"
            engine = StaticGenerator(model, cuda_graphs=True, max_batch_size=10, sync_interval=8, **common, **options)
            got = engine.generate(prompts, params, max_new_tokens_per_sample=caps)
            differing = sum(a != b for a, b in zip(got.response_ids, want.response_ids))
            check(f"static_windows[{family_name},{label}] rows differing from TorchGenerator", differing, 0)
            err = max(
                float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(got.logprobs, want.logprobs)
            )
            check(
                f"static_windows[{family_name},{label}] max |Δ log-prob|", err, 1e-4, f"({engine.stats['attention']})"
            )


@guarded
def families_distill():
    import math
    import tempfile

    from families import BUILDERS, RELEASED

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers import make_tiny_tokenizer
    from opd.config import DistillConfig, build_config
    from opd.recipes.distill import distill

    tokenizer = make_tiny_tokenizer()
    root = Path(tempfile.mkdtemp(prefix="opd-families-distill-"))
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": "x" * (3 + 7 * i) + f" {i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, key in RELEASED.items():
        for role, seed in (("student", 0), ("teacher", 1)):
            torch.manual_seed(seed)
            BUILDERS[key]().save_pretrained(root / key / role)
            tokenizer.save_pretrained(root / key / role)
        options = {
            "student.path": str(root / key / "student"),
            "teacher.path": str(root / key / "teacher"),
            "data.path": str(prompts),
            "data.answer_key": "answer",
            "data.max_prompt_length": 96,
            "prompts_per_step": 4,
            "rollout.n": 4,
            "rollout.max_new_tokens": 48,
            "micro_batch_tokens": 4096,
            "compile": COMPILE_LAYERS,
            "run.out_dir": str(root / key / "runs"),
            "run.name": "run",
            "run.steps": 2,
            "run.report": False,
        }
        distill(build_config(DistillConfig, options=options, overrides=[]))
        steps = [json.loads(line) for line in (root / key / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "pg_loss" in s]
        check(f"families_distill[{name}] steps missing of 2", 2 - len(steps), 0)
        finite = all(math.isfinite(s["pg_loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
        check(f"families_distill[{name}] steps with a non-finite loss or gradient", float(not finite), 0)


@guarded
def deterministic():
    """Opt-in (`--only deterministic`; on an H100 ~7 min with a cold compile cache, 6 warm): `run.deterministic` on
    CUDA, through the CLI in fresh processes (torch reads CUBLAS_WORKSPACE_CONFIG once per process): a 4-step run with
    compiled layers and nucleus sampling, against 2 steps + `--resume` to 4 of the same config: the learning metrics
    of every step and the final weights equal bit for bit. The same run without it is reported beside (how many of
    those values differ; not a pass/fail). Then `deterministic_sampling`."""
    import subprocess
    import tempfile

    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers import make_tiny_model, make_tiny_tokenizer
    from opd.train.checkpoint import latest_checkpoint

    root = Path(tempfile.mkdtemp(prefix="opd-deterministic-"))
    tokenizer = make_tiny_tokenizer()
    for name, seed in (("student", 0), ("teacher", 1)):
        make_tiny_model("qwen3", seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rows = [{"prompt": "x" * (3 + 7 * i) + f" {i}+{i}=", "answer": str(2 * i)} for i in range(16)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(name: str, *overrides: str) -> Path:
        argv = [sys.executable, "-m", "opd.cli", "distill", "--student", str(root / "student"), "--teacher"]
        argv += [str(root / "teacher"), "--prompts", str(root / "prompts.jsonl"), "--out-dir", str(root / "runs")]
        argv += ["--name", name, "data.answer_key=answer", "prompts_per_step=4", "rollout.n=4"]
        argv += ["rollout.max_new_tokens=48", "rollout.top_p=0.95", "run.save_every=2", "run.report=false"]
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}  # opd sets it
        subprocess.run(argv + list(overrides), check=True, env=env)
        return root / "runs" / name

    keys = ("reward_mean", "pg_loss", "grad_norm", "entropy_student", "overlap_ratio", "response_length")

    def learning(run_dir: Path) -> list[list[float]]:
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [[s.get(k) for k in keys] for s in steps if "pg_loss" in s]

    def weights(run_dir: Path) -> dict:
        return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))

    straight = run("straight", "--steps", "4", "run.deterministic=true")
    run("resumed", "--steps", "2", "run.deterministic=true")
    resumed = run("resumed", "--steps", "4", "run.deterministic=true", "run.resume=true")
    other = run("other", "--steps", "4", "run.deterministic=false")
    a, b, c = learning(straight), learning(resumed), learning(other)
    check("deterministic resume: steps missing of 4", 4 - min(len(a), len(b)), 0)
    check("deterministic resume: learning values differing", sum(x != y for p, q in zip(a, b) for x, y in zip(p, q)), 0)
    wa, wb = weights(straight), weights(resumed)
    check("deterministic resume: weight tensors differing", sum(not torch.equal(wa[k], wb[k]) for k in wa), 0)
    differing = sum(x != y for p, q in zip(a, c) for x, y in zip(p, q))
    check("without run.deterministic: learning values differing", differing, float("inf"), "(informational)")
    deterministic_sampling()


def deterministic_sampling():
    """Opt-in (`--only deterministic_sampling`, ~1 min; also the end of `deterministic`): in deterministic mode,
    torch's eager float cumsum and the compiled top-p filter (integer sums, at the real vocabulary of 151,936 and 1,
    2, 4 rows) repeated: equal, and the compiled filter keeps what the eager one keeps."""
    from opd.rollout.sampling import filter_logits

    # torch's eager CUDA cumsum honours deterministic mode (a fixed-order scan; its docstring still lists it as
    # raising); inductor's float scan does not, which is why the compiled sampling step sums integers under the flag
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 151_936, generator=generator).mul(3).cuda()
    filtered = torch.compile(lambda x: filter_logits(x, top_p=0.9), dynamic=False)
    torch.use_deterministic_algorithms(True)  # neither uses cuBLAS: no CUBLAS_WORKSPACE_CONFIG needed here
    try:
        sums = [logits.softmax(-1).cumsum(-1) for _ in range(5)]
        kept = {rows: [torch.isfinite(filtered(logits[:rows])) for _ in range(5)] for rows in (1, 2, 4)}
        eager = torch.isfinite(filter_logits(logits, top_p=0.9))
    finally:
        torch.use_deterministic_algorithms(False)
    check("deterministic eager float cumsum: repeats differing", sum(not torch.equal(x, sums[0]) for x in sums), 0)
    differing = sum(not torch.equal(k, runs[0]) for runs in kept.values() for k in runs)
    check("deterministic compiled top-p (1, 2, 4 rows): repeats differing", differing, 0)
    check("deterministic compiled top-p vs eager: entries kept differently", float((kept[4][0] != eager).sum()), 0)


OPT_IN = (deterministic, deterministic_sampling)  # run only when named in --only

CHECKS = (
    static_greedy,
    static_packed,
    gpu_busy,
    static_rows_and_stop,
    decode_attention,
    full_vocab_topk,
    static_sampling,
    static_autocast,
    static_memory,
    score_hidden_checks,
    candidate_grads,
    compiled_layers,
    packed_flex,
    packed_varlen,
    families,
    families_static,
    static_windows,
    families_distill,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/benchmarks/check_cuda.json")
    parser.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    parser.add_argument("--compile-layers", action="store_true", help="families_distill with compiled layers")
    args = parser.parse_args(argv)
    global COMPILE_LAYERS
    COMPILE_LAYERS = args.compile_layers
    if not torch.cuda.is_available():
        raise SystemExit("check_cuda.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    only = None if args.only is None else set(args.only.split(","))
    for fn in CHECKS + OPT_IN:
        if (only is None and fn not in OPT_IN) or (only is not None and fn.__name__ in only):
            fn()
    failed = [r for r in ROWS if not r["ok"]]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": ROWS}, indent=1)
    )
    print(
        f"\n{len(ROWS) - len(failed)} of {len(ROWS)} checks passed"
        + (f"; FAILED: {[r['check'] for r in failed]}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
