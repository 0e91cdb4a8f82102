"""`opd rollout`: teacher answers for SFT (the cold start before OPD), with rejection sampling.

For every prompt we want `n` accepted samples, each drawn up to `max_attempts` times; an attempt is rejected when
it is (a) truncated (hit max_new_tokens), (b) without an extractable final answer (`extract_answer`), (c) degenerate
(`degeneracy_reasons`), or (d) with `require_correct`, graded wrong. Every reason that applies is recorded (grading
runs only when (a)-(c) pass); retries re-sample only the rejected samples. Outputs in `out/`: `rollouts.jsonl`,
`rejected.jsonl`, `stats.json`, `config.yaml`, `identity.json` (and `out/llamafactory/`). Work is appended per fixed
batch, seeded by its rows' keys, so a rerun skips finished prompts and `num_workers` spawned processes give the same
samples; a rerun resumes only with the same settings, model files and encoded prompts (`identity.json`); the
outputs, batches, seeds and resume in full: docs/design.md, "opd.recipes.rollout".

Omitted on purpose: carrying retries into the next batch to keep the engine full, per-token log-probs in the output
(SFT does not need them), and answer-consistency voting across samples (self-consistency filtering).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from opd.config import flatten_dotted, save_config
from opd.config.rollout import RolloutConfig
from opd.eval.degeneracy import degeneracy_reasons
from opd.eval.grading import decode_responses, extract_answer, grade
from opd.fingerprints import data_fingerprint, model_fingerprint
from opd.io import append_jsonl, atomic_write_json, read_jsonl, repair_jsonl, write_jsonl
from opd.rundir import check_identity, check_same_work, locked
from opd.seeds import hashed_seed

# The CLI imports this module for RolloutConfig and must start fast: whatever loads torch (opd.types, the data,
# models and rollout packages, torch itself) is imported inside the function that needs it.
if TYPE_CHECKING:
    from opd.types import Prompt

REASONS = ("truncated", "no_answer", "repeated_line", "token_run", "repeated_block", "malformed_call", "wrong")
"""Every rejection reason, in the order they are checked and reported (`malformed_call`: an episode with a tool call
the parser could not read, which its messages cannot show as written)."""


# ------------------------------------------------------------------------------------------------ checks


@dataclass
class Check:
    """The verdict on one attempt. reasons: empty when accepted. extracted: the answer found (None: none).
    correct: graded against the ground truth (None when the prompt has none or grading did not run)."""

    reasons: list[str]
    extracted: str | None
    correct: bool | None


def check_response(
    text: str,
    token_ids: Sequence[int],
    finish_reason: str,
    answer: str | list[str] | None,
    config: RolloutConfig,
    *,
    final: str | None = None,
    malformed_calls: int = 0,
) -> Check:
    """Apply the rejection rules of the module docstring to one decoded response. For an episode: `text` and
    `token_ids` are the teacher's turns (checked for degeneracy), `final` its final turn (the answer extracted and
    graded), `malformed_calls` its calls the parser could not read."""
    final = text if final is None else final
    reasons = ["truncated"] if finish_reason == "length" else []
    extracted = extract_answer(final)
    if extracted is None:
        reasons.append("no_answer")
    reasons += degeneracy_reasons(text, token_ids, config.degeneracy)
    if malformed_calls:
        reasons.append("malformed_call")
    correct = None
    if not reasons and answer is not None:
        correct = grade(final, answer, timeout=config.grade_timeout).correct
        if config.require_correct and not correct:
            reasons.append("wrong")
    return Check(reasons, extracted, correct)


# ------------------------------------------------------------------------------------------------ one batch


@dataclass
class WorkItem:
    """One prompt to answer: its position in the (encoded) set, the templated prompt and its token ids."""

    index: int
    prompt: Prompt
    prompt_ids: list[int]


def call_seed(seed: int, keys: Sequence[tuple[str, int, int]]) -> int:
    """The seed of one generate call from the base seed and its rows' (prompt id, sample, attempt)."""
    return hashed_seed([seed, [list(key) for key in keys]], num_bytes=8)


