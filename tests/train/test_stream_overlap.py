"""`rollout.partial` with `rollout.overlap`: the stream's batch for step t+1 is built during step t, in the background,
from a snapshot of the weights at the start of step t (`opd.train.overlap.AheadStream`); its tokens record version t,
their lag is measured against the step that trains them, and the pending batch travels in the checkpoint."""

import copy
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_resume_equals_straight,
    cli,
    distill_config,
    kill9_distill_after_step_2,
    latest_weights,
    without_timing,
)
from opd.io import read_jsonl
from opd.recipes.distill import distill, setup
from opd.teacher.local import LocalScorer
from opd.train.checkpoint import latest_checkpoint, load_trainer_state
from opd.train.overlap import AheadStream
from opd.train.step import sample_rollouts, score_rollouts, step_metrics, step_targets, update_student

ON = (
    "rollout.partial=true",
    "rollout.overlap=true",
    "rollout.max_staleness=2",
    "rollout.partial_segment=2",
    "objective.tis_cap=2.0",
)
ROOT = Path(__file__).parents[2]


def test_versions_lags_and_weights_match_a_reference(world, tmp_path):
    """Every trained token's version is the step whose weights give its stored log-prob; tokens built in the
    background lag 1..max_staleness steps; the loss's truncated weights are exp(ℓ_now − ℓ_stored) clamped at the cap;
    every started sample is trained (the pending batch included), dropped or in flight."""
    cap, staleness = 1.5, 2
    overrides = (*ON[:-1], f"objective.tis_cap={cap}")
    tr = setup(distill_config(world, tmp_path, "optim.lr=3e-2", *overrides, steps=4), tmp_path / "run")
    assert isinstance(tr.engines.ahead, AheadStream) and tr.engines.stream is not None
    device, weights, lags = torch.device("cpu"), {}, set()
    for step in range(4):
        weights[step] = copy.deepcopy(tr.models.student)
        batch = sample_rollouts(tr, {}, device)
        rollouts, versions_BT, mask = batch.rollouts, batch.versions_BT, batch.rollouts.response_mask
        lag_BT = step - versions_BT[mask]
        lags |= set(lag_BT.tolist())
        assert (lag_BT == 0).all() if step == 0 else ((lag_BT >= 1) & (lag_BT <= staleness)).all()
        for v in versions_BT[mask].unique().tolist():
            scorer = LocalScorer(weights[v], max_tokens_per_batch=4096, vocab_size=tr.models.vocab_size)
            lp = scorer.score(rollouts, top_k=0, with_entropy=False).sampled_logprobs
            at_v = mask & (versions_BT == v)
            # the engine's incremental log-probs against a full forward of the same weights: float32 rounding
            assert torch.allclose(lp[at_v], rollouts.rollout_logprobs[at_v], atol=1e-4)
        scores = score_rollouts(tr, batch, {}, device)
        targets = step_targets(tr, batch, scores, device)
        now = LocalScorer(copy.deepcopy(tr.models.student), max_tokens_per_batch=4096, vocab_size=tr.models.vocab_size)
        lp_now = now.score(rollouts, top_k=0, with_entropy=False).sampled_logprobs
        reference = (lp_now - rollouts.rollout_logprobs).exp().clamp_max(cap)
        assert torch.allclose(targets.tis_weights[mask], reference[mask], rtol=1e-4, atol=1e-6)
        result = update_student(tr, rollouts, targets, {}, device)
        tr.engines.ahead.wait()
        metrics = step_metrics(tr, batch, scores, targets, result, {})
        assert metrics["partial/max_lag"] <= staleness and metrics["policy_lag"] == metrics["partial/max_lag"]
        assert metrics["partial/trained_total"] == (step + 1) * 4  # 2 prompts × 2 samples a step
        counted = metrics["partial/trained_total"] + metrics["partial/dropped_total"] + metrics["partial/in_flight"]
        assert metrics["partial/started_total"] == counted
        stream = tr.engines.stream
        assert stream.started == stream.trained + stream.dropped + stream.in_flight  # the pending batch: trained
        tr.run.step += 1
    assert lags >= {0, 1, 2}  # tokens of every allowed lag were trained: the checks above are not vacuous


