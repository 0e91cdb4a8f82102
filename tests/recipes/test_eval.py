"""`opd eval` end to end: grading existing responses, sampling from a tiny model, files, table, resume."""

import json

import pytest
from typer.testing import CliRunner

from helpers import eval_args, write_jsonl
from opd.cli import app
from opd.io import read_jsonl


def test_eval_responses_known_counts(tmp_path):
    rows = [
        # problem a: 3 of 4 correct
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "so \\boxed{12}"},
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "Answer: 12"},
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "\\boxed{12.0}"},
        {"problem_id": "a", "benchmark": "toy", "answer": "\\boxed{12}", "response": "\\boxed{13}"},
        # problem b: 1 of 4 correct (fraction vs decimal); its majority answer (2) is wrong
        {
            "problem_id": "b",
            "benchmark": "toy",
            "answer": "0.5",
            "responses": ["\\boxed{\\frac12}", "\\boxed{2}", "\\boxed{2}", "no answer"],
        },
    ]
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["eval", "--responses", str(write_jsonl(tmp_path / "r.jsonl", rows)), "--out", str(out)]
    )
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
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    result = CliRunner().invoke(app, ["eval", "--responses", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "no response field" in str(result.exception)


@pytest.fixture()
def problem_file(tmp_path):
    rows = [{"problem": f"What is {i} + {i}? Put the answer in \\boxed{{}}.", "answer": str(2 * i)} for i in range(5)]
    return write_jsonl(tmp_path / "toy.jsonl", rows)


def test_eval_model_files_table_and_resume(tiny_model_dir, problem_file, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out))
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
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out))
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output
    resumed = read_jsonl(out / "samples.jsonl")

    def key(r):
        return r["problem_id"], r["sample"]

    assert sorted(map(key, resumed)) == sorted(map(key, first))
    # the redone chunk reproduces exactly what the uninterrupted run sampled
    assert {key(r): r["response"] for r in resumed} == {key(r): r["response"] for r in first}

    # a complete run directory: nothing left to do
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out))
    assert len(read_jsonl(out / "samples.jsonl")) == 10


def test_eval_benchmark_files_of_one_stem_are_reported_apart(tiny_model_dir, tmp_path):
    """`math/test.jsonl` and `easy/test.jsonl` (a common layout) each get their own results, named by folder and
    stem; the same file listed twice is refused in one line before any model loads (their results would mix)."""
    files = []
    for folder, count in (("math", 3), ("easy", 2)):
        rows = [{"problem": f"What is {i} + 1? Put it in \\boxed{{}}.", "answer": str(i + 1)} for i in range(count)]
        (tmp_path / folder).mkdir()
        files.append(write_jsonl(tmp_path / folder / "test.jsonl", rows))
    args = eval_args(tiny_model_dir, files[0], tmp_path / "run")
    args[args.index("--benchmarks") + 1] = f"{files[0]},{files[1]}"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "results.json").read_text())["benchmarks"]
    assert {name: s["num_problems"] for name, s in summary.items()} == {"math-test": 3, "easy-test": 2}
    assert sorted({r["benchmark"] for r in read_jsonl(tmp_path / "run" / "samples.jsonl")}) == [
        "easy-test",
        "math-test",
    ]
    args = eval_args(tmp_path / "no-model-here", files[0], tmp_path / "run2")
    args[args.index("--benchmarks") + 1] = f"{files[0]},{files[0]}"
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and f"{str(files[0])!r} is listed twice" in str(result.exception)
    assert not (tmp_path / "run2").exists()


