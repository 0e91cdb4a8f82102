"""`opd distill` with a teacher of another vocabulary, through the CLI: auto picks the cross path and says so, the
step logs its xtok/ shares, `tokenizer: same` keeps the old refusal, and a teacher that cannot encode the student's
text stops at startup in one line."""

import json

import pytest

from helpers import cli, make_tiny_model, make_tiny_tokenizer, one_line
from helpers_cross_vocab import byte_bpe, characters, teacher_model


@pytest.fixture(scope="module")
def cross_world(tmp_path_factory):
    """A tiny student (byte-level, no merges), a byte-level BPE teacher and a characters-only teacher (no byte
    fallback), and a prompt set whose answers hold a character the latter cannot encode."""
    root = tmp_path_factory.mktemp("cross")
    make_tiny_model("qwen3", seed=0).save_pretrained(root / "student")
    make_tiny_tokenizer().save_pretrained(root / "student")
    for name, tokenizer in (("bpe", byte_bpe()), ("chars", characters(byte_fallback=False))):
        teacher_model(tokenizer).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rows = [{"prompt": f"{i}+{i}=", "answer": f"{2 * i} 数"} for i in range(6)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _args(root, tmp_path, teacher, *extra):
    return [
        "distill",
        f"student.path={root / 'student'}",
        f"teacher.path={root / teacher}",
        f"data.path={root / 'prompts.jsonl'}",
        "data.answer_key=answer",
        "data.max_prompt_length=32",
        "prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "micro_batch_tokens=64",
        f"run.out_dir={tmp_path}",
        "run.name=run",
        "run.steps=1",
        "run.report=false",
        *extra,
    ]


def test_auto_runs_a_teacher_of_another_vocabulary_through_the_cross_path(cross_world, tmp_path, capsys):
    code, out, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "objective.top_k=4"))
    assert code == 0, err
    assert "tokenizer auto → cross" in out and "cross_tokenizer pass" in out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    shares = [metrics[f"xtok/{k}_frac"] for k in ("exact", "span", "unmapped")]
    assert sum(shares) == pytest.approx(1.0)


def test_tokenizer_same_refuses_another_vocabulary_in_one_line(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "teacher.tokenizer=same"))
    assert "tokenizers differ" in one_line(code, err) or "missing from the teacher" in err


def test_a_cross_teacher_refuses_a_strategy_with_teacher_slots_in_one_line(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "objective.strategy=union"))
    assert "strategy: only_stu" in one_line(code, err)


def test_a_teacher_that_cannot_encode_the_text_stops_at_startup(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "chars"))
    line = one_line(code, err)
    assert "cross_tokenizer failed" in line and "数" in line


def test_opd_check_gives_a_teacher_of_another_vocabulary_its_cross_tokenizer_row(cross_world, tmp_path, capsys):
    args = [a for a in _args(cross_world, tmp_path, "bpe") if not a.startswith(("run.", "prompts_per", "rollout."))]
    code, out, err = cli(capsys, "check", *args[1:], f"run.out_dir={tmp_path}")
    assert code == 0, err
    report = json.loads(next(tmp_path.rglob("check.json")).read_text())
    row = next(r for r in report["results"] if r["name"] == "cross_tokenizer")
    assert row["status"] == "pass" and "exact-string map" in row["detail"]
    assert "on the forecast's rollouts" in row["detail"]  # coverage on the student's sampled rollouts
    shares = report["cross_tokenizer"]["rollouts"]
    assert sum(shares[f"xtok/{k}_frac"] for k in ("exact", "span", "unmapped")) == pytest.approx(1.0)
    rows = {r["name"]: r for r in report["results"]}
    assert rows["forecast"]["status"] != "skip" and rows["seq_reward_auroc"]["status"] in ("pass", "warn", "skip")
    assert report["forecast"]["values"]["rollouts"] > 0 and report["forecast"]["values"]["seq_reward_mean"] is not None
    assert rows["self_distillation_zero"]["status"] == "skip" and rows["step_time"]["status"] == "skip"


def test_opd_check_runs_no_forecast_when_the_teacher_cannot_encode_the_text(cross_world, tmp_path, capsys):
    args = [a for a in _args(cross_world, tmp_path, "chars") if not a.startswith(("run.", "prompts_per", "rollout."))]
    code, _, _ = cli(capsys, "check", *args[1:], f"run.out_dir={tmp_path}")
    report = json.loads(next(tmp_path.rglob("check.json")).read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert rows["cross_tokenizer"]["status"] == "fail" and code == report["exit_code"] != 0
    assert rows["forecast"]["status"] == "skip" and "cross_tokenizer row failed" in rows["forecast"]["detail"]


def test_the_cross_forecast_of_one_tokenizer_twice_is_the_same_vocabulary_forecast(cross_world, tmp_path):
    """The forecast of a cross teacher is computed on the aligned signal (the training step's cross scoring): with
    the student's own tokenizer as the teacher's (`tokenizer: cross` forces the path) every span is one-to-one and
    every position exact, so it equals the same-vocabulary forecast."""
    import io

    from rich.console import Console

    from opd import lab
    from opd.config import DistillConfig
    from opd.recipes.check import run_check

    def values(tokenizer, name):
        config = DistillConfig.model_validate(
            {
                "student": {"path": str(lab.student_path()), "device": "cpu", "dtype": "fp32"},
                "teacher": {"path": str(lab.teacher_path()), "device": "cpu", "dtype": "fp32", "tokenizer": tokenizer},
                "data": {"path": str(lab.opd_prompts_path()), "max_prompt_length": 64},
                "rollout": {"max_new_tokens": 24},
                "run": {"out_dir": str(tmp_path)},
            }
        )
        report = run_check(
            config,
            n=2,
            prompts_sample=4,
            out=tmp_path / name,
            skip=["scoring", "resources"],
            console=Console(file=io.StringIO(), width=200),
        )
        return report.values["forecast"]["values"], {r.name: r for r in report.results}

    same, same_rows = values("same", "same")
    cross, cross_rows = values("cross", "cross")
    assert "cross_tokenizer" in cross_rows and "cross_tokenizer" not in same_rows
    for key, value in same.items():
        if key == "seconds":
            continue
        if isinstance(value, float):
            assert cross[key] == pytest.approx(value, abs=1e-6), key
        else:
            assert cross[key] == value, key


def test_a_teachers_list_mixes_a_cross_and_a_same_vocabulary_teacher(cross_world, tmp_path, capsys):
    config = {
        "student": {"path": str(cross_world / "student")},
        "teachers": [
            {
                "name": "cross",
                "path": str(cross_world / "bpe"),
                "route": {"route_key": "id", "values": ["0", "1", "2"]},
            },
            {"name": "same", "path": str(cross_world / "student"), "route": {"default": True}},
        ],
        "data": {"path": str(cross_world / "prompts.jsonl"), "answer_key": "answer", "max_prompt_length": 32},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "objective": {"top_k": 4},
        "prompts_per_step": 4,
        "micro_batch_tokens": 64,
        "run": {"out_dir": str(tmp_path), "name": "run", "steps": 1, "report": False},
    }
    path = tmp_path / "two.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    code, out, err = cli(capsys, "distill", "-c", str(path))
    assert code == 0, err
    assert "teacher cross: tokenizer auto → cross" in out and "teacher same" in out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < metrics["teacher/cross/token_frac"] < 1 and "xtok/exact_frac" in metrics  # 3 of 6 prompts each
