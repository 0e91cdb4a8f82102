"""Fixtures of the lab's tests: a set of generated problems (train and test), made once per module."""

from __future__ import annotations

import pytest

from opd.lab.task import make_problems


@pytest.fixture(scope="module")
def problems():
    return make_problems(300, steps=(1, 6), seed=3) + make_problems(100, steps=(1, 6), split="test", seed=3)
