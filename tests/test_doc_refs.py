"""scripts/check_doc_refs.py: the repository's docs resolve; each kind of stale reference is reported on its line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_doc_refs.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_doc_refs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_repository_resolves():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


BAD_DOC = """# A doc

Fine: `opd.train.step.opd_step`, `opd.rollout.base.Generator.generate`, `src/opd/types.py`, `rollout/base.py`, spec §2,
[the spec](spec.md), `tests/test_objectives_*.py`, `checkpoints/step_N/`, `runs/<name>/`, tokens/s, I/O,
docs/design.md, "opd.train.stream" and (docs/spec.md "4. policy loss").
A dotted name: `opd.lab.experiments`.
A name after a module: `opd.train.step.no_such_function`.
A member of a class: `opd.rollout.base.Generator.no_such_member`.
A path: `src/opd/train/opd.py` and one under the package, `train/opd.py`.
A link: [gone](no_such_doc.md).
A spec section: SPEC §42.
A style item: STYLE 12.
A section: docs/design.md, "The rollout stream".
"""


def test_each_kind_of_bad_reference_is_reported_on_its_line(tmp_path: Path):
    doc = tmp_path.resolve() / "docs" / "bad.md"
    doc.parent.mkdir()
    doc.write_text(BAD_DOC, encoding="utf-8")
    (tmp_path / "docs" / "spec.md").write_text("", encoding="utf-8")  # the good link's target
    done = subprocess.run([sys.executable, str(SCRIPT), str(doc)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    found = [line.split(": ", 2)[:2] for line in done.stdout.splitlines()]
    assert found == [
        [f"{doc}:6", "opd.lab.experiments"],
        [f"{doc}:7", "opd.train.step.no_such_function"],
        [f"{doc}:8", "opd.rollout.base.Generator.no_such_member"],
        [f"{doc}:9", "src/opd/train/opd.py"],
        [f"{doc}:9", "train/opd.py"],
        [f"{doc}:10", "no_such_doc.md"],
        [f"{doc}:11", "SPEC §42"],
        [f"{doc}:12", "STYLE 12"],
        [f"{doc}:13", 'docs/design.md, "The rollout stream"'],
    ], done.stdout
    assert all(line.count(": ") >= 2 and line.rsplit(": ", 1)[1] for line in done.stdout.splitlines())


def test_python_comments_and_docstrings_are_read_but_not_code(checker, tmp_path: Path):
    source = tmp_path / "mod.py"
    source.write_text(
        '"""Module docstring.\n\nSee `opd.nowhere`."""\n'
        "\n"
        "x = 'opd.also_nowhere but a string, not prose'\n"
        "y = 1  # a comment naming SPEC §99\n"
        "\n"
        "\n"
        "def f():\n"
        '    """A docstring naming `tests/test_nowhere.py`."""\n',
        encoding="utf-8",
    )
    problems = checker.check_file(source)
    assert [(p.line, p.reference) for p in problems] == [
        (3, "opd.nowhere"),
        (6, "SPEC §99"),
        (10, "tests/test_nowhere.py"),
    ]


def test_a_style_item_resolves_against_style_md(checker, tmp_path: Path):
    (tmp_path / "STYLE.md").write_text("# Style\n\n1. One rule.\n12. Another.\n", encoding="utf-8")
    checker._style_items.cache_clear()
    try:
        problems = checker.check_text("STYLE 12 and STYLE 3", file="x.md", first_line=1, root=tmp_path, doc_dir=None)
    finally:
        checker._style_items.cache_clear()
    assert [(p.reference, p.why) for p in problems] == [("STYLE 3", "STYLE.md has no item 3.")]


def test_a_moved_name_or_file_is_reported_with_where_it_is_now(checker):
    text = "`opd.train.opd.opd_step` and `tests/elsewhere/test_doc_refs.py`"
    problems = checker.check_text(text, file="x.md", first_line=1, root=checker.ROOT, doc_dir=None)
    hints = [p.why.rsplit("(", 1)[1] for p in problems]
    assert hints == ["now opd.train.step.opd_step?)", "now tests/test_doc_refs.py?)"]
