"""Partial-rollout stream throughput and the static engine's decode step at each live-row bucket (issue 24).

    python benchmarks/rollout_stream.py --shape qwen3-0.6b --batches 256 --lengths lognormal:mean=1500,cap=7168 \\
        --stream-steps 20 --repeat 1                                                              # GPU
    python benchmarks/rollout_stream.py --shape tiny --device cpu --batches 8 --new-tokens 16 --stream-steps 3 \\
        --bucket-steps 32 --repeat 1                                                              # CPU smoke run

Stream (`rollout.partial`): `opd.train.stream.RolloutStream` driven as `opd.train.step._stream_rollouts` drives it,
over a random-weight model whose weights stay fixed (no training: throughput only), with the engine `--engine`
(`static_compile` as the trainer's static engine runs on CUDA, `static_packed` = it with packed prefills,
`static_engine` on CPU) sized to `--batches` rows. A
step trains `--batches` samples (`--batches / --n` prompts × `--n`); `--max-staleness S` (default 1) and `--segment`
(default the trainer's rule, `opd.train.stream.default_segment`), `--early-stop on|off` (rollout.partial_early_stop,
default off); `--configs S/on|off[/segment],…` runs several streams one after another in this process (one row each,
the per-step rows labelled; the `[equal]` row once). EOS is off; `--lengths` as in rollout.py, per sample: a sample's
total response length is drawn once when it starts (again when it is restarted), each call asks the engine for the
rest of it (capped by the segment, through `max_new_tokens_per_sample`), and a sample that reaches it is reported
finished ("stop", standing in for its EOS). The stream's calls give each sample only its prefix, so the length
follows it by that prefix (prompt + tokens so far). Tokens/s: trained tokens / wall time of the steps after the first
`--stream-warmup` (default S + 1, at least 2: step 0 starts S + 1 batches at once and the first steps pay the compiles;
step S is the first with tokens S steps old and trains the backlog of the start, 83 s against ~45 on an H200 at S = 2,
docs/performance.md; each of `--configs` by its own S); `[equal]`: the same
engine in one call of `--batches` rows at the trained mean length (rollout.py's equal-length row, `run_row`), and
`vs equal` their ratio (the issue's target ≥ 0.85; the bandwidth bound of the stream's own tokens, `KV bound tok/s`, is
what a long tail allows). Per step: calls, dropped, in flight, trained tokens by lag 0..S, decode steps
(`--phase-times`: the time and prefill tokens of the engine's placements), graphs `torch.compile` compiled during the
step (a call with a new row count compiles the step functions for it; before step 0 the decode step is compiled at
every count the calls can meet, as the trainer's warm-up does: `decode_warm_up_rows` / `decode_warm_up_s`).

Buckets: for each row count b (`--bucket-sizes`; auto: the powers of two below the stream's slot count, that count
and every bucket the stream's calls decoded at; the engine's own buckets are the ones ≥ 4), two calls of exactly b
rows, all of one length (EOS off): 1 + I and 1 + I + K tokens (I the engine's sync interval, K `--bucket-steps`
rounded up to I); ms/step = the difference of their times (alternated, the fastest of `--repeat` each) over the
difference of their decode steps (engine stats), so that prefill and graph capture cancel.
`stream decode steps`: the stream's decode steps at that bucket (all steps, warm-up included). Context: the prompt
plus ≤ 1 + I + K tokens, so the attention reads little cache; a long-tailed call's late steps attend over thousands
of positions and cost more.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    TOKENIZER_SIZE,
    Report,
    base_parser,
    build_model,
    forced_stop_rule,
    kv_bytes_per_token,
    kv_token_reads,
    markdown_table,
    measure,
    param_bytes,
    parse_lengths,
    peak_gib,
    peaks,
    reset_memory,
    resolve_device,
    sync,
)
from rollout import make_engine, run_row

ENGINES = ("static_compile", "static_splits1", "static_packed", "static_packed_compiled", "static_engine")
_COMPILED_LAYERS: set[int] = set()  # models whose decoder layers static_packed_compiled compiled


def stream_engine(name: str, model, shape: str, rows: int, *, cap: int = 7168, prompt_len: int = 128, **options):
    """rollout.py's engine `name` with left-padded prefills; static_packed: static_compile with packed prefills
    (the engine's default on a model set to opd_varlen, named here so that each stream says which it ran);
    static_packed_compiled: packed prefills through the model's decoder layers compiled (`rollout.compiled_prefill`;
    the layers compiled as `opd distill` compiles them, aot_eager on a CPU), their graphs warmed up as its warm-up
    does over prompts of `prompt_len` plus up to `cap` tokens."""
    if name == "static_packed_compiled":
        from opd.models import compile_layers
        from opd.train.step import warm_up_prefills

        if id(model) not in _COMPILED_LAYERS:  # in place, once per model: every stream of the process shares them
            compile_layers(model, True, backend="inductor" if model.device.type == "cuda" else "aot_eager")
            _COMPILED_LAYERS.add(id(model))
        engine = make_engine(
            "static_compile", model, shape, rows, packed_prefill=True, compiled_prefill=True, **options
        )
        warm_up_prefills(engine, list(range(3, 3 + prompt_len)), cap, TOKENIZER_SIZE[shape])
        return engine
    packed = name == "static_packed"
    return make_engine("static_compile" if packed else name, model, shape, rows, packed_prefill=packed, **options)


def warm_up_decode(engine, samples: int, max_staleness: int, prompt_len: int, cap: int) -> tuple[list[int], float]:
    """The trainer's decode warm-up for a stream (`opd.train.step.engine_warm_up_rows`): the decode step compiled at
    every row count the stream's calls can meet, the counts the free memory caps them to included, before its first
    step, so that no step compiles it. Returns the counts (none where the step does not compile) and the seconds."""
    from opd.rollout import SamplingParams
    from opd.train.step import engine_warm_up_rows
    from opd.train.stream import in_flight_batches

    if not engine.compiles_decode():
        return [], 0.0
    start = time.perf_counter()
    in_flight = in_flight_batches(max_staleness, 0) * samples
    rows = engine_warm_up_rows(  # least_new_tokens 1: forced lengths end a sample's call anywhere
        engine, in_flight, stream=True, prompt_lengths=[prompt_len], new_tokens=cap, least_new_tokens=1
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=cap, stop_at_eos=False, return_logprobs=True)
    engine.warm_up_decode(list(range(3, 3 + prompt_len)), params, rows)  # sampled as stream_generate samples
    seconds = time.perf_counter() - start
    print(
        f"[rollout_stream] decode step warmed up at {len(rows)} row counts ({rows[0]} to {rows[-1]}) in "
        f"{seconds:.1f} s",
        flush=True,
    )
    return rows, seconds


class ForcedLengths:
    """Total response lengths drawn per sample attempt (seeded, in order of starts), and each running sample's total
    keyed by its prefix (prompt + tokens so far), so that the length follows the sample across calls."""

    def __init__(self, spec: str, cap: int, seed: int):
        self.dist = None if spec == "equal" else parse_lengths(spec)
        self.cap, self.seed = cap, seed
        self.drawn: list[int] = []
        self.chunks = 0
        self.by_prefix: dict[tuple[int, ...], list[int]] = {}

    def draw(self) -> int:
        if self.dist is None:
            return self.cap
        if not self.drawn:
            self.drawn = self.dist.sample(4096, self.seed + 7919 * self.chunks)[::-1]
            self.chunks += 1
        return self.drawn.pop()

    def total(self, prefix: list[int], prompt_len: int) -> int:
        """The total length of the sample with this prefix: a new draw when it has no tokens yet."""
        waiting = self.by_prefix.get(tuple(prefix))
        if waiting:
            return waiting.pop()
        if len(prefix) != prompt_len:
            raise RuntimeError(f"a continued sample ({len(prefix) - prompt_len} tokens) has no drawn length")
        return self.draw()

    def carry(self, prefix: list[int], total: int) -> None:
        self.by_prefix.setdefault(tuple(prefix), []).append(total)


def stream_generate(engine, forced: ForcedLengths, prompt_len: int, cap: int, seed: int, counters: dict):
    """The `generate(prompt_ids, n, max_new_tokens, call, stop_when, caps)` closure of one step: one engine call
    (seed + call) with per-sample limits min(the stream's cap, the sample's remaining forced length); rows that reach
    their forced length end "stop"."""
    from dataclasses import replace

    from opd.rollout import SamplingParams

    def generate(prompt_ids, n, max_new_tokens, call, stop_when, caps):
        rows = [list(p) for p in prompt_ids for _ in range(n)]
        totals = [forced.total(r, prompt_len) for r in rows]
        caps = caps or [max_new_tokens] * len(rows)
        limits = [min(c, t - (len(r) - prompt_len)) for r, t, c in zip(rows, totals, caps)]
        # the stream's stop rule (--early-stop) sees the reasons reported below: a row at its forced total is "stop"
        stops = [limit == t - (len(r) - prompt_len) and t < cap for r, t, limit in zip(rows, totals, limits)]
        rule = forced_stop_rule(stop_when, stops)

        params = SamplingParams(
            n=n,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
            stop_at_eos=False,
            seed=seed + call,
            return_logprobs=True,
        )
        out = engine.generate(prompt_ids, params, max_new_tokens_per_sample=limits, stop_when=rule)
        reasons = []
        for r, total, ids, reason in zip(rows, totals, out.response_ids, out.finish_reasons):
            done = len(r) - prompt_len + len(ids)
            if done < total:
                forced.carry(r + ids, total)
            reasons.append("stop" if done >= total and total < cap else reason)
        stats = engine.stats
        counters["generated"] += sum(len(ids) for ids in out.response_ids)
        counters["rows"] = max(counters["rows"], stats.get("rows", 0))
        counters["decode_steps"] += stats.get("decode_steps", 0)
        for b, steps in stats.get("bucket_steps", {}).items():
            counters["bucket_steps"][b] = counters["bucket_steps"].get(b, 0) + steps
        return replace(out, finish_reasons=reasons)

    return generate


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a step that compiles a new row count shows here)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def time_placements(counters: dict, device, on: bool = True):
    """--phase-times: within the block, the static engine's placement of samples into slots (the prefill forward of
    their prompts or prefixes, the copy of its keys/values into the cache, the first token) runs between synchronised
    timers, so that a step's time splits into placing and decoding (the synchronisation costs a little of both)."""
    from opd.rollout.static_engine import _Run

    if not on:
        yield
        return
    place = _Run._place

    def timed_place(run, group, samples, slots):
        sync(device)
        start = time.perf_counter()
        place(run, group, samples, slots)
        sync(device)
        counters["place_s"] += time.perf_counter() - start
        real = sum(len(run.prompts[p]) for p in group)
        padded = len(group) * max(len(run.prompts[p]) for p in group)
        counters["place_tokens"] += real if run.engine.packed_prefill else padded
        counters["place_real_tokens"] += real

    _Run._place = timed_place
    try:
        yield
    finally:
        _Run._place = place


