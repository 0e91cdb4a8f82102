"""Sample n answers per benchmark problem and grade them, resumably, in one directory: the component behind
`opd eval`'s model mode (`opd.recipes.eval`) and the trainers' periodic evals (`run_dir/eval/step_N/`).

Outputs: `identity.json` (what the samples are made with), `config.yaml`, `samples.jsonl` (appended as work
finishes) and `results.json` (atomic, at the end). Problems run in fixed chunks seeded by (seed, benchmark, chunk
index), so a rerun into the same directory keeps every complete chunk and reproduces the rest; a rerun that asks for
other work (`identity.json`: the model's fingerprint, the sampling settings, each benchmark's hash) is refused with
one line before a model loads. The resume and identity rules in full: docs/design.md, "opd.eval.sampling". With
`tools` set, each sample is an episode with that environment (`opd.eval.tools`: built, and the python tool's sandbox
probed, before a model loads).

Omitted on purpose: extending a finished directory with more benchmarks, problems or samples (other work: use
another --out). Every weight byte is hashed (SHA-1, once per file and process; its cost: docs/performance.md):
sampled blocks missed tensors changed in place.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from opd.config import EvalConfig, ModelSpec, flatten_dotted, save_config
from opd.data.templates import encode_prompts, parse_template
from opd.eval.benchmarks import load_benchmark
from opd.eval.grading import decode_responses, grade
from opd.eval.metrics import ProblemResult, SampleResult, summarize
from opd.eval.tools import (
    TOOL_RECORD_KEYS,
    check_template,
    sample_episodes,
    tool_environment,
    tool_summary,
    tools_identity,
    with_tools,
)
from opd.fingerprints import file_digest, model_fingerprint, weights_fingerprint  # noqa: F401 (their old home)
from opd.io import append_jsonl, atomic_write_json, write_jsonl
from opd.models import fix_rope, load_model, load_tokenizer
from opd.names import benchmark_names
from opd.report.sinks import progress_bar
from opd.rollout import SamplingParams, make_generator
from opd.rollout.registry import check_vllm_rope, vllm_arguments
from opd.rundir import check_same_work, locked
from opd.seeds import hashed_seed

IDENTITY_FILE = "identity.json"
_OUR_FILES = ("config.yaml", "samples.jsonl", "results.json")


@dataclass
class EvalProblem:
    """One problem to evaluate: the prompt token ids and its ground truth (a list: any of them)."""

    benchmark: str
    problem_id: str
    prompt_ids: list[int]
    answer: str | list[str]
    messages: list[dict[str, Any]] | None = None


def evaluate_model(
    config: EvalConfig,
    run_dir: Path,
    *,
    generator: Any = None,
    tokenizer: Any = None,
    console: Any = None,
    weights: str | None = None,
) -> dict:
    """Sample and grade `config.model` on `config.benchmarks` into `run_dir` (resuming its complete chunks), write
    results.json, print the table; return the results ({benchmark: metrics}).

    `generator`/`tokenizer` let a caller (the trainer's periodic eval, the demo) reuse a model already in memory;
    otherwise they are loaded from `config.model`. One process per `run_dir` (its lock is held throughout).
    `weights`: the `weights_fingerprint` of that model in memory, when its weights are not `config.model.path`'s (a
    trainer's): it is the model's identity, and a directory made by other weights is evaluated again from scratch (a
    trainer owns its `eval/step_N`; a resume with other settings makes other weights at the same step).
    """
    console = console or Console()
    parse_template(config.template)  # a bad template fails before the model loads
    environment = tool_environment(config)  # the sandbox is probed before the model loads too
    if config.tools == "python" and config.sandbox == "rlimits-only":
        who = "as root: it can change any file of this host" if os.geteuid() == 0 else "as this user"
        console.print(f"[yellow]sandbox=rlimits-only: the model's code runs with resource limits only, {who}[/]")
    run_dir.mkdir(parents=True, exist_ok=True)
    with locked(run_dir, "eval"):  # one process per output directory
        records = _sample_and_grade(config, run_dir, generator, tokenizer, console, weights, environment)
        tools = environment.describe() if environment is not None else None
        if tools is not None and config.tool_format != "hermes":  # results of the default format read as before
            tools = {**tools, "tool_format": config.tool_format}
        return write_results(config, run_dir, records, console, tools=tools)


def write_results(
    config: EvalConfig, run_dir: Path, records: list[dict], console: Any, *, tools: dict[str, Any] | None = None
) -> dict:
    """Summarise graded `records` per benchmark, write `run_dir/results.json` atomically, print the table. `tools`:
    the environment of a tool eval (its `describe()`, the sandbox mode included), recorded with the episodes'
    figures per benchmark under `tools`."""
    results = summarize_records(records)
    results_meta: dict[str, Any] = {"model": config.model.path if config.model else None, "responses": config.responses}
    episodes = tool_summary(records)
    for benchmark, figures in episodes.items():
        results[benchmark]["tools"] = figures
    if tools is not None:
        results_meta["tools"] = tools
    atomic_write_json(run_dir / "results.json", {**results_meta, "benchmarks": results})
    print_results_table(results, console, title=f"opd eval — {run_dir}")
    for benchmark, figures in episodes.items():
        by_turns = ", ".join(
            f"{t} turns {100 * acc:.1f}% of {figures['episodes_by_turns'][t]}"
            for t, acc in figures["accuracy_by_turns"].items()
        )
        console.print(
            f"{benchmark} tools: {figures['tool_calls_mean']:.2f} calls per episode, {figures['tool_errors']} errors, "
            f"{figures['sandbox_refusals']} sandbox refusals; accuracy by turns: {by_turns}"
        )
    if tools is not None and "sandbox" in tools:
        console.print(f"sandbox: {tools['sandbox']}")
    console.print(f"results: {run_dir / 'results.json'}")
    return results


# ------------------------------------------------------------------------------------------------ identity


def check_resumable(run_dir: Path, identity: dict[str, Any]) -> None:
    """Refuse (ValueError, one line) a run directory holding eval output made with anything but `identity`."""
    saved_path = run_dir / IDENTITY_FILE
    if saved_path.is_file() and not any(_non_empty(run_dir / name) for name in ("samples.jsonl", "results.json")):
        return  # ours, but nothing was written under it yet
    if not saved_path.is_file():
        ours = [name for name in _OUR_FILES if (run_dir / name).exists()]
        if ours:
            raise ValueError(
                f"{run_dir} holds {', '.join(ours)} but no {IDENTITY_FILE} (another command's output, "
                f"or an older opd's); use another --out"
            )
        return
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{saved_path}: unreadable ({e}); use another --out") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{saved_path}: not a JSON object; use another --out")
    check_same_work(run_dir, flatten_dotted(saved), flatten_dotted(identity), what="eval samples", command="eval")


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def start_work(run_dir: Path, identity: dict[str, Any], config: EvalConfig) -> None:
    """identity.json first, then config.yaml: a directory with our files but no identity is never ours."""
    atomic_write_json(run_dir / IDENTITY_FILE, identity)
    save_config(config, run_dir)


def model_identity(config: EvalConfig) -> dict[str, Any]:
    """What of the model decides the samples: path, a fingerprint of its local files, dtype, attention, remote code."""
    spec = _model_spec(config)
    return {
        "path": spec.path,
        "files": model_fingerprint(spec.path),
        "dtype": spec.dtype,
        "attn_implementation": spec.attn_implementation,
        "trust_remote_code": spec.trust_remote_code,
    }


def _problems_sha256(prompts: list) -> str:
    """Hash of a benchmark as loaded: ids, messages and answers, in order (what the samples and grades depend on)."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([p.id, p.messages, p.answer], ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ model mode


def _sample_and_grade(
    config: EvalConfig,
    run_dir: Path,
    generator: Any,
    tokenizer: Any,
    console: Any,
    weights: str | None = None,
    environment: Any = None,
) -> list[dict]:
    """All graded records of `run_dir`: the complete chunks already in samples.jsonl, then the rest sampled and
    graded (appended as each chunk finishes).

    Phases: 1. load the benchmarks and check `run_dir`'s identity (before any model loads); 2. load the model unless
    a generator was given; 3. keep the complete chunks (`_resume`); 4. sample and grade the rest (`_sample_chunk`)."""
    loaded = {
        name: load_benchmark(
            benchmark,
            prompt_key=config.prompt_key,
            answer_key=config.answer_key,
            on_missing_answer=config.on_missing_answer,
        )
        for benchmark, name in zip(config.benchmarks, benchmark_names(config.benchmarks))
    }
    identity = _identity(config, loaded, weights)
    try:
        check_resumable(run_dir, identity)  # before any model is loaded
    except ValueError as error:
        if weights is None:
            raise
        console.print(f"[yellow]{run_dir}: made by other weights or settings, evaluated again ({error})[/]")
        for name in (*_OUR_FILES, IDENTITY_FILE):
            (run_dir / name).unlink(missing_ok=True)
    if generator is None:
        generator, tokenizer = _load_generator(config)
        if config.engine != "vllm":
            identity["model"] = model_identity(config)  # a hub id is in the local cache now
    if environment is not None:
        check_template(tokenizer, environment, str(config.tools))

    chunks = _chunks(config, loaded, tokenizer, console, environment)
    samples_path = run_dir / "samples.jsonl"
    records_done, work = _resume(run_dir, samples_path, chunks, identity, config, console)
    with progress_bar(console) as progress:
        task = progress.add_task("sampling + grading", total=sum(len(chunk) for _, _, chunk in work))
        for benchmark, chunk_id, chunk in work:
            records = _sample_chunk(config, generator, tokenizer, benchmark, chunk_id, chunk, environment)
            append_jsonl(samples_path, records)
            records_done.extend(records)
            progress.advance(task, len(chunk))
    return records_done


_IDENTITY_SETTINGS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "seed",
    "template",
    "enable_thinking",
    "max_prompt_length",
    "batch_size",
    "limit",
    "prompt_key",
    "answer_key",
    "on_missing_answer",
    "engine",
)
"""The EvalConfig settings that decide the samples (part of identity.json)."""


