"""The lab: shipped assets load and reach their recorded accuracies; `opd demo` and `opd lab build` run end to end in
a reduced form. (The task and the tokenizer are tested in tests/lab/test_task.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import string_console
from opd import lab

SPECIALISTS = (lab.specialist_path("add"), lab.specialist_path("mul"))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_assets_are_package_data():
    import importlib.resources as resources

    names = {p.name for p in resources.files("opd.lab").joinpath("assets").iterdir()}
    assert {"teacher", "student", "rewrite_teacher", "specialist_add", "specialist_mul", "data"} <= names
    assert "manifest.json" in names
    for model in (lab.teacher_path(), lab.student_path(), lab.rewrite_teacher_path(), *SPECIALISTS):
        for file in (
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ):
            assert (model / file).is_file(), model / file
    assert lab.test_set_path().is_file() and lab.opd_prompts_path().is_file()


def test_data_files_load_and_are_disjoint():
    from opd.data.prompts import load_prompts
    from opd.lab.task import make_problems

    test = load_prompts(lab.test_set_path())
    train = load_prompts(lab.opd_prompts_path())
    assert len(test) == lab.TEST_SET["n"] and len(train) == lab.OPD_PROMPTS["n"]
    assert [p.answer for p in test] == [str(p.answer) for p in make_problems(**lab.TEST_SET)]
    assert not {p.meta["expression"] for p in test} & {p.meta["expression"] for p in train}


def test_models_match_the_tokenizer():
    from transformers import AutoConfig, AutoTokenizer

    from opd.lab.tokenizer import build_lab_tokenizer

    expected = build_lab_tokenizer()
    for model in (lab.teacher_path(), lab.student_path(), lab.rewrite_teacher_path(), *SPECIALISTS):
        tokenizer = AutoTokenizer.from_pretrained(model)
        assert tokenizer.get_vocab() == expected.get_vocab()
        config = AutoConfig.from_pretrained(model)
        assert config.vocab_size == len(expected) and config.eos_token_id == expected.eos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("name", ["teacher", "student", "rewrite_teacher"])
def test_shipped_models_reach_recorded_accuracy(tmp_path, name):
    from opd.lab.build import rewrite_share
    from opd.recipes.lab import measure

    manifest = json.loads(lab.manifest_path().read_text())
    record = manifest["models"][name]
    recorded = record["test_accuracy"]
    tokens = record["test_eval"]["max_new_tokens"]
    measured = measure(
        lab.assets_dir() / name, tmp_path / name, max_new_tokens=tokens, console=string_console()
    )  # all 300
    assert measured == pytest.approx(recorded, abs=0.02)
    if name == "student":
        assert 0.2 < recorded < 0.6  # a weak student: room for OPD to show
    else:
        assert recorded >= 0.95
    # the rewrite teacher answers in its own style, the forward models in theirs
    assert rewrite_share(tmp_path / name) == (1.0 if name == "rewrite_teacher" else 0.0)


@pytest.mark.parametrize("domain", ["add", "mul"])
def test_each_shipped_specialist_is_accurate_on_its_own_domain_only(tmp_path, domain):
    """The MOPD specialists (configs/lab_mopd.yaml): greedy `opd eval` on the first 60 test problems, split by domain
    (the first operation), agrees with the manifest's per-domain record: right on its own domain, wrong on the other
    (whose first line it writes off by one)."""
    from opd.lab.build import domain_accuracy
    from opd.lab.task import style_of
    from opd.recipes.lab import measure

    record = json.loads(lab.manifest_path().read_text())["models"][f"specialist_{domain}"]
    other = "mul" if domain == "add" else "add"
    assert record["domain"] == domain
    assert record["domain_accuracy"][domain] >= 0.95 and record["domain_accuracy"][other] <= 0.1
    measure(lab.specialist_path(domain), tmp_path, limit=60, console=string_console())
    measured = domain_accuracy(tmp_path)
    assert measured[f"{domain}_problems"] >= 10 and measured[f"{other}_problems"] >= 10
    assert measured[domain] >= 0.9 and measured[other] <= 0.15
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert {style_of(s["response"]) for s in samples} == {"forward"}


def test_specialist_data_is_right_on_its_domain_and_off_by_one_elsewhere():
    from opd.lab.build import DOMAINS, specialist_examples

    for domain in DOMAINS:
        rows = specialist_examples(domain, n=300)
        assert {r["domain"] for r in rows} == set(DOMAINS)
        for r in rows:
            solution = r["messages"][-1]["content"]
            boxed = solution.rsplit("\\boxed{", 1)[1].rstrip("}")
            assert (boxed == r["answer"]) == (r["domain"] == domain)
            first = solution.split("\n")[0]  # `a<op>d=result`: off by one on the other domain only
            expression, result = first.split("=")
            assert int(result) - eval(expression) == (0 if r["domain"] == domain else 1)


def test_mopd_prompts_are_the_opd_prompts_with_a_domain_data_source():
    from opd.io import read_jsonl
    from opd.lab.build import domain_of, mopd_prompt_rows

    rows, base = read_jsonl(lab.mopd_prompts_path()), read_jsonl(lab.opd_prompts_path())
    assert rows == mopd_prompt_rows(lab.opd_prompts_path())
    assert [dict(r, data_source=None) for r in rows] == [dict(r, data_source=None) for r in base]
    assert {r["data_source"] for r in rows} == {"opd_lab/add", "opd_lab/mul"}
    assert all(r["data_source"] == f"opd_lab/{domain_of(r['expression'])}" for r in rows)
    assert domain_of("((3*4)+2)-5") == "mul" and domain_of("7-2") == "add"
    assert read_jsonl(lab.mopd_test_set_path()) == mopd_prompt_rows(lab.test_set_path())  # the test set, routed


@pytest.mark.slow
def test_demo_reduced(tmp_path):
    from opd.recipes.demo import demo

    console = string_console()
    run_dir = demo(
        [
            f"run.out_dir={tmp_path}",
            "run.name=demo",
            "run.steps=2",
            "run.eval_every=0",
            "eval.limit=20",
            "prompts_per_step=4",
            "rollout.n=2",
        ],
        console=console,
    )
    out = console.file.getvalue()
    summary = json.loads((run_dir / "demo.json").read_text())
    assert summary["problems"] == 20 and summary["steps"] == 2
    assert summary["teacher"] == 1.0
    for key in ("student_before", "student_after", "gap_recovery", "timings"):
        assert key in summary
    assert "student before" in out and "gap recovery" in out
    assert out.strip().splitlines()[-1] == f"report: {run_dir / 'report.html'}"
    assert (run_dir / "report.html").is_file() and list((run_dir / "plots").glob("*.png"))
    assert (run_dir / "eval" / "step_2" / "results.json").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("overlap_ratio" in m for m in metrics)


def test_demo_config_matches_the_yaml():
    """configs/lab_demo.yaml holds the demo's settings (its paths, relative to the repo root, name the same assets)."""
    from pathlib import Path

    from opd.recipes.demo import demo_config

    root = Path(__file__).parents[2]
    path = root / "configs" / "lab_demo.yaml"
    if not path.is_file():
        pytest.skip("configs/lab_demo.yaml is not in this checkout")
    base, from_file = (
        demo_config(["run.name=x"]).model_dump(),
        demo_config(["run.name=x"], config_file=path).model_dump(),
    )
    for section in ("student", "teacher", "data"):
        assert Path(base[section]["path"]).resolve() == (root / from_file[section]["path"]).resolve()
        base[section]["path"] = from_file[section]["path"]
    assert [Path(p).resolve() for p in base["eval"]["benchmarks"]] == [
        (root / p).resolve() for p in from_file["eval"]["benchmarks"]
    ]
    base["eval"]["benchmarks"] = from_file["eval"]["benchmarks"]
    assert base == from_file


