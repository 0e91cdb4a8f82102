"""Token sampling shared by the generation engines: top-k / top-p filtering and one seeded draw per row.

Pure tensor functions (no model, no engine state). `TorchGenerator` draws with `torch.multinomial` (`sample_next`);
`StaticGenerator` draws the same distribution with Gumbel-max noise written into a static buffer (its own `_sample`),
both after `filter_logits`.
"""

from __future__ import annotations

import torch

from opd.rollout.base import SamplingParams


def filter_logits(logits_RV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering: excluded entries become -inf. [R, V] float → [R, V] float.

    top-k keeps every entry ≥ the k-th largest (ties at the threshold are all kept); top-p keeps the smallest set of
    most likely tokens whose probability reaches `top_p` (always at least the most likely token). 0 / 1.0 disable them.
    """
    if top_k > 0 and top_k < logits_RV.shape[-1]:
        kth_R1 = torch.topk(logits_RV, top_k, dim=-1).values[:, -1:]
        logits_RV = logits_RV.masked_fill(logits_RV < kth_R1, float("-inf"))
    if top_p < 1.0:
        sorted_RV, order_RV = torch.sort(logits_RV, dim=-1, descending=True)
        probs_RV = sorted_RV.softmax(dim=-1)
        mass_before_RV = nucleus_mass_before(probs_RV)  # mass of the strictly more likely tokens
        drop_RV = mass_before_RV >= top_p
        drop_RV[:, 0] = False
        drop_unsorted_RV = torch.empty_like(drop_RV).scatter_(-1, order_RV, drop_RV)  # back to vocabulary order
        logits_RV = logits_RV.masked_fill(drop_unsorted_RV, float("-inf"))
    return logits_RV


FIXED_POINT = 2.0**52  # units per unit of probability of `nucleus_mass_before`'s integer sums


def nucleus_mass_before(probs_RV: torch.Tensor, exact: bool | None = None) -> torch.Tensor:
    """Per entry, the summed probability of the entries before it along the last dimension (an exclusive cumulative
    sum: top-p's mass of the more likely tokens, `probs_RV` sorted descending). [R, V] float → [R, V] of its dtype.

    exact: True = sum in integers, each probability rounded to a multiple of 2^-52 (`FIXED_POINT`): the same result
    whatever order a kernel adds in, within V × 2^-53 of the exact sums before the cast back to the input's dtype
    (2e-11 at 151,936 entries; a float32 input then rounds to its own 6e-8). Needed where the static engine's
    sampling step is compiled under `run.deterministic`: inductor's float scan ignores deterministic mode (torch's
    eager CUDA cumsum honours it). False = the float cumsum; None = exact for a CUDA tensor with deterministic
    algorithms on, so the default path is the float one."""
    if exact is None:
        exact = probs_RV.is_cuda and torch.are_deterministic_algorithms_enabled()
    if not exact:
        return probs_RV.cumsum(dim=-1) - probs_RV
    units_RV = torch.round(probs_RV.double() * FIXED_POINT).long()
    return (_exclusive_cumsum(units_RV).double() / FIXED_POINT).to(probs_RV.dtype)


@torch.compiler.disable  # eager inside compiled callers: see below
def _exclusive_cumsum(units_RV: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of integers along the last dimension, always run by torch's eager kernel (exact
    in any order, and capturable in a CUDA graph). Compiled, inductor splits a vocabulary-long int64 scan over few
    rows (`SplitScan`) and its Triton code generation fails on CUDA (torch 2.11, H100, 2026-12-06, at 2 rows ×
    151,936: `TypeError: list indices must be integers or slices, not NoneType`)."""
    return units_RV.cumsum(dim=-1) - units_RV


def sample_next(
    logits_RV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from next-token logits. Returns (tokens [R] long, logprobs [R] float32).

    logprobs: `log_softmax(logits / temperature)` over the full vocabulary at the sampled token — *before* top-k/top-p
    filtering, i.e. SPEC §1's s(y_t), which the trainer recomputes; at temperature 0 (greedy; top-k/top-p ignored) the
    unscaled `log_softmax(logits)`.
    """
    logits_RV = logits_RV.float()
    if params.temperature == 0:
        tokens_R = logits_RV.argmax(dim=-1)
        scaled_RV = logits_RV
    else:
        scaled_RV = logits_RV / params.temperature
        probs_RV = filter_logits(scaled_RV, params.top_k, params.top_p).softmax(dim=-1)
        tokens_R = torch.multinomial(probs_RV, 1, generator=generator).squeeze(-1)
    logprobs_R = scaled_RV.log_softmax(dim=-1).gather(-1, tokens_R[:, None]).squeeze(-1)
    return tokens_R, logprobs_R
