"""Tiny random-weight models, one per supported model family, with each family's attention features switched on
(sliding windows short enough to bind, soft-capping, attention sinks, MoE routing). Shared by tests/test_families.py,
scripts/support_table.py and benchmarks/check_cuda.py (issue 23); plain transformers classes, no opd code.

Token ids follow tests/helpers.py's tiny tokenizer (256 byte ids, then PAD, IM_START, EOS, THINK, END_THINK)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

WINDOW = 4  # shorter than most test rows, so a window binds
PAD_ID, EOS_ID, TINY_VOCAB = 256, 258, 261
TINY_CONFIG = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    pad_token_id=PAD_ID,
    bos_token_id=None,
    eos_token_id=EOS_ID,
)
TWO_KINDS = ["sliding_attention", "full_attention"]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def _build(config_class: str, model_class: str, **extra) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        config = getattr(transformers, config_class)(**TINY_CONFIG, **extra)
        return getattr(transformers, model_class)(config)

    return build


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama3_2": _build("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "qwen2_5": _build("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2_window": _build(
        "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "qwen3": _build("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "qwen3_moe": _build(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    ),
    # eager whatever transformers' default (5.17: sdpa, which drops the soft-cap), as `opd.models.load_model` picks
    "gemma2": _build(
        "Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=WINDOW, attn_implementation="eager"
    ),
    "gemma3": _build("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=WINDOW, layer_types=TWO_KINDS),
    "mistral": _build("MistralConfig", "MistralForCausalLM", sliding_window=WINDOW),
    "mistral_no_window": _build("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "phi3": _build("Phi3Config", "Phi3ForCausalLM", sliding_window=WINDOW),
    "olmo2": _build("Olmo2Config", "Olmo2ForCausalLM"),
    "smollm3": _build("SmolLM3Config", "SmolLM3ForCausalLM", no_rope_layers=[1, 0]),  # its second layer is NoPE
    "gpt_oss": _build(
        "GptOssConfig",
        "GptOssForCausalLM",
        head_dim=8,
        sliding_window=WINDOW,
        num_local_experts=2,
        num_experts_per_tok=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "granite": _build(  # Granite 3's multipliers (its defaults are all 1)
        "GraniteConfig",
        "GraniteForCausalLM",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.125,
        logits_scaling=8.0,
    ),
}
# The families as released (the support table's rows): display name -> builder key
RELEASED = {
    "Llama 3.2": "llama3_2",
    "Qwen2.5": "qwen2_5",
    "Qwen3": "qwen3",
    "Qwen3-MoE": "qwen3_moe",
    "Gemma 2": "gemma2",
    "Gemma 3": "gemma3",
    "Mistral (sliding window)": "mistral",
    "Mistral (no window)": "mistral_no_window",
    "Phi-3": "phi3",
    "OLMo 2": "olmo2",
    "SmolLM3": "smollm3",
    "GPT-OSS": "gpt_oss",
    "Granite": "granite",
}


def family(name: str) -> torch.nn.Module:
    """A random-weight fp32 CPU model of family `name` (a `BUILDERS` key), seeded, in eval mode."""
    torch.manual_seed(0)
    return BUILDERS[name]().eval()
