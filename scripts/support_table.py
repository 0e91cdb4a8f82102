"""Print README's "Model families" table: per family, whether opd's static decode engine, packed (varlen)
attention on CUDA and compiled decoder layers serve it, each "no" with the code's own reason.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from families import RELEASED, family  # noqa: E402
from opd.kernels import varlen_attention  # noqa: E402
from opd.rollout.static_engine import unsupported_reason  # noqa: E402

HEADER = "| Family | Static engine | Packed attention (CUDA) | Compiled layers |\n|---|---|---|---|"


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
    return "\n".join(rows)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
