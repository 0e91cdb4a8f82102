"""Print README's "Model families" table: per family, whether opd's static decode engine, packed (varlen)
attention on CUDA and compiled decoder layers serve it, each "no" with the code's own reason; then one row per RoPE
type of transformers (`ROPE_VARIANTS`): how each path treats it (`opd.models.fix_rope`,
`opd.rollout.vllm_engine.rope_refusal`).

Built from tiny random models (benchmarks/families.py) and the same checks the code runs at load time:
`opd.rollout.static_engine.unsupported_reason`, `opd.kernels.varlen_attention.refusal` (asked about a CUDA device;
it only inspects the device's type and this torch's kernel, so it runs on CPU) and what `opd.models.compile_layers`
needs (the decoder's `layers`). tests/features/test_support_table.py fails when README and this output disagree.

    python scripts/support_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from families import LLAMA3_ROPE, RELEASED, TINY_CONFIG, family  # noqa: E402
from opd.kernels import varlen_attention  # noqa: E402
from opd.models import fix_rope  # noqa: E402
from opd.rollout.static_engine import unsupported_reason  # noqa: E402
from opd.rollout.vllm_engine import rope_refusal  # noqa: E402

HEADER = "| Family | Static engine | Packed attention (CUDA) | Compiled layers |\n|---|---|---|---|"


ROPE_HEADER = (
    "| RoPE type | Torch engine, scorers, trainer | Static engine | vLLM engine and teacher | Served teacher |\n"
    "|---|---|---|---|---|"
)
ROPE_VARIANTS = {  # a tiny Llama's rope_parameters per type (longrope: Phi-3.5 / Phi-4-mini's shape)
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": LLAMA3_ROPE,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 128,
        "short_factor": [1.0] * 4,
        "long_factor": [4.0] * 4,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
FIXED = "yes, one table per run (fixed at its longest sequence)"


def _rope_row(kind: str) -> str:
    """One RoPE type's row: what each path does with a tiny Llama of that type, by the code's own checks."""
    config = transformers.LlamaConfig(**TINY_CONFIG, rope_parameters={"rope_theta": 10000.0, **ROPE_VARIANTS[kind]})
    model = transformers.LlamaForCausalLM(config).eval()
    choice = fix_rope(model, 4096)  # what every command that loads a model does
    static = unsupported_reason(model)
    run_long, run_short = rope_refusal(config, None, 1 << 20), rope_refusal(config, None, 1)
    if run_long is not None:
        vllm = f"no: {run_long}"
    elif run_short is not None:
        vllm = "yes where vllm.max_model_len and the run lie on one side of its switch; else refused in one line"
    else:
        vllm = "yes"
    served = "yes" if choice is None else "yes, fixed at its max_positions; a run needing another table is refused"
    cells = ["yes" if choice is None else FIXED, _cell(static) if choice is None or static else FIXED, vllm, served]
    return f"| {kind} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _cell(reason: str | None) -> str:
    return "yes" if reason is None else f"no: {reason}".replace("|", "\\|")


def _compile_reason(model: torch.nn.Module) -> str | None:
    """Why `opd.models.compile_layers` would compile nothing (its own condition), or None."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if getattr(body, "layers", None) is None:
        return "no decoder layers (model.get_decoder().layers)"
    return None


def table() -> str:
    """The markdown table, one row per released family."""
    rows = [HEADER]
    cuda = torch.device("cuda")
    for name, key in RELEASED.items():
        model = family(key)
        cells = [unsupported_reason(model), varlen_attention.refusal(model, cuda), _compile_reason(model)]
        rows.append(f"| {name} | " + " | ".join(_cell(c) for c in cells) + " |")
    rows += ["", ROPE_HEADER, *(_rope_row(kind) for kind in ROPE_VARIANTS)]
    return "\n".join(rows)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
