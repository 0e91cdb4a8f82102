"""`opd eval`: sample n answers per benchmark problem, grade them, report avg@n / pass@k / maj@n.

Two modes: with a model (generate, then grade: `opd.eval.sampling.evaluate_model`, which also holds the resume and
the identity rules) and with `responses` (grade existing generations, the reference's `grade.py` use case). Outputs
in the run directory: `identity.json`, `config.yaml`, `samples.jsonl` and `results.json`. In the responses mode the
identity is the file's hash, so a rerun over another file into the same directory is refused.

Omitted on purpose: resuming the responses mode part-way (grading a file is one pass; a rerun grades it again).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rich.console import Console

from opd.config import EvalConfig
from opd.data.prompts import MISSING, describe_missing, get_field, to_answer
from opd.eval.sampling import check_resumable, evaluate_model, graded_record, start_work, write_results
from opd.io import read_jsonl, write_jsonl
from opd.rundir import default_run_dir, locked


def evaluate(config: EvalConfig, *, generator: Any = None, tokenizer: Any = None, console: Any = None) -> dict:
    """Run `opd eval` and return the results dict (also written to `<out>/results.json`).

    `generator`/`tokenizer` let a caller (the demo, the lab) reuse a model already in memory; otherwise they are
    loaded from `config.model`.
    """
    console = console or Console()
    if (config.model is None) == (config.responses is None) and generator is None:
        raise ValueError("opd eval needs exactly one of --model (sample and grade) or --responses FILE (grade only)")
    if config.responses is None and not config.benchmarks:
        raise ValueError(
            "benchmarks is empty; name at least one: aime24, aime25, amc23, math500, minerva, "
            "olympiadbench or a prompt file"
        )
    if config.responses is not None and config.tools is not None and generator is None:
        raise ValueError("tools applies to sampling (--model); --responses grades existing answers: drop --tools")
    run_dir = Path(config.out) if config.out else default_run_dir("eval")
    if config.responses is None or generator is not None:
        return evaluate_model(config, run_dir, generator=generator, tokenizer=tokenizer, console=console)
    run_dir.mkdir(parents=True, exist_ok=True)
    with locked(run_dir, "eval"):  # one process per output directory
        identity = {
            "mode": "responses",
            "responses": str(config.responses),
            "responses_sha256": _file_sha256(Path(config.responses)),
            "on_missing_answer": config.on_missing_answer,
        }
        check_resumable(run_dir, identity)
        records = grade_responses_file(
            config.responses, timeout=config.timeout, on_missing_answer=config.on_missing_answer, console=console
        )
        start_work(run_dir, identity, config)
        write_jsonl(run_dir / "samples.jsonl", records)
        return write_results(config, run_dir, records, console)


def _file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------------------------- responses mode

_RESPONSE_KEYS = ("response", "responses", "output", "outputs", "completion", "generated_text", "generation")
_ANSWER_KEYS = ("answer", "ground_truth", "gt", "reward_model.ground_truth", "solution")
_ID_KEYS = ("problem_id", "id", "idx", "index", "extra_info.index", "prompt", "problem", "question")
_BENCHMARK_KEYS = ("benchmark", "data_source", "source", "dataset")


def _first(record: dict, keys: tuple[str, ...], *, allow_null: bool = False) -> tuple[str | None, Any]:
    """(key, value) of the first of `keys` the record has (a null value counts only with `allow_null`)."""
    for key in keys:
        value = get_field(record, key)
        if value is not MISSING and (allow_null or value is not None):
            return key, value
    return None, None


def _problem_of(row: dict, path: Path, line_number: int) -> tuple[str, str]:
    """(benchmark, problem id) of a responses line: its fields, else the file's stem and the line number."""
    _, problem = _first(row, _ID_KEYS)
    _, benchmark = _first(row, _BENCHMARK_KEYS)
    problem_id = str(problem) if problem is not None else f"line-{line_number}"
    if not isinstance(problem, (str, int)) and problem is not None:
        problem_id = str(problem)[:200]
    return (str(benchmark) if benchmark is not None else path.stem), problem_id


def grade_responses_file(
    path: str | Path, *, timeout: float = 5.0, on_missing_answer: str = "error", console: Any = None
) -> list[dict]:
    """Grade a JSONL of existing generations. Each line holds a response (`response`, or a list in `responses`),
    a ground truth (`answer` / `ground_truth` / `reward_model.ground_truth`; a list means any of them), and
    optionally a problem id and a benchmark name. Lines with the same (benchmark, problem) are the n samples of one
    problem, so they must give the same ground truth (else ValueError naming both lines). A line whose ground
    truth is null or empty is an error, or skipped with a count when `on_missing_answer="skip"`."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"responses file {path} is a folder; expected a JSONL file of generations")
    if not path.is_file():
        raise FileNotFoundError(f"responses file {path} does not exist")
    rows = read_jsonl(path, skip_partial_last_line=False)
    if not rows:
        raise ValueError(f"responses file {path} holds no records")
    records: list[dict] = []
    sample_counter: dict[tuple[str, str], int] = {}
    answers: dict[tuple[str, str], tuple[int, Any]] = {}
    skipped = []
    for line_number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
        response_key, responses = _first(row, _RESPONSE_KEYS)
        answer_key, raw_answer = _first(row, _ANSWER_KEYS, allow_null=True)
        if responses is None:
            raise ValueError(f"{path}:{line_number}: no response field; expected one of {', '.join(_RESPONSE_KEYS)}")
        if answer_key is None:
            raise ValueError(f"{path}:{line_number}: no ground-truth field; expected one of {', '.join(_ANSWER_KEYS)}")
        answer = to_answer(raw_answer, f"{path}:{line_number}:", answer_key)
        if answer is None:
            if on_missing_answer == "skip":
                skipped.append(line_number)
                continue
            raise ValueError(
                f"{path}:{line_number}: field {answer_key!r} is {describe_missing(raw_answer)}: no ground "
                f"truth; fix the line, or pass on_missing_answer=skip to leave such lines out"
            )
        benchmark, problem_id = _problem_of(row, path, line_number)
        key = (benchmark, problem_id)
        first_line, first_answer = answers.setdefault(key, (line_number, answer))
        if first_answer != answer:
            raise ValueError(
                f"{path}:{line_number}: problem {problem_id[:80]!r} ({benchmark}) has ground truth "
                f"{str(answer)[:60]!r}, but line {first_line} gave it {str(first_answer)[:60]!r}; the lines "
                f"of one problem are its samples and share one ground truth: give each problem its own id"
            )
        for response in responses if isinstance(responses, list) else [responses]:
            sample = sample_counter.get(key, 0)
            sample_counter[key] = sample + 1
            records.append(
                graded_record(
                    benchmark=benchmark,
                    problem_id=problem_id,
                    sample=sample,
                    response=str(response),
                    answer=answer,
                    num_tokens=row.get("num_tokens"),
                    truncated=bool(row.get("truncated", False)),
                    timeout=timeout,
                )
            )
    if skipped:
        if not records:
            raise ValueError(
                f"responses file {path}: every line lacks a ground truth (on_missing_answer=skip left none)"
            )
        message = (
            f"{path}: skipped {len(skipped)} of {len(rows)} lines without a ground truth (first: line "
            f"{skipped[0]}; on_missing_answer=skip)"
        )
        if console is not None:
            console.print(f"[yellow]{message}[/]")
        else:
            print(message)
    return records