def test_eval_builtin_benchmark_by_name(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = [
        "eval",
        "--model",
        str(tiny_model_dir),
        "--benchmarks",
        "aime24,math500",
        "--limit",
        "2",
        "--n",
        "1",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())["benchmarks"]
    assert set(results) == {"aime24", "math500"} and results["aime24"]["num_problems"] == 2


# ------------------------------------------------------------------------------------------------ identity (issue 12)


def _snapshot(out):
    return {
        name: (out / name).read_bytes() for name in ("samples.jsonl", "results.json", "config.yaml", "identity.json")
    }


@pytest.mark.parametrize(
    "change, field",
    [
        (["--n", "1"], "n: 2 → 1"),
        (["--temperature", "0.5"], "temperature: 1.0 → 0.5"),
        (["--top-p", "0.9"], "top_p: 1.0 → 0.9"),
        (["--top-k", "5"], "top_k: 0 → 5"),
        (["--max-new-tokens", "5"], "max_new_tokens: 6 → 5"),
        (["--seed", "1"], "seed: 0 → 1"),
        (["--template", "boxed"], "template: 'keep' → 'boxed'"),
        (["--no-thinking"], "enable_thinking: None → False"),
        (["--limit", "3"], "limit: None → 3"),
        (["--batch-size", "2"], "batch_size: 4 → 2"),
        (["max_prompt_length=100"], "max_prompt_length: 2048 → 100"),
    ],
)
def test_eval_rerun_with_other_settings_is_refused(tiny_model_dir, problem_file, tmp_path, change, field):
    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    before = _snapshot(out)
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out) + change)
    assert isinstance(result.exception, ValueError), result.output
    message = str(result.exception)
    assert "\n" not in message and field in message and str(out) in message and "another --out" in message
    assert _snapshot(out) == before  # nothing overwritten


def test_eval_rerun_with_another_model_or_changed_data_is_refused(tiny_model_dir, problem_file, tmp_path):
    from helpers import make_tiny_model

    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    before = _snapshot(out)
    # another model directory
    other = tmp_path / "other-model"
    make_tiny_model("llama", seed=1).save_pretrained(other)
    (other / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    result = CliRunner().invoke(app, eval_args(other, problem_file, out))
    assert "model.path" in str(result.exception) and "another --out" in str(result.exception)
    # the same directory, weights rewritten in place (e.g. a new checkpoint saved over it)
    make_tiny_model("llama", seed=1).save_pretrained(tiny_model_dir)
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out))
    assert "model.files" in str(result.exception)
    make_tiny_model("llama").save_pretrained(tiny_model_dir)  # back to the weights of the samples
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    # the benchmark file changed under the same name: one answer differs
    rows = read_jsonl(problem_file)
    rows[3]["answer"] = "7"
    write_jsonl(problem_file, rows)
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out))
    assert "benchmarks.toy" in str(result.exception)
    assert _snapshot(out) == before


@pytest.mark.slow
def test_eval_one_line_error_through_the_real_cli(tiny_model_dir, problem_file, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    args = eval_args(tiny_model_dir, problem_file, out)
    args[args.index("--n") + 1] = "3"
    proc = subprocess.run(
        [sys.executable, "-c", "from opd.cli import main; main()", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OPD_DEBUG": ""},
        timeout=300,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "n: 2 → 3" in lines[0] and "Traceback" not in proc.stderr


def test_eval_responses_into_a_model_run_is_refused(tiny_model_dir, problem_file, tmp_path):
    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    before = _snapshot(out)
    responses = write_jsonl(tmp_path / "r.jsonl", [{"response": "\\boxed{2}", "answer": "2"}])
    result = CliRunner().invoke(app, ["eval", "--responses", str(responses), "--out", str(out)])
    assert "mode: 'model' → 'responses'" in str(result.exception)
    assert _snapshot(out) == before


def test_eval_refuses_a_directory_of_other_output(problem_file, tmp_path):
    out = tmp_path / "someone-else"
    out.mkdir()
    (out / "config.yaml").write_text("steps: 10\n")
    responses = write_jsonl(tmp_path / "r.jsonl", [{"response": "\\boxed{2}", "answer": "2"}])
    result = CliRunner().invoke(app, ["eval", "--responses", str(responses), "--out", str(out)])
    assert "no identity.json" in str(result.exception)
    assert (out / "config.yaml").read_text() == "steps: 10\n"


def test_eval_identical_rerun_resumes_and_the_identity_is_recorded(tiny_model_dir, problem_file, tmp_path):
    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    identity = json.loads((out / "identity.json").read_text())
    assert identity["mode"] == "model" and identity["n"] == 2 and identity["model"]["path"] == str(tiny_model_dir)
    assert len(identity["model"]["files"]) == 16 and set(identity["benchmarks"]) == {"toy"}
    first = (out / "samples.jsonl").read_bytes()
    # the device and the grading timeout do not change what was sampled
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out) + ["--device", "cpu", "timeout=2"])
    assert result.exit_code == 0, result.output
    assert (out / "samples.jsonl").read_bytes() == first


# ------------------------------------------------------------------------------------------------ partial chunks


def _chunks(records):
    by_chunk = {}
    for r in records:
        by_chunk.setdefault(r["chunk"], []).append(r)
    return by_chunk


@pytest.mark.parametrize("damage", ["mid_chunk", "mid_line", "mid_line_then_more", "garbage_line", "all_but_one"])
def test_eval_redoes_partial_chunks(tiny_model_dir, problem_file, tmp_path, damage):
    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out)).exit_code == 0
    full = (out / "samples.jsonl").read_text()
    first = read_jsonl(out / "samples.jsonl")
    results = json.loads((out / "results.json").read_text())
    lines = full.splitlines(keepends=True)
    assert len(_chunks(first)) == 3  # 5 problems, 2 per chunk, n=2: chunks of 4, 4 and 2 lines
    if damage == "mid_chunk":  # a kill between two records of chunk 1: 6 of its lines... 2 of 4 present
        damaged = "".join(lines[:6])
    elif damage == "mid_line":  # disk full inside a line of chunk 1
        damaged = "".join(lines[:5]) + lines[5][: len(lines[5]) // 2]
    elif damage == "mid_line_then_more":  # a torn line, then the rest (an append that resumed after freeing space)
        damaged = "".join(lines[:5]) + lines[5][:40] + "".join(lines[6:])
    elif damage == "garbage_line":  # a record that parses but is not a sample (a corrupted block)
        damaged = "".join(lines[:2]) + '{"benchmark": "toy", "chunk": 0}\n' + "".join(lines[3:])
    else:  # every chunk but the last line
        damaged = "".join(lines[:-1])
    (out / "samples.jsonl").write_text(damaged)
    result = CliRunner().invoke(app, eval_args(tiny_model_dir, problem_file, out))
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output
    resumed = read_jsonl(out / "samples.jsonl")
    key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, first))  # every sample once
    assert {key(r): r for r in resumed} == {key(r): r for r in first}  # the redone chunks reproduce the run exactly
    assert json.loads((out / "results.json").read_text()) == results


