"""Helpers shared by the static engine's tests (tests/rollout/test_static_engine*.py): prompts, the engine pair,
tiny models that end responses at many lengths, and long-tailed per-sample caps."""

import torch

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_tiny_model
from opd.rollout.static_engine import StaticGenerator
from opd.rollout.torch_engine import TorchGenerator

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def engines(model, **kwargs):
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID, **kwargs)
    return TorchGenerator(model, **common), StaticGenerator(model, kv_bucket=16, **common)


def max_abs_diff(logprobs_a, logprobs_b):
    return max((abs(a - b) for row_a, row_b in zip(logprobs_a, logprobs_b) for a, b in zip(row_a, row_b)), default=0)


def eos_biased(kind="qwen3", bias=2.0, **kwargs):
    """A tiny model whose EOS logit is raised by `bias`: greedy and sampled responses end at many different lengths
    (bias 2: greedy lengths 4–30 over random prompts; bias 3: sampled lengths spread over 1–12)."""
    model = make_tiny_model(kind, **kwargs)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(TINY_VOCAB))
    with torch.no_grad():
        model.lm_head.bias[EOS_ID] = bias
    return model


def random_prompts(count, seed=0, longest=12):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, longest, (count,), generator=g)
    ]


# Long-tailed per-sample caps: once nothing is pending the tail runs in live-row buckets 8 → 4
TAIL_CAPS = [2, 40, 3, 5, 1, 33, 7, 2, 60, 4, 3, 9]
TAIL_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
