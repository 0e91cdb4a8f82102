"""`opd eval --tools`: episodes graded on their final turn, the tool figures in results.json, the sandbox probed and
refused before any model loads (a tiny random model end to end, and a scripted model that really uses its tools)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from helpers import eval_args, write_jsonl
from helpers_tools import (
    QUESTION,
    TOOL_RESPONSE,
    ScriptedModel,
    calculator_then_answer,
    make_tool_tokenizer,
    python_then_answer,
)
from opd.cli import app
from opd.cli_errors import user_error_line
from opd.config import EvalConfig, ModelSpec
from opd.io import read_jsonl
from opd.recipes.eval import evaluate
from opd.tools.sandbox import ProbeResult, probe


@pytest.fixture()
def problem_file(tmp_path):
    rows = [{"problem": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(3)]
    return write_jsonl(tmp_path / "toy.jsonl", rows)


def _config(model_dir, problem_file, out, **changes):
    fields = dict(
        model=ModelSpec(path=str(model_dir)),
        benchmarks=[str(problem_file)],
        prompt_key="problem",
        answer_key="answer",
        n=2,
        batch_size=4,
        max_new_tokens=200,
        out=str(out),
        tools="calculator",
    )
    return EvalConfig(**{**fields, **changes})


def test_a_model_that_uses_the_calculator_is_graded_on_its_final_turn(tiny_model_dir, problem_file, tmp_path):
    tokenizer = make_tool_tokenizer()
    out = tmp_path / "run"
    config = _config(tiny_model_dir, problem_file, out)
    model = ScriptedModel(tokenizer, calculator_then_answer)
    results = evaluate(config, generator=model, tokenizer=tokenizer, console=Console(record=True))
    assert results["toy"]["avg@2"] == 1.0
    figures = results["toy"]["tools"]
    assert figures["episodes"] == 6 and figures["accuracy_by_turns"] == {"2": 1.0}
    assert figures["tool_calls_mean"] == 1 and figures["tool_errors"] == 0 and figures["sandbox_refusals"] == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["tools"] == {"name": "calculator"} and saved["benchmarks"]["toy"]["tools"] == figures
    samples = read_jsonl(out / "samples.jsonl")
    assert all(s["turns"] == 2 and s["response"].startswith("So the answer") for s in samples)
    assert all("<tool_response>" in s["episode"] for s in samples)
    identity = json.loads((out / "identity.json").read_text())
    assert identity["tools"] == "calculator" and identity["max_turns"] == 4


def test_a_malformed_call_is_a_tool_error_and_the_run_completes(tiny_model_dir, problem_file, tmp_path):
    def malformed_then_gives_up(context: str) -> str:
        if "<tool_response>" in context:
            return "I cannot tell: \\boxed{0}."
        return "<tool_call>\n{not json\n</tool_call>"

    tokenizer = make_tool_tokenizer()
    config = _config(tiny_model_dir, problem_file, tmp_path / "run", max_new_tokens=1000)  # bytes: the error is long
    results = evaluate(config, generator=ScriptedModel(tokenizer, malformed_then_gives_up), tokenizer=tokenizer)
    figures = results["toy"]["tools"]
    assert figures["tool_errors"] == 6 and figures["tool_calls_mean"] == 1
    assert results["toy"]["avg@2"] == pytest.approx(1 / 3)  # problem 0's answer is 0
    assert figures["accuracy_by_turns"] == {"2": pytest.approx(1 / 3)}


def test_the_python_tool_runs_the_models_code_in_the_sandbox(tiny_model_dir, problem_file, tmp_path):
    if not probe("namespaces").ok:
        pytest.skip(f"no namespaces sandbox here: {probe('namespaces').reason}")

    tokenizer = make_tool_tokenizer()
    config = _config(tiny_model_dir, problem_file, tmp_path / "run", tools="python", n=1, limit=2)
    results = evaluate(config, generator=ScriptedModel(tokenizer, python_then_answer), tokenizer=tokenizer)
    assert results["toy"]["avg@1"] == 1.0 and results["toy"]["tools"]["tool_errors"] == 0
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["tools"]["name"] == "python" and saved["tools"]["sandbox"] == "namespaces"


def test_eval_with_tools_runs_a_tiny_model_end_to_end(tiny_model_dir, problem_file, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [*eval_args(tiny_model_dir, problem_file, out), "--tools", "calculator"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    figures = saved["benchmarks"]["toy"]["tools"]
    assert saved["tools"] == {"name": "calculator"} and figures["episodes"] == 6
    assert sum(figures["episodes_by_turns"].values()) == 6
    assert "toy tools:" in result.output


def _refuses(args):
    """The one line `opd eval` exits 2 with (main's handler: a user error, no model loaded)."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and result.exception is not None, result.output
    line = user_error_line(result.exception)
    assert line is not None and "\n" not in line, repr(result.exception)
    return line


def test_python_is_refused_where_the_sandbox_does_not_hold_before_the_model_loads(monkeypatch, tmp_path):
    monkeypatch.setattr("opd.eval.tools.probe", lambda mode: ProbeResult(mode, False, "no user namespaces"))
    args = ["eval", "--model", str(tmp_path / "no-such-model"), "--benchmarks", "aime24", "--tools", "python"]
    line = _refuses([*args, "--out", str(tmp_path / "o")])
    assert "tools=python" in line and "no user namespaces" in line and "--sandbox rlimits-only" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_sandbox_refusal_exits_2_with_one_line(tmp_path):
    code = (
        "import opd.eval.tools as t; from opd.tools.sandbox import ProbeResult;"
        "t.probe = lambda mode: ProbeResult(mode, False, 'no user namespaces');"
        "from opd.cli import main; main()"
    )
    args = ["eval", "--model", str(tmp_path / "no-such-model"), "--benchmarks", "aime24", "--tools", "python"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env={**os.environ, "OPD_DEBUG": ""},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "tools=python" in lines[0] and "no user namespaces" in lines[0] and "--sandbox rlimits-only" in lines[0]


def test_bad_tool_settings_are_one_line_errors(tmp_path):
    base = ["eval", "--model", str(tmp_path / "no-such-model"), "--benchmarks", "aime24", "--out", str(tmp_path / "o")]
    line = _refuses([*base, "--tools", "shell"])
    assert line.startswith("tools") and "'shell'" in line
    assert "sandbox" in _refuses([*base, "--tools", "python", "--sandbox", "none"])
    assert "max_turns" in _refuses([*base, "--tools", "calculator", "--max-turns", "0"])
    responses = write_jsonl(tmp_path / "r.jsonl", [{"response": "1", "answer": "1"}])
    line = _refuses(["eval", "--responses", str(responses), "--tools", "calculator", "--out", str(tmp_path / "p")])
    assert "--tools" in line


REFUSING_ENV = """
from opd.tools.environments import Observation, function_schema


class Episode:
    tools = [function_schema("calculator", "refuses everything", {"expression": {"type": "string"}}, ["expression"])]
    done = False

    def answer(self, call):
        return Observation("stopped", error=True, refused=True)

    def close(self):
        pass


class Refusing:
    def start(self, row):
        return Episode()

    def describe(self):
        return {"name": "refusing"}
"""


def test_an_environment_by_import_path_and_its_refusals_are_counted(
    tiny_model_dir, problem_file, tmp_path, monkeypatch
):
    (tmp_path / "refusing_env.py").write_text(REFUSING_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    tokenizer = make_tool_tokenizer()
    config = _config(tiny_model_dir, problem_file, tmp_path / "run", tools="refusing_env:Refusing")
    results = evaluate(config, generator=ScriptedModel(tokenizer, calculator_then_answer), tokenizer=tokenizer)
    figures = results["toy"]["tools"]
    assert figures["sandbox_refusals"] == 6 and figures["tool_errors"] == 6 and results["toy"]["avg@2"] == 0.0
    assert json.loads((tmp_path / "run" / "results.json").read_text())["tools"] == {"name": "refusing"}


def test_a_tool_eval_resumes_its_directory_and_refuses_other_tool_settings(tiny_model_dir, problem_file, tmp_path):
    tokenizer = make_tool_tokenizer()
    out = tmp_path / "run"
    model = ScriptedModel(tokenizer, calculator_then_answer)
    first = evaluate(_config(tiny_model_dir, problem_file, out), generator=model, tokenizer=tokenizer)
    calls = model.calls
    again = evaluate(_config(tiny_model_dir, problem_file, out), generator=model, tokenizer=tokenizer)
    assert again == first and model.calls == calls  # every chunk was complete: nothing sampled again
    with pytest.raises(ValueError, match="max_turns"):
        evaluate(_config(tiny_model_dir, problem_file, out, max_turns=2), generator=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tools"):
        evaluate(_config(tiny_model_dir, problem_file, out, tools=None), generator=model, tokenizer=tokenizer)


def test_max_prompt_length_counts_the_tools_offered(tiny_model_dir, problem_file, tmp_path):
    tokenizer = make_tool_tokenizer()
    model = ScriptedModel(tokenizer, calculator_then_answer)
    config = _config(tiny_model_dir, problem_file, tmp_path / "run", max_prompt_length=300)  # bytes; tools are more
    with pytest.raises(ValueError, match="every prompt is longer than max_prompt_length=300 tokens with the tools"):
        evaluate(config, generator=model, tokenizer=tokenizer)
    assert model.calls == 0


# ---------------------------------------------------------------------------------------- tool_format=markdown
def _writes_python_blocks(*, after: str = "") -> object:
    """A student in the markdown format: a python block that prints the question's product (then `after`), and once
    the context holds the tool's answer R, "\\boxed{R}"."""

    def policy(context: str) -> str:
        results = TOOL_RESPONSE.findall(context)
        if results:
            return f"\\boxed{{{results[-1]}}}"
        expression = QUESTION.findall(context)[-1]
        return f"Let me compute it.\n```python\nprint({expression})\n```{after}"

    return policy


def test_a_model_that_writes_python_blocks_runs_them_with_tool_format_markdown(tiny_model_dir, problem_file, tmp_path):
    if not probe("namespaces").ok:
        pytest.skip(f"no namespaces sandbox here: {probe('namespaces').reason}")
    tokenizer = make_tool_tokenizer()
    markdown = _config(tiny_model_dir, problem_file, tmp_path / "run", tools="python", tool_format="markdown", n=1)
    results = evaluate(markdown, generator=ScriptedModel(tokenizer, _writes_python_blocks()), tokenizer=tokenizer)
    figures = results["toy"]["tools"]
    assert results["toy"]["avg@1"] == 1.0 and figures["accuracy_by_turns"] == {"2": 1.0}
    assert figures["tool_calls_mean"] == 1 and figures["tool_errors"] == 0
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert all("```python\nprint(" in s["episode"] and "<tool_response>" in s["episode"] for s in samples)
    assert json.loads((tmp_path / "run" / "identity.json").read_text())["tool_format"] == "markdown"
    assert json.loads((tmp_path / "run" / "results.json").read_text())["tools"]["tool_format"] == "markdown"
    # hermes reads no call in the same turns: each episode ends after its first turn, ungraded text
    hermes = _config(tiny_model_dir, problem_file, tmp_path / "hermes", tools="python", n=1)
    results = evaluate(hermes, generator=ScriptedModel(tokenizer, _writes_python_blocks()), tokenizer=tokenizer)
    assert results["toy"]["tools"]["tool_calls_mean"] == 0 and results["toy"]["tools"]["episodes_by_turns"] == {"1": 3}


def test_a_python_block_followed_by_text_ends_the_episode_as_the_student_chose(tiny_model_dir, problem_file, tmp_path):
    tokenizer = make_tool_tokenizer()
    config = _config(tiny_model_dir, problem_file, tmp_path / "run", tools="python", tool_format="markdown", n=1)
    made_up = _writes_python_blocks(after="\n```output\n7\n```\nSo \\boxed{7}.")
    results = evaluate(config, generator=ScriptedModel(tokenizer, made_up), tokenizer=tokenizer)
    figures = results["toy"]["tools"]
    assert figures["tool_calls_mean"] == 0 and figures["episodes_by_turns"] == {"1": 3}
    assert results["toy"]["avg@1"] == pytest.approx(1 / 3)  # only 1 * 7 is 7


def test_markdown_without_a_python_tool_is_refused_in_one_line(tmp_path, monkeypatch):
    base = ["eval", "--model", str(tmp_path / "no-such-model"), "--benchmarks", "aime24", "--out", str(tmp_path / "o")]
    line = _refuses([*base, "--tools", "calculator", "--tool-format", "markdown"])
    assert "tool_format=markdown" in line and "tools=calculator" in line
    assert "tool_format" in _refuses([*base, "--tools", "python", "--tool-format", "llama"])
    (tmp_path / "refusing_env.py").write_text(REFUSING_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _refuses([*base, "--tools", "refusing_env:Refusing", "--tool-format", "markdown"])
    assert "tool_format=markdown" in line and "offers calculator" in line
    assert not (tmp_path / "o").exists()
