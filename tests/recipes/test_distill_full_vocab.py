"""`opd distill` with the exact full-vocabulary objectives (objective.loss=full_*, and the policy gradient on the
exact per-position KL) end to end on the tiny world: the teacher answers with hidden states, the loss is computed
chunk by chunk from both heads, the metrics carry the answer's bytes and the head's memory; and the trainer's
full-vocabulary loss equals the dense float64 reverse KL of the two models' own logits."""

from __future__ import annotations

import pytest
import torch

from helpers import distill_config
from opd.io import read_jsonl
from opd.recipes.distill import distill


@pytest.mark.parametrize(
    "overrides",
    [
        ["objective.loss=full_reverse_kl"],
        ["objective.loss=full_forward_kl", "teacher_offload=true"],
        ["objective.loss=full_jsd", "objective.jsd_beta=0.3", "objective.entropy_coef=0.01"],
        ["objective.loss=full_reverse_kl", "objective.kl_coef=0.1", "objective.top_k=0"],
        ["objective.token_reward=full_reverse_kl_next", "objective.top_k=0"],
        ["objective.token_reward=full_reverse_kl", "objective.top_k=0"],
        ["teacher.answer=hidden"],  # the paper's top-k objective, its scores computed here from hidden states
    ],
    ids=lambda o: ",".join(x.split(".", 1)[-1] for x in o),
)
def test_full_vocabulary_objectives_train(world, tmp_path, overrides, capsys):
    run_dir = distill(distill_config(world, tmp_path, *overrides))
    assert "hidden_scores pass" in capsys.readouterr().out  # the startup check of the hidden-state answer
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 2 and last["grad_norm"] > 0
    assert last["teacher/bytes_per_token"] > 0
    loss = next(o.split("=")[1] for o in [*overrides, "objective.loss=pg"] if o.startswith("objective.loss="))
    if loss.startswith("full_"):
        assert last[f"{loss}_loss"] > 0
        assert last["teacher/head_bytes"] > 0


def test_hidden_answer_trains_as_the_scores_answer(world, tmp_path):
    """answer=hidden computes the teacher's scores here from its hidden states (float32 on CPU): the same run as
    answer=scores up to float32 rounding of the reordered sums (1e-5 on the reward)."""
    scores = read_jsonl(distill(distill_config(world, tmp_path / "a", "teacher.answer=scores")) / "metrics.jsonl")
    hidden = read_jsonl(distill(distill_config(world, tmp_path / "b", "teacher.answer=hidden")) / "metrics.jsonl")
    for a, b in zip(scores, hidden):
        assert abs(a["reward_mean"] - b["reward_mean"]) < 1e-5
        assert a["teacher/bytes_per_token"] == 4 * (1 + 16 + 16 + 1) + 4 * 16  # sampled, top-16, requested, entropy
        assert "teacher/head_bytes" not in a and b["teacher/head_bytes"] > 0


@pytest.mark.slow
def test_full_loss_resumes_bit_identical_and_its_manifest_names_the_head(world, tmp_path):
    from helpers import latest_weights

    loss = "objective.loss=full_jsd"
    straight = distill(distill_config(world, tmp_path / "a", loss, "run.save_every=2", steps=4))
    distill(distill_config(world, tmp_path / "b", loss, "run.save_every=2", steps=2))
    resumed = distill(distill_config(world, tmp_path / "b", loss, "run.save_every=2", "run.resume=true", steps=4))
    a, b = latest_weights(straight), latest_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(resumed / "checkpoints" / "step_4" / "trainer_state.pt", weights_only=False)
    assert state["teachers"][0]["head"].startswith("sha256:")  # checked on resume (check_teacher_manifest)
