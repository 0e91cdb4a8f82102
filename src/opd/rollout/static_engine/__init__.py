"""`StaticGenerator`: the `Generator` contract with a static KV cache, continuous batching and a decode step replayed
as one CUDA graph.

Why: at RL batch sizes decoding a small model is bound by launching kernels from Python, not by the GPU. One
captured graph per step, compiled layer halves and sampling, fused weights and one attention kernel cut the kernels
per step, and a finished row's slot is refilled with the next pending sample so that long tails leave no row idle.
How a call runs, the Gumbel-max sampling and the determinism contract (bit-exact for a fixed row count R; pin R
with max_batch_size / max_batch_tokens): docs/design.md, "opd.rollout.static_engine".

Scope: the Llama layout and the families that are it plus features the step computes: Qwen2 (qkv bias), Qwen3 (q/k
norm over heads), sliding windows per layer (Mistral, Ministral, Qwen2's, Phi-3), Phi-3 (fused qkv and gate/up,
partial rotary), Qwen3-MoE (top-k routed experts, `_mlp`), Granite (embedding, residual and attention multipliers,
logit scaling), SmolLM3 (NoPE layers), OLMo 2 (norms after the branches) and Gemma 2 / 3 (norms on both sides of
each branch over 1 + w, scaled embeddings, GELU-tanh gates, Gemma 2's attention and logit soft-caps, Gemma 3's
RoPE table per layer type). Not GPT-OSS (attention sinks, its own experts). Anything else raises (engine
"auto" then picks `TorchGenerator`, saying why); graphs and compilation on CUDA only. Omitted: a paged cache,
speculative decoding, shared-prefix (cascade) attention, and `flex_attention`'s decoding path (tried: slower than
SDPA, and its graph capture failed at larger batches).

The package, one job a file:

- `layers`: the step's layer math (norms, RoPE, attention, MLP / MoE), pure functions of tensors
- `sample`: the step's Gumbel-max sampling and its two-stage vocabulary reductions
- `families`: what each supported family's modules hold, the support check, each layer's step weights
- `engine`: `StaticGenerator`, the API (options, row counts, memory, compiled step functions, `generate`)
- `run`: `_Run`, one call (slots, prefill and refill, the decode step, graphs, the loop)

The step functions are looked up here, in this package's namespace (`_attn_in`, `_attn_out`, `_sample`,
`_COMPILED`), so that replacing one here (the tests' spies, a reset of the compiled set) reaches every engine.

Shapes (docs/design.md, "Shape letters"): R rows of the engine call, S cache slots, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

from opd.rollout.static_engine.engine import StaticGenerator
from opd.rollout.static_engine.families import unsupported_reason
from opd.rollout.static_engine.layers import _attend_matmul, _attn_in, _attn_out
from opd.rollout.static_engine.rows import _round_rows, _row_buckets
from opd.rollout.static_engine.run import _Run
from opd.rollout.static_engine.sample import _sample, _split_argmax, _split_logsumexp

# the compiled step functions (attn_in, attn_out, sample), one set shared by all engines of the process
# (`StaticGenerator._step_fns`); None until the first compiling call
_COMPILED: tuple[Callable, Callable, Callable] | None = None

# the names users, benchmarks and tests import from here (the private ones: the tests' and benchmarks' probes)
__all__ = [
    "StaticGenerator",
    "unsupported_reason",
    "_COMPILED",
    "_Run",
    "_attend_matmul",
    "_attn_in",
    "_attn_out",
    "_round_rows",
    "_row_buckets",
    "_sample",
    "_split_argmax",
    "_split_logsumexp",
]
