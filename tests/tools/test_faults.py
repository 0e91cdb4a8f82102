"""Faults of tools and of the sandbox, through the real sandbox in the namespaces mode: a tool that hangs, crashes or
answers garbage is an error observation the model reads (cut, valid text), never the run's crash; a sandbox that
cannot start the code is the run's error (`SandboxError`, one line), and `opd rollout` stops on it with no part of the
batch in flight written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from helpers import write_jsonl
from helpers_tools import ScriptedModel, make_tool_tokenizer, python_then_answer
from opd.cli_errors import user_error_line
from opd.config import build_config
from opd.io import read_jsonl
from opd.recipes.rollout import RolloutConfig, teacher_rollout
from opd.tools.calls import observation_ids
from opd.tools.environments import (
    MAX_OBSERVATION_CHARS,
    Observation,
    PythonTool,
    ToolCall,
    answer_calls,
    answer_one,
)
from opd.tools.sandbox import Sandbox, SandboxError, SandboxLimits, probe


@pytest.fixture(scope="module", autouse=True)
def isolated():
    result = probe("namespaces")
    if not result.ok:
        pytest.skip(f"the namespaces sandbox is unavailable here: {result.reason}")


def _python(code: str, **limits) -> Observation:
    tool = PythonTool(limits={"wall_seconds": 20.0, "cpu_seconds": 5, **limits}, max_chars=2000)
    episode = tool.start({})
    try:
        [[observation]], _ = answer_calls([(episode, [ToolCall("python", {"code": code})])])
        return observation
    finally:
        episode.close()


def test_code_that_hangs_is_killed_at_its_wall_time_and_answered_with_an_error():
    observation = _python("import time\nprint('started', flush=True)\ntime.sleep(3600)", wall_seconds=2.0)
    assert observation.error and observation.refused
    assert observation.content.startswith("started") and "[killed: wall time of 2 s exceeded]" in observation.content


@pytest.mark.parametrize(
    ("code", "signal"),
    [
        ("import os\nos.abort()", "SIGABRT"),
        ("import ctypes\nctypes.string_at(0)", "SIGSEGV"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ],
)
def test_code_that_crashes_is_an_error_observation_naming_the_signal(code, signal):
    observation = _python(code)
    assert observation.error and observation.refused
    assert f"[killed by {signal}]" in observation.content


def test_code_that_raises_is_an_error_observation_with_its_traceback():
    observation = _python("raise RuntimeError('boom')")
    assert observation.error and not observation.refused
    assert "RuntimeError: boom" in observation.content


def test_garbage_output_is_valid_text_and_huge_output_is_cut():
    tokenizer = make_tool_tokenizer()
    garbage = _python("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\x80 \\x00 end')")
    assert not garbage.error and garbage.content.startswith("ok ") and garbage.content.endswith(" end")
    assert "\ufffd" in garbage.content and "\x00" not in garbage.content
    observation_ids(tokenizer, [{"role": "tool", "name": "python", "content": garbage.content}], [])  # tokenizes
    huge = _python("print('x' * 10_000_000)", max_output_bytes=1 << 16)
    assert huge.error and "[killed: more than 65536 bytes of output]" in huge.content
    assert len(huge.content) < 2100 and "[output cut at 2000 characters]" in huge.content


class _GarbageEpisode:
    """A user tool that answers what a broken tool might: bytes that are not UTF-8, lone surrogates, a huge string,
    something that is not an Observation, or an exception."""

    tools: list = []
    done = False

    def answer(self, call):
        kind = call.arguments["kind"]
        if kind == "bytes":
            return Observation(b"caf\xc3\xa9 \xff\xfe")  # type: ignore[arg-type]
        if kind == "surrogate":
            return Observation("half \udc80 a pair")
        if kind == "huge":
            return Observation("y" * (MAX_OBSERVATION_CHARS * 4))
        if kind == "none":
            return None
        raise OSError("the tool's device is gone")

    def close(self):
        pass


@pytest.mark.parametrize("kind", ["bytes", "surrogate", "huge", "none", "raises"])
def test_a_user_tool_that_answers_garbage_is_cleaned_into_text(kind):
    observation = answer_one(_GarbageEpisode(), ToolCall("broken", {"kind": kind}))
    observation.content.encode("utf-8")  # valid text the tokenizer takes
    assert len(observation.content) <= MAX_OBSERVATION_CHARS + 100
    if kind == "bytes":
        assert observation.content == "café \ufffd\ufffd"
    if kind == "huge":
        assert observation.content.endswith(f"[output cut at {MAX_OBSERVATION_CHARS} characters]")
    if kind in ("none", "raises"):
        assert observation.error and "broken" in observation.content


def _outside_interpreter(tmp_path: Path) -> str:
    """A link to this interpreter from a directory the sandbox does not mount: the host starts it, the sandbox's
    `setpriv` cannot (a sandbox that breaks: the same as an interpreter upgraded away mid-run)."""
    link = tmp_path / "bin" / "python"
    link.parent.mkdir()
    link.symlink_to(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    return str(link)


def test_a_sandbox_that_cannot_start_the_code_raises_one_line_never_an_observation(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    sandbox = Sandbox(limits=SandboxLimits(wall_seconds=20.0), python=_outside_interpreter(tmp_path))
    with pytest.raises(SandboxError, match="the namespaces sandbox could not start the code: .*setpriv") as error:
        sandbox.run_python("print('never')", work)
    assert user_error_line(error.value) is not None and "\n" not in user_error_line(error.value)

    class Episode:
        tools: list = []
        done = False

        def answer(self, call):
            return Observation(sandbox.run_python("print(1)", work).stdout)

        def close(self):
            pass

    with pytest.raises(SandboxError):
        answer_calls([(Episode(), [ToolCall("python", {"code": "print(1)"})])])


BREAKING_ENV = """
import os
from opd.tools.environments import PythonTool