def rollout_batch(
    batch: Sequence[WorkItem], generator: Any, tokenizer: Any, config: RolloutConfig, environment: Any = None
) -> list[dict]:
    """n samples for every prompt of `batch` with up to max_attempts draws each; one record per (prompt, sample),
    accepted (`accepted: True`, the SFT record) or exhausted (`accepted: False`, the last response and all reasons).
    With `environment` (config.tools built) each sample is an episode (`sample_episodes`)."""
    from opd.rollout.base import SamplingParams

    pending = [(k, s) for k in range(len(batch)) for s in range(config.n)]  # prompt-major, as generate returns
    history: dict[tuple[int, int], list[list[str]]] = {key: [] for key in pending}
    last: dict[tuple[int, int], tuple[str, int, str]] = {}
    records: dict[tuple[int, int], dict] = {}
    for attempt in range(1, config.max_attempts + 1):
        if attempt == 1:  # every sample of every prompt: one prefill per prompt
            prompt_ids, n = [item.prompt_ids for item in batch], config.n
        else:  # only the rejected samples, one row each
            prompt_ids, n = [batch[k].prompt_ids for k, _ in pending], 1
        params = SamplingParams(
            n=n,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_new_tokens=config.max_new_tokens,
            seed=call_seed(config.seed, [(batch[k].prompt.id, s, attempt) for k, s in pending]),
        )
        if environment is not None:
            items = batch if attempt == 1 else [batch[k] for k, _ in pending]
            samples = sample_episodes(items, generator, tokenizer, config, environment, params)
        else:
            output = generator.generate(prompt_ids, params)
            texts = decode_responses(tokenizer, output.response_ids)
            samples = [
                _Sample(text, list(ids), finish, [{"role": "assistant", "content": text}])
                for text, ids, finish in zip(texts, output.response_ids, output.finish_reasons)
            ]
        rejected = []
        for key, sample in zip(pending, samples):
            item = batch[key[0]]
            check = check_response(
                sample.text,
                sample.ids,
                sample.finish,
                item.prompt.answer,
                config,
                final=sample.final,
                malformed_calls=sample.figures.get("malformed_calls", 0),
            )
            if check.reasons:
                history[key].append(check.reasons)
                last[key] = (sample.episode or sample.text, len(sample.ids), sample.finish)
                rejected.append(key)
                continue
            records[key] = {
                **_head(item, key[1], accepted=True),
                "messages": [*_chat(item.prompt), *sample.messages],
                **({"tools": sample.tools} if environment is not None else {}),
                "attempts": attempt,
                "rejections": history[key],
                "extracted": check.extracted,
                "correct": check.correct,
                "num_tokens": len(sample.ids),
                **{k: v for k, v in sample.figures.items() if k != "malformed_calls"},
            }
        pending = rejected
        if not pending:
            break
    for key in pending:
        item = batch[key[0]]
        text, num_tokens, finish = last[key]
        records[key] = {
            **_head(item, key[1], accepted=False),
            "prompt": _chat(item.prompt),
            "attempts": config.max_attempts,
            "rejections": history[key],
            "last_response": text,
            "num_tokens": num_tokens,
            "finish_reason": finish,
        }
    return [records[key] for key in sorted(records)]


@dataclass
class _Sample:
    """One attempt: the teacher's text and tokens (every turn of an episode), how it ended, the messages it adds to
    the prompt's; for an episode also its final turn (graded), the whole episode's text, the tools offered and its
    figures (turns, tool_calls, tool_errors, sandbox_refusals, malformed_calls)."""

    text: str
    ids: list[int]
    finish: str
    messages: list[dict[str, Any]]
    final: str | None = None
    episode: str | None = None
    tools: list[dict[str, Any]] | None = None
    figures: dict[str, int] = field(default_factory=dict)


def rollout_environment(config: RolloutConfig) -> Any:
    """`config.tools` built (None without tools); the python tool only where `config.sandbox` holds here (probed).
    Raises ValueError with one line naming `tools` (`opd.eval.tools.tool_environment`)."""
    from opd.eval.tools import tool_environment

    return tool_environment(config)


def _template(config: RolloutConfig) -> dict[str, Any]:
    enable = config.data.enable_thinking
    return {} if enable is None else {"enable_thinking": enable}


