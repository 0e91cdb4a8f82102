"""`opd rollout`'s config (plain data; the program is `opd.recipes.rollout.teacher_rollout`), with the thresholds of
its degenerate-response checks (`opd.eval.degeneracy`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opd.config.sections import (
    TOOL_FORMAT_HELP,
    DataSpec,
    Identifier,
    ModelSpec,
    Section,
    Temperature,
    ToolFormat,
    VLLMSpec,
    check_tool_format,
)


class DegeneracySpec(Section):
    """When a response counts as degenerate (rejection reason (c)). Each check is off at 0."""

    line_repeats: int = Field(
        10,
        ge=0,
        description="Reject when one line (stripped, at least line_min_chars long) occurs this many times or more "
        "anywhere in the response; 0 = off.",
    )
    line_min_chars: int = Field(16, ge=1, description="Shorter lines (`\\]`, `Wait,`) are never counted as repeats.")
    token_run: int = Field(64, ge=0, description="Reject when one token id occurs this many times in a row; 0 = off.")
    block_repeats: int = Field(
        4,
        ge=0,
        description="Reject when a block of 2..block_max_tokens tokens repeats back to back this many times or more "
        "and the repetition spans at least block_min_tokens tokens; 0 = off.",
    )
    block_min_tokens: int = Field(
        128,
        ge=1,
        description="Shortest repeated span (tokens) that block_repeats flags: 4 copies of a 32-token block, "
        "64 of a 2-token one.",
    )
    block_max_tokens: int = Field(
        256,
        ge=2,
        description="Longest block (tokens) searched for; cost is linear in it "
        "(a few ms per 7k-token response at 256).",
    )


class RolloutConfig(Section):
    """`opd rollout`: n teacher samples per prompt with rejection sampling, written as SFT data."""

    model: ModelSpec = Field(description="The teacher that answers.")
    data: DataSpec = Field(description="The prompt set, its column mapping, instruction template and thinking switch.")
    out: str = Field(description="Output directory; rerunning into it resumes (finished prompts are skipped).")
    n: int = Field(1, ge=1, description="Accepted samples wanted per prompt.")
    temperature: Temperature = Field(
        1.0, ge=0.0, description="Sampling temperature; 0 = greedy (retries then repeat the same answer)."
    )
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1]; 1.0 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_new_tokens: int = Field(
        7168, ge=1, description="Longest response in tokens; a response that reaches it is rejected as truncated."
    )
    max_attempts: int = Field(
        3, ge=1, description="Draws per wanted sample before it is given up (written to rejected.jsonl)."
    )
    require_correct: bool = Field(
        False,
        description="Also reject answers graded wrong against the prompt's ground truth (every prompt needs one).",
    )
    grade_timeout: float = Field(5.0, gt=0.0, description="Seconds allowed for one symbolic answer comparison.")
    degeneracy: DegeneracySpec = Field(
        default_factory=DegeneracySpec, description="Thresholds of the degenerate-response checks."
    )
    batch_size: int = Field(
        64,
        ge=1,
        description="Sequences generated together (prompts × n); a batch holds max(1, batch_size // n) prompts "
        "and is the unit of resume.",
    )
    seed: int = Field(
        0,
        description="Base seed; every generate call's seed derives from it and its rows' (prompt id, sample, attempt).",
    )
    num_workers: int = Field(
        1, ge=1, description="Worker processes, one per device, each running every num_workers-th batch."
    )
    devices: list[str] | None = Field(
        None,
        description="One device per worker (e.g. [cuda:0, cuda:1]); None: cuda:0..N-1 when CUDA is there and "
        "model.device is auto/cuda, else model.device for all.",
    )
    llamafactory: bool = Field(
        False, description="Also write llamafactory/<dataset_name>.json (sharegpt) and dataset_info.json."
    )
    dataset_name: Identifier = Field(
        "opd_rollout",
        description="Dataset name in LlamaFactory's dataset_info.json and the file name (llamafactory/<name>.json).",
    )
    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="Generation engine (opd.rollout.registry): torch | vllm (loads the model itself, one worker; "
        "needs the vllm extra).",
    )
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")
    tools: str | None = Field(
        None,
        description="Teacher episodes with tools: each sample is an episode with this environment (python, "
        "calculator or package.module:factory); the final turn is graded and the whole conversation written. "
        "None: one plain answer per sample.",
    )
    sandbox: Literal["namespaces", "rlimits-only"] = Field(
        "namespaces",
        description="How the python tool isolates code: namespaces (probed at startup; the tool is refused where it "
        "does not hold) or rlimits-only (resource limits, no isolation; only when named).",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Generation turns per episode with tools (the last one answers); max_new_tokens bounds each turn "
        "and the whole episode.",
    )
    tool_format: ToolFormat = Field("hermes", description=TOOL_FORMAT_HELP)

    @model_validator(mode="after")
    def _tool_format_has_tool(self) -> RolloutConfig:
        check_tool_format(self.tools, self.tool_format)
        return self

    @model_validator(mode="after")
    def _dataset_file_apart(self) -> RolloutConfig:
        if self.dataset_name.lower() == "dataset_info":  # llamafactory/dataset_info.json maps the dataset file
            raise ValueError(
                "dataset_name: 'dataset_info' would write the dataset over llamafactory/dataset_info.json; "
                "choose another name"
            )
        return self

    @model_validator(mode="after")
    def _llamafactory_without_tools(self) -> RolloutConfig:
        if self.llamafactory and self.tools is not None:
            raise ValueError(
                "llamafactory: the LlamaFactory files opd writes hold user and assistant turns only, not tool calls "
                "and answers; drop --llamafactory (rollouts.jsonl is what opd sft reads) or --tools"
            )
        return self

    @model_validator(mode="after")
    def _devices_match_workers(self) -> RolloutConfig:
        if self.devices is not None and len(self.devices) != self.num_workers:
            raise ValueError(
                f"devices lists {len(self.devices)} devices but num_workers is {self.num_workers}; "
                f"give one device per worker"
            )
        if self.engine == "vllm" and self.num_workers != 1:
            raise ValueError(f"engine=vllm runs one in-process engine: num_workers must be 1, got {self.num_workers}")
        return self
