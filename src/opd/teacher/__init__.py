"""Teacher scoring: the `TeacherScorer` protocol and the in-process scorer (also the student's no-grad pass)."""

from opd.forward import ResponseHidden, forward_hidden, output_head
from opd.teacher.base import TeacherScorer
from opd.teacher.local import LocalScorer

__all__ = ["LocalScorer", "ResponseHidden", "TeacherScorer", "forward_hidden", "output_head"]
