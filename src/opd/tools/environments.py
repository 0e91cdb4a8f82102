"""Environments: what answers a model's tool calls during an episode, and the registry that names them.

An `Environment` starts an `Episode` from a prompt row; the episode lists the tools it offers (JSON schemas, as
`tokenizer.apply_chat_template(tools=…)` takes them), answers one `ToolCall` at a time with an `Observation`, and
says when it is done. Built-ins: `python` (runs the code in `opd.tools.sandbox`, answers with stdout and stderr, cut)
and `calculator` (arithmetic on numbers, parsed, never evaluated as code). A user environment is named by import path,
`package.module:factory` (a class or function called with the options), as a `TeacherSpec` names a model by path.
`answer_calls` answers the calls of many episodes at once on a thread pool, so that a slow tool does not hold up the
others. The protocol with a complete example environment: docs/agents.md.

Left out on purpose: environments that talk back unprompted (every observation answers a call), and async tools
(a thread per call in flight is enough for the sandbox's processes and for tools that wait on I/O).
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from opd.tools.sandbox import SANDBOX_MODES, Sandbox, SandboxError, SandboxLimits, probe


@dataclass(frozen=True)
class ToolCall:
    """One call a model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """An environment's answer to one call.

    content: the text the model sees (in a `tool` message)
    error:   the call failed (unknown tool, bad arguments, the code raised or was killed); the model still sees it
    done:    the environment ends the episode after this answer
    seconds: wall time the answer took
    refused: the sandbox refused or stopped the code (too long, a limit ran out, a signal: seccomp's included)
    """

    content: str
    error: bool = False
    done: bool = False
    seconds: float = 0.0
    refused: bool = False


@runtime_checkable
class Episode(Protocol):
    """One conversation's view of an environment. `answer` may run on a worker thread; one episode's calls are
    answered one at a time, in order."""

    tools: list[dict[str, Any]]

    def answer(self, call: ToolCall) -> Observation: ...

    @property
    def done(self) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class Environment(Protocol):
    """Starts episodes. `describe()` is what a run records about it (name, sandbox mode, limits)."""

    def start(self, row: Mapping[str, Any]) -> Episode: ...

    def describe(self) -> dict[str, Any]: ...


