"""Damaged run directories, read back: each file `opd report`, `opd distill --resume` and `opd sft --resume` read
from a run directory, damaged, fails with one line naming it (exit 2, no traceback) and, for a resume, before the
run changes anything in it. Cases and outcomes as in the bad-input matrix (test_commands.py)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import run_in_process
from helpers_bad_inputs import Case, classify, tally

# ---------------------------------------------------- issue 22 item 13: damaged run directories, read back

# Real runs made once per module (2 steps, a checkpoint, samples and an in-run eval at every step), copied into each
# case's tmp_path as {runs}/d (distill) and {runs}/s (sft) and damaged there; `opd report` reads them, `--resume`
# continues them to step 3 with the settings they were made with.
BASE_DISTILL = (
    "distill --student {model} --teacher {model} --prompts {prompts} --out-dir {runs} --name d "
    "prompts_per_step=2 rollout.max_new_tokens=4 data.max_prompt_length=64 micro_batch_tokens=256 run.save_every=1 "
    "run.samples_per_step=2 eval.benchmarks={bench} eval.n=1 eval.max_new_tokens=4 run.eval_every=1 run.report=false"
)
BASE_SFT = (
    "sft --model {model} --data {sft} --name s run.out_dir={runs} examples_per_step=2 data.max_length=256 "
    "micro_batch_tokens=256 run.save_every=1 run.report=false"
)
REPORT_D = "report {runs}/d --out {out}/r.html"
RESUME_D = BASE_DISTILL + " --steps 3 --resume"
RESUME_S = BASE_SFT + " run.steps=3 --resume"
DIR = object()  # damage: a directory where the file was
STEP = "99999999999999999999999"  # a step number no run reaches (and beyond int64)


@dataclass(frozen=True)
class Damaged(Case):
    """A Case run on a copy of the module's real runs after `damage`: (path under {runs}, content) pairs; content is
    text, bytes, DIR, or a callable of the path; a `*` in the path is each match. `remanifest`: the checkpoints'
    MANIFEST.json rewritten after the damage (a manifest that agrees with damaged files)."""

    damage: tuple = ()
    remanifest: bool = False
    kind: str = "damaged"

    def apply(self, runs: Path) -> None:
        from opd.rundir import MANIFEST, write_manifest

        for pattern, content in self.damage:
            for path in sorted(runs.glob(pattern)) if "*" in pattern else [runs / pattern]:
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
                path.parent.mkdir(parents=True, exist_ok=True)
                if content is DIR:
                    path.mkdir()
                elif callable(content):
                    content(path)
                elif isinstance(content, bytes):
                    path.write_bytes(content)
                else:
                    path.write_text(content)
                if self.remanifest and path.parent.parent.name == "checkpoints":
                    (path.parent / MANIFEST).unlink()
                    write_manifest(path.parent)


def _torch_save(value):
    def save(path: Path) -> None:
        import torch

        torch.save(value, path)

    return save


METRICS = "metrics.jsonl"
GOOD_RESULTS = '{"benchmarks": {"bench": {"avg@1": 0.5}}}'
_DAMAGE = {  # label → (path under the run, content, culprits beyond the file's path)
    "metrics.jsonl line a list": (
        METRICS,
        '{"step": 1, "loss": 1.0}\n[1, 2]\n{"step": 2, "loss": 0.5}\n',
        (":2", "list"),
    ),
    "metrics.jsonl line a number": (METRICS, '{"step": 1, "loss": 1.0}\n5\n{"step": 2, "loss": 0.5}\n', (":2",)),
    "metrics.jsonl step a string": (METRICS, '{"step": 1, "loss": 1.0}\n{"step": "two", "loss": 0.5}\n', ("'two'",)),
    "metrics.jsonl step absurd": (METRICS, '{"step": 1, "loss": 1.0}\n{"step": 1e300, "loss": 0.5}\n', ("1e+300",)),
    "metrics.jsonl step negative": (METRICS, '{"step": 1, "loss": 1.0}\n{"step": -5, "loss": 0.5}\n', ("-5",)),
    "samples line a list": ("samples/step_2.jsonl", "[1, 2]\n", (":1",)),
    "samples file a directory": ("samples/step_2.jsonl", DIR, ("directory",)),
    "samples step name absurd": (f"samples/step_{STEP}.jsonl", '{"step": 1}\n', ("not a step number",)),
    "eval results a list": ("eval/step_2/results.json", "[1, 2]", ("list",)),
    "eval results of another shape": ("eval/step_2/results.json", '{"benchmarks": [1]}', ("eval results",)),
    "eval results not JSON": ("eval/step_2/results.json", '{"bench', ("JSON",)),
    "eval step name absurd": (f"eval/step_{STEP}/results.json", GOOD_RESULTS, ("not a step number",)),
    "teacher eval results a list": ("eval/teacher/results.json", "[]", ("list",)),
    "teachers.json a list": ("teachers.json", "[]", ("list",)),
    "config.yaml unparsable": ("config.yaml", "run: [1, 2\n", ("YAML",)),
    "config.yaml a list": ("config.yaml", "- 1\n- 2\n", ("mapping",)),
    "config.yaml empty": ("config.yaml", "", ("mapping",)),
    "config.yaml a directory": ("config.yaml", DIR, ("directory",)),
    "config.yaml not UTF-8": ("config.yaml", b"run: \xff\n", ("UTF-8",)),
    "every MANIFEST.json a list": ("checkpoints/*/MANIFEST.json", "[]", ("MANIFEST.json", "no checkpoint")),
    "checkpoint step name absurd": (f"checkpoints/step_{STEP}", DIR, ("not a step number",)),
    "trainer_state.pt garbage": ("checkpoints/*/trainer_state.pt", b"garbage", ("not loadable",)),
    "trainer_state.pt a list": ("checkpoints/*/trainer_state.pt", _torch_save([1, 2]), ("not a trainer state",)),
    "model.safetensors garbage": ("checkpoints/*/model.safetensors", b"garbage", ("model.safetensors",)),
}
_REPORTED = [
    label for label in _DAMAGE if "MANIFEST" not in label and not label.startswith(("checkpoint", "trainer", "model."))
]
_RESUMED = [
    label
    for label in _DAMAGE
    if label not in ("samples file a directory", "teachers.json a list", "teacher eval results a list")
]  # (a resume rewrites teachers.json, and the others are the report's cases above, read the same way)
_RESUMED_SFT = [
    "metrics.jsonl line a list",
    "metrics.jsonl step absurd",
    "config.yaml a list",
    "every MANIFEST.json a list",
    "checkpoint step name absurd",
    "trainer_state.pt garbage",
]


def _damaged(command: str, argv: str, run: str, label: str) -> Damaged:
    where, content, culprits = _DAMAGE[label]
    culprit = where.replace("*", "step_2") if "MANIFEST" not in where else ""
    if STEP in culprit:  # the line names the file or directory whose name holds the absurd step
        culprit = culprit[: culprit.index(STEP) + len(STEP)] + (".jsonl" if culprit.endswith(".jsonl") else "")
    located = f"{{runs}}/{run}/{culprit}".rstrip("/")
    if where.startswith("checkpoints/*") and "MANIFEST" not in where:
        located = f"{{runs}}/{run}/checkpoints/step_2/{where.rsplit('/', 1)[1]}"
    return Damaged(
        f"{command}: {label}",
        argv,
        (located, *culprits),
        damage=((f"{run}/{where}", content),),
        remanifest=where.startswith("checkpoints/*") and "MANIFEST" not in where,
    )


DAMAGED_CASES: list[Damaged] = [
    *[_damaged("report", REPORT_D, "d", label) for label in _REPORTED],
    *[_damaged("distill --resume", RESUME_D, "d", label) for label in _RESUMED],
    *[_damaged("sft --resume", RESUME_S, "s", label) for label in _RESUMED_SFT],
]


@pytest.fixture(scope="module")
def base_runs(env_world, tmp_path_factory):
    """The real runs every damaged case copies: distill and sft, 2 steps each, made through the CLI."""
    runs = tmp_path_factory.mktemp("base-runs")
    world = {**env_world, "runs": str(runs)}
    mp = pytest.MonkeyPatch()
    try:
        for argv in (BASE_DISTILL + " --steps 2", BASE_SFT + " run.steps=2"):
            import shlex
            import traceback

            from opd.cli import main

            mp.setattr(sys, "argv", ["opd", *[part.format_map(world) for part in shlex.split(argv)]])
            try:
                main()
            except SystemExit as exit_:
                assert not exit_.code, f"{argv}: exit {exit_.code}"
            except BaseException:  # noqa: BLE001
                pytest.fail(traceback.format_exc())
    finally:
        mp.undo()
    return runs


@pytest.mark.parametrize("case", DAMAGED_CASES, ids=[c.name for c in DAMAGED_CASES])
def test_damaged_run_directory(case: Damaged, env_world, base_runs, monkeypatch, capfd, tmp_path):
    """Each file a command reads back from a run directory, damaged: one line naming it, exit 2, no traceback, and
    (for a resume) before the run changes anything in it."""
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    shutil.copytree(base_runs, runs)
    case.apply(runs)
    metrics_before = {p: p.read_bytes() for p in runs.glob("*/metrics.jsonl") if p.is_file()}
    world = {**env_world, "out": str(tmp_path / "out"), "runs": str(runs)}
    capfd.readouterr()
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    tally(case, outcome, code, (escaped or "") + stderr)
    assert outcome == "clear", f"{outcome} (exit {code}), wanted one line naming {culprits}:\n{escaped or ''}{stderr}"
    assert {p: p.read_bytes() for p in metrics_before} == metrics_before  # refused before anything was rewritten
    assert not (runs / "d" / "checkpoints" / "step_3").exists() and not (runs / "s" / "checkpoints" / "step_3").exists()
