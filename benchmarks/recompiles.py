"""Does the update's compiled graph recompile on a new packed size? The real pair's field check (docs/performance.md)
met one: inductor's mix-order reduction guarded on the packed token count (rows × hidden ≥ 5 Mi), so the warm-up's
packed micro-batch, above it, did not serve a smaller one. This runs the update's forward + backward (packed rows,
`forward_hidden`, autocast, activation budget 0.5, as the trainer does) at a series of packed sizes either side of
the threshold and prints, per size, the graphs it compiled and its seconds.

    python benchmarks/recompiles.py --shape qwen3-0.6b                  # compile_layers' options (opd's default)
    python benchmarks/recompiles.py --shape qwen3-0.6b --inductor-default   # inductor's defaults: the guard

One process per mode: torch.compile's caches are process-wide.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, build_model, pad_id  # noqa: E402
from opd.forward import forward_hidden  # noqa: E402
from opd.models import activation_budget, compile_layers  # noqa: E402
from opd.rollout.batch import random_rollouts  # noqa: E402
from opd.train.common import autocast  # noqa: E402
from opd.train.step import compiled_graphs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (all share one compiled graph)")
    parser.add_argument("--sizes", default="12000,3000,8000,1500,16000", help="packed tokens per micro-batch")
    parser.add_argument("--inductor-default", action="store_true", help="compile without compile_layers' options")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    SHAPES[args.shape] = dict(SHAPES[args.shape], num_hidden_layers=args.layers)
    model = build_model(args.shape, dtype=torch.float32, device=device, attn_implementation="auto")
    if args.inductor_default:
        for layer in model.get_decoder().layers:
            layer.compile(dynamic=True)
    else:
        compile_layers(model, True)
    model.train()
    hidden_size = model.config.hidden_size
    print(
        f"{args.shape} ({args.layers} layers, hidden {hidden_size}), attention {model.config._attn_implementation}, "
        f"{'inductor defaults' if args.inductor_default else 'compile_layers options'}; "
        f"threshold rows x hidden >= 5 Mi: {5 * 2**20 / hidden_size:.0f} tokens"
    )
    print(f"{'tokens':>7} {'graphs':>6} {'seconds':>8}")
    prompt = list(range(10, 74))
    for index, tokens in enumerate(int(n) for n in args.sizes.split(",")):
        # three ragged rows of the 64-token prompt, packed into one sequence of `tokens`
        response = (tokens - 3 * 64) // 2
        lengths = [response, response // 2, tokens - 3 * 64 - response - response // 2]
        rollouts = random_rollouts(
            prompt, lengths, vocab_size=model.config.vocab_size, pad_id=pad_id(args.shape), seed=index, device=device
        )
        before, start = compiled_graphs(), time.perf_counter()
        with autocast(device, torch.bfloat16), activation_budget(0.5):
            hidden = forward_hidden(model, rollouts, packing="packed")
            hidden.hidden_ND.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        print(f"{sum(lengths) + 3 * 64:>7} {compiled_graphs() - before:>6} {time.perf_counter() - start:>8.1f}")


if __name__ == "__main__":
    main()
