"""`opd dedup`: remove from prompt set A (a file) every prompt that duplicates one in set B (or an earlier one of A),
write the kept prompts and a JSON report, print the counts. The stages (exact, MinHash, embeddings) are
`opd.data.dedup.dedup`; this is the program around them: read the sets, refuse an output that is an input, write.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from opd.data.dedup import DedupResult, dedup, dedup_report
from opd.data.prompts import load_prompts, save_prompts
from opd.io import atomic_write_json
from opd.rundir import claim_output_files


def dedup_files(
    in_path: str | Path,
    against: str | Path | None,
    out: str | Path,
    *,
    report: str | Path | None = None,
    prompt_key: str = "prompt",
    answer_key: str | None = "reward_model.ground_truth",
    against_prompt_key: str | None = None,
    console: Any = None,
    overwrite: bool = False,
    **options: Any,
) -> DedupResult:
    """`opd dedup`: load A (and B), `dedup(**options)`, save the kept prompts of A to `out` (.parquet or .jsonl,
    atomically), write the JSON report (default: `<out stem>.report.json` beside `out`) and print the counts. An
    existing `out` or report is refused, or with `overwrite` moved aside (`opd.rundir.claim_output_files`)."""
    console = console or Console()
    start = time.perf_counter()
    report = Path(report) if report else Path(out).with_name(Path(out).stem + ".report.json")
    claim_output_files({"--out": out, "--report": report}, {"--in": in_path, "--against": against}, overwrite=overwrite)
    a_prompts = load_prompts(in_path, prompt_key=prompt_key, answer_key=answer_key, on_missing_answer="keep")
    b_prompts = (
        None if against is None else load_prompts(against, prompt_key=against_prompt_key or prompt_key, answer_key=None)
    )
    result = dedup(a_prompts, b_prompts, **options)
    out = Path(out)
    save_prompts(result.kept, out)
    params = {
        "in": str(in_path),
        "against": None if against is None else str(against),
        "out": str(out),
        **{k: (v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)) for k, v in options.items()},
    }
    data = dedup_report(result, params=params)
    data["seconds"]["total"] = round(time.perf_counter() - start, 3)
    atomic_write_json(report, data)

    table = Table(title=f"opd dedup — {in_path}" + (f" against {against}" if against else " (within the set)"))
    for column in ("input", "exact", "minhash", "embedding", "kept"):
        table.add_column(column, justify="right")
    table.add_row(*(str(result.counts[c]) for c in ("input", "exact", "minhash", "embedding", "kept")))
    console.print(table)
    console.print(f"kept: {out}   report: {report}   ({data['seconds']['total']:.1f} s)")
    return result
