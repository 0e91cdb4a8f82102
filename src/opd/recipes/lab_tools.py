"""The tool lab's models (`opd lab build OUT --only tools_teacher,tools_student`; `opd.lab.tools`): a teacher that
uses the calculator well and a cold-started student that calls it but not yet well, both fine-tuned by `opd sft` on
scripted calculator episodes from the shipped lab models moved onto the tool vocabulary, and measured by `opd eval`
with and without the calculator on the tool lab's test set. configs/lab_tools.yaml distills the one from the other;
the replication and its numbers: docs/lab.md, "A task that needs a tool".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from opd.config import EvalConfig, ModelSpec
from opd.lab import student_path, teacher_path
from opd.lab.build import STUDENT_ARCH, TEACHER_ARCH, n_params
from opd.lab.tools import TOOL_SFT_SET, onto_tool_vocabulary, write_tool_data
from opd.models import fix_rope, load_model
from opd.recipes.demo import accuracy
from opd.recipes.eval import evaluate
from opd.recipes.lab_sft import finetune
from opd.rollout import make_generator

TOOL_MODELS: dict[str, dict[str, Any]] = {
    "tools_teacher": {
        "arch": TEACHER_ARCH,
        "init": "the shipped lab teacher on the tool vocabulary",
        "steps": 150,
        "examples_per_step": 32,
        "lr": 1e-3,
        "examples": TOOL_SFT_SET["n"],
    },
    "tools_student": {
        "arch": STUDENT_ARCH,
        "init": "the shipped lab student on the tool vocabulary",
        "steps": 20,
        "examples_per_step": 16,
        "lr": 1e-3,
        "examples": 320,
    },
}
"""What `opd lab build --only tools_teacher,tools_student` trains: `opd sft` (the lab's SFT recipe, these steps,
batch and lr) on scripted calculator episodes (`opd.lab.tools.tool_examples`). The teacher is trained until it uses
the tool on every problem; the student is a cold start: a few steps on a few hundred episodes, after which it writes
calls (miscopying the numbers; sampled, on about 60 % of the prompts) and ignores the tool's answer (the paper's SFT
cold start, which tool-using OPD then builds on; docs/lab.md has the measurements)."""
EVAL_MAX_NEW_TOKENS = 48
"""New tokens per episode in the tool lab's evals (a scripted episode's assistant text is ~20 tokens)."""


def measure_tools(
    model_path: str | Path,
    benchmark: str | Path,
    out: str | Path,
    *,
    tools: str | None = "calculator",
    limit: int | None = None,
    device: str = "cpu",
    console: Any = None,
) -> dict[str, Any]:
    """Greedy n=1 accuracy on `benchmark` through `opd eval`, with the calculator (`opd eval --tools calculator`,
    up to 4 turns) or without tools (`tools` None). Returns {"accuracy", "tool_calls_mean" (with tools)}."""
    config = EvalConfig(
        model=ModelSpec(path=str(model_path), device=device, dtype="fp32"),
        benchmarks=[str(benchmark)],
        n=1,
        temperature=0.0,
        max_new_tokens=EVAL_MAX_NEW_TOKENS,
        batch_size=256,
        max_prompt_length=64,
        limit=limit,
        tools=tools,
        out=str(out),
    )
    model, tokenizer = load_model(str(model_path), dtype="fp32", device=device)
    fix_rope(model, config.max_prompt_length + EVAL_MAX_NEW_TOKENS * config.max_turns)
    generator = make_generator(model, tokenizer, engine="torch", max_batch_size=256)
    results = evaluate(config, generator=generator, tokenizer=tokenizer, console=console)
    (summary,) = results.values()
    record: dict[str, Any] = {"accuracy": accuracy(results)}
    if "tools" in summary:
        record["tool_calls_mean"] = summary["tools"]["tool_calls_mean"]
    return record


def build_tool_model(
    name: str,
    out_dir: Path,
    *,
    steps: int | None = None,
    sft_examples: int | None = None,
    eval_limit: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    time_budget_s: float | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Train `name` (a TOOL_MODELS key) into `out_dir/name` and measure it on `out_dir/data/tools_test.jsonl` with
    the calculator and without tools; returns its manifest record."""

    plan = TOOL_MODELS[name]
    steps = plan["steps"] if steps is None else steps
    n = sft_examples or plan["examples"]
    paths = write_tool_data(out_dir / "data", sft_examples=n)
    source = teacher_path() if name == "tools_teacher" else student_path()
    init = onto_tool_vocabulary(source, out_dir / "work" / f"{name}_init", seed=seed)
    start = time.perf_counter()
    run_dir, trained = finetune(
        init,
        paths["sft"],
        out_dir / "work",
        f"{name}_sft",
        out_dir / name,
        steps=steps,
        seed=seed,
        examples_per_step=plan["examples_per_step"],
        lr=plan["lr"],
        max_length=128,
        device=device,
        time_budget_s=time_budget_s,
        console=console,
    )
    seconds = time.perf_counter() - start
    record: dict[str, Any] = {
        "path": name,
        "arch": "Qwen3ForCausalLM",
        **plan["arch"],
        "params": n_params(out_dir / name),
        "seed": seed,
        "training": {
            "recipe": f"opd sft from {plan['init']} on scripted calculator episodes (opd.lab.tools.tool_examples)",
            "examples": n,
            "examples_per_step": plan["examples_per_step"],
            "lr": plan["lr"],
            **trained,
            "run_dir": str(run_dir),
            "wall_s": round(seconds, 1),
            "time_budget_s": time_budget_s,
        },
    }
    for tools in ("calculator", None):
        key = "with_calculator" if tools else "without_tools"
        eval_dir = out_dir / "work" / f"{name}_eval_{key}"
        record[key] = measure_tools(
            out_dir / name, paths["test"], eval_dir, tools=tools, limit=eval_limit, device=device, console=console
        )
    return record
