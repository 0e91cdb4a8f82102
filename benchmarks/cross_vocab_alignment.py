"""The cost of a cross-vocabulary teacher's alignment (`opd.teacher.cross_vocab`), CPU: ms per 1,000 student tokens
of `_align` (decode to bytes, one batched teacher encode, byte-offset spans, the span tensors), against the obvious
alternative, a per-row character-offset alignment through the tokenizers' own `offset_mapping` (two encodes per row,
Python loops over the offsets).

Tokenizers: a byte-level BPE (the student, GPT-2 / Qwen style) and a SentencePiece-style BPE with byte fallback (the
teacher, Gemma style), both trained here with the `tokenizers` library on the MATH-500 problems (no downloads);
responses are the problems re-encoded by the student, tiled to `--tokens` tokens per row. The share of a step is this
cost against a step's tokens: docs/performance.md puts the figure beside the real pair's step.

    PYTHONPATH=src python benchmarks/cross_vocab_alignment.py --rows 64 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from opd.teacher.cross_vocab import _align, build_cross_vocab
from opd.types import Rollouts

DATA = Path(__file__).resolve().parents[1] / "src" / "opd" / "eval" / "data" / "MATH-500.parquet"
SPECIALS = ("<|endoftext|>", "<|im_end|>")


def _texts(path: Path) -> list[str]:
    rows = pq.read_table(path).to_pylist()
    return [r["prompt"][-1]["content"] for r in rows]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def byte_bpe(texts: list[str], size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return _wrap(tok)


def sentencepiece(texts: list[str], size: int) -> PreTrainedTokenizerFast:
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, show_progress=False))
    vocab = dict(trained.get_vocab())
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _wrap(tok)


def _rollouts(student, texts: list[str], rows: int, tokens: int) -> Rollouts:
    stream = student("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    response_BT = torch.tensor(
        [stream[b * tokens : (b + 1) * tokens - 1] + [student.eos_token_id] for b in range(rows)]
    )
    B, T = response_BT.shape
    return Rollouts(
        input_ids=response_BT,
        attention_mask=torch.ones_like(response_BT, dtype=torch.bool),
        prompt_lengths=torch.zeros(B, dtype=torch.long),
        response_ids=response_BT,
        response_mask=torch.ones_like(response_BT, dtype=torch.bool),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )


def offsets_alignment(student, teacher, rollouts: Rollouts) -> int:
    """The alternative: per row, decode, then both tokenizers' character offsets, spans by a two-pointer walk."""
    spans = 0
    for row in rollouts.response_ids.tolist():
        text = student.decode(row[:-1])
        s_off = student(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        t_off = teacher(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        i = j = 0
        while i < len(s_off) and j < len(t_off):
            if s_off[i][1] == t_off[j][1]:
                spans += 1
                i += 1
                j += 1
            elif s_off[i][1] < t_off[j][1]:
                i += 1
            else:
                j += 1
    return spans


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    texts = _texts(args.data) * 8
    student, teacher = byte_bpe(texts, args.vocab), sentencepiece(texts, args.vocab)
    start = time.perf_counter()
    cross = build_cross_vocab(student, teacher, student_eos_ids=[student.eos_token_id])
    build_s = time.perf_counter() - start
    rollouts = _rollouts(student, texts, args.rows, args.tokens)
    tokens = int(rollouts.response_mask.sum())
    lengths = rollouts.response_mask.sum(-1).tolist()
    ours = _time(lambda: _align(cross, rollouts.response_ids, lengths, [0] * args.rows), args.repeats)
    theirs = _time(lambda: offsets_alignment(student, teacher, rollouts), args.repeats)
    aligned = _align(cross, rollouts.response_ids, lengths, [0] * args.rows)
    one = float((aligned.one_to_one_BT >= 0).float().mean())
    result = {
        "rows": args.rows,
        "tokens_per_row": args.tokens,
        "student_vocab": len(student),
        "teacher_vocab": len(teacher),
        "exact_map": cross.overlap,
        "one_to_one_frac": round(one, 4),
        "build_s": round(build_s, 3),
        "ours_ms_per_1k": round(1000 * ours / tokens * 1000, 3),
        "offsets_ms_per_1k": round(1000 * theirs / tokens * 1000, 3),
        "torch_threads": torch.get_num_threads(),
    }
    print("| path | ms / 1,000 tokens |\n| --- | --- |")
    print(f"| `_align` (bytes, one batched encode, numpy spans) | {result['ours_ms_per_1k']} |")
    print(f"| per-row character offsets (two encodes, Python walk) | {result['offsets_ms_per_1k']} |")
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
