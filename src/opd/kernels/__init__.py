"""Kernels for the GPU fast paths, each beside the torch code it replaces (the CPU path and the reference):
`decode_attention` (Triton: one-token grouped-query attention over a static KV cache, `StaticGenerator`'s decode
step) and `varlen_attention` (packed rows through torch's FlashAttention varlen kernel, as a transformers attention
implementation: `forward_hidden`'s packed forwards).

The Triton kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set
before Triton is imported), which is how the CPU tests check them. Without Triton installed, `available` is False and
the callers keep their torch paths. Omitted: a Triton top-k for the teacher's scoring (`opd.scoring._piece_topk` does
it in torch; why: docs/design.md, "opd.kernels", and the timing in docs/performance.md).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = tl = None


def available(device: torch.device) -> bool:
    """Whether the kernels here can run on tensors of `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def interpreted(device: torch.device) -> bool:
    """Whether kernels on `device` run through Triton's interpreter (CPU tensors): it cannot multiply bfloat16 tiles,
    so kernels that use `tl.dot` upcast their tiles to float32 there."""
    return device.type != "cuda"
