"""`opd.check.tokenizers`: the tokenizer rows of `opd check` on crafted pairs (the lab's tokenizer and variants of its
files: a swapped vocabulary, another chat template, other special tokens)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers_check import MESSAGES
from opd import check as C
from opd.lab.tokenizer import CHAT_TEMPLATE, build_lab_tokenizer


def _lab_tokenizer_dir(tmp_path: Path, name: str = "tok") -> Path:
    path = tmp_path / name
    build_lab_tokenizer().save_pretrained(path)
    return path


def _load(path: Path):
    from opd.models import load_tokenizer

    return load_tokenizer(path)


def _rows(results, name):
    (row,) = [r for r in results if r.name == name]
    return row


def test_identical_tokenizers_pass():
    rows = C.check_tokenizers(
        build_lab_tokenizer(),
        build_lab_tokenizer(),
        messages=MESSAGES,
        student_rows=34,
        teacher_rows=40,
        student_eos_ids=[2],
        teacher_eos_ids=[2],
    )
    assert [r.status for r in rows] == ["pass", "pass", "pass"]
    assert "padding" in _rows(rows, "tokenizer_vocab").detail  # 34 vs 40 rows: padding rows are allowed


def test_different_vocab_fails(tiny_tokenizer):
    rows = C.check_tokenizers(build_lab_tokenizer(), tiny_tokenizer, messages=MESSAGES)
    vocab = _rows(rows, "tokenizer_vocab")
    assert vocab.status == "fail" and vocab.hard and "tokenizers differ" in vocab.detail


def test_swapped_ids_fail(tmp_path):
    path = _lab_tokenizer_dir(tmp_path)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["3"], vocab["4"] = vocab["4"], vocab["3"]
    (path / "tokenizer.json").write_text(json.dumps(data))
    rows = C.check_tokenizers(build_lab_tokenizer(), _load(path), messages=MESSAGES)
    vocab_row = _rows(rows, "tokenizer_vocab")
    assert vocab_row.status == "fail" and "'3'" in vocab_row.detail
    # the templates render the same text, but to other ids: the first differing token is reported
    template = _rows(rows, "chat_template")
    assert template.status == "fail" and "first difference at token" in template.detail


def test_different_chat_template_reports_first_difference():
    teacher = build_lab_tokenizer()
    teacher.chat_template = "{{- '<|im_start|>system\\n<|im_end|>\\n' -}}" + CHAT_TEMPLATE
    row = _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "chat_template")
    assert row.status == "fail" and row.hard
    assert "first difference at token 1" in row.detail and "'user'" in row.detail and "'system'" in row.detail
    s, t = C.render_ids(build_lab_tokenizer(), MESSAGES, None), C.render_ids(teacher, MESSAGES, None)
    assert C.first_difference(s, t) == 1 and C.first_difference(s, s) is None
    assert C.first_difference([1, 2], [1, 2, 3]) == 2


def test_template_differing_only_with_thinking_off_warns_unless_the_run_uses_it():
    teacher = build_lab_tokenizer()
    teacher.chat_template = (
        CHAT_TEMPLATE + "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '\\n' -}}{%- endif -%}"
    )
    default = _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "chat_template")
    assert default.status == "warn" and "thinking off" in default.detail
    off = _rows(
        C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES, enable_thinking=False), "chat_template"
    )
    assert off.status == "fail"


def test_special_tokens(tmp_path):
    teacher = build_lab_tokenizer()
    teacher.eos_token = "<|endoftext|>"
    assert (
        _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "special_tokens").status == "fail"
    )
    eos_ids = C.check_tokenizers(
        build_lab_tokenizer(), build_lab_tokenizer(), messages=MESSAGES, student_eos_ids=[2], teacher_eos_ids=[0]
    )
    assert _rows(eos_ids, "special_tokens").status == "fail"  # the models stop on different tokens
    teacher = build_lab_tokenizer()
    teacher.pad_token = "<unk>"
    assert (
        _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "special_tokens").status == "warn"
    )