def _row(item: WorkItem) -> dict[str, Any]:
    """The row an episode starts from."""
    return {"prompt_id": item.prompt.id, "source": item.prompt.source, "answer": item.prompt.answer}


def sample_episodes(
    items: Sequence[WorkItem], generator: Any, tokenizer: Any, config: RolloutConfig, environment: Any, params: Any
) -> list[_Sample]:
    """`params.n` episodes per item (`run_episodes`), prompt-major, each as the messages it adds to the prompt's:
    per turn an assistant message (its text, its calls as `tool_calls`) and a `tool` message per call (the
    environment's answer, as the model read it)."""
    from opd.rollout.episodes import run_episodes
    from opd.tools.calls import assistant_message, parse_turn, tool_messages

    recorder = _Recorder(environment)
    result = run_episodes(
        generator,
        tokenizer,
        [_chat(item.prompt) for item in items],
        [_row(item) for item in items],
        recorder,
        params,
        max_turns=config.max_turns,
        template=_template(config),
        tool_format=config.tool_format,
    )
    n = params.n
    started = [episode.row.get("prompt_id") for episode in recorder.episodes]
    if started != [item.prompt.id for item in items for _ in range(n)]:  # the layout the recorder relies on
        raise RuntimeError("run_episodes started its episodes in another order than it lays out its output")
    samples = []
    for b, (ids, mask) in enumerate(zip(result.output.response_ids, result.env_masks)):
        answers = iter(recorder.episodes[b].observations)
        messages: list[dict[str, Any]] = []
        texts, student, final, malformed = [], [], "", 0
        for is_env, segment in _segments(list(ids), mask):
            if is_env:
                continue
            student += segment
            final = tokenizer.decode(segment, skip_special_tokens=True)
            texts.append(final)
            turn = parse_turn(final, config.tool_format)
            malformed += len(turn.errors)
            messages.append(assistant_message(turn))
            if turn.items:
                observations = [next(answers, None) for _ in turn.calls]
                if all(o is not None for o in observations):  # else the episode ended before its answers
                    messages += tool_messages(turn, [o for o in observations if o is not None])
        samples.append(
            _Sample(
                text="\n".join(texts),
                ids=student,
                finish=result.output.finish_reasons[b],
                messages=messages,
                final=final,
                episode=tokenizer.decode(list(ids), skip_special_tokens=True),
                tools=recorder.episodes[b].tools,
                figures={
                    "turns": result.turns[b],
                    "tool_calls": result.tool_calls[b],
                    "tool_errors": result.tool_errors[b],
                    "sandbox_refusals": result.sandbox_refusals[b],
                    "malformed_calls": malformed,
                },
            )
        )
    return samples


def _segments(ids: list[int], mask: Sequence[bool]) -> list[tuple[bool, list[int]]]:
    """`ids` cut into runs of the teacher's (False) and the environment's (True) tokens."""
    runs: list[tuple[bool, list[int]]] = []
    for token, is_env in zip(ids, mask):
        if runs and runs[-1][0] == is_env:
            runs[-1][1].append(token)
        else:
            runs.append((is_env, [token]))
    return runs


class _Recorder:
    """An environment that keeps, per episode in the order they start (`run_episodes` starts them prompt-major, as
    it lays out its output), the tools offered and the observations given, so that the conversation can be written
    as messages with the answers exactly as the model read them."""

    def __init__(self, environment: Any) -> None:
        self.environment = environment
        self.episodes: list[_RecordedEpisode] = []

    def start(self, row: Any) -> _RecordedEpisode:
        episode = _RecordedEpisode(self.environment.start(row), row)
        self.episodes.append(episode)
        return episode

    def describe(self) -> dict[str, Any]:
        return dict(self.environment.describe())


class _RecordedEpisode:
    def __init__(self, inner: Any, row: Any) -> None:
        self.inner, self.row, self.tools = inner, row, inner.tools
        self.observations: list[Any] = []

    def answer(self, call: Any) -> Any:
        from opd.tools.environments import answer_one

        observation = answer_one(self.inner, call)
        self.observations.append(observation)
        return observation

    @property
    def done(self) -> bool:
        return bool(self.inner.done)

    def close(self) -> None:
        self.inner.close()


