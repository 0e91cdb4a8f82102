"""Fixtures of the bad-input matrix: its world of good and broken inputs, built once for the session and shared by
test_commands.py and test_damaged_runs.py."""

import pytest

from helpers_bad_inputs import build_world


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> dict[str, str]:
    return build_world(tmp_path_factory.mktemp("bad-inputs"))


@pytest.fixture(scope="session")
def env_world(world):
    from opd.lab import teacher_path

    return {**world, "lab_teacher": str(teacher_path())}
