"""The bad-input matrix, second trust pass: inputs that were accepted with exit 0 while the run did something else than
asked (silent_wrong), wrote over what it had just written (data_loss), or were refused only after models loaded or
files were written (late). Each must now fail as every case of test_commands.py does: exit 2, one line on stderr
naming the culprit, no traceback. Each case carries its `failure_class` mark (the matrix's summary counts them).

The cases that need a run directory first (a resume over data edited in place, a `teachers.json` that is a folder)
are test functions of their own below the table; a teacher with no prompts in a step (no fake 0.0) is a metrics
property, tested in tests/train/test_teachers.py.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from helpers import run_in_process
from helpers_bad_inputs import DISTILL, EVAL, TINY_DISTILL, Case, classify, tally

SILENT, DATA_LOSS, LATE = "silent_wrong", "data_loss", "late"
CASE_KIND = {SILENT: "silent-wrong", DATA_LOSS: "data-loss", LATE: "late-error"}  # `Case.kind`'s spelling


def _teachers(*entries: dict) -> str:
    """`teachers=[...]` as one shell word of a case's argv: JSON whose braces survive `format_map`, and whose
    "@name@" strings become `{name}` placeholders of the world."""
    text = json.dumps(list(entries)).replace("{", "{{").replace("}", "}}")
    for key in ("model",):
        text = text.replace(f"@{key}@", "{" + key + "}")
    return shlex.quote(f"teachers={text}")


def _distill(teachers: str, *extra: str) -> str:
    base = "distill --student {model} --prompts {prompts} --out-dir {out} --name d " + TINY_DISTILL
    return " ".join((base, teachers, *extra))


MODEL = "@model@"
DEFAULT = {"name": "rest", "path": MODEL, "route": {"default": True}}

CASES: list[tuple] = [  # (case, failure class[, "slow"])
    # ------------------------------------------------------------------ routing that matches nothing (silent_wrong)
    (
        Case(
            "distill route value with other capitals",
            _distill(_teachers({"name": "toy", "path": MODEL, "route": {"data_source": ["Toy"]}}, DEFAULT)),
            ("teacher toy", "matches 0 of 4 prompts", "'toy' (4)"),
        ),
        SILENT,
    ),
    (
        Case(
            "distill route_key the loader consumed",
            _distill(
                _teachers(
                    {"name": "g", "path": MODEL, "route": {"route_key": "reward_model.ground_truth", "values": ["2"]}},
                    DEFAULT,
                )
            ),
            ("reward_model.ground_truth", "data.answer_key"),
        ),
        SILENT,
    ),
    (
        Case(
            "distill route_key no prompt has",
            _distill(_teachers({"name": "g", "path": MODEL, "route": {"route_key": "level", "values": [1]}}, DEFAULT)),
            ("no prompt has the column 'level'",),
        ),
        SILENT,
    ),
    (
        Case(
            "distill route value a mapping",
            _distill(
                _teachers(
                    {"name": "g", "path": MODEL, "route": {"route_key": "extra_info", "values": [{"index": 1}]}},
                    DEFAULT,
                )
            ),
            ("a route value", "{{'index': 1}}"),
        ),
        SILENT,
    ),
    (
        Case(
            "check route value with other capitals",
            "check --student {model} --prompts {prompts} --out {out}/check --n 1 --prompts-sample 4 "
            + _teachers({"name": "toy", "path": MODEL, "route": {"data_source": ["Toy"]}}, DEFAULT),
            ("teacher toy", "matches 0 of 4 prompts"),
        ),
        SILENT,
    ),
    # ---------------------------------------------------------------- a self-teacher that teaches nothing (silent)
    (
        Case(
            "distill path: student without a view",
            _distill(_teachers({"name": "self", "path": "student"})),
            ("teachers[0] (self)", "path: student without a view"),
        ),
        SILENT,
    ),
    (
        Case(
            "distill path: student_init alone without a view",
            _distill(_teachers({"name": "self", "path": "student_init"})),
            ("teachers[0] (self)", "path: student_init without a view"),
        ),
        SILENT,
    ),
    # ------------------------------------------------------ a view longer than the teacher's context (silent_wrong)
    (
        Case(
            "distill view past the teacher's context",
            _distill(
                _teachers(
                    {
                        "name": "t",
                        "path": MODEL,
                        "view": {"context_key": "answer", "context_template": " {context}" + " pad" * 150},
                    }
                )
            ),
            ("teacher t's view", "beyond its context (512 positions"),
        ),
        SILENT,
    ),
    # ------------------------------------------------------------------------- benchmark paths (silent_wrong)
    (
        Case(
            "eval --benchmarks ./aime24 missing",
            EVAL.replace("--benchmarks {bench}", "--benchmarks ./aime24"),
            ("'./aime24'", "no such file or folder"),
        ),
        SILENT,
    ),
    (
        Case(
            "eval --benchmarks a name and its shipped file",
            EVAL.replace("--benchmarks {bench}", "--benchmarks math500,{shipped_math500}"),
            ("'math500'", "name one benchmark"),
        ),
        SILENT,
    ),
    # -------------------------------------------------------------------------------- all steps skipped (silent)
    (
        Case(
            "distill ends on skipped steps",
            DISTILL.replace("--steps 1", "--steps 3") + " optim.lr=1e30 --skip-check all",
            ("the run ended with its last 2 steps (2..3) skipped",),
        ),
        SILENT,
        "slow",
    ),
    # ------------------------------------------------------------------------------- damaged files read back
    (
        Case(
            "report samples token_rewards a number",
            "report {run_samples} --out {out}/r.html",
            ("step_2.jsonl:1", "'token_rewards' is 5"),
        ),
        SILENT,
    ),
    # ------------------------------------------------------------------------------ outputs that collide (loss)
    (
        Case(
            "dedup --out and --report one file",
            "dedup --in {prompts} --out {out}/kept.jsonl --report {out}/kept.jsonl",
            ("--report", "is the --out file too"),
        ),
        DATA_LOSS,
    ),
    (
        Case(
            "dedup --report spelled through ..",
            "dedup --in {prompts} --out {out}/kept.jsonl --report {out}/x/../kept.jsonl",
            ("--report", "is the --out file too"),
        ),
        DATA_LOSS,
    ),
]


@pytest.fixture(scope="module")
def trust_world(env_world, tmp_path_factory):
    """The matrix's world, plus the path of a shipped benchmark file and a run directory whose newest samples file
    holds a number for token_rewards."""
    from opd.eval.benchmarks import benchmark_path

    root = tmp_path_factory.mktemp("trust")
    run = root / "run-samples"
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    (run / "samples" / "step_2.jsonl").write_text('{"response": "x", "token_rewards": 5}\n')
    return {**env_world, "shipped_math500": str(benchmark_path("math500")), "run_samples": str(run)}


def _run(argv: list[str], monkeypatch, capfd, tmp_path) -> tuple[int | None, str, str | None]:
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # ./aime24 and anything written to a default location: here
    return run_in_process(argv, monkeypatch, capfd)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            replace(case, kind=CASE_KIND[kind]),
            marks=[pytest.mark.failure_class(kind), *([pytest.mark.slow] if slow else [])],
            id=case.name,
        )
        for case, kind, *slow in CASES
    ],
)
def test_trust_case(case: Case, trust_world, monkeypatch, capfd, tmp_path):
    world = {**trust_world, "out": str(tmp_path / "out")}
    code, stderr, escaped = _run(case.command(world), monkeypatch, capfd, tmp_path)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    tally(case, outcome, code, (escaped or "") + stderr)
    assert outcome == "clear", f"{outcome} (exit {code}), wanted one line naming {culprits}:\n{escaped or ''}{stderr}"


def _routed_prompts(path, sources: list[str]):
    rows = [
        {"prompt": f"What is 1 + {k}?", "data_source": s, "reward_model": {"ground_truth": str(1 + k)}}
        for k, s in enumerate(sources)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _routed_distill(world: dict, prompts, out, *extra: str) -> list[str]:
    teachers = [
        {"name": "a", "path": world["model"], "route": {"data_source": ["a"]}},
        {"name": "b", "path": world["model"], "route": {"data_source": ["b"]}},
    ]
    base = f"distill --student {world['model']} --prompts {prompts} --out-dir {out} --name d {TINY_DISTILL}"
    return [*shlex.split(base), f"teachers={json.dumps(teachers)}", *extra]


@pytest.mark.slow
@pytest.mark.failure_class(SILENT)
def test_resume_over_a_route_column_edited_in_place(trust_world, monkeypatch, capfd, tmp_path):
    """The same prompts, ids and answers, another data_source for one: the resumed steps would train under other
    teachers. Refused in one line; the routing table the first step trained with is untouched."""
    prompts = _routed_prompts(tmp_path / "p.jsonl", ["a", "b", "a", "b"])
    code, stderr, _ = _run(_routed_distill(trust_world, prompts, tmp_path / "runs"), monkeypatch, capfd, tmp_path)
    assert code == 0, stderr
    table = (tmp_path / "runs" / "d" / "teachers.json").read_bytes()
    _routed_prompts(prompts, ["b", "b", "a", "b"])
    argv = _routed_distill(trust_world, prompts, tmp_path / "runs", "--resume")
    argv[argv.index("--steps") + 1] = "2"
    code, stderr, escaped = _run(argv, monkeypatch, capfd, tmp_path)
    assert classify(code, stderr, ["teachers' routing or views", str(prompts)], 2, escaped) == "clear", stderr
    assert (tmp_path / "runs" / "d" / "teachers.json").read_bytes() == table


@pytest.mark.slow
@pytest.mark.failure_class(LATE)
def test_resume_with_a_teachers_json_folder_is_refused_before_config_yaml_is_rewritten(
    trust_world, monkeypatch, capfd, tmp_path
):
    prompts = _routed_prompts(tmp_path / "p.jsonl", ["a", "b", "a", "b"])
    code, stderr, _ = _run(_routed_distill(trust_world, prompts, tmp_path / "runs"), monkeypatch, capfd, tmp_path)
    assert code == 0, stderr
    run_dir = tmp_path / "runs" / "d"
    (run_dir / "teachers.json").unlink()
    (run_dir / "teachers.json").mkdir()
    config = (run_dir / "config.yaml").read_bytes()
    argv = _routed_distill(trust_world, prompts, tmp_path / "runs", "--resume")
    argv[argv.index("--steps") + 1] = "2"  # a config.yaml that a late refusal would already have rewritten
    code, stderr, escaped = _run(argv, monkeypatch, capfd, tmp_path)
    assert classify(code, stderr, [str(run_dir / "teachers.json"), "not a file"], 2, escaped) == "clear", stderr
    assert (run_dir / "config.yaml").read_bytes() == config and not list(run_dir.glob("config.step_*"))


@pytest.mark.failure_class(LATE)
def test_check_with_a_later_teachers_check_json_is_refused_before_the_first_teacher_runs(
    trust_world, monkeypatch, capfd, tmp_path
):
    prompts = _routed_prompts(tmp_path / "p.jsonl", ["a", "b", "a", "b"])
    out = tmp_path / "check"
    (out / "b").mkdir(parents=True)
    (out / "b" / "check.json").write_text("{}\n")  # an earlier check's, of teacher b
    teachers = _routed_distill(trust_world, prompts, tmp_path / "runs")[-1]
    argv = ["check", "--student", trust_world["model"], "--prompts", str(prompts), "--out", str(out), teachers]
    argv += ["--n", "1", "--prompts-sample", "4", "rollout.max_new_tokens=4", "data.max_prompt_length=64"]
    code, stderr, escaped = _run(argv, monkeypatch, capfd, tmp_path)
    assert classify(code, stderr, [str(out / "b" / "check.json"), "exists"], 2, escaped) == "clear", stderr
    assert not (out / "a").exists()  # teacher a's check never ran