def kv_bound(args, model, device, lengths: list[int], rows: int) -> dict:
    """The bandwidth bound of decoding these samples (any schedule): every token reads the keys and values of its
    prompt and the tokens before it, and each step of `rows` rows reads the weights once. A long-tailed length
    distribution puts most tokens late in long samples, so its tokens read more cache than those of equal lengths at
    the same mean (rollout.py's `bound_kv`)."""
    _, bandwidth = peaks(device, args)
    if not bandwidth or not lengths or not rows:
        return {}
    kv_bytes = kv_bytes_per_token(args.shape, next(model.parameters()).dtype.itemsize)
    read = kv_token_reads([args.prompt_len] * len(lengths), lengths) * kv_bytes
    seconds = (read + sum(lengths) / rows * param_bytes(model)) / bandwidth
    return {"bound_kv_tokens_per_s": sum(lengths) / seconds}


def stream_configs(args) -> list:
    """The streams to run, in order, in this process (the model and compiled step functions shared): `--configs`
    (`S/on|off[/segment]`, comma-separated), else the one of `--max-staleness`, `--early-stop`, `--segment`."""
    import argparse

    def warmed(config: argparse.Namespace) -> argparse.Namespace:
        warmup = config.stream_warmup
        if warmup is None:
            warmup = max(2, config.max_staleness + 1)
        if 0 < config.stream_steps <= warmup:
            raise SystemExit(f"--stream-steps {config.stream_steps} ≤ the stream's warm-up {warmup}: no step timed")
        return argparse.Namespace(**{**vars(config), "stream_warmup": warmup})

    if not args.configs:
        return [warmed(args)]
    configs = []
    for spec in args.configs.split(","):
        parts = spec.strip().split("/")
        if len(parts) not in (2, 3) or not parts[0].isdigit() or parts[1] not in ("on", "off"):
            raise SystemExit(f"--configs: {spec!r} is not S/on|off[/segment] (e.g. 2/on or 1/off/3584)")
        if len(parts) == 3 and not (parts[2].isdigit() and int(parts[2]) >= 1):
            raise SystemExit(f"--configs: segment {parts[2]!r} in {spec!r} is not an integer ≥ 1")
        segment = int(parts[2]) if len(parts) == 3 else None
        configs.append(
            warmed(
                argparse.Namespace(
                    **{**vars(args), "max_staleness": int(parts[0]), "early_stop": parts[1], "segment": segment}
                )
            )
        )
    return configs


