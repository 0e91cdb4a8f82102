"""`opd eval`'s config (plain data; the program is `opd.recipes.eval.evaluate`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opd.config.sections import (
    TOOL_FORMAT_HELP,
    BenchmarkList,
    ModelSpec,
    Section,
    Temperature,
    ToolFormat,
    VLLMSpec,
    check_tool_format,
)
from opd.names import EngineName


class EvalConfig(Section):
    """`opd eval`: sample n answers per benchmark problem, grade them, report avg@n / pass@k / maj@n."""

    model: ModelSpec | None = Field(None, description="The model to sample from; None with `responses` set.")
    responses: str | None = Field(None, description="Grade this JSONL of existing generations instead of sampling.")
    benchmarks: BenchmarkList = Field(
        default_factory=lambda: ["aime24", "aime25", "amc23", "math500"],
        description="Built-in names (aime24, aime25, amc23, math500, minerva, olympiadbench) or file paths, "
        "reported under the file's stem (folder-stem where two files share a stem).",
    )
    prompt_key: str = Field("prompt", description="Prompt column of benchmark files given by path.")
    answer_key: str = Field("reward_model.ground_truth", description="Answer column of benchmark files given by path.")
    template: str = Field("keep", description="Instruction template applied to every problem (see DataSpec.template).")
    enable_thinking: bool | None = Field(None, description="Chat template thinking switch; None: template default.")
    max_prompt_length: int = Field(2048, ge=1, description="Longer prompts are dropped with a count in the log.")
    n: int = Field(16, ge=1, description="Samples per problem.")
    temperature: Temperature = Field(0.7, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_new_tokens: int = Field(4096, ge=1, description="Longest response; longer ones count as truncated.")
    batch_size: int = Field(64, ge=1, description="Sequences generated together (prompts × n).")
    limit: int | None = Field(None, ge=1, description="Evaluate only the first N problems of each benchmark.")
    seed: int = Field(0, description="Sampling seed; the same seed reproduces the samples.")
    out: str | None = Field(
        None, description="Output directory; None: runs/eval-<timestamp>. Rerunning into it resumes."
    )
    timeout: float = Field(
        5.0,
        gt=0,
        description="Wall-time budget in seconds of one response's symbolic grading (imports and worker start-up "
        "included); a comparison that runs out counts as wrong.",
    )
    on_missing_answer: Literal["error", "skip"] = Field(
        "error",
        description="A benchmark row (or --responses line) without a ground truth: error (one line naming it) or skip "
        "(dropped, counted).",
    )
    engine: EngineName = Field(
        "auto",
        description="Generation engine (opd.rollout.registry): auto | torch | static | vllm (loads the model itself; "
        "needs the vllm extra).",
    )
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")
    tools: str | None = Field(
        None,
        description="Tool-integrated eval: each problem is an episode with this environment (python, calculator or "
        "package.module:factory); the final turn is graded. None: plain sampling.",
    )
    sandbox: Literal["namespaces", "rlimits-only"] = Field(
        "namespaces",
        description="How the python tool isolates code: namespaces (probed at startup; the tool is refused where it "
        "does not hold) or rlimits-only (resource limits, no isolation; only when named).",
    )
    max_turns: int = Field(4, ge=1, description="Generation turns per episode with tools (the last one answers).")
    tool_format: ToolFormat = Field("hermes", description=TOOL_FORMAT_HELP)

    @model_validator(mode="after")
    def _tool_format_has_tool(self) -> EvalConfig:
        check_tool_format(self.tools, self.tool_format)
        return self
