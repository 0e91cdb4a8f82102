"""`opd.cli`: every command has help, a user error is one line, and the spellings of thinking on/off."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from opd.cli import app


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["eval"],
        ["distill"],
        ["sft"],
        ["merge"],
        ["report"],
        ["prompts"],
        ["prompts", "template"],
        ["prompts", "score"],
        ["prompts", "select"],
        ["rollout"],
        ["dedup"],
        ["pipeline", "run"],
        ["demo"],
        ["lab"],
        ["lab", "build"],
        ["lab", "run"],
    ],
)
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_cli_error_is_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "eval",
            "--responses",
            str(tmp_path / "missing.jsonl"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "missing.jsonl" in lines[0], result.stderr


@pytest.mark.parametrize("command", [["eval"], ["rollout"], ["distill"], ["sft"], ["prompts", "score"]])
def test_one_spelling_for_thinking(command):
    """Every command that renders chat prompts takes the same switch, --thinking / --no-thinking."""
    result = CliRunner().invoke(app, [*command, "--help"])
    assert "--thinking / --no-thinking" in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(
    "argv, enabled, note",
    [
        (["--thinking"], True, False),
        (["--no-thinking"], False, False),
        (["--thinking", "on"], True, True),
        (["--thinking=off"], False, True),
        ([], None, False),
    ],
)
def test_rollout_thinking_old_spelling_still_works(argv, enabled, note, monkeypatch, capfd):
    """`opd rollout --thinking on|off` (its spelling before the switch became a flag) works for one more release,
    with a deprecation note on stderr."""
    import opd.recipes.rollout as rejection
    from opd.cli import main

    seen = {}
    monkeypatch.setattr(rejection, "teacher_rollout", lambda config: seen.setdefault("config", config))
    monkeypatch.setattr(sys, "argv", ["opd", "rollout", "--model", "m", "--prompts", "p.jsonl", "--out", "o", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    assert seen["config"].data.enable_thinking is enabled
    assert ("deprecated" in capfd.readouterr().err) is note
