"""Environments: the calculator's arithmetic and refusals, the python tool in the sandbox (and its refusal to start
without isolation unless the weaker mode is named), user environments by import path, and answering many episodes'
calls at once."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from opd.tools.environments import (
    Calculator,
    Observation,
    ToolCall,
    answer_calls,
    calculate,
    environment_names,
    load_environment,
)
from opd.tools.sandbox import probe


@pytest.fixture(scope="module")
def isolated():
    result = probe("namespaces")
    if not result.ok:
        pytest.skip(f"the namespaces sandbox is unavailable here: {result.reason}")


def test_calculate_does_arithmetic_exactly():
    assert calculate("12345 * 6789") == 83810205
    assert calculate("-(2 + 3) ** 2") == -25 and calculate("(2 + 3) ** 2 // 4 % 5") == 1
    assert calculate("sqrt(16) + abs(-2) + max(1, 5) + round(2.6)") == 14.0
    assert calculate("7 / 2") == 3.5


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("'a' * 3", "not allowed"),
        ("x + 1", "not allowed"),
        ("9 ** 9 ** 9", "too large"),
        ("1 / 0", "division by zero"),
        ("2 +", "not an arithmetic expression"),
        ("sqrt(-1)", "sqrt: math domain error"),
    ],
)
def test_calculate_refuses_anything_but_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        calculate(expression)


def test_the_calculator_answers_calls_and_errors_as_observations():
    episode = Calculator().start({"prompt": "What is 6 * 7?"})
    assert episode.tools[0]["function"]["name"] == "calculator"
    assert episode.answer(ToolCall("calculator", {"expression": "6 * 7"})) == Observation("42")
    assert episode.answer(ToolCall("calculator", {"expression": "open('x')"})).error
    assert "needs the argument 'expression'" in episode.answer(ToolCall("calculator", {"expr": "1"})).content
    assert "no tool named 'python'; the tools are: calculator" in episode.answer(ToolCall("python", {})).content
    assert not episode.done


def test_the_python_tool_runs_code_in_the_sandbox_and_cleans_up(tmp_path, isolated):
    tool = load_environment("python", {"limits": {"wall_seconds": 2.0}, "max_chars": 50, "root": str(tmp_path)})
    assert tool.describe()["sandbox"] == "namespaces" and tool.describe()["limits"]["wall_seconds"] == 2.0
    episode = tool.start({})
    ok = episode.answer(ToolCall("python", {"code": "open('n', 'w').write('5')\nprint(6 * 7)"}))
    assert ok == Observation("42", error=False, seconds=ok.seconds)
    again = episode.answer(ToolCall("python", {"code": "print(int(open('n').read()) + 1)\nraise ValueError('bad')"}))
    assert again.error and again.content.startswith("6\nTraceback") and "[output cut at 50 characters]" in again.content
    assert not again.refused  # the code failed; the sandbox did not stop it
    slow = episode.answer(ToolCall("python", {"code": "import time\ntime.sleep(60)"}))
    assert slow.error and slow.refused and "[killed: wall time of 2 s exceeded]" in slow.content
    episode.close()
    assert list(tmp_path.iterdir()) == []


def test_the_python_tool_refuses_a_sandbox_that_does_not_hold(monkeypatch):
    import opd.tools.environments as environments

    monkeypatch.setattr(environments, "probe", lambda mode: type(probe(mode))(mode, False, "no user namespaces"))
    with pytest.raises(ValueError, match="the namespaces sandbox does not work here: no user namespaces; name sandbox"):
        load_environment("python")


def test_the_weaker_mode_runs_only_when_named_and_is_recorded():
    tool = load_environment("python", {"sandbox": "rlimits-only"})
    assert tool.describe()["sandbox"] == "rlimits-only"
    with pytest.raises(ValueError, match="sandbox must be one of namespaces, rlimits-only, got 'none'"):
        load_environment("python", {"sandbox": "none"})
    with pytest.raises(ValueError, match="unknown sandbox limit 'gpu_seconds'"):
        load_environment("python", {"limits": {"gpu_seconds": 1}})


USER_ENVIRONMENT = '''
from opd.tools.environments import Observation, function_schema


class Countdown:
    """Answers `tick` until the count reaches zero, then ends the episode."""

    def __init__(self, start=2):
        self.start_at = start

    def start(self, row):
        return CountdownEpisode(row.get("count", self.start_at))

    def describe(self):
        return {"name": "countdown", "start": self.start_at}


class CountdownEpisode:
    def __init__(self, count):
        self.count = count
        self.tools = [function_schema("tick", "Count down by one.", {}, [])]

    def answer(self, call):
        self.count -= 1
        return Observation(str(self.count), done=self.count == 0)

    @property
    def done(self):
        return self.count == 0

    def close(self):
        pass
'''


def test_a_user_environment_is_loaded_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(USER_ENVIRONMENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_envs", raising=False)
    environment = load_environment("my_envs:Countdown", {"start": 3})
    episode = environment.start({})
    answers = [episode.answer(ToolCall("tick")) for _ in range(3)]
    assert [a.content for a in answers] == ["2", "1", "0"] and answers[-1].done and episode.done
    assert environment.describe() == {"name": "countdown", "start": 3}


@pytest.mark.parametrize(
    ("name", "options", "error"),
    [
        ("shell", {}, "rollout.tools must be one of python, calculator or an import path"),
        ("no_such_module_xyz:Env", {}, "rollout.tools: cannot import 'no_such_module_xyz'"),
        ("opd.tools.environments:Nope", {}, "module 'opd.tools.environments' has no 'Nope'"),
        ("opd.tools.environments:environment_names", {}, "made a list, which has no start"),
        ("calculator", {"precision": 3}, r"rollout.tools: cannot build calculator with the options \[.precision.\]"),
    ],
)
def test_a_bad_environment_name_is_one_line_naming_the_key(name, options, error):
    with pytest.raises(ValueError, match=error):
        load_environment(name, options)
    assert environment_names() == ["python", "calculator"]


class _Gate:
    """An episode whose answer waits until every episode of the batch has started answering: only concurrent
    answering finishes (serial answering would wait forever, so the test bounds it with timeout_s)."""

    tools: list = []
    done = False

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def answer(self, call: ToolCall) -> Observation:
        self.barrier.wait()
        if call.name == "crash":
            raise RuntimeError("tool bug")
        return Observation(call.name)

    def close(self) -> None:
        pass


def test_calls_of_many_episodes_are_answered_concurrently_and_a_crash_is_an_observation():
    barrier = threading.Barrier(4)
    episodes = [_Gate(barrier) for _ in range(4)]
    pending = [(e, [ToolCall(name)]) for e, name in zip(episodes, ["a", "b", "crash", "d"])]
    answers, stats = answer_calls(pending, max_workers=4, timeout_s=60)
    assert [a[0].content for a in answers[:2]] == ["a", "b"] and answers[3][0].content == "d"
    assert answers[2][0].error and "the tool crash failed: RuntimeError: tool bug" in answers[2][0].content
    assert (stats.calls, stats.errors) == (4, 1)


def test_a_tool_that_hangs_is_answered_with_an_error_at_the_deadline():
    stuck = _Gate(threading.Barrier(2))  # nobody else ever arrives at the barrier
    answers, stats = answer_calls([(stuck, [ToolCall("x")])], timeout_s=0.2)
    assert answers[0][0].error and "no answer within 0.2 s" in answers[0][0].content
    stuck.barrier.abort()  # release the worker thread
    assert Path(".").exists() and stats.errors == 1


def test_python_calls_of_several_episodes_run_side_by_side(tmp_path, isolated):
    tool = load_environment("python", {"root": str(tmp_path)})
    episodes = [tool.start({}) for _ in range(4)]
    pending = [
        (e, [ToolCall("python", {"code": f"import os\nprint({i} * 10, os.getcwd())"})]) for i, e in enumerate(episodes)
    ]
    answers, stats = answer_calls(pending, max_workers=4)
    assert [a[0].content for a in answers] == [f"{i * 10} /episode" for i in range(4)]
    assert (stats.calls, stats.errors) == (4, 0)
    for episode in episodes:
        episode.close()
