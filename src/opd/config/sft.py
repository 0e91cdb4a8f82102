"""`opd sft`'s config (plain data; the program is `opd.recipes.sft.sft`, whose `check_config` holds the checks
across sections)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator

from opd.config.sections import EvalSpec, ModelSpec, OptimSpec, RunSpec, Section


class SFTDataSpec(Section):
    """SFT data files and how to tokenise them (see `opd.data.sft`)."""

    path: list[str] = Field(
        description="One file or a list: .jsonl / .json / .parquet; each file's layout is detected on its own."
    )
    format: Literal["auto", "chat", "sharegpt", "alpaca"] = Field(
        "auto",
        description="auto (from each file's first record), chat (`messages`; also `opd rollout` output), "
        "sharegpt (`conversations`), alpaca (`instruction`, `input`, `output`).",
    )
    enable_thinking: bool | None = Field(
        None,
        description="Passed to the chat template (Qwen3 thinking on/off); must match how the answers were "
        "generated. None: template default.",
    )
    system_prompt: str | None = Field(
        None, description="A system message put first in every conversation (replacing its own); None: as in the data."
    )
    end_of_turn: str | None = Field(
        None,
        description="Token that ends an assistant turn, trained as its last target; None: the first special "
        "token the chat template writes after an answer (<|im_end|> for Qwen), else EOS.",
    )
    max_length: int = Field(4096, ge=2, description="Longest sequence (prompt + answer) in tokens.")
    on_overflow: Literal["filter", "truncate", "error"] = Field(
        "filter", description="Longer sequences are dropped (and counted), cut to max_length, or an error."
    )
    packing: Literal["auto", "packed", "padded"] = Field(
        "auto",
        description="packed: examples concatenated, each attending only to itself (position ids restart); "
        "padded: right-padded rows; auto: packed with flash/flex attention, else padded (on "
        "sdpa/eager the packed mask is dense, S² for S packed tokens).",
    )
    limit: int | None = Field(None, ge=1, description="Use only the first N conversations; None: all.")

    @field_validator("path", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, os.PathLike)) else value


class SFTOptimSpec(OptimSpec):
    """AdamW for SFT: the fields of `OptimSpec` with SFT defaults, plus a warmup given as a fraction of the run."""

    lr: float = Field(
        1e-5,
        gt=0.0,
        description="Peak learning rate (full fine-tune of a pretrained model ~1e-5; LoRA ~1e-4; "
        "a tiny model from scratch ~1e-3).",
    )
    schedule: Literal["constant", "cosine", "linear"] = Field("cosine", description="LR schedule after warmup.")
    warmup_ratio: float = Field(
        0.03,
        ge=0.0,
        lt=1.0,
        description="Linear warmup over this fraction of the steps (rounded); used only when warmup_steps is 0.",
    )


class SFTRunSpec(RunSpec):
    """`RunSpec` with `steps` optional: by default the length comes from the number of epochs. (samples_per_step is
    unused: SFT samples nothing.)"""

    # None means 'from the epochs': wider than RunSpec.steps on purpose (a field override pydantic allows)
    steps: int | None = Field(  # type: ignore[assignment]
        None, ge=1, description="Optimizer steps; None: ceil(epochs × examples / examples_per_step)."
    )


class SFTEvalSpec(EvalSpec):
    """Periodic `opd eval` of the model being trained, plus how its prompts are rendered and batched."""

    template: str = Field(
        "keep", description="Instruction template of benchmark problems: keep | dapo | boxed | custom:<text>."
    )
    max_prompt_length: int = Field(2048, ge=1, description="Longer benchmark prompts are skipped (counted).")
    batch_size: int = Field(64, ge=1, description="Sequences generated together.")


class LoraSpec(Section):
    """Low-rank adapters (peft): only they train."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0.0, description="Scaling numerator: adapters are scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapter input, in [0, 1).")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt (e.g. [q_proj, v_proj]); all-linear: every linear layer but "
        "the output head (which may not be adapted: the chunked loss uses its base weight).",
    )
    merge: bool = Field(
        True, description="At the end, write full merged weights to <run>/merged (loadable without peft)."
    )


class SFTConfig(Section):
    """`opd sft`: supervised fine-tuning on (teacher) answers, the cold start before OPD."""

    model: ModelSpec
    data: SFTDataSpec
    epochs: float | None = Field(
        None, gt=0.0, description="Passes over the data; None: 1, unless run.steps is set (set at most one of them)."
    )
    examples_per_step: int = Field(
        32, ge=1, description="Examples per optimizer step (the batch); split into micro-batches by micro_batch_tokens."
    )
    micro_batch_tokens: int = Field(
        16384,
        ge=2,
        description="Input tokens of one forward/backward (packed: their sum; padded: rows × longest); "
        "at least data.max_length. Gradient accumulation over micro-batches is implicit.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    optim: SFTOptimSpec = Field(default_factory=SFTOptimSpec)
    run: SFTRunSpec = Field(default_factory=SFTRunSpec)
    eval: SFTEvalSpec = Field(default_factory=SFTEvalSpec)
    lora: LoraSpec = Field(default_factory=LoraSpec)
