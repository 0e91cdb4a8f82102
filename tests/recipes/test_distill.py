"""`opd distill` end to end on tiny random models: every strategy and advantage mode, startup checks, exact resume,
crash-safe checkpoints, agreement of the trainer's chunked scores with the dense SPEC §8 API, and learning."""

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import (
    distill_config,
    distill_toward_a_trained_teacher,
    latest_weights,
    make_tiny_model,
    make_tiny_tokenizer,
    without_timing,
)
from opd.io import read_jsonl
from opd.recipes.distill import distill
from opd.report.gpu_busy import GpuBusy
from opd.train.checkpoint import latest_checkpoint


@pytest.mark.parametrize(
    "overrides",
    [
        ["objective.strategy=only_stu"],
        ["objective.strategy=only_tch", "objective.weight=teacher_p"],
        ["objective.strategy=intersection", "objective.weight=none"],
        ["objective.strategy=union"],
        ["objective.strategy=union-intersection"],
        ["objective.top_k=0"],
        ["objective.advantage=token_reward+grpo"],
        ["objective.advantage=token_reward+grpo", "objective.top_k=0"],
        ["objective.advantage=token_grpo", "objective.top_k=0"],
        ["objective.loss_agg_mode=seq-mean-token-sum-norm"],
    ],
    ids=lambda o: ",".join(x.split(".", 1)[1] for x in o),
)
def test_every_mode_runs_and_writes_the_run_dir(world, tmp_path, overrides):
    run_dir = distill(distill_config(world, tmp_path, *overrides))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in (
        "reward_mean",
        "grad_norm",
        "overlap_ratio",
        "overlap_mass_student",
        "overlap_mass_teacher",
        "overlap_advantage",
        "entropy_student",
        "entropy_teacher",
        "entropy_gap",
        "response_length",
        "truncation_rate",
        "rollout_accuracy",
        "time/rollout",
        "time/teacher",
        "time/update",
        "tokens_per_second",
    ):
        assert metrics[-1][key] is not None, key
    assert 0.0 <= metrics[-1]["overlap_ratio"] <= 1.0
    assert "gpu/busy_frac" not in metrics[-1]  # NVML's samples: CUDA only (benchmarks/check_cuda.py, gpu_busy)
    assert GpuBusy.open(torch.device("cpu")) is None
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "samples" / "step_2.jsonl").exists()
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint.name == "step_2"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "tokenizer_config.json").exists()


def test_grpo_baseline_needs_no_teacher(world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, "objective.advantage=grpo", "objective.top_k=0", teacher=False))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert "rollout_accuracy" in metrics[-1] and "overlap_ratio" not in metrics[-1]


def test_samples_carry_per_token_rewards(world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path))
    record = read_jsonl(run_dir / "samples" / "step_1.jsonl")[0]
    assert len(record["tokens"]) == len(record["token_rewards"]) >= 1
    assert record["prompt"].endswith("assistant\n")


def test_report_written_at_end(world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, "run.report=true"))
    assert (run_dir / "report.html").stat().st_size > 10_000


@pytest.mark.parametrize(
    "overrides, teacher, message",
    [
        (["prompts_per_step=50"], True, "prompts_per_step=50 exceeds the 6 prompts"),
        (["data.max_prompt_length=2"], True, "max_prompt_length"),
        (["micro_batch_tokens=8"], True, "micro_batch_tokens=8 is smaller than one sequence"),
        (["objective.advantage=token_reward"], False, "needs a teacher"),
        (["objective.advantage=token_grpo"], True, "sampled-token only"),
        (["objective.loss=topk_kl", "objective.top_k=0"], True, "needs a top-k support"),
    ],
)
def test_startup_checks_fail_in_one_line(world, tmp_path, overrides, teacher, message):
    with pytest.raises(ValueError, match=message) as error:
        distill(distill_config(world, tmp_path, *overrides, teacher=teacher))
    assert "\n" not in str(error.value)


def test_step_0_eval_is_the_student_before_training(world, tmp_path):
    """With eval configured the trainer evaluates before its first step (eval/step_0, logged at step 0: the report's
    'before'); the eval draws from its own generator, so training is the same computation with it or without it."""
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    evals = [f"eval.benchmarks=[{bench}]", "eval.n=1", "eval.max_new_tokens=4", "eval.answer_key=answer"]
    run_dir = distill(distill_config(world, tmp_path / "a", *evals))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 2] and "eval/bench/avg@1" in metrics[0]
    assert (run_dir / "eval" / "step_0" / "results.json").is_file()
    without = distill(distill_config(world, tmp_path / "b", *evals, "run.eval_at_start=false"))
    assert [m["step"] for m in read_jsonl(without / "metrics.jsonl")] == [1, 2, 2]
    assert not (without / "eval" / "step_0").exists()
    a, b = latest_weights(run_dir), latest_weights(without)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same computation replayed: bit-exact
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in latest_checkpoint(run_dir).iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes  # not safetensors' 0600