def _identity(config: EvalConfig, loaded: dict[str, list], weights: str | None) -> dict[str, Any]:
    """What the samples are made with (identity.json): the model (and `weights`), the settings, each benchmark's
    hash."""
    return {
        "mode": "model",
        "model": model_identity(config) if weights is None else {**model_identity(config), "weights": weights},
        **{key: getattr(config, key) for key in _IDENTITY_SETTINGS},
        "benchmarks": {name: _problems_sha256(prompts) for name, prompts in loaded.items()},
        **tools_identity(config),
    }


def _load_generator(config: EvalConfig) -> tuple[Any, Any]:
    """(generator, tokenizer) of `config.model` with `config.engine`: vLLM loads the weights itself (no Hugging Face
    copy of the model), the other engines a loaded model."""
    spec = _model_spec(config)
    length = config.max_prompt_length + config.max_new_tokens  # the eval's longest sequence
    if config.engine == "vllm":
        check_vllm_rope(spec, config.vllm, length, "engine=vllm")
        tokenizer = load_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code)
        generator = make_generator(
            None, tokenizer, engine="vllm", max_batch_size=config.batch_size, **vllm_arguments(config.vllm, spec)
        )
        return generator, tokenizer
    model, tokenizer = load_model(
        spec.path,
        dtype=spec.dtype,
        device=spec.device,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    # one RoPE table for every row (`fix_rope`): a length-dependent one would follow each batch's longest row
    fix_rope(model, length)
    return make_generator(model, tokenizer, engine=config.engine, max_batch_size=config.batch_size), tokenizer


def _resume(
    run_dir: Path,
    samples_path: Path,
    chunks: list[tuple[str, int, list[EvalProblem]]],
    identity: dict[str, Any],
    config: EvalConfig,
    console: Any,
) -> tuple[list[dict], list[tuple[str, int, list[EvalProblem]]]]:
    """Write identity.json and config.yaml, keep the complete chunks of samples.jsonl (rewriting it without the
    others); return (their records, the chunks still to do)."""
    done, dropped = complete_chunks(samples_path, chunks, config.n)
    start_work(run_dir, identity, config)
    if dropped:  # partial chunks, broken or stray lines: rewrite the file without them (atomically), then redo
        write_jsonl(samples_path, [r for records in done.values() for r in records])
    work = [chunk for chunk in chunks if (chunk[0], chunk[1]) not in done]
    if done or dropped:
        console.print(
            f"resuming: {len(done)} of {len(chunks)} chunks complete in {samples_path}"
            + (f"; {dropped} lines of partial chunks dropped, those chunks are redone" if dropped else "")
        )
    return [r for records in done.values() for r in records], work


def _sample_chunk(
    config: EvalConfig,
    generator: Any,
    tokenizer: Any,
    benchmark: str,
    chunk_id: int,
    chunk: list[EvalProblem],
    environment: Any = None,
) -> list[dict]:
    """n samples per problem of one chunk (seeded by the chunk), graded: its records for samples.jsonl. With an
    `environment`, each sample is an episode (`opd.eval.tools`) whose final turn is graded."""
    params = SamplingParams(
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_new_tokens,
        seed=_chunk_seed(config.seed, benchmark, chunk_id),
    )
    if environment is not None:
        episodes = sample_episodes(config, generator, tokenizer, environment, chunk, params)
        records = []
        for index, episode in enumerate(episodes):
            problem = chunk[index // config.n]
            record = graded_record(
                benchmark=benchmark,
                problem_id=problem.problem_id,
                sample=index % config.n,
                response=episode["response"],
                answer=problem.answer,
                num_tokens=episode["num_tokens"],
                truncated=episode["truncated"],
                timeout=config.timeout,
                chunk=chunk_id,
            )
            records.append(record | {key: episode[key] for key in (*TOOL_RECORD_KEYS, "episode")})
        return records
    output = generator.generate([p.prompt_ids for p in chunk], params)
    texts = decode_responses(tokenizer, output.response_ids)
    records = []
    for sample_index, (text, ids, group) in enumerate(zip(texts, output.response_ids, output.group_ids)):
        problem = chunk[group]
        records.append(
            graded_record(
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
    return records


def _model_spec(config: EvalConfig) -> ModelSpec:
    """The model of a model-mode eval (`opd eval --model`)."""
    if config.model is None:
        raise ValueError("opd eval: sampling needs a model (--model); --responses FILE grades existing answers")
    return config.model


def _chunks(
    config: EvalConfig, loaded: dict[str, list], tokenizer: Any, console: Any, environment: Any = None
) -> list[tuple[str, int, list[EvalProblem]]]:
    """The benchmarks' problems encoded and cut into (benchmark, chunk index, problems) of `batch_size // n`
    problems each: the unit of sampling, of its seed and of resume. With an `environment`, a prompt's ids are those
    with its tools offered, and `max_prompt_length` counts them."""
    problems_per_chunk = max(1, config.batch_size // config.n)
    chunks: list[tuple[str, int, list[EvalProblem]]] = []
    for name, prompts in loaded.items():
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
            console.print(
                f"[yellow]{name}: {encoded.num_filtered} prompts longer than "
                f"{config.max_prompt_length} tokens skipped[/]"
            )
        problems = []
        for p, ids in zip(encoded.prompts, encoded.input_ids):
            assert p.answer is not None  # on_missing_answer is "error" or "skip" here: every prompt has one
            problems.append(EvalProblem(name, p.id, ids, p.answer, p.messages))
        if environment is not None:
            problems, longer = with_tools(config, tokenizer, environment, problems)
            if longer and not problems:
                raise ValueError(
                    f"{name}: every prompt is longer than max_prompt_length={config.max_prompt_length} tokens with "
                    f"the tools offered; raise max_prompt_length"
                )
            if longer:
                console.print(
                    f"[yellow]{name}: {longer} prompts longer than {config.max_prompt_length} tokens with the tools "
                    "offered skipped[/]"
                )
        for index in range(0, len(problems), problems_per_chunk):
            chunks.append((name, index // problems_per_chunk, problems[index : index + problems_per_chunk]))
    return chunks


def complete_chunks(
    path: Path, chunks: list[tuple[str, int, list[EvalProblem]]], n: int
) -> tuple[dict[tuple[str, int], list[dict]], int]:
    """The complete chunks of `samples.jsonl` ({(benchmark, chunk): its records}) and the number of lines that are not
    part of one (broken JSON, invalid records, lines of a partial chunk, duplicates, lines of no planned chunk).

    A chunk is complete when every (problem, sample) it plans has exactly one valid line."""
    if not path.exists():
        return {}, 0
    expected = {
        (name, chunk_id): {(p.problem_id, s) for p in chunk for s in range(n)} for name, chunk_id, chunk in chunks
    }
    found: dict[tuple[str, int], dict[tuple[str, int], dict]] = {}
    lines = 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        lines += 1
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not _valid_record(record):
            continue
        key = (record["benchmark"], record["chunk"])
        if (record["problem_id"], record["sample"]) in expected.get(key, ()):
            found.setdefault(key, {}).setdefault((record["problem_id"], record["sample"]), record)
    done = {key: list(records.values()) for key, records in found.items() if set(records) == expected[key]}
    return done, lines - sum(map(len, done.values()))


_RECORD_TYPES = {
    "benchmark": str,
    "problem_id": str,
    "sample": int,
    "chunk": int,
    "correct": bool,
    "truncated": bool,
    "response": str,
}


def _valid_record(record: Any) -> bool:
    return (
        isinstance(record, dict)
        and all(isinstance(record.get(key), kind) for key, kind in _RECORD_TYPES.items())
        and (record.get("extracted") is None or isinstance(record["extracted"], str))
        and (record.get("num_tokens") is None or isinstance(record["num_tokens"], int))
    )


def _chunk_seed(seed: int, benchmark: str, chunk_id: int) -> int:
    return hashed_seed(f"{seed}/{benchmark}/{chunk_id}")


def graded_record(
    *,
    benchmark: str,
    problem_id: str,
    sample: int,
    response: str,
    answer: str | list[str],
    num_tokens: int | None,
    truncated: bool,
    timeout: float,
    chunk: int | None = None,
) -> dict:
    """One line of samples.jsonl: `response` graded against `answer` (`chunk`: the model mode's resume unit)."""
    result = grade(response, answer, timeout=timeout)
    record = {
        "benchmark": benchmark,
        "problem_id": problem_id,
        "sample": sample,
        "answer": answer,
        "extracted": result.extracted,
        "correct": bool(result.correct),
        "num_tokens": num_tokens,
        "truncated": bool(truncated),
        "response": response,
    }
    if chunk is not None:
        record["chunk"] = chunk
    return record


# ------------------------------------------------------------------------------------------------ reporting


def summarize_records(records: list[dict]) -> dict[str, dict]:
    """Group per-sample records by benchmark and problem and compute the SPEC §7 metrics per benchmark."""
    problems: dict[tuple[str, str], dict[int, dict]] = {}
    for record in records:
        samples = problems.setdefault((record["benchmark"], str(record["problem_id"])), {})
        samples.setdefault(record["sample"], record)  # a chunk redone after a crash mid-append counts once
    return summarize(
        [
            ProblemResult(
                benchmark=benchmark,
                problem_id=problem_id,
                samples=[
                    SampleResult(
                        correct=s["correct"],
                        extracted=s["extracted"],
                        num_tokens=s["num_tokens"] or 0,
                        truncated=s["truncated"],
                    )
                    for _, s in sorted(samples.items())
                ],
            )
            for (benchmark, problem_id), samples in problems.items()
        ]
    )


def print_results_table(results: dict[str, dict], console: Any, title: str = "") -> None:
    """Accuracies in %, mean response length in tokens, truncation in %."""
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
            cells.append(
                "" if value is None else (f"{value:.0f}" if column == "mean_response_tokens" else f"{100 * value:.1f}")
            )
        table.add_row(benchmark, str(summary.get("num_problems", "")), *cells)
    console.print(table)
