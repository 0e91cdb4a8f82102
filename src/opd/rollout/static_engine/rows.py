"""The row counts a `StaticGenerator` call runs at: the ladder calls of varying sample counts round up to, the
live-row buckets the tail of a call shrinks to, and the rounding of a memory cap.

Shapes (docs/design.md, "Shape letters"): R rows of the engine call.
"""

from __future__ import annotations

_MIN_ROW_BUCKET = 4  # the smallest live-row bucket below the call's rows


def _row_buckets(rows: int) -> tuple[int, ...]:
    """The live-row buckets of a call with `rows` rows: rows itself and every power of two in [_MIN_ROW_BUCKET, rows).
    Each is one more shape for the compiled step functions (one compile per bucket and process) and its own graphs."""
    ladder = [1 << k for k in range(_MIN_ROW_BUCKET.bit_length() - 1, rows.bit_length()) if 1 << k < rows]
    return (*ladder, rows)


_ROW_STEP = 16  # from this many rows on the call-size ladder climbs by this many rows a rung


def _round_rows(samples: int, max_batch_size: int) -> int:
    """The rows of a call of `samples` samples rounded up to the fixed ladder 1, 2, 4, 8, 16, 32, 48, 64, ... (powers
    of two below _ROW_STEP, multiples of it from there), never above max_batch_size (itself always a result): a
    process whose calls send every sample count in [1, max_batch_size] meets at most 4 + max_batch_size / 16 + 1 row
    counts, so the compiled step functions stop recompiling once those are warm. The extra rows are empty slots."""
    samples = max(1, samples)
    if samples >= max_batch_size:
        return max_batch_size
    rung = 1 << (samples - 1).bit_length() if samples < _ROW_STEP else -(-samples // _ROW_STEP) * _ROW_STEP
    return min(rung, max_batch_size)


def _settle_limit(limit: int) -> int:
    """A row count capped by memory: itself below 16, else rounded down to a multiple of 8, so that calls whose
    limit differs a little run (and compile) the same shape."""
    return limit if limit < 16 else limit // 8 * 8
