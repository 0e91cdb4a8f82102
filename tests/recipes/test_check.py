"""`opd check` through its command line, and `opd distill`'s startup refusal (each group's checks: tests/check/).
Pairs are real tokenizers and models: the lab's (shipped, tiny) and variants of their files (a swapped vocabulary,
another chat template, another EOS)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opd import check as C
from opd import lab
from opd.lab.tokenizer import CHAT_TEMPLATE

LAB = [
    "rollout.max_new_tokens=64",
    "data.max_prompt_length=64",
    "student.device=cpu",
    "teacher.device=cpu",
    "student.dtype=fp32",
    "teacher.dtype=fp32",
    "micro_batch_tokens=8192",
    "prompts_per_step=4",
    "rollout.n=2",
]


def _check_cli(tmp_path, teacher, *extra):
    from opd.cli import app

    out = tmp_path / "check"
    args = [
        "check",
        "--student",
        str(lab.student_path()),
        "--teacher",
        str(teacher),
        "--prompts",
        str(lab.opd_prompts_path()),
        "--n",
        "2",
        "--prompts-sample",
        "8",
        "--out",
        str(out),
        *extra,
        *LAB,
    ]
    result = CliRunner().invoke(app, args)
    return result, (json.loads((out / "check.json").read_text()) if (out / "check.json").is_file() else None)


def test_cli_lab_pair_passes(tmp_path):
    result, report = _check_cli(tmp_path, lab.teacher_path())
    assert result.exit_code == C.EXIT_OK, result.output
    assert report["exit_code"] == 0 and report["forecast"]["verdict"] in ("likely", "uncertain")
    names = {r["name"]: r for r in report["results"]}
    # a local teacher's scores are checked by the rest; the student's engine against its scorer at distill's startup
    # teacher_view: a run with a view's (distill's startup); cross_tokenizer: a teacher of another vocabulary's;
    # hidden_scores: a teacher answering with hidden states; sandbox: a config with the python tool's
    assert set(names) == set(C.CHECKS) - {
        "served_scores",
        "generation_scoring",
        "teacher_view",
        "cross_tokenizer",
        "hidden_scores",
        "sandbox",
    }
    for name in (
        "tokenizer_vocab",
        "special_tokens",
        "chat_template",
        "determinism",
        "self_distillation_zero",
        "memory",
    ):
        assert names[name]["status"] == "pass", names[name]
    assert report["forecast"]["values"]["teacher_accuracy"] > report["forecast"]["values"]["student_accuracy"]
    assert names["step_time"]["value"] > 0 and "opd check" in result.output
    # 2 × 8 = 16 rollouts: too few for a verdict, and the output says so with the command that gets one
    assert report["forecast"]["recovery"] == "more_rollouts"
    assert "forecast: no verdict: evidence too thin: 16 student rollouts" in result.output
    assert "--n 2 --prompts-sample 16" in result.output
    # check.json is never replaced: a second run into the same --out refuses (a one-line error, exit 2 via main)
    again, _ = _check_cli(tmp_path, lab.teacher_path())
    assert isinstance(again.exception, FileExistsError)


def test_cli_student_as_teacher_is_unlikely(tmp_path):
    result, report = _check_cli(tmp_path, lab.student_path(), "--skip-check", "resources")
    assert result.exit_code == C.EXIT_UNLIKELY, result.output
    assert report["forecast"]["recovery"] == "other_teacher"
    statuses = {r["name"]: r["status"] for r in report["results"]}
    assert statuses["memory"] == statuses["step_time"] == "skip"


def test_cli_other_vocabulary_fails(tmp_path, tiny_model_dir):
    # tokenizer: same keeps the refusal (auto takes the cross path: tests/features/test_cross_tokenizer.py)
    result, report = _check_cli(tmp_path, tiny_model_dir, "teacher.tokenizer=same")
    assert result.exit_code == C.EXIT_FAILED, result.output
    statuses = {r["name"]: r["status"] for r in report["results"]}
    assert statuses["tokenizer_vocab"] == "fail" and statuses["determinism"] == "skip"


@pytest.mark.slow
def test_cli_bad_input_is_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "check",
            "--student",
            str(lab.student_path()),
            "--teacher",
            str(lab.teacher_path()),
            "--prompts",
            str(lab.opd_prompts_path()),
            "--skip-check",
            "nope",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown check 'nope'" in lines[0], result.stderr


def _other_template_teacher(tmp_path) -> Path:
    path = tmp_path / "teacher_other_template"
    shutil.copytree(lab.teacher_path(), path)
    (path / "chat_template.jinja").write_text("{{- '<|im_start|>system\\n<|im_end|>\\n' -}}" + CHAT_TEMPLATE)
    return path


def test_distill_refuses_on_a_hard_failure_unless_skipped(tmp_path):
    from opd.recipes.demo import demo_config
    from opd.recipes.distill import distill

    teacher = _other_template_teacher(tmp_path)
    small = [
        f"teacher.path={teacher}",
        f"run.out_dir={tmp_path}",
        "run.steps=1",
        "eval.limit=2",
        "prompts_per_step=2",
        "rollout.n=2",
        "run.report=false",
    ]
    with pytest.raises(ValueError, match="chat_template failed.*--skip-check chat_template"):
        distill(demo_config([*small, "run.name=refused"]))
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before any step
    run = distill(demo_config([*small, "run.name=skipped", "skip_checks=chat_template"]))
    assert (run / "metrics.jsonl").is_file()


def test_preflight_is_cheap_and_leaves_training_unchanged(tmp_path):
    """The startup checks draw no global random numbers and change no weights: a run with them equals one without."""
    from opd.recipes.demo import demo_config
    from opd.recipes.distill import distill

    small = [
        f"run.out_dir={tmp_path}",
        "run.steps=2",
        "eval.limit=2",
        "prompts_per_step=2",
        "rollout.n=2",
        "run.report=false",
        "run.samples_per_step=0",
    ]
    rows = []
    for name, skip in (("checked", "[]"), ("unchecked", "all")):
        run = distill(demo_config([*small, f"run.name={name}", f"skip_checks={skip}"]))
        rows.append(
            [
                {k: v for k, v in json.loads(line).items() if not k.startswith("time") and k != "tokens_per_second"}
                for line in (run / "metrics.jsonl").read_text().splitlines()
            ]
        )
    assert rows[0] == rows[1]