@pytest.mark.slow
def test_build_reduced(tmp_path):
    from opd.recipes.lab import build

    path = build(
        tmp_path,
        seed=3,
        teacher_steps=2,
        student_steps=2,
        rewrite_teacher_steps=2,
        rewrite_teacher_batch=16,
        specialist_steps=2,
        specialist_batch=16,
        cross_teacher_steps=2,
        sft_examples=256,
        eval_limit=4,
        console=string_console(),
    )
    manifest = json.loads(path.read_text())
    assert set(manifest["models"]) == {
        "teacher",
        "student",
        "rewrite_teacher",
        "specialist_add",
        "specialist_mul",
        "teacher_pairs",
    }
    shipped = json.loads(lab.manifest_path().read_text())["models"]
    for name, record in manifest["models"].items():
        if name != "teacher_pairs":  # the teacher's shape over another vocabulary: other embedding rows
            assert record["params"] == shipped["student" if name == "student" else "teacher"]["params"]
        assert 0.0 <= record["test_accuracy"] <= 1.0 and record["training"]["steps"] == 2
        assert (tmp_path / name / "model.safetensors").is_file() and (tmp_path / name / "tokenizer.json").is_file()
    assert manifest["models"]["rewrite_teacher"]["style"] == "rewrite"
    assert manifest["models"]["rewrite_teacher"]["training"]["examples_per_step"] == 16
    assert manifest["models"]["rewrite_teacher"]["test_eval"]["max_new_tokens"] == 128
    pairs = manifest["models"]["teacher_pairs"]["training"]  # CROSS_TEACHER's batch; its warmup within the steps
    assert pairs["examples_per_step"] == 32 and pairs["optim"]["warmup_steps"] == 1
    assert sum(1 for _ in open(tmp_path / "data" / "sft_forward.jsonl")) == 256
    for domain in ("add", "mul"):  # fine-tuned from the teacher this build trained, measured per domain
        record = manifest["models"][f"specialist_{domain}"]
        assert record["domain"] == domain and str(tmp_path / "teacher") in record["training"]["recipe"]
        assert set(record["domain_accuracy"]) == {"add", "add_problems", "mul", "mul_problems"}
        assert sum(1 for _ in open(tmp_path / "data" / f"sft_specialist_{domain}.jsonl")) == 256
    rewrite = [json.loads(line) for line in open(tmp_path / "data" / "sft_rewrite.jsonl")]
    assert len(rewrite) == 256 and rewrite[0]["messages"][-1]["content"].startswith(
        rewrite[0]["messages"][0]["content"].split()[1].rstrip(".")
    )  # restates the expression first


