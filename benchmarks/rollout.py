"""Rollout throughput: our engines against Hugging Face `generate()`, one model, the same prompts, the same lengths.

    python benchmarks/rollout.py --shape qwen3-0.6b --batches 64,256 --new-tokens 512       # GPU
    python benchmarks/rollout.py --batches 64,256 --lengths lognormal:mean=1500,cap=7168 --engines static_compile
    python benchmarks/rollout.py --shape qwen3-1.7b --batches 256 --prompt-len 1024 --new-tokens 7168 \\
        --engines static_compile --engines-big static_compile                                # paper shape, memory-sized
    python benchmarks/rollout.py --shape qwen3-1.7b --batches 16 --prompt-len 1024 --new-tokens 3072 \\
        --engines static_compile,static_engine,static_sdpa --lp-reference fp32               # log-prob drift
    python benchmarks/rollout.py --shape tiny --device cpu --batches 4 --new-tokens 8        # CPU smoke run

Rows (`--engines` at the first batch size, `--engines-big` at the others):
    hf_generate         `model.generate(do_sample=True)`, dynamic cache (the alternative)
    hf_generate_static  the same with `cache_implementation="static"` (transformers compiles the forward itself)
    hf_generate_nocudnn `hf_generate` with SDPA's cuDNN backend excluded (flash / memory-efficient / math only): on
                        torch 2.11 cuDNN attention re-plans at every new key length, which slows decoding
    torch_engine        `TorchGenerator` (our eager loop)
    static_engine       `StaticGenerator`, decode step replayed as CUDA graphs (eager step on CPU)
    static_compile      `StaticGenerator` with its decode functions under `torch.compile` as well (CUDA only); its
                        attention is the Triton split-KV kernel (`attention="auto"` on CUDA)
    static_nobuckets    `static_compile` with every decode step over all rows (`row_buckets=False`, the engine's
                        default; static_engine and static_compile run live-row buckets), to compare in one run
    static_splits1      `static_compile` with one split per row in the Triton kernel (`attention_splits=1`: the
                        default before the cache's length counted, `default_splits`), to compare in one run
    static_sdpa         `static_compile` with SDPA attention over the bucketed span (`attention="sdpa"`)
    static_v1           `static_compile` as first measured: per-projection GEMMs on the module's own weights
                        (`fuse_weights=False`) and matmul/softmax/matmul attention (`attention="matmul"`)
    vllm                `VLLMGenerator`: vLLM in this process on a copy of the weights saved to a temporary directory
                        (eager on CPU, fp32; needs the vllm extra, e.g. the environment of `./dev setup-vllm`); per-row
                        lengths as one request per row
A saved model instead of a random shape: `--model-path DIR` (e.g. the lab's `src/opd/lab/assets/student`).
Every row samples at temperature 1 from distinct random prompts, one sample per prompt, EOS off, and produces exactly
the requested tokens per row. `--lengths equal` (default): every row new_tokens (`min_new_tokens` for generate,
`stop_at_eos=False` for ours). `--lengths lognormal:mean=M,cap=C[,sigma=S]`: row r's length L_r is drawn (seeded)
from a lognormal with mean M (σ = S of its log, default 1), rounded and clipped to [1, C]; every engine ends row r
after exactly L_r tokens (ours through `generate(..., max_new_tokens_per_sample=...)`, generate() through a logits
processor that forces EOS at L_r and bans it before). Each such job runs twice: `[ragged]` with the drawn lengths and
`[equal]` with every row at their mean (the same total tokens), and `vs equal` is the ratio of their tokens/s
(`--compare-equal off` skips the equal row). Real tokens only are counted. `StaticGenerator` sizes its rows from the
free memory and refills finished rows' slots (`rows`, `steps`, `refills`, `occupancy` columns: its stats).

Timed: one full call after a short warm-up call of the same batch size (so compilation is outside the time, graph
capture inside it, as it is in training where every step captures anew). `lp_err` checks our engines: mean
|reported log-prob - log-prob recomputed by a teacher-forced forward| over all sampled tokens (bf16: ~1e-2 is
rounding). `--lp-reference fp32` adds, per response-position bucket, the errors of the engine and of the bf16
teacher-forced forward against a float32 forward of the same weights (TF32 off), and engine vs bf16 forward (a second
table): which side drifts with the length. (The model keeps RoPE's `inv_freq` float32, `common.keep_rope_float32`,
as real checkpoints load; the float32 reference is a float32 copy of the same bf16 weights and buffers.)

Bound: a decode step reads every weight once, so tokens/s ≤ rows · bandwidth / weight bytes (`pct_bound`); with the
KV cache (`bound_kv`), token t of a row also reads its prompt's and its t earlier tokens' keys and values (4 · layers ·
kv_heads · head_dim bytes each in bf16), summed over every row's tokens, and the call reads the weights once per step
of its longest row: a long tail's tokens sit late in long rows and read more cache than equal lengths at the same
mean. A ragged call cannot be faster than its longest row decoded alone: `max_len` steps.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    EOS_ID,
    PAD_ID,
    SHAPES,
    TOKENIZER_SIZE,
    Report,
    add_rollout_arguments,
    base_parser,
    build_model,
    eos_id,
    kv_token_reads,
    measure,
    pad_id,
    param_bytes,
    peaks,
    resolve_device,
    speedups,
)

ALL = (
    "hf_generate",
    "hf_generate_static",
    "hf_generate_nocudnn",
    "torch_engine",
    "static_engine",
    "static_compile",
    "static_nobuckets",
    "static_splits1",
    "static_sdpa",
    "static_v1",
    "vllm",
)
BUCKETS = (0, 128, 512, 1024, 2048, 4096, 8192)  # response-position buckets of the --lp-reference table


def draw_lengths(spec: str, rows: int, default: int, seed: int) -> list[int] | None:
    """Per-row response lengths from `--lengths`: None for "equal", else a seeded draw (see the module docstring)."""
    if spec == "equal":
        return None
    kind, _, rest = spec.partition(":")
    try:
        options = {k: float(v) for k, v in (item.split("=") for item in rest.split(",") if item)}
    except ValueError:
        raise SystemExit(f"--lengths {spec!r}: write lognormal:mean=M,cap=C[,sigma=S] or equal") from None
    if kind != "lognormal" or "mean" not in options or set(options) - {"mean", "cap", "sigma"}:
        raise SystemExit(f"--lengths {spec!r}: write lognormal:mean=M,cap=C[,sigma=S] or equal")
    sigma, cap = options.get("sigma", 1.0), int(options.get("cap", default))
    mu = math.log(options["mean"]) - sigma**2 / 2  # the lognormal's mean is exp(mu + sigma² / 2)
    g = torch.Generator().manual_seed(seed)
    drawn = torch.exp(mu + sigma * torch.randn(rows, generator=g, dtype=torch.float64))
    return drawn.round().clamp(1, cap).long().tolist()


_VLLM_DIRS: dict[int, str] = {}


def make_engine(name: str, model, shape: str, batch: int, **options):
    """Engine `name` over `model` with `batch` rows; `options`: more constructor arguments (not for vllm)."""
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    if name == "vllm":
        import tempfile

        from opd.rollout.vllm_engine import VLLMGenerator

        if id(model) not in _VLLM_DIRS:  # vLLM loads weights from a directory: this model's, saved once
            _VLLM_DIRS[id(model)] = tempfile.mkdtemp(prefix="opd-bench-vllm-")
            model.save_pretrained(_VLLM_DIRS[id(model)])
        return VLLMGenerator(
            _VLLM_DIRS[id(model)], eos_token_ids=[eos_id(shape)], vocab_size=TOKENIZER_SIZE[shape], max_batch_size=batch
        )
    common = dict(
        eos_token_ids=[eos_id(shape)],
        pad_token_id=pad_id(shape),
        vocab_size=TOKENIZER_SIZE[shape],
        max_batch_size=batch,
        **options,
    )
    if name == "torch_engine":
        return TorchGenerator(model, **common)
    if name == "static_v1":
        return StaticGenerator(model, compile=True, cuda_graphs=True, fuse_weights=False, attention="matmul", **common)
    if name == "static_sdpa":
        return StaticGenerator(model, compile=True, cuda_graphs=True, attention="sdpa", **common)
    if name == "static_nobuckets":
        return StaticGenerator(model, compile=True, cuda_graphs=True, row_buckets=False, **common)
    if name == "static_splits1":
        return StaticGenerator(model, compile=True, cuda_graphs=True, attention_splits=1, **common)
    return StaticGenerator(model, compile=name == "static_compile", cuda_graphs=True, row_buckets=True, **common)


def forced_lengths_processor(prompt_len: int, lengths: list[int], eos: int, device: torch.device):
    """A `generate()` logits processor that ends row r after exactly lengths[r] tokens: EOS banned before, forced at
    the last one."""
    from transformers import LogitsProcessor

    lengths_B = torch.as_tensor(lengths, device=device)

    class ForcedLengths(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            produced = input_ids.shape[1] - prompt_len
            last_B = lengths_B == produced + 1
            scores[:, eos] = float("-inf")
            scores[last_B] = float("-inf")
            scores[last_B, eos] = 0.0
            return scores

    return ForcedLengths()


def teacher_forced(model, prompts, output, shape: str):
    """(Rollouts, log-probs of the sampled tokens under a teacher-forced forward of `model`) (chunked scorer, no
    [B, T, V])."""
    from opd.rollout.batch import build_rollouts
    from opd.teacher.local import LocalScorer

    rollouts = build_rollouts(prompts, output, pad_id=pad_id(shape), device=next(model.parameters()).device)
    scores = LocalScorer(model, check_head=False, vocab_size=TOKENIZER_SIZE[shape]).score(
        rollouts, top_k=0, with_entropy=False
    )
    return rollouts, scores.sampled_logprobs


def logprob_error(model, prompts, output, shape: str) -> float:
    """Mean |engine log-prob - teacher-forced log-prob| over every sampled token."""
    rollouts, forced = teacher_forced(model, prompts, output, shape)
    return float((forced - rollouts.rollout_logprobs).abs()[rollouts.response_mask].mean())


def drift_by_position(model, reference, prompts, output, shape: str) -> list[dict]:
    """Per response-position bucket: mean |Δ log-prob| of engine vs `reference` (float32), bf16 teacher-forced vs
    reference, and engine vs bf16 teacher-forced."""
    rollouts, bf16 = teacher_forced(model, prompts, output, shape)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _, fp32 = teacher_forced(reference, prompts, output, shape)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    engine, mask = rollouts.rollout_logprobs, rollouts.response_mask
    position = torch.arange(mask.shape[1], device=mask.device)[None].expand_as(mask)
    rows = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        bucket = mask & (position >= lo) & (position < hi)
        if not bucket.any():
            continue
        rows.append(
            {
                "positions": f"[{lo}, {hi})",
                "tokens": int(bucket.sum()),
                "engine_vs_fp32": float((engine - fp32).abs()[bucket].mean()),
                "bf16_forward_vs_fp32": float((bf16 - fp32).abs()[bucket].mean()),
                "engine_vs_bf16_forward": float((engine - bf16).abs()[bucket].mean()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    add_rollout_arguments(  # --batches: the first is the main one
        parser,
        new_tokens=512,
        lengths="equal",
        lengths_help="equal, or lognormal:mean=M,cap=C[,sigma=S]: per-row response lengths (seeded)",
    )
    parser.add_argument(
        "--compare-equal",
        choices=("on", "off"),
        default="on",
        help="with --lengths DIST, also run each job at equal lengths with the same total tokens",
    )
    parser.add_argument(
        "--lp-error",
        choices=("on", "off"),
        default="on",
        help="score our rows' tokens with a teacher-forced forward (lp_err)",
    )
    parser.add_argument(
        "--lp-reference",
        choices=("none", "fp32"),
        default="none",
        help="fp32: per position bucket, engine and bf16 forward against a float32 forward",
    )
    parser.add_argument(
        "--engines",
        default="hf_generate,torch_engine,static_engine,static_compile,hf_generate_static",
        help=f"rows at the first batch size, in order; from {','.join(ALL)}",
    )
    parser.add_argument("--engines-big", default="torch_engine,static_compile", help="rows at the other batch sizes")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    flops, bandwidth = peaks(device, args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path:
        model = _saved_model(args, dtype, device)
    else:
        model = build_model(args.shape, dtype=dtype, device=device, seed=args.seed)
    reference = copy.deepcopy(model).float() if args.lp_reference == "fp32" else None
    cfg = SHAPES[args.shape]
    weight_bytes = param_bytes(model)
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype.itemsize
    report = Report(
        "rollout",
        args,
        device,
        shape=args.shape,
        dtype=str(dtype),
        weight_bytes=weight_bytes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        lengths=args.lengths,
        bandwidth=bandwidth,
    )
    batches = [int(b) for b in args.batches.split(",")]
    jobs = [(batches[0], e) for e in args.engines.split(",") if e != "hf_generate_static"]
    jobs += [(b, e) for b in batches[1:] for e in args.engines_big.split(",")]
    if "hf_generate_static" in args.engines.split(","):
        jobs.append((batches[0], "hf_generate_static"))  # last: its compilation can take minutes
    g = torch.Generator().manual_seed(args.seed)
    prompts_by_batch = {
        b: torch.randint(3, TOKENIZER_SIZE[args.shape], (b, args.prompt_len), generator=g)
        for b in dict.fromkeys(batches)
    }
    lengths_by_batch = {b: draw_lengths(args.lengths, b, args.new_tokens, args.seed) for b in prompts_by_batch}
    if args.lengths == "equal":
        kinds = [None]
    else:
        kinds = ["ragged", "equal"] if args.compare_equal == "on" else ["ragged"]
    for batch, name in jobs:
        if name not in ALL:
            raise SystemExit(f"--engines: unknown row {name!r}; choose from {', '.join(ALL)}")
        if name in ("static_compile", "static_splits1", "static_sdpa", "static_v1") and device.type != "cuda":
            continue  # compilation is CUDA-only; on CPU it would repeat static_engine
        for kind in kinds:
            drawn = lengths_by_batch[batch]
            if kind == "equal":
                lengths = [round(sum(drawn) / batch)] * batch
            else:
                lengths = drawn or [args.new_tokens] * batch
            report.run_row(
                f"{name}@{batch}" + (f"[{kind}]" if kind else ""),
                lambda name=name, batch=batch, lengths=lengths, kind=kind: run_row(
                    args,
                    name,
                    model,
                    reference,
                    device,
                    prompts_by_batch[batch],
                    lengths,
                    forced=kind is not None,
                    weight_bytes=weight_bytes,
                    bandwidth=bandwidth,
                    kv_bytes_per_token=kv_bytes_per_token,
                ),
            )
    rows_by_job: dict[str, list] = {}  # "@64", "@64[ragged]", ...: the rows one generate() row is the baseline of
    for r in report.data["rows"]:
        rows_by_job.setdefault("@" + r["name"].rsplit("@", 1)[1], []).append(r)
    for job, rows in rows_by_job.items():
        speedups(rows, f"hf_generate{job}")
    by_name = {r["name"]: r for r in report.data["rows"]}
    for name, row in by_name.items():
        equal = by_name.get(name.replace("[ragged]", "[equal]")) if name.endswith("[ragged]") else None
        if equal and row.get("tokens_per_s") and equal.get("tokens_per_s"):
            row["vs_equal"] = row["tokens_per_s"] / equal["tokens_per_s"]
    columns = [
        ("row", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("× generate", "speedup", ".1f"),
        ("vs equal", "vs_equal", ".2f"),
        ("ms/step", "ms_per_step", ".2f"),
        ("steps", "steps", ","),
        ("max_len", "max_len", ","),
        ("rows", "rows", ""),
        ("refills", "refills", ","),
        ("occupancy", "occupancy", ".2f"),
        ("% of weight-BW bound", "pct_bound", ".1f"),
        ("bound (+KV) tok/s", "bound_kv_tokens_per_s", ",.0f"),
        ("% of +KV bound", "pct_bound_kv", ".1f"),
        ("peak GiB", "peak_gib", ".1f"),
        ("warm-up s", "warmup_s", ".1f"),
        ("lp_err", "lp_err", ".2e"),
    ]
    lengths_note = (
        "every row the same length"
        if args.lengths == "equal"
        else f"lengths {args.lengths} (seeded): "
        + "; ".join(
            f"{b} rows: mean {sum(ls) / len(ls):.0f}, max {max(ls)}, total {sum(ls):,}"
            for b, ls in lengths_by_batch.items()
        )
    )
    weights = f"weights of {args.model_path}" if args.model_path else "random weights"
    notes = [
        f"shape {args.shape} ({dtype}), {weights}; prompt {args.prompt_len} tokens, {lengths_note}, "
        f"temperature 1, EOS off; weights {weight_bytes / 2**30:.2f} GiB"
    ]
    data = report.finish(columns, notes)
    drift = [(r["name"], b) for r in data["rows"] for b in r.get("lp_drift", [])]
    if drift:
        lines = [
            "| row | positions | tokens | engine vs fp32 | bf16 forward vs fp32 | engine vs bf16 forward |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {n} | {b['positions']} | {b['tokens']:,} | {b['engine_vs_fp32']:.2e} | "
            f"{b['bf16_forward_vs_fp32']:.2e} | {b['engine_vs_bf16_forward']:.2e} |"
            for n, b in drift
        ]
        data["drift_table"] = "\n".join(lines)
        report.write()
        print(
            "\nlog-prob drift by response position (mean |Δ log-prob|; float32 reference, TF32 off):",
            data["drift_table"],
            sep="\n",
            flush=True,
        )
    return data


def run_row(
    args, name, model, reference, device, prompts, lengths, *, forced, weight_bytes, bandwidth, kv_bytes_per_token
) -> dict:
    """One timed call of engine `name` producing lengths[r] tokens for row r."""
    batch, prompt_lists = len(lengths), prompts.tolist()
    longest, total = max(lengths), sum(lengths)
    extra: dict = {"max_len": longest, "mean_len": total / batch}
    if name.startswith("hf_generate"):
        ids, mask = prompts.to(device), torch.ones_like(prompts, device=device)
        kwargs = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_id(args.shape),
            eos_token_id=eos_id(args.shape),
        )
        if name == "hf_generate_static":
            kwargs["cache_implementation"] = "static"

        def call(n=longest):
            from contextlib import nullcontext

            from torch.nn.attention import SDPBackend, sdpa_kernel
            from transformers import LogitsProcessorList

            options = dict(kwargs)
            if forced:  # each row ends with a forced EOS at its own length
                options["logits_processor"] = LogitsProcessorList(
                    [
                        forced_lengths_processor(
                            args.prompt_len, [min(n, length) for length in lengths], eos_id(args.shape), device
                        )
                    ]
                )
            else:
                options["min_new_tokens"] = n
            backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
            with sdpa_kernel(backends) if name == "hf_generate_nocudnn" else nullcontext():
                return model.generate(ids, attention_mask=mask, max_new_tokens=n, **options)

        # the static cache's shape depends on max_new_tokens: warm up (compile) at the timed length
        short = None if name == "hf_generate_static" else (lambda: call(4))
        m = measure(call, device, warmup=args.warmup, repeat=args.repeat, warmup_fn=short)
        steps = m["result"].shape[1] - args.prompt_len
        produced = total if forced else steps * batch  # the processor ends row r after exactly lengths[r] tokens
    else:
        from opd.rollout import SamplingParams

        engine = make_engine(name, model, args.shape, batch)
        params = SamplingParams(
            n=1, temperature=1.0, max_new_tokens=longest, stop_at_eos=False, seed=args.seed, return_logprobs=True
        )
        short = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, stop_at_eos=False, seed=args.seed)
        per_sample = lengths if forced else None
        m = measure(
            lambda: engine.generate(prompt_lists, params, max_new_tokens_per_sample=per_sample),
            device,
            warmup=args.warmup,
            repeat=args.repeat,
            warmup_fn=lambda: engine.generate(prompt_lists, short),
        )
        produced = sum(len(r) for r in m["result"].response_ids)
        stats = getattr(engine, "stats", {})
        steps = stats.get("decode_steps", longest)
        extra.update(
            {k: stats[k] for k in ("rows", "refills", "occupancy", "bucket_steps", "bucket_occupancy") if k in stats}
        )
        if args.lp_error == "on":
            extra["lp_err"] = logprob_error(model, prompt_lists, m["result"], args.shape)
        if reference is not None:
            extra["lp_drift"] = drift_by_position(model, reference, prompt_lists, m["result"], args.shape)
    rate = produced / m["seconds"]
    # every token reads the cache of its prompt and of the tokens before it; the call reads the weights once a step
    kv_reads = kv_token_reads([args.prompt_len] * batch, lengths) * kv_bytes_per_token
    bound = batch * bandwidth / weight_bytes if bandwidth else None
    bound_kv = total * bandwidth / (longest * weight_bytes + kv_reads) if bandwidth else None
    return {
        "batch": batch,
        "tokens": produced,
        "seconds": m["seconds"],
        "tokens_per_s": rate,
        "steps": steps,
        "ms_per_step": 1e3 * m["seconds"] / max(1, steps),
        "warmup_s": m["first_call_seconds"],
        "pct_bound": 100 * rate / bound if bound else None,
        "pct_bound_kv": 100 * rate / bound_kv if bound_kv else None,
        "bound_tokens_per_s": bound,
        "bound_kv_tokens_per_s": bound_kv,
        "peak_gib": m["peak_gib"],
        **extra,
    }


def _saved_model(args, dtype, device):
    """Load `--model-path` and register it as the shape "saved" (its config, tokenizer size, EOS and pad ids)."""
    from opd.models import load_model

    model, tokenizer = load_model(args.model_path, dtype=dtype, device=device)
    config = model.config
    SHAPES["saved"] = dict(
        num_hidden_layers=config.num_hidden_layers,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    TOKENIZER_SIZE["saved"] = len(tokenizer)
    EOS_ID["saved"], PAD_ID["saved"] = tokenizer.eos_token_id, tokenizer.pad_token_id
    args.shape = "saved"
    return model.eval()


if __name__ == "__main__":
    main()
