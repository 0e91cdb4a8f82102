"""Teacher scoring: the `TeacherScorer` protocol and the in-process scorer (also the student's no-grad pass)."""

from opd.teacher.base import TeacherScorer
from opd.teacher.local import LocalScorer, ResponseHidden, forward_hidden, output_head

__all__ = ["LocalScorer", "ResponseHidden", "TeacherScorer", "forward_hidden", "output_head"]
