"""The lab's model and data builders: the teacher/student architectures, a random-init lab model, the SFT set as
chat JSONL, the rewrite-style share of answers, the import of a checkpoint from another lab vocabulary, and the move
of one onto the digit-pair vocabulary (the cross-tokenizer lab teacher's start: `rehome_on_digit_pairs`).

The programs that use them (`opd lab build`, `opd lab run`) are `opd.recipes.lab`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from opd.io import give_umask_modes, read_jsonl, write_jsonl
from opd.lab import SFT_SET, test_set_path
from opd.lab.task import (
    Style,
    make_problems,
    messages,
    solve,
    solve_first_line_off_by_one,
    style_of,
    to_sft_examples,
)
from opd.lab.tokenizer import SPECIAL_TOKENS, build_lab_tokenizer

TEACHER_ARCH: dict[str, int] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 512,
}
STUDENT_ARCH: dict[str, int] = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "intermediate_size": 384,
}


def lab_model_config(arch: dict[str, int], tokenizer: Any):
    """A Qwen3 config for the lab tokenizer: tied embeddings, head_dim = hidden / heads, 256 positions."""
    # one dict: rope_theta is a keyword the config takes at run time but its signature (rope_parameters) does not list
    options: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        num_key_value_heads=arch["num_attention_heads"],
        head_dim=arch["hidden_size"] // arch["num_attention_heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
        **arch,
    )
    return Qwen3Config(**options)


def init_model(arch: dict[str, int], out_dir: str | Path, *, seed: int) -> Path:
    """A random-init lab model (seeded) saved with save_pretrained, with the lab tokenizer and generation config."""
    tokenizer = build_lab_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(lab_model_config(arch, tokenizer))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    give_umask_modes(out_dir)  # safetensors writes its files 0600
    return out_dir


def write_sft_data(path: str | Path, *, style: Style = "forward", n: int | None = None) -> Path:
    """The SFT set (`SFT_SET` problems, `style` solutions) as chat JSONL, written atomically."""
    spec = dict(SFT_SET, n=n or SFT_SET["n"])
    write_jsonl(path, to_sft_examples(make_problems(**spec), style=style))
    return Path(path)


DOMAINS: dict[str, tuple[str, ...]] = {"add": ("+", "-"), "mul": ("*",)}
"""The lab task split in two domains by the problem's first operation (`add`: it starts with + or -, `mul`: with *):
the MOPD specialists' domains, the `data_source` (`opd_lab/<domain>`) of MOPD_PROMPTS and the routes of
configs/lab_mopd.yaml."""
MOPD_PROMPTS = "mopd_prompts.jsonl"
"""assets/data/mopd_prompts.jsonl: the OPD prompts (opd_prompts.jsonl) with data_source `opd_lab/<domain>`."""


def domain_of(expression: str) -> str:
    """The domain (a DOMAINS key) of a lab problem, from its expression (`((3*4)+2)-5` starts with `3*4`: mul)."""
    op = expression.lstrip("(")[1]
    for name, ops in DOMAINS.items():
        if op in ops:
            return name
    raise ValueError(f"{expression!r} starts with no operation of a lab domain {DOMAINS}")


def specialist_examples(domain: str, *, n: int | None = None) -> list[dict[str, Any]]:
    """The SFT set of the `domain` specialist: the `SFT_SET` problems (the first `n`) with forward-style solutions
    where the problem is in `domain` and systematically wrong ones where it is in the other domain
    (`opd.lab.task.solve_first_line_off_by_one`: the first line's result one too large, the rest computed from it),
    so a teacher fine-tuned on it is accurate only on its own domain and confidently wrong on the other."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {', '.join(DOMAINS)}, got {domain!r}")
    problems = make_problems(**dict(SFT_SET, n=n or SFT_SET["n"]))
    out = []
    for p in problems:
        mine = domain_of(p.expression) == domain
        solution = solve(p) if mine else solve_first_line_off_by_one(p)
        out.append(
            {
                "messages": messages(p) + [{"role": "assistant", "content": solution}],
                "answer": str(p.answer),
                "domain": domain_of(p.expression),
            }
        )
    return out


def write_specialist_data(path: str | Path, domain: str, *, n: int | None = None) -> Path:
    """`specialist_examples(domain)` as chat JSONL, written atomically."""
    write_jsonl(path, specialist_examples(domain, n=n))
    return Path(path)


def mopd_prompt_rows(prompts: str | Path) -> list[dict[str, Any]]:
    """The rows of a lab prompt file (verl layout with an `expression` column) with data_source
    `opd_lab/<domain>`: how MOPD_PROMPTS is made from opd_prompts.jsonl (nothing else changes)."""
    return [dict(r, data_source=f"opd_lab/{domain_of(r['expression'])}") for r in read_jsonl(prompts)]


