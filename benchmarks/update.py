"""Student update (forward + backward of the OPD policy loss): our chunked path (`forward_hidden` →
`candidate_logprobs` on 16 candidate ids per position → `policy_loss`) against the naive one (`model(...).logits` →
float32 `log_softmax` over [B, T, V] → gather the same ids → the same `policy_loss`).

    python benchmarks/update.py --shape qwen3-0.6b --batch 16 --prompt-len 128 --response-len 512 --ckpt on,off
    python benchmarks/update.py --shape tiny --device cpu --batch 2 --prompt-len 4 --response-len 8

Precision on CUDA: `--precision autocast` (default; the trainer's: float32 master weights, bf16 autocast) or `bf16`
(bf16 weights). The optimizer step is not timed (the same AdamW for both paths). `loss_err` and `grad_err` compare
the two paths after the last timed run: |Δloss| and ‖Δg‖ / ‖g‖ over the output embedding and a layer's MLP weight.

The naive rows always run eagerly (plain transformers); with `--compile on` the chunked path gets a compiled row too.

MFU = 6 · params · tokens/s / peak (tokens = B · (prompt + response), all of which run forward and backward; with
`--ragged` each row's response length is drawn and only real tokens count); with
gradient checkpointing the GPU really does ~8 · params FLOPs per token, so MFU understates its arithmetic rate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
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


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=16, help="sequences")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--response-len", type=int, default=512, help="trained response tokens per sequence")
    parser.add_argument("--candidates", type=int, default=16, help="candidate ids per position (J)")
    parser.add_argument(
        "--ckpt",
        default="on",
        help="gradient checkpointing, comma-separated rows: on (HF, every layer), off, selective "
        "(compiled rows only: `opd.models.activation_budget`, --budget of the activations kept)",
    )
    parser.add_argument("--budget", type=float, default=0.5, help="activation budget of --ckpt selective")
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="response lengths uniform in [response_len / 4, response_len] (right-padded rows)",
    )
    parser.add_argument(
        "--attn",
        default="sdpa",
        help="attention implementations of the chunked rows, comma-separated, a row each "
        "(opd_varlen / flex_attention / flash pack the rows into one sequence: no padding "
        "FLOPs); the naive rows use sdpa",
    )
    parser.add_argument("--precision", default="autocast", choices=["autocast", "bf16"], help="CUDA precision")
    parser.add_argument(
        "--compile",
        default=None,
        help="on, off or on,off: chunked rows with the decoder layers under torch.compile "
        "(`opd.models.compile_layers`, as `opd distill` on a GPU); default on,off on CUDA, off on CPU",
    )
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    flops, _ = peaks(device, args)
    cuda = device.type == "cuda"
    weights_dtype = torch.bfloat16 if cuda and args.precision == "bf16" else torch.float32
    autocast_dtype = torch.bfloat16 if cuda and args.precision == "autocast" else None
    model = build_model(args.shape, dtype=weights_dtype, device=device, seed=args.seed)
    params, vocab = param_count(model), TOKENIZER_SIZE[args.shape]
    report = Report(
        "update",
        args,
        device,
        shape=args.shape,
        precision=args.precision if cuda else "fp32",
        batch=args.batch,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        params=params,
        peak_flops=flops,
    )

    from opd.forward import forward_hidden, output_head
    from opd.objectives import policy_loss
    from opd.scoring import candidate_logprobs

    rollouts = random_rollouts(
        args.batch, args.prompt_len, args.response_len, vocab, device, args.seed, pad_id(args.shape), ragged=args.ragged
    )
    g = torch.Generator().manual_seed(args.seed + 1)
    shape_BTJ = (args.batch, args.response_len, args.candidates)
    candidates_BTJ = torch.randint(0, vocab, shape_BTJ, generator=g).to(device)
    candidates_BTJ[..., 0] = rollouts.response_ids  # the sampled token is a candidate, as in the trainer
    # random weights give near-uniform distributions: old log-probs near -log V keep the PPO ratio near 1 (unclipped,
    # so the gradient is not zero)
    old_lp_BTJ = (-torch.log(torch.tensor(float(vocab))) + 0.01 * torch.randn(shape_BTJ, generator=g)).to(device)
    advantages_BTJ = torch.randn(shape_BTJ, generator=g).to(device)
    valid_BTJ = torch.ones(shape_BTJ, dtype=torch.bool, device=device)
    mask_BT = rollouts.response_mask
    tokens = int(rollouts.attention_mask.sum())  # real tokens: padding is not useful work
    probes = {
        "output_embedding": model.get_output_embeddings().weight,
        "layer0.mlp.down": model.model.layers[0].mlp.down_proj.weight,
    }

    def autocast():
        from contextlib import nullcontext

        return torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()

    def ours():
        model.zero_grad(set_to_none=True)
        with autocast():  # the chunked head too, as in `opd_step`
            hidden = forward_hidden(model, rollouts)
            ids_NJ = candidates_BTJ[hidden.rows_N, hidden.cols_N]
            lp_NJ = candidate_logprobs(hidden.hidden_ND, output_head(model), ids_NJ, vocab_size=vocab)
        loss, _ = policy_loss(hidden.to_grid(lp_NJ), old_lp_BTJ, advantages_BTJ, valid_BTJ, mask_BT)
        loss.backward()
        return loss.detach()

    def naive():
        model.zero_grad(set_to_none=True)
        with autocast():
            logits_BLV = model(input_ids=rollouts.input_ids, attention_mask=rollouts.attention_mask.long()).logits
        lp_BTV = logits_BLV[:, args.prompt_len - 1 : -1, :vocab].float().log_softmax(-1)
        loss, _ = policy_loss(lp_BTV.gather(-1, candidates_BTJ), old_lp_BTJ, advantages_BTJ, valid_BTJ, mask_BT)
        loss.backward()
        return loss.detach()

    compile_modes = (args.compile or ("on,off" if cuda else "off")).split(",")
    if "on" in compile_modes:
        from opd.models import compile_layers

        compile_layers(model, True)
    from opd.models import activation_budget

    for ckpt in args.ckpt.split(","):
        if ckpt == "on":
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        model.train()
        kept = {}
        paths = [
            (
                f"chunked_candidates[{'compiled, ' if mode == 'on' else ''}ckpt {ckpt}"
                f"{'' if attn == 'sdpa' else ', ' + attn}]",
                ours,
                mode,
                attn,
            )
            for mode in compile_modes
            for attn in args.attn.split(",")
        ]
        paths.append((f"naive_full_logits[ckpt {ckpt}]", naive, "off", "sdpa"))
        budget = None
        if ckpt == "selective":  # only the compiled rows: the budget acts when a graph is compiled, so compile anew
            paths, budget = [p for p in paths if p[2] == "on"], args.budget
        if "selective" in args.ckpt.split(","):
            torch._dynamo.reset()
        for name, fn, mode, attn in paths:
            model.set_attn_implementation(attn)

            def row(fn=fn, mode=mode, budget=budget, ckpt=ckpt, kept=kept):
                with torch.compiler.set_stance("default" if mode == "on" else "force_eager"), activation_budget(budget):
                    m = measure(fn, device, warmup=args.warmup, repeat=args.repeat)
                rate = tokens / m["seconds"]
                out = {
                    "ckpt": ckpt,
                    "tokens": tokens,
                    "seconds": m["seconds"],
                    "tokens_per_s": rate,
                    "mfu_pct": 100 * 6 * params * rate / flops if flops else None,
                    "peak_gib": m["peak_gib"],
                }
                grads = {k: p.grad.detach().float().clone() for k, p in probes.items()}
                if kept:  # compare with the previous path on the same inputs and weights
                    out["loss_err"] = float((m["result"] - kept["loss"]).abs())
                    out["grad_err"] = max(
                        float((grads[k] - kept[k]).norm() / kept[k].norm().clamp(min=1e-30)) for k in grads
                    )
                kept.update(grads, loss=m["result"])
                return out

            report.run_row(name, row)
        model.zero_grad(set_to_none=True)
        speedups([r for r in report.data["rows"] if r.get("ckpt") == ckpt], f"naive_full_logits[ckpt {ckpt}]")
    columns = [
        ("row", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("× naive", "speedup", ".2f"),
        ("MFU %", "mfu_pct", ".1f"),
        ("peak GiB", "peak_gib", ".1f"),
        ("loss_err", "loss_err", ".1e"),
        ("grad_err", "grad_err", ".1e"),
    ]
    notes = [
        f"shape {args.shape}, {args.batch} × ({args.prompt_len} + {'≤ ' if args.ragged else ''}"
        f"{args.response_len}) tokens{' (ragged: tokens/s counts real tokens only)' if args.ragged else ''}, "
        f"{args.candidates} candidates per position, precision {report.data['precision']}, forward + backward "
        "(no optimizer step); loss_err/grad_err on the naive row compare it with the chunked row"
    ]
    return report.finish(columns, notes)


if __name__ == "__main__":
    main()
