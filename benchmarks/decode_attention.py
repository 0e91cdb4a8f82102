"""Decode attention alone: our Triton split-KV kernel against SDPA, one query token per row, Qwen3 head shapes.

    python benchmarks/decode_attention.py                                  # GPU: 0.6B heads, 64/256 rows
    python benchmarks/decode_attention.py --rows 64 --lengths 256,640 --splits 1,2,4,8
    python benchmarks/decode_attention.py --rows 160 --lengths ragged --ragged lognormal:mean=1700,cap=7168

Rows per (rows, length):
    sdpa_masked     what `StaticGenerator(attention="sdpa")` runs: SDPA with a 0/-inf mask over the step's span
                    rounded up to 128 slots (memory-efficient kernel, the only one taking a mask)
    sdpa_exact      SDPA over exactly `length` slots, no mask, `enable_gqa` (flash kernel): what a decode step could
                    do if every row had the same length and no left padding (a lower bound for torch kernels)
    triton[s]       `decode_attention` with s splits per row (`auto`: `default_splits` of the rows and the cache)
`--lengths ragged`: each row's valid slots drawn from `--ragged` (seeded; `common.parse_lengths`), as the rows of a
partial-rollout stream's decode step hold samples from the bare prompt to thousands of tokens: one program per (row,
kv head) and split, so without splits the longest rows set the kernel's end (`sdpa_exact` has no ragged form).
Each is replayed from a CUDA graph of 20 calls (as in the decode step), so launch overhead counts once per call, as it
does there. Bound: the keys and values of the valid slots, kv_heads · head_dim · 2 · 2 bytes per valid slot of
every row.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report, base_parser, parse_lengths, peaks, resolve_device

CALLS = 20


def graph_time(fn, repeat: int) -> float:
    """Seconds per call of fn, replayed CALLS times from one CUDA graph (median of `repeat` replays)."""
    fn()  # Triton compiles on the first call, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--rows", default="64,256", help="comma-separated batch rows")
    parser.add_argument(
        "--lengths", default="256,640,1152", help="comma-separated valid slots per row; `ragged`: drawn from --ragged"
    )
    parser.add_argument(
        "--ragged", default="lognormal:mean=1700,cap=7168", help="per-row valid slots for --lengths ragged"
    )
    parser.add_argument("--splits", default="auto,1,2,4,8", help="comma-separated splits for the Triton rows")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2, help="query heads per kv head (0.6B/1.7B: 2, 4B: 4)")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    try:  # bad input fails before the device is asked
        ragged = parse_lengths(args.ragged)
    except ValueError as error:
        raise SystemExit(f"--ragged {str(error).removeprefix('--lengths ')}") from None
    if any(spec != "ragged" and not spec.isdigit() for spec in args.lengths.split(",")):
        raise SystemExit(f"--lengths {args.lengths!r}: expected comma-separated integers or `ragged`")
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise SystemExit("decode_attention.py times CUDA kernels; it needs a GPU")
    from opd.kernels.decode_attention import decode_attention, default_splits

    _, bandwidth = peaks(device, args)
    report = Report(
        "decode_attention", args, device, kv_heads=args.kv_heads, groups=args.groups, head_dim=args.head_dim
    )
    kv, groups, dh, scale = args.kv_heads, args.groups, args.head_dim, args.head_dim**-0.5
    for rows in map(int, args.rows.split(",")):
        for spec in args.lengths.split(","):
            lengths = ragged.sample(rows, args.seed) if spec == "ragged" else [int(spec)] * rows
            length = max(lengths)
            capacity = length + 128
            q = torch.randn(rows, kv, groups, dh, device=device, dtype=torch.bfloat16)
            keys = torch.randn(rows, kv, capacity, dh, device=device, dtype=torch.bfloat16)
            values = torch.randn_like(keys)
            start = torch.zeros(rows, dtype=torch.long, device=device)
            last = torch.as_tensor(lengths, device=device) - 1  # per row
            span = min(capacity, -(-length // 128) * 128)
            bias = torch.zeros(rows, span, dtype=torch.bfloat16, device=device)
            for r, n in enumerate(lengths):
                bias[r, n:] = float("-inf")
            bias = bias[:, None, None].expand(rows, kv, groups, span)
            candidates = {
                "sdpa_masked": lambda q=q, keys=keys, values=values, span=span, bias=bias: (
                    F.scaled_dot_product_attention(
                        q, keys[:, :, :span], values[:, :, :span], attn_mask=bias, scale=scale
                    )
                ),
            }
            if spec != "ragged":
                q_heads = q.reshape(rows, kv * groups, 1, dh)
                exact_k, exact_v = keys[:, :, :length], values[:, :, :length]
                candidates["sdpa_exact"] = lambda q_heads=q_heads, k=exact_k, v=exact_v: F.scaled_dot_product_attention(
                    q_heads, k, v, scale=scale, enable_gqa=True
                )
            for splits in args.splits.split(","):
                count = default_splits(rows, kv, device, capacity) if splits == "auto" else int(splits)
                candidates[f"triton[{splits}={count}]" if splits == "auto" else f"triton[{count}]"] = (
                    lambda q=q, keys=keys, values=values, start=start, last=last, count=count: decode_attention(
                        q, keys, values, start, last, scale, splits=count
                    )
                )
            bytes_read = kv * sum(lengths) * dh * 2 * 2
            label = f"ragged max {length} mean {sum(lengths) / rows:.0f}" if spec == "ragged" else str(length)
            for name, fn in candidates.items():

                def row(fn=fn, rows=rows, label=label, bytes_read=bytes_read):
                    seconds = graph_time(fn, args.repeat * 5)
                    return {
                        "rows": rows,
                        "length": label,
                        "us": round(seconds * 1e6, 2),
                        "tb_per_s": round(bytes_read / seconds / 1e12, 3),
                        "pct_bandwidth": round(100 * bytes_read / seconds / bandwidth, 1) if bandwidth else None,
                    }

                report.run_row(f"{name} R={rows} L={label}", row)
    return report.finish(
        [
            ("row", "name", ""),
            ("µs per call", "us", ".1f"),
            ("TB/s", "tb_per_s", ".2f"),
            ("% of bandwidth", "pct_bandwidth", ".1f"),
        ],
        [f"bandwidth {bandwidth / 1e12:.2f} TB/s; keys+values of the valid slots per call"],
    )


if __name__ == "__main__":
    main()