def test_tokenizer_mismatch_is_caught_before_any_compute(world, tmp_path):
    other = tmp_path / "other"
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    make_tiny_model("qwen3", vocab_size=262, seed=2).save_pretrained(other)
    tokenizer.save_pretrained(other)
    cfg = distill_config(world, tmp_path)
    cfg.teacher.path = str(other)
    cfg.teacher.tokenizer = "same"  # auto would take the cross-vocabulary path (tests/features/test_cross_tokenizer.py)
    with pytest.raises(ValueError, match="<extra>"):
        distill(cfg)


def test_resume_is_bit_identical(world, tmp_path):
    straight = distill(distill_config(world, tmp_path / "a", "run.save_every=2", steps=4))
    distill(distill_config(world, tmp_path / "b", "run.save_every=2", steps=2))
    resumed = distill(distill_config(world, tmp_path / "b", "run.save_every=2", "run.resume=true", steps=4))
    a, b = latest_weights(straight), latest_weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = read_jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["reward_mean"] == read_jsonl(straight / "metrics.jsonl")[-1]["reward_mean"]


def test_deterministic_kernels_run_resume_and_leave_the_process_as_it_was(world, tmp_path, monkeypatch):
    """`run.deterministic`: the run's work (setup included: models load under it) sees torch's deterministic
    algorithms and cuBLAS's fixed workspace; a resume equals the uninterrupted run; afterwards the process is as
    before (a Python API caller's own code is not left in deterministic mode). With nucleus sampling and token GRPO
    (their cumsums; the exact nucleus form serves CUDA only), and empty tensors NaN-filled, as the mode does."""
    import opd.recipes.distill as recipe

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen, real_setup = [], recipe.setup

    def setup(*args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return real_setup(*args, **kwargs)

    monkeypatch.setattr(recipe, "setup", setup)
    options = ("run.deterministic=true", "run.save_every=2", "rollout.top_p=0.9", "objective.advantage=token_grpo")
    straight = distill(distill_config(world, tmp_path / "a", *options, "objective.top_k=0", steps=4))
    distill(distill_config(world, tmp_path / "b", *options, "objective.top_k=0", steps=2))
    resumed = distill(distill_config(world, tmp_path / "b", *options, "objective.top_k=0", "run.resume=true", steps=4))
    assert seen == [(True, ":4096:8")] * 3
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    a, b = latest_weights(straight), latest_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = [without_timing(read_jsonl(run / "metrics.jsonl")[-1]) for run in (straight, resumed)]
    assert last[0] == last[1]


def test_kill_during_checkpoint_keeps_previous_loadable(world, tmp_path, monkeypatch):
    import opd.train.checkpoint as checkpoint

    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if "step_4" in str(path):
            Path(path).write_bytes(b"partial")
            raise KeyboardInterrupt("killed while writing the checkpoint")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        distill(distill_config(world, tmp_path, "run.save_every=2", steps=4))
    run_dir = tmp_path / "run"
    assert latest_checkpoint(run_dir).name == "step_2"
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    resumed = distill(distill_config(world, tmp_path, "run.save_every=2", "run.resume=true", steps=4))
    assert latest_checkpoint(resumed).name == "step_4"


def test_trainer_scores_agree_with_dense_token_rewards(world):
    """The trainer's chunked path (LocalScorer + sparse core) equals SPEC §8's dense `token_rewards`."""
    from opd.objectives import build_candidates, candidate_rewards, gather_candidate_logprobs, token_rewards
    from opd.rollout import SamplingParams, make_generator
    from opd.rollout.batch import build_rollouts
    from opd.teacher.local import LocalScorer

    student = make_tiny_model("qwen3", seed=0)
    teacher = make_tiny_model("qwen3", seed=1)
    tokenizer = make_tiny_tokenizer()
    prompts = [tokenizer("1+1=")["input_ids"], tokenizer("22+3=")["input_ids"]]
    output = make_generator(student, tokenizer).generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=3))
    rollouts = build_rollouts(prompts, output, pad_id=tokenizer.pad_token_id)
    positions = rollouts.response_positions().clamp(max=rollouts.input_ids.shape[1] - 1)
    with torch.no_grad():
        dense_student = student(rollouts.input_ids, attention_mask=rollouts.attention_mask).logits
        dense_teacher = teacher(rollouts.input_ids, attention_mask=rollouts.attention_mask).logits

    def gather(logits):
        return torch.gather(logits, 1, positions[..., None].expand(-1, -1, logits.shape[-1]))

    for strategy in ("only_stu", "union", "union-intersection"):
        dense = token_rewards(
            gather(dense_student),
            gather(dense_teacher),
            rollouts.response_ids,
            rollouts.response_mask,
            top_k=4,
            strategy=strategy,
            weight="student_p",
        )
        s = LocalScorer(student).score(rollouts, top_k=4)
        t = LocalScorer(teacher).score(rollouts, top_k=4, requested_ids=s.topk_ids)
        s_at_t = LocalScorer(student).score(rollouts, top_k=0, requested_ids=t.topk_ids).requested_logprobs
        ids, valid = build_candidates(s.topk_ids, t.topk_ids, rollouts.response_mask, strategy)
        s_lp, t_lp = gather_candidate_logprobs(strategy, s.topk_logprobs, t.requested_logprobs, t.topk_logprobs, s_at_t)
        rewards, _ = candidate_rewards(s_lp, t_lp, valid, strategy=strategy, weight="student_p")
        assert torch.equal(ids[valid], dense.candidate_ids[dense.valid])
        torch.testing.assert_close(rewards, dense.rewards, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------- learning


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 16], ids=["sampled-token", "only_stu-top16"])
def test_opd_moves_the_student_toward_the_teacher(world, tmp_path, top_k):
    before, after = distill_toward_a_trained_teacher(world, tmp_path, f"objective.top_k={top_k}")
    assert after < 0.5 * before, (before, after)


