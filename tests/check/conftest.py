"""Fixtures of the `opd check` groups' tests: the lab teacher, loaded once per module."""

from __future__ import annotations

import pytest

from opd import lab


@pytest.fixture(scope="module")
def lab_teacher():
    from opd.models import load_model

    model, tokenizer = load_model(lab.teacher_path(), dtype="fp32", device="cpu")
    return model, tokenizer
