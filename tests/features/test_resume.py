"""Resuming a run, through its command line: nothing lost, nothing mixed (what writes state and locks its directory:
test_run_safety.py).

- `--resume` refuses a changed config unless `--allow-config-change`, and keeps the earlier config as
  config.step_N.yaml;
- checkpoints carry a manifest (sizes, sha256); a truncated or corrupt newest checkpoint is skipped with a warning;
- `kill -9` in the middle of each of distill, sft, eval, rollout and prompts score, then the same command again:
  the result equals an uninterrupted run.
- what a resume restores is what runs (a changed optimizer or learning rate runs the new values, a prompt file
  regenerated in place or changed training data refuses, a run without a verifiable checkpoint is an error).

The kill tests start the real CLI as a subprocess (one torch thread, like the in-process runs, so that both compute
exactly the same), stop it mid-run (SIGSTOP: it keeps its lock), run the same command in this process through the
CLI's `main()` (refused: the lock), kill -9 the subprocess and rerun in-process. The other tests call `main()`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (
    SFT_QA,
    assert_same_weights,
    chat,
    cli,
    distill_config,
    dump,
    eval_args,
    interrupt_with_a_second_process,
    make_prompts,
    one_line,
    score_config,
    sft_config,
    snapshot,
    start,
    tiny_rollout_config,
    wait_for,
    write_jsonl,
    write_prompts,
)
from opd.io import LOCK_FILE, read_jsonl
from opd.recipes.distill import distill
from opd.recipes.sft import sft
from opd.train.checkpoint import MANIFEST, latest_checkpoint, verify_checkpoint


@pytest.fixture(scope="module", autouse=True)
def progress_bars_off_as_opd_leaves_them():
    """transformers' progress bars off, as `opd`'s `main()` leaves them for the rest of the process (where these tests
    were, in test_run_safety.py, the module's first command had done it): a test that runs `distill()` before its
    first command reads only the command's stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# ------------------------------------------------------------------------------------- 6. resume config check


def test_resume_with_a_changed_objective_refuses_naming_each_key(capsys, world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    saved = (run_dir / "config.yaml").read_text()
    yaml_path = dump(distill_config(world, tmp_path, "objective.top_k=4", "rollout.n=3", steps=2), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert "objective.top_k: 16 → 4" in line and "rollout.n: 2 → 3" in line and "--allow-config-change" in line
    assert (run_dir / "config.yaml").read_text() == saved and len(read_jsonl(run_dir / "metrics.jsonl")) == 1

    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err
    assert (run_dir / "config.step_1.yaml").read_text() == saved  # the settings of steps 1..1
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["objective"]["top_k"] == 4


def test_resume_may_extend_a_run_and_keeps_the_config_history(capsys, world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    saved = (run_dir / "config.yaml").read_text()
    yaml_path = dump(distill_config(world, tmp_path, "run.save_every=7", "eval.n=3", steps=2), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert (run_dir / "config.step_1.yaml").read_text() == saved
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]


def test_resume_cannot_go_back(capsys, world, tmp_path):
    distill(distill_config(world, tmp_path, steps=2))
    yaml_path = dump(distill_config(world, tmp_path, steps=1), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert "run.steps=1" in line and "step_2" in line


def test_sft_resume_with_another_learning_rate_refuses(capsys, tmp_path, tiny_model_dir, sft_data):
    sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=s"))
    yaml_path = dump(
        sft_config(
            tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s", "optim.lr=0.5", "examples_per_step=2"
        ),
        tmp_path / "c.yaml",
    )
    line = one_line(*cli(capsys, "sft", "--config", yaml_path, "--resume")[::2])
    assert "optim.lr: 1e-05 → 0.5" in line and "examples_per_step: 4 → 2" in line
    code, _, err = cli(capsys, "sft", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err


# ------------------------------------------------------------------------------------- 7. checkpoint manifests


def test_manifest_lists_every_file_with_size_and_hash(world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    checkpoint = run_dir / "checkpoints" / "step_1"
    manifest = json.loads((checkpoint / MANIFEST).read_text())["files"]
    assert set(manifest) == {p.name for p in checkpoint.iterdir()} - {MANIFEST}
    assert manifest["model.safetensors"]["bytes"] == (checkpoint / "model.safetensors").stat().st_size
    assert len(manifest["trainer_state.pt"]["sha256"]) == 64


@pytest.mark.parametrize("damage", ["truncate_weights", "flip_state_byte", "remove_state"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(capsys, world, tmp_path, damage):
    straight = distill(distill_config(world, tmp_path / "a", "run.save_every=2", steps=4))
    run_dir = distill(distill_config(world, tmp_path / "b", "run.save_every=2", steps=4))
    newest = run_dir / "checkpoints" / "step_4"
    if damage == "truncate_weights":
        with open(newest / "model.safetensors", "r+b") as handle:
            handle.truncate(1000)
    elif damage == "flip_state_byte":  # same size: only the sha256 sees it
        data = bytearray((newest / "trainer_state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "trainer_state.pt").write_bytes(bytes(data))
    else:
        (newest / "trainer_state.pt").unlink()
    yaml_path = dump(distill_config(world, tmp_path / "b", "run.save_every=2", steps=4), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert "step_4 is incomplete or corrupt" in out and "resumed from" in out and "step_2" in out
    assert_same_weights(straight / "checkpoints" / "step_4", newest)
    assert verify_checkpoint(newest, hashes=True) is None


def test_checkpoint_without_a_manifest_still_resumes(capsys, world, tmp_path):
    """Checkpoints written before manifests existed: COMPLETE marker + trainer state, accepted unverified."""
    straight = distill(distill_config(world, tmp_path / "a", steps=2))
    run_dir = distill(distill_config(world, tmp_path / "b", steps=1))
    (run_dir / "checkpoints" / "step_1" / MANIFEST).unlink()
    assert latest_checkpoint(run_dir).name == "step_1"
    yaml_path = dump(distill_config(world, tmp_path / "b", steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0 and "resumed from" in out, err
    assert_same_weights(straight / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_2")


# ------------------------------------------------------------------------- 8. kill -9 and a second process


@pytest.mark.slow
def test_distill_kill9_resumes_exactly_and_refuses_a_second_process(capsys, world, tmp_path):
    # a long run (constant lr: its length does not change the steps it makes), killed after its first checkpoint,
    # then resumed to 6 steps: equal to a straight 6-step run
    yaml_path = dump(
        distill_config(world, tmp_path, "run.save_every=2", "run.keep_last=null", steps=500), tmp_path / "c.yaml"
    )
    run_dir, log = tmp_path / "run", tmp_path / "a.log"
    a = start(log, "distill", "--config", yaml_path)
    wait_for(a, lambda: (run_dir / "checkpoints" / "step_2").is_dir(), log, "the first checkpoint")
    interrupt_with_a_second_process(capsys, run_dir, a, "distill", "--config", yaml_path, "--resume")
    steps = max(6, int(latest_checkpoint(run_dir).name.split("_")[1]) + 2)
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", f"run.steps={steps}")
    assert code == 0, err
    assert f"lock left by pid {a.pid}" in out
    straight = distill(distill_config(world, tmp_path / "ref", "run.save_every=2", steps=steps))
    assert_same_weights(straight / "checkpoints" / f"step_{steps}", run_dir / "checkpoints" / f"step_{steps}")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["reward_mean"] == read_jsonl(straight / "metrics.jsonl")[-1]["reward_mean"]
    assert not list((run_dir / "checkpoints").glob(".*")) and not (run_dir / LOCK_FILE).exists()


@pytest.mark.slow
def test_sft_kill9_resumes_exactly_and_refuses_a_second_process(capsys, tmp_path, tiny_model_dir, sft_data):
    common = [
        "run.save_every=2",
        "run.keep_last=null",
        "optim.schedule=constant",
        "optim.warmup_ratio=0",
        "optim.lr=1e-2",
    ]
    yaml_path = dump(
        sft_config(tmp_path, tiny_model_dir, sft_data, *common, "run.steps=500", "run.name=s"), tmp_path / "c.yaml"
    )
    run_dir, log = tmp_path / "runs" / "s", tmp_path / "a.log"
    a = start(log, "sft", "--config", yaml_path)
    wait_for(a, lambda: (run_dir / "checkpoints" / "step_2").is_dir(), log, "the first checkpoint")
    interrupt_with_a_second_process(capsys, run_dir, a, "sft", "--config", yaml_path)
    steps = max(6, int(latest_checkpoint(run_dir).name.split("_")[1]) + 2)
    code, _, err = cli(capsys, "sft", "--config", yaml_path, "--resume", f"run.steps={steps}")
    assert code == 0, err
    straight = sft(sft_config(tmp_path, tiny_model_dir, sft_data, *common, f"run.steps={steps}", "run.name=ref"))
    assert_same_weights(straight / "checkpoints" / f"step_{steps}", run_dir / "checkpoints" / f"step_{steps}")
    losses = [[m["loss"] for m in read_jsonl(d / "metrics.jsonl")] for d in (straight, run_dir)]
    assert losses[0] == losses[1] and len(losses[0]) == steps


@pytest.mark.slow
def test_eval_kill9_rerun_is_identical_and_refuses_a_second_process(capsys, tmp_path, tiny_model_dir):
    rows = [{"problem": f"What is {i} + {i}? Put the answer in \\boxed{{}}.", "answer": str(2 * i)} for i in range(16)]
    problems = write_jsonl(tmp_path / "toy.jsonl", rows)
    out, log = tmp_path / "out", tmp_path / "a.log"
    args = eval_args(tiny_model_dir, problems, out)
    a = start(log, *args)
    wait_for(
        a,
        lambda: (out / "samples.jsonl").is_file() and (out / "samples.jsonl").stat().st_size > 0,
        log,
        "the first graded chunk",
    )
    interrupt_with_a_second_process(capsys, out, a, *args)
    code, _, err = cli(capsys, *args)
    assert code == 0, err
    code, _, err = cli(capsys, *eval_args(tiny_model_dir, problems, tmp_path / "ref"))  # uninterrupted, in-process
    assert code == 0, err
    key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
    resumed, straight = read_jsonl(out / "samples.jsonl"), read_jsonl(tmp_path / "ref" / "samples.jsonl")
    assert {key(r): r["response"] for r in resumed} == {key(r): r["response"] for r in straight}
    assert len({key(r) for r in resumed}) == 32
    results = [json.loads((d / "results.json").read_text())["benchmarks"] for d in (out, tmp_path / "ref")]
    assert results[0] == results[1]


@pytest.mark.slow
def test_rollout_kill9_rerun_is_identical_and_refuses_a_second_process(capsys, tmp_path, tiny_model_dir):
    prompts = write_prompts(tmp_path / "many.jsonl", 12)
    config = tiny_rollout_config(tmp_path, tiny_model_dir, "out", **{"data.path": str(prompts)})
    yaml_path, out, log = dump(config, tmp_path / "c.yaml"), tmp_path / "out", tmp_path / "a.log"
    a = start(log, "rollout", "--config", yaml_path)
    shard = out / "shards" / "rank_0.jsonl"
    wait_for(a, lambda: shard.is_file() and shard.stat().st_size > 0, log, "the first batch")
    interrupt_with_a_second_process(capsys, out, a, "rollout", "--config", yaml_path)
    code, stdout, err = cli(capsys, "rollout", "--config", yaml_path)
    assert code == 0 and "resuming" in stdout, err
    reference = dump(
        tiny_rollout_config(tmp_path, tiny_model_dir, "ref", **{"data.path": str(prompts)}), tmp_path / "r.yaml"
    )
    code, _, err = cli(capsys, "rollout", "--config", reference)  # uninterrupted, in-process
    assert code == 0, err
    for name in ("rollouts.jsonl", "rejected.jsonl"):
        assert read_jsonl(out / name) == read_jsonl(tmp_path / "ref" / name), name
    assert len(read_jsonl(out / "rejected.jsonl")) == 24


@pytest.mark.slow
def test_prompts_score_kill9_rerun_is_identical_and_refuses_a_second_process(tmp_path, model_dirs, capsys):
    # capsys after model_dirs: its setup (transformers' "Writing model shards" bars, on when no `opd` ran before in
    # this process) is not read as the commands' output
    from opd.data.prompts import save_prompts

    data = save_prompts(make_prompts(12), tmp_path / "set.jsonl")
    out, log = tmp_path / "scores" / "scores.jsonl", tmp_path / "a.log"
    yaml_path = dump(score_config(model_dirs, data, out), tmp_path / "c.yaml")
    a = start(log, "prompts", "score", "--config", yaml_path)
    wait_for(a, lambda: out.is_file() and out.stat().st_size > 0, log, "the first scored batch")
    interrupt_with_a_second_process(capsys, out.parent, a, "prompts", "score", "--config", yaml_path)
    code, _, err = cli(capsys, "prompts", "score", "--config", yaml_path)
    assert code == 0, err
    ref = tmp_path / "ref" / "scores.jsonl"
    code, _, err = cli(
        capsys, "prompts", "score", "--config", dump(score_config(model_dirs, data, ref), tmp_path / "r.yaml")
    )
    assert code == 0, err
    assert read_jsonl(out) == read_jsonl(ref) and len(read_jsonl(out)) == 12


# ---------------------------------------------------------------- issue 22: what a resume restores is what runs


def _optimizer_groups(checkpoint: Path) -> list[dict]:
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
    return [{k: v for k, v in g.items() if k != "params"} for g in state["optimizer"]["param_groups"]]


def test_resume_with_a_changed_optimizer_runs_the_new_values(capsys, world, tmp_path):
    """--allow-config-change optim.lr=… (and weight decay, betas): config.yaml says it, so the optimizer runs it."""
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    changed = ("optim.lr=0.1", "optim.weight_decay=0.3", "optim.betas=[0.8,0.99]", "optim.eps=1e-6")
    yaml_path = dump(distill_config(world, tmp_path, *changed, steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err
    assert "optim.lr: 0.001 → 0.1" in out and "optim.weight_decay: 0.01 → 0.3" in out
    decay, no_decay = _optimizer_groups(run_dir / "checkpoints" / "step_2")
    assert decay["lr"] == decay["initial_lr"] == 0.1 and no_decay["lr"] == 0.1
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert tuple(decay["betas"]) == (0.8, 0.99) and decay["eps"] == 1e-6
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-3, 0.1]


def test_sft_resume_with_a_changed_lr_runs_it(capsys, tmp_path, tiny_model_dir, sft_data):
    flat = ("optim.schedule=constant", "optim.warmup_ratio=0")
    sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=s", *flat))
    yaml_path = dump(
        sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s", "optim.lr=0.5", *flat),
        tmp_path / "c.yaml",
    )
    code, _, err = cli(capsys, "sft", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err
    run_dir = tmp_path / "runs" / "s"
    assert [g["lr"] for g in _optimizer_groups(run_dir / "checkpoints" / "step_2")] == [0.5, 0.5]
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-5, 0.5]


def test_logged_lr_is_the_one_the_step_used(world, tmp_path):
    """With warmup the first step runs at lr/warmup: metrics.jsonl says so (not the next step's lr)."""
    run_dir = distill(distill_config(world, tmp_path, "optim.warmup_steps=4", steps=2))
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-3 / 4, 2e-3 / 4]


def test_sft_logged_lr_is_the_one_the_step_used(tmp_path, tiny_model_dir, sft_data):
    run_dir = sft(
        sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "optim.warmup_steps=2", "optim.schedule=constant")
    )
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-5 / 2, 1e-5]


def test_resume_refuses_a_prompt_file_regenerated_in_place(capsys, world, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text((world / "prompts.jsonl").read_text())
    run_dir = distill(distill_config(world, tmp_path, f"data.path={data}", steps=1))
    metrics = (run_dir / "metrics.jsonl").read_text()
    rows = [{"prompt": f"{i}*{i}=", "answer": str(i * i)} for i in range(6)]  # the same row count
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml_path = dump(distill_config(world, tmp_path, f"data.path={data}", steps=2), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert str(data) in line and "changed" in line and "--allow-config-change" in line
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0 and "continuing on the new data" in out, err


def test_sft_resume_refuses_changed_training_data(capsys, tmp_path, tiny_model_dir, sft_data):
    sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=s"))
    rows = [{"messages": chat(q, a + "!")} for q, a in SFT_QA * 3]
    sft_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml_path = dump(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s"), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "sft", "--config", yaml_path, "--resume")[::2])
    assert str(sft_data) in line and "changed" in line


@pytest.mark.parametrize("damage", ["remove_checkpoints", "corrupt_only_checkpoint"])
def test_resume_without_a_verifiable_checkpoint_is_an_error(capsys, world, tmp_path, damage):
    run_dir = distill(distill_config(world, tmp_path, "run.keep_last=1", steps=1))
    if damage == "remove_checkpoints":
        shutil.rmtree(run_dir / "checkpoints")
    else:
        (run_dir / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"damaged")
    before = snapshot(run_dir)
    yaml_path = dump(distill_config(world, tmp_path, "run.keep_last=1", steps=2), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    line = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert code == 2 and "Traceback" not in err and "no checkpoint that verifies" in line and str(run_dir) in line
    assert snapshot(run_dir) == before  # metrics.jsonl and samples/ untouched


def test_resume_of_a_run_not_started_yet_starts_it(capsys, world, tmp_path):
    yaml_path = dump(distill_config(world, tmp_path, steps=1), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0 and "holds no run yet" in out, err


def test_consecutive_skipped_steps_stop_the_run(capsys, world, tmp_path):
    """Every step skipped for a non-finite gradient norm: an error after optim.max_skipped_steps, not exit 0."""
    yaml_path = dump(
        distill_config(world, tmp_path, "optim.lr=1e30", "optim.max_skipped_steps=2", steps=6), tmp_path / "c.yaml"
    )
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--skip-check", "all")
    line = one_line(code, err)
    assert "consecutive steps skipped" in line and "optim.max_skipped_steps=2" in line


def test_settings_that_do_not_change_the_math_are_resumable(capsys, world, tmp_path):
    distill(distill_config(world, tmp_path, steps=1))
    yaml_path = dump(distill_config(world, tmp_path, "skip_checks=[forecast]", steps=2), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--skip-check", "forecast")
    assert code == 0, err


@pytest.mark.slow
def test_a_run_that_ends_on_skipped_steps_fails_in_one_line(capsys, world, tmp_path):
    """optim.lr=1e30: step 1's update makes the weights non-finite, every later step is skipped — fewer than
    optim.max_skipped_steps (10), so nothing stopped the run; it must still not exit 0. Resumed for one more step,
    every step of the resumed run is skipped: the same."""
    yaml_path = dump(distill_config(world, tmp_path, "optim.lr=1e30", steps=3), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--skip-check", "all")
    line = one_line(code, err)
    assert "the run ended with its last 2 steps (2..3) skipped for a non-finite gradient norm" in line
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 3  # what it wrote stays
    yaml_path = dump(distill_config(world, tmp_path, "optim.lr=1e30", steps=4), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--skip-check", "all", "--resume")
    assert "the run ended with every step of this run (4..4) skipped" in one_line(code, err)
