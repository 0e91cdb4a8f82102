"""What a teacher's answer costs: bytes per scored position and scoring throughput for top-16 ids + log-probs,
any-ids (16 requested log-probs), hidden states (bf16, the head fetched once) and full logits, in process and over
loopback HTTP (`opd serve-teacher`'s app in a thread of this process), in one run and one table.

    python benchmarks/teacher_bytes.py                       # CPU, a random-weight Qwen3 of V = 32,768, E = 256
    python benchmarks/teacher_bytes.py --vocab 151936 --hidden 1536 --device cuda --dtype bfloat16 --batch 64

Rows (measured): `B/position` is the encoded answer on the wire (`opd.teacher.wire`), `positions/s` a whole
`score` call (forward, head, wire) over `--batch` rows, the median of `--repeats`. Full logits have no route (that is
the point): their bytes are V × 4 (float32) and their in-process row times materialising and soft-maxing `[N, V]`.
Then the analytic table at the real pair's and the paper's teacher shapes (bytes only) and the crossover K above
which hidden states cost fewer bytes than top-K (`opd.teacher.base.crossover_k`), which `teacher.answer: auto` uses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table
from opd.teacher import wire
from opd.teacher.base import (
    HiddenStateScorer,
    crossover_k,
    score_bytes_per_position,
    scores_from_hidden,
)
from opd.teacher.local import LocalScorer
from opd.types import Rollouts

K = Q = 16
ANALYTIC = {  # teacher shapes: (hidden size E, vocabulary V)
    "real pair teacher (E 1,536)": (1536, 151936),
    "paper's Qwen3-4B teacher": (2560, 151936),
}


class _Vocab:
    chat_template = None

    def __init__(self, size: int):
        self.size = size

    def get_vocab(self) -> dict[str, int]:
        return {f"<t{i}>": i for i in range(self.size)}


def build(vocab: int, hidden: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(2, hidden // 128)  # the real teachers' 128-dim heads (E 1,536: 12; Qwen3-4B's E 2,560: 20 here)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device, dtype).eval().requires_grad_(False)


def rollouts(batch: int, prompt: int, response: int, vocab: int, device: torch.device) -> Rollouts:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, prompt + response), generator=g)
    return Rollouts(
        ids,
        torch.ones(batch, prompt + response, dtype=torch.bool),
        torch.full((batch,), prompt),
        ids[:, prompt:].clone(),
        torch.ones(batch, response, dtype=torch.bool),
        torch.arange(batch),
        torch.zeros(batch, dtype=torch.bool),
    ).to(device)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a call's GPU work is inside its time, not the next one's
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def served(model, vocab: int):
    """(url, server, thread) of the app over `model` on a loopback port, in a thread of this process."""
    from opd.config import ModelSpec
    from opd.recipes.serve_teacher import ServeConfig
    from opd.teacher.server import bind, make_server, service_for, url_of

    config = ServeConfig(
        model=ModelSpec(path="bench"),
        max_request_bytes=1 << 30,
        max_inflight_bytes=1 << 30,
        max_rows=4096,
        max_batch_tokens=1 << 20,
        max_queue_tokens=1 << 21,
        forward_tokens=1 << 16,
    )
    service = service_for(model, _Vocab(vocab), config, name="bench", device="cpu")
    sock = bind("127.0.0.1", 0)
    server = make_server(service, None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return url_of(sock), server, thread


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the teacher's weights")
    args = parser.parse_args(argv)
    from opd.teacher.client import RemoteScorer

    device = torch.device(args.device)
    model = build(args.vocab, args.hidden, device, getattr(torch, args.dtype))
    local = LocalScorer(model, vocab_size=args.vocab, max_tokens_per_batch=1 << 16)
    batch = rollouts(args.batch, args.prompt_len, args.response_len, args.vocab, device)
    positions = int(batch.response_mask.sum())
    student_topk = torch.randint(0, args.vocab, (*batch.response_ids.shape, Q), generator=torch.Generator()).to(device)
    mask = batch.response_mask
    head = local.output_head()

    def scores_bytes(scores) -> float:
        return len(wire.encode_response(wire.response_from_scores(scores, mask))) / positions

    def full_logits() -> None:
        hidden = local.hidden_states(batch)[mask]
        torch.log_softmax(torch.nn.functional.linear(hidden, head.weight).float(), -1)

    top16 = dict(top_k=K, requested_ids=student_topk)
    any_ids = dict(top_k=0, requested_ids=student_topk)
    rows = []
    in_process = [
        ("top-16 ids + log-probs", lambda: local.score(batch, **top16), scores_bytes(local.score(batch, **top16))),
        ("any-ids (16 requested)", lambda: local.score(batch, **any_ids), scores_bytes(local.score(batch, **any_ids))),
        (
            "hidden states (bf16) → top-16 here",
            lambda: scores_from_hidden(local.hidden_states(batch).to(torch.bfloat16), head, batch, **top16),
            len(wire.encode_hidden(local.hidden_states(batch)[mask], "bfloat16")) / positions,
        ),
        ("full logits (float32)", full_logits, 4.0 * args.vocab),
    ]
    for name, fn, nbytes in in_process:
        rows.append({"where": "in process", "name": name, "bytes": nbytes, "pps": positions / timed(fn, args.repeats)})
    url, server, thread = served(model, args.vocab)
    try:
        remote = RemoteScorer(url, retry_deadline=0, request_tokens=1 << 16)
        from_hidden = HiddenStateScorer(remote)
        served_rows = [
            (
                "top-16 ids + log-probs",
                lambda: remote.score(batch, **top16),
                scores_bytes(remote.score(batch, **top16)),
            ),
            (
                "any-ids (16 requested)",
                lambda: remote.score(batch, **any_ids),
                scores_bytes(remote.score(batch, **any_ids)),
            ),
            (
                "hidden states (bf16) → top-16 here",
                lambda: from_hidden.score(batch, **top16),
                len(wire.encode_hidden(remote.hidden_states(batch)[mask], "bfloat16")) / positions,
            ),
        ]
        for name, fn, nbytes in served_rows:
            pps = positions / timed(fn, args.repeats)
            rows.append({"where": "loopback HTTP", "name": name, "bytes": nbytes, "pps": pps})
        rows.append({"where": "loopback HTTP", "name": "full logits (float32)", "bytes": 4.0 * args.vocab})
        remote.close()
    finally:
        server.should_exit = True
        thread.join(15)
    print(
        f"measured: V = {args.vocab:,}, E = {args.hidden}, {args.batch} rows × {args.response_len} positions, "
        f"{args.device}, float32 weights; head resident: {head.weight.numel() * head.weight.element_size():,} B"
    )
    print(
        markdown_table(
            rows,
            [
                ("where", "where", ""),
                ("answer", "name", ""),
                ("B/position", "bytes", ",.0f"),
                ("positions/s", "pps", ",.0f"),
            ],
        )
    )
    analytic = []
    for label, (e, v) in {**ANALYTIC, f"this run (E {args.hidden})": (args.hidden, args.vocab)}.items():
        analytic.append(
            {
                "shape": label,
                "top16": score_bytes_per_position(K, Q),
                "any": score_bytes_per_position(0, Q),
                "hidden": 2 * e,
                "full": 4 * v,
                "ratio": 4 * v / (2 * e),
                "k": crossover_k(e),
            }
        )
    print()
    print(
        markdown_table(
            analytic,
            [
                ("teacher shape", "shape", ""),
                ("top-16 + 16 requested (B)", "top16", ",d"),
                ("any-ids, 16 (B)", "any", ",d"),
                ("hidden bf16 (B)", "hidden", ",d"),
                ("full logits fp32 (B)", "full", ",d"),
                ("full / hidden", "ratio", ".0f"),
                ("crossover K", "k", "d"),
            ],
        )
    )
    return rows


if __name__ == "__main__":
    main()