def test_resume_is_bit_identical(world, tmp_path):
    """The stream after the background build and the pending batch travel in the trainer state."""
    common = ("optim.lr=3e-2", *ON, "run.save_every=2")
    straight = distill(distill_config(world, tmp_path / "a", *common, steps=4))
    distill(distill_config(world, tmp_path / "b", *common, steps=2))
    state = load_trainer_state(latest_checkpoint(tmp_path / "b" / "run"))
    pending = state["pending_rollouts"]
    # step 2's batch, built during step 1: its tokens lag 1 (step-1 weights) or 2 (continued from step 0)
    assert pending["versions"] and all(2 - v in (1, 2) for row in pending["versions"] for v in row)
    resumed = distill(distill_config(world, tmp_path / "b", *common, "run.resume=true", steps=4))
    a, b = latest_weights(straight), latest_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [without_timing(m) for m in ma] == [without_timing(m) for m in mb]
    assert [m["policy_lag"] for m in mb][1:] != [0] * 3


def test_kill9_resumes_exactly(capsys, world, tmp_path):
    """kill -9 of `opd distill` at some moment after a checkpoint (mid-step, mid-build in the background, mid-save),
    then `--resume`: the weights and every step's metrics equal an uninterrupted run's."""
    yaml_path, delay, checkpoint = kill9_distill_after_step_2(world, tmp_path, "optim.lr=3e-2", *ON)
    state = load_trainer_state(checkpoint)
    assert state["pending_rollouts"]["indices"], (delay, checkpoint)  # the next step's batch, built ahead
    samples = state["partial_stream"]["samples"]
    assert any(s["tokens"] and s["finish"] is None for s in samples), (delay, checkpoint, samples)
    steps = int(checkpoint.name.split("_")[1]) + 2
    assert_resume_equals_straight(capsys, world, tmp_path, yaml_path, steps, "optim.lr=3e-2", *ON, note=delay)


def test_lab_distill_runs_end_to_end(capsys, monkeypatch, tmp_path):
    """`opd distill -c configs/lab_demo.yaml` with both options, reduced: every step logs the stream's metrics and
    the wait for the background build; from step 2 on the trained tokens come from earlier weights."""
    if not (ROOT / "configs" / "lab_demo.yaml").is_file():
        pytest.skip("configs/lab_demo.yaml is not in this checkout")
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repo root
    reduced = (
        f"run.out_dir={tmp_path}",
        "run.name=lab",
        "run.steps=3",
        "run.eval_every=0",
        "eval.benchmarks=[]",
        "run.report=false",
        "prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        "rollout.partial_segment=4",
    )
    on = ("rollout.partial=true", "rollout.overlap=true", "rollout.max_staleness=2", "objective.tis_cap=2.0")
    code, _, err = cli(capsys, "distill", "-c", "configs/lab_demo.yaml", *reduced, *on)
    assert code == 0, err
    metrics = read_jsonl(tmp_path / "lab" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert "time/rollout_wait" in m and "partial/calls" in m and "partial/is_weight_min" in m
        assert sum(m[f"partial/lag_{k}_frac"] for k in range(3)) == pytest.approx(1.0)
        assert (
            m["partial/started_total"]
            == m["partial/trained_total"] + m["partial/dropped_total"] + m["partial/in_flight"]
        )
    assert metrics[0]["policy_lag"] == 0 and all(m["partial/lag_0_frac"] == 0 for m in metrics[1:])


def test_max_staleness_one_accepted(world, tmp_path):
    config = distill_config(world, tmp_path, *ON[:2], "rollout.max_staleness=1", "objective.tis_cap=2.0")
    assert config.rollout.partial and config.rollout.overlap and config.rollout.max_staleness == 1
