"""The bad-input matrix, trust cases of the security, traceback and misleading classes: config values used as
folder or file names (a teacher's name, run.name, rollout.dataset_name), values that cost without bound
(rollout.max_staleness; the served teacher's batch_window_ms and request_timeout_s), view templates whose fields the
teacher would never get, temperatures where float32 arithmetic breaks, a bearer token file that is not text, and an
objective.top_k beyond the vocabulary (known from the tokenizer alone). Each is refused before any model's weights
load (the test fails a load) or anything is written, with exit 2 and one line naming the key or file. Each case
carries its failure class (`failure_class` marker: the counts at the end of the run, conftest.py) and is tallied as
the other cases are (`OPD_MATRIX_TALLY`, test_commands.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from helpers import run_in_process
from helpers_bad_inputs import DISTILL, EVAL, ROLLOUT, Case, classify, tally

NO_TEACHER = DISTILL.replace("--teacher {model} ", "")
# the lab teacher served with max_top_k=4 (the `served` fixture), its student of the same tokenizer
SERVED = NO_TEACHER.replace("--student {model}", "--student {lab_teacher}") + " teacher.url={served}"
SERVED_MAX_TOP_K = 4
CHECK = "check --student {model} --prompts {prompts} --out {out}/check --n 1 --prompts-sample 2 " + (
    "rollout.max_new_tokens=4 data.max_prompt_length=64 micro_batch_tokens=256"
)


def teachers(first: str, view: str = "") -> str:
    """A `teachers=[...]` override (YAML; braces doubled for the world's placeholders): `first`, then `b` taking the
    toy prompts; `view`: the first teacher's view template."""
    seen = f", view: {{{{context_key: answer, context_template: '{view}'}}}}" if view else ""
    return (
        f"\"teachers=[{{{{name: '{first}', path: {{model}}, route: {{{{default: true}}}}{seen}}}}}, "
        f'{{{{name: b, path: {{model}}, route: {{{{data_source: [toy]}}}}}}}}]"'
    )


def case(failure_class: str, name: str, argv: str, culprit: tuple[str, ...]):
    kind = {"silent_wrong": "silent-wrong", "data_loss": "data-loss", "late": "late-error"}.get(failure_class)
    return pytest.param(
        Case(name, argv, culprit, kind=kind or failure_class),
        marks=pytest.mark.failure_class(failure_class),
        id=name,
    )


TRUST_CASES = [
    # -------------------------------------------------------------------------- names that become folders / files
    case("security", "check teacher name ..", f"{CHECK} {teachers('..')}", ("teachers.0.name", "'..'")),
    case("security", "check teacher name .", f"{CHECK} {teachers('.')}", ("teachers.0.name", "'.'")),
    case("security", "distill teacher name a path", f"{NO_TEACHER} {teachers('../up')}", ("teachers.0.name",)),
    case("security", "distill teacher name of 300 chars", f"{NO_TEACHER} {teachers('x' * 300)}", ("teachers.0.name",)),
    case("security", "check teacher name a reserved file", f"{CHECK} {teachers('nul')}", ("teachers.0.name", "nul")),
    case("data_loss", "check teacher name check.json", f"{CHECK} {teachers('check.json')}", ("teachers.0.name",)),
    case("security", "distill --name ..", DISTILL.replace("--name d", "--name .."), ("run.name", "'..'")),
    case("security", "distill run.name=.", DISTILL + " run.name=.", ("run.name", "'.'")),
    case("security", "distill --name ../elsewhere", DISTILL.replace("--name d", "--name ../x"), ("run.name",)),
    case(
        "security",
        "rollout dataset_name a path",
        ROLLOUT + " --llamafactory dataset_name=../../x",
        ("dataset_name", "../../x"),
    ),
    case(
        "data_loss",
        "rollout dataset_name dataset_info",
        ROLLOUT + " --llamafactory dataset_name=dataset_info",
        ("dataset_name", "dataset_info"),
    ),
    # ------------------------------------------------------------------------------- one value, unbounded cost
    case(
        "security",
        "distill rollout.max_staleness=1000000",
        DISTILL + " rollout.partial=true objective.tis_cap=2 rollout.max_staleness=1000000",
        ("rollout.max_staleness", "1000000"),
    ),
    case(
        "security",
        "serve-teacher batch_window_ms=5000",
        "serve-teacher --model {model} --port 0 batch_window_ms=5000",
        ("batch_window_ms", "5000", "1000"),
    ),
    case(
        "security",
        "serve-teacher request_timeout_s=3600",
        "serve-teacher --model {model} --port 0 request_timeout_s=3600",
        ("request_timeout_s", "3600", "600"),
    ),
    # ----------------------------------------------------------------------------------------- view templates
    case(
        "traceback",
        "distill view template {source}",
        f"{NO_TEACHER} {teachers('a', '{{source}}')}",
        ("context_template", "{{source}}"),
    ),
    case("traceback", "distill view template {0}", f"{NO_TEACHER} {teachers('a', '{{0}}')}", ("context_template",)),
    case(
        "misleading",
        "distill view template with a lone }",
        f"{NO_TEACHER} {teachers('a', '{{context}} }}')}",
        ("context_template", "'}}'"),
    ),
    case(
        "silent_wrong",
        "distill view template {{context}}",
        f"{NO_TEACHER} {teachers('a', '{{{{context}}}}')}",
        ("context_template", "no {{context}} field"),
    ),
    # ----------------------------------------------------------------------------------- degenerate temperatures
    case(
        "traceback",
        "distill rollout.temperature=1e-40",
        DISTILL + " rollout.temperature=1e-40",
        ("rollout.temperature", "1e-40"),
    ),
    case(
        "traceback",
        "distill objective.teacher_temperature=1e-300",
        DISTILL + " objective.teacher_temperature=1e-300",
        ("objective.teacher_temperature", "1e-300"),
    ),
    case("traceback", "eval temperature=1e-40", EVAL + " temperature=1e-40", ("temperature", "1e-40")),
    case(
        "traceback",
        "distill teachers temperature=1e-300",
        f"{NO_TEACHER} "
        + teachers("a").replace("route: {{default: true}}", "temperature: 1e-300, route: {{default: true}}"),
        ("teachers.0.temperature", "1e-300"),
    ),
    # --------------------------------------------------------------------------------------------- the token
    case(
        "misleading",
        "distill teacher.token_file not UTF-8",
        NO_TEACHER + " teacher.url=http://127.0.0.1:1 teacher.token_file={not_utf8} teacher.retry_deadline=0",
        ("token_file", "{not_utf8}"),
    ),
    # ------------------------------------------------------ a top-k beyond the vocabulary (261 ids), or a server's
    case(
        "late",
        "distill objective.top_k above a served teacher's max_top_k",
        SERVED + " objective.top_k=8",
        ("objective.top_k=8", "max_top_k", "{served}"),
    ),
    case(
        "late",
        "check objective.top_k above a served teacher's max_top_k",
        CHECK.replace("--student {model}", "--student {lab_teacher}") + " teacher.url={served} objective.top_k=8",
        ("objective.top_k=8", "max_top_k", "{served}"),
    ),
    case(
        "late",
        "distill diagnostics' top-k above a served teacher's max_top_k",
        SERVED + " objective.top_k=0",
        ("objective.top_k=0", "16", "max_top_k", "{served}"),
    ),
    case(
        "late",
        "distill objective.top_k beyond the vocabulary",
        DISTILL + " objective.top_k=1000000",
        ("objective.top_k", "1000000", "[0, 261]"),
    ),
    case(
        "late",
        "check objective.top_k beyond the vocabulary",
        CHECK + " --teacher {model} objective.top_k=262",
        ("objective.top_k", "262", "[0, 261]"),
    ),
]


class WeightsLoaded(BaseException):
    """Raised by any model load in a trust case: the case must be refused before (not caught as a user error)."""


@pytest.fixture(scope="module")
def served():
    """The lab teacher served in this process (no token, loopback) with max_top_k=4: its URL."""
    from helpers_served_teacher import serve_in_thread
    from opd.lab import teacher_path
    from opd.models import load_model
    from opd.teacher.local import LocalScorer

    model, _ = load_model(teacher_path(), dtype="fp32", device="cpu")
    with serve_in_thread(LocalScorer(model), token=None, max_top_k=SERVED_MAX_TOP_K) as (url, _):
        yield url


@pytest.mark.parametrize("case", TRUST_CASES)
def test_trust_case(case: Case, env_world, monkeypatch, capfd, tmp_path, request):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = work / "out"
    world = {**env_world, "out": str(out)}
    if "{served}" in case.argv:
        world["served"] = request.getfixturevalue("served")

    def no_weights(*args, **kwargs):
        raise WeightsLoaded(f"model weights loaded before the refusal: {args[0] if args else kwargs}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    tally(case, outcome, code, (escaped or "") + stderr)
    assert outcome == "clear", f"{outcome} (exit {code}), wanted one line naming {culprits}:\n{escaped or ''}{stderr}"
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_dir())
    assert not written, f"refused, yet wrote {written}"  # before any file is written, above --out or inside it


def test_every_trust_case_has_one_failure_class():
    classes = {"security", "silent_wrong", "data_loss", "traceback", "misleading", "late"}
    for param in TRUST_CASES:
        (mark,) = [m for m in param.marks if m.name == "failure_class"]
        assert mark.args[0] in classes, param.id
    assert len({p.id for p in TRUST_CASES}) == len(TRUST_CASES)
    assert Path(__file__).name.startswith("test_trust_")


@pytest.mark.slow
def test_a_run_with_matrix_cases_prints_its_counts_whatever_the_width(tmp_path):
    """pytest over a few cases, in a 60-column terminal: the counts by failure class and outcome close the run, one
    plain line a class (no wrapping)."""
    import subprocess
    import sys

    from helpers import subprocess_env

    here = Path(__file__)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(here), "-q", "-p", "no:cacheprovider", "-k", "max_staleness or eval"],
        cwd=here.parents[3],
        env={**subprocess_env(), "COLUMNS": "60"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "bad-input matrix: cases by failure class and outcome" in line)
    table = [line.split() for line in lines[start + 1 : start + 5]]
    assert table[0] == ["class", "cases", "clear", "traceback", "silent", "unclear", "other"]
    assert table[1:] == [["security", "1", "1", "0", "0", "0", "0"], ["traceback", "1", "1", "0", "0", "0", "0"]] + [
        ["total", "2", "2", "0", "0", "0", "0"]
    ]
