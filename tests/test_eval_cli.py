"""`opd eval` end to end: grading existing responses, sampling from a tiny model, files, table, resume."""

import json

import pytest
from typer.testing import CliRunner

from opd.cli import app
from opd.io import read_jsonl


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_responses_known_counts(tmp_path):
    rows = [
        # problem a: 3 of 4 correct
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "so \\boxed{12}"},
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "Answer: 12"},
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "\\boxed{12.0}"},
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "\\boxed{13}"},
        # problem b: 1 of 4 correct (fraction vs decimal); its majority answer (2) is wrong
        {"problem_id": "b", "benchmark": "toy", "answer": "0.5", "responses": ["\\boxed{\\frac12}", "\\boxed{2}", "\\boxed{2}", "no answer"]},
    ]
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", "--responses", str(_write_jsonl(tmp_path / "r.jsonl", rows)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "results.json").read_text())["benchmarks"]["toy"]
    assert summary["num_problems"] == 2 and summary["num_samples"] == 8
    assert summary["avg@4"] == pytest.approx(0.5)
    assert summary["pass@1"] == pytest.approx(0.5)
    assert summary["pass@4"] == pytest.approx(1.0)
    assert summary["maj@4"] == pytest.approx(0.5)
    samples = read_jsonl(out / "samples.jsonl")
    assert sum(s["correct"] for s in samples) == 4 and len(samples) == 8
    assert "toy" in result.output and "avg@4" in result.output


def test_eval_responses_bad_file_is_one_line_error(tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    result = CliRunner().invoke(app, ["eval", "--responses", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "no response field" in str(result.exception)


@pytest.fixture()
def problem_file(tmp_path):
    rows = [{"problem": f"What is {i} + {i}? Put the answer in \\boxed{{}}.", "answer": str(2 * i)} for i in range(5)]
    return _write_jsonl(tmp_path / "toy.jsonl", rows)


def _eval_args(model_dir, problem_file, out):
    return ["eval", "--model", str(model_dir), "--benchmarks", str(problem_file), "--prompt-key", "problem",
            "--answer-key", "answer", "--n", "2", "--max-new-tokens", "6", "--batch-size", "4", "--out", str(out),
            "--temperature", "1.0", "--top-p", "1.0"]


def test_eval_model_files_table_and_resume(tiny_model_dir, problem_file, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, _eval_args(tiny_model_dir, problem_file, out))
    assert result.exit_code == 0, result.output
    assert (out / "config.yaml").exists() and (out / "results.json").exists()
    summary = json.loads((out / "results.json").read_text())["benchmarks"]["toy"]
    assert summary["num_problems"] == 5 and summary["num_samples"] == 10
    assert 0.0 <= summary["avg@2"] <= 1.0 and "pass@2" in summary and "maj@2" in summary
    assert "toy" in result.output
    first = read_jsonl(out / "samples.jsonl")
    assert len(first) == 10 and all(r["num_tokens"] <= 6 for r in first)

    # interrupted run: the last chunk never made it to disk (and a partial line was left behind)
    last_chunk = max(r["chunk"] for r in first)
    kept = [r for r in first if r["chunk"] != last_chunk]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"benchmark": "to')
    result = CliRunner().invoke(app, _eval_args(tiny_model_dir, problem_file, out))
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output
    resumed = read_jsonl(out / "samples.jsonl")
    key = lambda r: (r["problem_id"], r["sample"])
    assert sorted(map(key, resumed)) == sorted(map(key, first))
    # the redone chunk reproduces exactly what the uninterrupted run sampled
    assert {key(r): r["response"] for r in resumed} == {key(r): r["response"] for r in first}

    # a complete run directory: nothing left to do
    result = CliRunner().invoke(app, _eval_args(tiny_model_dir, problem_file, out))
    assert len(read_jsonl(out / "samples.jsonl")) == 10


def test_eval_builtin_benchmark_by_name(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["eval", "--model", str(tiny_model_dir), "--benchmarks", "aime24,math500", "--limit", "2", "--n", "1",
            "--max-new-tokens", "3", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())["benchmarks"]
    assert set(results) == {"aime24", "math500"} and results["aime24"]["num_problems"] == 2