def test_eval_periodic_eval_dir_resumes_with_a_generator_in_memory(tiny_tokenizer, problem_file, tmp_path):
    """The trainer's `run_dir/eval/step_N` evals pass the model in memory; a rerun (a resumed run) reuses them."""
    from helpers import make_tiny_model
    from opd.config import EvalConfig, ModelSpec
    from opd.recipes.eval import evaluate
    from opd.rollout import make_generator

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def generate(self, prompt_ids, params):
            self.calls += 1
            return self.inner.generate(prompt_ids, params)

    config = EvalConfig(
        model=ModelSpec(path="student-base"),
        benchmarks=[str(problem_file)],
        prompt_key="problem",
        answer_key="answer",
        n=2,
        max_new_tokens=4,
        batch_size=4,
        temperature=1.0,
        top_p=1.0,
        out=str(tmp_path / "run" / "eval" / "step_4"),
    )
    first = Counting(make_generator(make_tiny_model("llama"), tiny_tokenizer, engine="torch"))
    results = evaluate(config, generator=first, tokenizer=tiny_tokenizer)
    again = Counting(make_generator(make_tiny_model("llama"), tiny_tokenizer, engine="torch"))
    assert evaluate(config, generator=again, tokenizer=tiny_tokenizer) == results and again.calls == 0
    assert first.calls == 3


# ------------------------------------------------------------------------------------------------ ground truths


