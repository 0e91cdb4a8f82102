"""`opd eval`: sample n answers per benchmark problem, grade them, report avg@n / pass@k / maj@n.

Two modes: with a model (generate, then grade) and with `responses` (grade existing generations, the
reference's `grade.py` use case). Outputs in the run directory: `config.yaml`, `samples.jsonl` (one line per
sample, appended as work finishes) and `results.json` (written atomically at the end).

Resume: problems are processed in fixed chunks whose sampling seed depends only on (seed, benchmark, chunk index),
so a rerun into the same directory skips every chunk already in `samples.jsonl` and reproduces the rest exactly
as an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from opd.config import EvalConfig, save_config
from opd.io import append_jsonl, atomic_write_json, read_jsonl, repair_jsonl, write_jsonl
from opd.report.sinks import progress_bar


@dataclass
class EvalProblem:
    """One problem to evaluate: the prompt token ids and its ground truth."""

    benchmark: str
    problem_id: str
    prompt_ids: list[int]
    answer: str


def default_run_dir(prefix: str) -> Path:
    return Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def evaluate(config: EvalConfig, *, generator: Any = None, tokenizer: Any = None, console: Any = None) -> dict:
    """Run `opd eval` and return the results dict (also written to `<out>/results.json`).

    `generator`/`tokenizer` let a caller (the trainer's periodic eval, the demo) reuse a model already in memory;
    otherwise they are loaded from `config.model`.
    """
    from rich.console import Console

    console = console or Console()
    if (config.model is None) == (config.responses is None) and generator is None:
        raise ValueError("opd eval needs exactly one of --model (sample and grade) or --responses FILE (grade only)")
    run_dir = Path(config.out) if config.out else default_run_dir("eval")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir)
    if config.responses is not None and generator is None:
        records = grade_responses_file(config.responses, timeout=config.timeout)
        write_jsonl(run_dir / "samples.jsonl", records)
    else:
        records = _sample_and_grade(config, run_dir, generator, tokenizer, console)
    results = summarize_records(records)
    results_meta = {"model": config.model.path if config.model else None, "responses": config.responses}
    atomic_write_json(run_dir / "results.json", {**results_meta, "benchmarks": results})
    print_results_table(results, console, title=f"opd eval — {run_dir}")
    console.print(f"results: {run_dir / 'results.json'}")
    return results


# ------------------------------------------------------------------------------------------------ model mode


def _sample_and_grade(config: EvalConfig, run_dir: Path, generator: Any, tokenizer: Any, console: Any) -> list[dict]:
    from opd.data.templates import encode_prompts
    from opd.eval.benchmarks import load_benchmark
    from opd.rollout import SamplingParams

    if generator is None and config.engine == "vllm":  # vLLM loads the weights itself: no HF copy of the model
        from opd.models import load_tokenizer
        from opd.rollout import make_generator
        from opd.rollout.vllm_engine import EngineOptions

        spec = config.model
        tokenizer = load_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code)
        options = EngineOptions.from_config(config.vllm, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code)
        generator = make_generator(None, tokenizer, engine="vllm", model_path=spec.path,
                                   max_batch_size=config.batch_size, engine_options=options)
    if generator is None:
        from opd.models import load_model
        from opd.rollout import make_generator

        model, tokenizer = load_model(
            config.model.path,
            dtype=config.model.dtype,
            device=config.model.device,
            trust_remote_code=config.model.trust_remote_code,
            attn_implementation=config.model.attn_implementation,
        )
        generator = make_generator(model, tokenizer, engine=config.engine, max_batch_size=config.batch_size)

    samples_path = run_dir / "samples.jsonl"
    repair_jsonl(samples_path)
    done = read_jsonl(samples_path) if samples_path.exists() else []
    done_chunks = {(r["benchmark"], r["chunk"]) for r in done}

    problems_per_chunk = max(1, config.batch_size // config.n)
    work: list[tuple[str, int, list[EvalProblem]]] = []
    for benchmark in config.benchmarks:
        prompts = load_benchmark(benchmark, prompt_key=config.prompt_key, answer_key=config.answer_key)
        if config.limit:
            prompts = prompts[: config.limit]
        encoded = encode_prompts(
            tokenizer,
            prompts,
            max_prompt_length=config.max_prompt_length,
            template=config.template,
            enable_thinking=config.enable_thinking,
        )
        if encoded.num_filtered:
            console.print(f"[yellow]{benchmark}: {encoded.num_filtered} prompts longer than {config.max_prompt_length} tokens skipped[/]")
        name = Path(benchmark).stem if Path(benchmark).suffix else benchmark
        problems = [
            EvalProblem(name, p.id, ids, p.answer or "") for p, ids in zip(encoded.prompts, encoded.input_ids)
        ]
        for index in range(0, len(problems), problems_per_chunk):
            chunk_id = index // problems_per_chunk
            if (name, chunk_id) not in done_chunks:
                work.append((name, chunk_id, problems[index : index + problems_per_chunk]))

    total = sum(len(chunk) for _, _, chunk in work)
    if done:
        console.print(f"resuming: {len(done_chunks)} chunks already graded in {samples_path}")
    with progress_bar(console) as progress:
        task = progress.add_task("sampling + grading", total=total)
        for benchmark, chunk_id, chunk in work:
            params = SamplingParams(
                n=config.n,
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,
                max_new_tokens=config.max_new_tokens,
                seed=_chunk_seed(config.seed, benchmark, chunk_id),
            )
            output = generator.generate([p.prompt_ids for p in chunk], params)
            texts = tokenizer.batch_decode(output.response_ids, skip_special_tokens=True)
            records = []
            for sample_index, (text, ids, group) in enumerate(zip(texts, output.response_ids, output.group_ids)):
                problem = chunk[group]
                records.append(
                    _graded_record(
                        benchmark=benchmark,
                        problem_id=problem.problem_id,
                        sample=sample_index % config.n,
                        response=text,
                        answer=problem.answer,
                        num_tokens=len(ids),
                        truncated=output.finish_reasons[sample_index] == "length",
                        timeout=config.timeout,
                        chunk=chunk_id,
                    )
                )
            append_jsonl(samples_path, records)
            done.extend(records)
            progress.advance(task, len(chunk))
    return done


def _chunk_seed(seed: int, benchmark: str, chunk_id: int) -> int:
    digest = hashlib.sha256(f"{seed}/{benchmark}/{chunk_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _graded_record(*, benchmark: str, problem_id: str, sample: int, response: str, answer: str, num_tokens: int | None,
                   truncated: bool, timeout: float, chunk: int | None = None) -> dict:
    from opd.eval.grading import grade

    result = grade(response, answer, timeout=timeout)
    record = {
        "benchmark": benchmark, "problem_id": problem_id, "sample": sample, "answer": answer,
        "extracted": result.extracted, "correct": bool(result.correct), "num_tokens": num_tokens,
        "truncated": bool(truncated), "response": response,
    }
    if chunk is not None:
        record["chunk"] = chunk
    return record


# --------------------------------------------------------------------------------------------- responses mode

_RESPONSE_KEYS = ("response", "responses", "output", "outputs", "completion", "generated_text", "generation")
_ANSWER_KEYS = ("answer", "ground_truth", "gt", "reward_model.ground_truth", "solution")
_ID_KEYS = ("problem_id", "id", "idx", "index", "extra_info.index", "prompt", "problem", "question")
_BENCHMARK_KEYS = ("benchmark", "data_source", "source", "dataset")


def _first(record: dict, keys: tuple[str, ...]) -> tuple[str | None, Any]:
    from opd.data.prompts import MISSING, get_field

    for key in keys:
        value = get_field(record, key)
        if value is not MISSING and value is not None:
            return key, value
    return None, None


def grade_responses_file(path: str | Path, *, timeout: float = 5.0) -> list[dict]:
    """Grade a JSONL of existing generations. Each line holds a response (`response`, or a list in `responses`),
    a ground truth (`answer` / `ground_truth` / `reward_model.ground_truth`), and optionally a problem id and a
    benchmark name; lines with the same (benchmark, problem) are the n samples of one problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"responses file {path} does not exist")
    rows = read_jsonl(path, skip_partial_last_line=False)
    if not rows:
        raise ValueError(f"responses file {path} holds no records")
    records: list[dict] = []
    sample_counter: dict[tuple[str, str], int] = {}
    for line_number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
        response_key, responses = _first(row, _RESPONSE_KEYS)
        answer_key, answer = _first(row, _ANSWER_KEYS)
        if responses is None:
            raise ValueError(f"{path}:{line_number}: no response field; expected one of {', '.join(_RESPONSE_KEYS)}")
        if answer is None:
            raise ValueError(f"{path}:{line_number}: no ground-truth field; expected one of {', '.join(_ANSWER_KEYS)}")
        _, problem = _first(row, _ID_KEYS)
        _, benchmark = _first(row, _BENCHMARK_KEYS)
        benchmark = str(benchmark) if benchmark is not None else path.stem
        problem_id = str(problem) if problem is not None else f"line-{line_number}"
        if not isinstance(problem, (str, int)) and problem is not None:
            problem_id = str(problem)[:200]
        for response in responses if isinstance(responses, list) else [responses]:
            key = (benchmark, problem_id)
            sample = sample_counter.get(key, 0)
            sample_counter[key] = sample + 1
            records.append(
                _graded_record(
                    benchmark=benchmark, problem_id=problem_id, sample=sample, response=str(response),
                    answer=str(answer), num_tokens=row.get("num_tokens"), truncated=bool(row.get("truncated", False)),
                    timeout=timeout,
                )
            )
    return records