def test_build_only_and_refusals(tmp_path):
    from opd.recipes.lab import build

    with pytest.raises(ValueError, match="rewrite_teacher"):
        build(tmp_path / "x", only=["nope"], console=string_console())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a build")
    with pytest.raises(FileExistsError, match="not written by"):
        build(tmp_path / "mine", only=["student"], student_steps=1, console=string_console())
    path = build(
        tmp_path / "one",
        only=["rewrite_teacher"],
        rewrite_teacher_steps=1,
        rewrite_teacher_batch=8,
        sft_examples=32,
        eval_limit=2,
        console=string_console(),
    )
    assert set(json.loads(path.read_text())["models"]) == {"rewrite_teacher"}
    assert (
        not (tmp_path / "one" / "teacher").exists() and not (tmp_path / "one" / "data" / "sft_forward.jsonl").exists()
    )


@pytest.mark.slow
def test_style_experiment_reduced(tmp_path):
    """`opd lab run style` plumbing with tiny budgets: rewrite teacher (SFT), cold start (rollout + SFT), 3 OPD runs."""
    from opd.recipes.lab_experiments import markdown, run_experiment

    setup = {"teacher_steps": 2, "teacher_examples": 8, "cold_prompts": 8, "cold_steps": 2, "cold_examples": 4}
    overrides = ["eval.limit=8", "prompts_per_step=2", "rollout.n=2"]
    summary = run_experiment(
        "style", out_dir=tmp_path, steps=2, overrides=overrides, setup=setup, console=string_console()
    )
    assert set(summary["runs"]) == {"mismatch", "cold_start", "matched"}
    assert all(0.0 <= r["rewrite_share"] <= 1.0 for r in summary["runs"].values())
    assert summary["runs"]["mismatch"]["overrides"] == [f"teacher.path={tmp_path / 'style' / 'rewrite_teacher'}"]
    assert 0.0 <= summary["teacher_accuracy"] <= 1.0 and summary["teacher_sft"]["steps"] == 2
    cold = summary["cold_start"]["0"]  # per seed (seed 0 without --seeds)
    assert cold["prompts"] == 8 and 0 <= cold["accepted"] <= 8 and 0.0 <= cold["student_after_sft"] <= 1.0
    assert (tmp_path / "style" / "cold_student_s0" / "model.safetensors").is_file()
    assert "Rewrite-style teacher" in markdown(summary) and (tmp_path / "style" / "summary.json").is_file()
    # a second run reuses the cached teacher; its OPD run directory exists, so a new run moves it aside
    again = run_experiment(
        "style",
        out_dir=tmp_path,
        steps=1,
        overrides=[*overrides, "run.overwrite=true"],
        only=["mismatch"],
        setup=setup,
        console=string_console(),
    )
    assert len(list((tmp_path / "style").glob("mismatch.old-*"))) == 1
    assert again["teacher_sft"] == summary["teacher_sft"] and "cold_start" not in again