def test_eval_responses_ground_truth_rules(tmp_path):
    runs = []

    def run(rows, *extra):  # each run its own --out: a changed responses file is other work
        path = write_jsonl(tmp_path / "r.jsonl", rows)
        runs.append(tmp_path / f"o{len(runs)}")
        return CliRunner().invoke(app, ["eval", "--responses", str(path), "--out", str(runs[-1]), *extra])

    # a null answer is not "" (which would grade a correct response wrong): one line naming the line and field
    result = run(
        [
            {"problem_id": "a", "response": "\\boxed{1}", "answer": "1"},
            {"problem_id": "b", "response": "\\boxed{2}", "answer": None},
        ]
    )
    assert "r.jsonl:2: field 'answer' is null" in str(result.exception) and "on_missing_answer=skip" in str(
        result.exception
    )
    # ... or skipped with a count
    result = run(
        [
            {"problem_id": "a", "response": "\\boxed{1}", "answer": "1"},
            {"problem_id": "b", "response": "\\boxed{2}", "answer": ""},
        ],
        "on_missing_answer=skip",
    )
    assert result.exit_code == 0, result.output
    assert "skipped 1 of 2 lines" in " ".join(result.output.split())  # rich wraps long lines
    assert json.loads((runs[-1] / "results.json").read_text())["benchmarks"]["r"]["num_problems"] == 1
    # a list answer is "any of", kept as a list (not the string "['1', '2']")
    result = run(
        [
            {"problem_id": "a", "response": "\\boxed{2}", "answer": ["1", "2"]},
            {"problem_id": "b", "response": "\\boxed{3}", "answer": ["1", "2"]},
        ]
    )
    assert result.exit_code == 0, result.output
    samples = read_jsonl(runs[-1] / "samples.jsonl")
    assert [s["correct"] for s in samples] == [True, False] and samples[0]["answer"] == ["1", "2"]
    # the same problem id with two answers is refused; with the same answer the lines are samples of one problem
    result = run(
        [
            {"problem_id": "a", "response": "\\boxed{1}", "answer": "1"},
            {"problem_id": "a", "response": "\\boxed{2}", "answer": "2"},
        ]
    )
    assert "r.jsonl:2: problem 'a'" in str(result.exception) and "line 1" in str(result.exception)
    result = run(
        [
            {"problem_id": "a", "response": "\\boxed{1}", "answer": "1"},
            {"problem_id": "a", "response": "\\boxed{2}", "answer": "1"},
        ]
    )
    assert json.loads((runs[-1] / "results.json").read_text())["benchmarks"]["r"]["num_samples"] == 2
    # a bool is not a math answer
    result = run([{"problem_id": "a", "response": "\\boxed{True}", "answer": True}])
    assert "field 'answer' is True (bool)" in str(result.exception)


def test_eval_benchmark_with_a_null_answer_fails_before_loading_the_model(problem_file, tmp_path):
    rows = read_jsonl(problem_file)
    rows[2]["answer"] = None
    write_jsonl(problem_file, rows)
    missing_model = tmp_path / "no-such-model"  # never reached: the data error comes first
    result = CliRunner().invoke(app, eval_args(missing_model, problem_file, tmp_path / "run"))
    assert isinstance(result.exception, ValueError)
    assert "row 2 (id '2') field 'answer' is null" in str(result.exception)
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def _student_teacher_and_prompts(tiny_tokenizer, tmp_path):
    """A tiny qwen3 student (seed 0) and teacher (seed 1) under tmp_path, and six "i+i=" prompts with their answers."""
    from helpers import make_tiny_model

    for name, seed in (("student", 0), ("teacher", 1)):
        make_tiny_model("qwen3", seed=seed).save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)])


def _distill_evaluating(tmp_path, out_dir, steps, options, *overrides):
    """`opd distill` of `_student_teacher_and_prompts`'s models for `steps` steps into out_dir/run, checkpointing and
    evaluating on the training prompts every 2 steps; `options` adds to these (dotted keys), then the overrides."""
    from opd.config import DistillConfig, build_config
    from opd.recipes.distill import distill

    prompts = tmp_path / "prompts.jsonl"
    base = {
        "student.path": str(tmp_path / "student"),
        "teacher.path": str(tmp_path / "teacher"),
        "data.path": str(prompts),
        "data.answer_key": "answer",
        "data.max_prompt_length": 32,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 6,
        "rollout.batch_size": 4,
        "micro_batch_tokens": 64,
        "run.out_dir": str(out_dir),
        "run.name": "run",
        "run.steps": steps,
        "run.report": False,
        "optim.lr": 1e-3,
        "run.save_every": 2,
        "run.eval_every": 2,
        "eval.benchmarks": [str(prompts)],
        "eval.answer_key": "answer",
        "eval.n": 2,
    }
    return distill(build_config(DistillConfig, options=base | options, overrides=list(overrides)))


