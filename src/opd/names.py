"""The engine names the config accepts, one type each, shared by `opd.config` and the registries that build them;
and the names evaluation results are reported under (`benchmark_names`).

Its own module (L0, no torch) so that loading a config stays as light as it is; each registry checks at import that
its table holds exactly these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

EngineName = Literal["auto", "torch", "static", "vllm"]
"""A generation engine (`opd.rollout.registry`); auto: static on CUDA for a supported layout, else torch."""

TeacherEngineName = Literal["local", "vllm"]
"""How a teacher loaded from `teacher.path` scores (`opd.teacher.registry`); `teacher.url` means a served one."""


def normalise_benchmark(name: str) -> str:
    """A benchmark name as the registry reads it (`opd.eval.benchmarks`): case, '-', '_' and spaces ignored, so that
    math500 and MATH-500 are one benchmark."""
    return "".join(c for c in name.lower() if c.isalnum())


# where the built-in benchmarks' files are shipped (`opd.eval.benchmarks`): a path into it is that benchmark
_SHIPPED = Path(__file__).resolve().parent / "eval" / "data"


def explicit_path(value: str) -> bool:
    """Whether a benchmark entry is written as a path, never a name or a hub id: it starts with '/', '.' or '~', or
    holds a backslash (`./math500`, `../aime24`, `~/sets/gsm8k`)."""
    return value.startswith(("/", ".", "~")) or "\\" in value


def benchmark_is_path(value: str) -> bool:
    """Whether a benchmark entry is a path (or a hub id 'owner/name'), never a registry name: it holds a '/', is an
    explicit path, or has a file suffix. So `./math500` is the user's folder, never the built-in math500."""
    return "/" in value or explicit_path(value) or bool(Path(value).suffix)


def _points_at(value: str) -> str:
    """What a benchmark entry points at: a name as the registry reads it, or a path resolved (a shipped file is its
    benchmark's name, so that `math500` and the path of MATH-500.parquet are one benchmark)."""
    if not benchmark_is_path(value):
        return normalise_benchmark(value)
    path = Path(value).expanduser().resolve()
    return normalise_benchmark(path.stem) if path.parent == _SHIPPED else str(path)


def benchmark_names(benchmarks: Sequence[str]) -> list[str]:
    """The name each benchmark of a list is reported under (results, samples, `eval/<name>/...` metrics): a built-in
    benchmark's name as given, a file's stem, or, for files whose stems coincide (`math/test.parquet`,
    `gsm8k/test.parquet`), their folder's name and the stem (`math-test`, `gsm8k-test`). Raises ValueError, naming
    both entries, where two still share a name (one entry given twice, or in two spellings of the registry's: math500
    and MATH-500): their results would be mixed."""
    # what an entry points at: a file's absolute path, or a name as the registry reads it
    given = [_points_at(str(b)) for b in benchmarks]
    for i, entry in enumerate(given):
        if entry in given[:i]:
            first = benchmarks[given.index(entry)]
            twice = (
                f"{first!r} is listed twice"
                if first == benchmarks[i]
                else f"{first!r} and {benchmarks[i]!r} name one benchmark"
            )
            raise ValueError(f"{twice} (its results would be counted twice); list it once")
    stems = [Path(b).stem if Path(b).suffix or explicit_path(str(b)) else str(b) for b in benchmarks]
    names = [
        f"{Path(b).absolute().parent.name}-{stem}" if Path(b).suffix and stems.count(stem) > 1 else stem
        for b, stem in zip(benchmarks, stems)
    ]
    for i, name in enumerate(names):
        if name in names[:i]:
            first = benchmarks[names.index(name)]
            raise ValueError(
                f"{first!r} and {benchmarks[i]!r} would both be reported as {name!r}, their results mixed; "
                "rename one of the two files, or its folder"
            )
    return names
