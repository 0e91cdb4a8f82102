"""Degenerate responses, rejection reason (c) of `opd rollout` (`opd.recipes.rollout`): a line repeated many times,
a block of tokens repeated back to back, a long run of one token. Each check has its threshold in `DegeneracySpec`
and is off at 0; the checks read the decoded text and the token ids only (no model)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from opd.config.rollout import DegeneracySpec


def degeneracy_reasons(text: str, token_ids: Sequence[int], spec: DegeneracySpec) -> list[str]:
    """Which degenerate patterns the response shows: "repeated_line", "token_run", "repeated_block" (in that order).

    token_run and repeated_block look for periodic stretches of token ids: for every period p, the longest run of
    positions t with ids[t] == ids[t + p] is a stretch of (run + p) tokens made of one p-token block repeated.
    Period 1 is a run of one token; a stretch whose block is a single token is reported as token_run only.
    """
    reasons = []
    if spec.line_repeats:
        lines = [line.strip() for line in text.splitlines()]
        counts = Counter(line for line in lines if len(line) >= spec.line_min_chars)
        if counts and max(counts.values()) >= spec.line_repeats:
            reasons.append("repeated_line")
    ids = np.asarray(token_ids, dtype=np.int64)
    if spec.token_run and len(ids) >= spec.token_run and _longest_periodic(ids, 1)[0] >= spec.token_run:
        reasons.append("token_run")
    if spec.block_repeats:
        for period in range(2, min(spec.block_max_tokens, len(ids) // 2) + 1):
            needed = max(spec.block_min_tokens, spec.block_repeats * period)
            if len(ids) < needed:
                break
            span, start = _longest_periodic(ids, period)
            if span >= needed and len(np.unique(ids[start : start + period])) > 1:
                reasons.append("repeated_block")
                break
    return reasons


def _longest_periodic(ids: np.ndarray, period: int) -> tuple[int, int]:
    """(length, start) of the longest stretch of `ids` with ids[t] == ids[t + period] throughout (a block of
    `period` tokens repeated; length counts the first copy too). (period, 0) when there is none."""
    same = ids[period:] == ids[:-period]
    if not same.any():
        return period, 0
    edges = np.diff(np.concatenate(([0], same.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    best = int(np.argmax(ends - starts))
    return int(ends[best] - starts[best]) + period, int(starts[best])