def test_distill_periodic_eval_is_finished_on_resume(tiny_tokenizer, tmp_path):
    """A run killed inside its step-4 eval (the checkpoint of step 4 is written after it) resumes from step 2, replays
    steps 3-4 and finishes eval/step_4 from its complete chunks: the same results as a run never interrupted."""
    import shutil

    _student_teacher_and_prompts(tiny_tokenizer, tmp_path)

    def run(out, steps, *extra):
        return _distill_evaluating(tmp_path, tmp_path / out, steps, {"eval.max_new_tokens": 4}, *extra)

    straight = run("a", 4)
    killed = run("b", 4)
    shutil.rmtree(killed / "checkpoints" / "step_4")
    samples = killed / "eval" / "step_4" / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines[:5]) + lines[5][:30])  # chunk 1 half written
    (killed / "eval" / "step_4" / "results.json").unlink()
    resumed = run("b", 4, "run.resume=true")
    for step in (2, 4):
        ours = json.loads((resumed / "eval" / f"step_{step}" / "results.json").read_text())
        assert ours == json.loads((straight / "eval" / f"step_{step}" / "results.json").read_text())
    assert read_jsonl(samples) and len(read_jsonl(samples)) == len(lines)


# ------------------------------------------------------------------------------------------------ weights identity


def test_eval_rerun_on_weights_changed_in_place_is_refused(tiny_tokenizer, problem_file, tmp_path):
    """Zeroing tensor bytes of a safetensors file in place (same size, same header) is other weights: a rerun into the
    same --out is refused, not answered from the samples of the old weights. Every byte counts, not sampled blocks."""
    from helpers import make_tiny_model

    model_dir = tmp_path / "model"  # > 1 MiB of weights: hashed in part before
    make_tiny_model("llama", hidden_size=128, intermediate_size=512).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    assert size > 2 << 20
    out = tmp_path / "run"
    assert CliRunner().invoke(app, eval_args(model_dir, problem_file, out)).exit_code == 0
    before = _snapshot(out)
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    block, blocks = 1 << 16, 16
    sampled = [(size - block) * k // (blocks - 1) for k in range(blocks)]
    for start, end in zip(sampled, sampled[1:]):  # the bytes between two 64 KiB blocks
        lo, hi = max(start + block, header_end), end
        if hi > lo:
            data[lo:hi] = bytes(hi - lo)
    weights.write_bytes(bytes(data))
    assert weights.stat().st_size == size
    result = CliRunner().invoke(app, eval_args(model_dir, problem_file, out))
    assert isinstance(result.exception, ValueError), result.output
    assert "model.files" in str(result.exception) and "another --out" in str(result.exception)
    assert _snapshot(out) == before


def test_model_fingerprint_hashes_each_file_once_per_process(tiny_model_dir, monkeypatch):
    """A re-evaluation does not hash the weights again: the digest is kept by (path, size, mtime, inode)."""
    import os
    import time

    from opd import fingerprints as sampling

    old = time.time_ns() - 10 * 10**9  # older than the racy window
    for file in tiny_model_dir.iterdir():
        os.utime(file, ns=(old, old))
    first = sampling.model_fingerprint(str(tiny_model_dir))
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda file, *a, **k: opened.append(file) or real_open(file, *a, **k))
    assert sampling.model_fingerprint(str(tiny_model_dir)) == first and opened == []
    monkeypatch.undo()
    weights = tiny_model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4)
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(old + 1, old + 1))
    assert sampling.model_fingerprint(str(tiny_model_dir)) != first


def test_distill_in_run_eval_is_keyed_by_the_weights_evaluated(tiny_tokenizer, tmp_path):
    """A resume with other settings replays steps 3-4 with other weights: eval/step_4 made by the old weights is
    evaluated again, not reused; its identity names the weights evaluated."""
    import shutil

    _student_teacher_and_prompts(tiny_tokenizer, tmp_path)

    def run(steps, *extra):
        options = {"run.eval_at_start": False, "eval.max_new_tokens": 8, "eval.temperature": 0.0}
        return _distill_evaluating(tmp_path, tmp_path / "runs", steps, options, *extra)

    run_dir = run(4)
    step_4 = run_dir / "eval" / "step_4"
    old_identity = json.loads((step_4 / "identity.json").read_text())
    old_samples = (step_4 / "samples.jsonl").read_text()
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    run(4, "run.resume=true", "run.allow_config_change=true", "objective.top_k=2", "rollout.n=4")
    identity = json.loads((step_4 / "identity.json").read_text())
    assert identity["model"]["weights"] != old_identity["model"].get("weights")
    assert (step_4 / "samples.jsonl").read_text() != old_samples  # sampled again, by the weights of this run
