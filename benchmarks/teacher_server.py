"""Served teacher vs local teacher: `RemoteScorer` → `opd serve-teacher` (another process, HTTP on loopback) against
`LocalScorer` in this process, on the same rows with the same weights, in one run.

    python benchmarks/teacher_server.py --shapes qwen3-1.7b,qwen3-4b --batch 32 --prompt-len 128 --response-len 512
    python benchmarks/teacher_server.py --shape lab --device cpu --batch 8 --prompt-len 16 --response-len 48

Every call scores all response positions of `--batch` rows: sampled-token log-probs, top-16 ids and log-probs,
log-probs at 16 requested ids and the entropy (what one OPD step asks of its teacher). Rows:

    local[shape]                 `LocalScorer.score` in this process (compiled layers on CUDA, as `opd distill`)
    served[shape, N clients]     N threads, each with its own `RemoteScorer` and its own rows, scoring at once
                                 against one server; tokens/s counts all clients' tokens over the wall time
    served[shape, 1 client, bf16 wire]   log-probs sent as bfloat16

`% of local` = tokens/s over the local row's; `added ms` = a served call's median latency minus the local call's
(1 client; with N clients each call also waits for the others'); `B/position` = request + response bytes on the
wire per scored position. The server runs on the same device as the local rows (one GPU: the trainer and the
teacher server share it, or the server has it to itself while the local row is idle).

The server process builds the same random-weight Qwen3 shape from the same seed (`common.build_model`, a
synthetic token→id map for /info), or loads the shipped lab teacher for `--shape lab`, and serves it with
`opd.teacher.server.service_for` + `run` (what `opd serve-teacher` runs after loading). Its forward budget equals
one client's batch, so the local and the served forwards have the same shapes;
`--request-tokens` (default: one request per call) is the client's split budget.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import threading
import time
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
    random_rollouts,
    resolve_device,
)

TOP_K = REQUESTED = 16


class _SyntheticVocab:
    """A token→id map for random-weight shapes (what /info hashes; nothing is ever tokenized)."""

    chat_template = None

    def __init__(self, size: int):
        self.size = size

    def get_vocab(self) -> dict[str, int]:
        return {f"<t{i}>": i for i in range(self.size)}


def build(shape: str, device: torch.device, seed: int):
    """(model, tokenizer-like, vocabulary size) of a shape; compiled layers on CUDA (as `opd distill`)."""
    from opd.models import compile_layers, load_model

    if shape == "lab":
        from opd.lab import teacher_path

        model, tokenizer = load_model(
            teacher_path(), dtype="fp32" if device.type == "cpu" else "auto", device=str(device)
        )
        vocab = len(tokenizer.get_vocab())
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_model(shape, dtype=dtype, device=device, seed=seed, attn_implementation="auto")
        vocab = TOKENIZER_SIZE[shape]
        tokenizer = _SyntheticVocab(vocab)
    model.requires_grad_(False)
    compile_layers(model, None)
    return model, tokenizer, vocab


def serve_main(args) -> None:
    """`--serve`: the server process (prints its URL on stdout, serves until terminated)."""
    from opd.config import ModelSpec
    from opd.recipes.serve_teacher import ServeConfig
    from opd.teacher.server import bind, run, service_for

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, tokenizer, _ = build(args.shape, device, args.seed)
    tokens = args.batch * (args.prompt_len + args.response_len)
    config = ServeConfig(
        model=ModelSpec(path=args.shape),
        forward_tokens=tokens,
        max_batch_tokens=tokens,
        max_request_bytes=1 << 30,
        max_inflight_bytes=1 << 30,
        max_rows=max(4096, args.batch),
        max_positions=max(65536, args.prompt_len + args.response_len),
    )
    service = service_for(model, tokenizer, config, name=args.shape, device=str(device))
    run(service, bind("127.0.0.1", 0), None)


def start_server(argv: list[str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, __file__, "--serve", *argv], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the server process exited ({process.wait()})")
        if "listening on " in line:
            return process, line.split("listening on ")[1].split()[0]
    raise RuntimeError("the server did not start within 600 s")


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-1.7b")
    parser.add_argument("--shapes", default=None, help="comma-separated shapes (lab = the shipped lab teacher)")
    parser.add_argument("--batch", type=int, default=32, help="rows per call (per client)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--response-len", type=int, default=512, help="scored response tokens per row")
    parser.add_argument("--clients", default="1,4", help="comma-separated client counts, a served row each")
    parser.add_argument("--request-tokens", type=int, default=None, help="client split budget; default one request")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads of both processes")
    parser.add_argument("--serve", action="store_true", help=argparse_suppress())
    for action in parser._actions:
        if action.dest == "shape":
            action.choices = sorted(SHAPES) + ["lab"]
    args = parser.parse_args(argv)
    if args.serve:
        serve_main(args)
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    from opd.teacher import wire
    from opd.teacher.local import LocalScorer

    device = resolve_device(args.device)
    shapes = (args.shapes or args.shape).split(",")
    clients = [int(c) for c in args.clients.split(",")]
    report = Report(
        "teacher_server",
        args,
        device,
        shapes=shapes,
        batch=args.batch,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        top_k=TOP_K,
        requested=REQUESTED,
    )
    tokens_per_call = args.batch * (args.prompt_len + args.response_len)

    for shape in shapes:
        model, _, vocab = build(shape, device, args.seed)
        local = LocalScorer(model, vocab_size=vocab, max_tokens_per_batch=tokens_per_call)
        pad = 0 if shape == "lab" else pad_id(shape)

        def inputs(seed: int, vocab=vocab, pad=pad):
            rollouts = random_rollouts(args.batch, args.prompt_len, args.response_len, vocab, device, seed, pad)
            g = torch.Generator().manual_seed(seed + 1)
            requested = torch.randint(0, vocab, (args.batch, args.response_len, REQUESTED), generator=g).to(device)
            return rollouts, requested

        rollouts, requested = inputs(args.seed)
        positions = int(rollouts.response_mask.sum())
        request = wire.request_from_rollouts(rollouts, requested)
        zeros = wire.ScoreResponse(
            torch.zeros(positions),
            torch.zeros(positions, TOP_K, dtype=torch.long),
            torch.zeros(positions, TOP_K),
            torch.zeros(positions),
            torch.zeros(positions, REQUESTED),
        )
        wire_bytes = {
            dtype: len(wire.encode_request(request)) + len(wire.encode_response(zeros, dtype))
            for dtype in wire.LOGPROB_DTYPES
        }
        score = dict(top_k=TOP_K, requested_ids=requested)
        base = {}

        def local_row(local=local, rollouts=rollouts, score=score, base=base, shape=shape):
            m = measure(lambda: local.score(rollouts, **score), device, warmup=args.warmup, repeat=args.repeat)
            base.update(seconds=m["seconds"], rate=tokens_per_call / m["seconds"], result=m["result"])
            return {
                "shape": shape,
                "clients": 0,
                "seconds": m["seconds"],
                "tokens_per_s": base["rate"],
                "pct_local": 100.0,
                "peak_gib": m["peak_gib"],
            }

        report.run_row(f"local[{shape}]", local_row)
        server_argv = [
            "--shape",
            shape,
            "--device",
            args.device,
            "--seed",
            str(args.seed),
            "--batch",
            str(args.batch),
            "--prompt-len",
            str(args.prompt_len),
            "--response-len",
            str(args.response_len),
        ]
        if args.threads:
            server_argv += ["--threads", str(args.threads)]
        process, url = start_server(server_argv)
        served_args = (inputs, score, args, tokens_per_call, base, wire_bytes, positions)  # served_row's, after clients
        try:
            for n in clients:
                report.run_row(
                    f"served[{shape}, {n} client{'s' if n > 1 else ''}]",
                    functools.partial(served_row, url, n, *served_args, "float32", shape),
                )
            report.run_row(
                f"served[{shape}, 1 client, bf16 wire]",
                functools.partial(served_row, url, 1, *served_args, "bfloat16", shape),
            )
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        local.model = None  # free this shape's weights before the next one
        del model
    columns = [
        ("row", "name", ""),
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("% of local", "pct_local", ".1f"),
        ("s per call", "seconds", ".3f"),
        ("added ms", "added_ms", ".1f"),
        ("B/position", "bytes_per_position", ".0f"),
        ("max err vs local", "max_err", ".1e"),
    ]
    notes = [
        f"{args.batch} × ({args.prompt_len} + {args.response_len}) tokens per call and client, top-{TOP_K} + "
        f"{REQUESTED} requested ids + entropy; served over loopback HTTP to a server process on the same "
        f"device; {'median of ' + str(args.repeat)} calls after {args.warmup} warm-up"
    ]
    return report.finish(columns, notes)


def served_row(url, clients, inputs, score, args, tokens_per_call, base, wire_bytes, positions, logprobs, shape):
    from opd.teacher.client import RemoteScorer

    scorers = [
        RemoteScorer(url, logprobs=logprobs, request_tokens=args.request_tokens or tokens_per_call)
        for _ in range(clients)
    ]
    batches = [inputs(args.seed + 1000 * c) for c in range(clients)]
    batches[0] = inputs(args.seed)  # client 0 scores the local row's inputs: its results are compared
    latencies: list[list[float]] = [[] for _ in range(clients)]
    results = [None] * clients
    start_barrier = threading.Barrier(clients + 1)
    errors = []

    def client(c: int) -> None:
        try:
            rollouts, requested = batches[c]
            for _ in range(args.warmup):
                scorers[c].score(rollouts, **{**score, "requested_ids": requested})
            start_barrier.wait()
            for _ in range(args.repeat):
                t = time.perf_counter()
                results[c] = scorers[c].score(rollouts, **{**score, "requested_ids": requested})
                if rollouts.input_ids.is_cuda:
                    torch.cuda.synchronize()
                latencies[c].append(time.perf_counter() - t)
        except Exception as error:  # reported as the row's error
            errors.append(error)
            start_barrier.abort()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start_barrier.wait()
    wall = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall
    for s in scorers:
        s.close()
    if errors:
        raise errors[0]
    rate = clients * args.repeat * tokens_per_call / wall
    median = statistics.median(latencies[0])
    a, b = results[0], base.get("result")
    max_err = None
    if b is not None:
        mask = batches[0][0].response_mask
        max_err = max(
            float((x - y)[mask].abs().max())
            for x, y in (
                (a.sampled_logprobs, b.sampled_logprobs),
                (a.topk_logprobs, b.topk_logprobs),
                (a.requested_logprobs, b.requested_logprobs),
                (a.entropy, b.entropy),
            )
        )
    return {
        "shape": shape,
        "clients": clients,
        "seconds": median,
        "tokens_per_s": rate,
        "pct_local": 100 * rate / base["rate"] if base else None,
        "added_ms": 1000 * (median - base["seconds"]) if base else None,
        "bytes_per_position": wire_bytes[logprobs] / positions,
        "max_err": max_err,
        "wire": logprobs,
    }


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
