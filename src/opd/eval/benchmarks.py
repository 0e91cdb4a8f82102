"""Built-in evaluation benchmarks, shipped inside the package so that evaluation works offline.

The files in `opd/eval/data/` are the verl-layout parquet files released with "Rethinking On-Policy Distillation
of Large Language Models" (arXiv 2604.13016), re-compressed (zstd) with their Hugging Face schema metadata
dropped; rows, columns and values are unchanged. Prompts are bare problems (no instruction): evaluation applies
an instruction template (`opd.data.templates`). Ground truths are kept as released: AIME24 writes `\\boxed{204}`,
and the grader unwraps it.

Omitted on purpose: downloading other benchmarks (anything else is a path or hub id given to `load_prompts`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from opd.data.prompts import DataError, load_prompts
from opd.names import benchmark_is_path, explicit_path, normalise_benchmark
from opd.types import Prompt


@dataclass(frozen=True)
class Benchmark:
    """A shipped benchmark. name: registry key; file: parquet name in `opd/eval/data`; rows: number of problems."""

    name: str
    file: str
    rows: int
    description: str


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "AIME24.parquet", 30, "AIME 2024 (I and II); answers written \\boxed{N}"),
        Benchmark("aime25", "AIME25.parquet", 30, "AIME 2025 (I and II); integer answers"),
        Benchmark("amc23", "AMC23.parquet", 40, "AMC 2023; numeric answers"),
        Benchmark("math500", "MATH-500.parquet", 500, "MATH-500 subset of MATH; LaTeX answers"),
        Benchmark("minerva", "Minerva.parquet", 272, "Minerva Math; numeric answers, units in the question"),
        Benchmark("olympiadbench", "Olympiad-Bench.parquet", 674, "OlympiadBench, English text-only math"),
    )
}


# Accepted spellings: the registry names and the file stems, case-insensitive, ignoring '-', '_' and spaces.
_ALIASES = {normalise_benchmark(k): k for k in BENCHMARKS} | {
    normalise_benchmark(Path(b.file).stem): k for k, b in BENCHMARKS.items()
}


def list_benchmarks() -> list[str]:
    """Names of the built-in benchmarks, in registry order."""
    return list(BENCHMARKS)


def get_benchmark(name: str) -> Benchmark | None:
    """The registry entry for `name` (a name or file stem, any case), or None."""
    return BENCHMARKS.get(_ALIASES.get(normalise_benchmark(name), ""))


def benchmark_path(name: str) -> Path:
    """Filesystem path of a shipped benchmark file. Raises `DataError` for an unknown name."""
    bench = get_benchmark(name)
    if bench is None:
        raise DataError(_unknown_message(name))
    return Path(str(resources.files("opd.eval") / "data" / bench.file))


def load_benchmark(name_or_path: str | Path, **options) -> list[Prompt]:
    """Prompts of a built-in benchmark (by name) or of any prompt set (a path or hub id, read by `load_prompts`).

    options: keyword arguments of `load_prompts` (column mapping, `limit`, ...).
    A bare word is a name (`opd.names.benchmark_is_path`): one that is neither a known name nor an existing file
    raises `DataError` listing the known names. A value written as a path (`./math500`, `/data/aime24`, `x.jsonl`) is
    that path, never a built-in: a missing one raises `DataError` naming it.
    """
    text = str(name_or_path)
    bench = None if not isinstance(name_or_path, str) or benchmark_is_path(text) else get_benchmark(text)
    if bench is not None:
        with resources.as_file(resources.files("opd.eval") / "data" / bench.file) as path:
            return load_prompts(path, **options)
    path = Path(text).expanduser()
    if path.exists():
        return load_prompts(path, **options)
    if not benchmark_is_path(text):
        raise DataError(_unknown_message(text))
    if not isinstance(name_or_path, str) or explicit_path(text) or path.suffix:
        raise DataError(f"benchmark {text!r}: no such file or folder ({path.absolute()})")
    return load_prompts(text, **options)  # 'owner/name': a hub id


def _unknown_message(name: str) -> str:
    known = list_benchmarks()
    close = difflib.get_close_matches(normalise_benchmark(name), list(_ALIASES), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(dict.fromkeys(_ALIASES[c] for c in close))}?" if close else ""
    return (
        f"unknown benchmark {name!r}; known: {', '.join(known)} (or a path to a prompt file, or a hub id "
        f"'owner/name'){hint}"
    )
