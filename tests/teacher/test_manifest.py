from pathlib import Path

import pytest

from opd.teacher.manifest import check_teacher_manifest

ENTRY = {"name": "t", "model": "m", "fingerprint": "f", "route": "default", "temperature": 1.0, "view": None}


def test_a_resume_refuses_another_teacher_tokenizer():
    saved = [{**ENTRY, "tokenizer": "cross abc span_credit=even"}]
    current = [{**ENTRY, "tokenizer": "cross def span_credit=even"}]
    with pytest.raises(ValueError, match="teacher t's tokenizer changed"):
        check_teacher_manifest(saved, current, Path("ckpt"))
    check_teacher_manifest(saved, saved, Path("ckpt"))


def test_a_checkpoint_from_before_cross_vocabulary_teachers_resumes_with_the_same_ids():
    check_teacher_manifest([ENTRY], [{**ENTRY, "tokenizer": "same"}], Path("ckpt"))