class Breaking(PythonTool):
    '''The python tool whose sandbox stops starting after its first call.'''

    def __init__(self):
        super().__init__(limits={"wall_seconds": 20.0})
        self.calls = 0

    def start(self, row):
        episode = super().start(row)
        tool = self
        answer = episode.answer

        def counted(call):
            tool.calls += 1
            if tool.calls == 2:
                tool.sandbox.python = os.environ["OPD_TEST_BROKEN_PYTHON"]
            return answer(call)

        episode.answer = counted
        return episode
"""


def test_rollout_stops_cleanly_when_the_sandbox_stops_starting_mid_run(tmp_path, monkeypatch):
    (tmp_path / "breaking_env.py").write_text(BREAKING_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OPD_TEST_BROKEN_PYTHON", _outside_interpreter(tmp_path))
    rows = [{"prompt": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(3)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    options = {
        "model.path": "scripted",
        "data.path": str(prompts),
        "data.answer_key": "answer",
        "data.template": "keep",
        "out": str(tmp_path / "out"),
        "max_new_tokens": 400,
        "batch_size": 1,
        "tools": "breaking_env:Breaking",
    }
    config = build_config(RolloutConfig, options=options)

    tokenizer = make_tool_tokenizer()
    with pytest.raises(SandboxError) as error:
        teacher_rollout(
            config, generator=ScriptedModel(tokenizer, python_then_answer), tokenizer=tokenizer, console=Console()
        )
    line = user_error_line(error.value)
    assert line is not None and "\n" not in line and "could not start the code" in line
    # the first batch (one prompt, its call answered) is logged; the batch in flight wrote nothing
    logged = read_jsonl(tmp_path / "out" / "shards" / "rank_0.jsonl")
    assert [(r["prompt_id"], r["accepted"]) for r in logged] == [("0", True)]
    assert logged[0]["messages"][2] == {"role": "tool", "name": "python", "content": "0"}
    assert not (tmp_path / "out" / "rollouts.jsonl").exists()