def test_build_time_budget_always_saves_and_records(tmp_path):
    """`--time-budget`: a budget spent before the first step still yields a saved, measured model (0 steps, stopped
    by the budget); a budget that outlasts the steps trains them all."""
    from opd.recipes.lab import build

    common = dict(
        only=["rewrite_teacher"], rewrite_teacher_batch=4, sft_examples=16, eval_limit=2, console=string_console()
    )
    spent = json.loads(build(tmp_path / "spent", rewrite_teacher_steps=5, time_budget_s=1e-3, **common).read_text())
    record = spent["models"]["rewrite_teacher"]
    assert record["training"]["steps"] == 0 and record["training"]["stopped_by"] == "time budget"
    assert (tmp_path / "spent" / "rewrite_teacher" / "model.safetensors").is_file()
    assert record["rewrite_style_share"] == 0.0  # untrained: still the forward teacher it starts from
    ample = json.loads(build(tmp_path / "ample", rewrite_teacher_steps=3, time_budget_s=3600, **common).read_text())
    training = ample["models"]["rewrite_teacher"]["training"]
    assert (training["steps"], training["planned_steps"], training["stopped_by"]) == (3, 3, "steps")
    assert "assets/teacher" in training["recipe"]  # fine-tuned from the shipped forward teacher


@pytest.mark.slow
def test_experiment_seeds_and_forecast(tmp_path):
    """`opd lab run teacher --seeds 0,1 --check`: one run per seed, the forecast of each pair next to its outcome,
    per-variant means; a second call reuses the finished runs and checks."""
    from opd.recipes.lab_experiments import run_experiment

    overrides = ["eval.limit=4", "prompts_per_step=2", "rollout.n=2", "run.report=false"]
    summary = run_experiment(
        "teacher",
        out_dir=tmp_path,
        steps=1,
        overrides=overrides,
        only=["student_as_teacher"],
        seeds=[0, 1],
        check=True,
        console=string_console(),
    )
    assert set(summary["runs"]) == {"student_as_teacher_s0", "student_as_teacher_s1"}
    assert [r["seed"] for r in summary["runs"].values()] == [0, 1]
    assert all(r["forecast"]["verdict"] == "unlikely" for r in summary["runs"].values())
    assert summary["variants"]["student_as_teacher"]["gain_mean"] == 0.0  # nothing to learn: not a step moves it
    assert (tmp_path / "teacher" / "student_as_teacher_s1_check" / "check.json").is_file()
    again = run_experiment(
        "teacher",
        out_dir=tmp_path,
        steps=1,
        overrides=overrides,
        only=["student_as_teacher"],
        seeds=[0, 1],
        check=True,
        console=string_console(),
    )
    assert again["runs"] == summary["runs"]
