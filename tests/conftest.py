"""Shared test fixtures: a tiny offline tokenizer with a Qwen-like chat template, and tiny random-weight models.

Nothing here touches the network. Everything is deterministic: the tokenizer is fully specified below, and model
weights come from a fixed seed drawn inside `torch.random.fork_rng` (the global RNG is left untouched).

Use the fixtures (`tiny_tokenizer`, `tiny_llama`, `tiny_qwen3`, `tiny_model_dir`) or import the plain functions
(`from conftest import make_tiny_tokenizer, make_tiny_model`) when a test needs a variant, e.g. another vocab size.

The tokenizer (`make_tiny_tokenizer`) is byte-level with no merges, so every string round-trips exactly:
    ids 0..255   one token per byte (GPT-2 byte-to-unicode alphabet)
    256          <|endoftext|>   special; the pad token (as in Qwen)
    257          <|im_start|>    special
    258          <|im_end|>      special; the EOS token (as in Qwen instruct models)
    259          <think>         added, not special (Qwen3 keeps it in decoded text)
    260          </think>        added, not special
    len(tokenizer) == TINY_VOCAB == 261

Importing this module sets `torch.set_num_threads(1)` for the whole test session (tiny tensors run ~10x faster
without OpenMP wake-ups on the shared 2-core machine).

Without CUDA, importing this module also sets `TRITON_INTERPRET=1` (before anything imports Triton), so that the
Triton kernels, when Triton is installed, run through Triton's interpreter on CPU tensors and are tested here.

Its chat template is a trimmed Qwen3 template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then with
`add_generation_prompt=True` `<|im_start|>assistant\n`, followed by `<think>\n\n</think>\n\n` when
`enable_thinking=False` (thinking on is the default, as in Qwen3). It omits Qwen3's tool-call blocks and its stripping
of earlier turns' reasoning.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config
from transformers import Qwen3ForCausalLM

# Tests use tiny tensors: one intra-op thread avoids OpenMP wake-ups that make them ~10x slower on a busy 2-core box.
torch.set_num_threads(1)

PAD_ID, IM_START_ID, EOS_ID, THINK_ID, END_THINK_ID = 256, 257, 258, 259, 260
TINY_VOCAB = 261

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what `pre_tokenizers.ByteLevel` emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The 261-token byte-level tokenizer described in the module docstring, with the Qwen-like chat template."""
    vocab = {ch: byte for byte, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Added in id order; special tokens are never split and are dropped by decode(skip_special_tokens=True).
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
    # The ids above are part of the contract other tests rely on; fail loudly if a library change moves them.
    got = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert got == [PAD_ID, IM_START_ID, EOS_ID], got
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK_ID, END_THINK_ID]
    assert len(tokenizer) == TINY_VOCAB
    return tokenizer


def make_tiny_model(
    kind: str = "llama",
    vocab_size: int = TINY_VOCAB,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.3,
    seed: int = 0,
) -> PreTrainedModel:
    """A random-weight causal LM ("llama" or "qwen3") in fp32 eval mode on CPU, ~50k parameters by default.

    `initializer_range` is larger than HF's 0.02 so that next-token distributions are peaked (greedy decoding has no
    near-ties, sampling with different seeds visibly differs). EOS is 258 (plus 256 in the generation config, as Qwen
    lists both), pad is 256. Attention is "eager" so results do not depend on which SDPA kernel is picked.
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="eager",
    )
    if kind == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif kind == "qwen3":
        config, cls = Qwen3Config(head_dim=hidden_size // num_heads, **common), Qwen3ForCausalLM
    else:
        raise ValueError(f"kind must be 'llama' or 'qwen3', got {kind!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = [EOS_ID, PAD_ID]
    model.generation_config.pad_token_id = PAD_ID
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The shared tiny tokenizer (session-scoped: do not mutate it; call `make_tiny_tokenizer()` for your own)."""
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_llama() -> PreTrainedModel:
    """A fresh tiny Llama (vocab 261, seed 0) per test, so tests may change its weights."""
    return make_tiny_model("llama")


@pytest.fixture
def tiny_qwen3() -> PreTrainedModel:
    """A fresh tiny Qwen3 (vocab 261, seed 0, QK-norm, tied embeddings off) per test."""
    return make_tiny_model("qwen3")


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_tokenizer):
    """A directory holding `save_pretrained` weights of a tiny Llama and the tiny tokenizer, as on the Hub."""
    path = tmp_path / "tiny-llama"
    make_tiny_model("llama").save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
