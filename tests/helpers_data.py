"""Shared by the data tests (tests/data/): the shared data sets beside the checkout (read once per session; tests
needing them are skipped when absent), one-line error checks, and a one-message chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd.data.prompts import load_prompts
from opd.types import Prompt

SHARED = Path(__file__).parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared data sets not found at {SHARED}")

_cache: dict[str, list[Prompt]] = {}


def shared(name: str) -> list[Prompt]:
    """Each shared file is read once per session (the two train sets take about a second each)."""
    if name not in _cache:
        _cache[name] = load_prompts(SHARED / name)
    return _cache[name]


def one_line_error(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


MESSAGES = [{"role": "user", "content": "What is 1+1?"}]