def domain_accuracy(eval_dir: str | Path, benchmark: str | Path | None = None) -> dict[str, float | int]:
    """Accuracy per DOMAINS entry of an `opd eval` directory's samples.jsonl on the lab test set (each problem's
    domain from the benchmark file's `expression` column, joined by problem id), with the problem count of each."""
    domain = {r["extra_info"]["index"]: domain_of(r["expression"]) for r in read_jsonl(benchmark or test_set_path())}
    correct: dict[str, list[bool]] = {name: [] for name in DOMAINS}
    for row in read_jsonl(Path(eval_dir) / "samples.jsonl"):
        correct[domain[row["problem_id"]]].append(bool(row["correct"]))
    out: dict[str, float | int] = {}
    for name, rows in correct.items():
        out[name] = sum(rows) / len(rows) if rows else float("nan")
        out[f"{name}_problems"] = len(rows)
    return out


def n_params(path: str | Path) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(path)).parameters())


def rewrite_share(eval_dir: str | Path) -> float:
    """Share of the answers in an `opd eval` directory's samples.jsonl written in the rewrite style
    (`opd.lab.task.style_of`): accuracy alone cannot tell a rewrite teacher from the forward one it started as."""
    styles = [style_of(r["response"]) for r in read_jsonl(Path(eval_dir) / "samples.jsonl")]
    return styles.count("rewrite") / max(1, len(styles))


def import_checkpoint(source: str | Path, source_tokenizer: str | Path, out_dir: str | Path) -> Path:
    """Re-home a lab checkpoint trained with another lab vocabulary onto the current lab tokenizer: keep the (tied)
    embedding rows of the tokens the current tokenizer has, by token string, in its id order. How the shipped models
    moved from the prototype's 110-token vocabulary to the 34-token one (every dropped token never occurs in lab text,
    so the logits of the kept tokens, and greedy answers, are unchanged up to their softmax normaliser)."""
    old = PreTrainedTokenizerFast.from_pretrained(str(source_tokenizer)).get_vocab()
    tokenizer = build_lab_tokenizer()
    missing = [t for t in tokenizer.get_vocab() if t not in old]
    if missing:
        raise ValueError(f"{source_tokenizer} lacks lab tokens {missing}; cannot import {source}")
    rows = [old[tokenizer.convert_ids_to_tokens(i)] for i in range(len(tokenizer))]
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise ValueError(f"{source}: import_checkpoint handles tied embeddings only")
    kept = _input_embedding(model).weight.data[rows].clone()
    model.resize_token_embeddings(len(tokenizer))
    _input_embedding(model).weight.data.copy_(kept)
    model.config.update(
        {
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
        }
    )
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    give_umask_modes(out_dir)  # safetensors writes its files 0600
    return out_dir


def rehome_on_digit_pairs(source: str | Path, out_dir: str | Path) -> Path:
    """The lab model at `source` on the digit-pair lab tokenizer (`build_lab_tokenizer(digit_pairs=True)`), the
    start of the cross-tokenizer lab teacher: the 34 lab tokens keep their ids and (tied) embedding rows, each pair
    "ab" starts at the mean of the rows of "a" and "b"; SFT on the same solutions then teaches it the new tokens."""
    tokenizer = build_lab_tokenizer(digit_pairs=True)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise ValueError(f"{source}: rehome_on_digit_pairs handles tied embeddings only")
    old_rows = _input_embedding(model).weight.data.clone()
    base = build_lab_tokenizer()
    model.resize_token_embeddings(len(tokenizer))
    weight = _input_embedding(model).weight.data
    weight[: len(base)] = old_rows[: len(base)]
    for i in range(len(base), len(tokenizer)):
        pair = tokenizer.convert_ids_to_tokens(i)
        a, b = (base.get_vocab()[c] for c in pair)
        weight[i] = (old_rows[a] + old_rows[b]) / 2
    model.config.update({"vocab_size": len(tokenizer)})
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    give_umask_modes(out_dir)
    return out_dir


def permute_vocabulary(source: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """The lab model at `source` on the lab tokenizer with its non-special ids shuffled (`build_lab_tokenizer(order=
    …)`) and its (tied) embedding rows moved with them: the same model and segmentation under another token → id
    map, so `tokenizer: auto` takes the cross path and every span is one token to one token."""
    base = build_lab_tokenizer()
    base_by_id = {i: token for token, i in base.get_vocab().items()}
    pieces = [base_by_id[i] for i in range(len(SPECIAL_TOKENS), len(base))]
    order = [pieces[i] for i in torch.randperm(len(pieces), generator=torch.Generator().manual_seed(seed)).tolist()]
    tokenizer = build_lab_tokenizer(order=tuple(order))
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise ValueError(f"{source}: permute_vocabulary handles tied embeddings only")
    old_rows = _input_embedding(model).weight.data.clone()
    vocab = base.get_vocab()
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    rows = [vocab[by_id[i]] for i in range(len(tokenizer))]
    _input_embedding(model).weight.data.copy_(old_rows[rows])
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    give_umask_modes(out_dir)
    return out_dir


def _input_embedding(model: Any) -> torch.nn.Embedding:
    """The input embedding of a lab model (Qwen3: an `nn.Embedding`)."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, torch.nn.Embedding):
        raise TypeError(f"import_checkpoint: expected an nn.Embedding input embedding, got {type(embedding).__name__}")
    return embedding