def run_stream(args, report: Report, model, device, name: str, label: str = "") -> dict:
    """`--stream-steps` steps of the stream; one per-step row at a time in `report.data["steps"]`; the summary."""
    from opd.train.stream import RolloutStream, default_segment

    samples = args.batches
    cap = args.new_tokens if args.lengths == "equal" else parse_lengths(args.lengths).cap
    segment = args.segment or default_segment(cap, args.max_staleness, 0, args.early_stop == "on")
    stream = RolloutStream(
        prompts_per_step=samples // args.n,
        n=args.n,
        max_new_tokens=cap,
        segment=segment,
        max_staleness=args.max_staleness,
        early_stop=args.early_stop == "on",
    )
    engine = stream_engine(
        name,
        model,
        args.shape,
        args.rows or samples,
        cap=cap,
        prompt_len=args.prompt_len,
        **({"sync_interval": args.sync_interval} if args.sync_interval else {}),
    )
    warm_up_rows, warm_up_s = warm_up_decode(engine, samples, args.max_staleness, args.prompt_len, cap)
    forced = ForcedLengths(args.lengths, cap, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts: list[list[int]] = []  # grows as the stream draws

    def draw() -> list[int]:
        start = len(prompts)
        prompts.extend(
            torch.randint(3, TOKENIZER_SIZE[args.shape], (samples // args.n, args.prompt_len), generator=g).tolist()
        )
        return list(range(start, len(prompts)))

    counters = {
        "generated": 0,
        "rows": 0,
        "bucket_steps": {},
        "decode_steps": 0,
        "place_s": 0.0,
        "place_tokens": 0,
        "place_real_tokens": 0,
    }
    steps = [row for row in report.data.setdefault("steps", []) if row.get("config") == label]
    timed = {"tokens": 0, "seconds": 0.0, "generated": 0, "samples": 0, "dropped": 0}
    lag_tokens = [0] * (args.max_staleness + 1)
    reset_memory(device)
    for step in range(args.stream_steps):
        step_seed = args.seed + 100_003 * (step + 1)
        generate = stream_generate(engine, forced, args.prompt_len, cap, step_seed, counters)
        before = {k: counters[k] for k in ("generated", "decode_steps", "place_s", "place_tokens", "place_real_tokens")}
        compiles_before = compiled_graphs()
        sync(device)
        start = time.perf_counter()
        with time_placements(counters, device, on=args.phase_times):
            taken = stream.next_batch(step, draw, prompts, generate)
        sync(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for ids in taken.output.response_ids)
        lags = torch.bincount(
            step - torch.tensor([v for versions in taken.versions for v in versions], dtype=torch.long),
            minlength=args.max_staleness + 1,
        ).tolist()
        row = {
            "config": label,
            "step": step,
            "timed": step >= args.stream_warmup,
            "calls": taken.calls,
            "dropped": taken.dropped,
            "in_flight": stream.in_flight,
            "cut_total": stream.cut,
            "trained": len(taken.output.response_ids),
            "tokens": tokens,
            **{k: counters[k] - v for k, v in before.items()},
            "compiles": compiled_graphs() - compiles_before,
            "rows": counters["rows"],  # the engine's widest call so far (kept per step: a run cut short still has it)
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            **{f"lag_{k}": lags[k] if k < len(lags) else 0 for k in range(args.max_staleness + 1)},
            "lengths": [len(ids) for ids in taken.output.response_ids],
        }
        steps.append(row)
        report.data["steps"].append(row)
        report.write()
        print(
            f"[{report.name}] step {step}: {tokens:,} tokens in {seconds:.2f} s, calls {taken.calls}, "
            f"dropped {taken.dropped}, in flight {stream.in_flight}" + ("" if row["timed"] else " (warm-up)"),
            flush=True,
        )
        if row["timed"]:
            for key in ("tokens", "seconds", "generated", "dropped"):
                timed[key] += row[key]
            timed["samples"] += row["trained"]
            for k in range(args.max_staleness + 1):
                lag_tokens[k] += row[f"lag_{k}"]
    bound = kv_bound(
        args, model, device, [n for row in steps if row["timed"] for n in row["lengths"]], counters["rows"]
    )
    rate = timed["tokens"] / timed["seconds"]
    return {
        "batch": samples,
        "segment": segment,
        "max_staleness": args.max_staleness,
        "timed_steps": args.stream_steps - args.stream_warmup,
        "tokens": timed["tokens"],
        "seconds": timed["seconds"],
        "tokens_per_s": rate,
        "generated_per_s": timed["generated"] / timed["seconds"],
        "mean_len": timed["tokens"] / max(1, timed["samples"]),
        "dropped": timed["dropped"],
        "dropped_total": stream.dropped,
        "started_total": stream.started,
        "trained_total": stream.trained,
        "in_flight": stream.in_flight,
        "cut_total": stream.cut,
        "early_stop": args.early_stop,
        "rows": counters["rows"],
        "decode_warm_up_rows": warm_up_rows,
        "decode_warm_up_s": warm_up_s,
        "bucket_steps": dict(sorted(counters["bucket_steps"].items(), reverse=True)),
        **{f"lag_{k}_frac": n / max(1, timed["tokens"]) for k, n in enumerate(lag_tokens)},
        **bound,
        "pct_bound_kv": 100 * rate / bound["bound_kv_tokens_per_s"] if bound else None,
        "peak_gib": peak_gib(device),
    }


def bucket_rows(args, model, device, name: str, slots: int, stream_steps: dict) -> list[dict]:
    """ms per decode step at each row count up to `slots` (see the module docstring)."""
    from opd.rollout import SamplingParams

    if args.bucket_sizes != "auto":
        sizes = [int(b) for b in args.bucket_sizes.split(",")]
    else:
        sizes = sorted({1 << k for k in range(slots.bit_length()) if 1 << k < slots} | set(stream_steps) | {slots})
    g = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for b in sizes:
        engine = stream_engine("static_packed" if name == "static_packed_compiled" else name, model, args.shape, b)
        prompts = torch.randint(3, TOKENIZER_SIZE[args.shape], (b, args.prompt_len), generator=g).tolist()
        interval = engine.sync_interval
        short, long = 1 + interval, 1 + interval * (1 + math.ceil(args.bucket_steps / interval))

        def call(tokens: int, engine=engine, prompts=prompts):
            params = SamplingParams(n=1, max_new_tokens=tokens, stop_at_eos=False, seed=args.seed)
            engine.generate(prompts, params)
            return engine.stats["decode_steps"]

        call(short)  # warm-up: compiles this row count (CUDA) once per process
        # alternated, the fastest of each: the least disturbed by the host
        times = {short: [], long: []}
        steps = {}
        for _ in range(args.repeat):
            for tokens in (short, long):
                m = measure(partial(call, tokens), device, warmup=0, repeat=1)
                times[tokens].append(m["seconds"])
                steps[tokens] = m["result"]
        ms = 1e3 * (min(times[long]) - min(times[short])) / (steps[long] - steps[short])
        rows.append(
            {
                "rows": b,
                "ms_per_step": ms,
                "row_tokens_per_s": 1e3 * b / ms,
                "steps_timed": steps[long] - steps[short],
                "stream_decode_steps": stream_steps.get(b),
            }
        )
    base = rows[0]["ms_per_step"]
    for row in rows:
        row["vs_smallest"] = row["ms_per_step"] / base
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-0.6b")
    parser.add_argument("--batches", type=int, default=256, help="samples a step trains (prompts × n); engine slots")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sample")
    parser.add_argument("--new-tokens", type=int, default=512, help="response length with --lengths equal")
    parser.add_argument("--lengths", default="equal", help="equal, or lognormal:mean=M,cap=C[,sigma=S] (per sample)")
    parser.add_argument("--stream-steps", type=int, default=20, help="stream steps, the warm-up ones included; 0: none")
    parser.add_argument(
        "--stream-warmup",
        type=int,
        default=None,
        help="first stream steps left out of the tokens/s; default max_staleness + 1, at least 2",
    )
    parser.add_argument("--max-staleness", type=int, default=1, help="rollout.max_staleness")
    parser.add_argument("--segment", type=int, default=None, help="rollout.partial_segment; default the trainer's")
    parser.add_argument(
        "--phase-times", action="store_true", help="time the engine's placements (prefill + cache copy) per step"
    )
    parser.add_argument(
        "--configs",
        default="",
        help="streams to run one after another in this process: S/on|off[/segment],… (max_staleness, early stop, "
        "segment); default the one of --max-staleness, --early-stop, --segment",
    )
    parser.add_argument("--rows", type=int, default=None, help="the stream engine's slots; default --batches")
    parser.add_argument("--sync-interval", type=int, default=None, help="the engine's sync_interval (its default)")
    parser.add_argument(
        "--early-stop", choices=("on", "off"), default="off", help="rollout.partial_early_stop (the stream's calls)"
    )
    parser.add_argument("--bucket-steps", type=int, default=128, help="decode steps timed per bucket row; 0: no table")
    parser.add_argument(
        "--bucket-sizes", default="auto", help="comma-separated row counts of the bucket table; auto: see the docstring"
    )
    parser.add_argument("--engine", default="static_compile", choices=ENGINES, help="static_compile: CUDA only")
    parser.add_argument(
        "--attention",
        default="auto",
        help="the model's attention: auto (as opd.models.load_model picks: opd_varlen on CUDA, sdpa elsewhere), or a "
        "transformers name; --engine static_packed needs opd_varlen",
    )
    parser.add_argument("--lp-error", choices=("on", "off"), default="off", help="lp_err of the [equal] row")
    args = parser.parse_args(argv)
    if args.batches % args.n:
        raise SystemExit(f"--batches {args.batches} is not a multiple of --n {args.n}")
    configs = stream_configs(args)  # a malformed --configs fails before the model is built
    device = resolve_device(args.device)
    _, bandwidth = peaks(device, args)
    # the engine's compilation is CUDA-only; the layers' (static_packed_compiled) runs on a CPU through aot_eager
    name = args.engine if device.type == "cuda" or args.engine == "static_packed_compiled" else "static_engine"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, dtype=dtype, device=device, seed=args.seed, attn_implementation=args.attention)
    weight_bytes = param_bytes(model)
    kv_bytes = kv_bytes_per_token(args.shape, dtype.itemsize)
    report = Report(
        "rollout_stream",
        args,
        device,
        shape=args.shape,
        dtype=str(dtype),
        engine=name,
        attention=model.config._attn_implementation,
        prompt_len=args.prompt_len,
        lengths=args.lengths,
    )
    stream_rows: list[dict] = []
    for config in configs if args.stream_steps else []:
        label = f"S{config.max_staleness} early {config.early_stop}" + (
            f" segment {config.segment}" if config.segment else ""
        )
        suffix = f" {label}" if args.configs else ""
        stream_rows.append(
            report.run_row(
                f"stream[{name}@{args.batches}{suffix}]",
                lambda config=config, label=label: run_stream(config, report, model, device, name, label),
            )
        )
    stream_row = next((row for row in stream_rows if "error" not in row), {})
    if stream_row:
        equal = round(stream_row["mean_len"])
        prompts = torch.randint(
            3,
            TOKENIZER_SIZE[args.shape],
            (args.batches, args.prompt_len),
            generator=torch.Generator().manual_seed(args.seed),
        )
        equal_row = report.run_row(
            f"{name}@{args.batches}[equal]",
            lambda: run_row(
                args,
                "static_compile" if name.startswith("static_packed") else name,  # equal prompts: nothing to pack
                model,
                None,
                device,
                prompts,
                [equal] * args.batches,
                forced=True,
                weight_bytes=weight_bytes,
                bandwidth=bandwidth,
                kv_bytes_per_token=kv_bytes,
            ),
        )
        for row in stream_rows:
            if equal_row.get("tokens_per_s") and row.get("tokens_per_s"):
                row["vs_equal"] = row["tokens_per_s"] / equal_row["tokens_per_s"]
    if args.bucket_steps:
        slots = stream_row.get("rows") or args.batches
        buckets = bucket_rows(args, model, device, name, slots, stream_row.get("bucket_steps", {}))
        report.data["buckets"] = buckets
        report.data["bucket_table"] = markdown_table(
            buckets,
            [
                ("rows", "rows", ""),
                ("ms/step", "ms_per_step", ".3f"),
                ("× smallest", "vs_smallest", ".2f"),
                ("row-tokens/s", "row_tokens_per_s", ",.0f"),
                ("steps timed", "steps_timed", ","),
                ("stream decode steps", "stream_decode_steps", ","),
            ],
        )
    most_stale = max(config.max_staleness for config in configs)
    lags = [(f"lag {k}", f"lag_{k}_frac", ".2f") for k in range(most_stale + 1)]
    columns = [
        ("row", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("vs equal", "vs_equal", ".2f"),
        ("tokens", "tokens", ","),
        ("seconds", "seconds", ".2f"),
        ("mean_len", "mean_len", ".0f"),
        ("rows", "rows", ""),
        ("timed steps", "timed_steps", ""),
        ("generated/s", "generated_per_s", ",.0f"),
        ("dropped", "dropped_total", ","),
        ("cut", "cut_total", ","),
        *lags,
        ("KV bound tok/s", "bound_kv_tokens_per_s", ",.0f"),
        ("% of it", "pct_bound_kv", ".0f"),
        ("peak GiB", "peak_gib", ".1f"),
    ]
    streams = "; ".join(
        f"max_staleness {row.get('max_staleness')}, segment {row.get('segment')}, early stop {row.get('early_stop')}, "
        f"timed steps {args.stream_steps - row.get('timed_steps', 0)}..{args.stream_steps - 1}"
        for row in stream_rows
    )
    notes = [
        f"shape {args.shape} ({dtype}), random fixed weights, engine {name}, attention "
        f"{model.config._attn_implementation}; prompt {args.prompt_len} tokens, lengths "
        f"{args.lengths} per sample (new-tokens {args.new_tokens} if equal), temperature 1, EOS off; stream: "
        f"{args.batches // args.n} prompts × {args.n} a step, {streams}, "
        "tokens/s over the timed steps (trained tokens / wall time); lag k: "
        "trained tokens sampled k steps before their step; dropped: restarted samples over the whole stream; cut: "
        "samples a call ended early returned unfinished"
    ]
    data = report.finish(columns, notes)
    extra = []
    if report.data.get("steps"):
        data["steps_table"] = markdown_table(
            report.data["steps"],
            [
                *([("config", "config", "")] if args.configs else []),
                ("step", "step", ""),
                ("timed", "timed", ""),
                ("calls", "calls", ""),
                ("dropped", "dropped", ","),
                ("in flight", "in_flight", ","),
                ("cut total", "cut_total", ","),
                ("trained", "trained", ","),
                ("tokens", "tokens", ","),
                ("generated", "generated", ","),
                ("compiles", "compiles", ","),
                ("decode steps", "decode_steps", ","),
                *(
                    [
                        ("place s", "place_s", ".2f"),
                        ("place tokens", "place_tokens", ","),
                        ("of them real", "place_real_tokens", ","),
                    ]
                    if args.phase_times
                    else []
                ),
                ("seconds", "seconds", ".2f"),
                ("tokens/s", "tokens_per_s", ",.0f"),
                *[(f"lag {k} tokens", f"lag_{k}", ",") for k in range(most_stale + 1)],
            ],
        )
        extra += ["\nstream, per step:", data["steps_table"]]
    if "bucket_table" in data:
        extra += [
            f"\ndecode step by live rows ({name}, equal lengths, difference of two calls):",
            data["bucket_table"],
        ]
    report.write()
    if extra:
        print(*extra, sep="\n", flush=True)
    return data


if __name__ == "__main__":
    main()
