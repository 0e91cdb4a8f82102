"""Teacher scoring: our `LocalScorer` (chunked top-k + requested ids + entropy from hidden states) against the naive
full-logits path (`model(...).logits` → float32 `log_softmax` over [B, T, V] → topk / gather / entropy).

    python benchmarks/teacher_score.py --shapes qwen3-1.7b,qwen3-4b --batch 32 --prompt-len 128 --response-len 512
    python benchmarks/teacher_score.py --shape tiny --device cpu --batch 2 --prompt-len 4 --response-len 8

Both rows compute the same `TokenScores` for every response position (log-prob of the sampled token, top-16 ids
and log-probs, log-probs at 16 requested ids, entropy), in bf16 on GPU, over the tokenizer's vocabulary; `max_err`
is the largest absolute difference between the two rows' log-probs and entropies, `topk_agree` the fraction of
equal top-k ids (ties at bf16 resolution can swap neighbours).

tokens/s counts every real input position (B · (prompt + response) unless `--ragged`, which draws each row's
response length and right-pads: then padding is not counted); the compute bound is 2 · params FLOPs per token,
`pct_peak` = 2 · params · tokens/s / peak.

The compiled row takes the top-k in two stages (`opd.scoring._piece_topk`); `--torch-topk` adds the same row with one
`torch.topk` over the whole rows (the previous code) for comparison.

`--compile on,off` (default on CUDA) adds a row with the decoder layers under `torch.compile`
(`opd.models.compile_layers`, what `opd distill` does on a GPU); the eager rows run with
`torch.compiler.set_stance("force_eager")`. The naive row is always eager (plain transformers).
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
    measure,
    pad_id,
    param_count,
    peaks,
    random_rollouts,
    resolve_device,
    speedups,
)


def naive_scores(model, rollouts, requested_BTR, top_k: int, vocab: int):
    """The obvious implementation: full logits, float32 log-softmax over [B, T, V], then pick."""
    from opd.types import TokenScores

    prompt = int(rollouts.prompt_lengths[0])  # every row has the same prompt length here
    logits_BLV = model(input_ids=rollouts.input_ids, attention_mask=rollouts.attention_mask.long()).logits
    lp_BTV = logits_BLV[:, prompt - 1 : -1, :vocab].float().log_softmax(-1)
    del logits_BLV
    sampled_BT = lp_BTV.gather(-1, rollouts.response_ids[..., None]).squeeze(-1)
    topk_lp_BTK, topk_ids_BTK = lp_BTV.topk(top_k, dim=-1)
    requested_BTR = lp_BTV.gather(-1, requested_BTR)
    entropy_BT = -(lp_BTV.exp() * lp_BTV).sum(-1)
    return TokenScores(sampled_BT, topk_ids_BTK, topk_lp_BTK, entropy_BT, requested_BTR)


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-1.7b")
    parser.add_argument("--shapes", default=None, help="comma-separated shapes, one model at a time (default --shape)")
    parser.add_argument("--batch", type=int, default=32, help="sequences")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--response-len", type=int, default=512, help="scored response tokens per sequence")
    parser.add_argument("--top-k", type=int, default=16, help="teacher top-k (and number of requested ids)")
    parser.add_argument("--torch-topk", action="store_true", help="add the compiled row with torch.topk")
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="response lengths uniform in [response_len / 4, response_len] (right-padded rows)",
    )
    parser.add_argument(
        "--attn",
        default="sdpa",
        help="comma-separated attention implementations for our rows, e.g. sdpa,opd_varlen "
        "(opd_varlen/flash/flex pack the rows into one sequence: no padding FLOPs)",
    )
    parser.add_argument(
        "--compile", default=None, help="on, off or on,off (a row each); default on,off on CUDA, off on CPU"
    )
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    flops, _ = peaks(device, args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = (args.shapes or args.shape).split(",")
    report = Report(
        "teacher_score",
        args,
        device,
        shapes=shapes,
        dtype=str(dtype),
        batch=args.batch,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        top_k=args.top_k,
        peak_flops=flops,
    )
    from opd.models import compile_layers
    from opd.teacher.local import LocalScorer

    compile_modes = (args.compile or ("on,off" if device.type == "cuda" else "off")).split(",")

    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        model = build_model(shape, dtype=dtype, device=device, seed=args.seed).requires_grad_(False)
        params, vocab = param_count(model), TOKENIZER_SIZE[shape]
        rollouts = random_rollouts(
            args.batch, args.prompt_len, args.response_len, vocab, device, args.seed, pad_id(shape), ragged=args.ragged
        )
        g = torch.Generator().manual_seed(args.seed + 1)
        requested_BTR = torch.randint(0, vocab, (args.batch, args.response_len, args.top_k), generator=g).to(device)
        tokens = int(rollouts.attention_mask.sum())  # real tokens: padding is not useful work
        scorer = LocalScorer(
            model, vocab_size=vocab, max_tokens_per_batch=args.batch * (args.prompt_len + args.response_len)
        )  # one forward
        results = {}

        def finish(m, key, results=results, tokens=tokens, shape=shape, params=params, model=model):
            results[key] = m["result"]
            rate = tokens / m["seconds"]
            return {
                "shape": shape,
                "tokens": tokens,
                "seconds": m["seconds"],
                "tokens_per_s": rate,
                "pct_peak": 100 * 2 * params * rate / flops if flops else None,
                "peak_gib": m["peak_gib"],
                "weights_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
            }

        def ours(mode, scorer=scorer, rollouts=rollouts, requested_BTR=requested_BTR, finish=finish):
            stance = "default" if mode == "on" else "force_eager"
            with torch.compiler.set_stance(stance):
                m = measure(
                    lambda: scorer.score(rollouts, top_k=args.top_k, requested_ids=requested_BTR),
                    device,
                    warmup=args.warmup,
                    repeat=args.repeat,
                )
            row = finish(m, "ours")
            row["compile_first_call_s"] = m["first_call_seconds"] if mode == "on" else None
            return row

        def naive(
            model=model, rollouts=rollouts, requested_BTR=requested_BTR, vocab=vocab, results=results, finish=finish
        ):
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                m = measure(
                    lambda: naive_scores(model, rollouts, requested_BTR, args.top_k, vocab),
                    device,
                    warmup=args.warmup,
                    repeat=args.repeat,
                )
            row = finish(m, "naive")
            if "ours" in results:  # agreement with our last row on the same inputs, at the real positions
                a, b = results["ours"], results["naive"]
                mask = rollouts.response_mask
                row["max_err"] = max(
                    float((x - y)[mask].abs().max())
                    for x, y in (
                        (a.sampled_logprobs, b.sampled_logprobs),
                        (a.topk_logprobs, b.topk_logprobs),
                        (a.requested_logprobs, b.requested_logprobs),
                        (a.entropy, b.entropy),
                    )
                )
                row["topk_agree"] = float((a.topk_ids == b.topk_ids)[mask].float().mean())
            return row

        if "on" in compile_modes:
            compile_layers(model, True)
        for attn in args.attn.split(","):
            if attn != "sdpa":
                model.set_attn_implementation(attn)
            suffix = "" if attn == "sdpa" else f", {attn}"
            for mode in compile_modes:
                report.run_row(
                    f"local_scorer[{shape}{', compiled' if mode == 'on' else ''}{suffix}]",
                    lambda mode=mode, ours=ours: ours(mode),
                )
        model.set_attn_implementation("sdpa")
        if args.torch_topk and "on" in compile_modes:
            import opd.scoring

            piece, opd.scoring._TOPK_PIECE = opd.scoring._TOPK_PIECE, 1 << 30  # one piece: a plain torch.topk
            report.run_row(f"local_scorer[{shape}, compiled, torch.topk]", lambda ours=ours: ours("on"))
            opd.scoring._TOPK_PIECE = piece
        report.run_row(f"naive_full_logits[{shape}]", naive)
        speedups([r for r in report.data["rows"] if r.get("shape") == shape], f"naive_full_logits[{shape}]")
        del model, scorer, rollouts, results, finish, ours, naive  # the functions hold this shape's model too
    columns = [
        ("row", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("× naive", "speedup", ".2f"),
        ("% of peak FLOPs", "pct_peak", ".1f"),
        ("peak GiB", "peak_gib", ".1f"),
        ("weights GiB", "weights_gib", ".1f"),
        ("max_err", "max_err", ".2e"),
        ("top-k agree", "topk_agree", ".3f"),
    ]
    notes = [
        f"{args.batch} × ({args.prompt_len} + {'≤ ' if args.ragged else ''}{args.response_len}) tokens"
        f"{' (ragged: tokens/s counts real tokens only)' if args.ragged else ''}, top-{args.top_k} + "
        f"{args.top_k} requested ids + entropy, {dtype}, random weights; max_err / top-k agree on the naive row "
        "compare it with ours"
    ]
    return report.finish(columns, notes)


if __name__ == "__main__":
    main()