def function_schema(name: str, description: str, parameters: dict[str, Any], required: Sequence[str]) -> dict:
    """A tool's JSON schema in the OpenAI / Hugging Face function format that chat templates render."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": parameters, "required": list(required)},
        },
    }


def unknown_tool(call: ToolCall, tools: list[dict[str, Any]]) -> Observation:
    names = ", ".join(t["function"]["name"] for t in tools)
    return Observation(f"error: no tool named {call.name!r}; the tools are: {names}", error=True)


def bad_argument(call: ToolCall, key: str, kind: str) -> Observation:
    return Observation(f"error: {call.name} needs the argument {key!r} ({kind})", error=True)


# ------------------------------------------------------------------------------------------------ calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
_MAX_DIGITS = 4000  # results (and operands of ** and *) beyond this many digits are refused, not computed


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses and abs, round, min, max, sqrt.
    Anything else (names, attributes, calls of other functions, strings) raises ValueError naming it; so do results
    too large to print."""
    if len(expression) > 1000:
        raise ValueError("expression longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * _digits(left) > _MAX_DIGITS:
            raise ValueError(f"result too large (more than {_MAX_DIGITS} digits)")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        if _digits(value) > _MAX_DIGITS:
            raise ValueError(f"result too large (more than {_MAX_DIGITS} digits)")
        return value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        try:
            return _FUNCTIONS[node.func.id](*(_evaluate(a) for a in node.args))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{node.func.id}: {e}") from None
    raise ValueError(f"not allowed in an arithmetic expression: {ast.unparse(node)[:80]!r}")


def _digits(value: Any) -> int:
    if isinstance(value, complex):
        raise ValueError("complex result")
    if isinstance(value, int):
        return max(1, value.bit_length() * 30103 // 100000 + 1)
    return 1


class CalculatorEpisode:
    def __init__(self) -> None:
        self.tools = [
            function_schema(
                "calculator",
                "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, abs, round, min, max, sqrt.",
                {"expression": {"type": "string", "description": "e.g. 12345 * 6789"}},
                ["expression"],
            )
        ]

    def answer(self, call: ToolCall) -> Observation:
        if call.name != "calculator":
            return unknown_tool(call, self.tools)
        expression = call.arguments.get("expression")
        if not isinstance(expression, str):
            return bad_argument(call, "expression", "a string")
        try:
            return Observation(str(calculate(expression)))
        except ValueError as e:
            return Observation(f"error: {e}", error=True)

    @property
    def done(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Calculator:
    """The `calculator` environment: one tool, `calculator(expression)`, answered in this process."""

    def start(self, row: Mapping[str, Any]) -> CalculatorEpisode:
        return CalculatorEpisode()

    def describe(self) -> dict[str, Any]:
        return {"name": "calculator"}


# ---------------------------------------------------------------------------------------------------- python


class PythonEpisode:
    """One episode's directory; each call runs its code there in a fresh sandboxed interpreter (files persist
    between the episode's calls, variables do not)."""

    def __init__(self, sandbox: Sandbox, workdir: Path, max_chars: int) -> None:
        self.sandbox, self.workdir, self.max_chars = sandbox, workdir, max_chars
        self.tools = [
            function_schema(
                "python",
                "Run a Python program and return what it prints (stdout, then stderr). Each call starts a fresh "
                "interpreter; files written in the working directory persist. No network.",
                {"code": {"type": "string", "description": "the program"}},
                ["code"],
            )
        ]

    def answer(self, call: ToolCall) -> Observation:
        if call.name != "python":
            return unknown_tool(call, self.tools)
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return bad_argument(call, "code", "a string")
        result = self.sandbox.run_python(code, self.workdir)
        text = "\n".join(p.rstrip("\n") for p in (result.stdout, result.stderr) if p)
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"\n[output cut at {self.max_chars} characters]"
        note = None  # after the cut, so that the model always reads why the call ended
        if result.killed == "wall_time":
            note = f"[killed: wall time of {self.sandbox.limits.wall_seconds:g} s exceeded]"
        elif result.killed == "output":
            note = f"[killed: more than {self.sandbox.limits.max_output_bytes} bytes of output]"
        elif result.signal is not None:
            note = f"[killed by {result.signal}]"
        if note is not None:
            text = f"{text}\n{note}" if text else note
        refused = result.exit_code is None or result.signal is not None
        return Observation(text, error=not result.ok, seconds=result.seconds, refused=refused)

    @property
    def done(self) -> bool:
        return False

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


class PythonTool:
    """The `python` environment. Refuses to start (ValueError, one line) where `probe(sandbox)` fails: the weaker
    mode runs only when named (`sandbox="rlimits-only"`), and `describe()` records it.

    sandbox:    "namespaces" (default) or "rlimits-only"
    limits:     `SandboxLimits` fields (cpu_seconds, wall_seconds, memory_bytes, …)
    max_chars:  characters of output the model sees, ≥ 1
    root:       where episode directories are made; default: the system's temporary directory
    read_only_paths: host directories the code may read (e.g. a site-packages)
    """

    def __init__(
        self,
        sandbox: str = "namespaces",
        limits: Mapping[str, Any] | None = None,
        max_chars: int = 4000,
        root: str | None = None,
        read_only_paths: Sequence[str] = (),
    ) -> None:
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"python tool: sandbox must be one of {', '.join(SANDBOX_MODES)}, got {sandbox!r}")
        if max_chars < 1:
            raise ValueError(f"python tool: max_chars must be ≥ 1, got {max_chars!r}")
        unknown = sorted(set(limits or {}) - set(SandboxLimits.__dataclass_fields__))
        if unknown:
            raise ValueError(f"python tool: unknown sandbox limit {unknown[0]!r}")
        checked = probe(sandbox)
        if not checked.ok:
            hint = "; name sandbox: rlimits-only to run without isolation" if sandbox == "namespaces" else ""
            raise ValueError(f"python tool: the {sandbox} sandbox does not work here: {checked.reason}{hint}")
        self.sandbox = Sandbox(
            mode=sandbox,  # type: ignore[arg-type]  # checked above
            limits=SandboxLimits(**(limits or {})),
            read_only_paths=tuple(read_only_paths),
        )
        self.max_chars, self.root = max_chars, root

    def start(self, row: Mapping[str, Any]) -> PythonEpisode:
        workdir = Path(tempfile.mkdtemp(prefix="opd-episode-", dir=self.root))
        return PythonEpisode(self.sandbox, workdir, self.max_chars)

    def describe(self) -> dict[str, Any]:
        limits = {k: getattr(self.sandbox.limits, k) for k in SandboxLimits.__dataclass_fields__}
        return {"name": "python", "sandbox": self.sandbox.mode, "limits": limits}


# -------------------------------------------------------------------------------------------------- registry

_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"python": PythonTool, "calculator": Calculator}


def environment_names() -> list[str]:
    """The built-in environments' names."""
    return list(_ENVIRONMENTS)


def load_environment(name: str, options: Mapping[str, Any] | None = None, *, key: str = "rollout.tools") -> Environment:
    """The environment `name` (a built-in, or `package.module:factory`) built with `options`. A bad name, an import
    that fails or a factory that does not make an `Environment` raises ValueError naming `key` and the value."""
    options = dict(options or {})
    if name in _ENVIRONMENTS:
        factory = _ENVIRONMENTS[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            raise ValueError(f"{key}: cannot import {module_name!r} for {name!r}: {e}") from None
        except AttributeError:
            raise ValueError(f"{key}: module {module_name!r} has no {attr!r} (from {name!r})") from None
    else:
        names = ", ".join(_ENVIRONMENTS)
        raise ValueError(f"{key} must be one of {names} or an import path 'package.module:factory', got {name!r}")
    try:
        environment = factory(**options)
    except TypeError as e:
        raise ValueError(f"{key}: cannot build {name} with the options {sorted(options)}: {e}") from None
    if not isinstance(environment, Environment):
        raise ValueError(f"{key}: {name} made a {type(environment).__name__}, which has no start() and describe()")
    return environment


# ------------------------------------------------------------------------------------------- answering calls


@dataclass(frozen=True)
class CallStats:
    """What a batch of answers cost: calls, errors among them, the calls' summed seconds and the batch's wall time."""

    calls: int
    errors: int
    tool_seconds: float
    wall_seconds: float


def answer_one(episode: Episode, call: ToolCall) -> Observation:
    """`episode.answer(call)`, timed. A tool that raises is the model's error observation, never the run's crash; a
    sandbox that cannot start (`SandboxError`) is the run's: it is raised."""
    t0 = time.monotonic()
    try:
        obs = episode.answer(call)
    except SandboxError:
        raise
    except Exception as e:
        obs = Observation(f"error: the tool {call.name} failed: {type(e).__name__}: {_line(str(e))}", error=True)
    if not isinstance(obs, Observation):
        obs = Observation(f"error: the tool {call.name} answered a {type(obs).__name__}, not an Observation", True)
    content = clean_text(obs.content)
    if content is not obs.content:
        obs = replace(obs, content=content)
    if not obs.seconds:
        obs = replace(obs, seconds=time.monotonic() - t0)
    return obs


MAX_OBSERVATION_CHARS = 16384
"""The most characters of one observation the model sees, whatever the environment answered (the python tool cuts
its own output at its `max_chars` first)."""


def clean_text(content: Any) -> str:
    """An observation's content as text the tokenizer takes: bytes decoded (invalid UTF-8 replaced), other objects
    as `str`, lone surrogates replaced, NUL bytes dropped, cut at `MAX_OBSERVATION_CHARS` with a note. Returns the
    same object when it is already clean."""
    text = content.decode("utf-8", "replace") if isinstance(content, (bytes, bytearray)) else content
    if not isinstance(text, str):
        text = str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    if "\x00" in text:
        text = text.replace("\x00", "")
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + f"\n[output cut at {MAX_OBSERVATION_CHARS} characters]"
    return text


def _line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def answer_calls(
    pending: Sequence[tuple[Episode, Sequence[ToolCall]]],
    *,
    max_workers: int | None = None,
    timeout_s: float | None = None,
) -> tuple[list[list[Observation]], CallStats]:
    """Answer every episode's calls, episodes in parallel on a thread pool (one episode's calls in order). A call that
    raises becomes an error observation; one not answered within `timeout_s` too (its thread is left to finish: the
    sandbox's own wall time bounds the built-in tools). Returns the observations in the order given, and the stats."""
    start = time.monotonic()

    def run(episode: Episode, calls: Sequence[ToolCall]) -> list[Observation]:
        return [answer_one(episode, call) for call in calls]

    results: list[list[Observation]] = []
    workers = max_workers or min(32, max(1, len(pending)), (os.cpu_count() or 1) * 4)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="opd-tool")
    try:
        futures = [pool.submit(run, episode, calls) for episode, calls in pending]
        for future, (_, calls) in zip(futures, pending):
            left = None if timeout_s is None else max(0.0, start + timeout_s - time.monotonic())
            try:
                results.append(future.result(timeout=left))
            except FutureTimeout:
                results.append([Observation(f"error: no answer within {timeout_s:g} s", error=True) for _ in calls])
    finally:
        pool.shutdown(wait=timeout_s is None, cancel_futures=True)
    flat = [o for answers in results for o in answers]
    stats = CallStats(len(flat), sum(o.error for o in flat), sum(o.seconds for o in flat), time.monotonic() - start)
    return results, stats
