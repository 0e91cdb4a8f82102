"""`rollout.overlap`: step t+1's rollouts are generated during step t from a snapshot of the step-t weights (one step
of policy lag), and step t+1 corrects them with truncated importance weights against the engine's log-probs. Off, a
step samples from its own weights as before."""

import copy

import pytest
import torch

from helpers import distill_config, distill_toward_a_trained_teacher
from opd.recipes.distill import setup
from opd.rollout import SamplingParams
from opd.rollout.batch import build_rollouts
from opd.rollout.torch_engine import TorchGenerator
from opd.teacher.local import LocalScorer
from opd.train.step import _sampling_params, opd_step


def _trainer(world, tmp_path, *overrides, steps=3):
    cfg = distill_config(world, tmp_path, "optim.lr=3e-2", *overrides, steps=steps)
    return setup(cfg, tmp_path / "run")


def _generate(model, tr, prompt_ids, params: SamplingParams):
    engine = TorchGenerator(
        model,
        eos_token_ids=tr.engines.generator.eos_token_ids,
        pad_token_id=tr.engines.generator.pad_token_id,
        vocab_size=tr.models.vocab_size,
        max_batch_size=tr.config.rollout.batch_size,
    )
    return engine.generate(prompt_ids, params)


def test_off_samples_each_step_from_its_own_weights(world, tmp_path):
    """Off (the default): no snapshot is kept, the lag is 0, and step t's rollouts are exactly what the engine
    samples with step t's seed from the weights at the start of step t (replayed here on a copy)."""
    tr = _trainer(world, tmp_path, "objective.tis_cap=2.0")
    assert not tr.config.rollout.overlap and tr.engines.rollout_model is None and tr.engines.rollout_generator is None
    calls = []
    real_generate = tr.engines.generator.generate

    def recording(prompt_ids, params):
        out = real_generate(prompt_ids, params)
        calls.append((prompt_ids, params, out))
        return out

    tr.engines.generator.generate = recording
    for step in range(2):
        start = copy.deepcopy(tr.models.student)
        metrics = opd_step(tr)
        assert metrics["policy_lag"] == 0 and tr.pending_rollouts is None
        prompt_ids, params, out = calls[step]
        assert params == _sampling_params(tr.config, step, 0)
        replay = _generate(start, tr, prompt_ids, params)
        assert replay.response_ids == out.response_ids and replay.logprobs == out.logprobs
        # the engine and the trainer's scorer see the same weights: importance weights are 1 up to rounding
        assert abs(metrics["is_weight_mean"] - 1) < 1e-4 and metrics["is_weight_capped_frac"] == 0
        tr.run.step += 1


def test_overlap_lags_one_step_and_weights_against_the_previous_policy(world, tmp_path):
    """On: step 0 samples now (lag 0) and generates step 1's rollouts from the step-0 weights in the background; step
    1 trains on them (lag 1) with importance weights exp(ℓ_θ1 − ℓ_θ0) of the sampled tokens, truncated at the cap.
    The learning rate is large so that θ1 visibly differs from θ0."""
    tr = _trainer(world, tmp_path, "rollout.overlap=true", "objective.tis_cap=1.5")
    assert tr.engines.rollout_model is not None
    theta0 = copy.deepcopy(tr.models.student)
    first = opd_step(tr)
    tr.run.step += 1
    assert first["policy_lag"] == 0
    pending = tr.pending_rollouts
    assert pending is not None
    prompt_ids = [tr.data.prompt_ids[i] for i in pending.indices]
    replay = _generate(theta0, tr, prompt_ids, _sampling_params(tr.config, 1, 0))  # step 1's seed, θ0's weights
    assert replay.response_ids == pending.output.response_ids and replay.logprobs == pending.output.logprobs

    theta1 = copy.deepcopy(tr.models.student)
    assert any(not torch.equal(a, b) for a, b in zip(theta0.parameters(), theta1.parameters()))
    second = opd_step(tr)
    assert second["policy_lag"] == 1
    rollouts = build_rollouts(prompt_ids, pending.output, pad_id=tr.models.tokenizer.pad_token_id)
    mask = rollouts.response_mask
    scorer = LocalScorer(theta1, max_tokens_per_batch=4096, vocab_size=tr.models.vocab_size)
    lp_theta1 = scorer.score(rollouts, top_k=0, with_entropy=False).sampled_logprobs
    raw = (lp_theta1 - rollouts.rollout_logprobs).exp()
    # float32 scorer vs the same scorer on a copy: identical up to the order of a few reductions
    assert second["is_weight_mean"] == pytest.approx(float(raw.clamp_max(1.5)[mask].mean()), abs=1e-5)
    assert second["is_weight_max"] == pytest.approx(float(raw[mask].max()), rel=1e-4)
    assert second["is_weight_capped_frac"] == pytest.approx(float((raw[mask] > 1.5).float().mean()), abs=1e-6)
    # against θ0 (what a lag-0 step would see) the weights would all be ~1: the check above is not vacuous
    assert abs(second["is_weight_mean"] - 1) > 1e-3


def test_overlap_needs_tis_cap(world, tmp_path):
    with pytest.raises(ValueError, match="objective.tis_cap") as error:
        _trainer(world, tmp_path, "rollout.overlap=true")
    assert "\n" not in str(error.value)


def test_overlap_resume_is_bit_identical(world, tmp_path):
    """The pending rollouts (generated from weights that no checkpoint holds) travel in the trainer state."""
    from helpers import latest_weights
    from opd.io import read_jsonl
    from opd.recipes.distill import distill

    on = ("rollout.overlap=true", "objective.tis_cap=2.0", "run.save_every=2")
    straight = distill(distill_config(world, tmp_path / "a", *on, steps=4))
    distill(distill_config(world, tmp_path / "b", *on, steps=2))
    resumed = distill(distill_config(world, tmp_path / "b", *on, "run.resume=true", steps=4))
    a, b = latest_weights(straight), latest_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    lags = [m["policy_lag"] for m in read_jsonl(resumed / "metrics.jsonl")]
    assert lags == [0, 1, 1, 1]


@pytest.mark.slow
def test_overlap_still_moves_the_student_toward_the_teacher(world, tmp_path):
    """The learning check of test_distill (20 steps, reverse KL to the teacher at least halves), with overlap on."""
    before, after = distill_toward_a_trained_teacher(world, tmp_path, "rollout.overlap=true", "objective.tis_cap=2.0")
    assert after < 0.5 * before, (before, after)


@pytest.mark.slow
def test_snapshot_of_a_compiled_student_runs_its_own_weights():
    """`opd distill` compiles the student's layers in place; the rollout snapshot must run its own weights, not the
    live student's through a shared compiled forward."""
    from helpers import make_tiny_model
    from opd.models import compile_layers
    from opd.train.overlap import rollout_snapshot

    student = make_tiny_model("qwen3")
    compile_layers(student, True, backend="aot_eager")
    snapshot = rollout_snapshot(student, torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(snapshot(ids).logits, student(ids).logits, atol=1e-5)
        for p in snapshot.model.layers.parameters():
            p.mul_(0.5)
        assert not torch.allclose(snapshot(ids).logits, student(ids).logits, atol=1e-3)
        ref = make_tiny_model("qwen3")  # an uncompiled model with the halved layer weights agrees with the snapshot
        for p in ref.model.layers.parameters():
            p.mul_(0.5)
        assert torch.allclose(snapshot(ids).logits, ref(ids).logits, atol=1e-5)
