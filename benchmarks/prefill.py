"""The static engine's placement of samples: one prefill of their prompts, the copy of its keys/values into the
slots and the first token, packed (`packed_prefill=True`, the default under opd_varlen attention) against left-padded
prompts under a mask (issue 24: a partial-rollout stream prefills its continued samples again at every call).

    python benchmarks/prefill.py --shape qwen3-0.6b --samples 64 --prompt-lengths 128:7296          # GPU
    python benchmarks/prefill.py --shape tiny --device cpu --samples 6 --prompt-lengths 8:64 --repeat 1  # CPU smoke

Prompts: `--samples` distinct ones, lengths uniform in `--prompt-lengths LO:HI` (seeded): a stream's continued
samples are their prompt plus anything from a few to thousands of tokens. One `generate` call of one token each
(`max_new_tokens=1`, no decode step) with as many rows as samples, the model set to opd_varlen (as
`opd.models.load_model` does on CUDA), bf16 on CUDA. Tokens/s: prompt tokens / seconds (median of `--repeat`).
Compute bound: 2 · params + the causal attention's 2 · L · layers · heads · head size FLOPs per token of a prompt of
L tokens, at the dense bf16 peak. `--profile`: the ten CUDA kernels that took the most time in one call of each
layout. `--compiled`: a third layout, packed through the decoder layers compiled by `opd.models.compile_layers`
(`compiled_prefill=True`); its first call (warm-up) holds the compilation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    SHAPES,
    TOKENIZER_SIZE,
    Report,
    base_parser,
    build_model,
    eos_id,
    measure,
    pad_id,
    param_count,
    peaks,
    profiled,
    resolve_device,
)


def attention_flops(shape: str, lengths: list[int]) -> float:
    """Causal attention FLOPs of prompts of these lengths: QKᵀ and PV, half the square each."""
    spec = SHAPES[shape]
    width = spec["num_attention_heads"] * spec.get("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    return sum(2 * 2 * n * n / 2 * width for n in lengths) * spec["num_hidden_layers"]


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--samples", type=int, default=64, help="distinct prompts placed in one call")
    parser.add_argument("--prompt-lengths", default="128:7296", help="LO:HI, prompt lengths drawn uniformly")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="StaticGenerator prefill_tokens")
    parser.add_argument("--profile", action="store_true", help="print each layout's top CUDA kernels (CUDA only)")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="a third layout: packed through decoder layers compiled by compile_layers (compiled_prefill=True)",
    )
    args = parser.parse_args(argv)
    try:
        low, high = (int(x) for x in args.prompt_lengths.split(":"))
        assert 1 <= low <= high
    except (ValueError, AssertionError):
        raise SystemExit(f"--prompt-lengths must be LO:HI with 1 ≤ LO ≤ HI, got {args.prompt_lengths!r}") from None
    from opd.kernels import varlen_attention
    from opd.rollout import SamplingParams
    from opd.rollout.static_engine import StaticGenerator

    device = resolve_device(args.device)
    flops, _ = peaks(device, args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, dtype=dtype, device=device, seed=args.seed, attn_implementation="opd_varlen")
    assert model.config._attn_implementation == varlen_attention.ATTENTION
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(low, high + 1, (args.samples,), generator=generator).tolist()
    vocab = TOKENIZER_SIZE[args.shape]
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=1, stop_at_eos=False, seed=args.seed)
    tokens = sum(lengths)
    bound_s = (2 * param_count(model) * tokens + attention_flops(args.shape, lengths)) / flops if flops else None
    report = Report("prefill", args, device, shape=args.shape, dtype=str(dtype), samples=args.samples)
    profiles = {}
    layouts = [("packed", {"packed_prefill": True}), ("padded", {"packed_prefill": False})]
    if args.compiled:  # the eager layouts run these layers eagerly (force_eager), as the trainer's engine does
        from opd.models import compile_layers

        compile_layers(model, True, backend="inductor" if device.type == "cuda" else "aot_eager")
        layouts.append(("packed_compiled", {"packed_prefill": True, "compiled_prefill": True}))
    for name, layout in layouts:
        engine = StaticGenerator(
            model,
            eos_token_ids=[eos_id(args.shape)],
            pad_token_id=pad_id(args.shape),
            vocab_size=vocab,
            max_batch_size=args.samples,
            prefill_tokens=args.prefill_tokens,
            compile=False,
            cuda_graphs=False,
            **layout,
        )

        def call(engine=engine):
            engine.generate(prompts, params)
            return dict(engine.stats)

        def row(call=call, name=name) -> dict:
            result = measure(call, device, warmup=args.warmup, repeat=args.repeat)
            if args.profile and device.type == "cuda":
                profiles[name] = profiled(call, device)["table"]
            seconds = result["seconds"]
            return {
                "tokens_per_s": tokens / seconds,
                "seconds": seconds,
                "prefills": result["result"]["prefills"],
                "first_call_s": result["first_call_seconds"],
                "of_bound": bound_s / seconds if bound_s else None,
                "peak_gib": result["peak_gib"],
            }

        report.run_row(name, row)
    columns = [
        ("layout", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("seconds", "seconds", ".3f"),
        ("forwards", "prefills", "d"),
        ("first call s", "first_call_s", ".2f"),
        ("of compute bound", "of_bound", ".0%"),
        ("peak GiB", "peak_gib", ".1f"),
    ]
    notes = [
        f"shape {args.shape} ({dtype}), opd_varlen attention; {args.samples} prompts of {low}..{high} tokens "
        f"({tokens:,} in all), prefill_tokens {args.prefill_tokens}; one call of one token each"
    ]
    data = report.finish(columns, notes)
    for name, table in profiles.items():
        print(f"\n{name}: top CUDA kernels of one call\n{table}")
    return data


if __name__ == "__main__":
    main()