def _head(item: WorkItem, sample: int, *, accepted: bool) -> dict:
    return {
        "prompt_id": item.prompt.id,
        "sample": sample,
        "accepted": accepted,
        "source": item.prompt.source,
        "answer": item.prompt.answer,
    }


def _chat(prompt: Prompt) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in prompt.messages]


def run_batches(
    batches: Sequence[Sequence[WorkItem]],
    generator: Any,
    tokenizer: Any,
    config: RolloutConfig,
    log_path: Path,
    say: Callable[[str], None] = print,
    environment: Any = None,
) -> None:
    """Roll out `batches` in order, appending each finished batch's records to `log_path` (a batch that fails, e.g.
    on a sandbox that stops starting, writes nothing)."""
    for number, batch in enumerate(batches, start=1):
        start = time.perf_counter()
        records = rollout_batch(batch, generator, tokenizer, config, environment)
        append_jsonl(log_path, records)
        accepted = sum(r["accepted"] for r in records)
        say(
            f"{log_path.stem}: batch {number}/{len(batches)} ({len(batch)} prompts): {accepted}/{len(records)} "
            f"accepted, {sum(r['attempts'] for r in records)} attempts, {time.perf_counter() - start:.1f} s"
        )


# ------------------------------------------------------------------------------------------------ the command


def teacher_rollout(
    config: RolloutConfig, *, generator: Any = None, tokenizer: Any = None, console: Any = None
) -> Path:
    """Run `opd rollout` (see the module docstring) and return the output directory.

    `generator` (any `Generator`) and `tokenizer` let a caller reuse a model in memory (and tests inject scripted
    engines); they need num_workers = 1. Otherwise the tokenizer and teacher are loaded from `config.model`.
    """
    console = console or Console()
    if generator is not None and config.num_workers != 1:
        raise ValueError(
            f"a generator passed in runs in this process only; num_workers must be 1, got {config.num_workers}"
        )
    if generator is not None and tokenizer is None:
        raise ValueError("a generator passed in needs its tokenizer too (tokenizer=...)")
    out = Path(config.out)
    environment = rollout_environment(config)  # the sandbox is probed before anything is written or loaded
    if config.tools == "python" and config.sandbox == "rlimits-only":
        who = "as root: it can change any file of this host" if os.geteuid() == 0 else "as this user"
        console.print(f"[yellow]sandbox=rlimits-only: the model's code runs with resource limits only, {who}[/]")
    with locked(out, "rollout"):  # one process per output directory
        return _rollout_locked(
            config, out, generator=generator, tokenizer=tokenizer, console=console, environment=environment
        )


