"""Real tokenizers of three kinds, built offline with the `tokenizers` library, for the cross-vocabulary tests:
a byte-level BPE with trained merges (GPT-2 / Qwen style), a SentencePiece-style BPE with byte fallback (Gemma style:
spaces normalised to `▁`, `<0xNN>` pieces), and a character tokenizer (one token per character of a small alphabet,
with or without byte fallback). Each is a `PreTrainedTokenizerFast` with the tiny Qwen-like chat template and
`<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (EOS) as special tokens.
"""

from __future__ import annotations

import json
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers import CHAT_TEMPLATE, make_tiny_model

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CORPUS = [
    "Compute 12 + 35 = 47. The answer is \\boxed{47}.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Café au lait, naïve résumé, façade: déjà vu.",
    "数学是科学的语言。二加二等于四。",
    "Emoji 🙂🚀 and symbols ∑ ∫ √ ≤ ≥ → ×.",
    "def f(x):\n    return x * x  # square\n",
    "  leading spaces, trailing spaces  ",
    "Let x = 3; then 2x + 1 = 7, so the final answer is 7.",
] * 4


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


@lru_cache(maxsize=4)
def byte_bpe(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Byte-level BPE with merges trained on `CORPUS` (every byte is a token: any text round-trips)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok)


@lru_cache(maxsize=4)
def sentencepiece(vocab_size: int = 300, *, prepend: bool = False) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE with byte fallback: spaces become `▁` (Gemma), or with `prepend` a `▁` is also put
    before the text (Llama 2 / Metaspace prepend_scheme first); a character outside its pieces is `<0xNN>` bytes."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trained.train_from_iterator([t.replace(" ", "▁") for t in CORPUS], trainer)
    vocab = dict(trained.get_vocab())
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False))
    if prepend:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _wrap(tok)


ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\téèàçö"


@lru_cache(maxsize=4)
def characters(*, byte_fallback: bool = True) -> PreTrainedTokenizerFast:
    """One token per character of `ALPHABET`; any other character is `<0xNN>` bytes with `byte_fallback`, else
    `<unk>` (a text it cannot encode)."""
    vocab = {c: i for i, c in enumerate(ALPHABET)}
    if byte_fallback:
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
    else:
        vocab["<unk>"] = len(vocab)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=byte_fallback, unk_token=None if byte_fallback else "<unk>")
    )
    parts = [decoders.ByteFallback(), decoders.Fuse()] if byte_fallback else [decoders.Fuse()]
    tok.decoder = decoders.Sequence(parts)
    return _wrap(tok)


KINDS = {
    "byte_bpe": byte_bpe,
    "sentencepiece": sentencepiece,
    "characters": characters,
}


def teacher_model(tokenizer: PreTrainedTokenizerFast, seed: int = 1):
    """A tiny random Qwen3 over `tokenizer` (at least the tiny model's 261 rows: rows past the tokenizer are padding),
    its config's EOS and pad ids the tokenizer's."""
    model = make_tiny_model("qwen3", vocab_size=max(len(tokenizer), 261), seed=seed)
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return model


def chat_prompt(tokenizer, i: int) -> list[int]:
    """The ids of a one-turn chat prompt `q{i}` under `tokenizer`'s template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"q{i}"}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def text_rollouts(tokenizer, texts, eos_id, truncate_last=False):
    """(Rollouts, prompts): rows of a chat prompt then the canonical tokens of a text and EOS (the last row cut before
    its EOS, and flagged truncated, when `truncate_last`)."""
    import torch

    from opd.types import Rollouts

    prompts = [chat_prompt(tokenizer, i) for i in range(len(texts))]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos_id] for t in texts]
    if truncate_last:
        responses[-1] = responses[-1][:-1]
    B, T = len(texts), max(len(r) for r in responses)
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.zeros((B, L), dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.bool)
    response_ids = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attention[b, : len(p) + len(r)] = True
        response_ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = True
    rollouts = Rollouts(
        input_ids, attention, torch.tensor([len(p) for p in prompts]), response_ids, mask, torch.arange(B),
        torch.tensor([truncate_last and b == B - 1 for b in range(B)]),
    )  # fmt: skip
    return rollouts, prompts
