"""`opd.teacher.registry`: the teacher placements it names."""

import pytest

from opd.config import ModelSpec, TeacherSpec
from opd.teacher.registry import resolve_scorer


def test_teacher_registry_names_its_placements():
    assert resolve_scorer(ModelSpec(path="t")) == "local"
    assert resolve_scorer(TeacherSpec(path="t", engine="vllm")) == "vllm"
    assert resolve_scorer(TeacherSpec(url="http://127.0.0.1:1")) == "served"
    with pytest.raises(ValueError, match="one of local, served, vllm, got 'fast'"):
        resolve_scorer(TeacherSpec.model_construct(path="t", engine="fast", url=None))