def _rollout_locked(
    config: RolloutConfig, out: Path, *, generator: Any, tokenizer: Any, console: Any, environment: Any
) -> Path:
    """The body of `teacher_rollout`, run holding the lock of `out`."""
    from opd.data.prompts import load_prompts
    from opd.data.templates import encode_prompts

    shards = out / "shards"
    resuming = any(shards.glob("rank_*.jsonl"))
    if resuming:
        _check_resumable(out, config)
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out)
    if tokenizer is None:
        from opd.models import load_tokenizer

        tokenizer = load_tokenizer(config.model.path, trust_remote_code=config.model.trust_remote_code)

    data = config.data
    prompts = load_prompts(
        data.path,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        id_key=data.id_key,
        split=data.split,
        limit=data.limit,
        on_missing_answer=data.on_missing_answer,
    )
    if config.require_correct:
        missing = [p.id for p in prompts if p.answer is None]
        if missing:
            raise ValueError(
                f"require_correct needs a ground truth for every prompt, but {len(missing)} have none "
                f"(first: id {missing[0]!r}); set data.answer_key or drop --require-correct"
            )
    encoded = encode_prompts(
        tokenizer,
        prompts,
        max_prompt_length=data.max_prompt_length,
        on_overflow=data.on_overflow,
        enable_thinking=data.enable_thinking,
        template=data.template,
    )
    if encoded.num_filtered:
        console.print(f"[yellow]{encoded.num_filtered} prompts longer than {data.max_prompt_length} tokens skipped[/]")
    items = [WorkItem(i, p, ids) for i, (p, ids) in enumerate(zip(encoded.prompts, encoded.input_ids))]
    if environment is not None:
        items = _with_tools(items, tokenizer, config, environment, console)
    check_identity(  # the model's files and the encoded prompts, or one output would mix two models' samples
        out / "identity.json",
        {"model_files": model_fingerprint(config.model.path), "prompts_sha256": _prompts_fingerprint(items)},
        resuming=resuming,
        out=out,
        what="a rollout",
    )

    for path in sorted(shards.glob("rank_*.jsonl")):
        repair_jsonl(path)
    finished = _finished_prompts(_read_logs(shards), config.n)
    per_batch = max(1, config.batch_size // config.n)
    batches = [
        [item for item in items[i : i + per_batch] if item.prompt.id not in finished]
        for i in range(0, len(items), per_batch)
    ]
    batches = [batch for batch in batches if batch]
    if finished:
        console.print(f"resuming: {len(finished)} of {len(items)} prompts already finished in {shards}")
    start = time.perf_counter()
    if batches and config.num_workers == 1:
        if generator is None:
            generator, tokenizer = _load_teacher(config, config.model.device)
        run_batches(
            batches, generator, tokenizer, config, shards / "rank_0.jsonl", say=console.print, environment=environment
        )
    elif batches:
        _run_workers(config, batches, shards)
    seconds = time.perf_counter() - start

    stats = _merge(items, _read_logs(shards), config, out, num_filtered=encoded.num_filtered, seconds=seconds)
    print_stats(stats, console, title=f"opd rollout — {out}")
    return out


def _with_tools(
    items: list[WorkItem], tokenizer: Any, config: RolloutConfig, environment: Any, console: Any
) -> list[WorkItem]:
    """`items` with their prompt ids as their episodes start (the tools offered in the prompt), those over
    `data.max_prompt_length` dropped with a count; a template that cannot render tool answers is refused."""
    from opd.tools.calls import observation_ids, prompt_ids

    kept: list[WorkItem] = []
    for item in items:
        episode = environment.start(_row(item))
        try:
            if not kept:
                try:
                    observation_ids(tokenizer, [{"role": "tool", "name": "t", "content": "x"}], episode.tools)
                except ValueError as e:
                    raise ValueError(
                        f"tools={config.tools}: the model's chat template cannot hold tool calls: {e}"
                    ) from None
            ids = prompt_ids(tokenizer, _chat(item.prompt), episode.tools, **_template(config))
        finally:
            episode.close()
        if len(ids) <= config.data.max_prompt_length:
            kept.append(WorkItem(item.index, item.prompt, ids))
    if len(kept) < len(items):
        console.print(
            f"[yellow]{len(items) - len(kept)} prompts longer than {config.data.max_prompt_length} tokens with the "
            f"tools offered skipped[/]"
        )
    if not kept:
        raise ValueError(
            f"tools={config.tools}: no prompt fits data.max_prompt_length={config.data.max_prompt_length} with the "
            "tools offered (the template writes their schemas into the prompt); raise data.max_prompt_length"
        )
    return kept


def _load_teacher(config: RolloutConfig, device: str) -> tuple[Any, Any]:
    """(TorchGenerator over the teacher on `device`, its tokenizer)."""
    from opd.models import fix_rope, load_model
    from opd.rollout import make_generator

    spec = config.model
    length = config.data.max_prompt_length + config.max_new_tokens  # the longest sequence sampled
    if config.engine == "vllm":  # vLLM loads the weights itself: no HF copy of the model
        from opd.models import load_tokenizer
        from opd.rollout.registry import check_vllm_rope, vllm_arguments

        check_vllm_rope(spec, config.vllm, length, "engine=vllm")
        tokenizer = load_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code)
        return make_generator(
            None, tokenizer, engine="vllm", max_batch_size=config.batch_size, **vllm_arguments(config.vllm, spec)
        ), tokenizer
    model, tokenizer = load_model(
        spec.path,
        dtype=spec.dtype,
        device=device,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )
    # one RoPE table for every row (`fix_rope`): a length-dependent one would follow each batch's longest row
    fix_rope(model, length)
    generator = make_generator(model, tokenizer, engine="torch", max_batch_size=config.batch_size)
    return generator, tokenizer