@pytest.mark.parametrize(
    "overrides",
    [
        ["objective.kl_coef=0.1", "objective.kl_type=k1"],
        ["objective.kl_coef=0.1", "objective.entropy_coef=0.01", "objective.top_k=0"],
        ["objective.tis_cap=2.0"],
        ["objective.loss=topk_kl"],
        ["objective.loss=forward_kl"],
        ["objective.loss=jsd", "objective.jsd_beta=0.5"],
        # the strategy's 2K slots carry the advantages while the loss lives on the teacher's K (crashed the metrics)
        ["objective.loss=forward_kl", "objective.strategy=union"],
        ["objective.loss=jsd", "objective.strategy=union-intersection"],
    ],
    ids=lambda o: ",".join(x.split(".", 1)[1] for x in o),
)
def test_optional_terms_and_extension_objectives_run(world, tmp_path, overrides):
    run_dir = distill(distill_config(world, tmp_path, *overrides))
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 2 and last["grad_norm"] is not None and last["grad_norm"] > 0
    if "objective.kl_coef=0.1" in overrides:
        assert "kl_reference" in last
    loss_keys = [k for k in last if k.endswith("_loss")]
    assert loss_keys, last.keys()


def test_teacher_offload_trains_like_a_resident_teacher(world, tmp_path):
    """teacher_offload only changes where the teacher's weights wait between scorings: the same run, bit for bit
    (on CPU the device copy is the host tensor itself; on the GPU the path ran in benchmarks/opd_step.py's offload
    rows)."""
    resident = distill(distill_config(world, tmp_path / "resident"))
    offloaded = distill(distill_config(world, tmp_path / "offloaded", "teacher_offload=true"))
    for key, value in latest_weights(resident).items():
        assert torch.equal(latest_weights(offloaded)[key], value), key
    keys = ("reward_mean", "grad_norm", "overlap_ratio")
    assert [{k: m[k] for k in keys} for m in read_jsonl(offloaded / "metrics.jsonl")] == [
        {k: m[k] for k in keys} for m in read_jsonl(resident / "metrics.jsonl")
    ]


def test_on_device_keeps_one_host_copy_and_copies_nothing_back():
    from opd.models import host_copies, on_device

    teacher = make_tiny_model("qwen3", seed=1).requires_grad_(False)
    values = {k: v.clone() for k, v in teacher.state_dict().items()}
    pairs = host_copies(teacher)
    assert [t.data_ptr() for t, _ in pairs] == [h.data_ptr() for _, h in pairs]  # the module now uses the copies
    for _ in range(2):
        with on_device(teacher, torch.device("cpu")):
            teacher(torch.tensor([[1, 2, 3]]))
        assert [h.data_ptr() for _, h in host_copies(teacher)] == [h.data_ptr() for _, h in pairs]  # made once
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in values.items())
    teacher.to(torch.float64)  # moved by something else: the copies are made again, of the new tensors
    assert all(h.dtype == torch.float64 for _, h in host_copies(teacher))
    with on_device(None, torch.device("cpu")), on_device(teacher, None):  # no-ops
        pass


def test_the_console_line_shows_turns_and_calls_only_for_episodes():
    from opd.recipes.distill import _console_line

    line = _console_line(3, {"reward_mean": -0.25, "episode/turns_mean": 2.0, "episode/tool_calls_mean": 1.5})
    assert line == "step 3 r -0.25 turns 2 calls 1.5"
    assert "turns" not in _console_line(3, {"reward_mean": -0.25})
