"""Tool-integrated eval (`opd eval --tools NAME`): each benchmark problem is an episode (`opd.rollout.episodes`) with
an environment, its final turn is graded as a plain sample is, and the results add the episodes' figures.

The python tool's sandbox is probed before any model loads (`tool_environment`): where the namespaces mode does not
hold here, the run is refused with one line unless `sandbox: rlimits-only` is named; results.json records the mode.

Per sample, samples.jsonl adds `turns`, `tool_calls`, `tool_errors`, `sandbox_refusals` and `episode` (the whole
conversation after the prompt, tool answers included); `response` is the final turn, the text that is graded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from opd.config import EvalConfig
from opd.rollout import SamplingParams
from opd.rollout.episodes import run_episodes, start_prompt_ids
from opd.tools.calls import check_tool_format, observation_ids
from opd.tools.environments import Environment, load_environment
from opd.tools.sandbox import probe

TOOL_RECORD_KEYS = ("turns", "tool_calls", "tool_errors", "sandbox_refusals")


class ToolSettings(Protocol):
    """What builds an environment: eval's config, `opd rollout`'s, distill's `rollout` section."""

    @property
    def tools(self) -> str | None: ...
    @property
    def sandbox(self) -> str: ...
    @property
    def tool_format(self) -> str: ...


def tool_environment(config: ToolSettings) -> Environment | None:
    """`config.tools` built (None without tools); the python tool only where `config.sandbox` holds here (probed);
    its tools such that `config.tool_format` can call them (`check_tool_format`). Raises ValueError with one line
    naming the key."""
    if config.tools is None:
        return None
    environment = _build_environment(config.tools, config)
    episode = environment.start({})
    try:
        check_tool_format(episode.tools, config.tool_format)
    finally:
        episode.close()
    return environment


def _build_environment(tools: str, config: ToolSettings) -> Environment:
    if tools == "python":
        checked = probe(config.sandbox)
        if not checked.ok:
            hint = (
                "; sandbox=rlimits-only (--sandbox rlimits-only) runs it with resource limits only, no isolation"
                if config.sandbox == "namespaces"
                else ""
            )
            raise ValueError(f"tools=python: the {config.sandbox} sandbox does not work here: {checked.reason}{hint}")
        return load_environment("python", {"sandbox": config.sandbox}, key="tools")
    return load_environment(tools, key="tools")


def tools_identity(config: EvalConfig) -> dict[str, Any]:
    """The settings of a tool eval that decide its samples (empty without tools: older directories stay resumable)."""
    if config.tools is None:
        return {}
    identity: dict[str, Any] = {"tools": config.tools, "max_turns": config.max_turns}
    if config.tools == "python":
        identity["sandbox"] = config.sandbox
    if config.tool_format != "hermes":  # older directories, all hermes, stay resumable
        identity["tool_format"] = config.tool_format
    return identity


def check_template(tokenizer: Any, environment: Environment, name: str) -> None:
    """Refuse (ValueError, one line) a chat template that cannot render tool answers, before any sampling."""
    episode = environment.start({})
    try:
        observation_ids(tokenizer, [{"role": "tool", "name": "t", "content": "x"}], episode.tools)
    except ValueError as e:
        raise ValueError(f"tools={name}: the model's chat template cannot hold tool calls: {e}") from None
    finally:
        episode.close()


def with_tools(config: EvalConfig, tokenizer: Any, environment: Environment, problems: list[Any]) -> tuple[list, int]:
    """`problems` (`EvalProblem`s) with their prompt ids as the episodes start (the tools their rows are offered in
    the prompt), those over `config.max_prompt_length` dropped; and how many were dropped."""
    kept = []
    starts = start_prompt_ids(tokenizer, environment, ((p.messages, _row(p)) for p in problems), _template(config))
    for problem, ids in zip(problems, starts):
        if len(ids) <= config.max_prompt_length:
            kept.append(replace(problem, prompt_ids=ids))
    return kept, len(problems) - len(kept)


def _template(config: EvalConfig) -> dict[str, Any]:
    return {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}


def _row(problem: Any) -> dict[str, Any]:
    """The row an episode starts from."""
    return {"benchmark": problem.benchmark, "problem_id": problem.problem_id, "answer": problem.answer}


def sample_episodes(
    config: EvalConfig,
    generator: Any,
    tokenizer: Any,
    environment: Environment,
    problems: list[Any],
    params: SamplingParams,
) -> list[dict[str, Any]]:
    """`params.n` episodes per problem (`EvalProblem`s with messages), prompt-major: per episode the final turn's
    text (graded), the whole episode's text, its student tokens, whether it ran out, and its tool figures."""
    result = run_episodes(
        generator,
        tokenizer,
        [p.messages for p in problems],
        [_row(p) for p in problems],
        environment,
        params,
        max_turns=config.max_turns,
        template=_template(config),
        tool_format=config.tool_format,
    )
    out = result.output
    episodes = []
    for b, (ids, mask, final) in enumerate(zip(out.response_ids, result.env_masks, result.final_turns())):
        episodes.append(
            {
                "response": tokenizer.decode(final, skip_special_tokens=True),
                "episode": tokenizer.decode(ids, skip_special_tokens=True),
                "num_tokens": mask.count(False),
                "truncated": out.finish_reasons[b] == "length",
                "turns": result.turns[b],
                "tool_calls": result.tool_calls[b],
                "tool_errors": result.tool_errors[b],
                "sandbox_refusals": result.sandbox_refusals[b],
            }
        )
    return episodes


def tool_summary(records: list[dict]) -> dict[str, dict[str, Any]]:
    """Per benchmark, over its tool episodes: accuracy and count by number of turns, mean tool calls per episode,
    tool errors and sandbox refusals (totals). Empty when no record has tool figures."""
    grouped: dict[str, list[dict]] = {}
    for record in records:
        if all(isinstance(record.get(key), int) for key in TOOL_RECORD_KEYS):
            grouped.setdefault(record["benchmark"], []).append(record)
    summary = {}
    for benchmark, rows in grouped.items():
        by_turns: dict[int, list[bool]] = {}
        for row in rows:
            by_turns.setdefault(row["turns"], []).append(bool(row["correct"]))
        summary[benchmark] = {
            "episodes": len(rows),
            "accuracy_by_turns": {str(t): sum(c) / len(c) for t, c in sorted(by_turns.items())},
            "episodes_by_turns": {str(t): len(c) for t, c in sorted(by_turns.items())},
            "tool_calls_mean": sum(r["tool_calls"] for r in rows) / len(rows),
            "tool_errors": sum(r["tool_errors"] for r in rows),
            "sandbox_refusals": sum(r["sandbox_refusals"] for r in rows),
        }
    return summary