def _check_resumable(out: Path, config: RolloutConfig) -> None:
    """A rerun into `out` that already holds samples must ask for the same samples: compare with its config.yaml."""
    saved_path = out / "config.yaml"
    if not saved_path.exists():
        return

    saved = flatten_dotted(yaml.safe_load(saved_path.read_text()) or {})
    current = flatten_dotted(config.model_dump(mode="json"))
    check_same_work(out, saved, current, what="a rollout", command="rollout")


def _prompts_fingerprint(items: Sequence[WorkItem]) -> str:
    """The encoded prompts a rollout samples from: token ids, ids and ground truths (`data_fingerprint`)."""
    return data_fingerprint((item.prompt_ids, [item.prompt.id, item.prompt.answer]) for item in items)[:16]


def _read_logs(shards: Path) -> dict[tuple[str, int], dict]:
    """Every logged record by (prompt id, sample); a record logged twice (a batch redone after a crash inside
    its append) counts once, the last one."""
    records: dict[tuple[str, int], dict] = {}
    for path in sorted(shards.glob("rank_*.jsonl")):
        for record in read_jsonl(path):
            records[(record["prompt_id"], record["sample"])] = record
    return records


def _finished_prompts(records: dict[tuple[str, int], dict], n: int) -> set[str]:
    samples = Counter(prompt_id for prompt_id, sample in records if sample < n)
    return {prompt_id for prompt_id, count in samples.items() if count == n}


# ------------------------------------------------------------------------------------------------ workers


def _worker_devices(config: RolloutConfig) -> list[str]:
    if config.devices is not None:
        return list(config.devices)
    import torch

    if torch.cuda.is_available() and config.model.device in ("auto", "cuda"):
        if config.num_workers > torch.cuda.device_count():
            raise ValueError(
                f"num_workers={config.num_workers} but only {torch.cuda.device_count()} CUDA devices "
                f"exist; lower num_workers or list devices explicitly"
            )
        return [f"cuda:{k}" for k in range(config.num_workers)]
    return [config.model.device] * config.num_workers


def _run_workers(config: RolloutConfig, batches: list[list[WorkItem]], shards: Path) -> None:
    """Spawn one process per worker; worker k runs batches k, k + W, k + 2W, ... and logs to rank_k.jsonl."""
    import torch.multiprocessing as mp

    devices = _worker_devices(config)
    assignments = [batches[k :: config.num_workers] for k in range(config.num_workers)]
    mp.start_processes(
        _worker_main,
        args=(config, assignments, devices, str(shards)),
        nprocs=config.num_workers,
        join=True,
        start_method="spawn",
    )


def _worker_main(
    rank: int, config: RolloutConfig, assignments: list[list[list[WorkItem]]], devices: list[str], shards: str
) -> None:
    import torch

    if not assignments[rank]:
        return
    if devices[rank].startswith("cpu") or (devices[rank] == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.num_workers))  # no oversubscription
    environment = rollout_environment(config)
    generator, tokenizer = _load_teacher(config, devices[rank])
    run_batches(
        assignments[rank],
        generator,
        tokenizer,
        config,
        Path(shards) / f"rank_{rank}.jsonl",
        say=lambda line: print(f"[worker {rank} {devices[rank]}] {line}", flush=True),
        environment=environment,
    )


# ------------------------------------------------------------------------------------------------ outputs


def _merge(
    items: list[WorkItem],
    logged: dict[tuple[str, int], dict],
    config: RolloutConfig,
    out: Path,
    *,
    num_filtered: int,
    seconds: float,
) -> dict:
    """Write rollouts.jsonl, rejected.jsonl, stats.json (and the LlamaFactory files) from the logs, in prompt
    order; return the stats."""
    records = [logged[(item.prompt.id, s)] for item in items for s in range(config.n) if (item.prompt.id, s) in logged]
    accepted = [{k: v for k, v in r.items() if k != "accepted"} for r in records if r["accepted"]]
    rejected = [{k: v for k, v in r.items() if k != "accepted"} for r in records if not r["accepted"]]
    write_jsonl(out / "rollouts.jsonl", accepted)
    write_jsonl(out / "rejected.jsonl", rejected)
    stats = rollout_stats(records, num_prompts=len(items), num_filtered=num_filtered)
    stats["seconds"] = round(seconds, 2)
    atomic_write_json(out / "stats.json", stats)
    if config.llamafactory:
        write_llamafactory(accepted, out / "llamafactory", config.dataset_name)
    return stats


