"""Rollout throughput: our engines against Hugging Face `generate()`, one model, the same prompts, the same lengths.

    python benchmarks/rollout.py --shape qwen3-0.6b --batches 64,256 --new-tokens 512       # GPU
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
    static_sdpa         `static_compile` with SDPA attention over the bucketed span (`attention="sdpa"`, the
                        previous default)
    static_v1           `static_compile` as first measured: per-projection GEMMs on the module's own weights
                        (`fuse_weights=False`) and matmul/softmax/matmul attention (`attention="matmul"`)
    vllm                `VLLMGenerator`: vLLM in this process on a copy of the weights saved to a temporary directory
                        (eager on CPU, fp32; needs the vllm extra, e.g. the environment of `./dev setup-vllm`)
A saved model instead of a random shape: `--model-path DIR` (e.g. the lab's `src/opd/lab/assets/student`).
Every row samples at temperature 1 from distinct random prompts and produces exactly new_tokens tokens per row (EOS
off: `min_new_tokens` for generate, `stop_at_eos=False` for ours), one sample per prompt. Timed: one full call after
a short warm-up call of the same batch size (so compilation is outside the time, graph capture inside it, as it is
in training where every step captures anew). `lp_err` checks our engines: mean |reported log-prob - log-prob
recomputed by a teacher-forced forward| over all sampled tokens (bf16: ~1e-2 is rounding).

Bound: a decode step reads every weight once, so tokens/s ≤ rows · bandwidth / weight bytes (`pct_bound`); the
KV cache adds rows · (prompt + t) · 4 · layers · kv_heads · head_dim bytes per step (`bound_kv`, averaged over t).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    EOS_ID, PAD_ID, SHAPES, Report, base_parser, build_model, eos_id, measure, pad_id, param_bytes, peaks,
    resolve_device, speedups, TOKENIZER_SIZE,
)

ALL = ("hf_generate", "hf_generate_static", "hf_generate_nocudnn", "torch_engine", "static_engine", "static_compile",
       "static_sdpa", "static_v1", "vllm")


_VLLM_DIRS: dict[int, str] = {}


def make_engine(name: str, model, shape: str, batch: int):
    from opd.rollout.static_engine import StaticGenerator
    from opd.rollout.torch_engine import TorchGenerator

    if name == "vllm":
        import tempfile

        from opd.rollout.vllm_engine import VLLMGenerator

        if id(model) not in _VLLM_DIRS:  # vLLM loads weights from a directory: this model's, saved once
            _VLLM_DIRS[id(model)] = tempfile.mkdtemp(prefix="opd-bench-vllm-")
            model.save_pretrained(_VLLM_DIRS[id(model)])
        return VLLMGenerator(_VLLM_DIRS[id(model)], eos_token_ids=[eos_id(shape)], vocab_size=TOKENIZER_SIZE[shape],
                             max_batch_size=batch)
    common = dict(eos_token_ids=[eos_id(shape)], pad_token_id=pad_id(shape), vocab_size=TOKENIZER_SIZE[shape],
                  max_batch_size=batch)
    if name == "torch_engine":
        return TorchGenerator(model, **common)
    if name == "static_v1":
        return StaticGenerator(model, compile=True, cuda_graphs=True, fuse_weights=False, attention="matmul", **common)
    if name == "static_sdpa":
        return StaticGenerator(model, compile=True, cuda_graphs=True, attention="sdpa", **common)
    return StaticGenerator(model, compile=name == "static_compile", cuda_graphs=True, **common)


def logprob_error(model, prompts, output, shape: str) -> float:
    """Mean |engine log-prob - teacher-forced log-prob| over every sampled token (chunked scorer, no [B, T, V])."""
    from opd.rollout.batch import build_rollouts
    from opd.teacher.local import LocalScorer

    rollouts = build_rollouts(prompts, output, pad_id=pad_id(shape), device=next(model.parameters()).device)
    scores = LocalScorer(model, check_head=False, vocab_size=TOKENIZER_SIZE[shape]).score(
        rollouts, top_k=0, with_entropy=False)
    mask = rollouts.response_mask
    diff = (scores.sampled_logprobs - rollouts.rollout_logprobs).abs()[mask]
    return float(diff.mean())


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--batches", default="64,256", help="comma-separated rows per call; the first is the main one")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=512, help="generated tokens per row")
    parser.add_argument("--engines", default="hf_generate,torch_engine,static_engine,static_compile,hf_generate_static",
                        help=f"rows at the first batch size, in order; from {','.join(ALL)}")
    parser.add_argument("--engines-big", default="torch_engine,static_compile", help="rows at the other batch sizes")
    parser.add_argument("--model-path", default=None, help="a saved model directory instead of a random --shape")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    flops, bandwidth = peaks(device, args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path:
        model = _saved_model(args, dtype, device)
    else:
        model = build_model(args.shape, dtype=dtype, device=device, seed=args.seed)
    cfg = SHAPES[args.shape]
    weight_bytes = param_bytes(model)
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype.itemsize
    report = Report("rollout", args, device, shape=args.shape, dtype=str(dtype), weight_bytes=weight_bytes,
                    prompt_len=args.prompt_len, new_tokens=args.new_tokens, bandwidth=bandwidth)
    batches = [int(b) for b in args.batches.split(",")]
    jobs = [(batches[0], e) for e in args.engines.split(",") if e != "hf_generate_static"]
    jobs += [(b, e) for b in batches[1:] for e in args.engines_big.split(",")]
    if "hf_generate_static" in args.engines.split(","):
        jobs.append((batches[0], "hf_generate_static"))  # last: its compilation can take minutes
    g = torch.Generator().manual_seed(args.seed)
    prompts_by_batch = {b: torch.randint(3, TOKENIZER_SIZE[args.shape], (b, args.prompt_len), generator=g)
                        for b in dict.fromkeys(batches)}
    for batch, name in jobs:
        prompts = prompts_by_batch[batch]
        prompt_lists = prompts.tolist()
        mean_kv = batch * (args.prompt_len + args.new_tokens / 2) * kv_bytes_per_token
        bound = batch * bandwidth / weight_bytes if bandwidth else None
        bound_kv = batch * bandwidth / (weight_bytes + mean_kv) if bandwidth else None
        if name not in ALL:
            raise SystemExit(f"--engines: unknown row {name!r}; choose from {', '.join(ALL)}")
        if name in ("static_compile", "static_sdpa", "static_v1") and device.type != "cuda":
            continue  # compilation is CUDA-only; on CPU it would repeat static_engine

        def row(name=name, batch=batch, prompts=prompts, prompt_lists=prompt_lists):
            extra = {}
            if name.startswith("hf_generate"):
                ids, mask = prompts.to(device), torch.ones_like(prompts, device=device)
                kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id(args.shape),
                              eos_token_id=eos_id(args.shape))
                if name == "hf_generate_static":
                    kwargs["cache_implementation"] = "static"

                def call(n=args.new_tokens):
                    from contextlib import nullcontext

                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
                    with sdpa_kernel(backends) if name == "hf_generate_nocudnn" else nullcontext():
                        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kwargs)

                # the static cache's shape depends on max_new_tokens: warm up (compile) at the timed length
                short = None if name == "hf_generate_static" else (lambda: call(4))
                m = measure(call, device, warmup=args.warmup, repeat=args.repeat, warmup_fn=short)
                produced = (m["result"].shape[1] - args.prompt_len) * batch
            else:
                from opd.rollout import SamplingParams

                engine = make_engine(name, model, args.shape, batch)
                params = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new_tokens, stop_at_eos=False,
                                        seed=args.seed, return_logprobs=True)
                short = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, stop_at_eos=False, seed=args.seed)
                m = measure(lambda: engine.generate(prompt_lists, params), device, warmup=args.warmup,
                            repeat=args.repeat, warmup_fn=lambda: engine.generate(prompt_lists, short))
                produced = sum(len(r) for r in m["result"].response_ids)
                extra["lp_err"] = logprob_error(model, prompt_lists, m["result"], args.shape)
            rate = produced / m["seconds"]
            return {"batch": batch, "tokens": produced, "seconds": m["seconds"], "tokens_per_s": rate,
                    "ms_per_step": 1e3 * m["seconds"] / args.new_tokens, "warmup_s": m["first_call_seconds"],
                    "pct_bound": 100 * rate / bound if bound else None,
                    "pct_bound_kv": 100 * rate / bound_kv if bound_kv else None,
                    "bound_tokens_per_s": bound, "bound_kv_tokens_per_s": bound_kv, "peak_gib": m["peak_gib"],
                    **extra}

        report.run_row(f"{name}@{batch}", row)
    by_batch: dict[int, list] = {}
    for r in report.data["rows"]:
        by_batch.setdefault(int(r["name"].rsplit("@", 1)[1]), []).append(r)
    for batch, rows in by_batch.items():
        speedups(rows, f"hf_generate@{batch}")
    columns = [("row", "name", ""), ("tokens/s", "tokens_per_s", ",.0f"), ("× generate", "speedup", ".1f"),
               ("ms/step", "ms_per_step", ".2f"), ("% of weight-BW bound", "pct_bound", ".1f"),
               ("bound (weights) tok/s", "bound_tokens_per_s", ",.0f"),
               ("bound (+KV) tok/s", "bound_kv_tokens_per_s", ",.0f"), ("% of +KV bound", "pct_bound_kv", ".1f"),
               ("peak GiB", "peak_gib", ".1f"), ("warm-up s", "warmup_s", ".1f"), ("lp_err", "lp_err", ".2e")]
    weights = f"weights of {args.model_path}" if args.model_path else "random weights"
    notes = [f"shape {args.shape} ({dtype}), {weights}; prompt {args.prompt_len} tokens, {args.new_tokens} new "
             f"tokens per row, temperature 1, EOS off; weights {weight_bytes / 2**30:.2f} GiB"]
    return report.finish(columns, notes)


def _saved_model(args, dtype, device):
    """Load `--model-path` and register it as the shape "saved" (its config, tokenizer size, EOS and pad ids)."""
    from opd.models import load_model

    model, tokenizer = load_model(args.model_path, dtype=dtype, device=device)
    config = model.config
    SHAPES["saved"] = dict(num_hidden_layers=config.num_hidden_layers, num_key_value_heads=config.num_key_value_heads,
                           head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    TOKENIZER_SIZE["saved"] = len(tokenizer)
    EOS_ID["saved"], PAD_ID["saved"] = tokenizer.eos_token_id, tokenizer.pad_token_id
    args.shape = "saved"
    return model.eval()


if __name__ == "__main__":
    main()