# ------------------------------------------------------------------------------------------------ reporting


def summarize_records(records: list[dict]) -> dict[str, dict]:
    """Group per-sample records by benchmark and problem and compute the SPEC §7 metrics per benchmark."""
    from opd.eval.metrics import ProblemResult, SampleResult, summarize

    problems: dict[tuple[str, str], dict[int, dict]] = {}
    for record in records:
        samples = problems.setdefault((record["benchmark"], str(record["problem_id"])), {})
        samples.setdefault(record["sample"], record)  # a chunk redone after a crash mid-append counts once
    return summarize([
        ProblemResult(
            benchmark=benchmark, problem_id=problem_id,
            samples=[SampleResult(correct=s["correct"], extracted=s["extracted"], num_tokens=s["num_tokens"] or 0,
                                  truncated=s["truncated"]) for _, s in sorted(samples.items())],
        )
        for (benchmark, problem_id), samples in problems.items()
    ])


def print_results_table(results: dict[str, dict], console: Any, title: str = "") -> None:
    """Accuracies in %, mean response length in tokens, truncation in %."""
    from rich.table import Table

    if not results:
        console.print("no results")
        return
    labels = {"mean_response_tokens": "tokens", "truncation_rate": "trunc %"}
    columns: list[str] = []
    for summary in results.values():
        for key in summary:
            if key not in columns and (key.startswith(("avg@", "pass@", "maj@")) or key in labels):
                columns.append(key)
    table = Table(title=title)
    table.add_column("benchmark")
    table.add_column("problems", justify="right")
    for column in columns:
        table.add_column(labels.get(column, column), justify="right")
    for benchmark, summary in results.items():
        cells = []
        for column in columns:
            value = summary.get(column)
            cells.append("" if value is None else (f"{value:.0f}" if column == "mean_response_tokens" else f"{100 * value:.1f}"))
        table.add_row(benchmark, str(summary.get("num_problems", "")), *cells)
    console.print(table)