def rollout_stats(records: Sequence[dict], *, num_prompts: int, num_filtered: int = 0) -> dict:
    """Acceptance statistics over the per-sample records (accepted and exhausted).

    rejections[reason]: attempts rejected for that reason (an attempt may have several);
    rejection_rate[reason]: that count over all attempts; accepted_at_attempt[k]: samples accepted on draw k."""
    attempts = sum(r["attempts"] for r in records)
    accepted = [r for r in records if r["accepted"]]
    reasons = Counter(reason for r in records for attempt in r["rejections"] for reason in attempt)
    graded = [r["correct"] for r in accepted if r.get("correct") is not None]
    return {
        "prompts": num_prompts,
        "prompts_filtered_too_long": num_filtered,
        "samples": len(records),
        "accepted": len(accepted),
        "exhausted": len(records) - len(accepted),
        "acceptance_rate": len(accepted) / len(records) if records else 0.0,
        "attempts": attempts,
        "attempt_acceptance_rate": len(accepted) / attempts if attempts else 0.0,
        "accepted_at_attempt": {str(k): v for k, v in sorted(Counter(r["attempts"] for r in accepted).items())},
        "rejections": {reason: reasons[reason] for reason in REASONS},
        "rejection_rate": {reason: reasons[reason] / attempts if attempts else 0.0 for reason in REASONS},
        "accepted_correct_rate": sum(graded) / len(graded) if graded else None,
        "mean_accepted_tokens": float(np.mean([r["num_tokens"] for r in accepted])) if accepted else None,
    }


def print_stats(stats: dict, console: Any, title: str = "") -> None:
    table = Table(title=title)
    table.add_column("rejected for")
    table.add_column("attempts", justify="right")
    table.add_column("% of attempts", justify="right")
    for reason in REASONS:
        table.add_row(reason, str(stats["rejections"][reason]), f"{100 * stats['rejection_rate'][reason]:.1f}")
    console.print(table)
    at = ", ".join(f"{k}: {v}" for k, v in stats["accepted_at_attempt"].items()) or "-"
    console.print(
        f"accepted {stats['accepted']}/{stats['samples']} samples ({100 * stats['acceptance_rate']:.1f}%) "
        f"of {stats['prompts']} prompts; {stats['attempts']} attempts "
        f"({100 * stats['attempt_acceptance_rate']:.1f}% accepted); accepted at attempt {at}"
    )


def write_llamafactory(records: Sequence[dict], directory: Path, name: str) -> Path:
    """The accepted records as a LlamaFactory sharegpt dataset: `<name>.json` (a list of {conversations: [{from:
    human|gpt, value}], system?}) and `dataset_info.json` mapping it; train with `dataset_dir: <directory>` and
    `dataset: <name>`. A system message goes to the `system` column (mapped only when some record has one)."""
    roles = {"user": "human", "assistant": "gpt"}
    has_system = any(m["role"] == "system" for r in records for m in r["messages"])
    rows = []
    for record in records:
        row: dict[str, Any] = {
            "conversations": [
                {"from": roles[m["role"]], "value": m["content"]} for m in record["messages"] if m["role"] != "system"
            ]
        }
        if has_system:
            row["system"] = next((m["content"] for m in record["messages"] if m["role"] == "system"), "")
        rows.append(row)
    columns = {"messages": "conversations", **({"system": "system"} if has_system else {})}
    info = {
        name: {
            "file_name": f"{name}.json",
            "formatting": "sharegpt",
            "columns": columns,
            "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"},
        }
    }
    atomic_write_json(directory / f"{name}.json", rows)
    atomic_write_json(directory / "dataset_info.json", info)
    return directory
