"""Seed derivation: the one place a run's base seed becomes the seed of a step, a rank, a chunk or a call.

Two forms, both pure functions of their arguments (so a resume or a rerun replays them): `derive_seed`, a linear mix
for integer coordinates (step, row index, rank), and `hashed_seed`, a SHA-256 of any JSON-able key for coordinates
that are names (a benchmark, prompt ids). The salts keep streams that share coordinates apart; they are part of
each caller's recorded results, so they never change.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# the salts in use, one per stream (changing one changes that stream's samples)
SALT_STEP_ROLLOUT = 17  # opd distill: the rollouts of a step, and `opd prompts score`'s student rollouts per batch
SALT_CHECK_ACCURACY = 29  # opd check: the accuracy samples of the forecast
SALT_VLLM_PROMPT = 7  # the vLLM engine: one request per prompt


def derive_seed(
    seed: int, *, step: int = 0, index: int = 0, salt: int = 0, call: int = 0, bits: int | None = 31
) -> int:
    """`(seed · 1,000,003 + step · 7,919 + salt + index · 104,729 + call · 1,299,709) mod 2^bits`: distinct primes
    keep the coordinates from aliasing for any realistic range (`call`: the generation call within a step, 0 for
    the first, so a one-call step's seed is the one without it). `bits=None` leaves the value unreduced."""
    value = seed * 1_000_003 + step * 7919 + salt + index * 104_729 + call * 1_299_709
    return value if bits is None else value % (2**bits)


def hashed_seed(key: Any, *, num_bytes: int = 4) -> int:
    """A seed from the SHA-256 of `key` (a string, or any JSON-able value): the first `num_bytes` bytes,
    little-endian; with 8 bytes shifted right by one so that torch takes it as a signed 64-bit seed."""
    text = key if isinstance(key, str) else json.dumps(key)
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:num_bytes], "little")
    return value >> 1 if num_bytes == 8 else value
