"""What a checkpoint records of its teachers (`teacher_manifest`) and the check that a resume uses the same ones
(`check_teacher_manifest`). Moved out of the distill recipe (issue 50); `opd.recipes.distill` still imports both."""

from __future__ import annotations

from pathlib import Path

from opd.config import STUDENT
from opd.fingerprints import model_fingerprint
from opd.teacher.base import HiddenStateSource, source_head_hash
from opd.teacher.registry import RoutedTeacher, resolve_scorer

__all__ = ["check_teacher_manifest", "teacher_manifest"]


def teacher_manifest(teachers: list[RoutedTeacher]) -> list[dict]:
    """What a checkpoint records of its teachers: name, model (path or url, and a fingerprint: the local files'
    hash, or a served teacher's /info, whose model_fingerprint hashes the files it serves), route, temperature,
    its tokenizer mode (same, or cross with the teacher tokenizer's hash); for a teacher answering with hidden
    states, `head`: its output head's `head_fingerprint`."""
    out = []
    for routed in teachers:
        entry = routed.entry
        info = getattr(routed.teacher.scorer, "info", None)
        if entry.path == STUDENT:  # no files of its own: the student's weights at every step
            fingerprint = "student (live)"
        elif resolve_scorer(entry) == "served" and isinstance(info, dict):
            keys = ("model", "model_fingerprint", "vocab_hash", "chat_template_hash", "vocab_size", "dtype")
            fingerprint = "/info " + ",".join(f"{k}={info[k]}" for k in keys if k in info)
        else:
            fingerprint = model_fingerprint(str(entry.path)) or str(entry.path)
        assert entry.route is not None
        record = {
            "name": entry.name,
            "model": str(entry.url if entry.url is not None else entry.path),
            "fingerprint": fingerprint,
            "route": entry.route.describe(),
            "temperature": entry.temperature,
            "view": None if entry.view is None else entry.view.model_dump(),
            # a cross-vocabulary teacher: its tokenizer's hash and span credit (SPEC §9); else the student's ids
            "tokenizer": "same"
            if routed.cross is None
            else f"cross {routed.cross.tokenizer_hash} span_credit={routed.cross.credit}",
        }
        scorer = routed.teacher.scorer
        if getattr(entry, "answer", "scores") == "hidden" and isinstance(scorer, HiddenStateSource):
            record["head"] = source_head_hash(scorer)  # the head its hidden states are projected with
        out.append(record)
    return out


def check_teacher_manifest(saved: list[dict] | None, current: list[dict], checkpoint: Path) -> None:
    """Refuse to resume `checkpoint` with another teacher set, route or model than it was trained with (one line
    naming what changed). A checkpoint written before manifests existed has none: nothing to compare."""
    if saved is None:
        return
    old, new = {t["name"]: t for t in saved}, {t["name"]: t for t in current}
    if old.keys() != new.keys():
        raise ValueError(
            f"--resume: {checkpoint} was trained with teachers {sorted(old)}, this run has {sorted(new)}; resume "
            f"with the same teachers, or start another run.name"
        )
    for name, was in old.items():
        for key in ("model", "fingerprint", "route", "temperature", "view", "tokenizer", "head"):
            if key == "tokenizer" and key not in was:  # written before cross-vocabulary teachers: the same ids
                continue
            if was.get(key) != new[name].get(key):
                raise ValueError(
                    f"--resume: teacher {name}'s {key} changed since {checkpoint} ({was.get(key)} → "
                    f"{new[name].get(key)}); resume with the same teacher, or start another run.name"
                )
