"""README's "Model families" table is what scripts/support_table.py computes from the code's own checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- support-table: begin", "<!-- support-table: end -->"


def _script():
    spec = importlib.util.spec_from_file_location("support_table", ROOT / "scripts" / "support_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(BEGIN)
    body = text[text.index("\n", start) + 1 : text.index(END)]
    return body.strip()


def test_readme_support_table_equals_the_scripts_output():
    generated = _script().table()
    assert readme_table() == generated, "README's support table is stale: paste `python scripts/support_table.py`"


def test_support_table_names_the_refusals_of_gemma2_and_gpt_oss():
    rows = {line.split(" | ")[0].strip("| "): line for line in _script().table().splitlines()[2:]}
    assert "soft-capping" in rows["Gemma 2"] and "sinks" in rows["GPT-OSS"]
    assert rows["Llama 3.2"] == "| Llama 3.2 | yes | yes | yes |"
