"""Fixtures of the served-teacher tests: the lab teacher loaded in process and one `opd serve-teacher` subprocess,
each made once for the session and shared by tests/teacher/test_*.py."""

import pytest

from helpers_served_teacher import LIMITS, V, serve_process
from opd.lab import teacher_path
from opd.models import load_model
from opd.teacher.local import LocalScorer


@pytest.fixture(scope="session")
def lab_teacher():
    model, tokenizer = load_model(teacher_path(), dtype="fp32", device="cpu")
    return model, tokenizer, LocalScorer(model, vocab_size=V)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The session's `opd serve-teacher` (lab teacher, token, small limits): yields (url, token file, log path)."""
    tmp = tmp_path_factory.mktemp("server")
    with serve_process(tmp, *LIMITS) as (url, _, log_path):
        yield url, tmp / "token", log_path
